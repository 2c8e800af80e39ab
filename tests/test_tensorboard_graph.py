"""TensorBoard's Graphs dashboard: the traced step's graph and step_N run metadata, read back with
TensorBoard's own EventAccumulator, and the same step built node by node through TensorBoard's protos."""

import contextvars
import logging
import os
import types

import hypothesis
import pytest
from hypothesis import strategies as st
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.compat.proto.attr_value_pb2 import AttrValue
from tensorboard.compat.proto.config_pb2 import RunMetadata
from tensorboard.compat.proto.graph_pb2 import GraphDef
from tensorboard.compat.proto.node_def_pb2 import NodeDef
from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto

from hookprof.step_stats import DeviceStepStats, NodeExecStats, StepStats, TensorAllocation, TensorDescription
from hookprof.tensorboard.events import acquire, masked_crc32c, release, use_for
from hookprof.tensorboard.graph import graph_and_run_metadata, graph_name, node_graph_name, tf_device
from hookprof.tracing.dataflow import DataEdge
from lightning_prof import HookCallback, ProfilerHook
from tests.conftest import RecordingHook
from tests.lightning_models import HeldAtTheEnd, TinyModel, loader, trainer

# TensorFlow's DataType numbers (tensorflow/core/framework/types.proto), independent of graph.py's table
TF_DTYPES = {"float32": 1, "float64": 2, "int32": 3, "uint8": 4, "int16": 5, "int8": 6, "complex64": 8, "int64": 9,
             "bool": 10, "bfloat16": 14, "uint16": 17, "complex128": 18, "float16": 19, "uint32": 22, "uint64": 23}


def _shape_proto(shape):
    return TensorShapeProto(dim=[TensorShapeProto.Dim(size=int(d)) for d in shape])


