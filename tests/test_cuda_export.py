"""A real CUDA step as kineto exported it (torch 2.11.0+cu130 on an H100: `Linear(256, 512) -> relu ->
Linear(512, 10)`, its backward and SGD), converted and written here without a GPU: kernels on their streams,
each kernel's launching op, kernel-to-kernel dataflow arrows, the step graph's GPU placement, and the Profile
tab's GPU plane as xprof's own converters read it."""

from __future__ import annotations

import collections
import gzip
import json
import os
import shutil

import pytest

from hookprof import RunOptions, TraceLevel
from hookprof.step_stats import NodeExecStats, StepStats, TensorDescription
from hookprof.tensorboard.graph import step_graph
from hookprof.trace import ChromeTraceWriter, xplane
from hookprof.trace import format as fmt
from hookprof.trace.reader import load_trace
from hookprof.tracing import xspace
from hookprof.tracing.coordinator import PhasedExport, StepPhases
from hookprof.tracing.dataflow import DataEdge
from hookprof.tracing.kineto_trace import KinetoExport
from tests.test_xprof import needs_xprof, rows, tool

EXPORT = os.path.join(os.path.dirname(__file__), "data", "kineto_cuda_step.json.gz")


def exported(tmp_path):
    path = tmp_path / "step.json"
    with gzip.open(EXPORT, "rb") as source, open(path, "wb") as target:
        shutil.copyfileobj(source, target)
    base = json.loads(path.read_bytes())["baseTimeNanoseconds"]
    return KinetoExport(str(path), base, RunOptions(trace_level=TraceLevel.FULL_TRACE), "2.11.0+cu130")


@pytest.fixture
def stats(tmp_path):
    return exported(tmp_path).to_stats()


STEP = 5


@pytest.fixture
def phased(tmp_path):
    """The step as the render worker converts it (`PhasedExport`): kineto's export with the coordinator's step
    phases, a 2 ms data wait before its first op, forward, backward and optimizer where its ops say."""
    export = exported(tmp_path)
    host = export.to_stats().device("/host:CPU").node_stats
    first, last = min(n.start_ns for n in host), max(n.start_ns + n.duration_ns for n in host)
    marks = [("forward", first)] + [(phase, min(n.start_ns for n in host if n.phase == phase))
                                    for phase in ("backward", "optimizer")]
    stats = PhasedExport(export, StepPhases("torch", (first - 2_000_000, first), marks, last)).to_stats()
    stats.step = STEP
    return stats


def raw_events():
    return json.load(gzip.open(EXPORT))["traceEvents"]


def test_every_kernel_sits_on_its_stream_and_names_the_op_that_launched_it(stats):
    raw = raw_events()
    ops_by_id = {e["args"]["External id"]: e["name"] for e in raw if e.get("cat") == "cpu_op"}
    expected = collections.Counter((e["name"], ops_by_id[e["args"]["External id"]]) for e in raw
                                   if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy"))
    gpu = stats.device("/device:CUDA:0")
    kernels = [n for n in gpu.node_stats if n.category == "Kernel"]
    assert len(kernels) == sum(expected.values()) == 23
    nodes = {n.node_name: n for n in stats.all_nodes()}
    launched = collections.Counter((k.op, nodes[k.args["launched_by"]].op) for k in kernels)
    assert launched == expected
    assert {k.args["stream"] for k in kernels} == {7} and gpu.thread_names == {7: "stream 7"}
    assert {k.args["device"] for k in kernels} == {0}
    gemms = {nodes[k.args["launched_by"]].op for k in kernels if "gemm" in k.op.lower()}
    assert gemms == {"aten::addmm", "aten::mm"}


def test_dataflow_between_ops_that_ran_kernels_joins_their_kernels(stats, tmp_path):
    host = stats.device("/host:CPU").node_stats
    addmm = next(n for n in host if n.op == "aten::addmm")
    relu = next(n for n in host if n.op == "aten::relu")  # runs its kernel through aten::clamp_min inside it
    clamp = next(n for n in host if n.op == "aten::clamp_min")
    view = next(n for n in host if n.op == "aten::t")  # a view: no kernel
    tensor = TensorDescription("float32", (64, 512), 131072)
    stats.edges = [DataEdge(addmm, relu, tensor, f"{addmm.node_name}:0"),
                   DataEdge(view, addmm, tensor, f"{view.node_name}:0")]
    path = str(tmp_path / "t.json")
    ChromeTraceWriter(show_dataflow=True).write(stats, path)
    trace = json.load(open(path))
    processes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
                 if e["ph"] == "M" and e["name"] == "process_name"}
    flows = {(e["id"], e["ph"]): e for e in trace["traceEvents"] if e["ph"] in "st" and e["name"] != "launch"}
    assert len(flows) == 4
    first, second = sorted({flow_id for flow_id, _ in flows})
    start, end = flows[(first, "s")], flows[(first, "t")]
    assert processes[start["pid"]] == processes[end["pid"]] == "/device:CUDA:0 Compute"
    kernels = {k.start_ns: k for k in stats.device("/device:CUDA:0").node_stats}
    base = stats.start_ns()
    addmm_kernels = [k for k in kernels.values() if k.args["launched_by"] == addmm.node_name]
    last = max(addmm_kernels, key=lambda k: k.start_ns + k.duration_ns)
    assert start["ts"] == pytest.approx((last.start_ns + last.duration_ns - base) / 1000, abs=0.002)
    (relu_kernel,) = [k for k in kernels.values() if k.args["launched_by"] == clamp.node_name]
    assert end["ts"] == pytest.approx((relu_kernel.start_ns - base) / 1000, abs=0.001)
    assert end["tid"] == relu_kernel.thread_id == 7
    # a producer that ran no kernel keeps the arrow on the host's threads
    assert processes[flows[(second, "s")]["pid"]] == "/host:CPU Compute"


