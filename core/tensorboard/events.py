"""TensorBoard event files, one stream per log directory (TF's SummaryWriterCache).

Hooks writing to the same directory share one stream, so one run shows everything, in order. That matters:
TensorBoard reads a directory's event files one after another, and a session-start event (which purges
stale events of a crashed run) in one file would purge the events another writer put in an earlier-read
file. So where a framework already writes the directory (Lightning's TensorBoardLogger), the adapter
registers its writer as the directory's stream (`use_for`) and every hook writes into that same file.
Otherwise hookprof's own `EventWriter` writes the directory's file, created on the first event (no empty
event files). Every event is flushed at once (traced and summary steps are rare, and a crash then loses
nothing), and writers close at interpreter exit.

A failed write raises `OSError` naming the file (or directory) and the reason to the hook, which counts and warns;
nothing here ends training, and writing resumes by itself once the cause is gone:
- hookprof's `EventWriter` holds no file open between events; after a failed write the next event starts a new
  file, and a file removed under it (its directory deleted) is replaced, the directory made again.
- a framework's `SummaryWriter` (Lightning's logger's) writes on a thread of TensorBoard's that dies at its first
  failed write and re-raises that error on every later call, the framework's own included. So an event goes to
  it only when its directory is there, writable and has room for it (`check_room`): a full or read-only disk
  costs that event, not the user's writer. Once the writer has failed anyway (EIO, a race) or its directory is
  gone, hookprof stops using it, says so once, and writes its events into a file of its own in the same
  directory. It never closes or changes the user's writer.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import itertools
import logging
import os
import re
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from hookprof._runtime.warn_once import WarnOnce

log = logging.getLogger(__name__)
ROOM_MARGIN = 64 * 1024  # free bytes kept beyond an event before it goes to a writer hookprof cannot reopen

_lock = threading.Lock()
_writers: dict[str, Any] = {}
_users: dict[str, int] = {}  # hooks holding each directory's stream (acquire / release)
_file_ids = itertools.count()  # two files of one process opened in the same second get distinct names
_EVENT_FILE = re.compile(r"events\.out\.tfevents\.(\d+)\.")


@functools.cache
def masked_crc32c() -> Callable[[bytes], int]:
    """The TFRecord checksum for hookprof's own event files: google-crc32c's C function where installed.

    Without TensorFlow, TensorBoard computes it in pure Python, about 5 MB/s: the graph and run metadata of a
    10k-op traced step (1.4 MB) took 260 ms to checksum, more than converting the step. The C function gives
    the same value (TensorBoard's reader checks every record with its own). Only hookprof's files use it;
    every other writer in the process keeps TensorBoard's own.
    """
    try:
        import google_crc32c
    except ImportError:
        google_crc32c = None
    if google_crc32c is None or google_crc32c.implementation != "c":  # its pure-Python fallback is no faster
        from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as python_crc

        return python_crc
    crc32c = google_crc32c.value

    def masked(data: bytes) -> int:
        x = crc32c(data)
        return (((x >> 15) | (x << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    return masked


def tf_record(data: bytes) -> bytes:
    """One TFRecord: length, its masked CRC-32C, the data, the data's masked CRC-32C (little-endian)."""
    crc = masked_crc32c()
    header = struct.pack("<Q", len(data))
    return b"".join((header, struct.pack("<I", crc(header)), data, struct.pack("<I", crc(data))))


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # (not on Windows, where planting a symlink needs privileges)


class SharedStream:
    """What hookprof's hooks share as a log directory's stream (`acquire`): its `add_event`, and the digest of the
    last step graph a ProfilerHook wrote into it (`graph_digest`), so that the hooks sharing it write a graph
    only when it changes (TensorBoard keeps one a run, and warns for each other). An `EventWriter`, or a
    framework's writer registered with `use_for` (`FrameworkStream`)."""

    graph_digest: bytes | None = None


class EventWriter(SharedStream):
    """Appends `Event` protos to an event file of its own in `logdir`, created at the first event.

    Writes on the calling thread. Each event is appended and the file closed again, as TensorBoard's own
    writer does: between events hookprof holds no file open, so a removed file frees its space at once and an
    administrator can remount the disk read-only. A failed write raises `OSError` naming the file: the next
    event starts a new file (TensorBoard reads it after the old one, whose records up to the failure stay
    readable), and a new file that got no event is removed. A file removed under the writer (with its
    directory) is replaced by a new one at the next event, the directory made again.
    """

    def __init__(self, logdir: str, filename_suffix: str = ".hookprof") -> None:
        self.logdir = logdir
        self.filename_suffix = filename_suffix
        self.path: str | None = None  # the file being written
        self._events_in_file = 0
        self._lock = threading.Lock()  # hooks write from the training thread and ProfilerHook's background one

    def add_event(self, event: Any) -> None:
        record = tf_record(event.SerializeToString())
        with self._lock:
            f = None
            try:
                if self.path is not None:
                    try:
                        # never through a symlink planted in place of our file (ELOOP: a failed write,
                        # the next event starts a new file)
                        f = os.fdopen(os.open(self.path, os.O_WRONLY | os.O_APPEND | _NOFOLLOW), "ab")
                    except FileNotFoundError:  # removed: appending to a new file of the same name would
                        self.path = None  # mix two runs of records for a reader that had read the old one
                if f is None:
                    f = self._create()
                with f:
                    f.write(record)
                self._events_in_file += 1
            except OSError as err:
                where = err.filename or self.path or self.logdir
                self._failed()
                raise OSError(err.errno, err.strerror or str(err), where) from err

    def _create(self) -> Any:
        """A new event file, named as TensorBoard's writers name theirs, starting with the file version.

        TensorBoard reads a directory's files in name order, so the name's time is that of the newest event
        file there plus one second when that one was started this second (or later): a file started after
        another writer's (or after one of ours that failed) is read after it.
        """
        self.graph_digest = None  # (a new file gets the step graph again)
        from tensorboard.compat.proto.event_pb2 import Event

        os.makedirs(self.logdir, exist_ok=True)
        newest = max((int(match[1]) for name in os.listdir(self.logdir) if (match := _EVENT_FILE.match(name))),
                     default=0)
        stamp = max(int(time.time()), newest + 1)
        name = f"events.out.tfevents.{stamp:010d}.{socket.gethostname()}.{os.getpid()}.{next(_file_ids)}" \
               f"{self.filename_suffix}"
        path = os.path.join(self.logdir, name)
        f = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o666), "wb")
        self.path, self._events_in_file = path, 0
        try:
            f.write(tf_record(Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString()))
        except BaseException:
            with contextlib.suppress(OSError):
                f.close()
            raise
        return f

    def _failed(self) -> None:
        """After a failed write, the next event starts a new file; this one is removed if it holds no event."""
        if self.path is not None and self._events_in_file == 0:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        self.path = None

    def flush(self) -> None:
        """Nothing to do: each event is on disk (in the OS's cache) when `add_event` returns."""

    def close(self) -> None:
        """The next event, if any, starts a new file."""
        with self._lock:
            self.path = None


