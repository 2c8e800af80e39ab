"""Tensor identities borrowed from an earlier traced step (`hookprof.tracing.step_identity`), in real Lightning fits:
the same arrows and memory objects as the step's own event tree, and none, with the reason, where the ops differ."""

import contextvars
import dataclasses
import os

import lightning as L
import orjson
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from hookprof import HookedSession, ManualSession, SessionRunHook
from hookprof._runtime import by_fit, worker
from hookprof.hooks.capture import CaptureOptions
from hookprof.run_options import RunOptions, TraceLevel
from hookprof.trace import format as fmt
from hookprof.tracing import HostTracer
from hookprof.tracing.kineto_replay import CONVERSIONS
from hookprof.tracing.kineto_trace import BORROW
from hookprof.tracing.step_identity import DATAFLOW_MISSING, TEMPLATES
from hookprof.tracing.torch_tracer import TorchTracer
from lightning_prof import ProfilerHook
from tests.conftest import load_trace, skip_where_cuda_started
from tests.lightning_models import HeldAtTheEnd, TinyModel, loader, trainer
from tests.test_ddp_agree import fit as ddp_fit

TENSORS = RunOptions(trace_level=TraceLevel.FULL_TRACE, record_dataflow=True, record_memory=True)


class AdamModel(TinyModel):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)  # (state made at the first step: its ops differ)


class BothPaths(L.Callback):
    """Traces every step with its own tree walk (and a template of it), and converts each step's export again
    with the previous step's identities borrowed, joined to them (`apply_template`, not given what the walk
    found): (step, the tree's stats, the borrowed stats)."""

    def __init__(self):
        self.steps = []
        self._previous = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.tracer = TorchTracer(pl_module)
        self.tracer.bind_fit({})  # a fit of its own each step: every step walks its tree
        self.tracer.start(TENSORS)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        exported = self.tracer.stop_recording().export()
        walked = exported.to_stats()
        if self._previous is not None:
            token = self._previous.identity[1]
            borrowed = dataclasses.replace(exported, tree=None, identity=(BORROW, token))
            TEMPLATES.recall(token).last = None  # (joined to the template: not given what its walk found)
            self.steps.append((trainer.global_step, walked, borrowed.to_stats()))
        self._previous = exported


def edges(stats):
    return sorted((e.producer.node_name, e.consumer.node_name, e.name, e.tensor) for e in stats.edges)


def memory(stats):
    """The allocations (their ids aside: each path numbers its own) and the allocator's samples."""
    allocations = sorted((a.alloc_ns, a.free_ns, a.nbytes, a.device, a.producer and a.producer.node_name,
                          str(a.tensor)) for a in stats.allocations)
    return allocations, [dataclasses.astuple(s) for s in stats.memory_samples]


def outputs(stats):
    return sorted((node.node_name, str(node.outputs)) for node in stats.all_nodes())


def test_borrowed_identities_give_the_tree_walks_arrows_and_memory_on_the_same_step(tmp_dir):
    for model in (TinyModel(), AdamModel()):
        paths = BothPaths()
        L.Trainer(max_steps=4, callbacks=[paths], logger=False, enable_checkpointing=False, default_root_dir=tmp_dir,
                  enable_progress_bar=False, enable_model_summary=False, accelerator="cpu").fit(model, loader())
        first, *later = paths.steps
        # the first step's ops (Lightning's first batch; Adam's state) differ: nothing borrowed, and why
        assert first[2].edges == [] and first[2].allocations == []
        assert "ops differ" in first[2].metadata[DATAFLOW_MISSING]
        assert len(later) == 2
        for step, walked, borrowed in later:
            assert DATAFLOW_MISSING not in borrowed.metadata, step
            assert len(walked.edges) > 40 and len(walked.allocations) > 20
            assert edges(borrowed) == edges(walked), (type(model).__name__, step)
            assert memory(borrowed) == memory(walked), (type(model).__name__, step)
            assert outputs(borrowed) == outputs(walked), (type(model).__name__, step)


def test_a_step_whose_ops_differ_gets_no_arrows_and_its_timeline_says_why(tmp_dir):
    """Steps traced one after another borrow the first one's identities; the step with a smaller batch cannot:
    its timeline has ops but no arrows and no memory objects, and its metadata says why."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(44, 8, generator=g), torch.randn(44, 1, generator=g))
    batches = [list(range(i, i + 8)) for i in range(0, 24, 8)] + [[24, 25, 26, 27]] + \
        [list(range(i, i + 8)) for i in range(28, 44, 8)]  # the 4th batch is short
    hook = ProfilerHook(save_steps=1, output_dir=tmp_dir, show_memory=True)
    trainer(tmp_dir, [hook], len(batches)).fit(TinyModel(), DataLoader(data, batch_sampler=batches))
    timelines = {int(path.rsplit("-", 1)[1].split(".")[0]): load_trace(path) for path in hook.saved_paths}
    assert sorted(timelines) == [2, 3, 4, 5, 6]  # (the first step only starts the count)
    for step, trace in timelines.items():
        events = trace["traceEvents"]
        flows = [e for e in events if e["ph"] == "s"]
        objects = [e for e in events if e.get("cat") == fmt.CAT_TENSOR]
        assert any(e["ph"] == "X" and e["cat"] == "Op" for e in events), step
        if step == 4:  # the short batch
            assert flows == [] and objects == []
            assert "differs from the step its tensor identities were taken from" in \
                trace["metadata"][DATAFLOW_MISSING]
            assert "[4, 8]" in trace["metadata"][DATAFLOW_MISSING]  # the shapes that differ
        else:
            assert len(flows) > 20 and objects, step
            assert DATAFLOW_MISSING not in trace["metadata"], step


class FitIdentities(L.Callback):
    """Keeps the fit's tensor identities (`_Identities`: what counts the steps that could not borrow)."""

    identities = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from hookprof.tracing import fit_traces

        self.identities = self.identities or fit_traces()._tracer_state.get("torch_identities")


