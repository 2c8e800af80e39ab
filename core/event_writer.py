"""TensorBoard event files through TensorBoard's own writer, one per log directory (TF's SummaryWriterCache).

Hooks writing to the same directory share one `EventWriter`, so one run shows everything. The file is
created on the first event (no empty event files), every event is flushed at once (traced and summary
steps are rare, and a crash then loses nothing), and writers close at interpreter exit.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from typing import Any

_lock = threading.Lock()
_writers: dict[str, EventWriter] = {}


class EventWriter:
    """Appends `Event` protos to an event file in `logdir`, created on first use."""

    def __init__(self, logdir: str) -> None:
        self.logdir = logdir
        self._writer: Any = None

    def add_event(self, event: Any) -> None:
        if self._writer is None:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            os.makedirs(self.logdir, exist_ok=True)
            self._writer = EventFileWriter(self.logdir, filename_suffix=".hookprof")
        if not event.wall_time:
            event.wall_time = time.time()
        self._writer.add_event(event)
        self._writer.flush()

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()


def event_writer(logdir: str) -> EventWriter:
    """The shared writer for `logdir`."""
    key = os.path.abspath(logdir)
    with _lock:
        writer = _writers.get(key)
        if writer is None:
            writer = _writers[key] = EventWriter(key)
        return writer


def flush_if_open(logdir: str) -> None:
    """Flush the shared writer of `logdir` if one exists (never creates a file)."""
    with _lock:
        writer = _writers.get(os.path.abspath(logdir))
    if writer is not None:
        writer.flush()


@atexit.register
def close_all() -> None:
    """Close every shared writer (also run at interpreter exit)."""
    with _lock:
        writers = list(_writers.values())
        _writers.clear()
    for writer in writers:
        writer.close()
