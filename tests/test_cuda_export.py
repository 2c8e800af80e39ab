"""A real CUDA step as kineto exported it (torch 2.11.0+cu130 on an H100: `Linear(256, 512) -> relu ->
Linear(512, 10)`, its backward and SGD), converted and written here without a GPU: kernels on their streams,
each kernel's launching op, kernel-to-kernel dataflow arrows, and the step graph's GPU placement."""

from __future__ import annotations

import collections
import gzip
import json
import os
import shutil

import pytest

from hookprof import RunOptions, TraceLevel
from hookprof.step_stats import TensorDescription
from hookprof.tensorboard.graph import step_graph
from hookprof.trace import ChromeTraceWriter
from hookprof.tracing.dataflow import DataEdge
from hookprof.tracing.kineto_trace import KinetoExport

EXPORT = os.path.join(os.path.dirname(__file__), "data", "kineto_cuda_step.json.gz")


@pytest.fixture
def stats(tmp_path):
    path = tmp_path / "step.json"
    with gzip.open(EXPORT, "rb") as source, open(path, "wb") as target:
        shutil.copyfileobj(source, target)
    base = json.loads(path.read_bytes())["baseTimeNanoseconds"]
    return KinetoExport(str(path), base, RunOptions(trace_level=TraceLevel.FULL_TRACE), "2.11.0+cu130").to_stats()


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
