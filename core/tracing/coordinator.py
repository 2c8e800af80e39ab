"""The coordinator that runs at most one tracer per training step, one per fit.

Each fit's driver (`hookprof.hooks.hooked_session.HookedSession`) owns one coordinator, current in its
context while the fit runs (`fit_traces()`: what a hook judging every step reads the phases from). The driver
asks it to trace a step when a hook asks for it (the hooks' options merged first)
and stops it at the step's end; every hook of that step gets the same `RunMetadata`, whose step stats are
converted from the recording on first use (on `ProfilerHook`'s background thread, unless a hook reads them
first). A second driver asking for the same step (two hand-built `HookedSession`s) gets the running trace. The
coordinator also records the step's phases (data wait, forward, backward, optimizer) from the framework's
callback events, or where the tracer saw them begin, so every tracer shows them on a "Step phases" thread.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import time
import weakref
from collections.abc import Hashable
from typing import Any

from hookprof._runtime.background import BACKGROUND, any_busy, busy_since
from hookprof._runtime.fit_run import current_run
from hookprof._runtime.warn_once import WarnOnce
from hookprof.run_options import RunMetadata, RunOptions
from hookprof.step_stats import NodeExecStats, StepStats
from hookprof.trace import format as fmt
from hookprof.tracing.tracer import HOST_DEVICE, Tracer, TracerFactory, TracerUnavailable

log = logging.getLogger(__name__)

STEP_THREAD_ID = 0  # the pseudo-thread that carries the step's phase spans on the host device


class _StepTrace:
    """The trace of one step: its tracer, the phases marked so far, and the metadata once stopped."""

    __slots__ = ("key", "tracer", "options", "marks", "data_wait", "data_wait_shared", "metadata")

    def __init__(self, key: Hashable, tracer: Tracer, options: RunOptions, data_wait: tuple[int, int] | None,
                 data_wait_shared: bool = False):
        self.key = key
        self.tracer = tracer
        self.options = options
        self.marks: list[tuple[str, int]] = []
        self.data_wait = data_wait  # (start, end) ns: the previous step's end to this step's request
        self.data_wait_shared = data_wait_shared  # hookprof's own workers had work during that wait
        self.metadata: RunMetadata | None = None


class StepRecord:
    """One step's phases as a watched run keeps them (`StepTraceCoordinator.watch`): cheap host timestamps
    (ns) of its data wait's start (None for a run's first step), its start, each phase's start and its end."""

    __slots__ = ("step", "data_wait_start", "start", "marks", "end", "traced", "disturbed")

    def __init__(self, data_wait_start: int | None, start: int, disturbed: bool) -> None:
        self.step: int | None = None  # the global step it reached, as its watchers number it
        self.data_wait_start = data_wait_start
        self.start = start
        self.marks: list[tuple[str, int]] = []
        self.end: int | None = None
        self.traced = False  # a tracer ran in this step: its time is the tracer's as much as the step's
        self.disturbed = disturbed  # hookprof's background work (converting, writing) ran beside it

    @property
    def seconds(self) -> float:
        """The step's wall time, its data wait included."""
        begin = self.start if self.data_wait_start is None else self.data_wait_start
        return ((self.end or begin) - begin) / 1e9

    def spans(self) -> list[tuple[str, int, int]]:
        """(name, start ns, end ns) of the data wait and each phase, as `_add_phase_spans` lays a traced step out."""
        end = self.end or self.start
        spans = [] if self.data_wait_start is None else [(fmt.DATA_WAIT, self.data_wait_start, self.start)]
        return spans + _phase_spans(self.start, self.marks, end)


