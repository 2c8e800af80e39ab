"""One owner per fit: after a real `Trainer.fit` or `Model.fit` returns or raises, however it ended, nothing
hookprof started is left: no thread, no child process, no torch profiler or module hook, no wrapper on the
model, no JAX listener, and the garbage collector is on."""

from __future__ import annotations

import contextvars
import gc
import os
import threading

import keras
import lightning as L
import pytest
import torch

from hookprof._runtime import worker
from hookprof._runtime.background import drain_all
from hookprof._runtime.fit_run import FitRun, close_run, fit_call, on_fit_end, open_run
from keras_prof import HookCallback as KerasHookCallback
from keras_prof import ProfilerHook as KerasProfilerHook
from keras_prof.hook_callback import _TrainStepWatch
from lightning_prof import ProfilerHook, SummarySaverHook
from tests.conftest import RecordingHook, timeline_steps
from tests.lightning_models import TinyModel, loader, trainer
from tests.test_keras_prof import data as keras_data
from tests.test_keras_prof import model as keras_model


def leftovers() -> list[str]:
    """What of hookprof's is still running in this process."""
    found = [f"thread {t.name}" for t in threading.enumerate() if t.name.startswith("hookprof")]
    process = worker.WORKER._process
    if process is not None and process.poll() is None:
        found.append(f"render worker pid {process.pid}")
    children = _children()
    if children:
        found.append(f"child processes {children}")
    if torch._C._autograd._profiler_enabled():
        found.append("torch profiler enabled")
    from torch.nn.modules import module

    if module._global_forward_hooks or module._global_forward_pre_hooks:
        found.append("global module hooks")
    if not gc.isenabled():
        found.append("gc disabled")
    return found


def _children() -> list[int]:
    """This process's child processes that run hookprof code (others, a framework's or an earlier test's, are
    not hookprof's to stop)."""
    pid = os.getpid()
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(c) for c in f.read().split()]
        except FileNotFoundError:  # (a thread that ended meanwhile: hookprof's closing one, say)
            pass
    ours = []
    for child in children:
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"hookprof" in f.read():
                    ours.append(child)
        except OSError:  # (gone meanwhile)
            pass
    return ours


class RaiseIn(L.Callback):
    """Another callback that raises at a given hook of a given step."""

    def __init__(self, where: str, step: int):
        self.where, self.step = where, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.where == "batch_start" and trainer.global_step + 1 == self.step:
            raise RuntimeError("another callback failed")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.where == "batch_end" and trainer.global_step == self.step:
            raise RuntimeError("another callback failed")


@pytest.mark.parametrize("how", ["clean", "requested stop", "step raises", "other callback at batch start",
                                 "other callback at batch end"])
def test_lightning_fit_leaves_nothing_running(tmp_dir, how):
    hooks = [ProfilerHook(save_steps=2, output_dir=tmp_dir, show_memory=True),
             SummarySaverHook(save_steps=2, output_dir=tmp_dir,
                              summary_op=__import__("hookprof").summary.scalar("loss", lambda s: s.outputs["loss"]))]
    model = TinyModel(fail_at_step=5 if how == "step raises" else None)
    callbacks = list(hooks)
    if how == "requested stop":
        callbacks.append(__import__("lightning_prof").HookCallback([RecordingHook(stop_at=5)]))
    elif how.startswith("other callback"):
        # the step after a traced one (4): its trace is running when the other callback raises at its start
        callbacks.append(RaiseIn("batch_start" if how.endswith("start") else "batch_end", 4))
    fit = trainer(tmp_dir, callbacks, 8)
    if how in ("clean", "requested stop"):
        fit.fit(model, loader())
    else:
        with pytest.raises(RuntimeError):
            fit.fit(model, loader())
    assert leftovers() == []
    assert timeline_steps(tmp_dir)[:1] == [2]  # it did trace (a render worker and threads ran)


class KerasRaiseAtBatchBegin(keras.callbacks.Callback):
    def __init__(self, batch: int):
        super().__init__()
        self.batch = batch

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.batch:
            raise RuntimeError("another callback failed")