def test_the_step_graph_places_ops_that_ran_kernels_on_gpu_0(stats):
    devices = {node.op: node.device for node in step_graph(stats).node}
    prefix = "/job:localhost/replica:0/task:0/device:"
    for op in ("aten::addmm", "aten::mm", "aten::clamp_min", "aten::relu", "aten::linear", "aten::_foreach_add_"):
        assert devices[op] == prefix + "GPU:0", op
    for op in ("aten::t", "aten::empty", "aten::view"):
        if op in devices:
            assert devices[op] == prefix + "CPU:0", op


def timeline_kernels(stats, tmp_path):
    """The timeline's kernels (memsets too), each with its stream and its launching op's scoped name."""
    path = str(tmp_path / "timeline.json")
    ChromeTraceWriter().write(stats, path)
    events = [e for e in load_trace(path)["traceEvents"] if e.get("ph") == "X"]
    ops = {e["args"]["name"]: f"{e['args']['scope']}/{e['name']}" if e["args"].get("scope") else e["name"]
           for e in events if e["cat"] == "Op"}
    return [(e["name"], e["args"]["stream"], ops[e["args"]["launched_by"]], e["dur"], e["ts"])
            for e in events if e["cat"] == "Kernel"]


def totals(kernels, key):
    """Kernel counts and total microseconds by `key(kernel)`."""
    counts, times = collections.Counter(), collections.Counter()
    for kernel in kernels:
        counts[key(kernel)] += 1
        times[key(kernel)] += kernel[3]
    return counts, times


def test_the_profile_tabs_xspace_has_a_gpu_plane_with_each_kernel_on_its_stream(phased, tmp_path):
    """The GPU plane (tsl's `/device:GPU:0`), as protobuf itself reads and writes it back byte for byte: a line
    per stream, each kernel in the step (`group_id`) with its correlation id and its launching op (`tf_op`)."""
    data = xplane.step_xspace(phased, "host")
    space = xspace.parse_xspace(data)
    assert space.SerializeToString(deterministic=True) == data  # the hand-written wire format
    assert [p.name for p in space.planes] == [xplane.HOST_PLANE, "/device:GPU:0", xplane.TASK_PLANE]
    gpu = space.planes[1]
    names = {entry.key: entry.value.name for entry in gpu.event_metadata}
    stat_names = {entry.key: entry.value.name for entry in gpu.stat_metadata}

    def stat_values(event):
        return {stat_names[s.metadata_id]: stat_names[s.ref_value] if s.WhichOneof("value") == "ref_value"
                else s.int64_value for s in event.stats}

    lines = {line.name: line for line in gpu.lines}
    assert set(lines) == {"Stream #7", xplane.STEP_LINE}
    kernels = timeline_kernels(phased, tmp_path)
    written = [(names[e.metadata_id], stat_values(e)) for e in lines["Stream #7"].events]
    assert [name for name, _ in written] == [k[0] for k in sorted(kernels, key=lambda k: k[4])]
    assert collections.Counter((name, values[xplane.TF_OP]) for name, values in written) == \
        collections.Counter((k[0], k[2]) for k in kernels)
    assert {values[xplane.GROUP_ID] for _, values in written} == {STEP}
    correlations = {k.args["correlation"] for k in phased.device("/device:CUDA:0").node_stats}
    assert {values[xplane.CORRELATION_ID] for _, values in written} == correlations and len(correlations) == 23
    details = [values.get(xplane.KERNEL_DETAILS) for name, values in written]
    assert sum(d is not None for d in details) == 22  # every kernel but the memset
    (step,) = lines[xplane.STEP_LINE].events
    assert names[step.metadata_id] == f"ProfilerStep#{STEP}" and stat_values(step)[xplane.GROUP_ID] == STEP
    assert {stat_names[s.metadata_id]: stat_values(gpu).get(stat_names[s.metadata_id]) for s in gpu.stats} == {
        "gpu_device_name": "NVIDIA H100 80GB HBM3", "core_count": 132, "memory_size": 85017493504,
        "compute_cap_major": 9, "compute_cap_minor": 0, "device_vendor": "Nvidia"}  # kineto's deviceProperties


