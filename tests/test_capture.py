"""ProfilerHook's parts on their own, without a framework: the capture pipeline (a StepStats-backed RunMetadata
in, timeline and TensorBoard events out; back-pressure, keep_last, dropped outputs), `CaptureOptions`' checks,
and the trigger watch (StepObservations in, capture windows and fires out)."""

from __future__ import annotations

import importlib
import json
import logging
import math
import threading
import types

import pytest

import hookprof
from hookprof._runtime.background import WRITES
from hookprof.hooks import CaptureOptions, ProfilerHook, RunMetadata
from hookprof.hooks.capture import CapturePipeline, Retention
from hookprof.hooks.trigger_watch import CaptureWindow, TriggerWatch
from hookprof.step_stats import DeviceStepStats, NodeExecStats, StepStats
from hookprof.tensorboard.events import FrameworkStream
from hookprof.trace import ChromeTraceWriter
from hookprof.tracing import HOST_DEVICE, StepTraceCoordinator
from hookprof.triggers import NonFinite, StepObservation

SESSION = types.SimpleNamespace(rank=0, world_size=1, framework="none")


def traced_step(step: int) -> RunMetadata:
    """A traced step as a tracer hands it over: two ops on the host."""
    ops = [NodeExecStats(node_name=f"op{i}", op=f"aten::op{i}", start_ns=1_000 * i, duration_ns=500, thread_id=0)
           for i in range(2)]
    metadata = RunMetadata(StepStats([DeviceStepStats(HOST_DEVICE, ops, {0: "main"})]))
    metadata.step = step
    return metadata


class Sink:
    """An event stream that keeps what it is given."""

    def __init__(self):
        self.events = []

    def add_event(self, event):
        self.events.append(event)


def pipeline_for(tmp_path, **options):
    return CapturePipeline(ChromeTraceWriter(), CaptureOptions(**options))


def submit(pipeline, tmp_path, step, events=None, capture=None):
    path = str(tmp_path / f"timeline-{step}.json")
    pipeline.submit(step, traced_step(step), SESSION, path, str(tmp_path), events, capture)
    return path


def read(path):
    with open(path) as f:
        return json.load(f)


@pytest.mark.parametrize("render_worker", [True, False])
def test_the_pipeline_writes_a_steps_timeline_and_its_tensorboard_events(tmp_path, render_worker):
    pipeline = pipeline_for(tmp_path, render_worker=render_worker)  # (stats, no export: rendered here either way)
    sink = Sink()
    path = submit(pipeline, tmp_path, 3, FrameworkStream(sink))  # (a framework's writer as the run's stream)
    assert pipeline.saved_paths == [path]
    trace = read(path)
    assert {"aten::op0", "aten::op1"} <= {e.get("name") for e in trace["traceEvents"]}
    assert trace["metadata"]["framework"] == "none" and "skipped_traces" not in trace["metadata"]
    pytest.importorskip("tensorboard")
    assert [e.tagged_run_metadata.tag for e in sink.events if e.HasField("tagged_run_metadata")] == ["step_3"]
    assert pipeline.dropped_outputs == 0


def test_a_triggers_window_lands_in_the_file(tmp_path):
    pipeline = pipeline_for(tmp_path, render_worker=False)
    fire = {"kind": "non_finite", "step": 4, "detail": "loss = nan"}
    path = submit(pipeline, tmp_path, 5, capture=CaptureWindow([fire], [], 1))
    pipeline.flush()
    assert read(path)["metadata"]["trigger"] == fire


