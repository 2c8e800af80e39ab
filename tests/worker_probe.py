"""Functions the render worker runs for the tests (this module imports nothing heavy: unpickling a function
imports its module there)."""

from __future__ import annotations

import logging
import os
import sys


def torch_modules() -> list[str]:
    """The torch modules the process has imported."""
    return sorted(name for name in sys.modules if name == "torch" or name.startswith("torch."))


def pid() -> int:
    return os.getpid()


def warn(message: str) -> None:
    logging.getLogger("hookprof.probe").warning(message)


def burn(cpu_seconds: float) -> int:
    """Use `cpu_seconds` of this process's CPU (however long that takes in wall time), then return its pid."""
    import time

    end = time.process_time() + cpu_seconds
    while time.process_time() < end:
        pass
    return os.getpid()


def shaped_parts_held(token: str) -> int:
    """How many renderers hold parts of fit `token`'s last step (`hookprof.step_stats.KeptParts`) in this
    process."""
    from hookprof.hooks.capture import KEPT_PARTS

    kept = KEPT_PARTS.recall(token)
    if kept is None:
        return 0
    return sum(parts._last is not None for parts in (kept.timeline, kept.flows, kept.graph, kept.xspace))


NOTES: list[str] = []  # what `note` was told, in the process that runs it


def note(text: str) -> None:
    NOTES.append(text)


def notes() -> list[str]:
    return list(NOTES)


def timed_bytes(seconds: float, size: int) -> tuple[float, float, bytes]:
    """Sleep `seconds`, then return when it began and ended (`time.monotonic()`, the same clock in every process
    of the machine) with `size` bytes."""
    import time

    start = time.monotonic()
    time.sleep(seconds)
    return start, time.monotonic(), b"x" * size


def slowly(seconds: float, fn, *args):
    """`fn(*args)` after `seconds` of sleep: a call that is surely running when the worker is killed."""
    import time

    time.sleep(seconds)
    return fn(*args)
