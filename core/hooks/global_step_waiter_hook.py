"""`GlobalStepWaiterHook`: TF1's `tf.train.GlobalStepWaiterHook`, holding a worker back until the global step
reaches a given step."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from hookprof._runtime import arguments
from hookprof.hooks.session_run_hook import SessionRunContext, SessionRunHook

logger = logging.getLogger(__name__)


class GlobalStepWaiterHook(SessionRunHook):
    """Delays the first step until the global step reaches `wait_until_step` (TF1's hook).

    TF used it to start the workers of asynchronous (parameter-server) training gradually, e.g.
    `wait_until_step=int(K * log(task_id + 1))` with task 0 the chief. Here, as there, it waits for a global
    step that something else advances: the step it reads is `run_context.session.global_step`, read afresh on
    every poll, so the session must read a counter shared with the process that trains (a `ManualSession` the
    chief updates, a session reading a shared store), or pass `global_step_fn` that reads one (e.g.
    `lambda: int(store.get("global_step"))` on a `torch.distributed.TCPStore` the chief sets). Lightning's and
    Keras' own sessions count this process's optimizer steps, which cannot advance while it waits: with them
    the hook passes at once when training resumes at or past `wait_until_step`, and otherwise waits for ever,
    as a TF worker whose chief never came did. (Synchronous DDP ranks step together: none can run ahead.)

    Args:
        wait_until_step: the global step to wait for; `<= 0` means never wait.
        global_step_fn: optional (not in TF): a function of no arguments returning the global step to wait on,
            instead of `run_context.session.global_step`.
        sleep: optional (not in TF): what waits between polls; None (the default) is `time.sleep`, looked up at
            each poll, so a test's `mock.patch.object(time, "sleep", ...)` (TF's own tests do this) reaches it.

    Raises:
        TypeError: a `wait_until_step` that is not an int, a `global_step_fn` or `sleep` that is not callable.

    Timing and messages are TF's: in the first `before_run` (of each fit: `begin` resets it), unless
    `wait_until_step <= 0`, it logs `"Waiting for global step %d before starting training."` once, then polls
    the global step every 0.5 s until it is `>= wait_until_step`, logging `"Waiting for global step %d before
    starting training. Current step is %d."` whenever the step has moved more than 1000 past the step last
    logged (TF's cadence: by steps, not by time; the first such message needs a step above 1000). Once started
    it never waits again and is quiet (`quiet_on`).
    """

    POLL_SECS = 0.5  # TF's time.sleep(0.5) between polls

    def __init__(self, wait_until_step: int, global_step_fn: Callable[[], int] | None = None,
                 sleep: Callable[[float], Any] | None = None) -> None:
        self.wait_until_step = arguments.check_int("GlobalStepWaiterHook", "wait_until_step", wait_until_step)
        if global_step_fn is not None and not callable(global_step_fn):
            raise TypeError(f"`GlobalStepWaiterHook(global_step_fn={global_step_fn!r})`: pass a function of no "
                            "arguments returning the global step, or None to read `run_context.session.global_step`.")
        if sleep is not None:
            arguments.check_callable("GlobalStepWaiterHook", "sleep", sleep)
        self._global_step_fn = global_step_fn
        self._sleep = sleep
        self._worker_is_started = False

    @property
    def worker_is_started(self) -> bool:
        """Whether the wait is over or there is none (TF's `_worker_is_started`, which a hook with
        `wait_until_step <= 0` sets in its first `before_run`: a quiet hook gets none)."""
        return self._worker_is_started or self.wait_until_step <= 0

    def begin(self) -> None:
        self._worker_is_started = False

    def quiet_on(self, global_step: int) -> bool:
        # once started, TF's before_run returns None at once; with wait_until_step <= 0 it never waits
        return self._worker_is_started or self.wait_until_step <= 0

    def may_request_stop(self) -> bool:
        return False  # it only waits

    def before_run(self, run_context: SessionRunContext) -> None:
        if self._worker_is_started:
            return None
        if self.wait_until_step <= 0:
            self._worker_is_started = True
            return None
        logger.info("Waiting for global step %d before starting training.", self.wait_until_step)
        read = self._global_step_fn
        session = run_context.session
        last_logged_step = 0
        while True:
            current_step = int(read() if read is not None else session.global_step)
            if current_step >= self.wait_until_step:
                self._worker_is_started = True
                return None
            if current_step - last_logged_step > 1000:
                logger.info("Waiting for global step %d before starting training. Current step is %d.",
                            self.wait_until_step, current_step)
                last_logged_step = current_step
            (self._sleep or time.sleep)(self.POLL_SECS)