def test_a_full_write_queue_skips_the_step_and_the_next_file_counts_it(tmp_path, caplog):
    pipeline = pipeline_for(tmp_path, render_worker=False, max_pending_writes=1, write_grace_seconds=0)
    gate = threading.Event()
    WRITES.submit(lambda: gate.wait(30))  # a disk that takes nothing for now
    try:
        submit(pipeline, tmp_path, 1)
        pipeline._pending.wait()  # (rendered: its file waits for the disk)
        assert not pipeline.room_to_write()
        with caplog.at_level(logging.WARNING, logger="hookprof"):
            pipeline.skip(2, str(tmp_path))
            pipeline.skip(3, str(tmp_path))
    finally:
        gate.set()
    assert pipeline.skipped_traces == 2
    said = [r.getMessage() for r in caplog.records if "faster than the disk" in r.getMessage()]
    assert len(said) == 1 and "1 files wait" in said[0] and "step 2" in said[0]
    pipeline.flush()
    assert pipeline.room_to_write()
    path = submit(pipeline, tmp_path, 4)
    pipeline.flush()
    assert read(path)["metadata"]["skipped_traces"] == 2 and pipeline.skipped_since_file == 0


def test_keep_last_keeps_the_newest_files_the_pipeline_wrote(tmp_path):
    pipeline = CapturePipeline(ChromeTraceWriter(), CaptureOptions(render_worker=False), keep_last=2)
    paths = [submit(pipeline, tmp_path, step) for step in (1, 2, 3)]
    assert pipeline.saved_paths == paths[1:]
    assert sorted(p.name for p in tmp_path.glob("timeline-*")) == ["timeline-2.json", "timeline-3.json"]
    assert pipeline.retention.removed == 1


def test_retention_counts_only_what_it_removed(tmp_path):
    retention = Retention(1)
    first, second, third = (tmp_path / f"t{i}" for i in range(3))
    for path in (first, second, third):
        path.write_text("{}")
    assert retention.retain(str(first)) == []
    assert retention.retain(str(second)) == [str(first)] and retention.removed == 1
    second.unlink()  # removed by someone else: nothing to count
    assert retention.retain(str(third)) == [str(second)] and retention.removed == 1
    retention.reset()  # a new run: the last run's file is not this one's to remove
    other = tmp_path / "t3"
    other.write_text("{}")
    assert retention.retain(str(other)) == [] and third.exists()
    assert Retention(None).retain(str(other)) == []


def test_an_unwritable_timeline_is_counted_where_the_pipeline_was_told(tmp_path, caplog):
    owner = types.SimpleNamespace(dropped_outputs=0)
    pipeline = CapturePipeline(ChromeTraceWriter(), CaptureOptions(render_worker=False), counts=owner)
    (tmp_path / "a-file").write_text("")
    with caplog.at_level(logging.WARNING, logger="hookprof"):
        pipeline.submit(1, traced_step(1), SESSION, str(tmp_path / "a-file" / "timeline-1.json"), str(tmp_path),
                        None)
        pipeline.flush()
    assert pipeline.saved_paths == [] and owner.dropped_outputs == 1 and pipeline.dropped_outputs == 0
    assert any("Could not write timeline" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("options", "error", "message"), [
    ({"render_worker": "yes"}, TypeError, "`CaptureOptions(render_worker='yes')`: `render_worker` must be True or"),
    ({"render_timeout_seconds": 0}, ValueError, "`render_timeout_seconds` must be a number of seconds > 0"),
    ({"render_timeout_seconds": "300"}, TypeError, "`render_timeout_seconds` must be a number of seconds"),
    ({"max_pending_writes": 0}, ValueError, "`CaptureOptions(max_pending_writes=0)`: `max_pending_writes` must be"),
    ({"max_pending_writes": 2.5}, TypeError, "`max_pending_writes` must be an int >= 1"),
    ({"write_grace_seconds": -1}, ValueError, "`write_grace_seconds` must be a number of seconds > 0"),
    ({"write_grace_seconds": False}, TypeError, "`write_grace_seconds` must be a number of seconds"),
])
def test_capture_options_name_a_bad_argument(options, error, message):
    with pytest.raises(error) as caught:
        CaptureOptions(**options)
    assert message in str(caught.value)


