"""Write a file so that readers see either nothing or the whole file: temp file, then rename."""

from __future__ import annotations

import contextlib
import os
import secrets
from typing import BinaryIO, Iterator

TEMP_SUFFIX = ".tmp"


def temp_path_for(path: str) -> str:
    """A hidden sibling of `path` that a crash may leave behind; `remove_stale_temps` finds it by shape."""
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")


@contextlib.contextmanager
def atomic_write(path: str) -> Iterator[BinaryIO]:
    """Open a binary temp file beside `path`; on a clean exit rename it onto `path`, else delete it.

    The temp file is created with mode 0666 less the umask, like a plain `open(path, "wb")`, so the renamed
    file has the permissions a user expects (not the 0600 of `tempfile.mkstemp`).
    """
    tmp = temp_path_for(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
