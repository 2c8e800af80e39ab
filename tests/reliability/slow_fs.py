"""A real slow filesystem: FUSE passthrough of a directory whose every written file takes `delay` seconds to
close (as a network filesystem's close-to-open flush does). Run as its own process:

    python tests/reliability/slow_fs.py BACKING_DIR MOUNTPOINT DELAY_SECONDS

It mounts in the foreground until killed (SIGTERM unmounts). Needs libfuse 2 and mfusepy (`mount_slow_fs`
in the tests skips with the reason when they are missing).
"""

from __future__ import annotations

import errno
import os
import sys
import time


def main(root: str, mountpoint: str, delay: float) -> None:
    from mfusepy import FUSE, FuseOSError, Operations

    class SlowPassthrough(Operations):
        use_ns = True

        def __init__(self) -> None:
            self.root = os.path.realpath(root)
            self.written: set[int] = set()

        def _full(self, path: str) -> str:
            return os.path.join(self.root, path.lstrip("/"))

        def _call(self, function, *args):
            try:
                return function(*args)
            except OSError as err:
                raise FuseOSError(err.errno or errno.EIO) from None

        def access(self, path, amode):
            if not os.access(self._full(path), amode):
                raise FuseOSError(errno.EACCES)
            return 0

        def getattr(self, path, fh=None):
            st = self._call(os.lstat, self._full(path))
            return {key: getattr(st, key) for key in ("st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime",
                                                       "st_nlink", "st_size", "st_uid")}

        def readdir(self, path, fh):
            return [".", "..", *self._call(os.listdir, self._full(path))]

        def mkdir(self, path, mode):
            return self._call(os.mkdir, self._full(path), mode)

        def rmdir(self, path):
            return self._call(os.rmdir, self._full(path))

        def chmod(self, path, mode):
            return self._call(os.chmod, self._full(path), mode)

        def chown(self, path, uid, gid):
            return self._call(os.chown, self._full(path), uid, gid)

        def unlink(self, path):
            return self._call(os.unlink, self._full(path))

        def rename(self, old, new):
            return self._call(os.replace, self._full(old), self._full(new))

        def utimens(self, path, times=None):
            return self._call(os.utime, self._full(path), None, ns=times) if times else \
                self._call(os.utime, self._full(path), None)

        def statfs(self, path):
            st = os.statvfs(self._full(path))
            return {key: getattr(st, key) for key in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail",
                                                       "f_ffree", "f_files", "f_flag", "f_frsize", "f_namemax")}

        def open(self, path, flags):
            return self._call(os.open, self._full(path), flags)

        def create(self, path, mode, fi=None):
            return self._call(os.open, self._full(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

        def read(self, path, size, offset, fh):
            return self._call(os.pread, fh, size, offset)

        def write(self, path, data, offset, fh):
            self.written.add(fh)
            return self._call(os.pwrite, fh, data, offset)

        def truncate(self, path, length, fh=None):
            return self._call(os.truncate, self._full(path), length)

        def flush(self, path, fh):  # close(2) waits for this (FUSE's release comes later, unwaited)
            if fh in self.written:  # the slow part: a written file's close
                self.written.discard(fh)
                time.sleep(delay)
            return 0

        def fsync(self, path, datasync, fh):
            return self._call(os.fsync, fh)

        def release(self, path, fh):
            return self._call(os.close, fh)

    FUSE(SlowPassthrough(), mountpoint, foreground=True, nothreads=False, allow_other=False)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
