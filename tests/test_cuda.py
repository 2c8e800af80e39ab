"""Real fits on a CUDA device: kernels on their streams, launch and dataflow arrows, GPU memory to the byte, the
step graph's device, the Profiler's accelerator time and advice, and 2-rank DDP read by HTA.

Every test here needs a CUDA device and skips without one (CI has none: they run where a GPU is lent).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from tests.conftest import load_trace, op_events

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GAP_SECONDS = 0.02  # the idle gap planted in each step: the host sleeps while the device has nothing queued
MARKER_ELEMENTS = 12288  # 48 KiB of float32, a block size (a multiple of 512) no other tensor of the step has


def _lightning():
    import lightning as L

    class GapModel(L.LightningModule):
        """Two Linear layers on CUDA with a planted idle gap between them."""

        def __init__(self, gap: float = GAP_SECONDS):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(256, 512), torch.nn.Linear(512, 10)
            self.gap = gap
            self.marked: dict[int, int] = {}  # global step -> bytes allocated right after the marker

        def training_step(self, batch, batch_idx):
            x, y = batch
            hidden = torch.relu(self.fc1(x))
            marker = torch.empty(MARKER_ELEMENTS, device=x.device)  # a size nothing else in the step has
            self.marked[self.trainer.global_step + 1] = torch.cuda.memory_allocated()
            del marker
            if self.gap:
                torch.cuda.synchronize()
                time.sleep(self.gap)
            loss = torch.nn.functional.cross_entropy(self.fc2(hidden), y)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return L, GapModel


def _loader():
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(512, 256, generator=g), torch.randint(0, 10, (512,), generator=g))
    return DataLoader(data, batch_size=64)


def _fit(tmp_dir, callbacks, max_steps=4, gap=GAP_SECONDS):
    L, GapModel = _lightning()
    trainer = L.Trainer(max_steps=max_steps, accelerator="gpu", devices=1, callbacks=callbacks,
                        default_root_dir=tmp_dir, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, logger=False)
    model = GapModel(gap)
    trainer.fit(model, _loader())
    return model


def _processes(trace):
    return {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}


def _threads(trace):
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name"}


def test_lightning_kernels_sit_on_their_streams_each_with_its_launch_arrow(tmp_dir):
    from lightning_prof import ProfilerHook

    hook = ProfilerHook(save_steps=2, output_dir=tmp_dir)
    _fit(tmp_dir, [hook])
    assert [os.path.basename(p) for p in hook.saved_paths] == ["timeline-2.json", "timeline-4.json"]
    trace = load_trace(hook.saved_paths[-1])
    processes, threads = _processes(trace), _threads(trace)
    (gpu,) = [pid for pid, name in processes.items() if name == "/device:CUDA:0 Compute"]
    kernels = [e for e in op_events(trace, "Kernel") if e["pid"] == gpu]
    # forward (2 gemms, relu), loss, backward, SGD: dozens of kernels, every one on a named stream thread
    assert len(kernels) >= 10
    assert {threads[(gpu, e["tid"])] for e in kernels} == {f"stream {e['tid']}" for e in kernels}
    assert any("gemm" in e["name"].lower() or "sm90" in e["name"] for e in kernels)
    launches = {e["args"]["correlation"]: e for e in op_events(trace, "Runtime")}
    flows = [e for e in trace["traceEvents"] if e["ph"] in "st" and e["name"] == "launch"]
    starts = {e["id"]: e for e in flows if e["ph"] == "s"}
    ends = {e["id"]: e for e in flows if e["ph"] == "t"}
    for kernel in kernels:
        correlation = kernel["args"]["correlation"]
        assert correlation in launches, kernel["name"]  # the cudaLaunchKernel that queued it
        assert correlation in ends and ends[correlation]["pid"] == gpu and ends[correlation]["tid"] == kernel["tid"]
        assert starts[correlation]["pid"] != gpu  # from the host thread that launched it
        assert ends[correlation]["ts"] >= starts[correlation]["ts"]  # a kernel runs after its launch


def test_the_profile_tab_counts_each_kernels_time_under_its_launching_op_and_the_step(tmp_dir):
    """xprof's converters on a real CUDA fit's profile run: Framework Op Stats' device time per launching op
    equals the timeline's kernels', and the overview's step has device compute time from them."""
    from lightning_prof import ProfilerHook
    from tests.test_xprof import profile_files, raw_to_tool_data, rows, tool

    if raw_to_tool_data is None:
        pytest.skip("xprof is not installed")
    hook = ProfilerHook(save_steps=2, output_dir=tmp_dir)
    _fit(tmp_dir, [hook])
    pb = profile_files(tmp_dir)[-1]
    trace = load_trace(hook.saved_paths[-1])
    ops = {e["args"]["name"]: f"{e['args']['scope']}/{e['name']}" if e["args"].get("scope") else e["name"]
           for e in op_events(trace)}
    kernels = op_events(trace, "Kernel")
    by_op = collections.Counter()
    for kernel in kernels:
        if kernel["args"].get("launched_by") in ops:
            by_op[ops[kernel["args"]["launched_by"]]] += kernel["dur"]
    device = {row["operation"]: row["total_time"] for row in rows(tool(pb, "framework_op_stats")[0])
              if row["host_or_device"] == "Device" and row["type"] != "IDLE"}
    assert device.keys() == by_op.keys() and len(by_op) >= 5
    assert all(device[op] == pytest.approx(by_op[op], abs=1e-3) for op in by_op)
    (graph,) = [t for t in tool(pb, "overview_page") if any(c["id"] == "stepTimeMs" for c in t.get("cols", ()))]
    (row,) = rows(graph)
    assert row["stepnum"] == "4"
    assert 0 < row["deviceComputeTimeMs"] <= sum(k["dur"] for k in kernels) / 1000 + 1e-6  # streams may overlap