def check_room(directory: str, nbytes: int) -> None:
    """Raise `OSError` (ENOENT, EROFS or ENOSPC, naming `directory`) unless `directory` exists on a writable
    filesystem with `nbytes` plus `ROOM_MARGIN` free: checked before an event goes to a writer whose first
    failed write would end it for good."""
    try:
        stats = os.statvfs(directory)
    except OSError as err:
        raise OSError(err.errno, err.strerror, directory) from err
    if stats.f_flag & os.ST_RDONLY:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), directory)
    if stats.f_bavail * stats.f_frsize < nbytes + ROOM_MARGIN:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), directory)


class FrameworkStream(SharedStream):
    """A framework's own writer (`sink`: anything with `add_event` and `flush`) as a log directory's stream: it gets
    events as protos (the render worker's come serialized), and is closed with the stream when it has `close`."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink

    def add_event(self, event: Any) -> None:
        self.sink.add_event(event.proto() if isinstance(event, SerializedEvent) else event)

    def flush(self) -> None:
        self.sink.flush()

    def close(self) -> None:
        _close(self.sink)


def use_for(logdir: str, sink: Any) -> None:
    """Make `sink` (e.g. a framework's own writer) the stream of `logdir` for every hook (a new run's: it gets the
    step graph again)."""
    with _lock:
        _writers[os.path.abspath(logdir)] = FrameworkStream(sink)


def event_writer(logdir: str) -> Any:
    """The shared stream for `logdir`: a registered framework writer, else this project's EventWriter."""
    key = os.path.abspath(logdir)
    with _lock:
        writer = _writers.get(key)
        if writer is None:
            writer = _writers[key] = EventWriter(key)
        return writer


