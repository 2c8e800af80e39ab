"""A traced step converted as its fit's last converted step was (`hookprof.tracing.kineto_replay`): in real
Lightning fits, each step so converted equals its conversion in full, field for field and in every output; a
step whose ops, nesting, phases or sequence numbers differ is converted in full."""

import dataclasses

import lightning as L
import pytest

from hookprof.run_options import RunOptions, TraceLevel
from hookprof.step_stats import StepStats
from hookprof.tracing import kineto_replay
from hookprof.tracing.kineto_trace import _convert
from hookprof.tracing.torch_tracer import TorchTracer
from tests.conftest import skip_where_cuda_started
from tests.lightning_models import TinyModel, loader, trainer
from tests.test_step_clock import TwoOptimizers
from tests.test_step_identity import AdamModel, kineto_events, rendered

OPS = RunOptions(trace_level=TraceLevel.FULL_TRACE)
DATAFLOW = RunOptions(trace_level=TraceLevel.FULL_TRACE, record_dataflow=True)
TENSORS = RunOptions(trace_level=TraceLevel.FULL_TRACE, record_dataflow=True, record_memory=True)


class BothConversions(L.Callback):
    """Traces every step of the fit with one fit's tracer and converts each export twice: in full (as a step of
    no fit) and as the render worker converts it (its fit's last conversion replayed where the ops are the
    same); keeps (full, as converted) in order."""

    def __init__(self, options, batches=1):
        self.options, self.state, self.steps, self.batches = options, {}, [], batches

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % self.batches == 0:  # (an optimizer step's micro-batches traced together, as hookprof does)
            self.tracer = TorchTracer(pl_module)
            self.tracer.bind_fit(self.state)
            self.tracer.start(self.options)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx % self.batches != self.batches - 1:
            return
        exported = self.tracer.stop_recording().export()
        full = dataclasses.replace(exported, fit=None).to_stats()
        self.steps.append((full, exported.to_stats()))


def counted_replays(monkeypatch):
    """The steps converted as their fit's last one was, counted as they are."""
    replays = []
    replay = kineto_replay.Conversion.replay

    def counted(self, *args):
        found = replay(self, *args)
        replays.append(found is not None)
        return found

    monkeypatch.setattr(kineto_replay.Conversion, "replay", counted)
    return replays


def counted_recordings(monkeypatch):
    """The conversions recorded for a fit's next steps (`kineto_replay.Conversion`), counted as they are made."""
    recorded = []
    made = kineto_replay.Conversion.__init__

    def counted(self, *args):
        recorded.append(True)
        made(self, *args)

    monkeypatch.setattr(kineto_replay.Conversion, "__init__", counted)
    return recorded


def fields(stats):
    """Every field of every node (times included), the threads' names and the step's metadata."""
    return ([(dev.device, [dataclasses.astuple(node) for node in dev.node_stats], dev.thread_names)
             for dev in stats.dev_stats], stats.metadata)


@pytest.mark.parametrize("options", [OPS, DATAFLOW, TENSORS], ids=["ops", "dataflow", "dataflow+memory"])
@pytest.mark.parametrize("fit", ["sgd", "adam", "accumulation", "two optimizers"])
def test_a_step_converted_as_its_fits_last_one_equals_its_conversion_in_full(tmp_dir, monkeypatch, options, fit):
    skip_where_cuda_started()
    replays = counted_replays(monkeypatch)
    steps = BothConversions(options, batches=2 if fit == "accumulation" else 1)
    if fit == "accumulation":
        trainer(tmp_dir, [steps], 8, logger=False, accumulate_grad_batches=2).fit(TinyModel(), loader(n=192))
    elif fit == "two optimizers":  # (two optimizer steps a batch)
        trainer(tmp_dir, [steps], 16, logger=False).fit(TwoOptimizers(), loader(n=96))
    else:
        trainer(tmp_dir, [steps], 8, logger=False).fit(TinyModel() if fit == "sgd" else AdamModel(), loader(n=96))
    assert len(steps.steps) == 8
    for number, (full, converted) in enumerate(steps.steps):
        assert fields(converted) == fields(full), number
        assert rendered(converted) == rendered(full), number
    # (most steps were converted as the one before: an epoch's first and last steps, Adam's first, differ)
    assert sum(replays) >= len(steps.steps) // 2, replays


