"""The TF1 hook contract: `SessionRunHook` and the small value types passed around a step.

In TF1 a step was one `session.run(fetches, feed_dict, options)` call. In Lightning and Keras a step is one
training batch; the adapters map the framework's batch callbacks onto `before_run` / `after_run`, and
`run_context.session` is a `hookprof.hooks.hooked_session.Session` (a view of the trainer or model, see there).
`RunOptions`, `TraceLevel` and `RunMetadata` are defined in `hookprof.run_options` (the tracers read them too)
and importable from here.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from hookprof.run_options import RunMetadata, RunOptions
from hookprof.run_options import TraceLevel as TraceLevel


class SessionRunArgs(NamedTuple):
    """What a hook asks of the coming step: values to fetch after it, feeds, and run options.

    `fetches` is any nested structure (dict / list / tuple) whose leaves are fetch items: the name of a step
    output or logged metric (`"loss"`, `"global_step"`), or a callable of the step's `StepState`. They are
    evaluated after the step; `SessionRunValues.results` has the same structure.
    `feed_dict` maps names to values published for the step (read them with `hookprof.step_feeds()`);
    two hooks feeding the same name is an error.
    """

    fetches: Any = None
    feed_dict: dict | None = None
    options: RunOptions | None = None


class SessionRunValues(NamedTuple):
    """What a hook gets back in `after_run`: its fetched `results`, the merged `options`, `run_metadata`."""

    results: Any
    options: RunOptions
    run_metadata: RunMetadata


class SessionRunContext:
    """One per step, shared by every hook's `before_run` and `after_run` of that step.

    `original_args` are the step's own inputs as `SessionRunArgs(fetches=None, feed_dict={'batch': ...,
    'batch_idx': ...})`; `session` is the adapter's `Session`. `request_stop()` ends training after every
    hook's `after_run` of this step has run.
    """

    __slots__ = ("_original_args", "_session", "_stop_requested")

    def __init__(self, original_args: SessionRunArgs, session: Any) -> None:
        self._original_args = original_args
        self._session = session
        self._stop_requested = False

    @property
    def original_args(self) -> SessionRunArgs:
        return self._original_args

    @property
    def session(self) -> Any:
        return self._session

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    def request_stop(self) -> None:
        """Ask the training loop to stop after this step (TF: `run_context.request_stop()`)."""
        self._stop_requested = True


class SessionRunHook:
    """Code that runs around every training step; subclass and override what you need (all are no-ops)."""

    def begin(self) -> None:
        """Called once before training starts (Lightning `setup`/`on_fit_start`, Keras `on_train_begin`)."""

    def after_create_session(self, session: Any, coord: Any) -> None:
        """Called when training is ready to run steps, and again after a restore; `coord` is always None."""

    def before_run(self, run_context: SessionRunContext) -> SessionRunArgs | None:
        """Called before each step; return `SessionRunArgs` to fetch values, feed, or request a trace."""
        return None

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        """Called after each step that finished without raising, with the results asked for in before_run."""

    def end(self, session: Any) -> None:
        """Called at the end of training on a clean finish or a requested stop, never after an exception."""

    def quiet_on(self, global_step: int) -> bool:
        """Optional fast path (not in TF): True promises that, for the step starting at `global_step`, this
        hook's `before_run` would return None and its `after_run` would change nothing. When every hook of a
        callback says so, the step costs one call per hook instead of a context, arguments and two calls.
        The default, False, keeps TF's behaviour: both calls on every step."""
        return False

    # --- distributed training (not in TF): decisions every rank makes together ------------------------------
    # In a fit of several ranks (DDP), a decision that changes what a step does (stop, a collective save, a
    # trace) must be the same on every rank, or one rank waits in a collective for a rank that went another
    # way. The driver agrees them after each step through `session.agree` (one small collective for all of the
    # step's decisions); in one process it never asks. Hooks whose decisions follow from the global step alone
    # (the same on every rank) need none of this.

    def may_request_stop(self) -> bool:
        """Whether this hook may call `request_stop()` on what its own rank sees (a loss, a clock). While any
        hook of a distributed fit may, the driver agrees each step's stop across ranks: one rank's request
        stops every rank after that step. False: this hook never asks, or asks on the global step alone. The
        default, True, is right for any hook (a user's hook that never stops costs a small collective a step)."""
        return True

    def votes(self) -> int:
        """How many decisions this hook asks the ranks of a distributed fit to make together after each step
        (fixed for the fit, the same on every rank); the driver then calls `vote` and `agreed` after every
        step, the hook's `after_run` included or not. 0 (the default): none."""
        return 0

    def vote(self, global_step: int) -> tuple[bool, ...]:
        """This rank's proposals (`votes()` of them) after the step that reached `global_step`."""
        return ()

    def agreed(self, run_context: SessionRunContext, decisions: tuple[bool, ...]) -> None:
        """The decisions every rank made together (each True when any rank proposed it), the same on every
        rank; act on them here (a collective save runs on every rank at once). `run_context.request_stop()`
        works here too."""