class _TorchWriterSink:
    """A `torch.utils.tensorboard.SummaryWriter` (or tensorboardX's) as an event sink, into its own file.

    The writer is the user's (or their framework's): hookprof neither closes nor changes it. Its file is written
    by a thread of TensorBoard's that dies at its first failed write and re-raises that error on every later
    call, so an event goes to it only after `check_room`. When the writer fails anyway, or its directory is
    gone, hookprof's events go to an `EventWriter` of its own in the writer's directory from then on.
    """

    def __init__(self, writer: Any) -> None:
        self._writer = writer
        self._own: EventWriter | None = None  # hookprof's own file, once the writer cannot be used
        self._lock = threading.Lock()  # the training thread and ProfilerHook's background one both write
        self._warn_once = WarnOnce(log)

    def _logdir(self) -> str:
        get = getattr(self._writer, "get_logdir", None)
        return os.fspath(get() if callable(get) else self._writer.logdir)

    def add_event(self, event: Any) -> None:
        with self._lock:
            if self._own is None:
                logdir = self._logdir()
                try:
                    check_room(logdir, event.ByteSize() + 16)
                except FileNotFoundError:
                    self._leave(logdir, "its directory is gone")
                else:  # (a full or read-only disk raises: this event is lost, the user's writer is not)
                    try:
                        self._writer._get_file_writer().add_event(event)
                        self._writer.flush()
                        return
                    except Exception as err:  # its thread died (EIO, a race), or it was closed
                        self._leave(logdir, err)
            self._own.add_event(event)

    def _leave(self, logdir: str, reason: Any) -> None:
        """Stop using the user's writer: hookprof's events go to a file of its own in `logdir` from now on."""
        self._own = EventWriter(logdir)
        self._warn_once("left", "The TensorBoard writer of %s cannot be written (%s): hookprof writes its events "
                        "into an event file of its own there from now on; the writer itself is left as it is.",
                        logdir, reason.strerror if isinstance(reason, OSError) and reason.strerror else reason)

    def flush(self) -> None:
        """Flush hookprof's own file if it has one, else the user's writer (whose failure is left to its
        owner: hookprof's events were flushed as they were written)."""
        with self._lock:
            own = self._own
            if own is None:
                with contextlib.suppress(Exception):
                    self._writer.flush()
                return
        own.flush()

    def close(self) -> None:
        """Flush; close hookprof's own file. The user owns the writer and closes it."""
        with contextlib.suppress(OSError):
            self.flush()
        if self._own is not None:
            self._own.close()


def as_event_sink(writer: Any, argument: str = "summary_writer") -> Any:
    """Something with `add_event(event)` and `flush()` from what a user already has: a log directory path,
    an event sink (this project's `EventWriter`, or an adapter's wrapper of a framework's writer), or a
    `torch.utils.tensorboard.SummaryWriter` (tensorboardX's too)."""
    if isinstance(writer, (str, os.PathLike)):
        return event_writer(os.fspath(writer))
    if callable(getattr(writer, "add_event", None)) and callable(getattr(writer, "flush", None)):
        return writer
    if callable(getattr(writer, "_get_file_writer", None)):
        return _TorchWriterSink(writer)
    raise TypeError(
        f"`{argument}` must be a TensorBoard writer: a log directory, a torch.utils.tensorboard.SummaryWriter, "
        f"or hookprof.tensorboard.events.EventWriter (lightning_prof and keras_prof also take Lightning's "
        f"TensorBoardLogger and a keras.callbacks.TensorBoard); got {type(writer).__name__}."
    )


def new_event(step: int, **fields: Any) -> Any:
    """A TensorBoard `Event` at `step`, stamped now (every sink, the user's own too, gets a wall time)."""
    from tensorboard.compat.proto.event_pb2 import Event

    return Event(step=int(step), wall_time=time.time(), **fields)


class SerializedEvent:
    """An `Event` serialized already (by the render worker, `hookprof._runtime.worker`): `EventWriter` writes
    its bytes as they are; `proto()` parses it for a sink that wants the message."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:  # noqa: N802 (the protobuf method's name)
        return self.data

    def ByteSize(self) -> int:  # noqa: N802
        return len(self.data)

    def proto(self) -> Any:
        from tensorboard.compat.proto.event_pb2 import Event

        return Event.FromString(self.data)


def add_summary(sink: Any, summary: Any, step: int) -> None:
    sink.add_event(new_event(step, summary=summary))


def add_session_start(sink: Any, step: int) -> None:
    """TF's `SessionLog(status=START)`: TensorBoard drops events of a previous run past `step` (a restart)."""
    from tensorboard.compat.proto.event_pb2 import SessionLog

    sink.add_event(new_event(step, session_log=SessionLog(status=SessionLog.START)))


def acquire(logdir: str) -> Any:
    """The stream of `logdir` for a hook's run; `release` it at the run's end."""
    key = os.path.abspath(logdir)
    writer = event_writer(key)
    with _lock:
        _users[key] = _users.get(key, 0) + 1
    return writer


def release(logdir: str) -> None:
    """A hook is done with `logdir`: flush, and close the writer (and its thread) when no hook uses it."""
    key = os.path.abspath(logdir)
    with _lock:
        left = _users.get(key, 0) - 1
        writer = _writers.get(key)
        if left > 0:
            _users[key] = left
            writer = None
        else:
            _users.pop(key, None)
            _writers.pop(key, None)
    if writer is not None:
        _close(writer)


def _close(writer: Any) -> None:
    """Close a stream at the end of its use; a failure there is the end of what it could write, not an error to
    raise out of a hook's `close()` (each failed event was raised and counted when it was written)."""
    close = getattr(writer, "close", None)
    if callable(close):
        try:
            close()
        except OSError as err:
            log.debug("Closing the event stream %r failed: %s", writer, err)


@atexit.register
def close_all() -> None:
    """Close every shared writer (also run at interpreter exit)."""
    with _lock:
        writers = list(_writers.values())
        _writers.clear()
        _users.clear()
    for writer in writers:
        _close(writer)