@needs_xprof
def test_xprof_attributes_each_kernels_time_to_its_stream_its_launching_op_and_the_step(phased, tmp_path):
    """xprof's own converters on the real H100 step: the trace viewer's GPU stream track, Framework Op Stats'
    and Op Profile's device time per launching op, Kernel Stats per kernel and op, and the overview's step with
    its device compute time, each equal to the timeline's."""
    run = tmp_path / "plugins" / "profile" / f"step_{STEP}"
    run.mkdir(parents=True)
    pb = str(run / "host.xplane.pb")
    with open(pb, "wb") as f:
        f.write(xplane.step_xspace(phased, "host"))
    kernels = timeline_kernels(phased, tmp_path)

    viewer = tool(pb, "trace_viewer")["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in viewer if e.get("ph") == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in viewer
               if e.get("ph") == "M" and e["name"] == "thread_name"}
    shown = [(e["name"], int(threads[(e["pid"], e["tid"])].removeprefix("Stream #")), e["args"]["tf_op"], e["dur"])
             for e in viewer if e.get("ph") == "X" and processes[e["pid"]] == "/device:GPU:0"
             and threads[(e["pid"], e["tid"])].startswith("Stream #")]
    counts, times = totals(kernels, lambda k: (k[1], k[2]))  # per stream and launching op
    shown_counts, shown_times = totals(shown, lambda k: (k[1], k[2]))
    assert shown_counts == counts and shown_times.keys() == times.keys()
    assert all(shown_times[key] == pytest.approx(times[key], abs=1e-3) for key in times)

    _, by_op = totals(kernels, lambda k: k[2])
    device = {row["operation"]: row for row in rows(tool(pb, "framework_op_stats")[0])
              if row["host_or_device"] == "Device" and row["type"] != "IDLE"}
    assert device.keys() == by_op.keys()
    assert all(device[op]["total_time"] == pytest.approx(by_op[op], abs=1e-3) for op in by_op)
    assert {row["eager"] for row in device.values()} == {"Eager"}

    profile = tool(pb, "op_profile")["byProgramExcludeIdle"]
    leaves = [leaf for program in profile["children"] for category in program["children"]
              for leaf in category["children"]]
    profiled = collections.Counter()
    for leaf in leaves:  # xprof names a device op "<launching op>/<kernel>"
        profiled[next(op for op in by_op if leaf["name"].startswith(op + "/"))] += leaf["metrics"]["rawTime"] / 1e6
    assert profiled.keys() == by_op.keys()
    assert all(profiled[op] == pytest.approx(by_op[op], abs=1e-3) for op in by_op)

    stats = rows(tool(pb, "kernel_stats"))  # a row per kernel, launching op and launch configuration
    launched, launched_times = totals([k for k in kernels if not k[0].startswith("Memset")], lambda k: (k[0], k[2]))
    listed, listed_times = collections.Counter(), collections.Counter()
    for row in stats:
        listed[(row["kernel_name"], row["op_name"])] += int(row["occurrences"])
        listed_times[(row["kernel_name"], row["op_name"])] += row["total_duration_us"]
    assert listed == launched and sum(launched.values()) == 22  # every kernel (a memset is none)
    assert all(listed_times[key] == pytest.approx(launched_times[key], abs=1e-3) for key in launched)
    assert all(row["registers_per_thread"] > 0 and row["grid_dim"] and row["block_dim"] for row in stats)

    spans = {n.op: n for n in phased.device("/host:CPU").node_stats if n.category == "Span"}
    wait, train = spans["data_wait"], spans["train_step"]
    environment = [t["p"] for t in tool(pb, "overview_page") if "device_type" in t.get("p", {})]
    assert environment == [{**environment[0], "device_type": "Nvidia GPU (Hopper)"}]  # kineto's H100, sm_90
    for page in ("overview_page", "input_pipeline_analyzer"):
        (graph,) = [t for t in tool(pb, page) if any(c["id"] == "stepTimeMs" for c in t.get("cols", ()))]
        (row,) = rows(graph)
        assert row["stepnum"] == str(STEP)
        # xprof splits a GPU step by its device's events alone: the kernels' time is device compute (one
        # stream: nothing overlaps), the host's (its data wait, its ops) all others
        assert row["deviceComputeTimeMs"] == pytest.approx(sum(k[3] for k in kernels) / 1000, abs=1e-6)
        assert row["stepTimeMs"] == pytest.approx((train.start_ns + train.duration_ns - wait.start_ns) / 1e6,
                                                  abs=1e-6)
        assert row["otherTimeMs"] == pytest.approx(row["stepTimeMs"] - row["deviceComputeTimeMs"], abs=1e-6)