def protos_of(stats: StepStats) -> tuple[GraphDef, RunMetadata]:
    """The step's GraphDef and RunMetadata built message by message with TensorBoard's protos (what graph.py
    wrote before it wrote the wire format itself): what its bytes must decode to."""
    inputs = {}
    for edge in stats.edges:
        slot = edge.name.rsplit(":", 1)[-1]
        source = node_graph_name(edge.producer)
        inputs.setdefault(id(edge.consumer), []).append(source if slot == "0" else f"{source}:{slot}")
    allocated = {}
    for alloc in stats.allocations:
        if alloc.producer is not None:
            allocated[id(alloc.producer)] = allocated.get(id(alloc.producer), 0) + alloc.nbytes
    graph, meta = GraphDef(), RunMetadata()
    for dev in stats.dev_stats:
        device = tf_device(dev.device)
        dev_proto = meta.step_stats.dev_stats.add(device=device)
        for node in dev.node_stats:
            if node.category != "Op":
                continue
            attrs = {"phase": AttrValue(s=node.phase.encode())}
            if node.outputs:
                attrs["_output_shapes"] = AttrValue(list=AttrValue.ListValue(
                    shape=[_shape_proto(t.shape) for t in node.outputs]))
            graph.node.append(NodeDef(name=node_graph_name(node), op=node.op, device=device,
                                      input=inputs.get(id(node), []), attr=attrs))
            micros = max(1, node.duration_ns // 1000)
            proto = dev_proto.node_stats.add(
                node_name=node_graph_name(node), all_start_micros=node.start_ns // 1000, op_start_rel_micros=0,
                op_end_rel_micros=micros, all_end_rel_micros=micros, timeline_label=node.op,
                thread_id=node.thread_id)
            if id(node) in allocated:
                proto.memory.add(allocator_name=device, total_bytes=allocated[id(node)],
                                 peak_bytes=allocated[id(node)])
            for slot, tensor in enumerate(node.outputs or ()):
                description = proto.output.add(slot=slot).tensor_description
                description.dtype = TF_DTYPES.get(tensor.dtype, 0)
                description.shape.CopyFrom(_shape_proto(tensor.shape))
                description.allocation_description.requested_bytes = tensor.nbytes or 0
                description.allocation_description.allocator_name = device
    return graph, meta


def test_graph_and_step_run_metadata_land_beside_the_scalars(tmp_dir):
    hook = ProfilerHook(save_steps=2, show_memory=True)  # default dir: the logger's run dir
    t = trainer(tmp_dir, [hook], 4)
    t.fit(TinyModel(), loader())
    acc = EventAccumulator(t.log_dir, size_guidance={"run_metadata": 0, "scalars": 0})
    acc.Reload()
    tags = acc.Tags()
    assert sorted(tags["run_metadata"]) == ["step_2", "step_4"]
    assert "train_loss" in tags["scalars"]  # Lightning's scalars: the same run directory
    assert tags["graph"]

    graph = acc.Graph()
    nodes = {n.name: n for n in graph.node}
    addmm, relu = graph_name("TinyModel/fc1/aten::addmm"), graph_name("TinyModel/aten::relu")
    assert addmm == "TinyModel/fc1/aten.addmm" and nodes[addmm].op == "aten::addmm"
    assert addmm in list(nodes[relu].input)  # the dataflow edge, as a graph input
    assert [d.size for d in nodes[addmm].attr["_output_shapes"].list.shape[0].dim] == [8, 16]
    for node in nodes.values():  # every input names a node of the graph
        for source in node.input:
            assert source.split(":")[0] in nodes

    # ops outside every module are grouped under their phase: no op sits alone at the top of the graph
    assert {name.split("/")[0] for name in nodes} == {"TinyModel", "forward", "backward", "optimizer"}
    assert nodes["backward/MseLossBackward0"].op == "MseLossBackward0"  # autograd's node, outside the modules

    meta = acc.RunMetadata("step_4")
    # TensorBoard's frontend colours by compute time and memory only devices named `.../device:<type>:<n>`
    tf_cpu = "/job:localhost/replica:0/task:0/device:CPU:0"
    assert [dev.device for dev in meta.step_stats.dev_stats] == [tf_cpu]
    assert {n.device for n in nodes.values()} == {tf_cpu}  # (tests/test_tensorboard_dashboard.py: its colours)
    stats = [s for dev in meta.step_stats.dev_stats for s in dev.node_stats]
    assert {s.node_name for s in stats} == set(nodes)
    assert all(s.all_end_rel_micros > 0 for s in stats)
    addmm_stats = next(s for s in stats if s.node_name == addmm)
    assert addmm_stats.output[0].tensor_description.allocation_description.requested_bytes == 8 * 16 * 4
    assert any(m.total_bytes > 0 for s in stats for m in s.memory)
    assert os.path.dirname(hook.saved_paths[0]) == t.log_dir


def test_a_run_gets_its_step_graph_once_while_it_stays_the_same(tmp_dir, caplog):
    """Each traced step's run metadata, and the graph only when it changes: TensorBoard keeps one graph a run
    and warns, at every load, for each graph event after the first (as TF1: `add_graph` once, then
    `add_run_metadata` each step)."""
    from tensorboard.compat.proto.event_pb2 import Event

    from hookprof.hooks.capture import CapturePipeline, Job, Rendered
    from hookprof.trace.writer import ChromeTraceWriter

    t = trainer(tmp_dir, [ProfilerHook(save_steps=1)], 4)
    t.fit(TinyModel(), loader())
    acc = EventAccumulator(t.log_dir, size_guidance={"run_metadata": 0})
    with caplog.at_level(logging.WARNING, logger="tensorboard"):
        acc.Reload()
    assert sorted(acc.Tags()["run_metadata"]) == ["step_2", "step_3", "step_4"] and acc.Tags()["graph"]
    assert not [r for r in caplog.records if "more than one graph" in r.getMessage()]

    class Stream:  # a run's event stream
        def __init__(self):
            self.events = []

        def add_event(self, event):
            self.events.append(event)

    stream, run = Stream(), os.path.join(tmp_dir, "run")
    use_for(run, stream)  # (a framework's writer as the run's stream)
    pipelines = CapturePipeline(ChromeTraceWriter()), CapturePipeline(ChromeTraceWriter())  # two hooks' on it
    job = Job(1, types.SimpleNamespace(step=1), None, os.path.join(tmp_dir, "t.json"), None, acquire(run), None)
    try:
        for step, digest in enumerate([b"a", b"a", b"b", b"a"]):
            pipelines[step % 2].store(job, Rendered(events=[Event(step=step, graph_def=digest), Event(step=step)],
                                                    graph_digest=digest))
    finally:
        release(run)
    graphs = [e.graph_def for e in stream.events if e.HasField("graph_def")]
    assert graphs == [b"a", b"b", b"a"] and len(stream.events) == 7  # a changed graph is written again


def test_hooks_that_share_a_run_write_its_step_graph_once(tmp_dir, caplog):
    """Two ProfilerHooks writing into Lightning's run directory share its event stream (the logger's file), and
    the stream keeps the last graph written: the run's graph is written once, not once a hook."""
    hooks = [ProfilerHook(save_steps=2), ProfilerHook(save_steps=3, name="other")]
    t = trainer(tmp_dir, hooks, 6)
    t.fit(TinyModel(), loader())
    events = [e for name in os.listdir(t.log_dir) if name.startswith("events.out.tfevents.")
              for e in EventFileLoader(os.path.join(t.log_dir, name)).Load()]
    assert sum(e.HasField("graph_def") for e in events) == 1
    acc = EventAccumulator(t.log_dir, size_guidance={"run_metadata": 0})
    with caplog.at_level(logging.WARNING, logger="tensorboard"):
        acc.Reload()
    assert {"step_2", "step_3", "step_4", "step_6"} == set(acc.Tags()["run_metadata"]) and acc.Tags()["graph"]
    assert not [r for r in caplog.records if "more than one graph" in r.getMessage()]


def graph_names_here():
    """{run token: how many graph names it keeps} in this process (the render worker runs it too)."""
    from hookprof.hooks.capture import KEPT_PARTS

    kept = {token: KEPT_PARTS.recall(token) for token in KEPT_PARTS.tokens()}
    return {token: len(parts.graph_names.named) for token, parts in kept.items()
            if parts is not None and parts.graph_names is not None}


@pytest.mark.parametrize("render_worker", [True, False], ids=["worker", "in-process"])
def test_each_fit_keeps_its_own_step_graph_names_until_it_ends(tmp_dir, render_worker):
    """The graph names a fit's traced steps repeat are kept from one step to the next by that fit's renders
    (`KEPT_PARTS`, by the run's token, in the render worker or in the training process), not by the process:
    two fits of the same model each have their own, and each fit's go when it ends."""
    from hookprof import HookedSession, ManualSession, SessionRunHook
    from hookprof._runtime import worker
    from hookprof.hooks.capture import CaptureOptions
    from hookprof.tracing import HostTracer

    def held():
        return worker.WORKER.call(graph_names_here) if render_worker else graph_names_here()

    other, context = HookedSession([SessionRunHook()], HostTracer), contextvars.Context()
    context.run(other.begin)  # a fit in another thread: the worker outlives these
    runs = []
    try:
        for fit in range(2):
            out = os.path.join(tmp_dir, str(fit))
            hook = ProfilerHook(save_steps=1, output_dir=out, capture=CaptureOptions(render_worker=render_worker))
            probe = HeldAtTheEnd(hook, held)
            before = set(held()) if not render_worker or worker.WORKER.answered else set()
            trainer(out, [probe, hook], 4).fit(TinyModel(), loader())
            (mine,) = set(probe.at_end) - before  # the fit's own, while it ran: the names of its steps' ops
            assert probe.at_end[mine] > 10
            assert mine not in held()  # gone once the fit ended
            runs.append(mine)
    finally:
        context.run(other.end, ManualSession())
    assert runs[0] != runs[1]


def test_tensorboard_false_writes_no_event_file(tmp_dir):
    hook = ProfilerHook(save_steps=2, output_dir=tmp_dir, tensorboard=False)
    trainer(tmp_dir, [hook], 2, logger=False).fit(TinyModel(), loader())
    assert [n for n in os.listdir(tmp_dir) if "tfevents" in n] == []
    assert os.listdir(tmp_dir) == ["timeline-2.json"]


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(data=hypothesis.strategies.binary(max_size=4096))
def test_our_fast_record_checksum_is_tensorboards_own(data):
    # TensorBoard's reader checks each record with its pure-Python CRC (the files above pass through it);
    # hookprof's own event files get google-crc32c's C one: they must agree on any record
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tensorboards

    ours = masked_crc32c()
    assert ours is not tensorboards  # the C one is installed with the tensorboard extra
    assert ours(data) == tensorboards(data)


def test_a_fits_written_step_graph_is_the_step_built_with_tensorboards_protos(tmp_dir):
    # the bytes graph.py writes, as TensorBoard's reader decodes them from a real fit's event file, against
    # the same traced step (the stats every hook of the fit got) built message by message
    seen = RecordingHook()
    hook = ProfilerHook(save_steps=2, output_dir=tmp_dir, show_memory=True)  # dataflow (inputs) and memory
    trainer(tmp_dir, [hook, HookCallback([seen])], 2, logger=False).fit(TinyModel(), loader())
    traced = [m.step_stats for m in seen.metadata if m.step_stats is not None]
    assert len(traced) == 1
    stats = traced[0]
    acc = EventAccumulator(tmp_dir, size_guidance={"run_metadata": 0})
    acc.Reload()
    expected_graph, expected_meta = protos_of(stats)
    assert len(expected_graph.node) > 50 and any(n.input for n in expected_graph.node)
    assert any(s.memory for d in expected_meta.step_stats.dev_stats for s in d.node_stats)
    assert acc.Graph() == expected_graph
    assert acc.RunMetadata("step_2") == expected_meta


_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12) | \
    st.sampled_from(["", "aten::addmm", "Model/fc1/aten::addmm", "/lead", "trail/", "a::b/c::d", "a b/c\u00e9:1",
                     "autograd::engine::evaluate_function: AddmmBackward0"])
