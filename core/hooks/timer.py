"""`SecondOrStepTimer` and `NeverTriggerTimer`: when a periodic hook fires, with TF1's exact behaviour;
`AgreedTimer`: a timer whose fires the ranks of a distributed fit decide together."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from hookprof._runtime import arguments


class NeverTriggerTimer:
    """A timer that never fires (TF's `NeverTriggerTimer`)."""

    def reset(self) -> None:
        pass

    def should_trigger_for_step(self, step: int) -> bool:
        return False

    def update_last_triggered_step(self, step: int) -> tuple[float | None, int | None]:
        return (None, None)

    def last_triggered_step(self) -> int | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def check_exactly_one(every_secs: Any, every_steps: Any) -> None:
    """TF's rule and messages for a seconds-or-steps schedule: exactly one of the two."""
    if every_secs is None and every_steps is None:
        raise ValueError("Either every_secs or every_steps should be provided.")
    if every_secs is not None and every_steps is not None:
        raise ValueError("Can not provide both every_secs and every_steps.")


class SecondOrStepTimer:
    """Fires the first time, then once `every_steps` steps or `every_secs` seconds passed since the last fire.

    Never fires twice for the same step. Seconds are `time.time()`, read at each call as TF's timer read them
    (so tests that patch `time.time` move it), or `clock()` when one is given (tests without sleeping).
    """

    def __init__(
        self,
        every_secs: float | None = None,
        every_steps: int | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        check_exactly_one(every_secs, every_steps)
        if every_steps is not None:
            arguments.check_positive_int("SecondOrStepTimer", "every_steps", every_steps)
        if every_secs is not None:
            arguments.check_seconds("SecondOrStepTimer", "every_secs", every_secs)
        if clock is not None:
            arguments.check_callable("SecondOrStepTimer", "clock", clock)
        self._every_secs = every_secs
        self._every_steps = every_steps
        self._clock = clock
        self.reset()

    def _now(self) -> float:
        return time.time() if self._clock is None else self._clock()

    def reset(self) -> None:
        self._last_triggered_step: int | None = None
        self._last_triggered_time: float | None = None

    def should_trigger_for_step(self, step: int) -> bool:
        if self._last_triggered_step is None:
            return True
        if self._last_triggered_step == step:
            return False
        if self._every_secs is not None:
            return self._now() >= self._last_triggered_time + self._every_secs
        return step >= self._last_triggered_step + self._every_steps

    def update_last_triggered_step(self, step: int) -> tuple[float | None, int | None]:
        """Record a fire at `step`; return `(elapsed_secs, elapsed_steps)` since the last, `(None, None)` first."""
        now = self._now()
        if self._last_triggered_time is None:
            elapsed: tuple[float | None, int | None] = (None, None)
        else:
            elapsed = (now - self._last_triggered_time, step - self._last_triggered_step)
        self._last_triggered_time = now
        self._last_triggered_step = step
        return elapsed

    def last_triggered_step(self) -> int | None:
        return self._last_triggered_step

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs: the last step fired (wall-clock time does not survive a restart)."""
        return {"last_triggered_step": self._last_triggered_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the schedule: steps count from the saved step, seconds from the moment of the resume."""
        step = state.get("last_triggered_step")
        self._last_triggered_step = None if step is None else int(step)
        self._last_triggered_time = None if step is None else self._now()


class AgreedTimer:
    """A timer whose fires the ranks of a distributed fit decide together: `should_trigger_for_step` says what
    they agreed after the last step (`due`, set by the hook's `agreed`, cleared by the fire); the rank's own
    timer (`own`, read on its own clock) only proposes, and keeps the schedule's record (the last fire, the
    saved state). `PeriodicHook` installs it where the ranks agree."""

    def __init__(self, own: SecondOrStepTimer | NeverTriggerTimer) -> None:
        self.own = own
        self.due = False

    def reset(self) -> None:
        self.own.reset()
        self.due = False

    def should_trigger_for_step(self, step: int) -> bool:
        # (a first fire needs no agreement: every rank's timer fires the first time it is asked)
        return self.due or self.own.last_triggered_step() is None

    def update_last_triggered_step(self, step: int) -> tuple[float | None, int | None]:
        self.due = False  # (the agreed fire happened: the next needs a new agreement, which the ballot makes only
        # on steps some rank votes True)
        return self.own.update_last_triggered_step(step)

    def last_triggered_step(self) -> int | None:
        return self.own.last_triggered_step()

    def state_dict(self) -> dict[str, Any]:
        return self.own.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.own.load_state_dict(state)
