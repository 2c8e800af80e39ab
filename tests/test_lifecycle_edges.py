"""Regression tests for the lifecycle edges a review found: accumulation, skipped batches, re-fits, two
callbacks, validation time, in-place writes through views, pid renumbering, writer threads."""

import os
import threading

import lightning as L
import torch

import hookprof
from hookprof import RunOptions, SessionRunArgs, TraceLevel, step_feeds
from hookprof.step_stats import NodeExecStats, TensorDescription
from hookprof.trace.merge import merge_timelines
from hookprof.trace.reader import load_trace
from hookprof.tracing.dataflow import OpData, find_edges
from lightning_prof import HookCallback, ProfilerHook
from tests.conftest import RecordingHook, timeline_steps
from tests.lightning_models import TinyModel, loader, trainer


def test_gradient_accumulation_counts_optimizer_steps(tmp_dir):
    rec = RecordingHook()
    hook = ProfilerHook(save_steps=2, output_dir=tmp_dir, tensorboard=False)
    trainer(tmp_dir, [hook, HookCallback([rec])], 8, accumulate_grad_batches=4).fit(TinyModel(), loader(n=256))
    assert [c[1] for c in rec.calls if c[0] == "after_run"] == list(range(1, 9))
    assert timeline_steps(tmp_dir) == [2, 4, 6, 8]
    trace = load_trace(hook.saved_paths[0])  # one TF step = the whole window: 4 forwards, 1 optimizer step
    forward = [e for e in trace["traceEvents"] if e.get("name") == "aten::addmm" and e["args"]["phase"] == "forward"]
    assert len(forward) == 4 * 2


