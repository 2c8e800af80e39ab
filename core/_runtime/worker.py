"""The render worker: a second Python process that turns traced steps into files, off the training process.

Converting a traced step and rendering its timeline and step graph cost several microseconds of Python per
event. On a thread of the training process that work holds its GIL, so the training feels all of it, even
when the trace is taken every 10th step. The worker does it in its own interpreter, on another core. The
training process hands it a step as kineto's own export (a file torch's C++ writes, as `export_chrome_trace`
does) plus the compact event tree for dataflow and memory (`hookprof.tracing.kineto_trace`), and gets back
the bytes to write.

`WORKER.call(fn, *args)` runs `fn(*args)` there and returns its result. `fn` must be a module-level function
(pickled by name), and the arguments and result must pickle. `WORKER.post(fn, *args)` sends the call and
returns at once; `WORKER.take(ticket)`, on any thread, waits for its result. Details:
- Nothing waits for the training process's GIL between two calls. The training thread holds it for 100 ms
  and more at a time (torch's profiler stop, kineto's export), and a reply of a 20k-op step is 5-13 MB, so:
  - the next call is sent before the last one's reply is read (`post`): the worker starts it as soon as it
    has handed that reply over;
  - the worker hands a reply to a thread of its own, which sends it while the worker goes on;
  - replies come over a socket, and a reply's body is read in one call without the GIL (`MSG_WAITALL`;
    a pipe gives 64 KiB a read, and each read needs the GIL back). Requests go through a pipe of 1 MiB
    where Linux allows it, so that sending one rarely waits for the worker.
  Measured at 20k events, every step traced with the defaults: the worker spent 50-90 ms a step waiting to
  hand a reply over, and then waited for the next request; after, it waits for the training alone.
- The worker is a fresh interpreter running `main()` here, not a fork. A fork would copy the
  training process page by page as it writes (measured: more than the work it moves). multiprocessing's
  spawn re-imports the user's `__main__`, which may be a training script with no `__main__` guard.
- It starts at the first call, or earlier with `start()`, and serves calls one at a time.
- It ends when the training process tells it to (`stop`: the last fit open ends, the process exits), closes
  its pipe, or dies.
- Its hookprof log records come back with each result and are logged here, as if here.
- A worker that dies mid-call (killed, out of memory) raises `WorkerFailed` here, as does one that has not
  answered within the call's `timeout`, or that has answered before and then used no CPU for the call's `stall`
  seconds (it hangs: stopped with SIGSTOP, stuck on a stalled disk; Linux, where `/proc` shows its CPU time):
  it is killed. A slow worker (a loaded machine) is never judged so, nor is one that has not answered yet (it
  starts: an interpreter and its imports). The calls sent after the one it ran go to a new one. A worker that
  dies before ever answering (it cannot import hookprof from here) makes every later call raise OSError at
  once: the caller does the work itself.
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
import queue
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import IO, Any

try:
    import fcntl
except ImportError:  # (not POSIX: no worker runs there, see AVAILABLE)
    fcntl = None

AVAILABLE = os.name == "posix"
_LENGTH = struct.Struct("<Q")
_POLL_SECONDS = 0.5  # how often a side waiting for the other checks that it still lives
_EXIT_SECONDS = 5.0  # how long the training process's exit waits for the worker to finish a call
# how much lower the worker's scheduling priority is than the training process's (`nice`): where the machine has
# fewer free cores than the training and the worker need, the training's threads run first (the worker still gets
# a share, and its stalls are judged by its CPU time, not by how long it takes)
WORKER_NICE = 10
_REQUEST_PIPE_BYTES = 1 << 20  # the request pipe's buffer (`Worker.post`)
FULL_COLLECTION_CALLS = 16  # the worker's cyclic collector looks at what outlives calls once per this many calls

log = logging.getLogger(__name__)


class WorkerFailed(RuntimeError):
    """The worker ended without a result (a signal, an exit), or the function raised there."""


class _Ticket:
    """A request posted to the worker (`Worker.post`): `Worker.take` waits for its reply and gives its result."""

    __slots__ = ("request", "process", "delivered", "reply", "error", "discard")

    def __init__(self, request: bytes, discard: bool = False) -> None:
        self.request = request
        # the worker it was sent to; None once that worker died with an earlier request: sent again by `take`
        self.process: subprocess.Popen | None = None
        self.delivered = False  # whether the request went into the worker's pipe whole
        self.reply: bytes | bytearray | None = None
        self.error: BaseException | None = None
        self.discard = discard  # a `tell`: no one takes it; its reply is dropped when read


class Worker:
    """The training process's side: starts the worker process on demand and sends it calls, which it runs one at
    a time, in the order sent.

    A call can be sent (`post`) before the worker has finished the calls before it, and its result taken
    (`take`) later, from another thread: the worker then starts it as soon as it has sent the previous one's
    reply, without waiting for this process to read that reply and send the next request (the training
    thread holds this process's GIL for 100 ms and more at a time in torch's profiler stop, which a reader here
    waits for). Replies are read in the order sent, whoever reads them. A worker that dies or is killed mid-call
    costs that call (the first unread one: the call it was running) and no other: the calls sent after it go
    to a new worker."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None
        self._answered = False  # whether the running worker ever answered (one that never does is broken)
        self._broken: str | None = None  # why workers cannot run here: callers render themselves
        # the process and the order of requests: held to send one (whole, in order) and to end a failed worker
        self._lock = threading.Lock()
        self._reading = threading.Lock()  # one reader of the replies at a time
        # the calls sent to `_process` whose replies are not read yet, in the order sent
        self._outstanding: collections.deque[_Ticket] = collections.deque()
        self._killed: tuple[subprocess.Popen, WorkerFailed] | None = None  # killed by a sender, and why

    def start(self, preload: tuple[str, ...] = ()) -> None:
        """Start the worker now, if not running, importing the `preload` modules while the caller goes on
        (an interpreter and its imports take a second or so)."""
        if self._lock.acquire(blocking=False):  # (busy: it runs already)
            try:
                if self._replaceable():
                    self._started(preload)
            finally:
                self._lock.release()

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
             stall: float | None = None) -> Any:
        """`fn(*args)` in the worker. Raises `WorkerFailed` when the worker dies, `fn` raises there, it has
        not answered after `timeout` seconds, or it used no CPU for `stall` seconds (it is killed then: a hung
        one must not hold up the training process's end); OSError when no worker can run here (it cannot
        start, or the first one died, or used no CPU for `stall` seconds, before answering)."""
        return self.take(self.post(fn, *args, timeout=timeout, stall=stall), timeout=timeout, stall=stall)

    def post(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
             stall: float | None = None) -> _Ticket:
        """Send `fn(*args)` to the worker (started if need be) and return at once, without its result: `take`
        gives it. Raises OSError when no worker can run here, and what pickling the call raises. A worker that
        does not take the request (its pipe full: it is stopped, or hangs) within `timeout` seconds, or uses no
        CPU for `stall` seconds meanwhile, is killed: `take` says so."""
        ticket = _Ticket(pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL))
        self._send(ticket, timeout, stall, start=True)
        return ticket

    def take(self, ticket: _Ticket, timeout: float | None = None, stall: float | None = None) -> Any:
        """The result of the call `post` sent, once the worker has run it; raises as `call` does. `timeout` and
        `stall` judge the worker from now on."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._reading:
            while ticket.reply is None and ticket.error is None:
                if ticket.process is None:  # (its worker died with an earlier call: sent to a new one)
                    self._send(ticket, timeout, stall, start=True)
                    continue
                self._read_next(ticket.process, deadline, timeout, stall)
        if ticket.error is not None:
            raise ticket.error
        return _result(ticket.reply)

    def tell(self, fn: Callable[..., Any], *args: Any, timeout: float = _EXIT_SECONDS) -> None:
        """`fn(*args)` in the worker if one runs, for what it holds (a fit's end: what it kept for that fit); none
        is started for it (a new one holds nothing). Not waited for: the worker runs it after the calls sent
        before it. A failure is logged, never raised: the worker that failed is gone, and what it held with it."""
        try:
            self._send(_Ticket(pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL), discard=True), timeout,
                       None, start=False)
        except OSError as err:
            log.debug("The render worker could not run %s: %s", getattr(fn, "__name__", fn), err)

    def _send(self, ticket: _Ticket, timeout: float | None, stall: float | None, start: bool) -> None:
        """Send `ticket`'s request to the running worker (one started if `start`; else none is sent to a worker
        that is not running or has not answered yet: it holds nothing). A worker whose replies wait to be read
        is never replaced here: one that died goes with the reader's next read (`_read_next`)."""
        with self._lock:
            process = self._process
            if self._replaceable():
                if start:
                    process = self._started()
                elif process is None or process.poll() is not None or not self._answered:
                    return
            ticket.process, ticket.delivered = process, False
            self._outstanding.append(ticket)
            deadline = None if timeout is None else time.monotonic() + timeout
            try:
                _send_within(process.stdin.fileno(), ticket.request, _Progress(process, stall) if stall is not None
                             else process, deadline)
                ticket.delivered = True
            except BaseException as err:  # (gone, hung, or the request cut short: the conversation is broken)
                with contextlib.suppress(OSError):
                    process.kill()  # (its reader finds it ended: the calls sent before this one are its to judge)
                if isinstance(err, TimeoutError):  # (and _Stalled) it took no request for that long: it hangs
                    self._outstanding.remove(ticket)
                    ticket.error = self._judged(err, timeout, stall)
                    self._killed = (process, ticket.error)
                elif not isinstance(err, OSError):  # (OSError: it was gone, and this call goes to a new one)
                    raise

    def _replaceable(self) -> bool:
        """Whether no call sent to the running worker waits for its reply, so that one that ended may be replaced
        (`_lock` held). Tells sent to one that ended are dropped: what they would have cleared went with it."""
        process = self._process
        if (process is None or process.poll() is not None) and all(sent.discard for sent in self._outstanding):
            self._outstanding.clear()
        return not self._outstanding

    def _read_next(self, process: subprocess.Popen, deadline: float | None, timeout: float | None,
                   stall: float | None) -> None:
        """Read the next reply of `process`, into the first unread call. A worker that ended, hung or took too long
        is killed: the first unread call fails (the one it ran), the later ones are sent again to a new one."""
        peer = _Progress(process, stall) if stall is not None else process
        error: BaseException | None = None
        reply = None
        try:
            reply = _receive_whole(process.stdout, peer, deadline)
        except TimeoutError as err:  # (and _Stalled)
            error = self._judged(err, timeout, stall)
        except OSError:  # the worker's end of the pipe is gone: it died
            pass
        except BaseException as err:  # the conversation is broken: a new worker for the next call
            error = err
        with self._lock:
            sent = [ticket for ticket in self._outstanding if ticket.process is process]  # (none once stopped)
            # the first it took whole: the one this reply answers, or the one it ran when it ended
            ran = next((ticket for ticket in sent if ticket.delivered), None)
            if reply is not None:
                self._answered = self._answered or self._process is process
                if ran is not None:
                    self._outstanding.remove(ran)
                    if ran.discard:
                        with contextlib.suppress(WorkerFailed):
                            _result(reply)  # (its log records)
                    else:
                        ran.reply = reply
                return
            for ticket in sent:
                self._outstanding.remove(ticket)
            if self._process is process:
                self._process = None
            _end(process)
            killed, self._killed = self._killed, None
            if error is None and killed is not None and killed[0] is process:
                error = killed[1]  # (killed by a sender, which judged it hung)
            if error is None:
                reason = _ended(process)
                if not self._answered:
                    self._broken = f"{reason} before answering once"
                error = WorkerFailed(reason)
            if self._broken is not None:
                error = OSError(errno.ECHILD, self._broken)
            for ticket in sent:
                if ticket is ran or ticket.discard:  # (and tells to a worker gone: what they clear went with it)
                    ticket.error = error
                else:
                    ticket.process = None  # (`take` sends it to a new worker)
        if not isinstance(error, (WorkerFailed, OSError)):
            raise error

    def _judged(self, err: TimeoutError, timeout: float | None, stall: float | None) -> WorkerFailed:
        """Why a worker judged hung (`_Stalled`) or slow (a timeout) was killed."""
        if isinstance(err, _Stalled):
            if not self._answered:  # (hung while starting, its imports stuck: so would the next one be)
                self._broken = f"it used no CPU for {stall:g} s before answering once (hung while starting)"
            return WorkerFailed(f"the render worker used no CPU for {stall:g} s (hung: stopped, or stuck on its "
                                "disk) and was killed; a new one renders the next steps")
        return WorkerFailed(f"the render worker took more than {timeout:g} s and was stopped")

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
            # its replies come over a socket, not a pipe: a reply is read whole in one call, without the GIL
            # (`_receive_whole`); it stands where the process's stdout pipe would (closed with it, by `_end`)
            ours, theirs = socket.socketpair()
            try:
                process = subprocess.Popen(
                    [sys.executable, "-P", "-c", code], stdin=subprocess.PIPE, stdout=theirs.fileno(),
                    stderr=stderr, env=env, close_fds=True)
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
            process.stdout = ours
            # requests are sent while it renders the one before (`post`): a pipe of 1 MiB (Linux's most for
            # a process without privileges) takes a walked step's identities whole, so that the sender does not
            # wait for the worker to finish; where it cannot be had, the sender waits
            with contextlib.suppress(AttributeError, OSError):
                fcntl.fcntl(process.stdin.fileno(), fcntl.F_SETPIPE_SZ, _REQUEST_PIPE_BYTES)
            self._process = process
            self._answered = False
        return process

    def stop(self) -> None:
        """End the worker (at the training process's exit, and a fit's end): it is told to quit, finishes what it
        was sent and exits. Calls whose results were not taken yet fail."""
        with self._lock:
            process, self._process = self._process, None
            for ticket in self._outstanding:
                ticket.error = WorkerFailed("the render worker was stopped")
            self._outstanding.clear()
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
        self._lock, self._reading = threading.Lock(), threading.Lock()
        self._outstanding = collections.deque()