@pytest.mark.parametrize("profiler", [False, True], ids=["worker", "worker-and-in-process"])
def test_a_step_whose_ops_differ_is_counted_once_however_many_hooks_convert_it(tmp_dir, profiler):
    """Two ProfilerHooks write every traced step (each converts it: in the render worker, or, with a Profiler,
    in the training process): the short batch's step, the first to borrow from the walked one, counts once
    toward giving borrowing up, not once a conversion (two counts a step turned borrowing off after two such
    steps instead of GIVE_UP)."""
    from hookprof.profiler import Profiler

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(36, 8, generator=g), torch.randn(36, 1, generator=g))
    # (step 1 only starts the count, step 2 walks its tree, step 3 is the short batch)
    batches = [list(range(0, 8)), list(range(8, 16)), [16, 17, 18, 19]] + [list(range(i, i + 8)) for i in (20, 28)]
    hooks = [ProfilerHook(save_steps=1, output_dir=f"{tmp_dir}/a", show_memory=True, name="a"),
             ProfilerHook(save_steps=1, output_dir=f"{tmp_dir}/b", show_memory=True, name="b",
                          profiler=Profiler() if profiler else None)]
    probe = FitIdentities()
    trainer(tmp_dir, [*hooks, probe], len(batches)).fit(TinyModel(), DataLoader(data, batch_sampler=batches))
    for hook in hooks:  # both wrote the short batch's step, without arrows, and said why
        trace = load_trace(next(p for p in hook.saved_paths if p.endswith("-3.json")))
        assert "differs from the step" in trace["metadata"][DATAFLOW_MISSING]
    assert probe.identities.mismatches == 1


def test_a_step_to_borrow_from_that_was_converted_elsewhere_does_not_count_toward_giving_up():
    """A restarted render worker has no template: the next traced step walks its tree again, but only steps
    whose ops differed count toward GIVE_UP (three restarts turned borrowing off for the rest of the fit)."""
    from hookprof.tracing.kineto_trace import BORROW, NO_TEMPLATE, RECORD
    from hookprof.tracing.torch_tracer import _Identities

    identities = _Identities()
    for _ in range(_Identities.GIVE_UP + 1):
        identities.record()
        assert identities.mode() == BORROW
        identities.mismatch(identities.next_borrow(), NO_TEMPLATE)
        assert identities.mode() == RECORD
    for _ in range(_Identities.GIVE_UP):  # (two borrowing steps in a row whose ops differed: a walk again)
        identities.record()
        _, second, third = identities.next_borrow(), identities.next_borrow(), identities.next_borrow()
        identities.mismatch(second, "op 7 differs")
        assert identities.mode() == BORROW  # (one step alone: an epoch's first, say)
        identities.mismatch(third, "op 7 differs")
        assert identities.mode() in (RECORD, None)
    assert identities.mode() is None


def test_a_late_report_of_a_step_that_borrowed_from_an_earlier_walk_changes_nothing():
    """Reports come from the render thread, after later steps started: a step that borrowed from the fit's
    earlier walk and is told to differ after the next walk was exported neither counts as the new walk's first
    borrowing step nor makes the new walk's next odd step look like the second of two in a row."""
    from hookprof.tracing.kineto_trace import BORROW
    from hookprof.tracing.torch_tracer import _Identities

    identities = _Identities()
    identities.record()
    late = identities.next_borrow()  # (borrowing from the first walk; its report comes late)
    identities.mismatch(identities.next_borrow(), "op 3 differs")  # (a lone odd step: borrowing goes on)
    identities.record()  # (a walk again, say after a restarted worker)
    identities.next_borrow()
    odd = identities.next_borrow()
    identities.mismatch(late, "op 3 differs")
    identities.mismatch(odd, "op 3 differs")  # (alone in its walk's steps)
    assert identities.mode() == BORROW and identities.mismatches == 0


def test_the_late_reports_of_a_bad_walks_borrowing_steps_count_toward_giving_up_once():
    """With renders queued, several steps borrow from a walk before the first of them is reported to differ
    (the walked step was the odd one): their reports, two in a row, make the next step walk again, and count
    toward GIVE_UP once for that walk, not once each."""
    from hookprof.tracing.kineto_trace import RECORD
    from hookprof.tracing.torch_tracer import _Identities

    identities = _Identities()
    identities.record()
    steps = [identities.next_borrow() for _ in range(3)]  # (all started before the first report came)
    for step in steps:
        identities.mismatch(step, "op 3 differs")
    assert identities.mode() == RECORD and identities.mismatches == 1
    identities.record()  # (the next walk is odd too: it counts again)
    identities.mismatch(identities.next_borrow(), "op 3 differs")
    assert identities.mismatches == 2