class StepTraceCoordinator:
    """Runs at most one tracer per step, whoever asked; hands every hook of the step the same metadata.

    Hooks that judge every step (a ProfilerHook with triggers) `watch` the run: the coordinator then keeps a
    `StepRecord` of the last steps (`recent`), with the phases the framework marked, at the cost of a few
    timestamps a step.
    """

    def __init__(self) -> None:
        self._current: _StepTrace | None = None
        self._last_step_end_ns: int | None = None
        self._warn_once = WarnOnce(log)
        self._watchers: collections.Counter[int] = collections.Counter()  # how many watch, by record count
        self.recent: collections.deque[StepRecord] = collections.deque(maxlen=0)
        self.last_record: StepRecord | None = None  # the watched step that ended last, until the next begins
        self._record: StepRecord | None = None  # the watched step running
        self._tracer_state: dict[str, Any] = {}  # what a run's traced steps leave for its later ones (`bind_fit`)
        self._marked: list[tuple[list[tuple[str, int]], tuple[str, int]]] = []  # what the last `mark` added, where

    def watch(self, steps: int) -> None:
        """Keep the records of at least the last `steps` steps until `unwatch(steps)`."""
        self._watchers[steps] += 1
        self._resize()

    def unwatch(self, steps: int) -> None:
        if self._watchers[steps] > 0:
            self._watchers[steps] -= 1
        self._watchers += collections.Counter()  # drops the zero counts
        self._resize()

    def _resize(self) -> None:
        length = max(self._watchers, default=0)
        if length != self.recent.maxlen:
            self.recent = collections.deque(self.recent, maxlen=length)
        if not length:
            self._record = self.last_record = None

    def step_begins(self) -> None:
        """A watched step starts now (its hooks' `before_run`): open its record (once per step)."""
        if self.recent.maxlen and self._record is None:
            self.last_record = None
            self._record = StepRecord(self._last_step_end_ns, time.time_ns(), any_busy())

    def new_run(self) -> None:
        """Training (re)starts: a trace left running by an unfinished step of a previous run is stopped, and
        the time since that run's last step is no data wait."""
        self.abort()
        self._tracer_state = {}
        self._last_step_end_ns = None
        self.recent.clear()
        self.last_record = None

    def restart_data_clock(self) -> None:
        """Work between steps that is not data loading (validation) ended now: the next data wait starts here."""
        self._last_step_end_ns = time.time_ns()

    @property
    def watching(self) -> bool:
        """Whether a watched step runs (its phases are recorded for the triggers)."""
        return self._record is not None

    @property
    def active(self) -> bool:
        """Whether a trace is running (between the step's start and its first `after_run`)."""
        return self._current is not None and self._current.metadata is None

    def start(self, key: Hashable, factory: TracerFactory, options: RunOptions) -> None:
        """Start tracing step `key` unless it already is; a trace left over from another step is aborted."""
        requested_ns = time.time_ns()  # the data wait ends here; what follows (a wait, the tracer's start) is ours
        last = self._last_step_end_ns
        shared = last is not None and busy_since(last)  # (read before waiting for those workers below)
        current = self._current
        if current is not None:
            if current.key == key:
                if not current.options.covers(options):
                    self._warn_once(
                        "detail",
                        "A second driver asked for more detail (%s) than the trace already running for "
                        "this step (%s); run the hooks that need it in the first driver.",
                        options, current.options,
                    )
                return
            self.abort()
        BACKGROUND.wait_idle()  # the previous traced step's conversion and files must not run inside this one
        try:
            tracer = factory()
            bind = getattr(tracer, "bind_fit", None)  # (duck-typed tracers may lack it)
            if bind is not None:
                bind(self._tracer_state)
            tracer.start(options)
        except TracerUnavailable as err:
            self._warn_once(f"unavailable:{err}", "Step not traced: %s", err)
            return
        except Exception:  # profiling must never end the user's training run
            self._warn_once("start", "Starting the step's tracer failed; steps run untraced.", exc_info=True)
            return
        trace = _StepTrace(key, tracer, options, None if last is None else (last, requested_ns), shared)
        self._current = trace
        _TRACING.add(self)
        trace.marks.append(("step", time.time_ns()))
        if self._record is not None:
            self._record.traced = True

    def mark(self, phase: str) -> None:
        """Note that the running step entered `phase` now (first caller wins, within a micro-batch); free when
        nothing traces or watches."""
        current, record = self._current, self._record
        if (current is None or current.metadata is not None) and record is None:
            if self._marked:  # (nothing traces or watches: the step's marks cost a few reads)
                self._marked = []
            return
        marked = []
        if current is not None and current.metadata is None:
            mark = _mark_once(current.marks, phase)
            if mark is not None:
                marked.append((current.marks, mark))
        if record is not None:
            mark = _mark_once(record.marks, phase)
            if mark is not None:
                marked.append((record.marks, mark))
        self._marked = marked

    def unmark(self, phase: str) -> None:
        """The running step's last mark, `phase`, did not happen after all (a data wait that found the epoch's
        data exhausted: no batch came, and the step ends): what that `mark` added goes, if still the last."""
        marked, self._marked = self._marked, []
        for marks, mark in marked:
            if mark[0] == phase and marks and marks[-1] is mark:
                marks.pop()

    def micro_batch(self) -> None:
        """Another micro-batch of the running step begins now (gradient accumulation: one optimizer step over
        several batches): its forward, backward, ... are marked again, after the previous one's."""
        current, record = self._current, self._record
        tracing = current is not None and current.metadata is None
        if tracing or record is not None:  # (free when nothing traces or watches)
            now = time.time_ns()
            if tracing:
                current.marks.append((MICRO_BATCH, now))
            if record is not None:
                record.marks.append((MICRO_BATCH, now))

    def finish(self, key: Hashable) -> RunMetadata | None:
        """Stop the trace of step `key` (if it still runs) and return its metadata; None if it was not traced."""
        end_ns = self._last_step_end_ns = time.time_ns()
        record = self._record
        if record is not None:
            record.end, self._record = end_ns, None
            record.disturbed = record.disturbed or any_busy()
            self.recent.append(record)
            self.last_record = record
        current = self._current
        if current is None or current.key != key:
            return None
        if current.metadata is None:
            _TRACING.discard(self)  # (stopped here, whatever follows: nothing left for the exit to abort)
            try:
                recording = current.tracer.stop_recording()
            except Exception:  # a tracer bug costs this trace, never the training run
                self._warn_once("stop", "Collecting the traced step failed; it has no timeline.", exc_info=True)
                current.metadata = RunMetadata()
                return current.metadata

            marks = list(current.marks)  # (the step's start first: see `start`)
            phases = StepPhases(current.tracer.name, current.data_wait, marks, end_ns, current.data_wait_shared,
                                step_shared=busy_since(marks[0][1]))

            def make_step_stats() -> StepStats | None:
                try:
                    stats = recording()
                except Exception:  # a conversion bug costs this trace, never the training run
                    self._warn_once("stop", "Collecting the traced step failed; it has no timeline.", exc_info=True)
                    return None
                return phases.add_to(stats)

            def export_step() -> PhasedExport | None:
                export = getattr(recording, "export", None)
                exported = export() if export is not None else None
                return None if exported is None else PhasedExport(exported, phases)

            current.metadata = RunMetadata(make_step_stats=make_step_stats, export_step=export_step)
        return current.metadata

    def abort(self) -> None:
        """Drop the running trace, if any, after a failed step; the tracer is always stopped."""
        self._record = None
        current, self._current = self._current, None
        _TRACING.discard(self)
        if current is not None and current.metadata is None:
            try:
                current.tracer.abort()
            except Exception:  # the step's own exception matters more than a tracer's
                log.exception("Stopping the %s tracer after a failed step raised", current.tracer.name)


