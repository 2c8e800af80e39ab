"""keras_prof against real `Model.fit` (torch backend) on a tiny model: schedules, content, lifecycle, faults."""

import logging
import os

import keras
import numpy as np
import pytest
import torch

import hookprof
from hookprof import RunOptions, TraceLevel
from keras_prof import HookCallback, ProfilerHook
from tests.conftest import NO_UNCLOSED_RESOURCES, FakeClock, RecordingHook, load_trace, op_events, timeline_steps

assert keras.backend.backend() == "torch"

pytestmark = NO_UNCLOSED_RESOURCES


class FailingSequential(keras.Sequential):
    """A Sequential whose train step raises at global step `fail_at` (1-based)."""

    fail_at: int | None = None

    def train_step(self, data):
        if self.fail_at is not None and int(self.optimizer.iterations) + 1 == self.fail_at:
            raise RuntimeError(f"boom at step {self.fail_at}")
        return super().train_step(data)


def model(fail_at=None):
    keras.utils.set_random_seed(0)
    m = FailingSequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="fc1"),
                           keras.layers.Dense(1, name="fc2")], name="tiny")
    m.fail_at = fail_at
    m.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return m


def data(n=48):
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, 8)).astype("float32"), rng.standard_normal((n, 1)).astype("float32")


def fit(m, callbacks, epochs=2, n=48):
    x, y = data(n)
    return m.fit(x, y, batch_size=8, epochs=epochs, callbacks=callbacks, verbose=0)


def test_save_steps_over_epochs_writes_exactly_the_expected_timelines(tmp_dir):
    hook = ProfilerHook(save_steps=4, output_dir=tmp_dir)
    fit(model(), [hook], epochs=2)  # 6 steps per epoch, 12 in all
    assert timeline_steps(tmp_dir) == [4, 8, 12]
    assert hook.saved_paths == [os.path.join(tmp_dir, f"timeline-{s}.json") for s in (4, 8, 12)]


def test_timeline_holds_forward_backward_and_optimizer_of_exactly_one_step(tmp_dir):
    hook = ProfilerHook(save_steps=3, output_dir=tmp_dir)
    fit(model(), [hook], epochs=1)
    assert timeline_steps(tmp_dir) == [3, 6]  # 6 steps: the loop below has both to read
    for path in hook.saved_paths:
        trace = load_trace(path)
        ops = op_events(trace)
        by_phase = {p: [e["name"] for e in ops if e["args"]["phase"] == p]
                    for p in ("forward", "backward", "optimizer")}
        assert by_phase["forward"].count("aten::relu") == 1
        assert sum(n.startswith("autograd::engine::evaluate_function") for n in by_phase["backward"]) >= 4
        assert by_phase["optimizer"], "the optimizer's update ops are in the trace"
        matmuls = [e for e in ops
                   if e["args"]["phase"] == "forward" and e["name"] in ("aten::addmm", "aten::matmul", "aten::mm")]
        assert {e["args"]["scope"] for e in matmuls} == {"tiny/fc1", "tiny/fc2"}
        span = next(e for e in op_events(trace, "Span") if e["args"]["op"] == "train_step")
        assert span["name"] == f"ProfilerStep#{trace['metadata']['step']}"
        assert all(span["ts"] <= e["ts"] and e["ts"] + e["dur"] <= span["ts"] + span["dur"] + 1 for e in ops)
        assert trace["metadata"]["framework"] == "keras"
        # the Step phases thread has the step's phases, as under Lightning, in order, each holding its ops
        phases = {e["args"]["op"]: e for e in op_events(trace, "Span")}
        assert [p for p in ("data_wait", "forward", "backward", "optimizer") if p in phases] == [
            "data_wait", "forward", "backward", "optimizer"]
        for name in ("forward", "backward", "optimizer"):
            inside = [e for e in ops if e["args"]["phase"] == name
                      and phases[name]["ts"] <= e["ts"] <= phases[name]["ts"] + phases[name]["dur"]]
            assert inside, name
        assert phases["forward"]["ts"] + phases["forward"]["dur"] == pytest.approx(phases["backward"]["ts"], abs=1)


def test_save_secs_triggers_on_time_not_steps(tmp_dir):
    clock = FakeClock()

    class Tick(hookprof.SessionRunHook):
        def after_run(self, run_context, run_values):
            clock.now += 3

    hook = hookprof.ProfilerHook(save_secs=7, output_dir=tmp_dir, clock=clock)
    fit(model(), [HookCallback([Tick(), hook])], epochs=2)
    # The count starts at t=3 (end of step 1); step k starts at t=3(k-1). Step 5 starts at t=12 >= 3+7 and
    # fires; its end (t=15) restarts the count; step 9 starts at t=24 >= 22. A steps schedule of 3 or 4
    # would give other numbers; 12 steps and 36 s give exactly these two.
    assert timeline_steps(tmp_dir) == [5, 9]


