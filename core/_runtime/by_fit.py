"""`ByFit`: what the process that converts and renders traced steps keeps from one of a fit's steps for its next
ones, by the fit's token, until the fit ends.

That process is the render worker, or the training process where no worker runs; the fit's `FitRun` lives in
the training process. So what a fit keeps there is released by a stop registered with its `FitRun`
(`release`): forgotten here, and in the render worker if one runs. Of fits that no `FitRun` owns (a tracer or
pipeline driven by hand), each store keeps the newest few.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from hookprof._runtime import worker

T = TypeVar("T")


class ByFit(Generic[T]):
    """One kind of thing each fit keeps (a value per fit token), the newest `KEEP` of fits that never end
    (thread-safe). Each store has a `name`, by which the render worker finds its own copy (`release`)."""

    KEEP = 4
    ENDED_KEPT = 64  # how many ended fits' tokens each store remembers (a late render of one keeps nothing)

    def __init__(self, name: str) -> None:
        self.name = name
        self._by_fit: collections.OrderedDict[str, T] = collections.OrderedDict()
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._lock = threading.Lock()
        _STORES[name] = self

    def remember(self, token: str, value: T) -> None:
        with self._lock:
            self._by_fit.pop(token, None)
            self._put(token, value)

    def recall(self, token: str) -> T | None:
        with self._lock:
            return self._by_fit.get(token)

    def setdefault(self, token: str, make: Callable[[], T]) -> T:
        """Fit `token`'s value, made (`make()`) if it has none yet; for a fit that has ended (a step of a failed
        fit rendered after its end), a new value kept nowhere."""
        with self._lock:
            value = self._by_fit.get(token)
            if value is None:
                value = make()
                self._put(token, value)
            return value

    def forget(self, token: str) -> None:
        """Fit `token` ended: its value goes, and none is kept for it again."""
        with self._lock:
            self._by_fit.pop(token, None)
            self._ended[token] = None
            while len(self._ended) > self.ENDED_KEPT:
                self._ended.popitem(last=False)

    def tokens(self) -> list[str]:
        """The fits held, oldest first."""
        with self._lock:
            return list(self._by_fit)

    def release(self, token: str) -> None:
        """Fit `token` ended (a stop its `FitRun` runs, after its hooks flushed what they traced): its value goes,
        here and in the render worker, if one runs."""
        self.forget(token)
        worker.WORKER.tell(forget_here, self.name, token)

    def _put(self, token: str, value: T) -> None:
        """Keep `value` for fit `token` (not for one that has ended), the newest `KEEP` at most (lock held)."""
        if token not in self._ended:
            self._by_fit[token] = value
            self._evict()

    def _evict(self) -> None:
        while len(self._by_fit) > self.KEEP:
            self._by_fit.popitem(last=False)


# The stores by name (not what they hold: that is the fits'), so that the render worker finds its own copy.
_STORES: dict[str, ByFit] = {}


def forget_here(name: str, token: str) -> None:
    """Forget what fit `token` kept in store `name` of this process (run in the render worker by `release`)."""
    store = _STORES.get(name)
    if store is not None:
        store.forget(token)


def held_here(name: str) -> list[str]:
    """The tokens of the fits whose values store `name` holds in this process (run in the render worker by
    `WORKER.call`), oldest first."""
    store = _STORES.get(name)
    return [] if store is None else store.tokens()
