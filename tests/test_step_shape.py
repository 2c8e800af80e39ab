"""A step of the last rendered one's shape reuses what that shape decided (`hookprof.step_stats.StepShape`): its
timeline, step graph, run metadata and XSpace are byte for byte what rendering it alone writes, and a step of
another shape, or whose threads' events came in another order, reuses nothing."""

import contextvars
import copy
import dataclasses

import pytest
import torch

from hookprof import HookedSession, ManualSession, SessionRunHook
from hookprof._runtime import worker
from hookprof.hooks import CaptureOptions
from hookprof.run_options import RunOptions, TraceLevel
from hookprof.step_stats import KeptParts, NodeExecStats, ShapedParts, StepShape, node_shape
from hookprof.tensorboard import graph
from hookprof.trace import xplane
from hookprof.trace.writer import ChromeTraceWriter
from hookprof.tracing import HostTracer
from hookprof.tracing.torch_tracer import TorchTracer
from lightning_prof import ProfilerHook
from tests import worker_probe
from tests.conftest import skip_where_cuda_started
from tests.lightning_models import HeldAtTheEnd, TinyModel, loader, trainer


def test_a_nodes_shape_is_every_field_but_its_times():
    fields = [f.name for f in dataclasses.fields(NodeExecStats) if f.name not in ("start_ns", "duration_ns")]
    node = NodeExecStats(**{f.name: f"value of {f.name}" for f in dataclasses.fields(NodeExecStats)})
    assert sorted(node_shape(node)) == sorted(f"value of {name}" for name in fields)


def traced_steps(count, memory=False):
    """`count` real training steps of one model, traced with dataflow (and memory) (steps 7, 8, ...)."""
    skip_where_cuda_started()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracer = TorchTracer(model)
    steps = []
    for step in range(7, 7 + count):
        tracer.start(RunOptions(trace_level=TraceLevel.FULL_TRACE, record_dataflow=True, record_memory=True))
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        stats = tracer.stop()
        stats.step = step
        if not memory:
            stats.allocations, stats.memory_samples = [], []
        steps.append(stats)
    return steps


def outputs(stats, shape=None):
    """The step's timeline bytes, GraphDef, RunMetadata and XSpace, reusing the last step's parts with `shape`."""
    trace = b"".join(ChromeTraceWriter().render(stats, {"run": 1}, shape=shape)[0].chunks)
    return (trace, *graph.graph_and_run_metadata(stats, shape=shape), xplane.step_xspace(stats, "host", shape))


@pytest.fixture
def kept():
    """What one fit's renderers keep (a fresh fit's: nothing yet)."""
    return KeptParts()


def last_kept(kept):
    """The shape each renderer (timeline, its arrows, step graph, XSpace) kept parts of, or None."""
    return [None if parts._last is None else parts._last[0]
            for parts in (kept.timeline, kept.flows, kept.graph, kept.xspace)]


def test_a_step_of_the_last_ones_shape_renders_as_it_alone_would(kept):
    first, second = traced_steps(2)
    shapes = StepShape(first, kept), StepShape(second, kept)
    assert shapes[0] == shapes[1]  # (a fit's steps repeat one shape: the second reuses the first's parts)
    alone = outputs(second)
    assert outputs(first, shapes[0]) == outputs(first)
    assert outputs(second, shapes[1]) == alone
    assert all(shape is shapes[0] for shape in last_kept(kept))  # (kept, not remade)
    assert alone[0] != outputs(first)[0] and alone[3] != outputs(first)[3]  # (its own times and number)


def test_a_step_of_another_shape_or_order_renders_as_it_alone_would(kept):
    first, second = traced_steps(2)
    renamed, reordered = copy.deepcopy(second), copy.deepcopy(second)
    host = next(dev for dev in renamed.dev_stats if dev.device == xplane.HOST_PLANE)
    op = next(node for node in host.node_stats if node.op == "aten::addmm")
    op.scope = "elsewhere"
    # the same shape, but one thread's events no longer in the step's order (xprof's lines are in time order)
    host = next(dev for dev in reordered.dev_stats if dev.device == xplane.HOST_PLANE)
    a, b = [node for node in host.node_stats if node.category == "Op"][:2]
    assert a.start_ns < b.start_ns
    a.start_ns, b.start_ns = b.start_ns, a.start_ns
    with_memory = traced_steps(1, memory=True)[0]  # (its allocations' bytes are in its nodes' run metadata)
    assert with_memory.allocations and StepShape(with_memory) == StepShape(first)
    for before, step in ((first, renamed), (first, reordered), (reordered, second), (first, with_memory),
                         (with_memory, second)):
        outputs(before, StepShape(before, kept))
        assert outputs(step, StepShape(step, kept)) == outputs(step)
    assert StepShape(reordered) == StepShape(first) and StepShape(renamed) != StepShape(first)



