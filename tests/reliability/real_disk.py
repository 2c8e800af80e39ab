"""Real disks that fail on cue, for tests that need the kernel's own errors (they mount, so they need root):
a small tmpfs to fill, remount read-only or empty, and an ext4 image on a loop device to shut down (every
write then fails with EIO, as a dying disk's do). Each skips its test with the reason when it cannot mount.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import struct
import subprocess

import pytest

FS_IOC_SHUTDOWN = 0x8004587D  # _IOR('X', 125, __u32): ext4 and xfs stop; every later write fails with EIO
_SHUTDOWN_FULLSYNC = 0  # what was written before the shutdown is synced to the disk first


def _run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True)


def _mount_or_skip(*command: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a test filesystem needs root")
    result = _run(*command)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a test filesystem here ({' '.join(command)}): {result.stderr.strip()}")


class Tmpfs:
    """A tmpfs of `size` mounted at `path` until `unmount`."""

    def __init__(self, path: str, size: str = "8m") -> None:
        self.path = path
        os.makedirs(path, exist_ok=True)
        _mount_or_skip("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path)
        self._filler = os.path.join(path, ".filler")

    def fill(self) -> None:
        """Take every free page (a file of zeros until ENOSPC)."""
        fd = os.open(self._filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        block = b"\0" * 65536
        try:
            while True:
                os.write(fd, block)
        except OSError as err:
            assert err.errno == errno.ENOSPC
        finally:
            os.close(fd)
        assert shutil.disk_usage(self.path).free < 4096

    def free(self) -> None:
        os.unlink(self._filler)

    def remount(self, mode: str) -> None:
        """`ro` or `rw` (ro is refused while a file on it is open for writing)."""
        result = _run("mount", "-o", f"remount,{mode}", self.path)
        assert result.returncode == 0, result.stderr

    def unmount(self) -> None:
        _run("umount", "-l", self.path)


class Ext4Image:
    """An ext4 image on a loop device mounted at `path`; `shut_down` makes every write fail with EIO, and
    `recover` mounts the image afresh at the same place (what a replaced disk or a remount after fsck gives)."""

    def __init__(self, path: str, image: str, size_mb: int = 32) -> None:
        self.path, self.image = path, image
        os.makedirs(path, exist_ok=True)
        if shutil.which("mkfs.ext4") is None:
            pytest.skip("mkfs.ext4 is not installed (apt-get install e2fsprogs)")
        with open(image, "wb") as f:
            f.truncate(size_mb << 20)
        made = _run("mkfs.ext4", "-q", "-F", image)
        if made.returncode != 0:
            pytest.skip(f"mkfs.ext4 failed: {made.stderr.strip()}")
        _mount_or_skip("mount", "-o", "loop", image, path)

    def shut_down(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.ioctl(fd, FS_IOC_SHUTDOWN, struct.pack("I", _SHUTDOWN_FULLSYNC))
        finally:
            os.close(fd)

    def recover(self) -> None:
        self.unmount()
        result = _run("mount", "-o", "loop", self.image, self.path)
        assert result.returncode == 0, result.stderr

    def unmount(self) -> None:
        if _run("umount", self.path).returncode != 0:
            _run("umount", "-l", self.path)


@contextlib.contextmanager
def mounted(disk):
    try:
        yield disk
    finally:
        disk.unmount()