def test_lifecycle_order_and_fetches(tmp_dir):
    hook = RecordingHook(fetches={"loss": "loss", "step": "global_step"})
    fit(model(), [HookCallback([hook])], epochs=1, n=24)
    assert hook.calls == [
        ("begin",), ("after_create_session",),
        ("before_run", 0), ("after_run", 1), ("before_run", 1), ("after_run", 2),
        ("before_run", 2), ("after_run", 3), ("end",),
    ]
    assert [r["step"] for r in hook.results] == [1, 2, 3]
    assert all(np.isfinite(float(r["loss"])) for r in hook.results)


def test_batch_is_visible_to_fetches(tmp_dir):
    hook = RecordingHook(fetches=lambda s: tuple(s.batch[0].shape))
    fit(model(), [HookCallback([hook])], epochs=1, n=20)
    assert hook.results == [(8, 8), (8, 8), (4, 8)]


def test_request_stop_ends_training_after_that_step(tmp_dir):
    hook = RecordingHook(stop_at=4)
    m = model()
    fit(m, [HookCallback([hook])], epochs=5)
    assert int(m.optimizer.iterations) == 4
    assert hook.names()[-2:] == ["after_run", "end"]


def test_exception_in_a_step_no_after_run_no_end_profiler_stopped_and_next_fit_traces(tmp_dir):
    hook = RecordingHook(options=RunOptions(trace_level=TraceLevel.FULL_TRACE))
    with pytest.raises(RuntimeError, match="boom at step 3"):
        fit(model(fail_at=3), [HookCallback([hook])], epochs=1)
    assert hook.names() == ["begin", "after_create_session"] + ["before_run", "after_run"] * 2 + ["before_run"]
    assert not torch._C._autograd._profiler_enabled()

    again = ProfilerHook(save_steps=2, output_dir=tmp_dir)
    fit(model(), [again], epochs=1)
    assert timeline_steps(tmp_dir) == [2, 4, 6]
    assert "aten::relu" in [e["name"] for e in op_events(load_trace(again.saved_paths[0]))]


def test_a_fit_walks_the_stack_once_to_find_its_model_fit_call(tmp_dir, monkeypatch):
    """Which `Model.fit` call a fit is (its callback list, and the call its run ends with if it fails without
    telling its callbacks) is found in one walk up the stack when the fit begins, however many hookprof
    callbacks it has: not again at its first step."""
    from keras_prof import hook_callback

    walks, real = [], hook_callback._fit_frame
    monkeypatch.setattr(hook_callback, "_fit_frame", lambda *args: walks.append(args) or real(*args))
    recorder = RecordingHook()
    fit(model(), [ProfilerHook(save_steps=2, output_dir=tmp_dir), HookCallback([recorder])], epochs=1)
    assert timeline_steps(tmp_dir) == [2, 4, 6] and recorder.names()[-1] == "end"
    assert len(walks) == 1


def test_resume_continues_from_the_optimizer_iterations(tmp_dir):
    m = model()
    first = ProfilerHook(save_steps=4, output_dir=tmp_dir)
    fit(m, [first], epochs=1)  # 6 steps: timeline 4... then the same model trains on
    second = ProfilerHook(save_steps=4, output_dir=tmp_dir)
    second.hook.load_state_dict(first.hook.state_dict())
    fit(m, [second], epochs=1)  # global steps 7..12
    assert timeline_steps(tmp_dir) == [4, 8, 12]


def test_output_dir_that_cannot_be_created_fails_before_the_first_step(tmp_dir):
    hook = RecordingHook()
    bad = hookprof.ProfilerHook(save_steps=1, output_dir="/proc/hookprof-cannot-exist")
    with pytest.raises(ValueError, match=r"output_dir=.*cannot write there"):
        fit(model(), [HookCallback([bad, hook])], epochs=1)
    assert "before_run" not in hook.names()