def test_a_model_whose_ops_alternate_gives_borrowing_up_as_one_whose_ops_change_every_step():
    """Odd steps alone are tolerated where they are few (an epoch's first); a model whose every third step runs
    other ops (A, A, B) makes its fit walk again after its third such step, and after `GIVE_UP` such walks every
    step walks its own tree (its B steps would otherwise have no arrows for the whole fit)."""
    from hookprof.tracing.kineto_trace import BORROW
    from hookprof.tracing.torch_tracer import _Identities

    identities = _Identities()
    for _ in range(_Identities.GIVE_UP):
        identities.record()
        for op_differs in (False, False, True) * 10:
            borrow = identities.next_borrow()
            if op_differs:
                identities.mismatch(borrow, "op 5 differs")
            if identities.mode() != BORROW:
                break
        assert identities.borrows == 9  # (the walk again after its third B step, its ninth borrowing step)
    assert identities.mode() is None
    tolerant = _Identities()
    tolerant.record()
    for number in range(1, 201):  # (one odd step in 8: an epoch of 8 traced steps)
        borrow = tolerant.next_borrow()
        if number % 8 == 0:
            tolerant.mismatch(borrow, "op 5 differs")
    assert tolerant.mode() == BORROW and tolerant.mismatches == 0


@pytest.mark.parametrize("store", [TEMPLATES, CONVERSIONS], ids=["templates", "conversions"])
@pytest.mark.parametrize("render_worker", [True, False], ids=["worker", "in-process"])
def test_a_fit_s_template_goes_when_the_fit_ends(tmp_dir, render_worker, store):
    """A fit's template (and its last converted steps: `hookprof.tracing.kineto_replay`) are the fit's (its
    FitRun's): gone once the fit ends, from the render worker (which another fit open meanwhile keeps running) or
    from the training process, not left for later fits to evict."""
    held = (lambda: worker.WORKER.call(by_fit.held_here, store.name)) if render_worker else store.tokens
    other, context = HookedSession([SessionRunHook()], HostTracer), contextvars.Context()
    context.run(other.begin)  # a fit in another thread: the worker outlives this one
    try:
        hook = ProfilerHook(save_steps=1, output_dir=tmp_dir, show_memory=True,
                            capture=CaptureOptions(render_worker=render_worker))
        probe = HeldAtTheEnd(hook, held)
        before = set(held()) if render_worker and worker.WORKER.answered else set(store.tokens())
        trainer(tmp_dir, [probe, hook], 5).fit(TinyModel(), loader())
        mine = set(probe.at_end) - before
        assert len(mine) == 1  # the fit's template, while it ran
        assert not mine & set(held())
        assert render_worker == (worker.WORKER._process is not None)
    finally:
        context.run(other.end, ManualSession())


class FitExports(L.Callback):
    """Traces every step of the fit with one fit's tracer (its first step walks its tree, the next ones borrow)
    and converts each at once, as a render worker would (a step whose ops differ makes the next one walk its
    tree again); keeps the exports and their stats in order."""

    def __init__(self, options):
        self.options, self.state, self.steps = options, {}, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.tracer = TorchTracer(pl_module)
        self.tracer.bind_fit(self.state)
        self.tracer.start(self.options)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        exported = self.tracer.stop_recording().export()
        self.steps.append((exported, exported.to_stats()))


def rendered(stats):
    """What a step's outputs hold: its timeline's bytes, step graph, run metadata and XSpace, and its records."""
    from tests.test_step_shape import outputs as step_outputs

    stats.step = 1
    return (*step_outputs(stats), edges(stats), outputs(stats),
            [(a.allocation_id, a.nbytes, a.alloc_ns, a.free_ns, a.producer and a.producer.node_name, a.tensor)
             for a in stats.allocations], [dataclasses.astuple(s) for s in stats.memory_samples])


def full_path(exported):
    """The step converted without what its fit's last borrowing step found (`BorrowedStep`)."""
    TEMPLATES.recall(exported.identity[1]).last = None
    return exported.to_stats()


def counted_gives(monkeypatch):
    """The borrowing steps given what the last one found (`BorrowedStep.give`), counted as they are."""
    from hookprof.tracing.step_identity import BorrowedStep

    gives = []
    give = BorrowedStep.give
    monkeypatch.setattr(BorrowedStep, "give", lambda self, *args: gives.append(1) or give(self, *args))
    return gives


@pytest.mark.parametrize("options", [TENSORS, RunOptions(trace_level=TraceLevel.FULL_TRACE, record_dataflow=True)],
                         ids=["dataflow-and-memory", "dataflow"])
def test_a_borrowing_step_of_the_last_ones_layout_renders_as_found_anew(tmp_dir, monkeypatch, options):
    """A borrowing step whose events come in the order of the fit's last borrowing step's takes that step's
    arrows, outputs and allocations by place (`BorrowedStep`): its timeline, step graph, XSpace and records
    are byte for byte those of joining the template to it and finding its arrows again."""
    skip_where_cuda_started("a step's host holds the CUDA runtime's calls: no step is given the last one's arrows")
    gives = counted_gives(monkeypatch)
    fit = FitExports(options)
    trainer(tmp_dir, [fit], 7, logger=False).fit(AdamModel(), loader())
    modes = [(exported.identity[0], DATAFLOW_MISSING in stats.metadata) for exported, stats in fit.steps]
    # the first batch's ops differ (Lightning's first step, Adam's state): the step after it walks again
    assert modes == [("record", False), (BORROW, True), ("record", False)] + [(BORROW, False)] * 4
    # (each borrowing step after the walk is given: the first what the walked step found, `leave_walked`)
    assert len(gives) == 4
    for exported, stats in fit.steps[3:]:
        found = full_path(exported)
        assert len(found.edges) > 40 and (len(found.allocations) > 20) == options.record_memory
        assert rendered(stats) == rendered(found)
    assert len(gives) == 4


