"""The render worker: a second Python process that turns traced steps into files, off the training process.

Converting a traced step and rendering its timeline and step graph cost several microseconds of Python per
event. On a thread of the training process that work holds its GIL, so the training feels all of it, even
when the trace is taken every 10th step. The worker does it in its own interpreter, on another core. The
training process hands it a step as kineto's own export (a file torch's C++ writes, as `export_chrome_trace`
does) plus the compact event tree for dataflow and memory (`hookprof.tracing.kineto_trace`), and gets back
the bytes to write.

`WORKER.call(fn, *args)` runs `fn(*args)` there and returns its result. `fn` must be a module-level function
(pickled by name), and the arguments and result must pickle. The caller blocks reading a pipe, with the GIL
released. Details:
- The worker is a fresh interpreter running `main()` here, not a fork. A fork would copy the
  training process page by page as it writes (measured: more than the work it moves). multiprocessing's
  spawn re-imports the user's `__main__`, which may be a training script with no `__main__` guard.
- It starts at the first call, or earlier with `start()`, and serves calls one at a time.
- It ends when the training process closes its pipe (at exit) or dies.
- Its hookprof log records come back with each result and are logged here, as if here.
- A worker that dies mid-call (killed, out of memory) raises `WorkerFailed` here, as does one that has not
  answered within the call's `timeout`, or that has answered before and then used no CPU for the call's `stall`
  seconds (it hangs: stopped with SIGSTOP, stuck on a stalled disk; Linux, where `/proc` shows its CPU time):
  it is killed. A slow worker (a loaded machine) is never judged so, nor is one that has not answered yet (it
  starts: an interpreter and its imports). The next call starts a new one. A worker that dies
  before ever answering (it cannot import hookprof from here) makes every later call raise OSError at once:
  the caller does the work itself.
- Linux and macOS only (`AVAILABLE`); elsewhere the caller does the work on its own thread.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import errno
import gc
import importlib
import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import IO, Any

AVAILABLE = os.name == "posix"
_LENGTH = struct.Struct("<Q")
_POLL_SECONDS = 0.5  # how often a side waiting for the other checks that it still lives
_EXIT_SECONDS = 5.0  # how long the training process's exit waits for the worker to finish a call
# how much lower the worker's scheduling priority is than the training process's (`nice`): where the machine has
# fewer free cores than the training and the worker need, the training's threads run first (the worker still gets
# a share, and its stalls are judged by its CPU time, not by how long it takes)
WORKER_NICE = 10
FULL_COLLECTION_CALLS = 16  # the worker's cyclic collector looks at what outlives calls once per this many calls

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _held(lock: threading.Lock, timeout: float | None) -> Iterator[bool]:
    """`lock` held for the block, waited for `timeout` seconds at most (None: as long as it takes): whether
    it was taken."""
    taken = lock.acquire(timeout=-1 if timeout is None else timeout)
    try:
        yield taken
    finally:
        if taken:
            lock.release()


class WorkerFailed(RuntimeError):
    """The worker ended without a result (a signal, an exit), or the function raised there."""


class Worker:
    """The training process's side: starts the worker process on demand and calls functions there."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None
        self._answered = False  # whether the running worker ever answered (one that never does is broken)
        self._broken: str | None = None  # why workers cannot run here: callers render themselves
        self._lock = threading.Lock()  # one call at a time (the pipe carries one conversation)
        # tells skipped while the worker was busy (`tell`): run before its next call, in the same request
        self._told: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = collections.deque(maxlen=256)

    def start(self, preload: tuple[str, ...] = ()) -> None:
        """Start the worker now, if not running, importing the `preload` modules while the caller goes on
        (an interpreter and its imports take a second or so)."""
        if self._lock.acquire(blocking=False):  # (busy: it runs already)
            try:
                self._started(preload)
            finally:
                self._lock.release()

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
             stall: float | None = None) -> Any:
        """`fn(*args)` in the worker. Raises `WorkerFailed` when the worker dies, `fn` raises there, it has
        not answered after `timeout` seconds, or it used no CPU for `stall` seconds (it is killed then: a hung
        one must not hold up the training process's end); OSError when no worker can run here (it cannot
        start, or the first one died, or used no CPU for `stall` seconds, before answering)."""
        return self._call(fn, args, timeout, start=True, stall=stall)

    def tell(self, fn: Callable[..., Any], *args: Any, timeout: float = _EXIT_SECONDS) -> None:
        """`fn(*args)` in the worker if one runs, for what it holds (a fit's end: what it kept for that fit); none
        is started for it (a new one holds nothing). One busy with a call is not waited for: it runs `fn` before
        its next call. A failure is logged, never raised: the worker that failed is gone, and what it held with
        it."""
        try:
            self._call(fn, args, timeout, start=False)
        except (WorkerFailed, OSError) as err:
            log.debug("The render worker could not run %s: %s", getattr(fn, "__name__", fn), err)

    def _call(self, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float | None, start: bool,
              stall: float | None = None) -> Any:
        with _held(self._lock, None if start else 0) as held:
            if not held:  # (busy with another fit's step: a `tell` is not waited for, it goes with the next call)
                self._told.append((fn, args))
                return None
            process = self._process
            if start:
                process = self._started()
            elif process is None or process.poll() is not None or not self._answered:
                return None  # (one still starting holds nothing yet)
            told = []
            while self._told:
                told.append(self._told.popleft())
            call = (_after_told, (told, fn, args)) if told else (fn, args)
            request = pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
            reply = None
            deadline = None if timeout is None else time.monotonic() + timeout
            peer = _Progress(process, stall) if stall is not None else process
            try:
                _send_within(process.stdin.fileno(), request, peer, deadline)
                reply = _receive(process.stdout.fileno(), peer, deadline)
            except _Stalled:
                self._discard(process)
                if not self._answered:  # (hung while starting, its imports stuck: so would the next one be)
                    self._broken = f"it used no CPU for {stall:g} s before answering once (hung while starting)"
                    raise OSError(errno.ECHILD, self._broken) from None
                raise WorkerFailed(f"the render worker used no CPU for {stall:g} s (hung: stopped, or stuck on "
                                   "its disk) and was killed; a new one renders the next steps") from None
            except TimeoutError:
                self._discard(process)
                raise WorkerFailed(f"the render worker took more than {timeout:g} s and was stopped") from None
            except OSError:  # the worker's end of the pipe is gone: it died
                pass
            except BaseException:  # the conversation is broken: a new worker for the next call
                self._discard(process)
                raise
            if reply is None:
                self._discard(process)
                reason = _ended(process)
                if not self._answered:
                    self._broken = f"{reason} before answering once"
                    raise OSError(errno.ECHILD, self._broken)
                raise WorkerFailed(reason)
            self._answered = True
        ok, value, records = pickle.loads(reply)
        for record in records:
            logger = logging.getLogger(record.name)
            if logger.isEnabledFor(record.levelno):  # (the levels set here rule, as for records made here)
                logger.handle(record)
        if not ok:
            raise WorkerFailed(value)
        return value

    def _started(self, preload: tuple[str, ...] = ()) -> subprocess.Popen:
        if self._broken is not None:
            raise OSError(errno.ECHILD, self._broken)
        process = self._process
        if process is None or process.poll() is not None:
            if process is not None:  # one that exited: reaped, its pipes closed
                _end(process)
            if not sys.executable:  # (an embedded interpreter)
                raise OSError(errno.ENOENT, "this Python has no executable to start the render worker with")
            # the parent's import path, absolute (the worker starts in the same directory, but the parent
            # may have moved since); -P: no script directory or working directory put before it
            path = os.pathsep.join(os.path.abspath(entry) for entry in sys.path if entry)
            env = {**os.environ, "PYTHONPATH": path}
            # at a lower priority than the training (from its first import on): where the two share cores, the
            # training gets them first and the worker the rest (`WORKER_NICE`)
            code = (f"import os; os.nice({WORKER_NICE}); from hookprof._runtime.worker import main; "
                    f"main({os.getpid()}, {tuple(preload)!r})")
            stderr = None if sys.stderr is not None else subprocess.DEVNULL
            process = self._process = subprocess.Popen(
                [sys.executable, "-P", "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=stderr, env=env, close_fds=True)
            self._answered = False
        return process

    def _discard(self, process: subprocess.Popen) -> None:
        self._process = None
        _end(process)

    def stop(self) -> None:
        """End the worker (at the training process's exit): it is told to quit, finishes and exits."""
        process, self._process = self._process, None
        if process is None:
            return
        try:
            # (a forked child may hold the pipe open: an explicit quit, written as the pipe takes it: the calls
            # left it non-blocking)
            _send_within(process.stdin.fileno(), b"", process, time.monotonic() + _EXIT_SECONDS)
            process.stdin.close()
            process.wait(_EXIT_SECONDS)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
        _end(process)

    @property
    def answered(self) -> bool:
        """Whether the running worker has answered a call (one that has not is still starting: an interpreter
        and its imports take a second or more on a loaded machine)."""
        return self._process is not None and self._answered

    @property
    def starting(self) -> bool:
        """Whether a worker process is running that has not answered a call yet (none can run here once the
        first one died before answering: calls render in the caller's process then)."""
        process = self._process
        return process is not None and not self._answered and self._broken is None and process.poll() is None

    def _forget(self) -> None:
        """In a forked child (a DataLoader worker): the worker is the parent's; this process starts its own
        if it ever needs one."""
        self._process = None
        self._lock = threading.Lock()
        self._told = collections.deque(maxlen=256)


def _after_told(told: list[tuple[Callable[..., Any], tuple[Any, ...]]], fn: Callable[..., Any],
                args: tuple[Any, ...]) -> Any:
    """In the worker: the tells skipped while it was busy (`Worker.tell`), then the call."""
    for tell_fn, tell_args in told:
        try:
            tell_fn(*tell_args)
        except Exception:  # (a tell's failure is no call's)
            log.debug("The render worker could not run %s", getattr(tell_fn, "__name__", tell_fn), exc_info=True)
    return fn(*args)


def _end(process: subprocess.Popen) -> None:
    """Kill the worker unless it has exited, reap it (no zombie) and close this side of its pipes (no file left
    for the garbage collector to warn about: a `ResourceWarning` in the user's process)."""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        if process.poll() is None:
            process.kill()
        process.wait(_POLL_SECONDS)
    for pipe in (process.stdin, process.stdout):
        with contextlib.suppress(OSError):
            pipe.close()


def _send(out: IO[bytes], data: bytes) -> None:
    out.write(_LENGTH.pack(len(data)))
    out.write(data)
    out.flush()


def _send_within(fd: int, data: bytes, peer: subprocess.Popen | _Progress, deadline: float | None) -> None:
    """One length-prefixed message to the worker, written as the pipe takes it: a worker that stopped reading
    (it hangs: stopped, stalled) fills the pipe, and a blocking write would wait for ever. Raises TimeoutError
    once `deadline` has passed, BrokenPipeError when the worker is gone."""
    message = memoryview(_LENGTH.pack(len(data)) + data)
    os.set_blocking(fd, False)
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    sent = 0
    while sent < len(message):
        wait = _POLL_SECONDS if deadline is None else min(_POLL_SECONDS, deadline - time.monotonic())
        if wait <= 0:
            raise TimeoutError
        if not poller.poll(wait * 1000):
            if _gone(peer):
                raise BrokenPipeError(errno.EPIPE, "the render worker is gone")
            continue
        try:
            sent += os.write(fd, message[sent:sent + (1 << 20)])
        except BlockingIOError:
            continue


def _receive(fd: int, peer: subprocess.Popen | _Progress | int, deadline: float | None = None) -> bytes | None:
    """One length-prefixed message from `fd`; None when the other side ended before sending it whole (it
    died, or closed the pipe). `peer`: the worker's process (or its `_Progress`) here, the training process's pid
    there. Raises TimeoutError once `deadline` (`time.monotonic()`) has passed."""
    poller = select.poll()  # (not select.select: a descriptor may be 1024 or more)
    poller.register(fd, select.POLLIN)
    buffer = bytearray()
    want = _LENGTH.size
    while len(buffer) < want:
        wait = _POLL_SECONDS if deadline is None else min(_POLL_SECONDS, deadline - time.monotonic())
        if wait <= 0:
            raise TimeoutError
        if not poller.poll(wait * 1000):
            if _gone(peer):
                return None
            continue
        chunk = os.read(fd, min(want - len(buffer), 1 << 20))
        if not chunk:
            return None
        buffer += chunk
        if want == _LENGTH.size and len(buffer) >= want:
            want += _LENGTH.unpack_from(buffer)[0]
    return bytes(memoryview(buffer)[_LENGTH.size:want])


class _Stalled(TimeoutError):
    """The worker used no CPU for the call's `stall` seconds."""


def cpu_ticks(pid: int) -> int | None:
    """The CPU time process `pid` has used so far, in clock ticks (user and system, from `/proc/<pid>/stat`);
    None where that cannot be read (not Linux, the process gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat(5))
    except (OSError, IndexError, ValueError):
        return None


class _Progress:
    """The worker during a call that judges stalls: `stalled()` once it has used no CPU for `stall` seconds
    (checked each time a wait for it times out). Where its CPU time cannot be read it is never judged so."""

    __slots__ = ("process", "stall", "_ticks", "_since")

    def __init__(self, process: subprocess.Popen, stall: float) -> None:
        self.process, self.stall = process, stall
        self._ticks, self._since = cpu_ticks(process.pid), time.monotonic()

    def stalled(self) -> bool:
        ticks, now = cpu_ticks(self.process.pid), time.monotonic()
        if ticks is None or ticks != self._ticks:
            self._ticks, self._since = ticks, now
            return False
        return now - self._since >= self.stall


def _gone(peer: subprocess.Popen | _Progress | int) -> bool:
    """Whether the other side ended; raises `_Stalled` when it lives but stalled (`_Progress`)."""
    if isinstance(peer, int):
        return os.getppid() != peer
    if isinstance(peer, _Progress):
        if peer.process.poll() is not None:
            return True
        if peer.stalled():
            raise _Stalled
        return False
    return peer.poll() is not None


def _ended(process: subprocess.Popen) -> str:
    try:
        status = process.wait(_POLL_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        return "the render worker stopped answering"
    if status < 0:
        try:
            return f"the render worker was killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"the render worker was killed by signal {-status}"
    return f"the render worker exited with status {status}"


class _Records(logging.Handler):
    """The worker's log records, made picklable (message formatted, traceback as text)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        record.msg, record.args, record.exc_info = record.getMessage(), None, None
        self.records.append(record)


def main(parent: int, preload: tuple[str, ...] = ()) -> None:
    """The worker's loop: a call in, its result out, until the training process closes the pipe or dies."""
    # Ctrl-C and a batch system's SIGTERM to the process group are the training's to handle: the worker
    # finishes the step it renders, and ends when the training process tells it to or dies
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    for module in preload:
        try:
            importlib.import_module(module)
        except Exception:  # (said when a call needs it)
            pass
    # The worker builds and drops a step's hundreds of thousands of acyclic objects per call: the cyclic
    # collector runs once after each call, when they are gone (a pass then costs little: what the imports made
    # is frozen out of it), never while they are alive (a full pass over a 20k-op step cost 120 ms). That pass
    # looks at what the call made alone; what outlives calls (a fit's identity template, the renderers' last
    # step: `hookprof.step_stats.ShapedParts`, tens of thousands of objects) is looked at every
    # FULL_COLLECTION_CALLS calls (a full pass over it cost 10-15 ms: as much as the rest of the pass).
    gc.disable()
    gc.freeze()
    calls = 0
    requests = sys.stdin.buffer.fileno()
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print must not corrupt the replies
    records = _Records()
    logger = logging.getLogger("hookprof")
    logger.handlers, logger.propagate = [records], False
    while True:
        request = _receive(requests, parent)
        if not request:  # the training process ended, or said to quit (an empty message)
            return
        try:
            fn, args = pickle.loads(request)
            result = (True, fn(*args), records.records)
        except BaseException:  # (the caller says what failed)
            result = (False, traceback.format_exc(), records.records)
        try:
            data = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            data = pickle.dumps((False, traceback.format_exc(), records.records))
        records.records = []
        try:
            _send(replies, data)
        except OSError:  # the training process is gone
            return
        del request, result, data
        calls += 1
        gc.collect(2 if calls % FULL_COLLECTION_CALLS == 0 else 1)


WORKER = Worker()
atexit.register(WORKER.stop)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=WORKER._forget)