def failing_batches(n_ok: int):
    x, y = keras_data()
    for i in range(n_ok):
        yield x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8]
    raise RuntimeError("the data failed")


@pytest.mark.parametrize("how", ["clean", "step raises"])
def test_keras_fit_leaves_nothing_running(tmp_dir, how):
    model = keras_model(fail_at=None if how == "clean" else 4)
    hook = KerasProfilerHook(save_steps=2, output_dir=tmp_dir, show_memory=True)
    if how == "clean":
        model.fit(*keras_data(), batch_size=8, epochs=1, callbacks=[hook], verbose=0)
    else:
        with pytest.raises(RuntimeError, match="boom at step 4"):
            model.fit(*keras_data(), batch_size=8, epochs=1, callbacks=[hook], verbose=0)
    assert leftovers() == []
    assert not isinstance(model.train_function, _TrainStepWatch)
    assert timeline_steps(tmp_dir)[:1] == [2]


@pytest.mark.parametrize("where", ["another callback", "the data"])
def test_keras_fit_failing_outside_its_step_leaves_no_profiler_and_the_next_fit_cleans_up(tmp_dir, where):
    """Keras calls no callback when a fit fails outside its train step (another callback's
    `on_train_batch_begin`, the data). The traced step's tracer starts only inside the step, so such a failure
    at a traced step leaves no profiler or module hook running; the next fit of the model (with any
    callbacks) closes the failed fit's hooks, stops what it started and puts the model's own train function
    back."""
    model = keras_model()
    x, y = keras_data()
    hook = KerasProfilerHook(save_steps=2, output_dir=tmp_dir)
    # batch 3 is global step 4, traced (TF's schedule: timeline-2, then timeline-4)
    if where == "another callback":
        with pytest.raises(RuntimeError, match="another callback failed"):
            model.fit(x, y, batch_size=8, epochs=1, callbacks=[hook, KerasRaiseAtBatchBegin(3)], verbose=0)
    else:
        with pytest.raises(RuntimeError, match="the data failed"):
            model.fit(failing_batches(3), epochs=1, steps_per_epoch=6, callbacks=[hook], verbose=0)
    assert not torch._C._autograd._profiler_enabled()
    from torch.nn.modules import module

    assert not module._global_forward_hooks and not module._global_forward_pre_hooks
    drain_all()  # (the failed fit's last timeline may still be converting, its GC pause on: bounded work)
    assert gc.isenabled()
    other = os.path.join(tmp_dir, "second")
    recording = RecordingHook()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0,
              callbacks=[KerasHookCallback([recording]), KerasProfilerHook(save_steps=2, output_dir=other)])
    assert leftovers() == []
    assert not isinstance(model.train_function, _TrainStepWatch)
    assert timeline_steps(other) == [4, 6, 8]  # (the model's optimizer is at step 3: steps 4-9)
    assert timeline_steps(tmp_dir) == [2]  # the failed fit's last timeline, finished when it was closed
    assert recording.names()[-1] == "end"


@pytest.mark.parametrize("thread_ends", [True, False])
def test_a_keras_fit_that_failed_in_another_thread_does_not_keep_the_next_fits_worker_running(tmp_dir,
                                                                                               thread_ends):
    """A Keras fit in another thread whose data fails after traced steps (Keras tells no callback) counts as
    open no longer than its `Model.fit` call runs: a later fit of another model, in the main thread, stops
    the render worker and the threads at its end, whether the failed fit's thread has ended or lives on."""
    failed, go_on = [], threading.Event()
    hook = KerasProfilerHook(save_steps=2, output_dir=os.path.join(tmp_dir, "thread"))  # (kept, as a user might)

    def fit_in_thread():
        try:
            keras_model().fit(failing_batches(5), epochs=1, steps_per_epoch=8, callbacks=[hook], verbose=0)
        except RuntimeError as err:
            failed.append(err)
        if not thread_ends:
            go_on.wait(120)  # (a thread that lives on: a pool's, a server's)

    thread = threading.Thread(target=fit_in_thread, name="user-fit")
    thread.start()
    try:
        for _ in range(1200):
            if failed or not thread.is_alive():
                break
            threading.Event().wait(0.1)
        assert [str(err) for err in failed] == ["the data failed"]
        assert [os.path.basename(p) for p in hook.hook.saved_paths][:1] == ["timeline-2.json"]  # (the worker ran)
        if thread_ends:
            thread.join(60)
        other = os.path.join(tmp_dir, "main")
        keras_model().fit(*keras_data(), batch_size=8, epochs=1, verbose=0,
                          callbacks=[KerasProfilerHook(save_steps=2, output_dir=other)])
        assert timeline_steps(other)[:1] == [2]
        assert leftovers() == []
    finally:
        go_on.set()
        thread.join(60)