def test_a_memcpy_is_named_as_xprof_tells_its_direction_and_shown_as_kineto_names_it():
    """xprof classes a device copy by its event's name (`MemcpyHToD...`, any case) and counts its bytes from
    `memcpy_details`; the event's display name, which the trace viewer shows, stays kineto's."""
    stats = StepStats(step=0)
    stats.device("/host:CPU").node_stats.append(NodeExecStats("fc/aten::copy_", "aten::copy_", 1000, 5000, 1,
                                                               scope="fc"))
    stats.device("/device:CUDA:1").node_stats.append(NodeExecStats(
        "Memcpy HtoD (Pageable -> Device)", "Memcpy HtoD (Pageable -> Device)", 3000, 1000, 9, category="Kernel",
        args={"correlation": 0, "kind": "gpu_memcpy", "stream": 9, "device": 1, "bytes": 4096,
              "launched_by": "fc/aten::copy_"}))
    data = xplane.step_xspace(stats, "host")
    space = xspace.parse_xspace(data)
    assert space.SerializeToString(deterministic=True) == data  # display names and zeros (group 0) included
    (gpu,) = [p for p in space.planes if p.name == "/device:GPU:1"]
    assert len({plane.id for plane in space.planes}) == len(space.planes)  # GPU:1's id is not the host's
    assert [line.name for line in gpu.lines] == ["Stream #9", xplane.STEP_LINE]
    (copy,) = gpu.lines[0].events
    metadata = {entry.key: entry.value for entry in gpu.event_metadata}[copy.metadata_id]
    assert (metadata.name, metadata.display_name) == ("MemcpyHtoD (Pageable -> Device)",
                                                      "Memcpy HtoD (Pageable -> Device)")
    stat_names = {entry.key: entry.value.name for entry in gpu.stat_metadata}
    values = {stat_names[s.metadata_id]: stat_names.get(s.ref_value) if s.WhichOneof("value") == "ref_value"
              else s.int64_value for s in copy.stats}
    assert values == {xplane.GROUP_ID: 0, xplane.CORRELATION_ID: 0, xplane.TF_OP: "fc/aten::copy_",
                      xplane.IS_EAGER: 1, xplane.MEMCPY_DETAILS: "num_bytes:4096"}
    (step,) = gpu.lines[1].events  # no phases: the step on the device is its kernels' span
    assert (step.offset_ps, step.duration_ps) == (copy.offset_ps, copy.duration_ps) == (2_000_000, 1_000_000)


def test_a_kernel_and_an_op_without_external_ids_are_not_joined():
    """kineto links a kernel to the op that launched it by the op's External id: an op that has none is never a
    kernel's launcher, however many such kernels there are."""
    from hookprof.tracing.kineto_trace import _convert
    from tests.test_step_identity import kineto_events

    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::relu", "ts": 0, "dur": 5, "tid": 1, "args": {}},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mul", "ts": 6, "dur": 5, "tid": 1,
               "args": {"External id": 7}},
              {"ph": "X", "cat": "kernel", "name": "relu_kernel", "ts": 2, "dur": 1, "tid": 7,
               "args": {"device": 0, "stream": 7, "correlation": 3}},
              {"ph": "X", "cat": "kernel", "name": "mul_kernel", "ts": 8, "dur": 1, "tid": 7,
               "args": {"device": 0, "stream": 7, "correlation": 4, "External id": 7}}]
    stats = StepStats()
    _convert(kineto_events(events), 0, stats, True)
    kernels = {n.op: n.args.get(fmt.ARG_LAUNCHED_BY) for n in stats.device("/device:CUDA:0").node_stats}
    assert kernels == {"relu_kernel": None, "mul_kernel": "aten::mul"}
