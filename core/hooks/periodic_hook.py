"""`PeriodicHook`: what every hook on a steps-or-seconds schedule that writes files shares: the timer and its
resumable state, the output directory, the TensorBoard stream it holds, and warnings given once."""

from __future__ import annotations

import logging
import numbers
import os
import reprlib
from collections.abc import Callable
from typing import Any

from hookprof._runtime import arguments
from hookprof._runtime.warn_once import WarnOnce
from hookprof.hooks.session import steps_per_run
from hookprof.hooks.session_run_hook import SessionRunHook
from hookprof.hooks.timer import AgreedTimer, NeverTriggerTimer, SecondOrStepTimer


class PeriodicHook(SessionRunHook):
    """A hook firing on a `SecondOrStepTimer` and writing into `output_dir`.

    Each run (`begin`) starts the count again, as TF's hooks did, unless a saved schedule was loaded for this
    run: before `begin` (Keras, by hand) or between `begin` and `after_create_session` (Lightning restores
    checkpoints there). A run that starts at a global step above 0 with no saved schedule continues a step
    schedule from the uninterrupted run's last fire (`first_fire` + a multiple of `save_steps`).

    Where the ranks of a fit agree (`session.agreeing`, under DDP), the seconds schedule of a hook whose fires
    must be the same on every rank (`agreed_schedule`), read on each rank's clock, fires by what they agreed:
    the timer becomes an `AgreedTimer`, each rank proposes a fire after each step (`vote`: its own timer asked
    by `_schedule_fires`), and `agreed` records the decision, which the hook reads from its timer where it
    always does (a step schedule is the same on every rank already).
    """

    # the global step of an uninterrupted run's first fire on a steps schedule, the others following every
    # `save_steps` (TF: ProfilerHook at N, 2N; CheckpointSaverHook at 0, N; SummarySaverHook at its first step)
    first_fire = 0
    # whether every rank must fire on the same steps (a collective save, traces merged across ranks): then a
    # seconds schedule is agreed where the ranks agree (see above); a hook whose fires are its rank's own says no
    agreed_schedule = False

    def __init__(self, save_steps: int | None, save_secs: float | None, output_dir: Any,
                 clock: Callable[[], float] | None = None, schedule_optional: bool = False):
        owner = type(self).__name__
        unscheduled = schedule_optional and save_steps is None and save_secs is None
        if not unscheduled:
            arguments.check_schedule(owner, save_steps, save_secs)
        self.save_steps = save_steps
        self.save_secs = save_secs
        self._timer: SecondOrStepTimer | NeverTriggerTimer = NeverTriggerTimer() if unscheduled else \
            SecondOrStepTimer(every_secs=save_secs, every_steps=save_steps, clock=clock)
        self._restored = False
        self.output_dir = None if output_dir is None else arguments.expand_dir(owner, "output_dir", output_dir)
        self._output_dir_given = output_dir is not None
        self._events_dir: str | None = None
        self.dropped_outputs = 0
        self._warn_once = WarnOnce(logging.getLogger(type(self).__module__))
        self._session: Any = None  # the fit's session (its steps_per_run)
        # the running step fires the schedule: set by the subclass's before_run, read back and cleared by its
        # after_run (`_step_done`); `state_dict` reads it in between
        self._due = False

    def _run_steps(self) -> int:
        """How many global steps the coming step advances (TF's steps_per_run; see `Session.steps_per_run`)."""
        return steps_per_run(self._session)

    def may_request_stop(self) -> bool:
        return False  # it writes files (a CheckpointSaverHook's listeners may ask: see there)

    def set_default_output_dir(self, path: str | os.PathLike) -> None:
        """Where files go when the user gave no `output_dir` (the adapters call this before each fit's `begin`,
        so a second fit writes into its own run directory)."""
        if not self._output_dir_given:
            self.output_dir = arguments.expand_dir(type(self).__name__, "output_dir", path)

    def begin(self) -> None:
        self._due = False
        if not self._restored:
            self._timer.reset()

    def after_create_session(self, session: Any, coord: Any) -> None:
        self._session = session
        own = self._timer.own if isinstance(self._timer, AgreedTimer) else self._timer
        self._timer = AgreedTimer(own) if getattr(session, "agreeing", False) and self._agrees_schedule() else own
        step = getattr(session, "global_step", 0) or 0
        last = self._timer.last_triggered_step()
        if self._restored and last is not None and last > step:
            self._ignore_saved(f"it fired last at step {last}, after the resumed run's step {step}")
            self._timer.reset()
        fresh = not self._restored and self._timer.last_triggered_step() is None
        if fresh and self.save_steps and step > 0 and step >= self.first_fire:
            # Resumed without a saved schedule (a Keras checkpoint holds the optimizer's step, not callbacks):
            # an uninterrupted run fires at first_fire + k*N, so continue from the last of those. Seconds
            # schedules count from the resume.
            self._timer.update_last_triggered_step(step - (step - self.first_fire) % self.save_steps)
        self._restored = False  # a later run starts its own count

    # --- under DDP: a seconds schedule's fires are one decision for all ranks ---------------------------------

    def _agrees_schedule(self) -> bool:
        return self.agreed_schedule and self.save_secs is not None  # (a step schedule is the same everywhere)

    def votes(self) -> int:
        return int(self._agrees_schedule())

    def vote(self, global_step: int) -> tuple[bool, ...]:
        timer = self._timer
        if not self._agrees_schedule():
            return ()
        return (isinstance(timer, AgreedTimer) and self._schedule_fires(global_step, timer.own),)

    def agreed(self, run_context, decisions: tuple[bool, ...]) -> None:
        if isinstance(self._timer, AgreedTimer):
            self._timer.due = decisions[0]

    def _schedule_fires(self, global_step: int, timer: Any) -> bool:
        """Whether `timer` fires the schedule after the step that reached `global_step` (a subclass that acts
        before a step asks about the next one)."""
        return timer.should_trigger_for_step(global_step)

    def _step_done(self) -> bool:
        """This hook's after_run of the running step has begun (it brings its timer up to date): whether the step
        fired the schedule."""
        due, self._due = self._due, False
        return due

    def state_dict(self) -> dict[str, Any]:
        """The schedule, so that a resumed run writes no duplicate and misses no step. A checkpoint taken inside
        a step this hook fires on, before its after_run (a `CheckpointSaverHook` earlier in the list), holds the
        schedule as it is after that step: what a resumed run reads does not depend on the hooks' order."""
        state = self._timer.state_dict()
        if self._due and self._session is not None and "last_triggered_step" in state:
            state = {**state, "last_triggered_step": self._session.global_step}
        return {"timer": state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a schedule `state_dict` gave. A state hookprof does not write (a tampered or foreign
        checkpoint) is said once and ignored: the run goes on as a resume without a saved schedule."""
        timer = state.get("timer") if isinstance(state, dict) else None
        step = timer.get("last_triggered_step", None) if isinstance(timer, dict) else False
        if step is not None and not (isinstance(step, numbers.Integral) and not isinstance(step, bool) and step >= 0):
            self._ignore_saved(f"{reprlib.repr(state)} is not one it writes ({{'timer': {{'last_triggered_step': "
                               "an int >= 0 or None}})")
            return
        self._timer.load_state_dict(timer)
        self._restored = True

    def _ignore_saved(self, why: str) -> None:
        self._restored = False
        self._warn_once("state", "%s ignores the schedule saved in the checkpoint: %s. It schedules as a run "
                        "resumed without one.", type(self).__name__, why)

    # --- the TensorBoard stream of output_dir, held for a run -----------------------------------------------

    def _acquire_events(self) -> Any:
        """This run's hold on the event stream of `output_dir` (a previous failed run's is let go first)."""
        from hookprof.tensorboard.events import acquire

        self._release_events()
        self._events_dir = self.output_dir
        return acquire(self.output_dir)

    def _release_events(self) -> None:
        if self._events_dir is not None:
            from hookprof.tensorboard.events import release

            release(self._events_dir)
        self._events_dir = None

    def close(self) -> None:
        """Release what this hook holds (at `end()`, and when training fails before it): the event stream, and
        the fit's session (the model stays no one's after its fit)."""
        self._release_events()
        self._session = None