def test_default_home_is_logs_train_beside_the_summaries(tmp_dir, monkeypatch):
    from hookprof import summary
    from keras_prof import SummarySaverHook

    monkeypatch.chdir(tmp_dir)
    hooks = [ProfilerHook(save_steps=2), SummarySaverHook(save_steps=2, summary_op=summary.scalar(
        "loss", lambda step: step.outputs["loss"], collections=[]))]
    fit(model(), hooks, epochs=1, n=32)
    train = os.path.join(tmp_dir, "logs", "train")
    assert sorted(n for n in os.listdir(train) if n.startswith("timeline-")) == ["timeline-2.json", "timeline-4.json"]
    (events,) = [n for n in os.listdir(train) if n.startswith("events.out.tfevents")]  # one stream, both hooks
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(train, size_guidance={"run_metadata": 0, "tensors": 0})
    acc.Reload()
    assert sorted(acc.Tags()["run_metadata"]) == ["step_2", "step_4"] and "loss" in acc.Tags()["tensors"]
    assert not [n for n in os.listdir(tmp_dir) if n.startswith("timeline-")]  # nothing in the working dir


def test_a_schedule_longer_than_the_fit_says_so_once(tmp_dir, caplog):
    hook = ProfilerHook(save_secs=3600, output_dir=tmp_dir)
    fit(model(), [hook], epochs=1, n=24)
    assert hook.saved_paths == []
    warnings = [r.getMessage() for r in caplog.records if "wrote no timeline" in r.getMessage()]
    assert len(warnings) == 1
    assert "first comes 3600 s after the first step" in warnings[0] and "ran 3 steps" in warnings[0]
    assert "lower save_secs" in warnings[0]


def test_evaluate_and_predict_say_once_that_they_run_no_hooks_and_a_fits_validation_does_not(tmp_dir, caplog,
                                                                                            monkeypatch):
    from hookprof._runtime.warn_once import WarnOnce
    from keras_prof import hook_callback

    m = model()
    x, y = data()
    hook = ProfilerHook(save_steps=2, output_dir=tmp_dir)
    with caplog.at_level(logging.WARNING, logger="keras_prof"):
        monkeypatch.setattr(hook_callback, "_warn_once", WarnOnce(hook_callback.log))  # (once per process)
        fit(m, [hook], epochs=1)
        m.fit(x, y, batch_size=8, epochs=1, validation_data=(x, y), callbacks=[hook], verbose=0)
        assert [r for r in caplog.records if "runs none of them" in r.getMessage()] == []
        for _ in range(2):
            m.evaluate(x, y, batch_size=8, callbacks=[hook], verbose=0)
            m.predict(x, batch_size=8, callbacks=[hook], verbose=0)
    said = [r.getMessage() for r in caplog.records if "runs none of them" in r.getMessage()]
    assert len(said) == 2 and "Model.evaluate" in said[0] and "Model.predict" in said[1]


def test_a_second_model_into_the_same_directory_keeps_the_first_ones_timelines(tmp_dir, monkeypatch, caplog):
    """Two models fit one after the other in one process, both into Keras' default logs/train: the second's
    timelines go beside the first's (`timeline-4.1.json`), with one warning; none is overwritten."""
    monkeypatch.chdir(tmp_dir)
    first, second = ProfilerHook(save_steps=4, tensorboard=False), ProfilerHook(save_steps=4, tensorboard=False)
    fit(model(), [first], epochs=1)
    other = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3, name="other")], name="other")
    other.compile(optimizer="sgd", loss="mse")
    with caplog.at_level(logging.WARNING):
        fit(other, [second], epochs=1)
    out = os.path.join(tmp_dir, "logs", "train")
    assert [os.path.basename(p) for p in first.saved_paths] == ["timeline-4.json"]
    assert [os.path.basename(p) for p in second.saved_paths] == ["timeline-4.1.json"]
    def models(name):
        return {e["args"].get("scope", "").split("/")[0] for e in op_events(load_trace(os.path.join(out, name)))}

    assert "tiny" in models("timeline-4.json") and "other" in models("timeline-4.1.json")
    (warning,) = [r.getMessage() for r in caplog.records if "exists" in r.getMessage()]
    assert "timeline-4.json" in warning and "timeline-4.1.json" in warning