@pytest.mark.parametrize("options", [TENSORS, RunOptions(trace_level=TraceLevel.FULL_TRACE, record_dataflow=True)],
                         ids=["dataflow-and-memory", "dataflow"])
@pytest.mark.parametrize("model", [TinyModel, AdamModel], ids=["sgd", "adam"])
def test_the_step_after_a_walk_is_given_what_the_walk_found_as_the_full_path_finds_it(tmp_dir, monkeypatch, options,
                                                                                    model):
    """The walked step leaves its arrows, outputs and allocations by place (`leave_walked`): the first borrowing
    step after it, of its layout, is given them, and renders byte for byte what joining the template to it and
    finding its arrows again renders (Lightning's first step and Adam's state make the first walk's next step
    differ: the fit walks again, and the step after that second walk is the one given)."""
    skip_where_cuda_started("a step's host holds the CUDA runtime's calls: no step is given the last one's arrows")
    from hookprof.tracing.step_identity import BorrowedStep

    given = []
    give = BorrowedStep.give
    monkeypatch.setattr(BorrowedStep, "give", lambda self, stats, *args: given.append(stats) or give(self, stats,
                                                                                                        *args))
    fit = FitExports(options)
    trainer(tmp_dir, [fit], 5, logger=False).fit(model(), loader())
    modes = [exported.identity[0] for exported, _ in fit.steps]
    after_walks = [i + 1 for i in range(len(modes) - 1) if modes[i] == "record" and modes[i + 1] == BORROW
                   and DATAFLOW_MISSING not in fit.steps[i + 1][1].metadata]
    assert after_walks  # (a walk, and a step after it that borrowed)
    for i in after_walks:
        exported, stats = fit.steps[i]
        assert any(s is stats for s in given), i  # (given by place, not joined again)
        found = full_path(exported)
        assert len(found.edges) > 10 and (len(found.allocations) > 10) == options.record_memory
        assert rendered(stats) == rendered(found)


def test_a_borrowing_step_of_another_layout_finds_its_arrows_anew(tmp_dir, monkeypatch):
    """A borrowing step with the template's ops whose events come in another order than the last borrowing
    step's (here a tensor freed inside the op that made it) is joined to the template and its arrows found
    again: they differ from the last step's, and are what a step converted alone gets."""
    skip_where_cuda_started("a step's host holds the CUDA runtime's calls: no step is given the last one's arrows")
    gives = counted_gives(monkeypatch)
    fit = FitExports(TENSORS)
    trainer(tmp_dir, [fit], 5, logger=False).fit(TinyModel(), loader())
    (_, before), (exported, stats) = fit.steps[-2:]
    # (the two borrowing steps after the fit's second walk: given, the first what the walk found)
    assert len(gives) == 2 and exported.identity[0] == BORROW
    # the step again, one of its tensors freed inside the op that made it (so no longer that op's output)
    edge = next(e for e in stats.edges if any(a.producer is e.producer and a.tensor == e.tensor and a.free_ns
                                              for a in stats.allocations))
    made = next(a for a in stats.allocations if a.producer is edge.producer and a.tensor == edge.tensor)
    with open(exported.path, "rb") as f:
        data = orjson.loads(f.read())
    base = data.get("baseTimeNanoseconds", 0)
    free = next(e for e in data["traceEvents"] if e.get("name") == "[memory]" and e["args"]["Bytes"] == -made.nbytes
                and round(e["ts"] * 1000) + base == made.free_ns)
    free["ts"] = (made.alloc_ns + 1 - base) / 1000
    path = os.path.join(tmp_dir, "moved.json")
    with open(path, "wb") as f:
        f.write(orjson.dumps(data))
    moved = dataclasses.replace(exported, path=path)
    changed = moved.to_stats()
    assert len(gives) == 2 and DATAFLOW_MISSING not in changed.metadata  # (found anew, not given)
    assert edges(changed) != edges(stats)
    assert (edge.producer.node_name, edge.consumer.node_name, edge.name, edge.tensor) not in edges(changed)
    assert rendered(changed) == rendered(full_path(moved))
    # and the step after it, of the first order again, finds its own anew too (the last layout is the moved one's)
    assert rendered(exported.to_stats()) == rendered(stats) and len(gives) == 2
    assert edges(before) == edges(stats)


def kineto_events(events):
    """Events written as the export's JSON objects, decoded as the conversion reads them."""
    from hookprof.tracing.kineto_events import decode_trace

    return decode_trace(orjson.dumps({"traceEvents": events})).traceEvents