_INT64 = st.integers(-(2**63), 2**63 - 1)
_TENSOR = st.builds(TensorDescription, st.sampled_from([*TF_DTYPES, "float8_e4m3fn", "Scalar"]),
                    st.lists(st.integers(-(2**40), 2**40) | st.sampled_from([0, 1, 127, 128, 16384]),
                             max_size=4).map(tuple),
                    st.none() | st.integers(0, 2**62))
_NODE = st.builds(
    NodeExecStats, node_name=_TEXT | st.text("ab/:", min_size=2100, max_size=2200), op=_TEXT,
    start_ns=_INT64 | st.integers(1_700_000_000 * 10**9, 1_800_000_000 * 10**9), duration_ns=_INT64,
    thread_id=st.integers(0, 2**32 - 1) | st.sampled_from([0, 2**32, -1]), phase=_TEXT,
    outputs=st.none() | st.lists(_TENSOR, max_size=3),
    category=st.sampled_from(["Op", "Op", "Op", "Module", "Span"]))


@st.composite
def _steps(draw):
    devices = [DeviceStepStats(draw(st.sampled_from(["/host:CPU", "/device:CUDA:0", "/device:CUDA:1",
                                                         "/device:XLA:3", "odd"])), draw(st.lists(_NODE, max_size=8)))
               for _ in range(draw(st.integers(0, 3)))]
    nodes = [n for d in devices for n in d.node_stats]
    edges, allocations = [], []
    if nodes:
        for _ in range(draw(st.integers(0, 6))):
            producer, consumer = draw(st.sampled_from(nodes)), draw(st.sampled_from(nodes))
            slot = draw(st.sampled_from(["0", "1", "12"]))
            edges.append(DataEdge(producer, consumer, draw(_TENSOR), f"{producer.node_name}:{slot}"))
        for i in range(draw(st.integers(0, 4))):
            allocations.append(TensorAllocation(i, "/host:CPU", draw(st.integers(0, 2**40)), 0,
                                                producer=draw(st.none() | st.sampled_from(nodes))))
    return StepStats(devices, edges=edges, allocations=allocations)


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(stats=_steps())
def test_any_step_decodes_to_what_tensorboards_protos_build(stats):
    # names to sanitise, ops outside modules, empty phases and names, epoch and negative times, zero and
    # negative dims, unknown dtypes, several devices, nodes longer than 2 kB: the wire format graph.py writes
    # decodes to the messages TensorBoard's protos build; a thread id no uint32 holds fails both ways
    try:
        expected = protos_of(stats)
    except ValueError:
        with pytest.raises(ValueError, match="thread_id"):
            graph_and_run_metadata(stats)
        return
    graph, meta = graph_and_run_metadata(stats)
    assert (GraphDef.FromString(graph), RunMetadata.FromString(meta)) == expected