def _result(reply: bytes | bytearray) -> Any:
    """A call's result from its reply: the worker's log records logged here, as if made here; `WorkerFailed` raised
    when the call raised there."""
    ok, value, records = pickle.loads(reply)
    for record in records:
        logger = logging.getLogger(record.name)
        if logger.isEnabledFor(record.levelno):  # (the levels set here rule, as for records made here)
            logger.handle(record)
    if not ok:
        raise WorkerFailed(value)
    return value


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


def _receive_whole(replies: socket.socket, peer: subprocess.Popen | _Progress,
                   deadline: float | None = None) -> bytearray | None:
    """One length-prefixed reply from the worker, as `_receive` reads one (None when the worker ended before
    sending it whole), but each part read in one call that returns when it is all there (`MSG_WAITALL`), which
    waits without the GIL. A pipe's read returns at most what the pipe holds (64 KiB): each read of a reply of
    megabytes then needed the GIL back, and while the training thread held it through torch's profiler stop
    the worker waited to hand its reply over (15-146 ms a step at 20k events, longer than the render)."""
    header = bytearray(_LENGTH.size)
    if not _fill(replies, memoryview(header), peer, deadline):
        return None
    body = bytearray(_LENGTH.unpack(header)[0])
    return body if _fill(replies, memoryview(body), peer, deadline) else None


