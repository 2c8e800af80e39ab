"""Write a file so that readers see either nothing or the whole file: temp file, then rename.

Temp files are hidden siblings named `.<name>.<pid>.<random>.tmp`; a process killed mid-write leaves one,
and `remove_stale_temps` (called when a hook starts writing into a directory) deletes those whose process is
gone. The file operations go through `FILE_LAYER`, which tests replace (`use_file_layer`) to inject disk
faults (ENOSPC, EIO, permission loss) without mocking the writers.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from typing import BinaryIO

TEMP_SUFFIX = ".tmp"
_TEMP_NAME = re.compile(r"^\..+\.(\d+)\.[0-9a-f]{8}" + re.escape(TEMP_SUFFIX) + "$")


class FileLayer:
    """The file operations the writers use: open a new temp file for writing, rename it into place."""

    def open_temp(self, path: str) -> BinaryIO:
        # O_EXCL refuses any existing name, O_NOFOLLOW says so even where O_EXCL is not honoured (NFSv2)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
        return os.fdopen(fd, "wb")

    def replace(self, source: str, target: str) -> None:
        os.replace(source, target)


FILE_LAYER = FileLayer()


@contextlib.contextmanager
def use_file_layer(layer: FileLayer) -> Iterator[None]:
    """Route the writers' file operations through `layer` for a while (fault injection in tests)."""
    global FILE_LAYER
    previous, FILE_LAYER = FILE_LAYER, layer
    try:
        yield
    finally:
        FILE_LAYER = previous


def temp_path_for(path: str) -> str:
    """A hidden sibling of `path` that a crash may leave behind; `remove_stale_temps` finds it by shape."""
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")


@contextlib.contextmanager
def atomic_write(path: str) -> Iterator[BinaryIO]:
    """Open a binary temp file beside `path`; on a clean exit rename it onto `path`, else delete it.

    The temp file is created with mode 0666 less the umask, like a plain `open(path, "wb")`, so the renamed
    file has the permissions a user expects (not the 0600 of `tempfile.mkstemp`). A directory removed since
    the writer started is made again.
    """
    tmp = temp_path_for(path)
    layer = FILE_LAYER
    try:
        f = layer.open_temp(tmp)
    except FileNotFoundError:
        # the directory was removed while training ran: made again, as the event writer does
        head = os.path.dirname(tmp)
        if not head:
            raise
        os.makedirs(head, exist_ok=True)
        f = layer.open_temp(tmp)
    try:
        with f:
            yield f
        layer.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def remove_stale_temps(directory: str) -> list[str]:
    """Delete temp files in `directory` left by processes that no longer run; return their names."""
    return remove_left_by_dead_processes(directory, _TEMP_NAME)


def remove_left_by_dead_processes(directory: str, name: re.Pattern[str]) -> list[str]:
    """Delete what processes that no longer run left in `directory`: the entries (files, or directories and
    all they hold) whose name matches `name`, the process id as its first group; return their names."""
    return remove_entries(directory, name, lambda path, pid: pid != os.getpid() and not process_alive(pid))


def remove_entries(directory: str, name: re.Pattern[str], stale: Callable[[str, int], bool]) -> list[str]:
    """Delete the entries of `directory` (files, or directories and all they hold; never what a symlink points
    to) whose name matches `name` (a process id as its first group) and for which `stale(path, pid)` holds;
    return their names."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for entry in names:
        match = name.match(entry)
        path = os.path.join(directory, entry)
        if match and stale(path, int(match.group(1))):
            with contextlib.suppress(OSError):
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
                removed.append(entry)
    return removed


__all__ = ["FILE_LAYER", "FileLayer", "atomic_write", "process_alive", "remove_entries",
           "remove_left_by_dead_processes", "remove_stale_temps", "temp_path_for", "use_file_layer"]
