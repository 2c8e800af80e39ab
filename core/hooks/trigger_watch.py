"""The trigger watch: ProfilerHook's triggers judged on every step, and the capture windows their fires open.

`TriggerWatch` holds the triggers (`hookprof.triggers`), what they fetch of each step, the cooldown and the
count of fires; while watching, the fit's trace coordinator keeps the phases of the last steps (`watch`),
so a fire's file can show the steps before it. A fire at step N opens a `CaptureWindow`: the next
`capture_steps` steps are to be traced, and their files say why.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from typing import Any

from hookprof._runtime.memory import allocated_bytes, model_device
from hookprof._runtime.warn_once import WarnOnce
from hookprof.hooks.session import evaluate_fetches
from hookprof.tracing.coordinator import StepRecord, StepTraceCoordinator, fit_traces
from hookprof.triggers import StepObservation, Trigger, host_scalar

# ProfilerHook's logger: "... fired at step N" stays where users set ProfilerHook's level.
log = logging.getLogger("hookprof.hooks.profiler_hook")


OTHER_RANK = "other_rank"  # a capture window's fire that happened on another rank of a distributed fit


class CaptureWindow:
    """A trigger's fire being captured: what fired (kind, step, detail), the records of the firing step and
    the steps before it, and how many steps are still to trace."""

    __slots__ = ("fires", "recent", "left")

    def __init__(self, fires: list[dict[str, Any]], recent: list[StepRecord], steps: int) -> None:
        self.fires = fires
        self.recent = recent
        self.left = steps


class TriggerFetch:
    """A trigger's fetch, evaluated so that a step without the value (a skipped batch's empty outputs, a
    metric not logged yet) gives None and notes why, rather than raising out of the callback."""

    __slots__ = ("fetch", "error")

    def __init__(self, fetch: Any) -> None:
        self.fetch = fetch
        self.error: Exception | None = None

    def __call__(self, state: Any) -> Any:
        try:
            return evaluate_fetches(self.fetch, state)
        except Exception as err:  # (a user's callable too: monitoring must not end the training run)
            self.error = err
            return None

    def settings(self) -> Any:
        """What tells two of these apart in a checkpoint key: the fetch."""
        return self.fetch


def batch_index(state: Any) -> Any:
    """The step's batch index in its epoch (0: an epoch's first step, whose data loader may be starting)."""
    return state.batch_idx


class TriggerWatch:
    """Judges every finished step with `triggers` (checked already); a fire outside the cooldown opens a
    `CaptureWindow` of `capture_steps` steps (`pending`, until its steps are traced). `fired` counts fires by
    kind, over all runs."""

    def __init__(self, triggers: Sequence[Trigger], capture_steps: int, cooldown_steps: int,
                 warn_once: WarnOnce | None = None) -> None:
        self.triggers = list(triggers)
        self.capture_steps = capture_steps
        self.cooldown_steps = cooldown_steps
        self._warn_once = warn_once or WarnOnce(log)
        # what each trigger fetches of a step (one fetch per name, read on the host once however many triggers
        # read it), whether one reads memory, how many steps' records they keep
        self._keys = [None if t.fetch is None else f"fetch:{t.fetch}" if isinstance(t.fetch, str) else f"fetch#{i}"
                      for i, t in enumerate(self.triggers)]
        self.fetches: dict[str, Any] = {key: TriggerFetch(t.fetch) for key, t in zip(self._keys, self.triggers)
                                        if key}
        self.fetches["batch_idx"] = batch_index
        self.reads_memory = any(t.reads_memory for t in self.triggers)
        self.window = max((t.window for t in self.triggers), default=0) + 1  # the firing step and those before
        self.watching = False
        self._traces: StepTraceCoordinator | None = None  # the fit's, while watching
        self._memory_device: str | None = None
        self.pending: CaptureWindow | None = None  # the fire being captured, while steps remain
        self._quiet_until = -1  # no trigger fires at or before this step (the cooldown)
        self._opened_at: int | None = None  # the step whose fire opened `pending` on this rank
        self.fired: collections.Counter[str] = collections.Counter()

    def begin(self) -> None:
        """A new run: the triggers forget the last run's steps; no fire is pending, no cooldown runs."""
        for trigger in self.triggers:
            trigger.reset()
        self.pending, self._quiet_until, self._opened_at = None, -1, None

    def start(self, session: Any, writes_here: bool, traces: StepTraceCoordinator | None = None) -> None:
        """The session exists: find the device whose memory MemoryJump reads (the model's, not whichever CUDA
        touched last), and have the coordinator (`traces`; None: the fit's) keep the last steps' phases, for
        a fire's file."""
        self._memory_device = model_device(getattr(session, "model", None)) if self.reads_memory else None
        traces = traces if traces is not None else fit_traces()
        if self.triggers and writes_here and not self.watching and traces is not None:
            traces.watch(self.window)
            self.watching, self._traces = True, traces

    def stop(self) -> None:
        if self.watching:
            self._traces.unwatch(self.window)
            self.watching, self._traces = False, None

    def step_begins(self) -> dict[str, Any] | None:
        """A step begins: the fetches the triggers read of it (None when not watching)."""
        if not self.watching:
            return None
        self._traces.step_begins()
        return self.fetches

    def step_ended(self, step: int, results: dict[Any, Any], traced: CaptureWindow | None, writes_here: bool,
                   output_dir: Any = None) -> None:
        """A step ended at global step `step`, with the fetches' `results`; `traced` is the window it was to be
        traced for, if any (one step of it is done)."""
        if traced is not None:
            traced.left -= 1
            if traced.left == 0 and self.pending is traced:
                self.pending = None
        if self.watching:
            self._judge(step, results, writes_here, output_dir)

    def _judge(self, step: int, results: dict[Any, Any], writes_here: bool, output_dir: Any) -> None:
        """Show the finished step to every trigger; on a fire (outside the cooldown) capture the next steps."""
        record = self._traces.last_record
        if record is not None:
            record.step = step
        # time and memory are judged only on steps that ran as an untraced step runs
        judged = record is not None and not (record.traced or record.disturbed or results.get("batch_idx") == 0)
        memory = allocated_bytes(step, self._memory_device) if judged and self.reads_memory else None
        observation = StepObservation(step, record.seconds if judged else None, None,
                                      *(memory if memory is not None else (None, "")))
        values = {key: host_scalar(value) for key, value in results.items()}
        for key, fetch in self.fetches.items():
            if isinstance(fetch, TriggerFetch) and fetch.error is not None:  # the triggers reading it sit out
                self._warn_once(f"fetch:{key}", "Triggers cannot read %r on every step (%s: %s); they sit out "
                                "those steps.", fetch.fetch, type(fetch.error).__name__, fetch.error)
                fetch.error = None
        fires = self.observe(observation, values)
        if not fires or step <= self._quiet_until or not writes_here:
            return
        self._open(step, fires)
        for fire in fires:
            self.fired[fire["kind"]] += 1
            level = logging.WARNING if self.fired[fire["kind"]] == 1 else logging.INFO
            log.log(level, "%s fired at step %d (%s): tracing step%s %d%s into '%s'.", fire["kind"], step,
                    fire["detail"], "s" if self.capture_steps > 1 else "", step + 1,
                    f"..{step + self.capture_steps}" if self.capture_steps > 1 else "", output_dir)

    def _open(self, step: int, fires: list[dict[str, Any]]) -> None:
        """Capture the `capture_steps` steps after `step`, for `fires`; the cooldown starts."""
        self._quiet_until = step + self.cooldown_steps
        recent = [r for r in self._traces.recent if r.step is not None and r.step > step - self.window]
        self.pending = CaptureWindow(fires, recent, self.capture_steps)
        self._opened_at = step

    def opened_at(self, step: int) -> bool:
        """Whether a fire at `step` opened a capture window on this rank (its vote under DDP)."""
        return self._opened_at == step

    def join(self, step: int, output_dir: Any = None) -> None:
        """The ranks agreed that a trigger fired at `step` on one of them: this rank captures the same steps,
        and its cooldown starts with theirs (so the ranks' windows stay one)."""
        if not self.watching or self._opened_at == step:
            return
        self._open(step, [{"kind": OTHER_RANK, "step": step, "detail": "a trigger fired on another rank"}])
        log.info("A trigger fired at step %d on another rank: tracing step%s %d%s into '%s' here too.", step,
                 "s" if self.capture_steps > 1 else "", step + 1,
                 f"..{step + self.capture_steps}" if self.capture_steps > 1 else "", output_dir)

    def observe(self, observation: StepObservation, values: dict[str, Any]) -> list[dict[str, Any]]:
        """Show `observation` (its `value` set from `values`, by each trigger's fetch) to every trigger; the
        fires (kind, step, detail). A trigger handed no number says so once and sits the step out."""
        fires = []
        for i, (trigger, key) in enumerate(zip(self.triggers, self._keys)):
            observation.value = values.get(key)
            try:
                detail = trigger.observe(observation)
            except TypeError as err:  # a fetch that gives no number: said once, the trigger sits out
                self._warn_once(f"trigger:{i}", "%s", err)
                continue
            if detail is not None:
                fires.append({"kind": trigger.kind, "step": observation.step, "detail": detail})
        return fires