def test_a_step_whose_host_holds_more_than_its_ops_finds_its_arrows_anew():
    """Arrows are reused by their nodes' places: a host whose nodes are not its ops alone (a CUDA runtime call
    among them, which may trade places with an op from one step to the next, the order of starts and ends
    unchanged) never reuses the last step's, so each step's arrow joins the ops it joins when found anew."""
    from hookprof.step_stats import StepStats, TensorDescription
    from hookprof.tracing.kineto_trace import _convert
    from hookprof.tracing.step_identity import SIGNATURE, IdentityTemplate, Interned, borrow

    def step(relu_at, runtime_at):
        events = [
            {"ph": "X", "cat": "cpu_op", "name": "aten::empty", "ts": 0, "dur": 5, "tid": 1,
             "args": {"External id": 1, "Input Dims": [[4]], "Input type": ["float"]}},
            {"ph": "X", "cat": "cpu_op", "name": "aten::relu", "ts": relu_at, "dur": 1, "tid": 1,
             "args": {"External id": 2, "Input Dims": [[4]], "Input type": ["float"]}},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaGetDevice", "ts": runtime_at, "dur": 1, "tid": 1,
             "args": {"correlation": 7}},
            {"ph": "i", "name": "[memory]", "ts": 1, "tid": 1, "args": {"Bytes": 64, "Addr": 100, "Device Type": 0}},
        ]
        stats, instants = StepStats(), []
        converted = _convert(kineto_events(events), 0, stats, True, False, True, instants, Interned())
        return stats, converted.rows(), instants, converted

    _, rows, _, _ = step(8, 6)
    # empty makes a 64-byte tensor, relu reads it
    template = IdentityTemplate([row[SIGNATURE] for row in rows],
                                [[], [(0, ("made", 0, 0), TensorDescription("float32", (16,), 64))]],
                                [frozenset(), frozenset()], {0: [(64, "/host:CPU")]})
    for relu_at, runtime_at in ((8, 6), (6, 8)):  # (the runtime call before relu, then after it)
        stats, _, instants, converted = step(relu_at, runtime_at)
        assert borrow(template, stats, converted, instants, 0, True, False) is None
        assert [(e.producer.op, e.consumer.op) for e in stats.edges] == [("aten::empty", "aten::relu")]


def test_a_step_whose_backward_runs_on_a_thread_of_its_own_borrows_across_both():
    """On CUDA, autograd runs the backward on a thread of its own: a backward op there reads a tensor a forward op
    made on the step's thread, and the arrow between them is borrowed like any other, the two threads' ops put
    back in start order (an op of the step's thread that writes the tensor after the backward read it is not its
    source). A thread that is not the step's (a DataLoader's pin-memory thread), whose ops vary in number from
    step to step, is not compared."""
    from hookprof.step_stats import StepStats, TensorDescription
    from hookprof.tracing.kineto_trace import _convert
    from hookprof.tracing.step_identity import SIGNATURE, IdentityTemplate, Interned, _step_rows, borrow

    def op(name, ts, dur, tid, external_id, cat="cpu_op"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid,
                "args": {"External id": external_id, "Input Dims": [[4]], "Input type": ["float"]}}

    def step(pinned):
        events = [
            op("autograd::engine::evaluate_function: ReluBackward0", 20, 5, 2, 3),
            op("aten::threshold_backward", 21, 2, 2, 4),
            op("module::fc", 0, 10, 1, 1, cat="user_annotation"),
            op("aten::relu", 1, 3, 1, 2),
            op("aten::mul_", 30, 1, 1, 5),
            *(op("aten::pin_memory", 12 + i, 1, 3, 10 + i) for i in range(pinned)),
            {"ph": "i", "name": "[memory]", "ts": 2, "tid": 1, "args": {"Bytes": 64, "Addr": 100, "Device Type": 0}},
        ]
        stats, instants = StepStats(), []
        converted = _convert(kineto_events(events), 0, stats, True, False, True, instants, Interned())
        return stats, converted.rows(), instants, converted

    _, rows, _, _ = step(1)
    own = _step_rows(rows)
    assert [(row.tid, row.name) for row in own] == [
        (1, "module::fc"), (1, "aten::relu"), (1, "aten::mul_"),
        (2, "autograd::engine::evaluate_function: ReluBackward0"), (2, "aten::threshold_backward")]
    # relu (op 1, on the step's thread) makes a 64-byte tensor; the backward's threshold_backward (op 4) reads it
    # as 4 x 4, then mul_ (op 2, the step's thread again) as 16 and writes it in place: the allocation holds what
    # its earliest reader read
    square, flat = TensorDescription("float32", (4, 4), 64), TensorDescription("float32", (16,), 64)
    template = IdentityTemplate([row[SIGNATURE] for row in own],
                                [[], [], [(0, ("made", 1, 0), flat)], [], [(0, ("made", 1, 0), square)]],
                                [frozenset(), frozenset(), frozenset({0}), frozenset(), frozenset()],
                                {1: [(64, "/host:CPU")]})
    for pinned in (1, 2):
        stats, _, instants, converted = step(pinned)
        assert borrow(template, stats, converted, instants, 0, True, True) is None
        assert sorted((e.producer.op, e.consumer.op, e.consumer.thread_id) for e in stats.edges) == [
            ("aten::relu", "aten::mul_", 1), ("aten::relu", "aten::threshold_backward", 2)]
        assert [(a.producer.op, a.nbytes, a.tensor) for a in stats.allocations] == [("aten::relu", 64, square)]


def arrows(path):
    """A timeline's dataflow arrows, as (tensor name, producer node, consumer node), and its step's metadata."""
    trace = load_trace(path)
    return ({(e["name"], e["args"][fmt.ARG_PRODUCER], e["args"][fmt.ARG_CONSUMER]) for e in trace["traceEvents"]
             if e["ph"] == "s" and e.get("cat") == fmt.CAT_DATAFLOW}, trace["metadata"])


