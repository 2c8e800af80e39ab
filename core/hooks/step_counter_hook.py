"""`StepCounterHook`: global steps per second, logged and written as a TensorBoard scalar (TF1's hook)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from hookprof._runtime import arguments, distribution
from hookprof._runtime.background import count_dropped
from hookprof._runtime.warn_once import WarnOnce
from hookprof.hooks.session import coming_step, steps_per_run
from hookprof.hooks.session_run_hook import SessionRunHook
from hookprof.hooks.timer import SecondOrStepTimer

logger = logging.getLogger(__name__)

_STUCK_WARNINGS = 5  # TF: logging.log_first_n(WARN, ..., 5)


class StepCounterHook(SessionRunHook):
    """Counts steps per second, with TF1's rules, arguments and messages.

    Every `every_n_steps` global steps (or `every_n_secs` seconds) it logs `"global_step/sec: %g"` at INFO and,
    when it has somewhere to write, adds the scalar summary `global_step/sec` at that global step. The first
    step only starts the count (TF: the timer's first `update_last_triggered_step` returns `(None, None)`), so
    with `every_n_steps=10` the first value is written at global step 11, then 21, 31, ... As TF, it warns
    (the first 5 times) when the global step did not increase over a step it saw; it is quiet (`quiet_on`)
    between its measuring steps, so a global step that stops moving there is noticed only as a missing value
    (TF checked every step; `HookCallback` with a hook lacking `quiet_on` gets TF's check).

    Args:
        every_n_steps: measure every this many global steps (TF's default, 100). Exactly one of
            `every_n_steps` / `every_n_secs`: pass `every_n_steps=None` with `every_n_secs`.
        every_n_secs: measure every this many seconds.
        output_dir: the log directory (an event file is added there); `summary_writer` wins over it. With
            neither, TF wrote no summary and only logged; the adapters default to the run's log directory.
        summary_writer: a writer the user already has: a `torch.utils.tensorboard.SummaryWriter`, a log
            directory, or an event sink (`hookprof.tensorboard.events.EventWriter`); the adapters also take
            Lightning's `TensorBoardLogger` and a Keras `TensorBoard` callback.
        batch_size: (not in TF) examples per global step; when given, `examples/sec` is logged and written too.
        clock: the seconds clock (default: `time.time()`, read at each call); for tests.

    Raises:
        ValueError: neither or both of `every_n_steps` / `every_n_secs` (TF's message), a count below 1 or seconds
            not above 0, an `output_dir` that is a file or not writable.
        TypeError: a count that is not an int, an `output_dir` that is not a path, a `summary_writer` that is not
            a writer.

    Only rank 0 writes summaries under distributed training; every rank logs, as every TF worker did.
    Each run (`begin`) starts the count again.
    """

    def __init__(
        self,
        every_n_steps: int | None = 100,
        every_n_secs: float | None = None,
        output_dir: str | os.PathLike | None = None,
        summary_writer: Any = None,
        batch_size: int | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        owner = type(self).__name__
        if (every_n_steps is None) == (every_n_secs is None):
            raise ValueError("exactly one of every_n_steps and every_n_secs should be provided.")
        self._timer = SecondOrStepTimer(every_steps=every_n_steps, every_secs=every_n_secs, clock=clock)
        self.every_n_steps = every_n_steps
        self.every_n_secs = every_n_secs
        self.batch_size = None if batch_size is None else arguments.check_positive_int(owner, "batch_size",
                                                                                       batch_size)
        self.output_dir = None if output_dir is None else arguments.expand_dir(owner, "output_dir", output_dir)
        self._output_dir_given = output_dir is not None
        self._writer_arg = summary_writer
        if output_dir is not None or summary_writer is not None:  # summaries asked for: their protos must be there
            distribution.require("tensorboard", f"{owner}(output_dir=..., summary_writer=...)")
        if summary_writer is not None:
            from hookprof.tensorboard.events import as_event_sink

            as_event_sink(summary_writer)  # a wrong kind of writer fails here, before training
        self._summary_tag = "global_step/sec"
        self._session: Any = None  # the fit's session: what one step advances the global step by (steps_per_run)
        self._sink: Any = None
        self._events_dir: str | None = None
        self._writes_here = True
        self._last_global_step: int | None = None
        self._stale_global_step: int | None = None
        self._stuck_warnings = 0
        self._warn_once = WarnOnce(logger)  # a failing disk is said once per reason, not every step
        self.dropped_outputs = 0

    def set_default_output_dir(self, path: str | os.PathLike) -> None:
        """Where summaries go when the user gave neither `output_dir` nor `summary_writer` (adapters call this)."""
        if self._writer_arg is None and not self._output_dir_given:
            self.output_dir = arguments.expand_dir(type(self).__name__, "output_dir", path)

    def begin(self) -> None:
        from hookprof.tensorboard.events import acquire, as_event_sink

        self.close()  # a previous run that failed before end() lets go of its stream here
        if self._writer_arg is not None:
            self._sink = as_event_sink(self._writer_arg)
        elif self.output_dir and not distribution.installed("tensorboard"):  # the adapter's default directory
            self._warn_once("no tensorboard", "%s logs %s but writes no summaries: the tensorboard package is not "
                            "installed; %s", type(self).__name__, self._summary_tag,
                            distribution.install_hint("tensorboard"))
        elif self.output_dir:
            arguments.make_dir(type(self).__name__, "output_dir", self.output_dir)
            self._events_dir = self.output_dir
            self._sink = acquire(self.output_dir)
        self._timer.reset()
        self._last_global_step = None
        self._stale_global_step = None

    def after_create_session(self, session: Any, coord: Any) -> None:
        self._session = session
        self._writes_here = getattr(session, "rank", 0) == 0

    def quiet_on(self, global_step: int) -> bool:
        # After_run acts when the timer fires for this step, or to warn about a global step that did not move.
        if self._timer.should_trigger_for_step(coming_step(self._session, global_step)):
            return False
        return not (global_step == self._last_global_step and self._stuck_warnings < _STUCK_WARNINGS)

    def may_request_stop(self) -> bool:
        return False  # it only measures

    def before_run(self, run_context) -> None:
        # TF fetched the global step with the step (a stale value: the step before it ran)
        self._stale_global_step = run_context.session.global_step
        return None

    def after_run(self, run_context, run_values) -> None:
        stale_global_step = self._stale_global_step
        if stale_global_step is None:  # (a driver that skipped before_run: take the step as one global step)
            stale_global_step = run_context.session.global_step - steps_per_run(run_context.session)
        self._stale_global_step = None
        timer = self._timer
        if timer.should_trigger_for_step(coming_step(run_context.session, stale_global_step)):
            global_step = run_context.session.global_step  # the real value after the step
            if timer.should_trigger_for_step(global_step):
                elapsed_time, elapsed_steps = timer.update_last_triggered_step(global_step)
                if elapsed_time is not None:
                    self._log_and_record(elapsed_steps, elapsed_time, global_step)
        if stale_global_step == self._last_global_step and self._stuck_warnings < _STUCK_WARNINGS:
            self._stuck_warnings += 1
            logger.warning(
                "It seems that global step (session.global_step) has not been increased. Current value (could be "
                "stable): %s vs previous value: %s. You could increase the global step by advancing "
                "session.global_step after each step (a ManualSession), or by stepping the optimizer.",
                stale_global_step, self._last_global_step)
        self._last_global_step = stale_global_step

    def _log_and_record(self, elapsed_steps: int, elapsed_time: float, global_step: int) -> None:
        if elapsed_time <= 0:  # (a clock that did not move: no rate to give; TF would divide by zero)
            return
        steps_per_sec = elapsed_steps / elapsed_time
        values = [(self._summary_tag, steps_per_sec)]
        if self.batch_size is not None:
            values.append(("examples/sec", steps_per_sec * self.batch_size))
        if self._sink is not None and self._writes_here:
            self._write(values, global_step)
        for tag, value in values:
            logger.info("%s: %g", tag, value)

    def _write(self, values: list[tuple[str, float]], global_step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        from hookprof.summary import scalar_values
        from hookprof.tensorboard.events import add_summary

        summary = Summary()
        for tag, value in values:
            summary.value.extend(scalar_values(tag, np.asarray(value, dtype=np.float64)))
        try:
            add_summary(self._sink, summary, global_step)
        except OSError as err:  # a full disk must not end the training run
            count_dropped(self)
            self._warn_once(f"write:{err.strerror or err}", "Could not write %s at step %d to %s (%s); training "
                            "goes on.", self._summary_tag, global_step,
                            err.filename or self.output_dir or "the summary writer", err.strerror or err)

    def end(self, session: Any) -> None:
        self.close()

    def close(self) -> None:
        """Flush and let go of the event stream and the fit's session (at `end()`, and when training fails before
        it)."""
        self._session = None
        sink, self._sink = self._sink, None
        if sink is not None:
            try:
                sink.flush()
            except OSError as err:  # what could not be flushed is lost either way; the run goes on
                count_dropped(self)
                self._warn_once(f"flush:{err.strerror or err}", "Could not flush %s to %s (%s).", self._summary_tag,
                                err.filename or self.output_dir or "the summary writer", err.strerror or err)
            finally:
                if self._events_dir is not None:
                    from hookprof.tensorboard.events import release

                    release(self._events_dir)
                self._events_dir = None