def span(name, ts, dur, external_id, sequence=-1, tid=1):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid,
            "args": {"External id": external_id, "Sequence number": sequence}}


def step_events(first_id, nested=True, late_update=True, sequences=(5, 5)):
    """A step's export: a forward op with a nested one (or one after the other), a backward function (on a thread
    of its own, as autograd's on CUDA), and an update that starts after its end (or before it: forward by the
    phase rule)."""
    inner_start = 2 if nested else 12
    return [span("aten::linear", 0, 10, first_id, sequences[0]),
            span("aten::addmm", inner_start, 5, first_id + 1),
            span("autograd::engine::evaluate_function: AddmmBackward0", 20, 10 if late_update else 25, first_id + 2,
                 sequences[1], tid=2),
            span("aten::add_", 40, 3, first_id + 3)]


def converted(events, fit):
    stats = StepStats()
    rows = _convert(kineto_events(events), 1_000_000, stats, True, False, True, [], None, fit)
    return stats, rows.rows(), rows.by_external_id()


@pytest.mark.parametrize("change", ["nesting", "phase", "sequence numbers", "name", "shapes"])
def test_a_step_whose_times_or_ops_decide_otherwise_is_converted_in_full(monkeypatch, change):
    """The same ops (names, threads, arguments) are not enough: times that nest them otherwise, or put an op on the
    other side of the backward's end, or sequence numbers that are not the last step's shifted, are each step's
    own; a step with another op or other shapes is another step. Each such step is converted in full and equals
    its conversion with no fit's; the step after it, like it, is converted as it was."""
    replays = counted_replays(monkeypatch)
    fit = f"replay-test-{change}"
    first = step_events(100)
    other = {"nesting": step_events(200, nested=False), "phase": step_events(200, late_update=False),
             "sequence numbers": step_events(200, sequences=(5, 9)), "name": step_events(200),
             "shapes": step_events(200)}[change]
    if change == "name":
        other[1]["name"] = "aten::mm"
    if change == "shapes":
        other[1]["args"]["Input Dims"] = [[4, 8], [8, 2]]
    again = [dict(event, args=dict(event["args"])) for event in other]
    for event in again:
        event["args"]["External id"] += 100
        if event["args"]["Sequence number"] >= 0:
            event["args"]["Sequence number"] += 3
    converted(first, fit)
    for events, replayed in ((step_events(300), True), (other, False), (again, True)):
        stats, rows, by_id = converted(events, fit)
        full_stats, full_rows, full_by_id = converted(events, None)
        assert fields(stats) == fields(full_stats)
        assert [row[1:] for row in rows] == [row[1:] for row in full_rows]
        assert {key: dataclasses.astuple(node) for key, node in by_id.items()} == \
            {key: dataclasses.astuple(node) for key, node in full_by_id.items()}
        assert replays[-1] is replayed, (change, events)
    if change == "phase":  # (what the full conversion decided otherwise)
        assert {node.op: node.phase for node in converted(other, None)[0].all_nodes()}["aten::add_"] == "forward"


def test_a_fit_whose_steps_are_never_converted_alike_stops_recording_them(monkeypatch):
    """Recording a step's conversion costs about half a conversion more: a fit whose steps never repeat their ops
    records none after `FitConversions.MISSES_MAX` misses in a row, and converts each step in full."""
    recorded = counted_recordings(monkeypatch)
    fit = "replay-test-never"
    for number in range(6):
        events = step_events(100 * number + 100)
        events[1]["name"] = f"aten::op{number}"  # (each step's ops its own)
        stats = converted(events, fit)[0]
        assert fields(stats) == fields(converted(events, None)[0])
    conversions = kineto_replay.CONVERSIONS.recall(fit)
    assert conversions.off and not conversions.kept
    assert len(recorded) == kineto_replay.FitConversions.MISSES_MAX  # (the first step's, and a miss's)


