"""Pause Python's cyclic garbage collector around bulk work on a step's objects."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic collector while hundreds of thousands of short-lived, acyclic objects are built:
    its full passes over every live object otherwise cost as much as the work (measured: 1.5-2x on
    converting and writing a traced step). Restores the collector's previous state."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