def test_lightning_dataflow_arrows_join_the_kernels_of_a_producer_and_its_consumer(tmp_dir):
    from lightning_prof import ProfilerHook

    hook = ProfilerHook(save_steps=4, output_dir=tmp_dir)
    _fit(tmp_dir, [hook])
    trace = load_trace(hook.saved_paths[-1])
    gpu = next(pid for pid, name in _processes(trace).items() if name == "/device:CUDA:0 Compute")
    flows = [e for e in trace["traceEvents"] if e["ph"] in "st" and e["cat"] == "DataFlow" and e["name"] != "launch"]
    on_gpu = collections.Counter(e["ph"] for e in flows if e["pid"] == gpu)
    # fc1's output -> relu -> fc2 (and their gradients back): tensors that one kernel writes and another reads
    assert on_gpu["s"] >= 4 and on_gpu["s"] == on_gpu["t"]
    kernels = {(e["tid"], e["ts"]): e for e in op_events(trace, "Kernel") if e["pid"] == gpu}
    by_id = collections.defaultdict(dict)
    for e in flows:
        by_id[e["id"]][e["ph"]] = e
    pairs = [p for p in by_id.values() if p.get("s", {}).get("pid") == gpu and "t" in p]
    assert pairs
    for pair in pairs:
        start, end = pair["s"], pair["t"]
        assert end["pid"] == gpu and end["ts"] >= start["ts"]  # the consumer runs after its producer ends
        assert (end["tid"], end["ts"]) in kernels  # each arrow lands on the start of a kernel


