"""`HookCallback`: runs TF1-style `SessionRunHook`s inside Keras 3 `Model.fit`.

Mapping: `begin` and `after_create_session` <- `on_train_begin` (run when the fit's first batch starts, once
every callback's `on_train_begin` has run, so a restored optimizer step is seen); `before_run` <-
`on_train_batch_begin`; `after_run` <- `on_train_batch_end`; `end` <- `on_train_end` (a clean finish or
`stop_training`). All hookprof callbacks of one fit share one driver (TF's one MonitoredSession): the first
to see a batch runs every hook of all of them, in the callbacks' order; the others return at once.
Keras has no exception callback, so during the fit `model.train_function` is wrapped in a thin watcher that
keeps the step's batch and, when a step raises, stops a running trace and closes the hooks' files; the
model's own function is put back when the fit ends or fails.
`run_context.session` is a `KerasSession`: `.model`, `.global_step` (`optimizer.iterations`), `.run(fetches)`;
a fetch name looks up the step's logs (`"loss"`, metrics); `request_stop()` sets `model.stop_training`.
With the torch backend steps are traced with torch.profiler, with the JAX backend with JAX's profiler (XLA
ops); other backends get the host tracer (phase spans only) and one warning.
"""

from __future__ import annotations

import collections.abc
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import keras

from hookprof._runtime.fit_run import fit_call
from hookprof._runtime.warn_once import WarnOnce
from hookprof.hooks.feed_fn_hook import FeedFnHook
from hookprof.hooks.hooked_session import HookedSession, check_hooks
from hookprof.hooks.session import Session, StepState
from hookprof.hooks.session_run_hook import SessionRunArgs, SessionRunHook
from hookprof.summary import to_numpy
from hookprof.trace.format import DATA_WAIT
from hookprof.tracing import HostTracer, TracerFactory

log = logging.getLogger(__name__)
_warn_once = WarnOnce(log)
DEFAULT_LOG_DIR = os.path.join("logs", "train")  # where keras.callbacks.TensorBoard() writes training events


def event_sink(writer: Any) -> Any:
    """A `summary_writer` as hookprof's hooks take it: a Keras `TensorBoard` callback becomes its `train`
    directory, where it writes the training events."""
    if isinstance(writer, keras.callbacks.TensorBoard):
        return os.path.join(writer.log_dir, "train")
    return writer


class KerasSession(Session):
    """`run_context.session` under Keras: the model being fit; the global step is `optimizer.iterations`."""

    framework = "keras"

    def __init__(self, model: keras.Model, epoch_steps: int | None = None, epochs: int | None = None) -> None:
        """`epochs`: those the fit runs (Keras' `epochs` less its `initial_epoch`), None: unknown."""
        super().__init__(model=model)
        self.epoch_steps = epoch_steps  # the fit's batches per epoch (Keras' `params["steps"]`), None: unknown
        optimizer = getattr(model, "optimizer", None)
        iterations = getattr(optimizer, "iterations", None)
        self._first_step = 0 if iterations is None else int(to_numpy(iterations))
        if epoch_steps and epochs:
            self.final_step = self._first_step + epochs * epoch_steps
        self.steps_done = 0
        self._cut: int | None = None  # the batches the running call ran, where it found the data exhausted
        # Keras (JAX, TensorFlow) runs `steps_per_execution` batches per train-function call, with one batch
        # callback for them: the global step (the optimizer's) then advances by that much per hookprof step
        per_call = getattr(model, "steps_per_execution", 1)
        self.steps_per_run = per_call if isinstance(per_call, int) and per_call > 1 else 1
        self.image_format = "NCHW" if keras.config.image_data_format() == "channels_first" else "NHWC"
        self.feeds_unread = unread_feeds(model)

    @property
    def model(self) -> keras.Model:
        """The model being fit. On the JAX backend its variables live outside it during `fit`: they are synced
        into it first (Keras' own `jax_state_sync`, free when nothing changed), so a hook that saves the model or
        reads its weights sees this step's."""
        sync = self._sync
        if sync is not None:
            sync()
        return self._model

    @model.setter
    def model(self, model: keras.Model) -> None:
        self._model = model
        self._sync = getattr(model, "jax_state_sync", None)

    @property
    def global_step(self) -> int:
        return self._first_step + self.steps_done

    def step_ended(self, first_batch: int | None, last_batch: int) -> None:
        """A train-function call ran batches `first_batch` .. `last_batch` of an epoch of `epoch_steps` (Keras
        3.8+ names both, the last as if the call were full: an epoch's last call may run fewer, so it is cut at
        the epoch's end; older Keras names the first twice: then it ran `steps_per_run`). The optimizer's count
        is not read: on JAX it lives outside the model during the fit. A call that found its epoch's data
        exhausted (a generator's, whose length Keras does not know) ran the batches it fetched (`call_cut`)."""
        cut, self._cut = self._cut, None
        if cut is not None:
            ran = cut
        elif first_batch is not None and last_batch > first_batch:
            epoch_steps = self.epoch_steps
            if epoch_steps:
                last_batch = min(last_batch, epoch_steps - 1)
            ran = last_batch - first_batch + 1
        else:
            ran = self.steps_per_run
        self.steps_done += ran

    def call_cut(self, ran: int | None) -> None:
        """The running train-function call found its epoch's data exhausted after `ran` batches (None: no call
        runs, none is cut)."""
        self._cut = ran


