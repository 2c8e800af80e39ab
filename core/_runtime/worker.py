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
    a pipe gives 64 KiB a read, and each read needs the GIL back);
  - sending never waits (it runs on the background thread, which the next traced step waits for): a request
    is written at once where it fits in the worker's pipe (1 MiB where Linux allows it: a walked 20k-op step
    is about 0.6 MB), else by the thread that takes its result, after the ones before it.
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
  starts: an interpreter and its imports). The calls sent after the one it ran go to a new one, in their
  order (a call it had finished, whose reply was cut short, is one of them). A worker that dies before ever
  answering (it cannot import hookprof from here) makes every later call raise OSError at once: the caller
  does the work itself.
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
    import termios
except ImportError:  # (not POSIX: no worker runs there, see AVAILABLE)
    fcntl = termios = None

AVAILABLE = os.name == "posix"
_LENGTH = struct.Struct("<Q")
_POLL_SECONDS = 0.5  # how often a side waiting for the other checks that it still lives
_EXIT_SECONDS = 5.0  # how long the training process's exit waits for the worker to finish a call
# how much lower the worker's scheduling priority is than the training process's (`nice`): where the machine has
# fewer free cores than the training and the worker need, the training's threads run first (the worker still gets
# a share, and its stalls are judged by its CPU time, not by how long it takes)
WORKER_NICE = 10
_REQUEST_PIPE_BYTES = 1 << 20  # the request pipe's buffer (`Worker.post`)
_PIPE_MARGIN = 64 << 10  # room a request leaves in the pipe to be written there at once (its pages, others' tells)
FULL_COLLECTION_CALLS = 16  # the worker's cyclic collector looks at what outlives calls once per this many calls

log = logging.getLogger(__name__)


class WorkerFailed(RuntimeError):
    """The worker ended without a result (a signal, an exit), or the function raised there."""


class _Ticket:
    """A call sent, or to be sent, to the worker (`Worker.post`, `Worker.tell`): `Worker.take` waits for its reply
    and gives its result."""

    __slots__ = ("request", "process", "delivered", "reply", "error", "discard")

    def __init__(self, request: bytes, discard: bool = False) -> None:
        self.request: bytes | None = request  # (dropped once answered)
        # the worker it was sent to; None while it waits to be sent (`Worker._unsent`)
        self.process: subprocess.Popen | None = None
        self.delivered = False  # whether the request went into that worker's pipe whole
        self.reply: bytes | bytearray | None = None
        self.error: BaseException | None = None
        self.discard = discard  # a `tell`: no one takes it; its reply is dropped when read


