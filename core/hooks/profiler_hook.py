"""`ProfilerHook`: a Chrome-trace timeline of one training step every N steps or seconds (TF1's hook)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from hookprof._runtime import arguments, worker
from hookprof._runtime.atomic_file import atomic_write, remove_stale_temps
from hookprof._runtime.background import BACKGROUND, RENDERS, WRITES, BackgroundJob, count_dropped
from hookprof._runtime.memory import allocated_bytes, model_device
from hookprof.hooks.periodic_hook import PeriodicHook
from hookprof.hooks.session import evaluate_fetches
from hookprof.hooks.session_run_hook import RunOptions, SessionRunArgs, TraceLevel
from hookprof.step_stats import DeviceStepStats, NodeExecStats, StepStats
from hookprof.tensorboard.events import EventWriter, SerializedEvent
from hookprof.trace import format as fmt
from hookprof.trace.writer import ChromeTraceWriter
from hookprof.tracing import HOST_DEVICE, STEP_TRACES
from hookprof.tracing.coordinator import StepRecord
from hookprof.triggers import StepObservation, Trigger, check_triggers, host_scalar

log = logging.getLogger(__name__)

DEFAULT_MAX_EVENTS = 2_000_000  # what Perfetto's and Chrome's JSON importers load comfortably
# Traced steps rendered and waiting for the disk, at most (each held in memory until written): past that a
# step due to be traced is not, and is counted (`skipped_traces`, the next file's `skipped_traces`). A full
# queue is given WRITE_GRACE_SECONDS to free a place first: a disk that keeps up does so within moments (the
# writer thread may only be waiting for the GIL), so only a slow disk ever costs a trace.
MAX_PENDING_WRITES = 2
WRITE_GRACE_SECONDS = 0.05
# Convert and render traced steps in the render worker process where one can run (`hookprof._runtime.worker`);
# False keeps that work on the background thread of the training process.
RENDER_WORKER = True
# A step the render worker has not rendered in this long is dropped (one warning) and the worker stopped: a
# hung worker (a stalled TMPDIR, say) must not hold up the fit's end. At the worker's pace (tens of
# microseconds an event at most) this leaves a wide margin for steps of millions of events.
RENDER_TIMEOUT_SECONDS = 300.0
_WORKER_MODULES = ("hookprof.hooks.profiler_hook", "hookprof.tracing.kineto_trace", "hookprof.tensorboard.graph",
                   "tensorboard.compat.proto.event_pb2", "orjson")


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
    every file on disk.

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

    Example::

        from lightning_prof import ProfilerHook
        trainer = Trainer(callbacks=[ProfilerHook(save_steps=100, output_dir="runs/prof")])
    """

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
        profiler: Any = None,
        with_stack: bool = False,
        triggers: Sequence[Trigger] | None = None,
        capture_steps: int = 1,
        cooldown_steps: int = 100,
        keep_last: int | None = None,
        clock: Callable[[], float] | None = None,
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
        self.profiler = profiler
        self._writer = ChromeTraceWriter(show_dataflow=show_dataflow, show_memory=show_memory,
                                         compress=compress, max_events=max_events)
        self._options = RunOptions(
            trace_level=TraceLevel.FULL_TRACE, record_dataflow=show_dataflow,
            record_memory=show_memory or profiler is not None, with_stack=with_stack,
        )
        self._request = False
        self._writes_here = True
        self._saved_paths: list[str] = []
        self._events: Any = None
        self._pending: Any = None  # the background job writing this hook's last traced step
        self._rendering: Any = None  # the last job waiting for the render worker (RENDERS)
        self._run_start: tuple[int, float] | None = None  # (global step, time) of this run's first step
        self._fired_in_run = 0
        # triggers: what each fetches of a step, whether one reads memory, the records they keep
        # (one fetch per name, read on the host once however many triggers read it)
        self._trigger_keys = [None if t.fetch is None else f"fetch:{t.fetch}" if isinstance(t.fetch, str)
                              else f"fetch#{i}" for i, t in enumerate(self.triggers)]
        self._trigger_fetches = {key: _TriggerFetch(t.fetch) for key, t in zip(self._trigger_keys, self.triggers)
                                 if key}
        self._trigger_fetches["batch_idx"] = _batch_index
        self._reads_memory = any(t.reads_memory for t in self.triggers)
        self._window = max((t.window for t in self.triggers), default=0) + 1  # the firing step and those before
        self._watching = False
        self._memory_device: str | None = None
        self._capture: _Capture | None = None  # the fire being captured, while steps remain
        self._quiet_until = -1  # no trigger fires at or before this step (the cooldown)
        self.fired: collections.Counter[str] = collections.Counter()  # trigger fires by kind, over all runs
        self._kept: collections.deque[str] = collections.deque()  # this run's timelines, oldest first (keep_last)
        self.removed_timelines = 0
        self._writes: collections.deque[BackgroundJob] = collections.deque()  # on the disk's worker, in order
        self.skipped_traces = 0  # steps due to be traced while MAX_PENDING_WRITES files waited for the disk
        self._skipped_since_file = 0
        self._wanted = self._skipping = self._periodic = False
        self._capturing: _Capture | None = None

    def begin(self) -> None:
        self.flush()  # a previous fit's last timeline goes to that fit's directory and stream first
        if self.output_dir is None:
            self.output_dir = os.getcwd()
        arguments.make_dir(type(self).__name__, "output_dir", self.output_dir)
        remove_stale_temps(self.output_dir)  # left by a run killed mid-write
        super().begin()
        self._events = self._acquire_events() if self.tensorboard else None
        self._run_start, self._fired_in_run = None, 0
        for trigger in self.triggers:
            trigger.reset()
        self._capture, self._quiet_until = None, -1
        self._kept.clear()

    def after_create_session(self, session: Any, coord: Any) -> None:
        super().after_create_session(session, coord)
        # (the device whose memory MemoryJump reads: the model's, not whichever CUDA touched last)
        self._memory_device = model_device(getattr(session, "model", None)) if self._reads_memory else None
        rank = getattr(session, "rank", 0)
        self._writes_here = self.ranks is None or rank in self.ranks
        if self.triggers and self._writes_here and not self._watching:
            STEP_TRACES.watch(self._window)  # keep the phases of the last steps, for a trigger's file
            self._watching = True
        if self._writes_here and self._uses_worker():
            with contextlib.suppress(OSError):  # (none to be had: the first traced step says so)
                worker.WORKER.start(_WORKER_MODULES)  # its interpreter starts while the first steps run

    def _uses_worker(self) -> bool:
        return RENDER_WORKER and worker.AVAILABLE and self.profiler is None

    def _traces_step(self, global_step: int) -> bool:
        """Whether the step starting at `global_step` is one to trace (never the first: see after_run)."""
        timer = self._timer
        return (self._writes_here and timer.last_triggered_step() is not None
                and timer.should_trigger_for_step(global_step + 1))

    def before_run(self, run_context) -> SessionRunArgs | None:
        self._periodic = self._traces_step(run_context.session.global_step)
        self._capturing = self._capture if self._writes_here else None
        self._wanted = self._periodic or self._capturing is not None
        # a disk slower than the schedule: skip the trace (counted) rather than stall or hold ever more files
        self._skipping = self._wanted and not self._room_to_write()
        self._request = self._wanted and not self._skipping
        if self._watching:
            STEP_TRACES.step_begins()
            return SessionRunArgs(fetches=self._trigger_fetches, options=self._options if self._request else None)
        return SessionRunArgs(options=self._options) if self._request else None

    def quiet_on(self, global_step: int) -> bool:
        timer = self._timer  # (_traces_step spelled out: this runs on every step the hook does not trace)
        return not self._watching and timer.last_triggered_step() is not None and not (
            self._writes_here and timer.should_trigger_for_step(global_step + 1))

    def after_run(self, run_context, run_values) -> None:
        timer = self._timer
        session = run_context.session
        step = session.global_step
        if self._run_start is None:
            self._run_start = (step - 1, time.monotonic())
        capture = self._capturing
        if capture is not None:
            capture.left -= 1
            if capture.left == 0 and self._capture is capture:
                self._capture = None
        if self._watching:
            self._judge(step, run_values.results)
        if timer.last_triggered_step() is None and not self._wanted:
            # TF 1.14+: the first step starts the count; the first timeline comes N steps or seconds later.
            timer.update_last_triggered_step(step - 1)  # (a NeverTriggerTimer, with triggers alone, ignores it)
        elif self._wanted:
            if self._periodic:
                timer.update_last_triggered_step(step)
            self._fired_in_run += 1  # (traced or not: another profiler may hold torch's, which warns itself)
            if self._skipping:
                self.skipped_traces += 1
                self._skipped_since_file += 1
                self._warn_once("skipped", "Timelines are traced faster than the disk takes them: %d files wait to "
                                "be written into %s, so step %d was not traced. Skipped steps are counted in "
                                "`skipped_traces` and in the next file's metadata; trace less often to keep them.",
                                MAX_PENDING_WRITES, self.output_dir, step)
                return
            run_metadata = run_values.run_metadata
            if run_metadata.converted and run_metadata.step_stats is None:
                return  # the step was not traced after all (another profiler held torch's)
            job = _Job(step, run_metadata, session, self, capture)
            # Converting the step's events and writing them costs as much as torch's profiler stop: it runs
            # on the background thread while training goes on (see hookprof._runtime.background).
            self._pending = BACKGROUND.submit(lambda: self._save(job))
            if self.profiler is not None:
                self.profiler.wait_for(self._pending)  # its reports include this step

    def _judge(self, step: int, results: dict[Any, Any]) -> None:
        """Show the finished step to every trigger; on a fire (outside the cooldown) capture the next steps."""
        record = STEP_TRACES.last_record
        if record is not None:
            record.step = step
        # time and memory are judged only on steps that ran as an untraced step runs
        judged = record is not None and not (record.traced or record.disturbed or results.get("batch_idx") == 0)
        memory = allocated_bytes(step, self._memory_device) if judged and self._reads_memory else None
        observation = StepObservation(step, record.seconds if judged else None, None,
                                      *(memory if memory is not None else (None, "")))
        values = {key: host_scalar(value) for key, value in results.items()}
        for key, fetch in self._trigger_fetches.items():
            if isinstance(fetch, _TriggerFetch) and fetch.error is not None:  # the triggers reading it sit out
                self._warn_once(f"fetch:{key}", "Triggers cannot read %r on every step (%s: %s); they sit out "
                                "those steps.", fetch.fetch, type(fetch.error).__name__, fetch.error)
                fetch.error = None
        fires = []
        for i, (trigger, key) in enumerate(zip(self.triggers, self._trigger_keys)):
            observation.value = values.get(key)
            try:
                detail = trigger.observe(observation)
            except TypeError as err:  # a fetch that gives no number: said once, the trigger sits out
                self._warn_once(f"trigger:{i}", "%s", err)
                continue
            if detail is not None:
                fires.append({"kind": trigger.kind, "step": step, "detail": detail})
        if not fires or step <= self._quiet_until or not self._writes_here:
            return
        self._quiet_until = step + self.cooldown_steps
        recent = [r for r in STEP_TRACES.recent if r.step is not None and r.step > step - self._window]
        self._capture = _Capture(fires, recent, self.capture_steps)
        for fire in fires:
            self.fired[fire["kind"]] += 1
            level = logging.WARNING if self.fired[fire["kind"]] == 1 else logging.INFO
            log.log(level, "%s fired at step %d (%s): tracing step%s %d%s into '%s'.", fire["kind"], step,
                    fire["detail"], "s" if self.capture_steps > 1 else "", step + 1,
                    f"..{step + self.capture_steps}" if self.capture_steps > 1 else "", self.output_dir)

    @property
    def saved_paths(self) -> list[str]:
        """The timelines written so far and still kept (`keep_last`), oldest first (waits for one still being
        written)."""
        self.flush()
        return list(self._saved_paths)

    def flush(self) -> None:
        """Wait until every traced step so far is on disk (files, TensorBoard, the Profiler)."""
        if self._pending is not None:
            self._pending.wait()  # this hook's jobs run in order: its last one done, all are
        if self._rendering is not None:
            self._rendering.wait()  # (and so do the render worker's, which the background jobs fed)
        if self._writes:
            self._writes[-1].wait()  # and so do the disk's
            self._writes.clear()

    def _room_to_write(self) -> bool:
        """Whether fewer than MAX_PENDING_WRITES of this hook's rendered steps wait for the disk, after giving a
        full queue WRITE_GRACE_SECONDS."""
        writes = self._writes

        def pending() -> int:
            while writes and writes[0].done:
                writes.popleft()
            return len(writes)  # (steps being rendered are the CPU's backlog: the next trace waits, see _save)

        if pending() < MAX_PENDING_WRITES:
            return True
        if writes:
            writes[0].wait(WRITE_GRACE_SECONDS)
        return pending() < MAX_PENDING_WRITES

    def timeline_path(self, step: int, rank: int = 0, world_size: int = 1) -> str:
        """The file a traced `step` is written to."""
        suffix = f"-rank{int(rank)}" if world_size > 1 else ""
        extension = ".json.gz" if self.compress else ".json"
        return os.path.join(self.output_dir or "", f"timeline-{int(step)}{suffix}{extension}")

    def _save(self, job: _Job) -> None:
        """On the background thread: hand the traced step to the render worker as kineto's export
        (`hookprof._runtime.worker`, called from `RENDERS`), or, with a Profiler (which wants the stats here),
        where no worker can run, or when someone converted the step already, convert and render it here and
        add it to the Profiler."""
        if self._uses_worker():
            try:
                exported = job.run_metadata.export()
            except OSError as err:  # no room in the temporary directory for kineto's export
                count_dropped(self)
                self._warn_once("export", "Could not export traced step %d to %s (%s: is it full, or read-only?); "
                                "training goes on without its timeline. Set TMPDIR to a directory with room.",
                                job.step, tempfile.gettempdir(), err.strerror or err)
                return
            except Exception:  # a tracer bug costs this trace, never the training run
                self._warn_once("convert", "Collecting the traced step failed; it has no timeline.", exc_info=True)
                return
            if exported is not None:
                if self._rendering is not None:
                    # One step renders while the next is exported, no more: a schedule faster than the worker
                    # makes the next traced step wait here (the coordinator waits for this thread), rather than
                    # piling exports up in TMPDIR and memory.
                    self._rendering.wait()
                self._rendering = RENDERS.submit(lambda: self._finish(job, self._render_elsewhere(job, exported)))
                return
        stats = job.run_metadata.step_stats
        self._finish(job, None if stats is None else render_step(stats, self._writer, job.spec))
        if self.profiler is not None:
            try:
                self.profiler.add_step(job.step, job.run_metadata)
            except Exception:  # the Profiler's bug must not cost the timeline or the run
                self._warn_once("profiler", "Profiler.add_step(%d) failed.", job.step, exc_info=True)

    def _render_elsewhere(self, job: _Job, exported: Any) -> _Rendered | None:
        """On `RENDERS`: the step rendered by the render worker (here if none can start)."""
        try:
            return worker.WORKER.call(render_step, exported, self._writer, job.spec, timeout=RENDER_TIMEOUT_SECONDS)
        except worker.WorkerFailed as err:
            count_dropped(self)
            self._warn_once("worker", "Could not render timeline %s: %s. Training goes on without it.", job.path,
                            str(err).strip())
        except OSError as err:  # no process to be had
            self._warn_once("no worker", "The render worker could not start (%s); timelines are rendered in the "
                            "training process.", err.strerror or err)
            return render_step(exported, self._writer, job.spec)
        except Exception:  # a bug of ours (a step that does not pickle) must not end the training run
            count_dropped(self)
            self._warn_once("worker:bug", "Could not hand timeline %s to the render worker; training goes on "
                            "without it.", job.path, exc_info=True)
        return None

    def _finish(self, job: _Job, rendered: _Rendered | None) -> None:
        """Say what failed in rendering a step, and hand what was rendered to the disk's worker (`WRITES`)."""
        if rendered is None:
            return
        if rendered.convert_error is not None:
            self._warn_once("convert", "Collecting the traced step failed; it has no timeline.\n%s",
                            rendered.convert_error)
            return
        if rendered.render_error is not None:
            count_dropped(self)
            self._warn_once("render", "Could not render timeline %s; training goes on without it.\n%s", job.path,
                            rendered.render_error)
        if rendered.events_error == _NO_TENSORBOARD:
            self._warn_once("no tensorboard", "The tensorboard package is not installed: timelines are written "
                            "but not the step_N graphs; pip install tensorboard, or pass tensorboard=False.")
        elif rendered.events_error is not None:
            count_dropped(self)
            self._warn_once("tb:render", "Could not build step_%d for TensorBoard.\n%s", job.step,
                            rendered.events_error)
        trace, events = rendered.trace, rendered.events
        if trace is not None or events:
            self._writes.append(WRITES.submit(lambda: self._store(job, trace, events)))

    def _store(self, job: _Job, trace: Any, events: list[Any] | None) -> None:
        """On the disk's worker: put a rendered step on disk (the timeline atomically, then its events)."""
        if trace is not None:
            self._write_file(job.path, *trace)
        if events:
            try:
                for event in events:
                    if isinstance(event, SerializedEvent) and not isinstance(job.events, EventWriter):
                        event = event.proto()  # a sink passing events to someone else's writer
                    job.events.add_event(event)
            except Exception as err:  # TensorBoard output must not end the training run either
                count_dropped(self)
                reason = (err.strerror or str(err)) if isinstance(err, OSError) else type(err).__name__
                self._warn_once(f"tb:{reason}", "Could not write step_%d to TensorBoard in %s (%s); training goes "
                                "on without it.", job.step, self.output_dir, reason)

    def _write_file(self, path: str, data: Any, result: Any) -> None:
        log.info("Saving timeline into '%s'.", path)
        try:
            with atomic_write(path) as out:
                data.write_to(out)
        except OSError as err:  # a full disk must not end the training run
            count_dropped(self)
            reason = err.strerror or str(err)
            self._warn_once(reason, "Could not write timeline %s (%s); training goes on without it.", path, reason)
            return
        if result.truncated:
            self._warn_once("truncated", "Timeline %s was cut at max_events=%d events; raise max_events to keep "
                            "whole steps.", path, self.max_events)
        if path in self._saved_paths:  # written again (a second fit from step 0 into the same directory)
            self._saved_paths.remove(path)
        self._saved_paths.append(path)
        if self.keep_last is not None:
            self._retain(path)

    def _retain(self, path: str) -> None:
        """keep_last: remove this run's oldest timelines beyond the newest `keep_last` (on the background
        thread, after `path` is whole; the files removed were written by this hook, in this run)."""
        kept = self._kept
        if path not in kept:
            kept.append(path)
        while len(kept) > self.keep_last:
            old = kept.popleft()
            try:
                os.remove(old)
            except FileNotFoundError:
                pass  # removed by someone else: nothing to keep or count
            except OSError as err:
                self._warn_once(f"remove:{err.errno}", "Could not remove old timeline %s (%s); keep_last=%d goes "
                                "on with the newer ones.", old, err.strerror or err, self.keep_last)
                continue
            else:
                self.removed_timelines += 1
            if old in self._saved_paths:
                self._saved_paths.remove(old)

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
        if self._watching:
            STEP_TRACES.unwatch(self._window)
            self._watching = False