class _TrainStepWatch:
    """Wraps `model.train_function` during one fit: keeps the running step's batch, and when the step raises,
    stops the trace and ends the fit's hooks without `end()` (TF's rule)."""

    def __init__(self, function: Any, fit: _Fit) -> None:
        self.function = function
        self.fit = fit
        self.batch: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fit = self.fit
        if fit.ended:  # left by a fit that failed outside a step (Keras tells no one): put the model's back
            model = fit.model
            if getattr(model, "train_function", None) is self:
                model.train_function = self.function
            return self.function(*args, **kwargs)
        if len(args) == 1 and isinstance(args[0], (list, tuple)) and len(args[0]) == 1:
            self.batch = args[0][0]  # the torch backend calls train_function([batch])
        try:
            driver = fit.driver
            if driver is not None:
                # (a call of one batch that no trace waits for fetches it itself, unwrapped; a call of several is
                # counted, its epoch's data may run out inside it, and timed where a trace or trigger watches)
                several = fit.session.steps_per_run > 1
                timed = driver.trace_pending or (driver.watched and several)
                if (fit.fetches_in_step and (timed or several) and len(args) == 2
                        and not kwargs and isinstance(args[1], collections.abc.Iterator)):  # (Keras < 3.7: a list)
                    args = (args[0], WaitedBatches(args[1], driver if timed else None, fit.session))
                driver.start_trace()  # (the tracer runs only inside the step: see HookedSession)
            return self.function(*args, **kwargs)
        except StopIteration:  # the data ran out (Keras ends the epoch, and the fit goes on): no step ran
            if fit.driver is not None:
                fit.driver.abort_step()
            if fit.session is not None:
                fit.session.call_cut(None)
            raise
        except BaseException:
            fit.close()
            raise


class WaitedBatches:
    """The iterator Keras on JAX hands `train_function(state, iterator)`, which fetches its batches itself: a slow
    input pipeline would show as the traced step's forward pass. Where a trace is about to start, the first batch
    is fetched now, before it, in the step's data wait, as on the torch backend (whose train function gets the
    batch loaded); an exhausted iterator raises StopIteration here, as the step would have. With
    `steps_per_execution` > 1 the call fetches its later batches between its jitted steps, with no callback in
    between: each of those fetches is a data wait of the running step, and the batch after it a micro-batch (its
    forward pass and what follows, as Lightning's accumulated batches), marked where a trace runs or triggers
    watch (`driver`; None: not timed). A call of several batches is counted: where the data runs out inside it
    (a generator's), the session learns how many it ran (`KerasSession.call_cut`)."""

    __slots__ = ("_iterator", "_driver", "_session", "_first", "_fetched")

    def __init__(self, iterator: Any, driver: HookedSession | None, session: KerasSession) -> None:
        self._iterator = iterator
        several = session.steps_per_run > 1
        self._driver = driver if several else None
        self._session = session if several else None
        self._fetched = 0
        self._first = next(iterator) if driver is not None and driver.trace_pending else _NOT_FETCHED

    def __iter__(self) -> WaitedBatches:
        return self

    def __next__(self) -> Any:
        self._fetched += 1
        if self._fetched == 1:
            first, self._first = self._first, _NOT_FETCHED
            return next(self._iterator) if first is _NOT_FETCHED else first
        driver = self._driver
        if driver is not None:
            driver.mark(DATA_WAIT)
        try:
            batch = next(self._iterator)
        except StopIteration:  # (the epoch's data ran out: the call ends here, with the batches it fetched)
            if driver is not None:
                driver.unmark(DATA_WAIT)
            if self._session is not None:
                self._session.call_cut(self._fetched - 1)
            raise
        if driver is not None:
            driver.micro_batch()
        return batch