def test_a_fit_run_stops_what_registered_newest_first_once_and_outside_a_fit_nothing_registers():
    contextvars.Context().run(_fit_run_order)  # (a context of its own: no run left current by another test)


def _fit_run_order():
    order = []
    assert on_fit_end("a", order.append, "outside") is False
    run = open_run()
    assert on_fit_end("a", order.append, "a") and on_fit_end("b", order.append, "b")
    assert on_fit_end("a", order.append, "a again")  # (one stop per key)
    run.on_end("c", lambda: 1 / 0)  # a stop that raises: logged, the rest still run
    close_run(run)
    close_run(run)
    assert order == ["b", "a"]
    assert on_fit_end("d", order.append, "d") is False
    assert isinstance(run, FitRun) and run.closed


def test_a_fits_end_reads_the_threads_frames_once_for_every_open_fit_it_sweeps(monkeypatch):
    """Fits open in other threads, each named by the frame of its fit call: the one whose call has returned
    (a failed fit that told no one) is closed by the next fit to end, the running ones are left open, and that
    sweep reads every thread's frames (`sys._current_frames()`, which walks all threads) once, not once a fit."""
    import sys

    runs, closed, ready, go_on = {}, [], threading.Barrier(4), threading.Event()

    def fit(name, returns):
        def wait():
            ready.wait(30)
            go_on.wait(30)

        def framework_fit():  # (the framework's fit call: the run counts as open while it runs)
            runs[name] = open_run(fit_call=fit_call(sys._getframe()))
            runs[name].on_end("stop", closed.append, name)
            if not returns:
                wait()

        framework_fit()
        if returns:
            wait()  # (its thread lives on; its fit call has returned)

    threads = [threading.Thread(target=contextvars.Context().run, args=(fit, name, name == "failed"))
               for name in ("failed", "a", "b")]
    for thread in threads:
        thread.start()
    reads = []
    try:
        ready.wait(30)
        real = sys._current_frames
        monkeypatch.setattr(sys, "_current_frames", lambda: reads.append(1) or real())
        contextvars.Context().run(lambda: close_run(open_run()))
        monkeypatch.undo()
        assert closed == ["failed"] and not runs["a"].closed and not runs["b"].closed
        assert len(reads) == 1
    finally:
        go_on.set()
        for thread in threads:
            thread.join(30)
        for run in runs.values():
            close_run(run)


def test_the_jax_compile_listener_is_registered_for_a_fit_only():
    jax = pytest.importorskip("jax")
    from jax._src import monitoring

    from hookprof.tracing.jax_tracer import _ProgramCache

    programs = _ProgramCache()
    run = open_run()
    programs.listen()
    assert programs._on_event in monitoring.get_event_duration_listeners()
    jax.jit(lambda v: v * 3)(jax.numpy.ones(3)).block_until_ready()
    assert programs.compiles >= 1
    close_run(run)
    assert programs._on_event not in monitoring.get_event_duration_listeners()
    assert programs.hlo_epoch() is not None  # compiles it could not see: the next trace exports HLO


class TraceEveryStep(RecordingHook):
    """Asks for a full trace of every step."""

    def before_run(self, run_context):
        from hookprof import RunOptions, SessionRunArgs, TraceLevel

        return SessionRunArgs(options=RunOptions(trace_level=TraceLevel.FULL_TRACE))