@pytest.mark.parametrize("left", [True, False], ids=["walk-left", "joined"])
@pytest.mark.parametrize("config", ["accumulation", "two optimizers"])
def test_the_borrowing_steps_of_an_accumulating_or_two_optimizer_fit_draw_its_walked_steps_arrows(tmp_dir, config,
                                                                                                    monkeypatch, left):
    """Every step traced with the defaults in fits whose step is two micro-batches (accumulation) or two
    optimizers' backward and updates (manual optimization): the fit's first traced step walks its event tree,
    each later one borrows its tensor identities and draws the very arrows the walked step drew. (A step that
    starts an epoch runs other ops, so has none and says why: the fits here stay in their first epoch.) With
    `left` the walked step leaves its records for the step after it (`leave_walked`); without, that step is
    joined to the template, and the ones after it are given what it found."""
    from hookprof.tracing import kineto_trace
    from tests.test_step_clock import TwoOptimizers

    if not left:
        monkeypatch.setattr(kineto_trace, "leave_walked", lambda *args: None)

    borrowed_steps = []  # (converted here: no render worker)
    borrow = kineto_trace.borrow
    monkeypatch.setattr(kineto_trace, "borrow", lambda *args: borrowed_steps.append(1) or borrow(*args))
    hook = ProfilerHook(save_steps=1, output_dir=tmp_dir, tensorboard=False,
                        capture=CaptureOptions(render_worker=False))
    if config == "accumulation":  # (20 batches: 10 steps an epoch)
        trainer(tmp_dir, [hook], 7, logger=False, accumulate_grad_batches=2).fit(TinyModel(), loader(n=160))
    else:  # (8 batches: 16 steps an epoch)
        trainer(tmp_dir, [hook], 14, logger=False).fit(TwoOptimizers(), loader())
    drawn = [arrows(path) for path in hook.saved_paths]
    assert len(drawn) >= 6 and not any(DATAFLOW_MISSING in metadata for _, metadata in drawn)
    walked, *borrowed = (frozenset(found) for found, _ in drawn)
    assert len(borrowed_steps) == len(borrowed)
    assert len(walked) > 10 and all(found == walked for found in borrowed), [len(found) for found, _ in drawn]


def test_an_epochs_first_step_alone_does_not_make_the_next_ones_walk_again(tmp_dir):
    """Each epoch's first step runs ops no other step does (11 more: copies and clones around the metric the
    model logs): it has no arrows and says why, and the steps after it borrow the fit's identities again, with
    arrows: over three epochs the fit walks its event tree once (it walked again after each epoch's first step,
    and gave borrowing up after the third)."""
    hook = ProfilerHook(save_steps=1, output_dir=tmp_dir, tensorboard=False)
    probe = FitIdentities()
    trainer(tmp_dir, [hook, probe], 24, logger=False).fit(TinyModel(), loader())  # (8 batches an epoch)
    missing = {int(path.rsplit("-", 1)[1].split(".")[0]): DATAFLOW_MISSING in arrows(path)[1]
               for path in hook.saved_paths}
    assert sorted(step for step, absent in missing.items() if absent) == [9, 17]  # (the second and third epochs' first)
    assert len(missing) == 23 and all(len(arrows(path)[0]) > 20 for path in hook.saved_paths
                                      if not missing[int(path.rsplit("-", 1)[1].split(".")[0])])
    assert probe.identities.mismatches == 0 and probe.identities.mode() == BORROW


@pytest.mark.parametrize("differs", ["bytes", "op"])
def test_a_walked_step_whose_allocations_are_not_its_exports_leaves_nothing_to_give(tmp_dir, monkeypatch, differs):
    """A walked step leaves its records by place (`leave_walked`) only where its walk's allocations are its
    export's: the same bytes in time order, each made in the op the export nests it in. One allocation of
    another size, or nested in another op, and the template has nothing to give (the next step is joined)."""
    skip_where_cuda_started("a step's host holds the CUDA runtime's calls: no step is given the last one's arrows")
    from hookprof.tracing import step_identity

    fit = FitExports(TENSORS)
    trainer(tmp_dir, [fit], 3, logger=False).fit(TinyModel(), loader())
    exported, _ = next((e, s) for e, s in fit.steps if e.identity[0] == "record")
    template = lambda: TEMPLATES.recall(exported.identity[1])  # noqa: E731  (each conversion makes it anew)
    exported.to_stats()
    assert template().last is not None  # (as walked: left)
    if differs == "bytes":
        events = step_identity.memory_events

        def memory_events(instants, base):
            allocations, threads = events(instants, base)
            first = next(i for i, a in enumerate(allocations) if a.nbytes > 0)
            allocations[first] = allocations[first]._replace(nbytes=allocations[first].nbytes + 4)
            return allocations, threads

        monkeypatch.setattr(step_identity, "memory_events", memory_events)
    else:
        nest = step_identity.step_allocations

        def step_allocations(allocations, threads, rows):
            blocks = nest(allocations, threads, rows)
            allocation_id, block = next((i, b) for i, b in blocks.items() if b.op is not None)
            other = next(row.external_id for row in rows if row.external_id != block.op)
            blocks[allocation_id] = dataclasses.replace(block, op=other)
            return blocks

        monkeypatch.setattr(step_identity, "step_allocations", step_allocations)
    exported.to_stats()
    assert template().last is None