_NOT_FETCHED = object()


class _Fit:
    """One `model.fit` as hookprof sees it: its hookprof callbacks, in the order Keras calls them, and the
    driver that the first of them to see a batch runs for all.

    Members gather in `on_train_begin`, found by the fit's `token`: the `params` dict that Keras hands every
    callback of one fit (a nested fit, even on the same model, has its own), else the model. Gathering ends
    at the first batch; after that the fit lives in its members and in the model's wrapped train function.
    """

    def __init__(self, model: keras.Model, token: Any) -> None:
        self.model = model
        self.token = token
        self.members: list[HookCallback] = []
        self.driver: HookedSession | None = None
        self.session: KerasSession | None = None
        self.watch: _TrainStepWatch | None = None
        self.ended = False  # end() or close() ran: its watch, if still on the model, only calls through
        self.first_epoch: int | None = None  # the fit's first epoch (`initial_epoch`), from `on_epoch_begin`
        self.fetches_in_step = keras.backend.backend() == "jax"  # train_function(state, iterator): `WaitedBatches`
        self._closing = threading.Lock()
        # which `Model.fit` call this is (see `running`), found once: its callback list (weakly) and the call;
        # when the list goes, the call has ended: one that failed outside its steps (another callback's
        # on_epoch_end) told no one, and is closed then
        frame = _fit_frame(model)
        self._callbacks = _callbacks_of(frame, on_gone=self._call_ended)
        self._call = fit_call(frame) if self._callbacks is not None else None
        del frame  # (held, it would keep the fit's locals alive)
        function = getattr(model, "train_function", None)
        if isinstance(function, _TrainStepWatch) and not function.fit.running():
            # left by a fit that failed outside a step (Keras told no one); a fit running around this one
            # (a nested fit from its callback) keeps its watch, which this one wraps
            function.fit.close()  # (its hooks' files, what it started; the model's own function goes back)
            function = getattr(model, "train_function", None)
            if isinstance(function, _TrainStepWatch):
                function = function.function
        if function is not None:
            self.watch = model.train_function = _TrainStepWatch(function, self)

    def running(self) -> bool:
        """Whether this fit's `Model.fit` call is still running on this thread's stack (one that failed has left
        it, though a traceback may keep its frame)."""
        callbacks = self._callbacks() if self._callbacks is not None else None
        return callbacks is not None and _fit_frame(self.model, callbacks) is not None

    def start(self, leader: HookCallback) -> HookedSession:
        """The first batch (or the end of a fit that ran none): `begin` and `after_create_session` for every
        hook, in order; `leader` drives the steps, the other members return at once."""
        _GATHERING.pop(id(self.token), None)
        hooks = [hook for member in self.members for hook in member.hooks]
        check_feeds(self.model, hooks)
        for hook in hooks:  # hooks left without a directory write where Keras' TensorBoard callback does
            if hasattr(hook, "set_default_output_dir"):
                hook.set_default_output_dir(DEFAULT_LOG_DIR)
        params = leader.params or {}  # (Keras sets them per fit)
        epochs = params.get("epochs")
        if epochs is not None:
            epochs -= self.first_epoch or 0
        self.session = KerasSession(self.model, params.get("steps"), epochs)
        # (with a watch on the train function, the step's trace starts there: a later callback's
        # on_train_batch_begin that raises then leaves no profiler running)
        self.driver = HookedSession(hooks, tracer_factory(self.model), defer_trace=self.watch is not None)
        for member in self.members:
            member._follows = member is not leader
        leader._driver, leader._session = self.driver, self.session
        # (a fit that fails outside its step tells no callback: its run ends with its `Model.fit` call)
        self.driver.begin(self._call)
        self.driver.after_create_session(self.session)
        return self.driver

    def end(self, leader: HookCallback) -> None:
        """A clean finish or a requested stop: `end()` for every hook, then the model's own function back."""
        driver = self.driver or self.start(leader)
        try:
            driver.end(self.session)
        finally:
            self._leave()

    def close(self) -> None:
        """The fit failed (or was left by an earlier one that failed): release the hooks' files, no `end()`."""
        with self._closing:
            if self.ended:
                return
            try:
                if self.driver is not None:
                    self.driver.abort_step()  # (a running trace stops before the hooks close their files)
                    self.driver.close()
            finally:
                self._leave()

    def _call_ended(self, _gone: weakref.ref) -> None:
        """The fit's `Model.fit` call ended (its callback list is freed): close it if nothing did, on a thread
        of its own (this runs wherever the list was freed, perhaps inside hookprof's own locked code). Not at
        the interpreter's exit (a traceback that ended the script is freed with the modules, after hookprof's
        exit handler closed every fit): no thread can start then, and one asked to waits forever."""
        if self.ended or sys.is_finalizing():
            return
        try:  # (not a daemon: an interpreter that exits now waits for the close to finish its files)
            threading.Thread(target=self.close, name="hookprof-fit-close").start()
        except RuntimeError:  # (the interpreter is shutting down its threads)
            pass

    def _leave(self) -> None:
        self.ended = True
        if self.watch is not None and getattr(self.model, "train_function", None) is self.watch:
            self.model.train_function = self.watch.function
        if _GATHERING.get(id(self.token)) is self:
            del _GATHERING[id(self.token)]
        for member in self.members:
            member._fit, member._driver, member._session, member._follows = None, None, None, False