def test_cuda_steps_borrow_the_tree_walks_arrows_and_memory_across_the_backwards_thread(tmp_dir):
    """A CUDA step that borrows its tensor identities from the step before it (its events converted again
    with that step's identities) gets the arrows, GPU allocations and outputs its own event tree gives, though
    autograd ran its backward on a thread of its own."""
    import lightning as L

    from hookprof.trace import format as fmt
    from hookprof.tracing import HOST_DEVICE
    from hookprof.tracing.step_identity import DATAFLOW_MISSING
    from tests.lightning_models import loader
    from tests.test_step_identity import AdamModel, BothPaths, edges, memory, outputs

    paths = BothPaths()
    L.Trainer(max_steps=5, callbacks=[paths], logger=False, enable_checkpointing=False, default_root_dir=tmp_dir,
              enable_progress_bar=False, enable_model_summary=False, accelerator="gpu", devices=1).fit(
        AdamModel(), loader())
    first, *later = paths.steps
    assert "ops differ" in first[2].metadata[DATAFLOW_MISSING]  # (Adam's state made at the first step)
    assert len(later) == 3
    for step, walked, borrowed in later:
        host = walked.device(HOST_DEVICE).node_stats
        backward = {n.thread_id for n in host if n.op.startswith("autograd::engine::evaluate_function")}
        forward = {n.thread_id for n in host if n.category == fmt.CAT_MODULE}
        assert backward and forward and not backward & forward  # (the backward's thread is autograd's own)
        assert DATAFLOW_MISSING not in borrowed.metadata, (step, borrowed.metadata)
        assert len(walked.edges) > 40
        assert any(a.device == "/device:CUDA:0" for a in walked.allocations)
        assert any(e.producer.thread_id in forward and e.consumer.thread_id in backward for e in walked.edges)
        assert edges(borrowed) == edges(walked), step
        # a CUDA step's event tree leaves out the allocator's events after the step's last op ends (the loss's
        # free, as the trace stops), which kineto's export, and so a borrowing step, has: the rest is equal
        end = max(n.start_ns + n.duration_ns for n in host if n.category != fmt.CAT_RUNTIME)
        assert _until(memory(borrowed), end) == _until(memory(walked), end) == _until(memory(walked), None), step
        assert outputs(borrowed) == outputs(walked), step


def _until(records, end):
    """A step's memory records (`tests.test_step_identity.memory`) as they were when the step's last op ended at
    `end` ns (None: all of them): the frees after it not yet made, the allocator's samples after it not yet
    taken."""
    if end is None:
        return records
    allocations, samples = records
    return ([(made, None if freed is None or freed > end else freed, *rest) for made, freed, *rest in allocations],
            [sample for sample in samples if sample[1] <= end])


def test_a_cuda_fits_traced_steps_borrow_their_identities(tmp_dir):
    """Under ProfilerHook's defaults, a CUDA fit's traced steps after the first borrow its tensor identities (no
    tree walk while training) and keep their arrows and GPU memory."""
    from hookprof.run_options import RunOptions, TraceLevel
    from hookprof.tracing.kineto_trace import BORROW
    from hookprof.tracing.step_identity import DATAFLOW_MISSING
    from tests.test_step_identity import FitExports

    fit = FitExports(RunOptions(trace_level=TraceLevel.FULL_TRACE, record_dataflow=True, record_memory=True))
    _fit(tmp_dir, [fit], max_steps=6, gap=0)
    modes = [(exported.identity[0], DATAFLOW_MISSING in stats.metadata) for exported, stats in fit.steps]
    assert modes[-3:] == [(BORROW, False)] * 3, modes  # (the first steps' ops may differ: Lightning's first batch)
    for exported, stats in fit.steps[-3:]:
        assert exported.tree is None  # (not walked)
        assert len(stats.edges) > 10 and any(a.device == "/device:CUDA:0" for a in stats.allocations)