def test_a_keras_fits_step_after_its_walk_is_given_what_the_walk_found_as_the_full_path_finds_it(monkeypatch):
    """Keras on torch (its own train step, Adam): the step after the fit's walk is given the walk's records by
    place (`leave_walked`), and renders byte for byte what joining the template to it renders."""
    import keras
    import numpy as np

    from hookprof.tracing.step_identity import BorrowedStep

    skip_where_cuda_started("a step's host holds the CUDA runtime's calls: no step is given the last one's arrows")
    if torch.cuda.is_available():  # (Keras would train on the GPU)
        pytest.skip("Keras on torch trains on the GPU here")
    given = []
    give = BorrowedStep.give
    monkeypatch.setattr(BorrowedStep, "give", lambda self, stats, *args: given.append(stats) or give(self, stats,
                                                                                                        *args))

    class Exports(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.state, self.steps = {}, []

        def on_train_batch_begin(self, batch, logs=None):
            self.tracer = TorchTracer(self.model)
            self.tracer.bind_fit(self.state)
            self.tracer.start(TENSORS)

        def on_train_batch_end(self, batch, logs=None):
            exported = self.tracer.stop_recording().export()
            self.steps.append((exported, exported.to_stats()))

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    rng = np.random.default_rng(0)
    exports = Exports()
    model.fit(rng.standard_normal((32, 8)).astype("float32"), rng.standard_normal((32, 1)).astype("float32"),
              batch_size=8, epochs=1, callbacks=[exports], verbose=0)
    (walked, _), (exported, stats), *_ = exports.steps
    assert walked.identity[0] == "record" and exported.identity[0] == BORROW
    assert any(s is stats for s in given) and DATAFLOW_MISSING not in stats.metadata
    found = full_path(exported)
    assert len(found.edges) > 10 and len(found.allocations) > 10
    assert rendered(stats) == rendered(found)


def identity_rows(names):
    """A step's rows of ops named `names`, one thread, each with one argument of shape [4]."""
    from hookprof.step_stats import NodeExecStats
    from hookprof.tracing.step_identity import Row, StepRows

    rows = [Row(NodeExecStats(f"{name}_{i}", name, 10 * i, 5, 1), i, 1, name, [[4]], ["float"])
            for i, name in enumerate(names)]
    return StepRows(rows, {row.external_id: row.node for row in rows})


def test_a_template_with_one_run_of_extra_ops_lends_what_its_other_ops_read_at_their_places():
    """The walked step ran X and `aten::empty` Y inside B, between B's start and C, which the next steps lack
    (DDP's bucket rebuild): the template without them gives C and D what they read, at their new places; what X
    made goes, and so does what Y (allocation plumbing) made that B owns, B's other allocation taking its rank;
    a read of what they made and left is, without them, data from before the step; allocations outside any op
    (-1) and in other threads' ops (-2) stay."""
    from hookprof.step_stats import TensorDescription
    from hookprof.tracing.step_identity import SIGNATURE, IdentityTemplate, without_extra_ops

    t = TensorDescription("float32", (4,), 16)
    cpu = "/host:CPU"
    ops = ["A", "B", "X", "aten::empty", "C", "D"]
    template = IdentityTemplate(
        [row[SIGNATURE] for row in identity_rows(ops).rows()],
        [[], [], [(0, ("made", 0, 0), t)], [],
         [(0, ("made", 1, 1), t), (1, ("made", -1, 0), t)],  # B's own allocation; one made outside any op
         [(0, ("made", 4, 0), t), (1, ("made", 2, 0), t), (2, ("made", 1, 0), t), (3, ("before", 7), t),
          (4, ("made", -2, 0), t)]],  # C's; X's and Y's, left; data from before; an other thread's
        [frozenset(), frozenset(), frozenset(), frozenset(), frozenset({0}), frozenset()],
        {-2: [(16, cpu)], -1: [(16, cpu)], 0: [(16, cpu)], 1: [(32, cpu), (16, cpu)], 2: [(16, cpu)],
         4: [(16, cpu)]},
        via={("made", 1, 0): 3},  # (made in Y, which B's allocation plumbing is)
        lasting=frozenset({("made", 2, 0), ("made", 1, 0), ("made", 4, 0)}))
    lighter = without_extra_ops(template, identity_rows(["A", "B", "C", "D"]))
    assert lighter.signatures == [row[SIGNATURE] for row in identity_rows(["A", "B", "C", "D"]).rows()]
    assert lighter.made == {-2: [(16, cpu)], -1: [(16, cpu)], 0: [(16, cpu)], 1: [(16, cpu)], 2: [(16, cpu)]}
    assert lighter.reads == [[], [], [(0, ("made", 1, 0), t), (1, ("made", -1, 0), t)],
                             [(0, ("made", 2, 0), t), (1, ("before", ("made", 2, 0)), t),
                              (2, ("before", ("made", 1, 0)), t), (3, ("before", 7), t), (4, ("made", -2, 0), t)]]
    assert lighter.written == [frozenset(), frozenset(), frozenset({0}), frozenset()]
    assert lighter.derived and without_extra_ops(lighter, identity_rows(["A", "B", "C"])) is None  # (never again)
    # a read of a temporary of theirs (gone at the step's end): what the op reads without them is unknown
    for temporary in (("made", 2, 0), ("made", 1, 0)):  # (X's own; Y's, which B owns)
        left = dataclasses.replace(template, lasting=template.lasting - {temporary})
        assert without_extra_ops(left, identity_rows(["A", "B", "C", "D"])) is None, temporary


class SkipsARun(TinyModel):
    """TinyModel that refreshes a buffer with a run of ops of its own at the start of every step but step `skip`
    (as a `GradScaler` skips its optimizer step now and then)."""

    def __init__(self, skip):
        super().__init__()
        self.skip = skip
        self.register_buffer("scale", torch.ones(16))

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step + 1 != self.skip:
            with torch.no_grad():
                self.scale.copy_(self.scale.abs().sqrt())
        return super().training_step(batch, batch_idx)


def test_a_step_without_a_run_of_its_walked_steps_ops_borrows_the_rest_as_its_own_walk_finds_them(tmp_dir):
    """Every step walks its tree and is converted again borrowing the step before's identities: step 4, which
    skips the run of ops the others start with, borrows from step 3's template without that run the arrows,
    memory objects and outputs its own walk finds; step 5, which runs them again, has more ops than step 4's."""
    paths = BothPaths()
    L.Trainer(max_steps=5, callbacks=[paths], logger=False, enable_checkpointing=False, default_root_dir=tmp_dir,
              enable_progress_bar=False, enable_model_summary=False, accelerator="cpu").fit(SkipsARun(4), loader())
    steps = {step: (walked, borrowed) for step, walked, borrowed in paths.steps}
    walked, borrowed = steps[4]
    assert DATAFLOW_MISSING not in borrowed.metadata and len(walked.edges) > 40
    assert edges(borrowed) == edges(walked) and memory(borrowed) == memory(walked)
    assert outputs(borrowed) == outputs(walked)
    assert "ops differ" in steps[5][1].metadata[DATAFLOW_MISSING]


def test_a_fit_whose_one_step_skips_a_run_of_ops_keeps_borrowing_its_walked_steps_identities(tmp_dir):
    """Traced every step with the defaults: the step that skips the run borrows the walked step's identities
    without it, and the steps after it, which run it again, borrow the walked step's own: each has its arrows,
    the same as the steps before the skip, and the fit walks once."""
    hook, probe = ProfilerHook(save_steps=1, output_dir=tmp_dir), FitIdentities()
    trainer(tmp_dir, [hook, probe], 7).fit(SkipsARun(4), loader())
    flows = {int(path.rsplit("-", 1)[1].split(".")[0]): sorted(
        (e["name"], e["args"]["consumer"]) for e in load_trace(path)["traceEvents"] if e["ph"] == "s")
        for path in hook.saved_paths}
    assert {2, 3, 4, 5, 6} <= set(flows)  # (one may wait for the disk: skipped)
    assert probe.identities.walks == 1
    assert all(len(found) > 40 for found in flows.values()), {step: len(found) for step, found in flows.items()}
    assert all(flows[step] == flows[2] for step in flows if step != 4)
    assert len(flows[4]) < len(flows[2])  # (the run's own arrows: the buffer's refresh)


@pytest.mark.parametrize("template_ops, step_ops", [
    ("AXXB", "AXB"),  # (an X alike beside the other: which one the step has cannot be told)
    ("AXB", "AC"),  # (the step's ops are not the template's first and last ones)
    ("AB", "AXB"),  # (the step has more)
    ("AXBYC", "ABC"),  # (two runs)
], ids=["alike beside", "other ops", "more ops", "two runs"])
def test_a_template_lends_nothing_where_its_extra_ops_are_not_one_run_that_can_be_told(template_ops, step_ops):
    from hookprof.tracing.step_identity import SIGNATURE, IdentityTemplate, without_extra_ops

    rows = identity_rows(template_ops).rows()
    template = IdentityTemplate([row[SIGNATURE] for row in rows], [[] for _ in rows], [frozenset()] * len(rows), {})
    assert without_extra_ops(template, identity_rows(step_ops)) is None


def test_ddp_steps_borrow_from_the_step_that_rebuilt_its_buckets_what_their_own_walk_finds(tmp_path):
    """Under DDP (2 ranks, gloo) the second step rebuilds the gradient buckets (broadcasts, copies, allocations:
    ops no later step runs). Every step walks its tree, and is converted again borrowing the step before's
    identities (`tests/ddp_fit.py`): the third step, borrowing from the second's, has its own walk's arrows,
    memory objects and outputs, as every later one does."""
    for rank in ddp_fit("identities_both_paths", tmp_path):
        steps = {step["step"]: step for step in rank["steps"]}
        assert sorted(steps) == list(range(2, 9))
        # (the second step, which rebuilt the buckets, has more ops than the first: it cannot borrow from it)
        assert "ops differ" in steps[2]["missing"]
        for step in range(3, 9):
            assert steps[step]["missing"] is None and steps[step]["edges"] > 40, step
            assert steps[step]["same"] == [True, True, True], step


def test_a_ddp_fit_traced_every_step_draws_arrows_from_the_third_step_on_with_one_walk(tmp_path):
    """A 2-rank DDP fit traced every step with the defaults (`tests/ddp_fit.py`): its first traced step (the
    second, which rebuilt the gradient buckets) is walked, and every later step, rendered by the render worker,
    borrows what that walk found without the rebuild's ops: arrows on each, and no second walk."""
    for rank, found in enumerate(ddp_fit("identities_every_step", tmp_path)):
        assert found["walks"] == 1, rank
        traced = {int(path.rsplit("-", 2)[1]): load_trace(path) for path in found["paths"]}
        assert {2, 3, 4} <= set(traced), (rank, sorted(traced))  # (a later one may wait for the disk: skipped)
        for step, trace in traced.items():
            assert DATAFLOW_MISSING not in trace["metadata"], (rank, step)
            assert sum(e["ph"] == "s" for e in trace["traceEvents"]) > 40, (rank, step)