def _fill(replies: socket.socket, view: memoryview, peer: subprocess.Popen | _Progress,
          deadline: float | None) -> bool:
    """Fill `view` from `replies`; False when the worker ended first. The socket's own receive timeout
    (`SO_RCVTIMEO`, _POLL_SECONDS at most) ends a call now and then, so that the worker's life and progress
    (`_gone`), and `deadline` (TimeoutError), are checked as `_receive` checks them."""
    got = 0
    while got < len(view):
        wait = _POLL_SECONDS if deadline is None else min(_POLL_SECONDS, deadline - time.monotonic())
        if wait <= 0:
            raise TimeoutError
        seconds = int(wait)
        replies.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                           struct.pack("ll", seconds, max(1, int((wait - seconds) * 1e6))))
        try:
            count = replies.recv_into(view[got:], 0, socket.MSG_WAITALL)
        except (BlockingIOError, InterruptedError):  # (the timeout with nothing read: EAGAIN)
            count = None
        if count == 0:  # (the worker closed its end: it ended)
            return False
        got += count or 0
        if got < len(view) and _gone(peer):
            return False
    return True


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
    # replies go out on a thread of their own: a reply of megabytes waits for the training process to read it,
    # and the next call (sent already: `Worker.post`) runs meanwhile
    outbox: queue.SimpleQueue[bytes] = queue.SimpleQueue()
    gone = threading.Event()  # the training process is gone: its end of the replies closed

    def send_replies() -> None:
        while True:
            data = outbox.get()
            try:
                _send(replies, data)
            except OSError:
                gone.set()
                return

    threading.Thread(target=send_replies, name="hookprof-replies", daemon=True).start()
    while not gone.is_set():
        request = _receive(requests, parent)
        if not request:  # the training process ended, or said to quit (an empty message)
            # At once: the interpreter's own end frees every object and module one by one (60 ms and more after
            # a fit, which the training process's `stop` waits for); the worker has nothing to flush or remove.
            os._exit(0)
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
        outbox.put(data)
        del request, result, data
        calls += 1
        gc.collect(2 if calls % FULL_COLLECTION_CALLS == 0 else 1)


WORKER = Worker()
atexit.register(WORKER.stop)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=WORKER._forget)
