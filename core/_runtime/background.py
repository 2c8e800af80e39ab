"""Work taken off the training thread: a traced step's conversion, timeline file and TensorBoard record.

After a traced step, torch's profiler has stopped but turning its events into `StepStats` and writing them
costs as much again (several microseconds per event, all Python). `BACKGROUND` runs those jobs on
one worker thread, in the order they came, while training goes on in torch's kernels (which release the GIL).

`submit` returns a `BackgroundJob` handle; readers wait on the jobs they depend on:
- a `ProfilerHook` on its own last job at `end()`/`close()`, `saved_paths` and `flush()`, so every file is
  on disk when `fit` returns;
- a `Profiler` on the jobs that add steps to it, before it reports.
File writes themselves run on a second worker, `WRITES`, fed by those jobs: the disk's time is no one's wait.
Only two waits are for the whole of `BACKGROUND` (`wait_idle`): before a new trace starts
(`StepTraceCoordinator`), so a conversion never runs inside the next traced step and distorts its timings,
and before a fork. `RENDERS` waits for the render worker (`hookprof._runtime.worker`), a process of its own:
while it renders one step, `BACKGROUND` exports the next.

The thread exists only while there is work (it is not a daemon: the interpreter finishes a write in progress
before it exits, and no file is left half-written).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class BackgroundJob:
    """A submitted job: `done` once it has run; `wait()` blocks until then."""

    __slots__ = ("_background", "_done")

    def __init__(self, background: Background) -> None:
        self._background = background
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Return once the job has run (or `timeout` seconds passed); return whether it has run. On the worker
        thread itself it returns at once: every job submitted before the running one has run, and a later one
        cannot be waited for from there."""
        if threading.current_thread() is not self._background._thread:
            return self._done.wait(timeout)
        return self.done


class Background:
    """One worker thread, started on demand, that runs submitted jobs in order and ends when none are left."""

    def __init__(self, name: str = "hookprof-background") -> None:
        self.name = name
        self._jobs: collections.deque[tuple[Callable[[], None], BackgroundJob]] = collections.deque()
        self._idle = threading.Condition()
        self._thread: threading.Thread | None = None
        self._last: threading.Thread | None = None  # the newest thread started (joined by `drain`)
        self.idle_since_ns = 0  # (time.time_ns()) when its last job ended

    def submit(self, job: Callable[[], None]) -> BackgroundJob:
        """Run `job()` on the worker after the jobs already submitted; wait on the handle for it. A job's
        exception is logged, never raised: jobs handle their own failures (a failed write must not end
        training)."""
        handle = BackgroundJob(self)
        entry = (job, handle)
        with self._idle:
            self._jobs.append(entry)
            if self._thread is not None:
                return handle
            thread = threading.Thread(target=self._work, name=self.name)
            try:
                thread.start()
            except RuntimeError:  # no thread to be had (a thread limit, an interpreter shutting down)
                self._jobs.remove(entry)
            else:
                self._thread = self._last = thread
                return handle
        log.warning("No background thread could start; writing on the training thread.", exc_info=True)
        self._run(job, handle)
        return handle

    def wait_idle(self) -> None:
        """Return once every job submitted so far has run (at once when called from a job)."""
        with self._idle:
            while self._thread is not None and self._thread is not threading.current_thread():
                self._idle.wait()

    def drain(self) -> None:
        """Return once every job submitted so far has run and the worker thread has ended (a fit's end leaves
        no thread of hookprof's behind). From a job itself it returns at once."""
        self.wait_idle()
        last = self._last
        if last is not None and last is not threading.current_thread():
            last.join()
            if self._last is last:
                self._last = None  # (no reference kept to an ended thread)

    @property
    def busy(self) -> bool:
        """Whether a job is running or waiting."""
        return self._thread is not None

    def _work(self) -> None:
        while True:
            with self._idle:
                if not self._jobs:
                    self.idle_since_ns = time.time_ns()
                    self._thread = None
                    self._idle.notify_all()
                    return
                job, handle = self._jobs.popleft()
            self._run(job, handle)

    @staticmethod
    def _run(job: Callable[[], None], handle: BackgroundJob) -> None:
        try:
            job()
        except Exception:  # a bug of ours: logged, and the next job still runs
            log.exception("A hookprof background job failed")
        finally:
            handle._done.set()


BACKGROUND = Background()
# The disk's own worker: a rendered timeline (bytes in memory) and its TensorBoard events are put on disk
# here, so a slow disk holds up neither training nor the next traced step's conversion. ProfilerHook bounds
# how many files wait for it (MAX_PENDING_WRITES) and skips traces past that, counted.
WRITES = Background("hookprof-writes")
# The render worker's caller: a job here hands an exported step to the worker process and waits (in a read,
# the GIL released) for its bytes, which go on to WRITES. One worker renders one step at a time.
RENDERS = Background("hookprof-renders")


_COUNTING = threading.Lock()


def count_dropped(owner: Any) -> None:
    """Add one to `owner.dropped_outputs`. The training thread and the background threads all count there, and
    `+=` on an attribute is no atomic step between threads."""
    with _COUNTING:
        owner.dropped_outputs += 1


def drain_all() -> None:
    """Wait for every job of hookprof's workers and for their threads to end, producers first."""
    for worker in (BACKGROUND, RENDERS, WRITES):
        worker.drain()


def any_busy() -> bool:
    """Whether any of hookprof's own workers has work (a step timed now may be slowed by it)."""
    return BACKGROUND.busy or WRITES.busy or RENDERS.busy


def busy_since(start_ns: int) -> bool:
    """Whether any of hookprof's own workers had work at some time since `start_ns` (time.time_ns()): a wait
    timed from then to now shared the process with it."""
    return any(worker.busy or worker.idle_since_ns > start_ns for worker in (BACKGROUND, WRITES, RENDERS))


def _after_fork_in_child() -> None:
    """A forked child has no worker threads: they start afresh there (and no thread holds its lock there)."""
    global _COUNTING
    _COUNTING = threading.Lock()
    for worker in (BACKGROUND, WRITES, RENDERS):
        worker.__init__(worker.name)


if hasattr(os, "register_at_fork"):
    # A fork (DataLoader workers start so, often right after a traced epoch-end step) waits for the worker:
    # a child forked mid-job would inherit its locks held and the garbage collector paused.
    os.register_at_fork(before=BACKGROUND.wait_idle, after_in_child=_after_fork_in_child)