@dataclasses.dataclass
class StepPhases:
    """What the coordinator adds to a traced step's stats: the tracer's name and the step's phase spans. Public:
    a `PhasedExport` carries one (to the render worker), and a step recorded elsewhere is phased with one.

    Attributes:
        tracer: the tracer's name (`metadata["tracer"]`, unless the stats name one).
        data_wait: (start, end) ns of the wait before the step, or None (a run's first step).
        marks: (phase, ns) where each phase began, the step's start first (`("step", ns)` or its first phase).
        end_ns: the step's end.
        data_wait_shared: whether hookprof's own workers (an earlier traced step's conversion, render, files)
            had work during the data wait: its span says so (`args.shared_with_hookprof`), and the advisor
            takes no such wait as evidence of the input pipeline's.
        step_shared: whether they had work during the step itself (its ops' times may be stretched by it): the
            step's span says so (`args.shared_with_hookprof`).
    """

    tracer: str
    data_wait: tuple[int, int] | None
    marks: list[tuple[str, int]]
    end_ns: int
    data_wait_shared: bool = False
    step_shared: bool = False

    def add_to(self, stats: StepStats) -> StepStats:
        stats.metadata.setdefault("tracer", self.tracer)
        _add_phase_spans(stats, self.data_wait, self.marks, self.end_ns, self.data_wait_shared, self.step_shared)
        return stats


@dataclasses.dataclass
class PhasedExport:
    """A traced step exported by its tracer (`to_stats()` converts it), with the coordinator's additions:
    picklable, for the render worker (`hookprof._runtime.worker`)."""

    exported: Any
    phases: StepPhases

    def to_stats(self) -> StepStats:
        return self.phases.add_to(self.exported.to_stats())

    @property
    def step_seconds(self) -> float:
        """How long the traced step took on the training thread, from its trace's start to its end."""
        marks = self.phases.marks
        return max(0, self.phases.end_ns - marks[0][1]) / 1e9 if marks else 0.0

    def report_mismatch(self, reason: str) -> None:
        """The step was converted elsewhere and its borrowed tensor identities did not fit
        (`hookprof.tracing.step_identity`): its tracer is told, once."""
        report = getattr(self.exported, "report_mismatch", None)
        if report is not None:
            report(reason)


MICRO_BATCH = "forward"  # the mark a micro-batch after the step's first begins with (its forward pass)


def _mark_once(marks: list[tuple[str, int]], phase: str) -> tuple[str, int] | None:
    """Append `phase` now unless the running micro-batch (the marks since the last MICRO_BATCH) has it; the mark
    appended, or None."""
    for name, _ in reversed(marks):
        if name == phase:
            return None
        if name == MICRO_BATCH:
            break
    mark = (phase, time.time_ns())
    marks.append(mark)
    return mark


