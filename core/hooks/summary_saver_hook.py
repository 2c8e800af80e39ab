"""`SummarySaverHook`: TensorBoard summaries every N steps or seconds (TF1's hook)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from hookprof._runtime import arguments, distribution
from hookprof._runtime.background import count_dropped
from hookprof.hooks.periodic_hook import PeriodicHook
from hookprof.hooks.session import coming_step
from hookprof.hooks.session_run_hook import SessionRunArgs
from hookprof.summary import MergedSummary, Scaffold, SummaryError, as_merged
from hookprof.tensorboard.events import add_session_start, add_summary, as_event_sink


class SummarySaverHook(PeriodicHook):
    """Saves summaries every N steps or seconds, with TF1's rules.

    The first step always writes, after a session-start event at that step (as TF: it tells TensorBoard to
    drop stale events of a crashed earlier run from this step on); later writes follow the schedule; `end()`
    flushes and writes nothing new. Write into the same stream as other writers of the directory (see
    `hookprof.tensorboard.events`); the Lightning adapter does so with the TensorBoardLogger by default.
    Summaries are lazy (`hookprof.summary`): their values are computed only on the steps written.
    Only rank 0 writes under distributed training.

    Args:
        save_steps: write every this many global steps. Exactly one of `save_steps` / `save_secs`.
        save_secs: write every this many seconds.
        output_dir: the log directory (an event file is added there); `summary_writer` wins over it.
        summary_writer: a writer the user already has: a `torch.utils.tensorboard.SummaryWriter`, a log
            directory, or an event sink (`hookprof.tensorboard.events.EventWriter`). The adapters' hooks also
            take Lightning's `TensorBoardLogger` and a Keras `TensorBoard` callback.
        scaffold: a `hookprof.summary.Scaffold` whose `summary_op` is written. Exactly one of `scaffold` /
            `summary_op`.
        summary_op: a summary op from `hookprof.summary`, a `merge` of them, a list of them, or a collection
            selected by key, resolved when first written: `summary.CollectionSummary(key)`.
        strict: raise when a summary cannot be computed; by default it is skipped with a warning naming the
            summary and the step, and training goes on.
        clock: the seconds clock of the schedule (default: `time.time()`, read at each call); for tests.

    Raises:
        ValueError: neither or both of `scaffold` / `summary_op` (TF's message), neither or both of `save_steps` /
            `save_secs`, a `save_steps` below 1 or `save_secs` not above 0, an `output_dir` that is a file or not
            writable.
        TypeError: a `scaffold` that is not a `Scaffold`, a `summary_op` that is not a summary op (a collection
            key must be `summary.CollectionSummary(key)`), an `output_dir` that is not a path, a `summary_writer`
            that is not a writer, a `save_steps` that is not an int, a `strict` that is not a bool.

    Example::

        summary.scalar("loss", lambda step: step.outputs["loss"])
        trainer = Trainer(callbacks=[SummarySaverHook(save_steps=50, summary_op=summary.merge_all())])
    """

    first_fire = 1  # the first step writes: an uninterrupted run writes at 1, 1 + N, 1 + 2N, ...

    def __init__(
        self,
        save_steps: int | None = None,
        save_secs: float | None = None,
        output_dir: str | os.PathLike | None = None,
        summary_writer: Any = None,
        scaffold: Scaffold | None = None,
        summary_op: Any = None,
        strict: bool = False,
        clock: Callable[[], float] | None = None,
    ) -> None:
        owner = type(self).__name__
        distribution.require("tensorboard", owner)  # its protos are the events and summaries this hook writes
        if (scaffold is None) == (summary_op is None):
            raise ValueError("Exactly one of scaffold or summary_op must be provided.")
        if scaffold is not None and not isinstance(scaffold, Scaffold):
            raise TypeError(f"`{owner}(scaffold={scaffold!r})`: `scaffold` must be a hookprof.summary.Scaffold.")
        super().__init__(save_steps, save_secs, output_dir, clock)
        self._summary_op = None if summary_op is None else as_merged(summary_op, "summary_op")
        self._scaffold = scaffold
        self._writer_arg = summary_writer
        if summary_writer is not None:
            as_event_sink(summary_writer)  # a wrong kind of writer fails here, before training
        self.strict = arguments.check_bool(owner, "strict", strict)
        self._sink: Any = None
        self._writes_here = True
        self._started = False
        self.summary_errors = 0

    def set_default_output_dir(self, path: str | os.PathLike) -> None:
        """Where events go when the user gave neither `output_dir` nor `summary_writer` (adapters call this)."""
        if self._writer_arg is None:
            super().set_default_output_dir(path)

    def _get_summary_op(self) -> MergedSummary | None:
        return self._summary_op if self._summary_op is not None else self._scaffold.summary_op

    def begin(self) -> None:
        if self._writer_arg is not None:
            self._sink = as_event_sink(self._writer_arg)
        elif self.output_dir is not None:
            arguments.make_dir(type(self).__name__, "output_dir", self.output_dir)
            self._sink = self._acquire_events()
        else:
            self._warn_once("nowhere", "SummarySaverHook has neither output_dir nor summary_writer: it writes "
                            "nothing. Pass output_dir= or summary_writer=.")
        self._started = False
        super().begin()

    def after_create_session(self, session: Any, coord: Any) -> None:
        super().after_create_session(session, coord)
        self._writes_here = getattr(session, "rank", 0) == 0

    def quiet_on(self, global_step: int) -> bool:
        timer = self._timer
        return not (self._sink is not None and self._writes_here and (
            timer.last_triggered_step() is None or timer.should_trigger_for_step(coming_step(self._session,
                                                                                      global_step))))

    def before_run(self, run_context) -> SessionRunArgs | None:
        self._due = not self.quiet_on(run_context.session.global_step)
        if not self._due:
            return None
        op = self._get_summary_op()
        if op is None:
            return None
        return SessionRunArgs(fetches=lambda state: op.evaluate(state, self.strict, self._on_error))

    def after_run(self, run_context, run_values) -> None:
        if not self._step_done():
            return
        step = run_context.session.global_step
        try:
            if not self._started:
                add_session_start(self._sink, step)
                self._started = True
            self._timer.update_last_triggered_step(step)
            if run_values.results is not None:
                add_summary(self._sink, run_values.results, step)
        except OSError as err:  # a full disk must not end the training run; writing resumes when it clears
            count_dropped(self)
            self._warn_once(f"os:{err.strerror}", "Could not write summaries at step %d to %s (%s); training "
                            "goes on, and summaries are written again once the disk takes them.", step,
                            err.filename or self.output_dir or "the summary writer", err.strerror or err)

    def end(self, session: Any) -> None:
        self.close()

    def close(self) -> None:
        """Flush and release the event writer (at `end()`, and when training fails before it); a disk failure
        here is warned, never raised (every summary was flushed when written)."""
        try:
            if self._sink is not None:
                self._sink.flush()
        except OSError as err:
            self._warn_once(f"flush:{err.strerror}", "Could not flush summaries to %s (%s).",
                            err.filename or self.output_dir or "the summary writer", err.strerror or err)
        finally:
            super().close()

    def _on_error(self, err: SummaryError) -> None:
        self.summary_errors += 1
        self._warn_once(str(err).split(" at step")[0], "%s; the other summaries are written.", err)

