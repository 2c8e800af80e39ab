"""`ProfilerHook`: a Chrome-trace timeline of one training step every N steps or seconds (TF1's hook).

The hook decides which steps are traced (the schedule, and the steps after a trigger fires: `TriggerWatch`, in
`trigger_watch`) and asks for their trace; what becomes of a traced step (export, render, write, back-pressure,
keep_last) is the capture pipeline's (`CapturePipeline`, tuned by `CaptureOptions`, in `capture`).
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from hookprof._runtime import arguments
from hookprof._runtime.atomic_file import remove_stale_temps
from hookprof.hooks.capture import CaptureOptions, CapturePipeline
from hookprof.hooks.periodic_hook import PeriodicHook
from hookprof.hooks.session import coming_step
from hookprof.hooks.session_run_hook import RunOptions, SessionRunArgs, TraceLevel
from hookprof.hooks.trigger_watch import CaptureWindow, TriggerWatch
from hookprof.profiler.profiler import Profiler
from hookprof.trace.writer import ChromeTraceWriter
from hookprof.triggers import Trigger, check_triggers

DEFAULT_MAX_EVENTS = 2_000_000  # what Perfetto's and Chrome's JSON importers load comfortably


class ProfilerHook(PeriodicHook):
    """Captures CPU/GPU profiling information every N steps or seconds, as `timeline-<step>.json` files.

    Same arguments and semantics as TF1's `tf.train.ProfilerHook`, as of TF 1.14: the first step only starts
    the count, so the first timeline is written N steps (or seconds) into training, at `timeline-N.json`,
    named after the global step reached by the traced step. The traced step runs under the adapter's tracer
    (torch.profiler where torch is the engine) and its ops, module scopes, input shapes and phases land in
    the file, which opens in Perfetto (ui.perfetto.dev) and chrome://tracing.

    The training thread waits only for torch's profiler to stop: converting the step's events and writing
    the files run on a background thread (`hookprof._runtime.background`) while training goes on. The next traced step,
    `end()`, `saved_paths`, `flush()` and the Profiler's reports wait for that work, so `fit` returns with
    every file on disk. That work is the hook's `pipeline` (`hookprof.hooks.capture.CapturePipeline`; a
    subclass may set `pipeline_class`), and the triggers' its `watch` (`hookprof.hooks.trigger_watch`).

    Args:
        save_steps: write a timeline every this many global steps. Exactly one of `save_steps`/`save_secs`.
        save_secs: write a timeline every this many seconds.
        output_dir: the directory for the files; created if missing. `~` and `$VARS` are expanded. The
            default, `""`, is the current directory (TF's); None lets the adapter choose (Lightning: the
            logger's run directory; Keras: `logs/train`), or the current directory without one.
        show_dataflow: add flow arrows between producers and consumers.
        show_memory: record allocations and add memory tracks (costs more per traced step).
        ranks: which distributed ranks write: None (all), an int, or a list of ints. File names carry the
            rank (`timeline-<step>-rank<r>.json`) when the world size is above 1, so they never collide.
        compress: write `timeline-<step>.json.gz` (gzip level 1, ~10x smaller) instead of `.json`.
        max_events: at most this many trace events per file (default 2,000,000, what Perfetto's and
            Chrome's JSON importers handle comfortably); a larger step is cut short, its metadata says
            `truncated`, and one warning is logged. None for no cap.
        tensorboard: also write the traced step's graph and run metadata (tag `step_<N>`) to a TensorBoard
            event file in `output_dir`, as TF did, for the Graphs dashboard (needs the tensorboard package).
        profiler: a `hookprof.profiler.Profiler`: every traced step is added to it (`add_step`), for tfprof's
            views and advice over the whole run. Memory is then recorded too.
        with_stack: record each op's Python call stack (the Profiler's code view and the advisor's code lines
            need it; it makes traced steps slower).
        triggers: `hookprof.triggers` (`SlowStep()`, `NonFinite("loss")`, `LossSpike()`, `MemoryJump(bytes)`)
            judged on every step: when one fires at step N, steps N+1 .. N+`capture_steps` are traced, the
            files' metadata say why (`trigger`: kind, step, detail) and hold the phases of step N and the
            triggers' `window` of steps before it. The schedule still runs; with triggers, `save_steps` and
            `save_secs` may both be None (trace only what triggers ask for).
        capture_steps: how many steps to trace after a trigger fires.
        cooldown_steps: after a trigger fires, none fires again for this many steps.
        keep_last: keep only the newest `keep_last` timelines this hook wrote in this run and remove older
            ones (`removed_timelines` counts them; TensorBoard's event files are kept). None keeps all.
        clock: the seconds clock of the schedule (default: `time.time()`, read at each call); for tests.
        capture: a `hookprof.hooks.CaptureOptions`: how traced steps are rendered and written (the render
            worker or not, its timeout, how many rendered steps may wait for the disk and for how long). None:
            the defaults, `CaptureOptions()`.

    Raises:
        ValueError: no schedule (neither `save_steps` nor `save_secs`, and no `triggers`) or both, a count or cap
            out of its range (`save_steps=0`, `capture_steps=0`, `keep_last=0`, `max_events=0`), the same trigger
            listed twice, an `output_dir` that is a file or not writable.
        TypeError: an argument of the wrong kind: a count that is not an int, a flag that is not a bool, an
            `output_dir` that is not a path, `ranks` that are not rank numbers, `triggers` that are not
            `hookprof.triggers`, a `profiler` that is not a `hookprof.profiler.Profiler`, a `capture` that is not
            `CaptureOptions`.

    Example::

        from lightning_prof import ProfilerHook
        trainer = Trainer(callbacks=[ProfilerHook(save_steps=100, output_dir="runs/prof")])
    """

    agreed_schedule = True  # (see PeriodicHook)

    pipeline_class: type[CapturePipeline] = CapturePipeline  # what carries traced steps to disk

    def __init__(
        self,
        save_steps: int | None = None,
        save_secs: float | None = None,
        output_dir: str | os.PathLike | None = "",
        show_dataflow: bool = True,
        show_memory: bool = False,
        ranks: int | Sequence[int] | None = None,
        compress: bool = False,
        max_events: int | None = DEFAULT_MAX_EVENTS,
        tensorboard: bool = True,
        profiler: Profiler | None = None,
        with_stack: bool = False,
        triggers: Sequence[Trigger] | None = None,
        capture_steps: int = 1,
        cooldown_steps: int = 100,
        keep_last: int | None = None,
        clock: Callable[[], float] | None = None,
        capture: CaptureOptions | None = None,
    ) -> None:
        owner = type(self).__name__
        self.triggers = check_triggers(owner, triggers)
        if save_steps is None and save_secs is None and not self.triggers:
            raise ValueError(f"`{owner}(save_steps=None, save_secs=None)`: set `save_steps` or `save_secs` (e.g. "
                             f"`{owner}(save_steps=100)`), or give `triggers` to trace only the steps after one "
                             "that fires (e.g. `triggers=[hookprof.triggers.SlowStep()]`).")
        super().__init__(save_steps, save_secs, output_dir, clock, schedule_optional=bool(self.triggers))
        self.capture_steps = arguments.check_positive_int(owner, "capture_steps", capture_steps)
        self.cooldown_steps = arguments.check_int(owner, "cooldown_steps", cooldown_steps, 0)
        self.keep_last = arguments.check_optional_cap(owner, "keep_last", keep_last)
        self.show_dataflow = arguments.check_bool(owner, "show_dataflow", show_dataflow)
        self.show_memory = arguments.check_bool(owner, "show_memory", show_memory)
        self.ranks = _check_ranks(owner, ranks)
        self.compress = arguments.check_bool(owner, "compress", compress)
        self.max_events = arguments.check_optional_cap(owner, "max_events", max_events)
        self.tensorboard = arguments.check_bool(owner, "tensorboard", tensorboard)
        self.with_stack = arguments.check_bool(owner, "with_stack", with_stack)
        if profiler is not None and not (callable(getattr(profiler, "add_step", None))
                                         and callable(getattr(profiler, "wait_for", None))):
            raise TypeError(f"`{owner}(profiler={profiler!r})`: `profiler` must be a hookprof.profiler.Profiler.")
        if capture is not None and not isinstance(capture, CaptureOptions):
            raise TypeError(f"`{owner}(capture={capture!r})`: `capture` must be a hookprof.hooks.CaptureOptions "
                            "(e.g. `CaptureOptions(render_worker=False)`), or None for the defaults.")
        self.profiler = profiler
        self.capture = capture if capture is not None else CaptureOptions()
        writer = ChromeTraceWriter(show_dataflow=show_dataflow, show_memory=show_memory, compress=compress,
                                   max_events=max_events)
        self.pipeline = self.pipeline_class(writer, self.capture, profiler, self.keep_last, self._warn_once,
                                            counts=self)
        self.watch = TriggerWatch(self.triggers, self.capture_steps, self.cooldown_steps, self._warn_once)
        self._options = RunOptions(
            trace_level=TraceLevel.FULL_TRACE, record_dataflow=show_dataflow,
            record_memory=show_memory or profiler is not None, with_stack=with_stack,
        )
        self._request = False  # this step's trace is asked for (set by before_run)
        self._writes_here = True
        self._events: Any = None
        self._run_start: tuple[int, float] | None = None  # (global step, time) of this run's first step
        self._fired_in_run = 0
        self._wanted = self._skipping = False
        self._capturing: CaptureWindow | None = None

    # --- what users read ----------------------------------------------------------------------------------

    @property
    def saved_paths(self) -> list[str]:
        """The timelines written so far and still kept (`keep_last`), oldest first (waits for one still being
        written)."""
        return self.pipeline.saved_paths

    def flush(self) -> None:
        """Wait until every traced step so far is on disk (files, TensorBoard, the Profiler)."""
        self.pipeline.flush()

    @property
    def skipped_traces(self) -> int:
        """Steps due to be traced while `max_pending_writes` files waited for the disk."""
        return self.pipeline.skipped_traces

    @property
    def removed_timelines(self) -> int:
        """Timelines removed by `keep_last`."""
        return self.pipeline.retention.removed

    @property
    def fired(self) -> collections.Counter[str]:
        """Trigger fires by kind, over all runs (a `collections.Counter`)."""
        return self.watch.fired

    def timeline_path(self, step: int, rank: int = 0, world_size: int = 1) -> str:
        """The file a traced `step` is written to."""
        suffix = f"-rank{int(rank)}" if world_size > 1 else ""
        extension = ".json.gz" if self.compress else ".json"
        return os.path.join(self.output_dir or "", f"timeline-{int(step)}{suffix}{extension}")

    # --- the TF hook ----------------------------------------------------------------------------------------

    def begin(self) -> None:
        self.flush()  # a previous fit's last timeline goes to that fit's directory and stream first
        if self.output_dir is None:
            self.output_dir = os.getcwd()
        arguments.make_dir(type(self).__name__, "output_dir", self.output_dir)
        remove_stale_temps(self.output_dir)  # left by a run killed mid-write
        super().begin()
        self._events = self._acquire_events() if self.tensorboard else None
        self._run_start, self._fired_in_run = None, 0
        self.watch.begin()
        self.pipeline.begin()

    def after_create_session(self, session: Any, coord: Any) -> None:
        super().after_create_session(session, coord)
        rank = getattr(session, "rank", 0)
        self._writes_here = self.ranks is None or rank in self.ranks
        self.watch.start(session, self._writes_here)
        self._start_worker_if_tracing(session)

    def _traces_step(self, global_step: int, timer: Any = None) -> bool:
        """Whether the step starting at `global_step` is one to trace (never the first: see after_run), by
        `timer` (default: the schedule's)."""
        timer = timer or self._timer
        return (self._writes_here and timer.last_triggered_step() is not None
                and timer.should_trigger_for_step(coming_step(self._session, global_step)))

    def before_run(self, run_context) -> SessionRunArgs | None:
        self._due = self._traces_step(run_context.session.global_step)
        self._capturing = self.watch.pending if self._writes_here else None
        self._wanted = self._due or self._capturing is not None
        # a disk slower than the schedule: skip the trace (counted) rather than stall or hold ever more files
        self._skipping = self._wanted and not self.pipeline.room_to_write()
        self._request = self._wanted and not self._skipping
        fetches = self.watch.step_begins()
        if fetches is not None:
            return SessionRunArgs(fetches=fetches, options=self._options if self._request else None)
        return SessionRunArgs(options=self._options) if self._request else None

    def quiet_on(self, global_step: int) -> bool:
        timer = self._timer  # (_traces_step spelled out: this runs on every step the hook does not trace)
        return not self.watch.watching and timer.last_triggered_step() is not None and not (
            self._writes_here and timer.should_trigger_for_step(coming_step(self._session, global_step)))

    # --- under DDP: which steps are traced is one decision for all ranks -------------------------------------

    def votes(self) -> int:
        """A seconds schedule and the triggers decide on what each rank sees: the ranks agree them (whether the
        schedule traces the next step: see `PeriodicHook`; a trigger's capture window), so each rank traces the
        same steps and merged traces line up."""
        return super().votes() + bool(self.triggers)

    def vote(self, global_step: int) -> tuple[bool, ...]:
        schedule = super().vote(global_step)
        return (*schedule, self.watch.opened_at(global_step)) if self.triggers else schedule

    def agreed(self, run_context, decisions: tuple[bool, ...]) -> None:
        super().agreed(run_context, decisions[:super().votes()])
        if self.triggers and decisions[-1]:  # a trigger fired on some rank: every rank captures the next steps
            self.watch.join(run_context.session.global_step, self.output_dir)

    def _schedule_fires(self, global_step: int, timer: Any) -> bool:
        return self._traces_step(global_step, timer)  # (the step a trace starts before: the next one)

    def after_run(self, run_context, run_values) -> None:
        timer = self._timer
        session = run_context.session
        step = session.global_step
        periodic = self._step_done()
        if self._run_start is None:
            self._run_start = (step - self._run_steps(), time.monotonic())
        self.watch.step_ended(step, run_values.results, self._capturing, self._writes_here, self.output_dir)
        if timer.last_triggered_step() is None and not self._wanted:
            # TF 1.14+: the first step starts the count; the first timeline comes N steps or seconds later.
            # (the step before this run's first; a NeverTriggerTimer, with triggers alone, ignores it)
            timer.update_last_triggered_step(step - self._run_steps())
        elif self._wanted:
            if periodic:
                timer.update_last_triggered_step(step)
            self._fired_in_run += 1  # (traced or not: another profiler may hold torch's, which warns itself)
            if self._skipping:
                self.pipeline.skip(step, self.output_dir)
                return
            run_metadata = run_values.run_metadata
            if run_metadata.converted and run_metadata.step_stats is None:
                return  # the step was not traced after all (another profiler held torch's)
            rank, world_size = getattr(session, "rank", 0), getattr(session, "world_size", 1)
            self.pipeline.submit(step, run_metadata, session, self.timeline_path(step, rank, world_size),
                                 self.output_dir, self._events if self.tensorboard else None, self._capturing)

    def _start_worker_if_tracing(self, session: Any) -> None:
        """Where the step schedule's next timeline comes before the fit's planned end (`Session.final_step`),
        start the render worker as the run starts, so that its interpreter and imports (0.3 s to a second or
        more) run beside the steps before that one, not with it (where the next traced steps, tens of
        milliseconds apart on a GPU, would wait for them). A fresh count starts at the run's first step; a
        resumed one (a checkpoint's, or the same hook's earlier fit) goes on from its last timeline."""
        final, last = getattr(session, "final_step", None), self._timer.last_triggered_step()
        start = last if last is not None else getattr(session, "global_step", 0)
        if self.save_steps and self._writes_here and final is not None and start + self.save_steps <= final:
            self.pipeline.start_worker()

    def end(self, session: Any) -> None:
        start = self._run_start
        if start is not None and self._fired_in_run == 0 and self._writes_here and not self.triggers:
            # a schedule longer than the fit: say so, or the user looks for files that never came
            steps, secs = getattr(session, "global_step", start[0]) - start[0], time.monotonic() - start[1]
            first, knob = (f"{self.save_steps} steps", "save_steps") if self.save_steps else \
                (f"{self.save_secs:g} s", "save_secs")
            self._warn_once("none", "%s wrote no timeline: the first comes %s after the first step, and this fit "
                            "ran %d steps in %.1f s; lower %s to trace a fit this short.",
                            type(self).__name__, first, steps, secs, knob)
        self.close()

    def close(self) -> None:
        """Finish the files still being written, then release the TensorBoard stream (at `end()`, and when
        training fails before it)."""
        self.flush()
        super().close()
        self._events = None
        self.watch.stop()


def _check_ranks(owner: str, ranks: Any) -> frozenset[int] | None:
    if ranks is None:
        return None
    values = [ranks] if isinstance(ranks, int) and not isinstance(ranks, bool) else ranks
    if not isinstance(values, (list, tuple, set, frozenset)) or not values or not all(
        isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in values
    ):
        raise TypeError(
            f"`{owner}(ranks={ranks!r})`: `ranks` must be None (all ranks), a rank number, or a non-empty list of them."
        )
    return frozenset(values)
