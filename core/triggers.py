"""`hookprof.triggers`: trace the steps after one that went wrong, not only every Nth step.

    from hookprof.triggers import LossSpike, MemoryJump, NonFinite, SlowStep
    ProfilerHook(save_steps=1000, triggers=[SlowStep(), NonFinite("loss")], capture_steps=1, cooldown_steps=100)

A `ProfilerHook` with triggers judges every step: when a trigger fires at step N, steps N+1 .. N+capture_steps
are traced, their files say why (`metadata.trigger`: kind, step, detail) and also hold the phases of step N and
the steps before it (a transient stall shows even when the traced step is normal). After a fire no trigger
fires again for `cooldown_steps` steps.

What a trigger reads of each step (a `StepObservation`):
- the step's wall time, data wait included, except on steps a tracer ran in, the first step of an epoch (a
  data loader starting up) and steps beside hookprof's own background work (writing a timeline): those
  are not judged for time or memory, so tracing never sets a trigger off;
- the value of its `fetch` (a step output or logged metric by name, or a callable of the finished step), when
  it has one; a torch tensor's value is read on the host, one small copy a step;
- the bytes allocated at the step's end, when it reads memory (`hookprof._runtime.memory.allocated_bytes`:
  the CUDA allocator's on a GPU run; the host heap in use otherwise, on every 10th step).

Write your own by subclassing `Trigger` and implementing `observe`.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
from typing import Any

from hookprof._runtime import arguments
from hookprof._runtime.arguments import check_fetches
from hookprof._runtime.values import is_non_finite
from hookprof.units import format_memory

__all__ = ["LossSpike", "MemoryJump", "NonFinite", "SlowStep", "StepObservation", "Trigger"]


@dataclasses.dataclass(slots=True)
class StepObservation:
    """A finished step as triggers see it. `seconds` and `memory_bytes` are None on steps not judged for
    them (traced, an epoch's first, beside hookprof's background work); `value` is the trigger's fetch."""

    step: int
    seconds: float | None = None
    value: Any = None
    memory_bytes: int | None = None
    memory_source: str = ""


class Trigger:
    """Base class: `observe` each finished step and return a one-line detail when the trigger fires, else None.

    Attributes a subclass sets: `kind` (its name in the trace metadata), `fetch` (what it reads of a step, or
    None), `reads_memory`, and `window` (how many steps before the firing one the trace shows).
    """

    kind = "trigger"
    fetch: Any = None
    reads_memory = False
    window = 0

    def reset(self) -> None:
        """Forget what was seen (a new fit starts)."""

    def settings(self) -> dict[str, Any]:
        """Its arguments (what tells two triggers apart in a checkpoint key): the public attributes."""
        return {name: value for name, value in vars(self).items() if not name.startswith("_")}

    def observe(self, observation: StepObservation) -> str | None:
        raise NotImplementedError


class _RollingMedian:
    """The median of the last `size` values: a ring of values and a sorted copy (bisect keeps it sorted)."""

    __slots__ = ("_ring", "_sorted")

    def __init__(self, size: int) -> None:
        self._ring: collections.deque[float] = collections.deque(maxlen=size)
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._ring)

    def add(self, value: float) -> None:
        ring = self._ring
        if len(ring) == ring.maxlen:
            del self._sorted[bisect.bisect_left(self._sorted, ring[0])]
        ring.append(value)
        bisect.insort(self._sorted, value)

    def median(self) -> float:
        values = self._sorted
        middle = len(values) // 2
        return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2

    def quantile(self, q: float) -> float:
        """The `q` quantile (0..1) of the window, the nearest value below it."""
        values = self._sorted
        return values[int(q * (len(values) - 1))]

    def clear(self) -> None:
        self._ring.clear()
        self._sorted.clear()


class _RollingTrigger(Trigger):
    """A trigger that compares each step's figure with the median of the last `window` steps' figures."""

    def __init__(self, owner: str, window: int, min_steps: int) -> None:
        self.window = arguments.check_positive_int(owner, "window", window)
        self.min_steps = arguments.check_positive_int(owner, "min_steps", min_steps)
        if self.min_steps > self.window:
            raise ValueError(f"`{owner}(window={window}, min_steps={min_steps})`: `min_steps` is how many of the "
                             "last `window` steps the median needs; make it at most `window`.")
        self._history = _RollingMedian(self.window)

    def reset(self) -> None:
        self._history.clear()

    def _judge(self, figure: float | None, fires) -> str | None:
        """Add `figure` to the window; `fires(figure, median)` gives the detail when it fires, else None."""
        if figure is None:
            return None
        history = self._history
        detail = fires(figure, history.median()) if len(history) >= self.min_steps else None
        history.add(figure)
        return detail


def _check_factor(owner: str, factor: Any) -> float:
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 1:
        raise ValueError(f"`{owner}(factor={factor!r})`: `factor` must be a number > 1 (3.0: three times the "
                         "median).")
    return float(factor)


