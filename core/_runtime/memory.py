"""`allocated_bytes()`: the bytes the training process holds now, read cheaply enough for every step.

On a GPU run (torch with CUDA started) it is the caching allocator's bytes allocated on the current device
(`torch.cuda.memory_allocated()`: tensors only, not the cache). Otherwise it is the process's resident set
size, read from `/proc/self/statm` through a descriptor kept open (under a microsecond a read). glibc's own
count of the heap in use (`mallinfo2`) would follow frees more closely, but it walks every arena: some 100 us
a call in a training process with torch's threads, too much for every step.
"""

from __future__ import annotations

import os
import sys

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_statm: tuple[int, int] | None = None  # (pid, descriptor): a forked child opens its own


def _statm_descriptor() -> int | None:
    global _statm
    pid = os.getpid()
    if _statm is None or _statm[0] != pid:
        try:
            _statm = (pid, os.open("/proc/self/statm", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)))
        except OSError:
            return None
    return _statm[1]


def allocated_bytes() -> tuple[int, str] | None:
    """(bytes, what was read) now, or None where nothing can be read."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
        return int(torch.cuda.memory_allocated(device)), f"cuda:{device} allocated"
    descriptor = _statm_descriptor()
    if descriptor is None:
        return None
    try:
        return int(os.pread(descriptor, 128, 0).split()[1]) * _PAGE, "host resident"
    except (OSError, IndexError, ValueError):
        return None