@pytest.mark.parametrize("render_worker", [True, False], ids=["worker", "in-process"])
def test_what_renderers_keep_of_a_fits_last_step_goes_when_the_fit_ends(tmp_dir, render_worker):
    skip_where_cuda_started()
    if render_worker and not worker.AVAILABLE:
        pytest.skip("the render worker runs on POSIX systems")
    held = (lambda token: worker.WORKER.call(worker_probe.shaped_parts_held, token)) if render_worker \
        else worker_probe.shaped_parts_held
    other, context = HookedSession([SessionRunHook()], HostTracer), contextvars.Context()
    context.run(other.begin)  # a fit in another thread: the worker outlives this one, and is asked after it
    try:
        hook = ProfilerHook(save_steps=1, output_dir=tmp_dir, capture=CaptureOptions(render_worker=render_worker))
        probe = HeldAtTheEnd(hook, lambda: held(probe.token))
        trainer(tmp_dir, [probe, hook], 4).fit(TinyModel(), loader())
        assert probe.at_end == 4  # the timeline's, its arrows', the step graph's and the XSpace's, while the fit ran
        process = worker.WORKER._process
        assert held(probe.token) == 0
        assert worker.WORKER._process is process and (process is not None) == render_worker  # (the same worker)
    finally:
        context.run(other.end, ManualSession())


def test_a_fit_that_has_ended_keeps_nothing_new():
    """A step of a fit rendered after the fit ended (a failed fit's last render) gets parts to use, kept nowhere:
    nothing outlives the fit's release."""
    from hookprof._runtime.by_fit import ByFit

    store = ByFit("test store")
    first = store.setdefault("fit", KeptParts)
    assert store.setdefault("fit", KeptParts) is first and store.tokens() == ["fit"]
    store.forget("fit")
    late = store.setdefault("fit", KeptParts)
    assert late is not first and store.tokens() == [] and store.recall("fit") is None
    store.remember("fit", late)
    assert store.tokens() == []


def test_a_step_of_more_nodes_than_kept_renders_alike_and_keeps_nothing(monkeypatch, kept):
    first, second = traced_steps(2)
    monkeypatch.setattr(ShapedParts, "KEEP_NODES_MAX", sum(len(dev.node_stats) for dev in first.dev_stats) - 1)
    assert outputs(first, StepShape(first, kept)) == outputs(first)
    assert last_kept(kept) == [None] * 4
    assert outputs(second, StepShape(second, kept)) == outputs(second)
    assert kept.shape(second) is None  # (a fit's step too large to keep takes no shape: nothing is made to keep)


def jax_steps(count):
    """`count` traced runs of one jitted JAX function (each program span has its run's id: no two have a shape)."""
    jax = pytest.importorskip("jax")
    from hookprof.tracing.jax_tracer import JaxTracer

    if jax.default_backend() != "cpu":  # (on a GPU machine: its steps have kernels, and torch may hold CUPTI)
        pytest.skip("JAX runs on a GPU here: this is a test of CPU steps")

    step = jax.jit(lambda x: jax.numpy.tanh(x @ x).sum())
    x = jax.numpy.ones((16, 16))
    step(x).block_until_ready()
    tracer, steps = JaxTracer(), []
    for _ in range(count):
        tracer.start(RunOptions(trace_level=TraceLevel.FULL_TRACE))
        step(x).block_until_ready()
        steps.append(tracer.stop())
    return steps


def test_a_fit_whose_steps_never_repeat_a_shape_stops_taking_them(kept):
    """Two steps in a row of another shape than the one before, and none ever of the last one's: the fit's next
    steps take no shape and nothing is kept (their outputs as rendered alone, as all along)."""
    steps = jax_steps(4)
    shapes = []
    for stats in steps:
        shapes.append(kept.shape(stats))
        assert outputs(stats, shapes[-1]) == outputs(stats)
    assert [shape is not None for shape in shapes] == [True, True, False, False]
    assert last_kept(kept) == [None] * 4