class SlowStep(_RollingTrigger):
    """Fires on a step slower than `factor` times the median of the last `window` judged steps (once
    `min_steps` were judged) and at least `min_excess_seconds` above it. A step's time is from the previous
    step's end (data wait included) to its own.

    The absolute floor keeps the host's own noise quiet: on a step of a millisecond, a scheduler preemption
    or a garbage-collection pass of the training process makes a step several times the median many times an
    hour, and tracing the next step shows nothing of it. Lower `min_excess_seconds` to catch smaller stalls
    of short steps.

    Example: `SlowStep(factor=3.0, window=100, min_steps=20)`: a 150 ms step in a run of 20 ms steps.
    """

    kind = "slow_step"

    def __init__(self, factor: float = 3.0, window: int = 100, min_steps: int = 20,
                 min_excess_seconds: float = 0.05) -> None:
        super().__init__("SlowStep", window, min_steps)
        self.factor = _check_factor("SlowStep", factor)
        self.min_excess_seconds = arguments.check_seconds("SlowStep", "min_excess_seconds", min_excess_seconds,
                                                          zero=True)

    def observe(self, observation: StepObservation) -> str | None:
        floor = self.min_excess_seconds
        return self._judge(observation.seconds, lambda seconds, median: (
            f"{_ms(seconds)} against a median of {_ms(median)}"
            if seconds > self.factor * median and seconds - median >= floor else None))


class NonFinite(Trigger):
    """Fires on a step whose `fetch` (default the loss) has a NaN or infinite element."""

    kind = "non_finite"

    def __init__(self, fetch: Any = "loss") -> None:
        self.fetch = check_fetches("NonFinite", "fetch", fetch)

    def observe(self, observation: StepObservation) -> str | None:
        value = observation.value
        if value is None or not is_non_finite(value, "NonFinite", "fetch"):
            return None
        return f"{_fetch_name(self.fetch)} = {_scalar_text(value)}"


class LossSpike(_RollingTrigger):
    """Fires on a step whose `fetch` (default the loss) spikes above the last `window` steps': it must be
    `factor` times the median (in general: above median + (factor - 1) x |median|, for losses that can be
    negative) and also `factor` times further above the median than the window's usual upward excursion (its
    90th percentile), so the batch-to-batch spread of a healthy small-batch or nearly converged loss does not
    set it off. NaN and infinite values are `NonFinite`'s: neither judged nor counted."""

    kind = "loss_spike"

    def __init__(self, factor: float = 3.0, window: int = 100, fetch: Any = "loss", min_steps: int = 20) -> None:
        super().__init__("LossSpike", window, min_steps)
        self.factor = _check_factor("LossSpike", factor)
        self.fetch = check_fetches("LossSpike", "fetch", fetch)

    def observe(self, observation: StepObservation) -> str | None:
        value = observation.value
        if value is None:
            return None
        loss = _as_float(value)
        if not math.isfinite(loss):
            return None
        return self._judge(loss, self._spike)

    def _spike(self, loss: float, median: float) -> str | None:
        excursion = self._history.quantile(0.9) - median
        if loss > median + (self.factor - 1) * abs(median) and loss - median > self.factor * excursion:
            return f"{_fetch_name(self.fetch)} {loss:.4g} against a median of {median:.4g}"
        return None


class MemoryJump(_RollingTrigger):
    """Fires on a step that ends with more than `bytes` allocated above the median of the last `window`
    judged steps' (the CUDA allocator's bytes on a GPU run, read every step; the host heap in use otherwise,
    read every 10th step, since reading it costs tens of microseconds: there `window` and `min_steps` count
    those readings).

    Example: `MemoryJump(512 * 2**20)`: half a GiB more held at a step's end than usual.
    """

    kind = "memory_jump"
    reads_memory = True

    def __init__(self, bytes: int, window: int = 100, min_steps: int = 20) -> None:
        super().__init__("MemoryJump", window, min_steps)
        self.bytes = arguments.check_positive_int("MemoryJump", "bytes", bytes)

    def observe(self, observation: StepObservation) -> str | None:
        return self._judge(observation.memory_bytes, lambda held, median: (
            f"{format_memory(held)} {observation.memory_source} at the step's end, {format_memory(held - median)} "
            f"above the "
            f"median of the last {len(self._history)} steps" if held - median > self.bytes else None))


def check_triggers(owner: str, triggers: Any) -> list[Trigger]:
    """None or a list of `Trigger`s (hookprof.triggers), each used by one hook only."""
    if triggers is None:
        return []
    if isinstance(triggers, Trigger) or not isinstance(triggers, (list, tuple)) or not all(
            isinstance(t, Trigger) for t in triggers):
        raise TypeError(f"`{owner}(triggers={triggers!r})`: `triggers` must be a list of hookprof.triggers "
                        "(SlowStep(), NonFinite('loss'), LossSpike(), MemoryJump(bytes)), or None.")
    if len({id(t) for t in triggers}) != len(triggers):
        raise ValueError(f"`{owner}(triggers=...)`: the same trigger object is listed twice; list each once.")
    return list(triggers)


def host_scalar(value: Any) -> Any:
    """A one-element torch tensor as a Python number (one copy to the host, made once for every trigger that
    reads it); anything else as it is."""
    if type(value).__module__.partition(".")[0] == "torch" and getattr(value, "numel", None) is not None \
            and value.numel() == 1 and not value.is_complex():
        return value.item()
    return value


def _as_float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a torch tensor of several elements
        raise TypeError(f"LossSpike: the fetch gives a {type(value).__name__} ({value!r:.80}), not one number; "
                        "pass a `fetch` that gives the scalar loss.") from None


def _scalar_text(value: Any) -> str:
    try:
        return f"{float(value):g}"
    except (TypeError, ValueError, RuntimeError):
        return "a value with NaN or infinite elements"


def _fetch_name(fetch: Any) -> str:
    return fetch if isinstance(fetch, str) else getattr(fetch, "__name__", "the fetch")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"