def test_lightning_gpu_memory_equals_torchs_allocator_to_the_byte(tmp_dir):
    from lightning_prof import ProfilerHook

    hook = ProfilerHook(save_steps=2, output_dir=tmp_dir, show_memory=True)
    model = _fit(tmp_dir, [hook])
    assert hook.saved_paths  # the loop below reads each
    for path in hook.saved_paths:
        trace = load_trace(path)
        step = trace["metadata"]["step"]
        (tensors,) = [pid for pid, name in _processes(trace).items() if name == "/device:CUDA:0 Tensors"]
        objects = [e for e in trace["traceEvents"] if e["pid"] == tensors and e["ph"] in "NOD"]
        phases = collections.Counter(e["ph"] for e in objects)
        assert phases["N"] == phases["O"] >= 10  # activations, gradients, the loss: GPU tensors of the step
        (marker,) = [e for e in objects if e["ph"] == "O" and e["args"]["snapshot"]["bytes"] == 4 * MARKER_ELEMENTS]
        counters = {e["ts"]: e["args"] for e in trace["traceEvents"] if e["ph"] == "C" and e["pid"] == tensors}
        # the allocator's bytes in use as the marker was made: torch.cuda.memory_allocated() just after, exactly
        at_marker = [c["allocated"] for ts, c in counters.items() if abs(ts - marker["ts"]) <= 1.0]
        assert model.marked[step] in at_marker, (model.marked[step], at_marker)
        peak = trace["metadata"]["peak_allocated_bytes"]["/device:CUDA:0"]
        assert peak == max(c["allocated"] for c in counters.values()) >= model.marked[step]


def test_keras_torch_backend_on_cuda_traces_kernels_and_gpu_memory(tmp_dir):
    import keras
    import numpy as np

    from keras_prof import ProfilerHook

    if keras.backend.backend() != "torch":
        pytest.skip("the Keras torch backend")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, activation="relu", name="fc1"),
                              keras.layers.Dense(10, name="fc2")])
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((512, 256)).astype("float32"), rng.integers(0, 10, 512)
    hook = ProfilerHook(save_steps=4, output_dir=tmp_dir, show_memory=True)
    model.fit(x, y, batch_size=64, epochs=1, callbacks=[hook], verbose=0)
    assert [os.path.basename(p) for p in hook.saved_paths] == ["timeline-4.json", "timeline-8.json"]
    trace = load_trace(hook.saved_paths[-1])
    processes = set(_processes(trace).values())
    assert {"/device:CUDA:0 Compute", "/device:CUDA:0 Tensors"} <= processes
    assert len(op_events(trace, "Kernel")) >= 10
    # Keras' Dense runs matmul then add: the gemm under its layer's scope, its kernels launched by it
    gemms = [e for e in op_events(trace) if e["name"] == "aten::mm" and e["args"].get("phase") == "forward"]
    assert {e["args"]["scope"].rsplit("/", 1)[-1] for e in gemms} == {"fc1", "fc2"}
    launchers = {e["args"].get("launched_by") for e in op_events(trace, "Kernel")}
    assert {e["args"]["name"] for e in gemms} <= launchers


def test_step_graph_runs_on_gpu_0_in_tensorboard(tmp_dir):
    from tensorboard.backend.event_processing import event_accumulator

    from lightning_prof import ProfilerHook

    hook = ProfilerHook(save_steps=2, output_dir=tmp_dir)
    _fit(tmp_dir, [hook])
    acc = event_accumulator.EventAccumulator(tmp_dir, size_guidance={event_accumulator.RUN_METADATA: 0})
    acc.Reload()
    assert set(acc.Tags()["run_metadata"]) == {"step_2", "step_4"}
    devices = [d.device for d in acc.RunMetadata("step_4").step_stats.dev_stats]
    assert "/job:localhost/replica:0/task:0/device:GPU:0" in devices
    graph = acc.Graph()
    assert collections.Counter(n.device.rsplit("/", 1)[-1] for n in graph.node)["device:GPU:0"] >= 10