def test_a_fit_that_ends_stops_only_its_own_trace_and_leaves_what_a_fit_in_another_thread_shares():
    """Two fits at once (each in its own thread's context): the first to end stops its own trace and leaves
    the second's running, with the render worker the second still uses; the last to end stops that too."""
    from hookprof import HookedSession, ManualSession, SessionRunArgs
    from hookprof.tracing import HostTracer, fit_traces

    drivers = {name: HookedSession([TraceEveryStep()], HostTracer) for name in "ab"}
    contexts = {name: contextvars.Context() for name in "ab"}  # (what two threads' callbacks run in)
    session = ManualSession()

    def in_fit(name, call, *args):
        return contexts[name].run(call, *args)

    for name, driver in drivers.items():
        in_fit(name, driver.begin)
        in_fit(name, driver.before_run, session, (name, 0), SessionRunArgs())
    traces = {name: in_fit(name, fit_traces) for name in "ab"}
    assert traces["a"] is not traces["b"] and all(t.active for t in traces.values())
    worker.WORKER.start()
    try:
        in_fit("a", drivers["a"].end, session)
        assert not traces["a"].active and in_fit("a", fit_traces) is None
        assert traces["b"].active and in_fit("b", fit_traces) is traces["b"]
        assert worker.WORKER._process is not None and worker.WORKER._process.poll() is None
        in_fit("b", drivers["b"].end, session)
        assert not traces["b"].active and worker.WORKER._process is None
    finally:
        worker.WORKER.stop()


@pytest.mark.parametrize("how", ["clean", "stop", "raises"])
def test_after_a_lightning_fit_its_callbacks_hold_neither_model_nor_trainer(tmp_dir, how):
    """Callbacks a user keeps (for `saved_paths`, for the next fit) let go of the fit's model and trainer."""
    import weakref

    from lightning_prof import CheckpointSaverHook, StopAtStepHook

    class Fails(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 3:
                raise RuntimeError("planted")

    hooks = [ProfilerHook(save_steps=2, output_dir=os.path.join(tmp_dir, "p")),
             SummarySaverHook(save_steps=2, output_dir=os.path.join(tmp_dir, "s"),
                              summary_op=__import__("hookprof").summary.scalar("loss", lambda s: s.outputs["loss"])),
             CheckpointSaverHook(os.path.join(tmp_dir, "c"), save_steps=3), StopAtStepHook(last_step=5)]
    model = TinyModel()
    fit_trainer = trainer(tmp_dir, [*hooks, Fails()] if how == "raises" else hooks, max_steps=5 if how == "stop" else 8)
    if how == "raises":
        with pytest.raises(RuntimeError, match="planted"):
            fit_trainer.fit(model, loader())
    else:
        fit_trainer.fit(model, loader())
    gone = weakref.ref(model), weakref.ref(fit_trainer)
    for callback in hooks:  # (Lightning itself gives every callback the model's `log`, and leaves it there)
        vars(callback).pop("log", None), vars(callback).pop("log_dict", None)
    del model, fit_trainer
    gc.collect()
    assert [ref() for ref in gone] == [None, None]
    assert hooks[0].saved_paths  # (the callbacks are alive, with what they wrote)


def test_a_keras_fit_that_fails_in_another_callbacks_epoch_end_leaves_nothing_running_once_it_returns(tmp_dir):
    """Another callback's `on_epoch_end` raises after traced steps: Keras tells no callback, and `fit` raises.
    Once the call has ended (its callback list is freed), the fit is closed: no render worker, thread or
    profiler of hookprof's is left, with no later fit to sweep it up."""

    class FailsAtEpochEnd(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            raise RuntimeError("epoch end failed")

    hook = KerasProfilerHook(save_steps=2, output_dir=os.path.join(tmp_dir, "prof"))
    try:
        keras_model().fit(*keras_data(), batch_size=8, epochs=2, verbose=0, callbacks=[hook, FailsAtEpochEnd()])
    except RuntimeError as err:
        assert str(err) == "epoch end failed"
    else:
        raise AssertionError("the fit did not fail")
    for _ in range(100):  # (closed on a thread of its own, once the list is freed)
        if not leftovers():
            break
        threading.Event().wait(0.1)
    assert leftovers() == []
    # (the worker ran; the close finished what it had been given: the fit may fail before a render is written)
    assert timeline_steps(os.path.join(tmp_dir, "prof"))[:1] == [2]