def test_the_usual_steps_conversion_outlives_an_odd_step(monkeypatch):
    """An odd step (an epoch's last one, logging its metrics) is converted in full and kept; the usual step after
    it is converted as the usual one before it was (the fit keeps its last two kinds of steps)."""
    replays = counted_replays(monkeypatch)
    fit = "replay-test-odd"
    odd = step_events(300)
    odd.append(span("aten::copy_", 50, 1, 304))
    for number, events in enumerate((step_events(100), step_events(200), odd, step_events(400), step_events(500))):
        stats = converted(events, fit)[0]
        assert fields(stats) == fields(converted(events, None)[0]), number
    # (the second step fits the first's; the odd one fits neither kept; the fourth fits the first's, once the
    # odd one's did not)
    assert replays == [True, False, False, True, True]
    assert len(kineto_replay.CONVERSIONS.recall(fit).kept) == kineto_replay.FitConversions.KEPT


def conv_step(first_id, stride):
    """A step of one convolution, its stride among its scalar arguments (which its flops follow)."""
    return [{"ph": "X", "cat": "cpu_op", "name": "aten::conv2d", "ts": 0, "dur": 10, "tid": 1,
             "args": {"External id": first_id, "Sequence number": -1,
                      "Input Dims": [[1, 3, 8, 8], [4, 3, 3, 3], [4], [], [], [], []],
                      "Input type": ["float", "float", "float", "ScalarList", "ScalarList", "ScalarList", "Scalar"],
                      "Concrete Inputs": ["", "", "", f"[{stride}, {stride}]", "[0, 0]", "[1, 1]", "1"]}}]


def test_a_convolution_whose_stride_changed_is_converted_in_full(monkeypatch):
    """A convolution's flops follow its scalar arguments (stride, padding, dilation, groups): a step whose
    convolution's stride changed is not converted as the last one was, and counts its own flops."""
    replays = counted_replays(monkeypatch)
    fit = "replay-test-conv"
    flops = []
    for number, stride in enumerate((1, 1, 2)):
        stats = converted(conv_step(100 * number + 100, stride), fit)[0]
        assert fields(stats) == fields(converted(conv_step(100 * number + 100, stride), None)[0])
        flops.append(stats.dev_stats[0].node_stats[0].args["flops"])
    assert replays == [True, False]
    assert flops[0] == flops[1] > flops[2] > 0


def test_a_kept_conversion_holds_no_part_of_its_steps_export():
    """The argument lists a kept conversion compares are its own copies: the export's bytes (about 10 MB at 20k
    ops), which the decoded events' lists are views of, are not kept alive by it for the rest of the fit."""
    import gc
    import sys

    import orjson

    from hookprof.tracing.kineto_events import decode_trace

    fit = "replay-test-export"
    events = conv_step(100, 1) + step_events(200)
    for event in events:
        event["args"].setdefault("Input Dims", [[4, 8]])
        event["args"].setdefault("Input type", ["float"])
    raw = orjson.dumps({"traceEvents": events})
    held = sys.getrefcount(raw)
    decoded = decode_trace(raw)
    assert sys.getrefcount(raw) > held  # (the decoded lists are views of it)
    _convert(decoded.traceEvents, 0, StepStats(), True, False, True, [], None, fit)
    del decoded
    gc.collect()
    assert kineto_replay.CONVERSIONS.recall(fit).kept
    assert sys.getrefcount(raw) == held


def test_a_step_converted_as_one_whose_ops_fit_a_template_is_compared_with_a_new_template():
    """What `borrow` found of a conversion's ops holds for the template it found it with: a step converted as
    that one was, borrowing from a template made since (a walk again), is compared with the new one, and told
    apart where its ops differ from it."""
    from hookprof.step_stats import TensorDescription
    from hookprof.tracing.step_identity import SIGNATURE, IdentityTemplate, borrow

    def step(first_id):
        events = [dict(span("aten::empty", 0, 5, first_id), args={"External id": first_id, "Input Dims": [[4]],
                                                                   "Input type": ["float"]}),
                  dict(span("aten::relu", 8, 1, first_id + 1), args={"External id": first_id + 1,
                                                                      "Input Dims": [[4]], "Input type": ["float"]}),
                  {"ph": "i", "name": "[memory]", "ts": 1, "tid": 1,
                   "args": {"Bytes": 64, "Addr": 100, "Device Type": 0}}]
        stats, instants = StepStats(), []
        rows = _convert(kineto_events(events), 0, stats, True, False, True, instants, None, "replay-test-template")
        return stats, rows, instants

    def template(rows, relu="aten::relu"):
        signatures = [row[SIGNATURE] for row in rows.rows()]
        signatures[1] = (relu, *signatures[1][1:])
        return IdentityTemplate(signatures, [[], [(0, ("made", 0, 0), TensorDescription("float32", (16,), 64))]],
                                [frozenset(), frozenset()], {0: [(64, "/host:CPU")]})

    stats, rows, instants = step(100)
    first = template(rows)
    assert borrow(first, stats, rows, instants, 0, True, False) is None
    stats, rows, instants = step(200)
    assert isinstance(rows, kineto_replay.Replayed) and rows.matched(first) is not None
    assert borrow(first, stats, rows, instants, 0, True, False) is None and len(stats.edges) == 1
    walked_again = template(rows, relu="aten::gelu")  # (a template whose second op is another)
    stats, rows, instants = step(300)
    reason = borrow(walked_again, stats, rows, instants, 0, True, False)
    assert reason is not None and "aten::relu" in reason and not stats.edges