def test_profiler_accelerator_time_and_the_planted_idle_gap(tmp_dir):
    import hookprof
    from lightning_prof import ProfilerHook

    profiler = hookprof.Profiler()
    hook = ProfilerHook(save_steps=1, output_dir=tmp_dir, profiler=profiler, tensorboard=False)
    _fit(tmp_dir, [hook], max_steps=5)
    ops = profiler.profile_operations({"select": ["micros", "accelerator_micros", "cpu_micros"],
                                       "order_by": "accelerator_micros"})
    accelerator = {row.name: row.self_["accelerator_micros"] for row in ops.rows}
    # the gemms and their gradients ran on the device, attributed to the ops that launched them
    assert accelerator["aten::addmm"] > 0 and accelerator["aten::mm"] > 0
    assert accelerator.get("aten::empty", 0) == 0
    advice = profiler.advise()
    findings = advice["AcceleratorUtilizationChecker"]["findings"]
    (finding,) = [f for f in findings if f["evidence"]["device"] == "/device:CUDA:0"]
    assert finding["evidence"]["busy_share"] < 0.5
    # the planted gap is the largest between ops, and about as long as the sleep
    largest = max(length for _, length in finding["evidence"]["largest_gaps_us"])
    assert largest >= 0.8 * GAP_SECONDS * 1e6


DDP_SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {repo!r})
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy
    from lightning_prof import ProfilerHook
    from tests.test_cuda import _lightning, _loader
    out = sys.argv[1]
    L_, GapModel = _lightning()
    # two ranks on the one GPU: two "nodes" of one device each, launched by the test (NCCL refuses two ranks
    # on one device, so gloo carries the collectives)
    trainer = L.Trainer(accelerator="gpu", devices=1, num_nodes=2, max_steps=4,
                        strategy=DDPStrategy(process_group_backend="gloo"),
                        callbacks=[ProfilerHook(save_steps=2, output_dir=out)], default_root_dir=out,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(GapModel(0.0), _loader())
""")


def test_ddp_two_ranks_on_the_gpu_write_per_rank_files_hta_reads(tmp_path):
    from hta import trace_analysis as hta

    script = tmp_path / "fit.py"
    script.write_text(DDP_SCRIPT.format(repo=REPO))
    out = tmp_path / "out"
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT="29571", WORLD_SIZE="2", LOCAL_RANK="0")
    procs = [subprocess.Popen([sys.executable, str(script), str(out)], env=dict(base, NODE_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(tmp_path))
             for r in (0, 1)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    names = sorted(n for n in os.listdir(out) if n.startswith("timeline-"))
    assert names == ["timeline-2-rank0.json", "timeline-2-rank1.json", "timeline-4-rank0.json",
                     "timeline-4-rank1.json"]
    hta_dir = tmp_path / "hta"
    hta_dir.mkdir()
    for rank in (0, 1):
        trace = load_trace(str(out / f"timeline-4-rank{rank}.json"))
        assert trace["distributedInfo"]["rank"] == rank and trace["distributedInfo"]["world_size"] == 2
        assert op_events(trace, "Kernel")
        os.link(out / f"timeline-4-rank{rank}.json", hta_dir / f"rank-{rank}.json")
    analysis = hta.TraceAnalysis(trace_dir=str(hta_dir))
    assert sorted(analysis.t.get_ranks()) == [0, 1]
    breakdown = analysis.get_temporal_breakdown(visualize=False)
    assert list(breakdown["rank"]) == [0, 1]
    assert (breakdown["compute_time(us)"] > 0).all()


def test_ddp_under_nccl_agrees_on_a_gloo_group_of_the_fits_own(tmp_path):
    """NCCL runs the default group (as with a GPU per rank; on this one GPU the strategy's own collectives go
    through gloo, tests/ddp_fit.py's `DefaultGroupNotGloo`): a stop one rank asks for stops both, agreed on a
    CPU gloo group that the fit makes and destroys."""
    from tests.test_ddp_agree import assert_agreed_on_a_gloo_group_of_the_fits_own

    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT="29573", WORLD_SIZE="2", LOCAL_RANK="0")
    procs = [subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "ddp_fit.py"), "agree_on_nccl",
                               str(tmp_path)], env=dict(base, NODE_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, cwd=str(tmp_path))
             for r in (0, 1)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert_agreed_on_a_gloo_group_of_the_fits_own(ranks, "nccl")
