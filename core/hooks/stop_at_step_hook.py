"""`StopAtStepHook`: TF1's `tf.train.StopAtStepHook`, requesting a stop once the global step reaches a step."""

from __future__ import annotations

from typing import Any

from hookprof._runtime import arguments
from hookprof.hooks.session import coming_step
from hookprof.hooks.session_run_hook import SessionRunArgs, SessionRunHook


class StopAtStepHook(SessionRunHook):
    """Requests a stop after `num_steps` steps, or once the global step reaches `last_step` (TF1's hook).

    Args:
        num_steps: number of steps to run, counted from the global step when training starts
            (`after_create_session`), so a fit resumed from a checkpoint at step 40 with `num_steps=10` stops
            at 50.
        last_step: the global step after which to stop.

    Raises:
        ValueError: neither or both of `num_steps` / `last_step` (TF's messages), a `num_steps` below 1 or a
            negative `last_step`.
        TypeError: a step that is not an int.

    Exactly one must be given: otherwise `ValueError("One of num_steps or last_step must be specified.")` or
    `ValueError("Only one of num_steps or last_step can be specified.")`, TF's messages.

    Timing is TF's: after each step, when the global step before it plus one reaches the last step, the
    global step after it is read and, if it is at or past the last step, `run_context.request_stop()` ends
    training after that step (Lightning: `trainer.should_stop`; Keras: `model.stop_training`; `end()` runs).
    So `trainer.global_step` / `optimizer.iterations` equal the last step when training ends. On the steps
    before that the hook is quiet (`quiet_on`), as TF's own check skips them.

    One difference, for reuse: TF computes the last step of `num_steps` once per hook; here every fit
    (`begin`) counts `num_steps` afresh from its own starting step.
    """

    def __init__(self, num_steps: int | None = None, last_step: int | None = None) -> None:
        if num_steps is None and last_step is None:
            raise ValueError("One of num_steps or last_step must be specified.")
        if num_steps is not None and last_step is not None:
            raise ValueError("Only one of num_steps or last_step can be specified.")
        owner = type(self).__name__
        # the settings as given (public: they tell two such hooks apart in a Lightning checkpoint)
        self.num_steps = None if num_steps is None else arguments.check_int(owner, "num_steps", num_steps, 1)
        self.last_step = None if last_step is None else arguments.check_int(owner, "last_step", last_step, 0)
        self._last_step: int | None = self.last_step  # the step to stop at; with num_steps, set per fit
        self._stale_step: int | None = None  # the global step when the running step began
        self._session: Any = None

    @property
    def stop_at_step(self) -> int | None:
        """The global step at which this hook stops training (None before a fit starts, with `num_steps`)."""
        return self._last_step

    def begin(self) -> None:
        self._last_step = self.last_step
        self._stale_step = None

    def after_create_session(self, session: Any, coord: Any) -> None:
        self._session = session
        if self._last_step is None:
            self._last_step = session.global_step + self.num_steps

    def quiet_on(self, global_step: int) -> bool:
        # TF's after_run looks at the real global step only when the stale one plus the steps a run advances
        # (TF's steps_per_run: Keras' steps_per_execution) reaches the last step
        last = self._last_step
        return last is not None and coming_step(self._session, global_step) < last

    def end(self, session: Any) -> None:
        self.close()

    def close(self) -> None:
        """Let go of the fit's session (at `end()`, and when training fails before it)."""
        self._session = None

    def may_request_stop(self) -> bool:
        return False  # it stops on the global step, the same on every rank

    def before_run(self, run_context) -> SessionRunArgs | None:
        # TF fetched the global step's read tensor (its value before the step); the session has it now
        self._stale_step = run_context.session.global_step
        return None

    def after_run(self, run_context, run_values) -> None:
        last = self._last_step
        if last is None or self._stale_step is None:
            return
        if coming_step(run_context.session, self._stale_step) >= last:
            # the step may or may not have advanced the global step: check the latest value, as TF does
            if run_context.session.global_step >= last:
                run_context.request_stop()
