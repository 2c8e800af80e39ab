"""What a step is asked to record and what it produced: TF's `RunOptions` (with its `TraceLevel`) and
`RunMetadata`, the contract between the hooks that request a trace and the tracers that fill it.

They live at the bottom of hookprof's layers, so that `hookprof.tracing` reads them without importing the hooks;
`hookprof.hooks` (and `hookprof`) re-export them.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from collections.abc import Callable
from typing import Any


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