def test_capture_options_defaults_and_the_hooks_argument(tmp_path):
    import dataclasses

    assert {f.name: f.default for f in dataclasses.fields(CaptureOptions)} == {
        "render_worker": True, "render_timeout_seconds": 300.0, "render_stall_seconds": 10.0, "max_pending_writes": 2,
        "write_grace_seconds": 0.05, "profile_tab": True}  # (docs/hooks.md's table says these)
    CaptureOptions(write_grace_seconds=0)  # 0 (no grace) is accepted, unlike other seconds
    assert hookprof.CaptureOptions is CaptureOptions
    hook = ProfilerHook(save_steps=1, output_dir=str(tmp_path), capture=CaptureOptions(max_pending_writes=5))
    assert hook.pipeline.options.max_pending_writes == 5
    assert ProfilerHook(save_steps=1).pipeline.options == CaptureOptions()
    with pytest.raises(TypeError, match=r"`ProfilerHook\(capture=\{'render_worker': False\}\)`: `capture` must be"):
        ProfilerHook(save_steps=1, capture={"render_worker": False})


def test_render_wait_seconds_is_accepted_as_render_stall_seconds_with_a_deprecation_warning(tmp_path):
    """`render_stall_seconds` was named `render_wait_seconds`: a caller that still passes it gets its value where the
    new name keeps it, and a DeprecationWarning, pointing at its own line, that names the new one."""
    with pytest.warns(DeprecationWarning) as caught:
        options = CaptureOptions(render_wait_seconds=3.0)
    assert [str(w.message) for w in caught] == [
        "CaptureOptions(render_wait_seconds=...) is deprecated: it is now named render_stall_seconds "
        "(CaptureOptions(render_stall_seconds=3.0))."]
    assert caught[0].filename == __file__
    assert options.render_stall_seconds == 3.0 and options == CaptureOptions(render_stall_seconds=3.0)
    hook = ProfilerHook(save_steps=1, output_dir=str(tmp_path), capture=options)
    assert hook.pipeline.options.render_stall_seconds == 3.0
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="`render_stall_seconds` must be"):
        CaptureOptions(render_wait_seconds=-1)  # checked as under its new name
    with pytest.raises(TypeError, match=r"pass render_stall_seconds only \(render_wait_seconds is its old name\)"):
        CaptureOptions(render_wait_seconds=3.0, render_stall_seconds=4.0)


# --- the trigger watch ----------------------------------------------------------------------------------------

def results(loss, batch=1):
    return {"fetch:loss": loss, "batch_idx": batch}


@pytest.fixture
def watch():
    watch = TriggerWatch([NonFinite("loss")], capture_steps=2, cooldown_steps=3)
    watch.begin()
    watch.start(types.SimpleNamespace(), writes_here=True, traces=StepTraceCoordinator())
    yield watch
    watch.stop()


def test_the_watch_asks_for_its_fetches_only_while_watching():
    watch = TriggerWatch([NonFinite("loss")], capture_steps=1, cooldown_steps=0)
    assert watch.step_begins() is None
    traces = StepTraceCoordinator()
    watch.start(types.SimpleNamespace(), writes_here=False, traces=traces)  # (a rank writing nothing watches nothing)
    assert not watch.watching and watch.step_begins() is None
    watch.start(types.SimpleNamespace(), writes_here=True, traces=traces)
    try:
        assert watch.watching and set(watch.step_begins()) == {"fetch:loss", "batch_idx"}
    finally:
        watch.stop()
    assert not watch.watching