# The ini's ignore of Keras' own numpy-copy DeprecationWarning is lifted here: the same fit without hookprof's
# callbacks and with every keras_prof hook that reads values (the global step, the loss, a kernel variable).
@pytest.mark.filterwarnings("error::DeprecationWarning", "error::ResourceWarning")
def test_a_fit_with_every_keras_prof_hook_adds_no_deprecation_or_resource_warning(tmp_dir):
    import keras_prof
    from hookprof import summary
    from hookprof.triggers import NonFinite

    fit(model(), [])  # Keras alone: no warning to begin with
    op = summary.merge([summary.scalar("loss", lambda step: step.outputs["loss"]),
                        summary.histogram("fc1/kernel", lambda step: step.model.get_layer("fc1").kernel)])
    profiler = ProfilerHook(save_steps=3, output_dir=tmp_dir, triggers=[NonFinite("loss")])
    summaries = keras_prof.SummarySaverHook(save_steps=2, output_dir=tmp_dir, summary_op=op)
    fit(model(), [profiler, summaries, keras_prof.StepCounterHook(every_n_steps=2, output_dir=tmp_dir),
                  keras_prof.LoggingTensorHook({"loss": "loss"}, every_n_iter=2), keras_prof.NanTensorHook("loss")])
    assert timeline_steps(tmp_dir) == [3, 6, 9, 12] and summaries.hook.summary_errors == 0


def test_a_jax_train_function_given_loaded_batches_gets_them_as_they_are():
    """Keras on JAX before 3.7 hands `train_function(state, data)` a list of batches it loaded already; 3.7+ an
    iterator, whose first batch keras_prof fetches before the trace starts (the data wait). A list passes as it
    is (`next` on it failed the fit)."""
    import types

    from keras_prof.hook_callback import _TrainStepWatch

    class Driver:
        trace_pending, watched, started = True, False, 0

        def start_trace(self):
            self.started += 1

    seen = []
    fit = types.SimpleNamespace(ended=False, driver=Driver(), fetches_in_step=True, close=lambda: None,
                                session=types.SimpleNamespace(steps_per_run=1))
    watch = _TrainStepWatch(lambda state, data: seen.append(data) or "ran", fit)
    batches = [("x", "y")]
    assert watch("state", batches) == "ran" and seen == [batches]
    fetched = []
    assert watch("state", (fetched.append(b) or b for b in ["a", "b"])) == "ran"
    assert fetched == ["a"]  # the iterator's first batch was fetched before the step, the rest left to it
    assert list(seen[1]) == ["a", "b"] and fit.driver.started == 2
    # a call that nothing traces or watches gets Keras' own iterator, unwrapped (no cost per batch)
    fit.driver.trace_pending = False
    iterator = iter(["c"])
    assert watch("state", iterator) == "ran" and seen[2] is iterator
    fit.driver.watched = True  # (a trigger watches a call of one batch: nothing to time inside it)
    iterator = iter(["d"])
    assert watch("state", iterator) == "ran" and seen[3] is iterator
    fit.session.steps_per_run = 4  # (one of several: the later batches' fetches are its data waits)
    assert watch("state", iter(["e"])) == "ran" and type(seen[4]).__name__ == "WaitedBatches"


@pytest.mark.parametrize("epochs, started", [(2, True), (1, False)])
def test_a_fit_whose_schedule_traces_starts_the_render_worker_with_its_first_step(tmp_dir, epochs, started):
    """Keras' epochs times batches say whether step 10 comes: 2 epochs of 6 batches trace it, and the worker
    runs from the second batch on; 1 epoch starts none."""
    from hookprof._runtime import worker

    class WorkerSeen(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.running = []

        def on_train_batch_begin(self, batch, logs=None):
            process = worker.WORKER._process
            self.running.append(process is not None and process.poll() is None)

    seen = WorkerSeen()
    hook = ProfilerHook(save_steps=10, output_dir=tmp_dir, tensorboard=False)
    m = model()
    fit(m, [seen, hook], epochs=epochs)
    assert seen.running[:2] == [False, started] and all(r == started for r in seen.running[1:9])
    assert len(hook.saved_paths) == int(started)
    # the same model fit on: its schedule goes on (traces at 20 with 2 more epochs, 10 with 1 after 6 steps)
    seen.running.clear()
    fit(m, [seen, hook], epochs=2)
    assert seen.running[:2] == [False, True] and len(hook.saved_paths) == int(started) + 1


def test_a_fit_from_a_later_epoch_counts_only_the_epochs_it_runs(tmp_dir):
    """`initial_epoch=1` of `epochs=2` runs one epoch of 6 steps: `save_steps=10` traces nothing, and no render
    worker starts."""
    from hookprof._runtime import worker

    class WorkerSeen(keras.callbacks.Callback):
        running = []

        def on_train_batch_begin(self, batch, logs=None):
            self.running.append(worker.WORKER._process is not None)

    seen = WorkerSeen()
    hook = ProfilerHook(save_steps=10, output_dir=tmp_dir, tensorboard=False)
    x, y = data()
    model().fit(x, y, batch_size=8, epochs=2, initial_epoch=1, callbacks=[seen, hook], verbose=0)
    assert seen.running == [False] * 6 and hook.saved_paths == []