def _add_phase_spans(stats: StepStats, data_wait: tuple[int, int] | None, marks: list[tuple[str, int]],
                     end_ns: int, data_wait_shared: bool = False, step_shared: bool = False) -> None:
    """Add the step's phases as nested spans on the host device's "Step" thread (the data wait before the step,
    and the step's own span, marked `shared_with_hookprof` where hookprof's own workers had work during it)."""
    host = stats.device(HOST_DEVICE)
    host.thread_names.setdefault(STEP_THREAD_ID, fmt.STEP_PHASES_THREAD)
    spans = []
    if data_wait is not None:
        spans.append((fmt.DATA_WAIT, *data_wait))
    step_start = marks[0][1]
    spans.append((fmt.TRAIN_STEP, step_start, end_ns))
    spans += _phase_spans(step_start, _with_phases_seen(stats, step_start, marks[1:], end_ns), end_ns)
    loops = [(start, stop) for name, start, stop in spans if name == fmt.VALIDATION]
    if loops:  # a validation run inside the step (an accumulation window): its ops are no forward pass of it
        for node in host.node_stats:
            if node.category != fmt.CAT_SPAN and any(start <= node.start_ns < stop for start, stop in loops):
                node.phase = fmt.VALIDATION
    shared = {fmt.ARG_SHARED_WITH_HOOKPROF: True}
    for i, (name, start, stop) in enumerate(spans):
        # (the wait before the step is the first span, where there is one)
        marked = data_wait_shared if i == 0 and data_wait is not None else step_shared and name == fmt.TRAIN_STEP
        host.node_stats.append(
            NodeExecStats(
                node_name=f"step/{name}", op=name, start_ns=start, duration_ns=max(0, stop - start),
                thread_id=STEP_THREAD_ID, phase="data" if name == fmt.DATA_WAIT else name,
                category=fmt.CAT_SPAN, args=shared if marked else None,
            )
        )


def _phase_spans(step_start: int, marks: list[tuple[str, int]], end_ns: int) -> list[tuple[str, int, int]]:
    """Each phase from where it was marked to where the next began; before the first mark, the forward pass."""
    phases = list(marks)
    if phases and phases[0][1] > step_start:
        phases.insert(0, ("forward", step_start))
    return [(name, start, phases[i + 1][1] if i + 1 < len(phases) else end_ns)
            for i, (name, start) in enumerate(phases)]


def _with_phases_seen(stats: StepStats, step_start: int, marks: list[tuple[str, int]],
                      end_ns: int) -> list[tuple[str, int]]:
    """The step's marks, and where the framework marks no backward pass or optimizer (Keras), the phases its ops
    show, in each batch of the step: from the step's start, or a later batch's (a MICRO_BATCH mark: Keras on JAX
    marks the data waits between the batches of one `steps_per_execution` call), to the next mark."""
    if any(name in _COMPUTE_MARKS for name, _ in marks):
        return marks
    seen = []
    for start in [step_start] + [at for name, at in marks if name == MICRO_BATCH]:
        seen += _phases_seen(stats, start, min((at for _, at in marks if at > start), default=end_ns))
    return sorted(marks + seen, key=lambda mark: mark[1]) if marks else seen


_COMPUTE_MARKS = frozenset({"backward", "after_backward", "optimizer"})  # what a framework that marks them marks


def _phases_seen(stats: StepStats, step_start: int, step_end: int) -> list[tuple[str, int]]:
    """Where the backward pass and the optimizer began, from the ops the tracer assigned to them: for
    frameworks whose callbacks mark no phases (Keras), so their steps show the same phase spans. The optimizer
    begins with its first op after the backward pass's last (XLA schedules a little optimizer work, a learning
    rate, early, and interleaves the rest: the phases are where each mostly runs)."""
    ops: dict[str, list[tuple[int, int]]] = {"backward": [], "optimizer": []}
    for node in stats.all_nodes():
        if node.category == fmt.CAT_OP and node.phase in ops and step_start <= node.start_ns < step_end:
            ops[node.phase].append((node.start_ns, node.start_ns + node.duration_ns))
    phases = []
    backward = ops["backward"]
    if backward:
        phases.append(("backward", min(start for start, _ in backward)))
    after = max((end for _, end in backward), default=step_start)
    optimizer = [start for start, _ in ops["optimizer"] if start >= after]
    if optimizer:
        phases.append(("optimizer", min(optimizer)))
    return phases


# Coordinators whose trace is running: one left running when the process ends (a Keras step failing outside
# the step function, which no callback sees) is stopped, so no profiler session or temp file outlives it.
_TRACING: weakref.WeakSet[StepTraceCoordinator] = weakref.WeakSet()


def fit_traces() -> StepTraceCoordinator | None:
    """The coordinator of the fit running in this context; None outside a fit."""
    run = current_run()
    return None if run is None else run.traces


@atexit.register
def _abort_running() -> None:
    for traces in list(_TRACING):
        traces.abort()
