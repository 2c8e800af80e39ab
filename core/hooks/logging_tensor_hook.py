"""`LoggingTensorHook`: logs the values of step outputs every N iterations or seconds, and/or at the end (TF1)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from hookprof._runtime import arguments
from hookprof.hooks.session_run_hook import SessionRunArgs, SessionRunHook
from hookprof.hooks.timer import NeverTriggerTimer, SecondOrStepTimer

logger = logging.getLogger(__name__)


class LoggingTensorHook(SessionRunHook):
    """Prints the given values every N local steps, every N seconds, or at the end, with TF1's rules.

    The values are logged at INFO as `"tag = value"` joined with `", "`, followed by `" (%.3f sec)"` (the
    seconds since the previous log) on every log but the first. The first iteration (0) always logs, then
    every `every_n_iter` iterations or once `every_n_secs` seconds passed; `at_end=True` also logs the last
    step's values at `end()`. Values are printed as numpy prints them (with `suppress=True`): torch tensors
    and other arrays are moved to the host first. Iterations count the steps of this run (`begin`).

    Args:
        tensors: a dict mapping tags to fetches (a step output or logged metric name such as `"loss"`, or a
            callable of the finished `StepState`), logged in sorted tag order; or a list of names, logged in
            list order.
        every_n_iter: log every this many iterations (local steps).
        every_n_secs: log every this many seconds. Exactly one of `every_n_iter` / `every_n_secs`, unless
            `at_end` is set and both are None.
        at_end: log the values of the last step at the end of training.
        formatter: a function of the dict tag -> value returning the text to log instead of the default.
        clock: the seconds clock (default: `time.time()`, read at each call); for tests.

    Raises:
        ValueError: no schedule (neither `at_end` nor one of `every_n_iter` / `every_n_secs`; TF's message), both,
            or an `every_n_iter` below 1.
        TypeError: `tensors` that are not a dict of tag -> fetch or a list of names, tags that are not strings, a
            `formatter` that is not callable.

    Example::

        trainer = Trainer(callbacks=[LoggingTensorHook({"loss": "loss"}, every_n_iter=100)])
    """

    def __init__(
        self,
        tensors: Mapping[str, Any] | list[str] | tuple[str, ...],
        every_n_iter: int | None = None,
        every_n_secs: float | None = None,
        at_end: bool = False,
        formatter: Callable[[dict[str, Any]], str] | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        owner = type(self).__name__
        only_log_at_end = at_end and (every_n_iter is None) and (every_n_secs is None)
        if not only_log_at_end and (every_n_iter is None) == (every_n_secs is None):
            raise ValueError("either at_end and/or exactly one of every_n_iter and every_n_secs must be provided.")
        if isinstance(every_n_iter, (int, float)) and not isinstance(every_n_iter, bool) and every_n_iter <= 0:
            raise ValueError(f"invalid every_n_iter={every_n_iter}.")  # (other kinds: SecondOrStepTimer's TypeError)
        if isinstance(tensors, Mapping):
            if not all(isinstance(tag, str) for tag in tensors):
                raise TypeError(f"`{owner}(tensors=...)`: the tags (keys) must be strings; got "
                                f"{sorted(repr(tag) for tag in tensors)}.")
            self._tag_order = sorted(tensors.keys())
            tensors = dict(tensors)
        elif isinstance(tensors, (list, tuple)) and all(isinstance(item, str) for item in tensors):
            self._tag_order = list(tensors)
            tensors = {item: item for item in tensors}
        else:
            raise TypeError(f"`{owner}(tensors={tensors!r})`: pass a dict of tag -> fetch (a step output or "
                            "metric name, or a callable of the finished step), or a list of names.")
        if formatter is not None:
            arguments.check_callable(owner, "formatter", formatter)
        self._tensors = tensors
        self._formatter = formatter
        self._timer: SecondOrStepTimer | NeverTriggerTimer = (
            NeverTriggerTimer() if only_log_at_end
            else SecondOrStepTimer(every_secs=every_n_secs, every_steps=every_n_iter, clock=clock))
        self._log_at_end = at_end
        self.every_n_iter = every_n_iter
        self.every_n_secs = every_n_secs
        self.at_end = at_end
        self.tags = frozenset(self._tag_order)  # (tells two hooks apart in a Lightning checkpoint's state keys)
        self._iter_count = 0
        self._count_step: int | None = None  # the global step after the last step this hook saw (None: none yet)
        self._should_trigger = False

    def begin(self) -> None:
        self._timer.reset()
        self._iter_count = 0
        self._count_step = None

    def _iteration(self, global_step: int) -> int:
        """This run's iteration for the step starting at `global_step`: TF counted its own after_run calls;
        steps on which the hook was quiet are counted from the global step, which advances once a step."""
        if self._count_step is None:
            return self._iter_count
        return self._iter_count + max(0, global_step - self._count_step)

    def quiet_on(self, global_step: int) -> bool:
        return self._count_step is not None and not self._timer.should_trigger_for_step(self._iteration(global_step))

    def may_request_stop(self) -> bool:
        return False  # it only logs

    def before_run(self, run_context) -> SessionRunArgs | None:
        self._iter_count = self._iteration(run_context.session.global_step)
        self._should_trigger = self._timer.should_trigger_for_step(self._iter_count)
        if self._should_trigger:
            return SessionRunArgs(self._tensors)
        return None

    def _log_tensors(self, tensor_values: Mapping[str, Any]) -> None:
        values = {tag: _host(value) for tag, value in tensor_values.items()}
        with np.printoptions(suppress=True):
            elapsed_secs, _ = self._timer.update_last_triggered_step(self._iter_count)
            if self._formatter:
                logger.info(self._formatter(values))
            else:
                stats = ", ".join(f"{tag} = {values[tag]}" for tag in self._tag_order)
                if elapsed_secs is not None:
                    logger.info("%s (%.3f sec)", stats, elapsed_secs)
                else:
                    logger.info("%s", stats)

    def after_run(self, run_context, run_values) -> None:
        if self._should_trigger:
            self._should_trigger = False
            self._log_tensors(run_values.results)
        self._iter_count += 1
        self._count_step = run_context.session.global_step

    def end(self, session: Any) -> None:
        if self._log_at_end:
            if getattr(session, "last_step", None) is None:
                logger.warning("LoggingTensorHook(at_end=True): no step ran, so there is nothing to log at the end.")
                return
            if self._count_step is not None:
                self._iter_count = self._iteration(session.global_step)
            values = session.run(self._tensors)
            self._log_tensors(values)


def _host(value: Any) -> Any:
    """A tensor or device array as a numpy array (printed as TF printed fetched values); others unchanged."""
    if hasattr(value, "detach") or (hasattr(value, "numpy") and not isinstance(value, (np.ndarray, np.generic))):
        from hookprof.summary import to_numpy

        return to_numpy(value)
    return value
