"""`PeriodicHook`: what every hook on a steps-or-seconds schedule shares: the timer and its resumable state."""

from __future__ import annotations

import time
from typing import Any, Callable

from core.session_run_hook import SessionRunHook
from core.timer import SecondOrStepTimer


class PeriodicHook(SessionRunHook):
    """A hook firing on a `SecondOrStepTimer`. Each run (`begin`) starts the count again, as TF's hooks did,
    unless a saved schedule was loaded for this run: before `begin` (Keras, by hand) or between `begin` and
    `after_create_session` (Lightning restores checkpoints there). A run that starts at a global step above 0
    with no saved schedule continues a step schedule from the last multiple of `save_steps`."""

    def __init__(self, save_steps: int | None, save_secs: float | None, clock: Callable[[], float] = time.time):
        self.save_steps = save_steps
        self.save_secs = save_secs
        self._timer = SecondOrStepTimer(every_secs=save_secs, every_steps=save_steps, clock=clock)
        self._restored = False

    def begin(self) -> None:
        if not self._restored:
            self._timer.reset()

    def after_create_session(self, session: Any, coord: Any) -> None:
        step = getattr(session, "global_step", 0) or 0
        if not self._restored and self.save_steps and step > 0 and self._timer.last_triggered_step() is None:
            # Resumed without a saved schedule (a Keras checkpoint holds the optimizer's step, not callbacks):
            # an uninterrupted run fires at N, 2N, ..., so continue from the last multiple of N. Seconds
            # schedules count from the resume.
            self._timer.update_last_triggered_step(step - step % self.save_steps)
        self._restored = False  # a later run starts its own count

    def state_dict(self) -> dict[str, Any]:
        """The schedule, so that a resumed run writes no duplicate and misses no step."""
        return {"timer": self._timer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._timer.load_state_dict(state.get("timer", {}))
        self._restored = True
