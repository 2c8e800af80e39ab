"""The TF1 hook contract: `SessionRunHook` and the small value types passed around a step.

In TF1 a step was one `session.run(fetches, feed_dict, options)` call. In Lightning and Keras a step is one
training batch; the adapters map the framework's batch callbacks onto `before_run` / `after_run`, and
`run_context.session` is a `hookprof.hooks.hooked_session.Session` (a view of the trainer or model, see there).
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from collections.abc import Callable
from typing import Any, NamedTuple


class TraceLevel(enum.IntEnum):
    """How much a step records, as TF's `RunOptions.TraceLevel`; the highest level any hook asks for wins."""

    NO_TRACE = 0
    SOFTWARE_TRACE = 1  # host-side spans of the step's phases only
    HARDWARE_TRACE = 2  # plus every op (and CUDA kernels when present)
    FULL_TRACE = 3  # plus input shapes, dtypes and sizes


@dataclasses.dataclass
class RunOptions:
    """Per-step options a hook requests through `SessionRunArgs(options=...)`.

    `trace_level` is TF's; `record_dataflow`, `record_memory` and `with_stack` are this project's extensions
    (what TF implied by FULL_TRACE plus `show_dataflow`/`show_memory`): the tracer records tensor identities,
    allocations and Python stacks when any hook asks.
    """

    NO_TRACE = TraceLevel.NO_TRACE
    SOFTWARE_TRACE = TraceLevel.SOFTWARE_TRACE
    HARDWARE_TRACE = TraceLevel.HARDWARE_TRACE
    FULL_TRACE = TraceLevel.FULL_TRACE

    trace_level: TraceLevel = TraceLevel.NO_TRACE
    record_dataflow: bool = False
    record_memory: bool = False
    with_stack: bool = False

    @property
    def records_tensors(self) -> bool:
        """Whether the tracer records which tensors each op touched and the memory they live in (dataflow and
        memory both read that record)."""
        return self.record_dataflow or self.record_memory

    def __post_init__(self) -> None:
        level = self.trace_level
        try:
            self.trace_level = TraceLevel[level] if isinstance(level, str) else TraceLevel(level)
        except (KeyError, ValueError):
            raise ValueError(f"`RunOptions(trace_level={level!r})`: use one of "
                             f"{[f'RunOptions.{t.name}' for t in TraceLevel]}.") from None

    def covers(self, other: RunOptions) -> bool:
        """Whether a trace run with these options records everything `other` asks for."""
        return (self.trace_level >= other.trace_level and self.record_dataflow >= other.record_dataflow
                and self.record_memory >= other.record_memory and self.with_stack >= other.with_stack)

    def merge(self, other: RunOptions) -> None:
        """Fold another hook's request into this one: the higher trace level and every extra wins."""
        self.trace_level = TraceLevel(max(self.trace_level, other.trace_level))
        self.record_dataflow = self.record_dataflow or other.record_dataflow
        self.record_memory = self.record_memory or other.record_memory
        self.with_stack = self.with_stack or other.with_stack


class RunMetadata:
    """What a traced step produced: its `StepStats` (None when the step was not traced).

    A tracer may hand over its recording unconverted (`make_step_stats`): `step_stats` then converts it on
    first use, once, on whichever thread asks first (`ProfilerHook` asks on its background thread, so the
    training thread does not wait for the conversion). Treat the stats as read-only: the background thread
    may be writing them to a file while a hook reads them. `step` is the global step after the traced step;
    the stats get it when their tracer left it unset.
    """

    def __init__(self, step_stats: Any = None, make_step_stats: Callable[[], Any] | None = None,
                 export_step: Callable[[], Any] | None = None) -> None:
        self._stats = step_stats  # hookprof.step_stats.StepStats
        self._make = make_step_stats
        self._export = export_step
        self._lock = threading.Lock() if make_step_stats is not None else None
        self.step: int | None = None

    @property
    def step_stats(self) -> Any:
        if self._make is not None:
            with self._lock:  # a second reader waits here for the first one's conversion
                make = self._make
                if make is not None:
                    try:
                        self._stats = make()
                    finally:
                        self._make = self._export = None  # (what either held, an export file, can go)
        stats = self._stats
        if stats is not None and stats.step is None and self.step is not None:
            stats.step = self.step
        return stats

    @step_stats.setter
    def step_stats(self, value: Any) -> None:
        self._make = None
        self._stats = value

    def export(self) -> Any:
        """The unconverted step in a form another process can convert (picklable, with `to_stats()`), where
        its tracer offers one and no one converted it here yet; else None (read `step_stats`). Raises
        OSError when the export cannot be written."""
        if self._export is None or self._make is None:
            return None
        return self._export()

    @property
    def converted(self) -> bool:
        """Whether the step stats exist already (reading `step_stats` would not convert anything)."""
        return self._make is None

    def __repr__(self) -> str:
        stats = self._stats if self._make is None else "<not yet converted>"
        return f"RunMetadata(step_stats={stats!r})"


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