def test_a_fit_whose_steps_run_kernels_records_none_of_them(monkeypatch):
    """A step with kernels carries each launch's correlation id in its args: no two convert alike, so the fit's
    first such step stops the recording (which costs half a conversion more), not a miss after a miss."""
    recorded = counted_recordings(monkeypatch)
    fit = "replay-test-kernels"
    for number in range(3):
        events = step_events(100 * number + 100)
        events.append({"ph": "X", "cat": "kernel", "name": "gemm", "ts": 3, "dur": 2, "tid": 7,
                       "args": {"device": 0, "stream": 7, "correlation": number, "External id": 100 * number + 101}})
        stats = converted(events, fit)[0]
        assert fields(stats) == fields(converted(events, None)[0])
    assert kineto_replay.CONVERSIONS.recall(fit).off and not recorded


def test_a_keras_fits_steps_converted_alike_equal_their_conversion_in_full(monkeypatch):
    """Keras on torch (its own train step, Adam's scalars changing every step): each traced step converted as the
    fit's last one was equals its conversion in full, field for field and in every output."""
    import keras
    import numpy as np
    import torch

    skip_where_cuda_started()
    if torch.cuda.is_available():  # (Keras would train on the GPU: steps with kernels are never converted alike)
        pytest.skip("Keras on torch trains on the GPU here")
    replays = counted_replays(monkeypatch)
    steps = BothConversions(DATAFLOW)

    class Traced(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            steps.on_train_batch_start(None, self.model, None, batch)

        def on_train_batch_end(self, batch, logs=None):
            steps.on_train_batch_end(None, self.model, None, None, batch)

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="fc1"),
                              keras.layers.Dense(1, name="fc2")])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    rng = np.random.default_rng(0)
    model.fit(rng.standard_normal((64, 8)).astype("float32"), rng.standard_normal((64, 1)).astype("float32"),
              batch_size=8, epochs=1, callbacks=[Traced()], verbose=0)
    assert len(steps.steps) == 8
    for number, (full, converted) in enumerate(steps.steps):
        assert fields(converted) == fields(full), number
        assert rendered(converted) == rendered(full), number
    assert sum(replays) >= len(steps.steps) // 2, replays


def test_a_step_too_large_to_keep_leaves_no_conversion(monkeypatch):
    """A step of more nodes than the renderers keep parts of (`ShapedParts.KEEP_NODES_MAX`) leaves no conversion
    (about 0.4 KB a node, twice, for the rest of the fit), and its fit's later steps are not compared."""
    from hookprof.step_stats import ShapedParts

    recorded = counted_recordings(monkeypatch)
    monkeypatch.setattr(ShapedParts, "KEEP_NODES_MAX", len(step_events(100)) - 1)
    for number in range(3):
        events = step_events(100 * number + 100)
        assert fields(converted(events, "replay-test-large")[0]) == fields(converted(events, None)[0])
    assert not recorded and kineto_replay.CONVERSIONS.recall("replay-test-large").off
    monkeypatch.setattr(ShapedParts, "KEEP_NODES_MAX", len(step_events(100)))
    converted(step_events(400), "replay-test-small")
    assert recorded