_NO_TENSORBOARD = "no tensorboard"


@dataclasses.dataclass
class _RenderSpec:
    """What rendering a traced step needs besides its stats and the writer (picklable, for the worker)."""

    step: int
    run_step: int | None  # the RunMetadata's step, for stats whose tracer left it unset
    metadata: dict[str, Any]
    distributed: dict[str, Any]
    capture: _Capture | None
    tag: str
    events: bool  # whether to build the TensorBoard step graph and run metadata


@dataclasses.dataclass
class _Rendered:
    """A traced step rendered: the timeline (bytes, result) and the TensorBoard events, or what failed (as
    text: a worker's exceptions do not cross the pipe)."""

    trace: tuple[Any, Any] | None = None
    events: list[Any] | None = None
    convert_error: str | None = None  # a traceback's text
    render_error: str | None = None
    events_error: str | None = None  # _NO_TENSORBOARD, or a traceback's text
    graph_seconds: float = 0.0  # building the step graph and run metadata (the benchmarks read it)


def render_step(source: Any, writer: ChromeTraceWriter, spec: _RenderSpec) -> _Rendered:
    """A traced step's timeline bytes and TensorBoard events, from its `StepStats` or from an export to convert
    (`to_stats()`). Runs in the render worker or on the background thread. The
    events come serialized (`SerializedEvent`: what an event file holds; they cross the worker's pipe so)."""
    rendered = _Rendered()
    stats = source
    if not isinstance(source, StepStats):
        try:
            stats = source.to_stats()
        except FileNotFoundError as err:  # something removed it from TMPDIR (a tmp cleaner) before its render
            rendered.convert_error = (f"its export {err.filename} was removed from the temporary directory before "
                                      "it was rendered (a tmp cleaner?); the next traced steps make it again")
            return rendered
        except Exception:  # a conversion bug costs this trace, never the training run
            rendered.convert_error = traceback.format_exc()
            return rendered
    if stats.step is None:
        stats.step = spec.run_step
    try:
        file_stats = _with_recent_steps(stats, spec.capture) if spec.capture is not None else stats
        rendered.trace = writer.render(file_stats, spec.metadata, spec.distributed)
    except Exception:  # a bug of ours must not end the training run
        rendered.render_error = traceback.format_exc()
    if spec.events:
        start = time.perf_counter()
        try:
            from hookprof.tensorboard import graph as tensorboard_graph

            events = tensorboard_graph.run_metadata_events(stats, spec.tag, spec.step)
        except ImportError:
            rendered.events_error = _NO_TENSORBOARD
        except Exception:  # a bug of ours must not end the training run
            rendered.events_error = traceback.format_exc()
        else:
            rendered.events = [SerializedEvent(e.SerializeToString()) for e in events]
        rendered.graph_seconds = time.perf_counter() - start
    return rendered


