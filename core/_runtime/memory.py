"""`allocated_bytes()`: the bytes the training process holds now, read at each step a MemoryJump judges.

On a GPU run (the model's parameters on a CUDA device; with no model to ask, torch with CUDA started) it is
the caching allocator's bytes allocated on that device (`torch.cuda.memory_allocated()`: tensors only, not the
cache; about a microsecond). A CPU fit in a process that also started CUDA reads the host. Otherwise it is the
host heap in use as glibc's allocator counts it (`mallinfo2`: torch's CPU tensors, numpy arrays and Python
objects alike). That count follows frees at once, where the resident set size does not: a warmed-up process
reuses freed heap, so a leak can grow for hundreds of steps before its resident set does. It walks the
allocator's free lists (20-150 us a call in a training process), so the host is read on every
`HOST_EVERY`-th step only. Where glibc is not the allocator, the resident set size from `/proc/self/statm`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _glibc_mallinfo2():
    try:
        function = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2  # glibc 2.33+
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    function.argtypes = []
    return function


_MALLINFO2 = _glibc_mallinfo2() if sys.platform.startswith("linux") else None
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_statm: tuple[int, int] | None = None  # (pid, descriptor): a forked child opens its own


def _resident() -> int | None:
    global _statm
    pid = os.getpid()
    try:
        if _statm is None or _statm[0] != pid:
            _statm = (pid, os.open("/proc/self/statm", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)))
        return int(os.pread(_statm[1], 128, 0).split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


HOST_EVERY = 10  # the host's memory is read on the steps that are multiples of this


def model_device(model: object) -> str | None:
    """Where a torch model's first parameter lives (`cuda:0`, `cpu`), or None where that cannot be told (no
    model, no parameters, not a torch module)."""
    parameters = getattr(model, "parameters", None)
    try:
        first = next(iter(parameters())) if callable(parameters) else None
    except (StopIteration, TypeError):
        return None
    device = getattr(first, "device", None)
    return None if device is None else str(device)


def allocated_bytes(step: int, device: str | None = None) -> tuple[int, str] | None:
    """(bytes, what was read) at the end of global step `step` on `device` (a torch device name such as
    `cuda:0` or `cpu`; None: CUDA's current device once CUDA has started, else the host), or None where
    nothing is read (on the host, steps that are not multiples of HOST_EVERY)."""
    torch = sys.modules.get("torch")
    on_cuda = device.startswith("cuda") if device is not None else torch is not None and torch.cuda.is_initialized()
    if on_cuda and torch is not None:
        index = torch.device(device).index if device is not None else None
        index = torch.cuda.current_device() if index is None else index
        return int(torch.cuda.memory_allocated(index)), f"cuda:{index} allocated"
    if step % HOST_EVERY:
        return None
    if _MALLINFO2 is not None:
        info = _MALLINFO2()
        return int(info.uordblks + info.hblkhd), "host heap in use"
    resident = _resident()
    return None if resident is None else (resident, "host resident")