class Worker:
    """The training process's side: starts the worker process on demand and sends it calls, which it runs one at
    a time, in the order sent.

    A call can be sent (`post`) before the worker has finished the calls before it, and its result taken
    (`take`) later, from another thread: the worker starts it as soon as it has handed the previous reply to
    its sending thread, without waiting for this process to read that reply or send the next request. Only a
    taker waits for the worker: `post` and `tell` send a request only where it fits in the request pipe at
    once, and leave it to the next `take` (which sends every request before its own, in order) otherwise.
    Replies are read in the order sent, by whoever takes. A worker that dies, hangs or takes too long costs the
    call it ran: the first it took whole, or the next one if it had finished that one (its reply came cut
    short); the calls sent after it go to a new worker, in their order, before any later one."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None
        self._answered = False  # whether the running worker ever answered (one that never does is broken)
        self._broken: str | None = None  # why workers cannot run here: callers render themselves
        self._capacity: int | None = None  # the running worker's request pipe's size, where it can be known
        # the process and the queues below: held to change them and to write a request that fits at once
        self._lock = threading.Lock()
        self._reading = threading.Lock()  # held by a taker: one thread waits for the worker at a time
        # the calls sent to `_process` whose replies are not read yet, in the order sent
        self._outstanding: collections.deque[_Ticket] = collections.deque()
        # the calls not sent yet, in order (no later one is sent before them): ones that did not fit in the pipe
        # at once, ones sent while a taker was writing, and the ones a dead worker had not run
        self._unsent: collections.deque[_Ticket] = collections.deque()
        self._writing = False  # a taker writes a request, waiting for the pipe to take it
        self._killed: tuple[subprocess.Popen, Exception] | None = None  # killed by a taker's write, and why

    def start(self, preload: tuple[str, ...] = ()) -> None:
        """Start the worker now, if not running, importing the `preload` modules while the caller goes on
        (an interpreter and its imports take a second or so)."""
        if self._lock.acquire(blocking=False):  # (busy: it runs already)
            try:
                self._current(start=True, preload=preload)
            finally:
                self._lock.release()

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
             stall: float | None = None) -> Any:
        """`fn(*args)` in the worker. Raises `WorkerFailed` when the worker dies, `fn` raises there, it has
        not answered after `timeout` seconds, or it used no CPU for `stall` seconds (it is killed then: a hung
        one must not hold up the training process's end); OSError when no worker can run here (it cannot
        start, or the first one died, or used no CPU for `stall` seconds, before answering)."""
        return self.take(self.post(fn, *args), timeout=timeout, stall=stall)

    def post(self, fn: Callable[..., Any], *args: Any) -> _Ticket:
        """Send `fn(*args)` to the worker (started if need be), without waiting for anything: its request goes
        into the pipe now where it fits there at once, else with the next `take`. `take` gives its result.
        Raises OSError when no worker can run here, and what pickling the call raises."""
        if self._broken is not None:  # (before pickling a step for nothing)
            raise OSError(errno.ECHILD, self._broken)
        ticket = _Ticket(pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL))
        with self._lock:
            self._send_or_queue(ticket, self._current(start=True))
        return ticket

    def tell(self, fn: Callable[..., Any], *args: Any) -> None:
        """`fn(*args)` in the worker if one runs, for what it holds (a fit's end: what it kept for that fit); none
        is started for it (a new one holds nothing). Not waited for, as `post`: the worker runs it after the
        calls sent before it. A failure is logged, never raised: the worker that failed is gone, and what it
        held with it."""
        ticket = _Ticket(pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL), discard=True)
        try:
            with self._lock:
                process = self._current(start=False)
                if process is not None:
                    self._send_or_queue(ticket, process)
        except OSError as err:
            log.debug("The render worker could not run %s: %s", getattr(fn, "__name__", fn), err)

    def take(self, ticket: _Ticket, timeout: float | None = None, stall: float | None = None) -> Any:
        """The result of the call `post` sent, once the worker has run it; raises as `call` does. `timeout` and
        `stall` judge the worker from now on."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._reading:
            while ticket.reply is None and ticket.error is None:
                if ticket.process is None:  # (not sent yet: sent now, after the ones before it)
                    self._send_queued(ticket, deadline, timeout, stall)
                else:
                    self._read_next(ticket.process, deadline, timeout, stall)
        if ticket.error is not None:
            raise ticket.error
        reply, ticket.reply = ticket.reply, None  # (the result is the caller's to keep, not the reply)
        return _result(reply)

    # --- `_lock` held ---------------------------------------------------------------------------------------

    def _current(self, start: bool, preload: tuple[str, ...] = ()) -> subprocess.Popen | None:
        """The worker to send to: the running one, or where none waits for a reply from it and it has ended, a
        new one (None where `start` is False: one that never answered holds nothing either). Tells sent to one
        that ended are dropped: what they would have cleared went with it."""
        process = self._process
        ended = process is None or process.poll() is not None
        if ended and all(sent.discard for sent in self._outstanding):
            self._outstanding.clear()
        if self._outstanding:
            return process
        if start:
            return self._started(preload)
        return None if ended or not self._answered else process

    def _send_or_queue(self, ticket: _Ticket, process: subprocess.Popen) -> None:
        """Send `ticket`'s request into `process`'s pipe where nothing waits to be sent before it and it fits
        there at once; else queue it for the next `take`."""
        if self._unsent or self._writing or not self._fits(process, len(ticket.request)):
            self._unsent.append(ticket)
            return
        self._outstanding.append(ticket)
        ticket.process = process
        try:  # (it fits: the pipe takes it in one write; the deadline is for a pipe that shrank)
            _send_within(process.stdin.fileno(), ticket.request, process, time.monotonic() + _EXIT_SECONDS)
            ticket.delivered = True
        except (OSError, TimeoutError):  # (it is gone, or cut the request short: its reader finds it ended)
            with contextlib.suppress(OSError):
                process.kill()

    def _fits(self, process: subprocess.Popen, size: int) -> bool:
        """Whether a request of `size` bytes fits in `process`'s request pipe at once, with what waits there
        (Linux: its size and its unread bytes are known; elsewhere never: the taker sends it)."""
        if self._capacity is None or fcntl is None:
            return False
        try:
            unread = struct.unpack("i", fcntl.ioctl(process.stdin.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
        except (OSError, ValueError):
            return False
        return _LENGTH.size + size + unread + _PIPE_MARGIN <= self._capacity

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
            # requests are sent while it renders the one before (`post`), where they fit in its pipe at once:
            # one of 1 MiB (Linux's most for a process without privileges) takes a walked 20k-op step's
            # identities (about 0.6 MB); where its size cannot be known, the taker sends each request
            self._capacity = None
            with contextlib.suppress(AttributeError, OSError):
                fcntl.fcntl(process.stdin.fileno(), fcntl.F_SETPIPE_SZ, _REQUEST_PIPE_BYTES)
            with contextlib.suppress(AttributeError, OSError):
                self._capacity = fcntl.fcntl(process.stdin.fileno(), fcntl.F_GETPIPE_SZ)
            self._process = process
            self._answered = False
        return process

    # --- a taker's (`_reading` held) ------------------------------------------------------------------------

    def _send_queued(self, until: _Ticket, deadline: float | None, timeout: float | None,
                     stall: float | None) -> None:
        """Send the queued requests in order, up to `until`'s, each written as the pipe takes it (the worker
        reads a request once it has finished the ones before). A worker that takes none for `stall` seconds of
        no CPU, or until `deadline`, is killed: the call whose request it did not take fails (it never ran it),
        and the worker's reader blames the call it ran; a call whose deadline passed before it could be sent
        fails, and no worker is killed for it."""
        while until.process is None and until.error is None:
            with self._lock:
                if until not in self._unsent:  # (stopped meanwhile: `stop` failed it)
                    return
                if deadline is not None and time.monotonic() >= deadline:
                    self._unsent.remove(until)
                    until.error = WorkerFailed(f"the render worker took more than {timeout:g} s")
                    return
                try:
                    process = self._current(start=True)
                except OSError:  # (no worker can run here: every call is the caller's to do)
                    self._unsent = collections.deque(sent for sent in self._unsent
                                                     if sent is not until and not sent.discard)
                    raise
                head = self._unsent.popleft()
                self._outstanding.append(head)
                head.process, head.delivered = process, False
                self._writing = True
            try:
                _send_within(process.stdin.fileno(), head.request, _judging(process, stall), deadline)
                head.delivered = True
            except TimeoutError as err:  # (and _Stalled) it takes no request: it hangs, or is that slow
                with contextlib.suppress(OSError):
                    process.kill()
                with self._lock:
                    error = self._judged(err, process, timeout, stall)
                    self._outstanding.remove(head)
                    head.process, head.error = None, error
                    self._killed = (process, error)
            except OSError:  # (it is gone: the request stays, not delivered, and goes to the next worker)
                with contextlib.suppress(OSError):
                    process.kill()
            finally:
                with self._lock:
                    self._writing = False

    def _read_next(self, process: subprocess.Popen, deadline: float | None, timeout: float | None,
                   stall: float | None) -> None:
        """Read `process`'s next reply, into the first call it took whole. A worker that ended, hung or took too
        long is killed: the call it ran fails (`Worker`), the later ones go back to the front of the queue."""
        progress = [0]  # (bytes of this reply read: a reply cut short answers a call the worker had finished)
        error: BaseException | None = None
        reply = None
        try:
            reply = _receive_whole(process.stdout, _judging(process, stall), deadline, progress)
        except TimeoutError as err:  # (and _Stalled)
            with self._lock:
                error = self._judged(err, process, timeout, stall)
        except OSError:  # the worker's end is gone: it died
            pass
        except BaseException as err:  # the conversation is broken: a new worker for the next call
            error = err
        with self._lock:
            sent = [ticket for ticket in self._outstanding if ticket.process is process]  # (none once stopped)
            took = [ticket for ticket in sent if ticket.delivered]
            if reply is not None:
                if self._process is process:
                    self._answered = True
                if took:
                    done = took[0]
                    self._outstanding.remove(done)
                    done.request = None
                    if done.discard:
                        with contextlib.suppress(WorkerFailed):
                            _result(reply)  # (its log records)
                    else:
                        done.reply = reply
                return
            owned = self._process is process  # (else `stop` has it, and ends it)
            if owned:
                self._process = None
            answered = self._answered or not owned
            finished = 1 if progress[0] else 0  # (a reply cut short: it had finished that call, and ran the next)
            ran = took[finished] if len(took) > finished else None
            for ticket in sent:
                self._outstanding.remove(ticket)
            again = [ticket for ticket in sent if ticket is not ran and not ticket.discard]
            for ticket in again:
                ticket.process, ticket.delivered = None, False
            self._unsent.extendleft(reversed(again))
            killed, self._killed = self._killed, None
        if owned:
            _end(process)  # (killed if alive, reaped, its pipes closed: no other thread uses them now)
        if error is None and killed is not None and killed[0] is process:
            error = killed[1]  # (killed by a taker whose request it did not take)
        if error is None:
            reason = _ended(process)
            error = WorkerFailed(reason)
            if not answered:
                with self._lock:
                    self._broken = f"{reason} before answering once"
        if self._broken is not None and owned and not answered:
            error = OSError(errno.ECHILD, self._broken)
        for ticket in sent:
            if ticket is ran or ticket.discard:  # (and tells to a worker gone: what they clear went with it)
                ticket.error = error
        if not isinstance(error, (WorkerFailed, OSError)):
            raise error

    def _judged(self, err: TimeoutError, process: subprocess.Popen, timeout: float | None,
                stall: float | None) -> WorkerFailed | OSError:
        """Why a worker judged hung (`_Stalled`) or slow (a timeout) was killed (`_lock` held): one hung before
        it ever answered is hung in its imports, and so would the next one be: none is started again."""
        if isinstance(err, _Stalled):
            if self._process is process and not self._answered:
                self._broken = f"it used no CPU for {stall:g} s before answering once (hung while starting)"
                return OSError(errno.ECHILD, self._broken)
            return WorkerFailed(f"the render worker used no CPU for {stall:g} s (hung: stopped, or stuck on its "
                                "disk) and was killed; a new one renders the next steps")
        return WorkerFailed(f"the render worker took more than {timeout:g} s and was stopped")

    def stop(self) -> None:
        """End the worker (at the training process's exit, and when the last fit open ends): it is told to quit,
        finishes what it was sent and exits. Calls whose results were not taken yet, sent or not, fail."""
        with self._lock:
            process, self._process = self._process, None
            for ticket in (*self._outstanding, *self._unsent):
                ticket.error = WorkerFailed("the render worker was stopped")
            self._outstanding.clear()
            self._unsent.clear()
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
        self._process, self._killed, self._writing = None, None, False
        self._lock, self._reading = threading.Lock(), threading.Lock()
        self._outstanding, self._unsent = collections.deque(), collections.deque()


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


def _receive(fd: int, parent: int) -> bytes | None:
    """In the worker: one length-prefixed request from `fd` (the pipe from the training process, pid `parent`);
    None when the training process ended before sending it whole (it died, or closed the pipe)."""
    poller = select.poll()  # (not select.select: a descriptor may be 1024 or more)
    poller.register(fd, select.POLLIN)
    buffer = bytearray()
    want = _LENGTH.size
    while len(buffer) < want:
        if not poller.poll(_POLL_SECONDS * 1000):
            if _gone(parent):
                return None
            continue
        chunk = os.read(fd, min(want - len(buffer), 1 << 20))
        if not chunk:
            return None
        buffer += chunk
        if want == _LENGTH.size and len(buffer) >= want:
            want += _LENGTH.unpack_from(buffer)[0]
    return bytes(memoryview(buffer)[_LENGTH.size:want])


def _receive_whole(replies: socket.socket, peer: subprocess.Popen | _Progress, deadline: float | None,
                   progress: list[int]) -> bytearray | None:
    """One length-prefixed reply from the worker, as the worker's `_receive` reads a request (None when the
    worker ended before sending it whole; TimeoutError once `deadline` has passed), but each part read in one
    call that returns when it is all there (`MSG_WAITALL`), which waits without the GIL. A pipe's read returns
    at most what the pipe holds (64 KiB): each read of a reply of megabytes then needed the GIL back, and while
    the training thread held it through torch's profiler stop the worker waited to hand its reply over (15-146
    ms a step at 20k events, longer than the render). `progress[0]` counts the bytes read (a reply cut short
    was one the worker had begun to send)."""
    header = bytearray(_LENGTH.size)
    if not _fill(replies, memoryview(header), peer, deadline, progress):
        return None
    body = bytearray(_LENGTH.unpack(header)[0])
    return body if _fill(replies, memoryview(body), peer, deadline, progress) else None


def _fill(replies: socket.socket, view: memoryview, peer: subprocess.Popen | _Progress, deadline: float | None,
          progress: list[int]) -> bool:
    """Fill `view` from `replies`, counting the bytes read in `progress[0]`; False when the worker ended first.
    The socket's own receive timeout (`SO_RCVTIMEO`, _POLL_SECONDS at most) ends a call now and then, so that
    the worker's life and progress (`_gone`), and `deadline` (TimeoutError), are checked between calls. What an
    ended worker sent before it ended is read (a reply it sent whole is its answer)."""
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
        progress[0] += count or 0
        if got < len(view) and _gone(peer):
            while got < len(view):  # (what it sent before it ended, without waiting: it sends no more)
                try:
                    count = replies.recv_into(view[got:], 0, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    return False
                if count == 0:
                    return False
                got += count
                progress[0] += count
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


def _judging(process: subprocess.Popen, stall: float | None) -> subprocess.Popen | _Progress:
    """What a wait for `process` watches: its life, and with `stall`, its CPU time (`_Progress`)."""
    return process if stall is None else _Progress(process, stall)


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