class _Job:
    """One traced step to write, with where it goes fixed on the training thread when the step ended (a next
    fit may change the hook's directory and event stream before the background thread gets to it)."""

    __slots__ = ("step", "run_metadata", "path", "events", "spec")

    def __init__(self, step: int, run_metadata: Any, session: Any, hook: ProfilerHook,
                 capture: _Capture | None) -> None:
        rank, world_size = getattr(session, "rank", 0), getattr(session, "world_size", 1)
        self.step = step
        self.run_metadata = run_metadata
        self.path = hook.timeline_path(step, rank, world_size)
        metadata = {"framework": getattr(session, "framework", "unknown"), fmt.RANK: rank, fmt.WORLD_SIZE: world_size}
        if hook._skipped_since_file:
            metadata[fmt.SKIPPED_TRACES], hook._skipped_since_file = hook._skipped_since_file, 0
        if capture is not None:
            metadata[fmt.TRIGGER] = capture.fires[0]
            if len(capture.fires) > 1:
                metadata[fmt.TRIGGERS_ALSO] = capture.fires[1:]
        distributed = {fmt.RANK: rank, fmt.WORLD_SIZE: world_size}
        backend = getattr(session, "distributed_backend", None)
        if backend:
            distributed["backend"] = backend
        self.events = hook._events if hook.tensorboard else None
        # ranks share the run directory: their tags must not collide
        tag = f"step_{step}" if world_size == 1 else f"step_{step}_rank{rank}"
        self.spec = _RenderSpec(step, run_metadata.step, metadata, distributed, capture, tag, self.events is not None)