class ManualOptimization(TinyModel):
    """Manual optimization that steps its optimizer every second batch."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = torch.nn.functional.mse_loss(self(batch[0]), batch[1])
        self.manual_backward(loss)
        if batch_idx % 2 == 1:
            opt.step()
            opt.zero_grad()
        return loss


class GlobalSteps(L.Callback):
    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append(trainer.global_step)


def test_manual_optimization_counts_its_optimizer_steps(tmp_dir):
    rec, seen = RecordingHook(), GlobalSteps()
    hook = ProfilerHook(save_steps=2, output_dir=tmp_dir, tensorboard=False)
    t = trainer(tmp_dir, [hook, HookCallback([rec]), seen], 4)
    t.fit(ManualOptimization(), loader())
    assert seen.steps == [0, 1, 1, 2, 2, 3, 3, 4]  # two batches per optimizer step
    assert [c[1] for c in rec.calls if c[0] == "before_run"] == [0, 1, 2, 3]
    assert [c[1] for c in rec.calls if c[0] == "after_run"] == [1, 2, 3, 4]
    assert timeline_steps(tmp_dir) == [2, 4]


def test_the_step_counter_found_is_lightnings_global_step(tmp_dir):
    """The callbacks read the global step from the counter behind `trainer.global_step` (a plain attribute
    instead of five properties); with automatic and with manual optimization it is that very number."""
    from lightning_prof.hook_callback import optimizer_step_counter

    for model, steps in ((TinyModel(), 5), (ManualOptimization(), 3)):
        t = trainer(tmp_dir, [], steps)
        t.fit(model, loader())
        counter = optimizer_step_counter(t, model)
        assert counter is not None and counter.completed == t.global_step == steps
        counter.completed += 1  # the same record, not a copy
        assert t.global_step == steps + 1


class SkipsBatches(TinyModel):
    def on_train_batch_start(self, batch, batch_idx):
        return -1 if batch_idx == 2 else None  # Lightning skips the rest of the epoch


def test_a_skipped_batch_is_aborted_and_nothing_keeps_running(tmp_dir):
    from torch.nn.modules import module as nn_module

    hooks_before = len(nn_module._global_forward_pre_hooks)
    rec = RecordingHook(options=RunOptions(trace_level=TraceLevel.FULL_TRACE))
    trainer(tmp_dir, [HookCallback([rec])], 20, max_epochs=1).fit(SkipsBatches(), loader())
    assert rec.names() == ["begin", "after_create_session"] + ["before_run", "after_run"] * 2 + ["before_run", "end"]
    assert not torch._C._autograd._profiler_enabled()
    assert len(nn_module._global_forward_pre_hooks) == hooks_before


def test_a_second_fit_with_the_same_callbacks_starts_its_own_schedule_and_run_dir(tmp_dir):
    hook = ProfilerHook(save_steps=3)
    dirs = []
    for _ in range(2):
        t = trainer(tmp_dir, [hook], 6)
        t.fit(TinyModel(), loader())
        dirs.append(t.log_dir)
    assert dirs[0] != dirs[1]
    for d in dirs:
        assert timeline_steps(d) == [3, 6]


class StopAt(hookprof.SessionRunHook):
    def __init__(self, loss):
        self.loss = loss


class Feeds(hookprof.SessionRunHook):
    def __init__(self, name, value):
        self.name, self.value = name, value

    def before_run(self, run_context):
        return SessionRunArgs(feed_dict={self.name: self.value})


class ReadsFeeds(TinyModel):
    seen: list = []

    def training_step(self, batch, batch_idx):
        self.seen.append(dict(step_feeds()))
        return super().training_step(batch, batch_idx)


def test_two_hook_callbacks_with_their_own_settings_and_feeds(tmp_dir):
    model = ReadsFeeds()
    model.seen = []
    callbacks = [HookCallback([StopAt(0.1), Feeds("lr_scale", 0.5)], name="lr"),
                 HookCallback([StopAt(0.2), Feeds("dropout", 0.1)], name="dropout")]
    trainer(tmp_dir, callbacks, 2).fit(model, loader())
    assert model.seen == [{"lr_scale": 0.5, "dropout": 0.1}] * 2


class SlowValidation(TinyModel):
    def validation_step(self, batch, batch_idx):
        import time

        time.sleep(0.2)
        return super().training_step(batch, batch_idx)


def test_validation_time_is_not_data_wait(tmp_dir):
    hook = ProfilerHook(save_steps=1, output_dir=tmp_dir, tensorboard=False)
    trainer(tmp_dir, [hook], 4, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0).fit(
        SlowValidation(), loader(), loader())
    assert len(hook.saved_paths) == 3  # steps 2..4 (the first step starts the count), each with its data wait
    for path in hook.saved_paths:
        waits = [e["dur"] for e in load_trace(path)["traceEvents"] if e.get("name") == "data_wait"]
        assert waits and all(w < 100_000 for w in waits), (path, waits)  # microseconds: never the 200 ms validation


def test_an_in_place_write_through_a_view_is_the_new_producer_of_the_whole_tensor():
    def node(name, start):
        return NodeExecStats(name, name, start, 5, 1)

    t = TensorDescription("float32", (4,), 16)
    whole, part = ("s", 0, 8, 4, "cpu"), ("s", 0, 4, 4, "cpu")
    addmm, mul_, relu = node("addmm", 0), node("mul_", 10), node("relu", 20)
    edges = find_edges([OpData(addmm, [], [(whole, t)]),
                        OpData(mul_, [(part, t)], [(part, t)], mutations=frozenset({0})),
                        OpData(relu, [(whole, t)], [])])
    assert [(e.producer.op, e.consumer.op) for e in edges] == [("mul_", "relu")]


def test_merge_renumbers_os_pids_without_collisions(tmp_path):
    import json

    paths = []
    for rank, pid in ((0, 1500), (1, 500)):
        path = tmp_path / f"r{rank}.json"
        path.write_text(json.dumps({"distributedInfo": {"rank": rank}, "baseTimeNanoseconds": 0, "traceEvents": [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "python"}},
            {"ph": "X", "name": f"op{rank}", "pid": pid, "tid": 1, "ts": 0, "dur": 1}]}))
        paths.append(str(path))
    merge_timelines(paths, str(tmp_path / "m.json"))
    ops = {e["name"]: e["pid"] for e in load_trace(str(tmp_path / "m.json"))["traceEvents"] if e["ph"] == "X"}
    assert ops == {"op0": 0, "op1": 1000}


def test_event_writer_threads_do_not_pile_up_across_fits(tmp_dir):
    from hookprof import summary

    op = summary.scalar("c", 1.0, collections=[])
    before = threading.active_count()
    for i in range(3):
        hook = hookprof.SummarySaverHook(save_steps=1, output_dir=os.path.join(tmp_dir, str(i)), summary_op=op)
        trainer(tmp_dir, [HookCallback([hook])], 2, logger=False).fit(TinyModel(), loader())
    assert threading.active_count() <= before + 1


def test_an_accumulated_step_has_a_phase_span_per_micro_batch_and_validation_its_own(tmp_dir):
    """accumulate_grad_batches=4: one traced step is one optimizer step whose phases are marked per
    micro-batch (forward, backward, after_backward, then the next batch's data wait), and a validation run
    inside the window is a span of its own, not part of a micro-batch's."""

    class Validated(TinyModel):
        def validation_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self(batch[0]), batch[1])

    hook = ProfilerHook(save_steps=2, output_dir=tmp_dir, tensorboard=False)
    fit = trainer(tmp_dir, [hook], 4, accumulate_grad_batches=4, val_check_interval=6, limit_val_batches=2)
    fit.fit(Validated(), loader(n=256), loader(n=32))
    traces = [load_trace(path) for path in hook.saved_paths]
    for trace in traces:
        phases = sorted((e for e in trace["traceEvents"] if e.get("cat") == "Span" and e.get("tid") == 0),
                        key=lambda e: e["ts"])
        names = [e["args"]["op"] for e in phases]
        assert [names.count(name) for name in ("forward", "backward", "optimizer")] == [4, 4, 1], names
        addmm = [e for e in trace["traceEvents"] if e.get("name") == "aten::addmm"]
        forward = [e for e in addmm if e["args"]["phase"] == "forward"]
        assert len(forward) == 4 * 2 and all(  # (before: three of four micro-batches sat in after_backward)
            any(s["args"]["op"] == "forward" and s["ts"] <= op["ts"] <= s["ts"] + s["dur"] for s in phases)
            for op in forward)
    # step 2 spans batches 4-7; Lightning validates after batch 5 (val_check_interval=6 batches): inside it,
    # a span of its own whose ops (2 batches, 2 addmm each) are validation's, not the step's forward
    validated = [t for t in traces if any(e.get("cat") == "Span" and e["args"].get("op") == "validation"
                                          for e in t["traceEvents"])]
    assert [t["metadata"]["step"] for t in validated] == [2]
    assert len([e for e in validated[0]["traceEvents"] if e.get("name") == "aten::addmm"
                and e["args"]["phase"] == "validation"]) == 2 * 2
