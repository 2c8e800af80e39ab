"""`HookedSession`: runs a list of `SessionRunHook`s through training steps with TF1's semantics.

The adapters call, per step, `before_run(...)`, then the framework runs the step, then `after_run(...)`
(or `abort_step()` if the step raised). Semantics, as `MonitoredSession._HookedSession` had them:
- hooks are called in list order; one `SessionRunContext` per step is shared by all of them;
- each hook gets back exactly the fetch structure it asked for; options merge (highest trace level wins);
- two hooks feeding the same name is an error naming the name;
- `request_stop()` takes effect after every `after_run` of the step; a failed step gets no `after_run`;
- in a distributed fit the ranks agree each step's stop and the hooks' votes (`hookprof.hooks.agreement`);
- `end()` is the adapter's to call, on a clean finish or a requested stop only.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

from hookprof._runtime import worker
from hookprof._runtime.background import drain_all
from hookprof._runtime.fit_run import FitCall, FitRun, close_run, open_run
from hookprof.hooks.agreement import Ballot
from hookprof.hooks.session import Session, StepState, evaluate_fetches
from hookprof.hooks.session_run_hook import (
    RunMetadata,
    RunOptions,
    SessionRunArgs,
    SessionRunContext,
    SessionRunHook,
    SessionRunValues,
    TraceLevel,
)
from hookprof.tracing import StepTraceCoordinator, TracerFactory

_HOOK_METHODS = ("begin", "after_create_session", "before_run", "after_run", "end")
_NO_FEEDS: Mapping[str, Any] = {}
# The feeds of the step running in this context (the training thread's): a ContextVar, not a module global,
# so a second fit elsewhere (another thread) neither sees nor clears this one's.
_current_feeds: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar("hookprof_feeds",
                                                                                  default=_NO_FEEDS)


def step_feeds() -> Mapping[str, Any]:
    """The values hooks fed into the step now running (`SessionRunArgs(feed_dict=...)`), by name.

    A training step reads them as TF graphs read fed placeholders, e.g. `hookprof.step_feeds().get("lr_scale", 1)`.
    """
    return _current_feeds.get()


def _publish_feeds(feeds: Mapping[str, Any]) -> None:
    """Make `feeds` what `step_feeds()` returns until the step ends."""
    _current_feeds.set(feeds)


@contextlib.contextmanager
def feeding(feeds: Mapping[str, Any]) -> Iterator[None]:
    """`step_feeds()` returns `feeds` inside the block (fetches run outside a step: `FinalOpsHook`'s)."""
    token = _current_feeds.set(dict(feeds))
    try:
        yield
    finally:
        _current_feeds.reset(token)


def abort_running_step(traces: StepTraceCoordinator) -> None:
    """A step raised: stop its trace (the profiler must not stay on) and drop its feeds."""
    _current_feeds.set(_NO_FEEDS)
    traces.abort()


def check_hooks(hooks: Sequence[Any], argument: str = "hooks") -> list[SessionRunHook]:
    """Validate a list of hooks before training: each must have the five SessionRunHook methods."""
    if isinstance(hooks, SessionRunHook) or not isinstance(hooks, Sequence):
        raise TypeError(f"`{argument}` must be a list of SessionRunHook, got {type(hooks).__name__}.")
    for i, hook in enumerate(hooks):
        missing = [m for m in _HOOK_METHODS if not callable(getattr(hook, m, None))]
        if missing:
            raise TypeError(
                f"`{argument}[{i}]` ({type(hook).__name__}) is not a SessionRunHook: it lacks {missing}. "
                "Subclass hookprof.SessionRunHook."
            )
    return list(hooks)


_QUIET = SessionRunContext(SessionRunArgs(), None)  # the step running is one on which every hook is quiet


class HookedSession:
    """Drives a list of hooks through steps, as TF's MonitoredSession did; the adapters run one per fit.

    Args:
        hooks: the hooks, called in this order.
        tracer_factory: makes the tracer for a step some hook asked to trace.
        traces: the coordinator that keeps one tracer per step and the step's phases (None: one of this
            driver's own, current in its context while the fit runs: `hookprof.tracing.fit_traces()`).
        defer_trace: a traced step's tracer starts at `start_trace()`, not in `before_run`: an adapter whose
            framework tells no one when a step fails outside the step itself (Keras: another callback's
            `on_train_batch_begin`) starts it where the step runs, so such a failure leaves no profiler on.
    """

    def __init__(
        self,
        hooks: Sequence[SessionRunHook],
        tracer_factory: TracerFactory,
        traces: StepTraceCoordinator | None = None,
        defer_trace: bool = False,
    ) -> None:
        self.hooks = check_hooks(hooks)
        if tracer_factory is not None and not callable(tracer_factory):
            raise TypeError(f"`HookedSession(tracer_factory={tracer_factory!r})`: pass a callable that makes a "
                            "hookprof.tracing.Tracer (e.g. hookprof.tracing.HostTracer).")
        self.tracer_factory = tracer_factory
        self._traces = traces if traces is not None else StepTraceCoordinator()
        self._context: SessionRunContext | None = None
        self._fetches: dict[int, Any] = {}
        self._options: RunOptions | None = None
        self._no_options = RunOptions()  # what hooks see on steps no hook asked options for
        self._key: Hashable = None
        self._session: Session | None = None  # the session of the step running
        self._run: FitRun | None = None  # what this fit started, stopped when it ends (see `release`)
        self._defer_trace = defer_trace
        self._pending_trace: tuple[Hashable, RunOptions] | None = None  # (deferred: started by start_trace)
        self._ballot: Ballot | None = None  # what the ranks of a distributed fit decide together (see agreement)
        # The hooks' quiet_on checks; None when a hook (duck-typed) has none, which turns the fast path off.
        checks = [getattr(hook, "quiet_on", None) for hook in self.hooks]
        self._quiet_checks = checks if all(callable(check) for check in checks) else None

    def begin(self, fit_call: FitCall | None = None) -> None:
        """`begin()` for every hook; `fit_call`: the framework's fit call (`hookprof._runtime.fit_run.fit_call`),
        where the adapter knows it (a fit that fails without telling its callbacks is judged ended once that call
        has returned)."""
        self._run = open_run(self._traces, fit_call)
        self._traces.new_run()
        for hook in self.hooks:
            hook.begin()

    def after_create_session(self, session: Session) -> None:
        self._ballot = Ballot.for_fit(session, self.hooks)
        if isinstance(session, Session):
            session.agreeing = self._ballot is not None  # (what the voters read: see `Session.agreeing`)
        for hook in self.hooks:
            hook.after_create_session(session, None)

    def before_run(self, session: Session, step_key: Hashable,
                   original_args: SessionRunArgs | Callable[[], SessionRunArgs]) -> None:
        """Ask every hook what it needs of the coming step; start the step's trace if one asked for it.

        `original_args` (the framework's own step arguments) may be a callable that makes them: steps on
        which every hook is quiet (`SessionRunHook.quiet_on`) never build them.
        """
        if self._context is not None:  # the previous step never finished (the framework skipped it)
            self.abort_step()
        self._key, self._session = step_key, session
        checks = self._quiet_checks
        if checks is not None and (callable(original_args) or original_args.options is None):
            step = session.global_step
            for check in checks:
                if not check(step):
                    break
            else:
                self._context = _QUIET
                return
        if callable(original_args):
            original_args = original_args()
        context = SessionRunContext(original_args, session)
        fetches: dict[int, Any] = {}
        feeds: dict[str, Any] = {}
        # TF merges the hooks' options into the caller's own (`session.run(..., options=...)`)
        options = None if original_args.options is None else dataclasses.replace(original_args.options)
        for i, hook in enumerate(self.hooks):
            request = hook.before_run(context)
            if request is None:
                continue
            if not isinstance(request, SessionRunArgs):
                raise TypeError(
                    f"{type(hook).__name__}.before_run returned {type(request).__name__}; "
                    "return None or hookprof.SessionRunArgs(fetches, feed_dict, options)."
                )
            if request.fetches is not None:
                fetches[i] = request.fetches
            if request.feed_dict is not None and not isinstance(request.feed_dict, Mapping):
                raise TypeError(f"{type(hook).__name__}.before_run returned SessionRunArgs(feed_dict="
                                f"{type(request.feed_dict).__name__}); feed_dict must be a dict of name -> value.")
            if request.feed_dict:
                unread = getattr(session, "feeds_unread", None)
                if unread:
                    raise ValueError(f"{type(hook).__name__} {unread}")
                _merge_feeds(feeds, request.feed_dict, original_args.feed_dict or {}, type(hook).__name__)
            if request.options is not None:
                if options is None:
                    options = RunOptions()
                options.merge(request.options)
        self._context, self._fetches, self._options = context, fetches, options
        if feeds:
            _publish_feeds(feeds)
        if options is not None and options.trace_level > TraceLevel.NO_TRACE:
            if self._defer_trace:
                self._pending_trace = (step_key, options)
            else:
                self._traces.start(step_key, self.tracer_factory, options)

    def mark(self, phase: str) -> None:
        """The running step entered `phase` now (the framework's event: "backward", "optimizer", ...)."""
        self._traces.mark(phase)

    def unmark(self, phase: str) -> None:
        """The running step's last `mark`, `phase`, did not happen after all (a data wait that got no batch)."""
        self._traces.unmark(phase)

    def micro_batch(self) -> None:
        """Another micro-batch of the running step begins (gradient accumulation)."""
        self._traces.micro_batch()

    def restart_data_clock(self) -> None:
        """Work between steps that is not data loading (validation) ended now."""
        self._traces.restart_data_clock()

    @property
    def watched(self) -> bool:
        """Whether the running step's phases are recorded for the triggers (`mark` does something then)."""
        return self._traces.watching

    @property
    def trace_pending(self) -> bool:
        """Whether `start_trace` would start a trace `before_run` deferred (`defer_trace`)."""
        return self._pending_trace is not None

    def start_trace(self) -> None:
        """Start the trace `before_run` deferred (`defer_trace`), if any: call it where the step itself runs."""
        pending, self._pending_trace = self._pending_trace, None
        if pending is not None:
            self._traces.start(pending[0], self.tracer_factory, pending[1])

    def after_run(self, make_state: Callable[[], StepState]) -> bool:
        """Give each hook its results and the step's metadata; return whether a hook requested a stop."""
        context = self._context
        if context is None:  # before_run did not complete (an earlier callback raised)
            return False
        self._context = None
        self._pending_trace = None  # (a deferred trace whose step never ran: nothing was recorded)
        if context is _QUIET:  # no hook has anything to do; the step still ends (data-wait clock, last_step)
            self._traces.finish(self._key)
            session = self._session
            if isinstance(session, Session):
                session._last_step = make_state  # (the property's setter, without its call: every idle step)
            if self._ballot is not None:  # the other ranks may have something to decide: agree all the same
                stop = self._ballot.decide(session, None, session.global_step)
                self._traces.restart_data_clock()  # (waiting for the other ranks is no data wait)
                return stop
            return False
        if _current_feeds.get():
            _current_feeds.set(_NO_FEEDS)
        fetches = self._fetches
        state = make_state() if fetches else None
        metadata = self._traces.finish(self._key)
        if metadata is None:
            metadata = RunMetadata()
        elif metadata.step is None:  # the stats, converted later maybe, belong to the global step after this one
            state = state or make_state()
            metadata.step = state.step
        session = self._session
        if isinstance(session, Session):
            session.last_step = state or make_state
        options = self._options or self._no_options
        for i, hook in enumerate(self.hooks):
            results = evaluate_fetches(fetches[i], state) if i in fetches else None
            hook.after_run(context, SessionRunValues(results, options, metadata))
        stop = context.stop_requested
        if self._ballot is not None:
            stop = self._ballot.decide(session, context, session.global_step)
        self._traces.restart_data_clock()  # the hooks' own work after the step is no data wait of the next
        return stop

    def abort_step(self) -> None:
        """The step raised (or never ran: Keras' data ran out): no after_run; stop any running trace, and drop one
        deferred to the step's start, so the next step starts its own (or none)."""
        self._context = self._pending_trace = None
        abort_running_step(self._traces)

    def end(self, session: Session) -> None:
        """A clean finish or a requested stop: every hook's `end()`, then what the fit started is stopped."""
        try:
            for hook in self.hooks:
                hook.end(session)
        finally:
            self.release()

    def close(self) -> None:
        """Training failed: release what the hooks hold (files, writers) without calling `end()` (TF's rule),
        then stop what the fit started. Hooks opt in with a `close()` method (this project's hooks have one)."""
        try:
            for hook in self.hooks:
                close = getattr(hook, "close", None)
                if callable(close):
                    try:
                        close()
                    except Exception:  # one hook's cleanup must not stop the others'
                        logging.getLogger(__name__).exception("%s.close() failed", type(hook).__name__)
        finally:
            self.release()

    def release(self) -> None:
        """Stop everything hookprof started for this fit, however it ended: a running trace (the profiler and
        its module hooks), the step's feeds, the background threads (once their files are written), the render
        worker process and what else registered with the fit's run (a JAX compile listener). What fits share
        (the background threads, the render worker) is stopped by the last fit open to end: a fit in another
        thread goes on writing. Safe to call twice; `end()` and `close()` call it."""
        self._context = self._pending_trace = self._session = self._ballot = None  # (the ballot's agree: the session's)
        self._fetches = {}
        abort_running_step(self._traces)
        run, self._run = self._run, None
        if run is not None and close_run(run):
            drain_all()
            worker.WORKER.stop()


def _merge_feeds(feeds: dict, new: Mapping, user: Mapping, hook_name: str) -> None:
    clash = feeds.keys() & new.keys()
    if clash:
        raise RuntimeError(f"Same tensor is fed by two hooks: {sorted(map(str, clash))} (second: {hook_name}).")
    clash = user.keys() & new.keys()
    if clash:
        raise RuntimeError(f"Same tensor is fed by a SessionRunHook and user: {sorted(map(str, clash))}.")
    feeds.update(new)
