"""Private working directories in a shared temporary directory, claimed by a lock while their process lives.

A process's directory (`<prefix><pid>-<random>`, mode 0700) holds an `.owner` file on which the process keeps
an exclusive `flock` for as long as the directory is its own. Another process sweeping the temporary
directory removes only directories whose lock it can take: their owner has died (the kernel drops a dead
process's locks). A pid alone would not do: two containers sharing `/tmp` have separate pid namespaces, so
a live neighbour's pid can look dead (or be reused) from here, and its live directory would be removed.

A directory removed under its owner (a tmp cleaner, `rm -rf /tmp/*`) is made again at the next use.
`claimed_directory` is one for the length of a `with` (a save's scratch space beside its target).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator

from hookprof._runtime.atomic_file import process_alive, remove_entries

OWNER_FILE = ".owner"
UNCLAIMED_GRACE_SECONDS = 60.0  # a directory without its lock file yet is left alone this long (being made)


class PrivateDirectory:
    """This process's claimed directory under `parent` (default: the temporary directory, read at each use:
    one directory per temporary directory this process has used), made on first use and again whenever it has
    gone."""

    def __init__(self, prefix: str, parent: str | None = None) -> None:
        self.prefix = prefix
        self._parent = parent
        self._claimed: dict[str, tuple[str, int]] = {}  # parent -> (directory, its lock's descriptor)
        self._pid = os.getpid()
        self._pattern = re.compile(rf"^\.?{re.escape(prefix)}(\d+)-")  # (its staging name too: `path`)

    def path(self) -> str:
        """The directory, made (and the stale ones of dead processes removed) if it is not there."""
        if self._pid != os.getpid():  # a forked child: the parent's directories and locks are not its own
            self._claimed, self._pid = {}, os.getpid()
        parent = self._parent or tempfile.gettempdir()
        claimed = self._claimed.get(parent)
        if claimed is not None:
            if os.path.isfile(os.path.join(claimed[0], OWNER_FILE)):
                return claimed[0]
            self._drop(parent)  # removed under us (a tmp cleaner): made again below
        remove_unclaimed(parent, self._pattern)
        # made under a staging name, claimed, then renamed: no one ever sees it by its name without its lock file
        staging = tempfile.mkdtemp(prefix=f".{self.prefix}{os.getpid()}-", dir=parent)
        fd = os.open(os.path.join(staging, OWNER_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (new and ours: never contended)
        path = os.path.join(parent, os.path.basename(staging)[1:])
        try:
            os.rename(staging, path)
        except OSError:
            os.close(fd)
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self._claimed[parent] = (path, fd)
        return path

    def release(self) -> None:
        """Remove the directories (if this process made them) and drop their claims."""
        for parent in list(self._claimed):
            self._drop(parent)

    def _drop(self, parent: str) -> None:
        path, fd = self._claimed.pop(parent)
        if self._pid == os.getpid():
            shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.close(fd)


# This process's own directory in TMPDIR (mode 0700: op names, code paths and results are not for other users):
# kineto's exports of traced steps (`hookprof.tracing.torch_tracer`) and what a rank's copy of a callback sends
# home (`hookprof._runtime.sent_home`); made again if something removes it, removed when the process exits.
PROCESS_DIRECTORY = PrivateDirectory("hookprof-")
atexit.register(PROCESS_DIRECTORY.release)


@contextlib.contextmanager
def claimed_directory(prefix: str, parent: str) -> Iterator[str]:
    """A private directory in `parent` (`<prefix><pid>-<random>`, claimed by its lock as `PrivateDirectory`'s
    are, the stale ones of dead processes swept first) for the length of the `with`; removed after."""
    owned = PrivateDirectory(prefix, parent)
    try:
        yield owned.path()
    finally:
        owned.release()


def remove_unclaimed(parent: str, pattern: re.Pattern[str]) -> list[str]:
    """Remove the directories in `parent` whose name matches `pattern` and whose owner no longer holds their
    lock; return their names. One without a lock file (an older hookprof's, or one being made) is removed
    only once it is older than UNCLAIMED_GRACE_SECONDS and its pid is not alive here."""
    return remove_entries(parent, pattern,
                          lambda path, pid: not os.path.islink(path) and os.path.isdir(path) and _unclaimed(path, pid))


def _unclaimed(path: str, pid: int) -> bool:
    try:
        fd = os.open(os.path.join(path, OWNER_FILE), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        try:
            old = time.time() - os.stat(path).st_mtime > UNCLAIMED_GRACE_SECONDS
        except OSError:
            return False
        return old and pid != os.getpid() and not process_alive(pid)
    except OSError:
        return False  # not ours to judge (another user's, a symlink)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # (EWOULDBLOCK: its owner lives, in whatever pid namespace)
        return False
    finally:
        os.close(fd)  # (closing drops the lock we may have taken)
    return True