def _callbacks_of(frame: FrameType | None, on_gone: Callable[[weakref.ref], Any] | None = None
                  ) -> weakref.ref | None:
    """A weak reference to the `CallbackList` of the `model.fit` call running in `frame` (`_fit_frame`), or None
    (a weak one: a failed fit's traceback must not keep more of it alive); `on_gone` is called when the list is
    freed."""
    if frame is None:
        return None
    try:
        return weakref.ref(frame.f_locals["callbacks"], on_gone)
    except TypeError:
        return None


def _fit_frame(model: keras.Model, wanted: Any = None) -> FrameType | None:
    """The frame of the innermost `model.fit` on this thread's stack (the one whose `CallbackList` is `wanted`,
    if given), or None."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "fit" and frame.f_locals.get("self") is model:
            callbacks = frame.f_locals.get("callbacks")
            if callbacks is not None and (wanted is None or callbacks is wanted):
                return frame
        frame = frame.f_back
    return None


_GATHERING: dict[int, _Fit] = {}  # id(token) -> a fit whose members are joining (before its first batch)


def _finished_step(session: KerasSession, logs: dict | None, batch_data: Any, batch: int) -> StepState:
    """The finished step, built when a hook or summary reads it (`session.model`: this step's weights, on JAX
    too)."""
    return StepState(session.global_step, logs, batch_data, batch, session.model, logs, session)


def compiles_step(model: keras.Model) -> bool:
    """Whether Keras runs this model's train step as a compiled program (traced once, then replayed): on JAX
    under `jit_compile` (the default), on TensorFlow as a `tf.function` unless `run_eagerly`."""
    if getattr(model, "run_eagerly", False):
        return False
    backend = keras.backend.backend()
    return backend == "tensorflow" or (backend == "jax" and bool(getattr(model, "jit_compile", True)))


def unread_feeds(model: keras.Model) -> str | None:
    """Why the values hooks feed into a step (`SessionRunArgs(feed_dict=...)`, read with `hookprof.step_feeds()`)
    would not reach this model's train step, with the fix; None where they do. A compiled step reads them once,
    when it is traced, and would see the first step's values on every step."""
    if not compiles_step(model):
        return None
    backend = keras.backend.backend()
    fix = "run_eagerly=True (model.compile(..., run_eagerly=True))" + (" or jit_compile=False" if backend == "jax"
                                                                        else "")
    return (f"feeds each step through hookprof.step_feeds(), but Keras on {backend} compiles the train step (traced "
            f"once, then replayed): it would read the first step's values on every step. Compile the model with "
            f"{fix} to feed each step.")


def check_feeds(model: keras.Model, hooks: Sequence[SessionRunHook]) -> None:
    """A `FeedFnHook` is refused before the first step where the step would not read its feeds (`unread_feeds`);
    any other hook that feeds is refused at the first step it does (`HookedSession.before_run`)."""
    feeders = [type(hook).__name__ for hook in hooks if isinstance(hook, FeedFnHook)]
    unread = unread_feeds(model) if feeders else None
    if unread is not None:
        raise ValueError(f"{feeders[0]} {unread}")


