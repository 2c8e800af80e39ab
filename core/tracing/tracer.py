"""The tracer interface: what fills a traced step's `RunMetadata` (torch, host, ...)."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

from hookprof.run_options import RunOptions
from hookprof.step_stats import StepStats

HOST_DEVICE = "/host:CPU"


class TracerUnavailable(RuntimeError):
    """A tracer cannot run now (another profiler holds the machinery); the step runs untraced."""


class Tracer(abc.ABC):
    """Collects one step into `StepStats`; the coordinator adds the step's phase spans to what it returns."""

    name: str

    @abc.abstractmethod
    def start(self, options: RunOptions) -> None:
        """Begin recording; called just before the step runs."""

    @abc.abstractmethod
    def stop(self) -> StepStats:
        """End recording and return what the step did."""

    @abc.abstractmethod
    def abort(self) -> None:
        """End recording after a failed step, dropping the data; must leave nothing running."""

    def bind_fit(self, state: dict[str, Any]) -> None:
        """Called before `start` with a dict the fit's coordinator keeps from one traced step to the next (a new
        one for each run): where a tracer keeps what a traced step leaves for the fit's later ones. By default
        nothing is kept."""
        return None

    def stop_recording(self) -> Callable[[], StepStats]:
        """End recording now and return what converts the recording into `StepStats`, which may run later,
        on another thread. Tracers whose conversion costs override it; by default `stop()` does all now.

        The recording may also have an `export()` method returning a picklable object with `to_stats()`: the
        step in a form another process converts (`ProfilerHook` hands it to the render worker,
        `hookprof._runtime.worker`); its class must import without the framework."""
        stats = self.stop()
        return lambda: stats


TracerFactory = Callable[[], Tracer]
