"""`FitRun`: what one fit started, stopped when that fit ends however it ends.

A fit's driver (`hookprof.hooks.hooked_session.HookedSession`) opens a `FitRun` at `begin()` and closes it
after `end()` (a clean finish or a requested stop) or `close()` (the fit failed: in a step, in another
callback, in the data). Whatever hookprof starts for a fit registers its own stop here (`on_fit_end`): the
render worker process, a JAX compile listener, the background threads. Code that runs outside any fit (a
hand-driven tracer, a test) finds no run and keeps the process-level fallback it had (`atexit`).

The current run is a `ContextVar`: each thread's context has its own, and the training thread, where the
framework calls the callbacks, is where fits begin and end. What several fits at once share (hookprof's
background threads, the render worker) is stopped by the last of them to end (`close_run` says which). A fit
that ended without telling anyone (Keras calls no callback when a fit fails outside its step: in the data, in
another callback) is no longer counted once its thread has ended or, where its driver named the frame of the
framework's fit call, once that frame has left its thread's stack: its stops run then, from the next fit to end.
"""

from __future__ import annotations

import contextvars
import logging
import sys
import threading
import weakref
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

log = logging.getLogger(__name__)

FitCall = tuple[int, CodeType]  # the framework's fit call: its frame's id and code (see `fit_call`)


class FitRun:
    """Stops registered by what a fit started, run once, newest first, when the fit ends."""

    def __init__(self, traces: Any = None, fit_call: FitCall | None = None) -> None:
        self._stops: list[tuple[Any, Callable[..., Any], tuple[Any, ...]]] = []
        self.closed = False
        self._closing = threading.Lock()  # (two threads may close one run: its fit's, and a sweep or a closer)
        self.traces = traces  # the fit's step trace coordinator (`hookprof.tracing.fit_traces()`)
        self._thread = threading.current_thread()
        self._frame = fit_call

    def running(self, frames: dict[int, FrameType] | None = None) -> bool:
        """Whether the fit may still run: its thread lives and, if its frame was named, has it on its stack.
        `frames`: each thread's current frame (`sys._current_frames()`), where the caller took them already."""
        thread = self._thread
        if not thread.is_alive():
            return False
        if self._frame is None:
            return True
        frame_id, code = self._frame
        frame = (sys._current_frames() if frames is None else frames).get(thread.ident)
        while frame is not None:
            if id(frame) == frame_id and frame.f_code is code:
                return True
            frame = frame.f_back
        return False

    def on_end(self, key: Any, stop: Callable[..., Any], *args: Any) -> None:
        """Run `stop(*args)` when the fit ends; a second registration under the same `key` is ignored (the
        render worker is started by every ProfilerHook of a fit, stopped once)."""
        if any(known == key for known, _, _ in self._stops):
            return
        self._stops.append((key, stop, args))

    def close(self) -> None:
        """Run every registered stop, newest first, once; one that raises is logged and the others still run."""
        with self._closing:
            if self.closed:
                return
            self.closed = True
            stops, self._stops = self._stops, []
        while stops:
            _, stop, args = stops.pop()
            try:
                stop(*args)
            except Exception:
                log.exception("hookprof could not stop %r at the end of the fit", stop)


def fit_call(frame: FrameType) -> FitCall:
    """The framework's fit call running in `frame`, by identity only (holding the frame would keep the fit's
    locals alive): what `open_run` is given to judge whether the fit still runs."""
    return id(frame), frame.f_code


_CURRENT: contextvars.ContextVar[FitRun | None] = contextvars.ContextVar("hookprof_fit_run", default=None)


_OPEN: weakref.WeakSet[FitRun] = weakref.WeakSet()  # the runs open in any context (fits in other threads)
_OPENING = threading.Lock()


def open_run(traces: Any = None, fit_call: FitCall | None = None) -> FitRun:
    """A new run, current from now on in this context (a run still open here is closed first); `traces`: the
    fit's step trace coordinator; `fit_call`: the framework's fit call (`fit_call(frame)`), where the driver
    knows it (the run counts as open no longer than that call runs)."""
    previous = _CURRENT.get()
    if previous is not None:
        close_run(previous)
    run = FitRun(traces, fit_call)
    with _OPENING:
        _OPEN.add(run)
    _CURRENT.set(run)
    return run


def close_run(run: FitRun) -> bool:
    """Close `run`; it stops being current if it was. Returns whether no other run is open now (in any
    context): the caller then stops what fits share."""
    run.close()
    if _CURRENT.get() is run:
        _CURRENT.set(None)
    with _OPENING:
        _OPEN.discard(run)
        # (failed fits that told no one; every thread's frames taken once for the sweep, and only if needed)
        frames = sys._current_frames() if any(other._frame is not None for other in _OPEN) else None
        ended = [other for other in _OPEN if not other.running(frames)]
        del frames  # (other threads' frames: not kept while the ended runs close)
        _OPEN.difference_update(ended)
        alone = not _OPEN
    for other in ended:
        other.close()
    return alone


def current_run() -> FitRun | None:
    """The fit running in this context, if any."""
    run = _CURRENT.get()
    return None if run is None or run.closed else run


def on_fit_end(key: Any, stop: Callable[..., Any], *args: Any) -> bool:
    """Register `stop(*args)` with the fit running in this context; False where no fit runs (the caller then
    keeps its own fallback)."""
    run = _CURRENT.get()
    if run is None or run.closed:
        return False
    run.on_end(key, stop, *args)
    return True