def tracer_factory(model: keras.Model) -> TracerFactory:
    """torch.profiler on the torch backend, JAX's profiler on the JAX backend; elsewhere (or on a JAX that
    lacks what the JAX tracer needs) the host tracer, with one warning per process naming what is missing."""
    backend = keras.backend.backend()
    if backend == "torch":
        from hookprof.tracing.torch_tracer import TorchTracer

        return lambda: TorchTracer(model)
    if backend == "jax":
        from hookprof.tracing.jax_tracer import JaxTracer, missing_support

        missing = missing_support()
        if missing is None:
            if compiles_step(model):
                return lambda: JaxTracer(model)
            warn = WarnOnce(log)  # (once a fit: this factory is the fit's)

            def eager_tracer() -> JaxTracer:
                warn("eager", "keras_prof: this model's train step runs without jit (%s), so JAX runs each op as its "
                     "own small program: traced steps show the ops without scopes, all as 'forward' (scopes and "
                     "phases come from the compiled train step's name stack). Compile with jit_compile=True and "
                     "run_eagerly=False (the defaults) to see them.",
                     "run_eagerly=True" if getattr(model, "run_eagerly", False) else "jit_compile=False")
                return JaxTracer(model)

            return eager_tracer
        _warn_once("backend", "keras_prof: the Keras backend is 'jax' but this JAX lacks %s, so traced steps "
                   "show only their phases (host tracer).", missing)
        return HostTracer
    _warn_once("backend", "keras_prof: the Keras backend is %r, so traced steps show only their phases (host "
               "tracer). Set KERAS_BACKEND=torch or jax before importing keras for op-level timelines.", backend)
    return HostTracer


class HookCallback(keras.callbacks.Callback):
    """Runs any `hookprof.SessionRunHook`s in `model.fit`, in list order, with TF1's semantics.

    Example::

        model.fit(x, y, callbacks=[HookCallback(hooks=[MyHook()])])
    """

    def __init__(self, hooks: Sequence[SessionRunHook]) -> None:
        super().__init__()
        self._hooks = check_hooks(hooks)
        self._fit: _Fit | None = None
        self._driver: HookedSession | None = None  # set on the member that drives the fit
        self._session: KerasSession | None = None
        self._follows = False  # another member drives this fit's hooks, ours included
        self._first_batch: int | None = None  # the batch the running train-function call began with

    @property
    def hooks(self) -> list[SessionRunHook]:
        return self._hooks

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self._fit is not None:  # this callback's last fit never ended: it raised outside a train step
            self._fit.close()
        model = self.model
        token = self.params if self.params else model
        fit = _GATHERING.get(id(token))
        if fit is None:
            fit = _GATHERING[id(token)] = _Fit(model, token)
        fit.members.append(self)
        self._fit = fit

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        fit = self._fit
        if fit is not None and fit.first_epoch is None:  # (Keras runs `epochs - initial_epoch` of them)
            fit.first_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self._follows:
            return
        self._first_batch = batch
        try:
            driver = self._driver or self._fit.start(self)
            session = self._session
            key = (id(session.model), session.global_step, batch)  # (Keras' `self.model` is a property)
            driver.before_run(session, key, lambda: SessionRunArgs(feed_dict={"batch_idx": batch}))
        except BaseException:
            self._fail()
            raise

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self._follows:
            return
        session = self._session
        session.step_ended(self._first_batch, batch)
        watch = self._fit.watch
        try:
            stop = self._driver.after_run(lambda: _finished_step(session, logs, watch.batch if watch else None, batch))
        except BaseException:  # a hook raised (NanTensorHook's error): the fit fails here, Keras tells nobody
            self._fail()
            raise
        if stop:
            session.model.stop_training = True

    def _fail(self) -> None:
        """A hook raised out of a batch callback: stop the trace, close the hooks' files (no `end()`, TF's
        rule) and put the model's own train function back, as a failed train step does."""
        if self._fit is not None:
            self._fit.close()

    def on_test_begin(self, logs: dict | None = None) -> None:
        self._outside_fit("evaluate")

    def on_predict_begin(self, logs: dict | None = None) -> None:
        self._outside_fit("predict")

    def _outside_fit(self, method: str) -> None:
        """`Model.evaluate` / `predict` with hookprof callbacks: their steps run no hooks (TF1's hooks ran in
        the training session; a fit's validation, which Keras runs inside the fit, is not this case)."""
        if self._fit is None:
            _warn_once(method, "keras_prof: hookprof's hooks run in Model.fit's training steps only; this "
                       "Model.%s runs none of them (no timelines, summaries or checks). Trace it with "
                       "torch.profiler or jax.profiler directly.", method)

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._fit is not None:  # the first member to see the end ends every hook (the others find no fit)
            self._fit.end(self)
