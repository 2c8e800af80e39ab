"""`FitRun`: what one fit started, stopped when that fit ends however it ends.

A fit's driver (`hookprof.hooks.hooked_session.HookedSession`) opens a `FitRun` at `begin()` and closes it
after `end()` (a clean finish or a requested stop) or `close()` (the fit failed: in a step, in another
callback, in the data). Whatever hookprof starts for a fit registers its own stop here (`on_fit_end`): the
render worker process, a JAX compile listener, the background threads. Code that runs outside any fit (a
hand-driven tracer, a test) finds no run and keeps the process-level fallback it had (`atexit`).

The current run is a `ContextVar`: each thread's context has its own, and the training thread, where the
framework calls the callbacks, is where fits begin and end.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class FitRun:
    """Stops registered by what a fit started, run once, newest first, when the fit ends."""

    def __init__(self) -> None:
        self._stops: list[tuple[Any, Callable[..., Any], tuple[Any, ...]]] = []
        self.closed = False

    def on_end(self, key: Any, stop: Callable[..., Any], *args: Any) -> None:
        """Run `stop(*args)` when the fit ends; a second registration under the same `key` is ignored (the
        render worker is started by every ProfilerHook of a fit, stopped once)."""
        if any(known == key for known, _, _ in self._stops):
            return
        self._stops.append((key, stop, args))

    def close(self) -> None:
        """Run every registered stop, newest first; one that raises is logged and the others still run."""
        if self.closed:
            return
        self.closed = True
        while self._stops:
            _, stop, args = self._stops.pop()
            try:
                stop(*args)
            except Exception:
                log.exception("hookprof could not stop %r at the end of the fit", stop)


_CURRENT: contextvars.ContextVar[FitRun | None] = contextvars.ContextVar("hookprof_fit_run", default=None)


def open_run() -> FitRun:
    """A new run, current from now on in this context (a run still open here is closed first)."""
    previous = _CURRENT.get()
    if previous is not None:
        previous.close()
    run = FitRun()
    _CURRENT.set(run)
    return run


def close_run(run: FitRun) -> None:
    """Close `run`; it stops being current if it was."""
    run.close()
    if _CURRENT.get() is run:
        _CURRENT.set(None)


def on_fit_end(key: Any, stop: Callable[..., Any], *args: Any) -> bool:
    """Register `stop(*args)` with the fit running in this context; False where no fit runs (the caller then
    keeps its own fallback)."""
    run = _CURRENT.get()
    if run is None or run.closed:
        return False
    run.on_end(key, stop, *args)
    return True