def test_a_step_with_kernels_takes_no_shape_nor_do_its_fits_later_steps(tmp_path, kept):
    from tests.test_cuda_export import exported

    gpu = exported(tmp_path).to_stats()  # (a real CUDA step: each kernel's correlation id in its args)
    cpu = traced_steps(2)
    assert kept.shape(gpu) is None and outputs(gpu, None) == outputs(gpu)
    assert kept.shape(cpu[0]) is None and kept.shape(cpu[1]) is None
    assert last_kept(kept) == [None] * 4


def test_a_fit_whose_steps_repeated_a_shape_takes_them_after_steps_of_other_shapes(kept):
    first, second, third = traced_steps(3)
    other, another = copy.deepcopy(second), copy.deepcopy(second)
    for stats, scope in ((other, "elsewhere"), (another, "further")):
        next(node for node in stats.all_nodes() if node.op == "aten::addmm").scope = scope
    for stats in (first, second, other, another, third):  # (matched; then differed twice in a row)
        shape = kept.shape(stats)
        assert shape is not None and outputs(stats, shape) == outputs(stats)
    assert last_kept(kept) == [shape] * 4 and all(kept_shape is shape for kept_shape in last_kept(kept))
    fourth = copy.deepcopy(third)  # (and a step of the third one's shape reuses its parts)
    shape = kept.shape(fourth)
    assert shape == last_kept(kept)[0] and outputs(fourth, shape) == outputs(fourth)


def test_steps_apart_only_in_whether_hookprofs_work_ran_beside_them_share_a_shape(kept):
    """Whether hookprof's own work ran beside a step's wait or the step itself (`args.shared_with_hookprof` on
    its phase spans) is the step's own, not its shape's: two steps apart only in that have one shape, the
    second reuses the first's parts, and each renders byte for byte as it alone would, its own marks included."""
    from hookprof.tracing.coordinator import StepPhases

    first, second = traced_steps(2)
    for stats, shared in ((first, False), (second, True)):
        nodes = list(stats.all_nodes())
        start, end = min(n.start_ns for n in nodes), max(n.start_ns + n.duration_ns for n in nodes)
        StepPhases("torch", (start - 1000, start), [("forward", start)], end, shared, shared).add_to(stats)
    alone = outputs(first), outputs(second)
    shapes = StepShape(first, kept), StepShape(second, kept)
    assert shapes[0] == shapes[1]
    assert outputs(first, shapes[0]) == alone[0]
    assert outputs(second, shapes[1]) == alone[1]
    assert all(shape is shapes[0] for shape in last_kept(kept))  # (the second reused the first's parts)
    assert [trace.count(b'"shared_with_hookprof":true') for trace, *_ in alone] == [0, 2]


def test_a_shaped_step_cut_short_by_max_events_writes_what_rendering_it_alone_writes(kept):
    """A step of the last one's shape writes its op events and arrows as runs of serialised events
    (`writer.Serialised`); `max_events` cuts it at the same event, inside a run or between a run and a phase
    span (placed among the ops here), as rendering the step alone does."""
    from hookprof.tracing.coordinator import StepPhases

    steps = traced_steps(2)
    for stats in steps:
        nodes = list(stats.all_nodes())
        start, end = min(n.start_ns for n in nodes), max(n.start_ns + n.duration_ns for n in nodes)
        StepPhases("torch", (start - 1000, start), [("forward", start)], end, False, False).add_to(stats)
        host = stats.dev_stats[0].node_stats
        spans = [node for node in host if node.category == "Span"]
        assert spans  # (then moved among the ops: the runs are cut around them)
        for at, span in zip((0, 5, 6), spans):
            host.remove(span)
            host.insert(at, span)
    shapes = StepShape(steps[0], kept), StepShape(steps[1], kept)
    ChromeTraceWriter().render(steps[0], shape=shapes[0])
    whole = ChromeTraceWriter().render(steps[1])[1].events
    assert whole > 40
    for cap in (1, 3, 6, 7, 8, 20, whole - 10, whole - 1, whole, whole + 5):
        writer = ChromeTraceWriter(max_events=cap)
        alone, alone_result = writer.render(steps[1], {"run": 1})
        shaped, shaped_result = writer.render(steps[1], {"run": 1}, shape=shapes[1])
        assert b"".join(shaped.chunks) == b"".join(alone.chunks), cap
        assert shaped_result == alone_result and shaped_result.events == min(cap, whole)
    assert last_kept(kept)[0] is shapes[0]  # (the second step reused the first's parts)