class _Capture:
    """A trigger's fire being captured: what fired (kind, step, detail), the records of the firing step and
    the steps before it, and how many steps are still to trace."""

    __slots__ = ("fires", "recent", "left")

    def __init__(self, fires: list[dict[str, Any]], recent: list[StepRecord], steps: int) -> None:
        self.fires = fires
        self.recent = recent
        self.left = steps


RECENT_STEPS_THREAD_ID = 1  # the host pseudo-thread of a trigger's window (the step phases' is 0)


def _with_recent_steps(stats: StepStats, capture: _Capture) -> StepStats:
    """The stats to write for a triggered step: these, plus the phases of the firing step and those before
    it on the host's "Steps before the trigger" thread (in a copy: the Profiler and the step graph see the
    traced step alone)."""
    fired = {fire["step"]: fire["kind"] for fire in capture.fires}
    spans = []
    for record in capture.recent:
        label = f"step {record.step}" + (f" ({fired[record.step]})" if record.step in fired else "")
        layout = [(label, record.start, record.end or record.start)] + record.spans()
        for name, start, stop in layout:
            spans.append(NodeExecStats(node_name=f"recent/step_{record.step}/{name}", op=name, start_ns=start,
                                       duration_ns=max(0, stop - start), thread_id=RECENT_STEPS_THREAD_ID,
                                       category=fmt.CAT_RECENT_STEP))
    if not spans:
        return stats
    devices = list(stats.dev_stats)
    host = next((i for i, dev in enumerate(devices) if dev.device == HOST_DEVICE), None)
    old = devices[host] if host is not None else DeviceStepStats(HOST_DEVICE)
    new = DeviceStepStats(HOST_DEVICE, spans + old.node_stats,
                          {**old.thread_names, RECENT_STEPS_THREAD_ID: fmt.RECENT_STEPS_THREAD})
    if host is None:
        devices.append(new)
    else:
        devices[host] = new
    return dataclasses.replace(stats, dev_stats=devices)


class _TriggerFetch:
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


def _batch_index(state: Any) -> Any:
    """The step's batch index in its epoch (0: an epoch's first step, whose data loader may be starting)."""
    return state.batch_idx


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