def test_a_fire_opens_a_window_of_capture_steps_then_cools_down(watch, caplog):
    watch.step_begins()
    watch.step_ended(1, results(1.0), None, True)
    assert watch.pending is None and watch.fired == {}
    watch.step_begins()
    with caplog.at_level(logging.INFO, logger="hookprof"):
        watch.step_ended(2, results(math.nan), None, True, "out")
    window = watch.pending
    assert window is not None and window.left == 2 and window.fires[0]["kind"] == "non_finite"
    assert window.fires[0]["step"] == 2 and watch.fired == {"non_finite": 1}
    assert any("non_finite fired at step 2" in r.getMessage() and "steps 3..4 into 'out'" in r.getMessage()
               for r in caplog.records)
    watch.step_ended(3, results(math.nan), window, True)  # traced, and within the cooldown: no new fire
    assert watch.pending is window and window.left == 1 and watch.fired == {"non_finite": 1}
    watch.step_ended(4, results(1.0), window, True)
    assert watch.pending is None
    watch.step_ended(5, results(math.nan), None, True)  # (cooldown: steps up to 2 + 3)
    assert watch.pending is None and watch.fired == {"non_finite": 1}
    watch.step_ended(6, results(math.inf), None, True)
    assert watch.pending is not None and watch.fired == {"non_finite": 2}
    watch.begin()  # a new run: nothing pending, no cooldown; the count goes on
    assert watch.pending is None and watch.fired == {"non_finite": 2}


def test_a_rank_that_writes_nothing_counts_no_fire(watch):
    watch.step_ended(1, results(math.nan), None, False)
    assert watch.pending is None and watch.fired == {}


def test_observe_hands_each_trigger_its_fetch_and_a_bad_one_sits_out(caplog):
    watch = TriggerWatch([NonFinite("loss"), NonFinite("grad")], capture_steps=1, cooldown_steps=0)
    with caplog.at_level(logging.WARNING, logger="hookprof"):
        fires = watch.observe(StepObservation(7), {"fetch:loss": math.nan, "fetch:grad": "text"})
        watch.observe(StepObservation(8), {"fetch:loss": 1.0, "fetch:grad": "text"})
    assert fires == [{"kind": "non_finite", "step": 7, "detail": fires[0]["detail"]}]
    assert "loss" in fires[0]["detail"]
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1  # said once


def test_the_render_worker_preloads_what_render_step_needs():
    from hookprof.hooks import capture

    assert capture.render_step.__module__ in capture.WORKER_MODULES
    for name in capture.WORKER_MODULES:
        if name.startswith("hookprof."):
            importlib.import_module(name)


@pytest.mark.parametrize("starting, answered, waited", [(True, False, 10.0), (False, True, 0.3), (False, False, 0.3)],
                         ids=["starting", "answered", "none can run"])
def test_a_traced_step_waits_for_the_worker_its_own_cost_unless_the_worker_is_starting(monkeypatch, starting, answered,
                                                                                      waited):
    """A worker still starting (its interpreter and imports) gets `render_stall_seconds`; otherwise, one rendering
    earlier steps or none at all (renders then run in this process), the step's own cost. The wait is for the
    oldest step waiting for the worker, and only where RENDERS_IN_FLIGHT steps wait: the step gets its turn when
    one of them is done by then, and not otherwise."""
    from hookprof._runtime import worker
    from hookprof.hooks.capture import RENDERS_IN_FLIGHT

    class Rendering:
        def __init__(self, finishes):
            self.done, self.finishes, self.timeout = False, finishes, None

        def wait(self, timeout):
            self.timeout, self.done = timeout, self.finishes
            return self.done

    monkeypatch.setattr(worker, "WORKER", types.SimpleNamespace(starting=starting, answered=answered))
    pipeline = CapturePipeline(ChromeTraceWriter(), CaptureOptions(render_stall_seconds=10.0))
    pipeline._renders.extend(Rendering(True) for _ in range(RENDERS_IN_FLIGHT - 1))
    assert pipeline._render_turn(0.3)  # (a place is free: nothing is waited for)
    assert all(r.timeout is None for r in pipeline._renders)
    pipeline._renders.append(Rendering(False))
    pipeline._renders[0].finishes = True
    assert pipeline._render_turn(0.3)  # (the oldest finishes within the wait)
    oldest = pipeline._renders[0]
    assert oldest.timeout is None and len(pipeline._renders) == RENDERS_IN_FLIGHT - 1
    pipeline._renders.appendleft(first := Rendering(False))
    assert not pipeline._render_turn(0.3)  # (none finishes: no place)
    assert first.timeout == waited and len(pipeline._renders) == RENDERS_IN_FLIGHT
