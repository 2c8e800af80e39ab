"""The capture pipeline: what becomes of a traced step once it ran (ProfilerHook hands it over here).

`CapturePipeline.submit` takes the step's `RunMetadata` and where its files go, and, off the training thread:
exports it (the background thread), renders it (`render_step`, in the render worker process where one can run,
else on the background thread), and writes the timeline, its TensorBoard events and its XSpace for TensorBoard's
Profile tab (the disk's thread). It bounds how many rendered steps wait for the disk (a step due past that is
skipped, counted), keeps only the newest timelines and profile runs (`Retention`, keep_last), counts what it
could not write and says each failure once.

Its tuning is a `CaptureOptions`, given to ProfilerHook as `capture=`; nothing here is process-wide state.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import logging
import os
import socket
import tempfile
import time
import traceback
import uuid
import warnings
from collections.abc import Callable
from typing import Any

from hookprof._runtime import arguments, distribution, worker
from hookprof._runtime.atomic_file import atomic_write
from hookprof._runtime.background import BACKGROUND, RENDERS, WRITES, BackgroundJob, count_dropped
from hookprof._runtime.by_fit import ByFit
from hookprof._runtime.fit_run import on_fit_end
from hookprof._runtime.warn_once import WarnOnce
from hookprof.hooks.trigger_watch import CaptureWindow
from hookprof.step_stats import DeviceStepStats, KeptParts, NodeExecStats, StepStats
from hookprof.tensorboard.events import SerializedEvent
from hookprof.trace import format as fmt
from hookprof.trace import xplane
from hookprof.trace.writer import ChromeTraceWriter
from hookprof.tracing import HOST_DEVICE
from hookprof.tracing.step_identity import DATAFLOW_MISSING

# ProfilerHook's logger: its messages ("Saving timeline ...") stay where users set ProfilerHook's level.
log = logging.getLogger("hookprof.hooks.profiler_hook")

# What the render worker imports while the first traced step is exported (`start_worker`): `render_step` (pickled by
# name, so its module), what it converts and renders with, and what its results are made of.
WORKER_MODULES = ("hookprof.hooks.capture", "hookprof.tracing.kineto_trace", "hookprof.tensorboard.graph",
                  "tensorboard.compat.proto.event_pb2", "orjson", "google.protobuf.descriptor_pool")
# The least a traced step waits for a place at the render worker (`RENDERS_IN_FLIGHT`) before it is dropped instead
# (`CapturePipeline.save`): a tiny step costs milliseconds, less than a loaded machine's scheduling delays.
RENDER_WAIT_FLOOR_SECONDS = 0.25
# The traced steps handed to the render worker and not yet rendered, at most: one rendering and one waiting. A
# second place lets a schedule that the worker keeps up with on average (every step, whose renders vary: a fit's
# first is a full conversion) go on without waiting for each render; more would only hold more exports in TMPDIR
# and memory where the worker cannot keep up.
RENDERS_IN_FLIGHT = 2


@dataclasses.dataclass(frozen=True)
class CaptureOptions:
    """How a ProfilerHook's traced steps are rendered and written (`ProfilerHook(capture=CaptureOptions(...))`).

    Args:
        render_worker: convert and render traced steps in the render worker process where one can run
            (`hookprof._runtime.worker`); False keeps that work on the training process's background thread.
        render_timeout_seconds: a step the render worker has not rendered in this long is dropped (one warning)
            and the worker stopped: a hung worker (a stalled TMPDIR, say) must not hold up the fit's end. At the
            worker's pace (tens of microseconds an event at most) 300 s leaves a wide margin for steps of
            millions of events.
        render_stall_seconds: a worker that uses no CPU for this long while it has a step (stopped with
            SIGSTOP, stuck on a stalled disk) is judged hung, off the training thread: it is killed, its step
            dropped (counted in `dropped_outputs`, one warning) and a new worker renders the next steps; one
            that hung while starting (its imports stuck) is not replaced: the steps are rendered in the
            training process, as where no worker can run. A slow worker (a loaded machine) still uses CPU
            and is never judged so: `render_timeout_seconds` bounds it. Where
            a process's CPU time cannot be read (not Linux) only `render_timeout_seconds` applies. The training
            thread never waits for the worker this long: a traced step whose turn comes while the worker still
            has `RENDERS_IN_FLIGHT` earlier ones to render waits at most its own cost
            (`RENDER_WAIT_FLOOR_SECONDS` at least), then is dropped (counted in `dropped_outputs`, one warning);
            a worker still starting is given this long before a step is dropped so.
        max_pending_writes: traced steps rendered and waiting for the disk, at most (each is held in memory
            until written), besides those still waiting for the render worker (`RENDERS_IN_FLIGHT`), which join
            them as they are rendered: past that a step due to be traced is not, and is counted
            (`skipped_traces`, and the next file's metadata `skipped_traces`).
        write_grace_seconds: how long a full queue is given to free a place first: a disk that keeps up does so
            within moments (the writer thread may only be waiting for the GIL), so only a slow disk ever costs a
            trace. 0: no grace.
        profile_tab: where the hook writes TensorBoard output (`tensorboard=True`), also write each traced step
            for TensorBoard's Profile tab (the xprof plugin), as `<output_dir>/plugins/profile/step_<N>/
            <host>.xplane.pb` (`hookprof.trace.xplane`); the same keep_last applies. False: not.
    """

    render_worker: bool = True
    render_timeout_seconds: float = 300.0
    render_stall_seconds: float = 10.0
    max_pending_writes: int = 2
    write_grace_seconds: float = 0.05
    profile_tab: bool = True
    # `render_stall_seconds`' name before: accepted with a DeprecationWarning, and not kept (not a field)
    render_wait_seconds: dataclasses.InitVar[float | None] = None

    def __post_init__(self, render_wait_seconds: float | None = None) -> None:
        owner = type(self).__name__
        if render_wait_seconds is not None:
            if self.render_stall_seconds != CaptureOptions.render_stall_seconds:
                raise TypeError(f"{owner}(): pass render_stall_seconds only (render_wait_seconds is its old name).")
            warnings.warn(f"{owner}(render_wait_seconds=...) is deprecated: it is now named render_stall_seconds "
                          f"({owner}(render_stall_seconds={render_wait_seconds!r})).", DeprecationWarning, stacklevel=3)
            object.__setattr__(self, "render_stall_seconds", render_wait_seconds)
        arguments.check_bool(owner, "render_worker", self.render_worker)
        arguments.check_seconds(owner, "render_timeout_seconds", self.render_timeout_seconds)
        arguments.check_seconds(owner, "render_stall_seconds", self.render_stall_seconds)
        arguments.check_positive_int(owner, "max_pending_writes", self.max_pending_writes)
        arguments.check_bool(owner, "profile_tab", self.profile_tab)
        grace = self.write_grace_seconds
        if isinstance(grace, bool) or grace != 0:  # (0 is allowed: no grace)
            arguments.check_seconds(owner, "write_grace_seconds", grace)


class Retention:
    """keep_last: the newest `keep_last` timelines of a run are kept, older ones removed (`removed` counts them).
    None keeps all. Only files handed to `retain` (written by its hook, in this run) are ever removed, by `remove`
    (`os.remove`; for profile runs, `remove_profile_run`)."""

    def __init__(self, keep_last: int | None, warn_once: WarnOnce | None = None,
                 remove: Any = os.remove) -> None:
        self.keep_last = keep_last
        self.removed = 0
        self._kept: collections.deque[str] = collections.deque()  # this run's timelines, oldest first
        self._warn_once = warn_once or WarnOnce(log)
        self._remove = remove

    def reset(self) -> None:
        """A new run: the files of the last one are no longer this one's to remove."""
        self._kept.clear()

    def retain(self, path: str) -> list[str]:
        """`path` was written (whole): remove the run's oldest timelines beyond the newest `keep_last`; return the
        paths removed (or gone already)."""
        if self.keep_last is None:
            return []
        kept, gone = self._kept, []
        if path not in kept:
            kept.append(path)
        while len(kept) > self.keep_last:
            old = kept.popleft()
            try:
                self._remove(old)
            except FileNotFoundError:
                pass  # removed by someone else: nothing to keep or count
            except OSError as err:
                self._warn_once(f"remove:{err.errno}", "Could not remove old timeline %s (%s); keep_last=%d goes "
                                "on with the newer ones.", old, err.strerror or err, self.keep_last)
                continue
            else:
                self.removed += 1
            gone.append(old)
        return gone


def remove_profile_run(path: str) -> None:
    """Remove an `.xplane.pb` hookprof wrote, and what xprof cached from its run (`*.op_stats*.pb`, ...: every
    other file of the run directory but other hosts' `.xplane.pb`); the directory goes too once empty. The
    step's run of the tracer's own XSpace (`native_profile_path`), where there is one, goes with it."""
    os.remove(path)
    _remove_caches(os.path.dirname(path))
    native = native_profile_path(path)
    with contextlib.suppress(FileNotFoundError):
        os.remove(native)
        _remove_caches(os.path.dirname(native))


def _remove_caches(run: str) -> None:
    """What xprof cached in a run directory (every file but the hosts' `.xplane.pb`), and the directory once
    empty."""
    with contextlib.suppress(OSError):  # (a cache another reader removes or holds open: it is only a cache)
        for entry in os.scandir(run):
            if entry.is_file(follow_symlinks=False) and not entry.name.endswith(xplane.XPLANE_SUFFIX):
                os.remove(entry.path)
        os.rmdir(run)


NATIVE_RUN_SUFFIX = "_jax"  # the run of JAX's own XSpace of a traced step, beside hookprof's


def native_profile_path(path: str) -> str:
    """Where the tracer's own XSpace of the step whose Profile-tab file is `path` goes: JAX's profiler hands
    its session's XSpace back, and xprof reads it as Keras' `TensorBoard(profile_batch=)` writes it (XLA's ops,
    HLO, its own step view): `.../step_<N>_jax/<host>.xplane.pb`, a run beside hookprof's `step_<N>`."""
    run, name = os.path.split(path)
    return os.path.join(run + NATIVE_RUN_SUFFIX, name)


def profile_run_path(logdir: str, step: int, host: str) -> str:
    """Where a traced step goes for TensorBoard's Profile tab: `<logdir>/plugins/profile/step_<N>/<host>.xplane.pb`
    (runs sort by step), or, where that file exists already (a second fit from the same step into the same
    directory), `step_<N>.1`, `.2`, ...: xprof caches what it read beside each file, so none is ever rewritten."""
    run = os.path.join(logdir, "plugins", "profile", f"step_{step:010d}")
    name = host + xplane.XPLANE_SUFFIX
    return _first_free(lambda again: os.path.join(f"{run}.{again}" if again else run, name), 0)


def _free_name(path: str) -> str:
    """`timeline-8.json` -> the first of `timeline-8.1.json`, `timeline-8.2.json`, ... that does not exist."""
    directory, name = os.path.split(path)
    stem, dot, extension = name.partition(".")
    return _first_free(lambda again: os.path.join(directory, f"{stem}.{again}{dot}{extension}"), 1)


def _first_free(path_of: Callable[[int], str], again: int) -> str:
    """The first of `path_of(again)`, `path_of(again + 1)`, ... that does not exist (links included)."""
    while os.path.lexists(path := path_of(again)):
        again += 1
    return path


NO_TENSORBOARD = "no tensorboard"
NO_PROTOBUF = "no protobuf"


@dataclasses.dataclass
class RenderSpec:
    """What rendering a traced step needs besides its stats and the writer (picklable, for the worker)."""

    step: int
    run_step: int | None  # the RunMetadata's step, for stats whose tracer left it unset
    metadata: dict[str, Any]
    distributed: dict[str, Any]
    capture: CaptureWindow | None  # the trigger's fire this step was traced for
    tag: str
    events: bool  # whether to build the TensorBoard step graph and run metadata
    profile_host: str | None = None  # the host name of the step's XSpace for the Profile tab; None: none
    # the token of the run whose renders keep what they repeat (`KEPT_PARTS`); None: none
    fit: str | None = None


@dataclasses.dataclass
class Rendered:
    """A traced step rendered: the timeline (bytes, result) and the TensorBoard events, or what failed (as
    text: a worker's exceptions do not cross the pipe)."""

    trace: tuple[Any, Any] | None = None
    events: list[Any] | None = None
    convert_error: str | None = None  # a traceback's text
    render_error: str | None = None
    events_error: str | None = None  # NO_TENSORBOARD, or a traceback's text
    graph_seconds: float = 0.0  # building the step graph and run metadata (the benchmarks read it)
    graph_digest: bytes | None = None  # of the step's GraphDef (`events[0]`): a run gets a graph when it changes
    xspace: bytes | None = None  # the step for TensorBoard's Profile tab (a serialized XSpace)
    xspace_error: str | None = None  # NO_PROTOBUF, or a traceback's text
    xspace_seconds: float = 0.0  # building it (the benchmarks read it)
    native_xspace: bytes | None = None  # the tracer's own XSpace of the step (JAX's), written as it came
    dataflow_missing: str | None = None  # why the step has no arrows (`hookprof.tracing.step_identity`)


def render_step(source: Any, writer: ChromeTraceWriter, spec: RenderSpec) -> Rendered:
    """A traced step's timeline bytes and TensorBoard events, from its `StepStats` or from an export to convert
    (`to_stats()`). Runs in the render worker or on the background thread. The
    events come serialized (`SerializedEvent`: what an event file holds; they cross the worker's pipe so)."""
    rendered = Rendered()
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
    rendered.dataflow_missing = stats.metadata.get(DATAFLOW_MISSING)
    # what the outputs hold besides the step's times: a step of the last one's shape reuses its parts
    kept = None if spec.fit is None else KEPT_PARTS.setdefault(spec.fit, KeptParts)
    try:
        shape = None if kept is None else kept.shape(stats)
    except Exception:  # a bug of ours costs the reuse, not the step's outputs
        log.debug("The step's shape could not be taken; its outputs are rendered whole", exc_info=True)
        shape = kept = None
    try:
        file_stats = stats if spec.capture is None else with_recent_steps(stats, spec.capture)
        # (a triggered step's file holds its window's earlier steps, named by their numbers: no two are alike)
        rendered.trace = writer.render(file_stats, spec.metadata, spec.distributed,
                                       shape if file_stats is stats else None)
    except Exception:  # a bug of ours must not end the training run
        rendered.render_error = traceback.format_exc()
    if spec.events:
        start = time.perf_counter()
        try:
            from hookprof.tensorboard import graph as tensorboard_graph

            names = None
            if kept is not None:  # (the step graph's names the fit's steps repeat)
                if kept.graph_names is None:
                    kept.graph_names = tensorboard_graph.GraphNames()
                names = kept.graph_names
            events = tensorboard_graph.run_metadata_events(stats, spec.tag, spec.step, names, shape)
        except ImportError:
            rendered.events_error = NO_TENSORBOARD
        except Exception:  # a bug of ours must not end the training run
            rendered.events_error = traceback.format_exc()
        else:
            rendered.events = [SerializedEvent(e.SerializeToString()) for e in events]
            rendered.graph_digest = hashlib.blake2b(events[0].graph_def, digest_size=16).digest()
        rendered.graph_seconds = time.perf_counter() - start
    native, stats.native_xspace = stats.native_xspace, None  # (its bytes go no further than this)
    if spec.profile_host is not None:
        rendered.native_xspace = native
        start = time.perf_counter()
        try:
            rendered.xspace = xplane.step_xspace(stats, spec.profile_host, shape)
        except ImportError:
            rendered.xspace_error = NO_PROTOBUF
        except Exception:  # a bug of ours must not end the training run
            rendered.xspace_error = traceback.format_exc()
        rendered.xspace_seconds = time.perf_counter() - start
    return rendered


# Where this process renders steps (the render worker, or the training process without one), what its renders
# keep of each run for the run's next steps, until its fit ends (see `begin`): each renderer's parts of the run's
# last step (a step of its shape reuses them) and the step graph's names
KEPT_PARTS: ByFit[KeptParts] = ByFit("kept parts")

RECENT_STEPS_THREAD_ID = 1  # the host pseudo-thread of a trigger's window (the step phases' is 0)


def with_recent_steps(stats: StepStats, capture: CaptureWindow) -> StepStats:
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


class Job:
    """One traced step to write, with where it goes fixed on the training thread when the step ended (a next
    fit may change the hook's directory and event stream before the background thread gets to it)."""

    __slots__ = ("step", "rank", "run_metadata", "path", "output_dir", "events", "spec", "ticket")

    def __init__(self, step: int, run_metadata: Any, session: Any, path: str, output_dir: str | None, events: Any,
                 capture: CaptureWindow | None, skipped: int = 0, profile_tab: bool = False,
                 fit: str | None = None) -> None:
        rank, world_size = getattr(session, "rank", 0), getattr(session, "world_size", 1)
        self.step, self.rank = step, rank
        self.run_metadata = run_metadata
        self.path = path
        self.output_dir = output_dir
        metadata = {"framework": getattr(session, "framework", "unknown"), fmt.RANK: rank, fmt.WORLD_SIZE: world_size}
        if skipped:
            metadata[fmt.SKIPPED_TRACES] = skipped
        if capture is not None:
            metadata[fmt.TRIGGER] = capture.fires[0]
            if len(capture.fires) > 1:
                metadata[fmt.TRIGGERS_ALSO] = capture.fires[1:]
        distributed = {fmt.RANK: rank, fmt.WORLD_SIZE: world_size}
        backend = getattr(session, "distributed_backend", None)
        if backend:
            distributed["backend"] = backend
        self.events = events
        # ranks share the run directory: their tags must not collide
        tag = f"step_{step}" if world_size == 1 else f"step_{step}_rank{rank}"
        # ranks are hosts of one profile run (xprof's multi-host view): their file names must not collide
        host = socket.gethostname() if world_size == 1 else f"{socket.gethostname()}_rank{rank}"
        profile_host = host if profile_tab and events is not None and output_dir is not None else None
        self.spec = RenderSpec(step, run_metadata.step, metadata, distributed, capture, tag, events is not None,
                               profile_host, fit)
        self.ticket: Any = None  # its request to the render worker, once sent (`CapturePipeline.post`)


class CapturePipeline:
    """A traced step's way to disk: export (background thread) -> render (the render worker, or the background
    thread with a Profiler or where no worker can run) -> write (the disk's thread), one hook's steps in order.

    `saved_paths` lists the timelines written and kept; `skipped_traces` the steps not traced because
    `max_pending_writes` files waited for the disk; failures to write are counted in `counts.dropped_outputs`
    (the hook's, by default this pipeline's own) and each is said once. `save`, `render_elsewhere` and `finish`
    are the stages (a subclass may time them: the benchmarks do).
    """

    def __init__(self, writer: ChromeTraceWriter, options: CaptureOptions | None = None, profiler: Any = None,
                 keep_last: int | None = None, warn_once: WarnOnce | None = None, counts: Any = None) -> None:
        self.writer = writer
        self.options = options if options is not None else CaptureOptions()
        self.profiler = profiler
        self._warn_once = warn_once or WarnOnce(log)
        self.retention = Retention(keep_last, self._warn_once)
        self.profile_retention = Retention(keep_last, self._warn_once, remove_profile_run)  # the Profile tab's runs
        self.dropped_outputs = 0
        self._counts = self if counts is None else counts  # whose `dropped_outputs` counts the failures
        self._saved_paths: list[str] = []
        self._pending: BackgroundJob | None = None  # the background job of the last traced step
        # the jobs waiting for the render worker (`RENDERS`, in order), RENDERS_IN_FLIGHT at most
        self._renders: collections.deque[BackgroundJob] = collections.deque()
        self._run_paths: set[str] = set()  # the timelines this run wrote (another fit's are never overwritten)
        self._writes: collections.deque[BackgroundJob] = collections.deque()  # on the disk's worker, in order
        self._fit: str | None = None  # the run's token (see `begin`)
        self.skipped_traces = 0  # steps due to be traced while max_pending_writes files waited for the disk
        self.skipped_since_file = 0  # of those, the ones no file's metadata has reported yet

    # --- on the training thread -----------------------------------------------------------------------------

    def uses_worker(self) -> bool:
        return self.options.render_worker and worker.AVAILABLE and self.profiler is None

    def start_worker(self) -> None:
        """Start the render worker's interpreter (where it will be used), importing what it renders with while the
        caller goes on. Called at a fit's first step where its step schedule traces before the fit's planned end
        (`ProfilerHook`), else with the first traced step (`submit`); never for a fit planned to trace nothing (its
        interpreter and imports, about 0.35 s of CPU, made a 1000-step fit of a tiny model 1.65x slower on 2
        shared cores, against 1.05x without it)."""
        if self.uses_worker():
            with contextlib.suppress(OSError):  # (none to be had: the first traced step says so)
                worker.WORKER.start(WORKER_MODULES)

    def begin(self) -> None:
        """A new run (the last one's files are flushed first by the hook)."""
        self.retention.reset()
        self._run_paths.clear()
        self.profile_retention.reset()
        # what this run's renders keep from one step to the next, where they run (`KEPT_PARTS`): the fit's, gone
        # when it ends (outside a fit, nothing is kept)
        token = uuid.uuid4().hex
        self._fit = token if on_fit_end(("kept parts", token), KEPT_PARTS.release, token) else None

    def room_to_write(self) -> bool:
        """Whether fewer than max_pending_writes of this pipeline's rendered steps wait for the disk, after giving
        a full queue write_grace_seconds."""
        writes, limit = self._writes, self.options.max_pending_writes

        def pending() -> int:
            while writes and writes[0].done:
                writes.popleft()
            return len(writes)  # (steps being rendered are the CPU's backlog: the next trace waits, see save)

        if pending() < limit:
            return True
        if writes:
            writes[0].wait(self.options.write_grace_seconds)
        return pending() < limit

    def skip(self, step: int, output_dir: str | None) -> None:
        """Step `step` was due but not traced (no room to write): count it, say so once."""
        self.skipped_traces += 1
        self.skipped_since_file += 1
        self._warn_once("skipped", "Timelines are traced faster than the disk takes them: %d files wait to be "
                        "written into %s, so step %d was not traced. Skipped steps are counted in "
                        "`skipped_traces` and in the next file's metadata; trace less often to keep them.",
                        self.options.max_pending_writes, output_dir, step)

    def submit(self, step: int, run_metadata: Any, session: Any, path: str, output_dir: str | None, events: Any,
               capture: CaptureWindow | None = None) -> BackgroundJob:
        """Hand a traced step over: its timeline goes to `path`, its TensorBoard events to `events` (the log
        directory's `SharedStream`; None for none). Converting the step's events and writing them costs as much
        as torch's profiler stop: it runs on the background thread while training goes on (see
        hookprof._runtime.background)."""
        skipped, self.skipped_since_file = self.skipped_since_file, 0
        job = Job(step, run_metadata, session, path, output_dir, events, capture, skipped, self.options.profile_tab,
                  self._fit)
        self.start_worker()  # (its imports run while the background thread has kineto export the step)
        self._pending = BACKGROUND.submit(lambda: self.save(job))
        if self.profiler is not None:
            self.profiler.wait_for(self._pending)  # its reports include this step
        return self._pending

    @property
    def saved_paths(self) -> list[str]:
        """The timelines written so far and still kept, oldest first (waits for one still being written)."""
        self.flush()
        return list(self._saved_paths)

    def flush(self) -> None:
        """Wait until every step handed over so far is on disk (files, TensorBoard, the Profiler)."""
        if self._pending is not None:
            self._pending.wait()  # the jobs run in order: the last one done, all are
        try:  # (one read: the background thread trims the queue, and may empty it, as this thread reads it)
            last = self._renders[-1]
        except IndexError:
            last = None
        if last is not None:
            last.wait()  # and so do the render worker's, in order (a hung one is killed on its own thread)
        if self._writes:
            self._writes[-1].wait()  # and so do the disk's
            self._writes.clear()

    # --- the stages, off the training thread ----------------------------------------------------------------

    def save(self, job: Job) -> None:
        """On the background thread: hand the traced step to the render worker as kineto's export
        (`hookprof._runtime.worker`, called from `RENDERS`), or, with a Profiler (which wants the stats here),
        where no worker can run, or when someone converted the step already, convert and render it here and
        add it to the Profiler."""
        if self.uses_worker():
            started = time.monotonic()
            try:
                exported = job.run_metadata.export()
            except OSError as err:  # no room in the temporary directory for kineto's export
                count_dropped(self._counts)
                self._warn_once("export", "Could not export traced step %d to %s (%s: is it full, or read-only?); "
                                "training goes on without its timeline. Set TMPDIR to a directory with room.",
                                job.step, tempfile.gettempdir(), err.strerror or err)
                return
            except Exception:  # a tracer bug costs this trace, never the training run
                self._warn_once("convert", "Collecting the traced step failed; it has no timeline.", exc_info=True)
                return
            if exported is not None:
                # RENDERS_IN_FLIGHT steps wait for the worker, no more (exports must not pile up in TMPDIR and
                # memory); the next traced step waits for this thread, so this one waits for a place no longer
                # than the step itself cost (its trace and its export), then is dropped.
                cost = time.monotonic() - started + getattr(exported, "step_seconds", 0.0)
                budget = max(RENDER_WAIT_FLOOR_SECONDS, cost)
                if not self._render_turn(budget):
                    count_dropped(self._counts)
                    self._warn_once("busy", "The render worker was still rendering the previous traced steps when "
                                    "step %d was ready: rather than hold training up longer than the step cost "
                                    "(waited %.2f s), step %d has no timeline (counted in dropped_outputs). Trace "
                                    "less often to keep every traced step.", job.step, budget, job.step)
                    return
                job.ticket = self.post(job, exported)
                self._renders.append(RENDERS.submit(lambda: self.finish(job, self.render_elsewhere(job, exported))))
                return
        stats = job.run_metadata.step_stats
        self.finish(job, None if stats is None else render_step(stats, self.writer, job.spec))
        if self.profiler is not None:
            try:
                self.profiler.add_step(job.step, job.run_metadata, rank=job.rank)
            except Exception:  # the Profiler's bug must not cost the timeline or the run
                self._warn_once("profiler", "Profiler.add_step(%d) failed.", job.step, exc_info=True)

    def _render_turn(self, budget: float) -> bool:
        """Whether fewer than RENDERS_IN_FLIGHT steps wait for the render worker, after waiting `budget` seconds at
        most for the oldest (`render_stall_seconds` while the worker has not answered yet: it is starting). A hung
        worker is judged and killed on `RENDERS`, not here (`hookprof._runtime.worker`)."""
        renders = self._renders
        while renders and renders[0].done:
            renders.popleft()
        if len(renders) < RENDERS_IN_FLIGHT:
            return True
        renders[0].wait(self.options.render_stall_seconds if worker.WORKER.starting else budget)
        while renders and renders[0].done:
            renders.popleft()
        return len(renders) < RENDERS_IN_FLIGHT

    def post(self, job: Job, exported: Any) -> Any:
        """On the background thread: send the exported step to the render worker now (where its request fits in
        the worker's pipe at once; else `RENDERS` sends it), so that it starts on it as soon as it has rendered
        the steps before it, without waiting for `RENDERS` to read their replies (which waits for the GIL: see
        `hookprof._runtime.worker`). Never waits. None where it could not be sent: `render_elsewhere` tries
        again and says why."""
        try:
            return worker.WORKER.post(render_step, exported, self.writer, job.spec)
        except Exception:
            return None

    def render_elsewhere(self, job: Job, exported: Any) -> Rendered | None:
        """On `RENDERS`: the step rendered by the render worker (here if none can start), its request sent already
        where it could be (`post`)."""
        options, ticket = self.options, job.ticket
        try:
            if ticket is None:
                rendered = worker.WORKER.call(render_step, exported, self.writer, job.spec,
                                              timeout=options.render_timeout_seconds,
                                              stall=options.render_stall_seconds)
            else:
                job.ticket = None  # (its reply goes with the take: the job waits for the disk, and holds no copy)
                rendered = worker.WORKER.take(ticket, timeout=options.render_timeout_seconds,
                                              stall=options.render_stall_seconds)
            # (the worker's copy of the step could not tell the tracer its identities did not fit: told here)
            report = getattr(exported, "report_mismatch", None)
            if rendered.dataflow_missing is not None and report is not None:
                report(rendered.dataflow_missing)
            return rendered
        except worker.WorkerFailed as err:
            count_dropped(self._counts)
            self._warn_once("worker", "Could not render timeline %s: %s. Training goes on without it.", job.path,
                            str(err).strip())
        except OSError as err:  # no process to be had
            self._warn_once("no worker", "The render worker could not start (%s); timelines are rendered in the "
                            "training process.", err.strerror or err)
            return render_step(exported, self.writer, job.spec)
        except Exception:  # a bug of ours (a step that does not pickle) must not end the training run
            count_dropped(self._counts)
            self._warn_once("worker:bug", "Could not hand timeline %s to the render worker; training goes on "
                            "without it.", job.path, exc_info=True)
        return None

    def finish(self, job: Job, rendered: Rendered | None) -> None:
        """Say what failed in rendering a step, and hand what was rendered to the disk's worker (`WRITES`)."""
        if rendered is None:
            return
        if rendered.convert_error is not None:
            self._warn_once("convert", "Collecting the traced step failed; it has no timeline.\n%s",
                            rendered.convert_error)
            return
        if rendered.render_error is not None:
            count_dropped(self._counts)
            self._warn_once("render", "Could not render timeline %s; training goes on without it.\n%s", job.path,
                            rendered.render_error)
        self._said_missing(rendered.events_error, NO_TENSORBOARD, "tb:render", "step_%d for TensorBoard", job.step,
                           "The tensorboard package is not installed: timelines are written but not the step_N "
                           f"graphs; {distribution.install_hint('tensorboard')}, or pass tensorboard=False.")
        self._said_missing(rendered.xspace_error, NO_PROTOBUF, "xplane:render", "step %d for TensorBoard's Profile "
                           "tab", job.step, "The protobuf package is not installed: traced steps are not written "
                           "for TensorBoard's Profile tab; pip install 'hookprof[xprof]' (its viewer, with "
                           "protobuf), or pass capture=CaptureOptions(profile_tab=False).")
        if rendered.trace is not None or rendered.events or rendered.xspace is not None:
            self._writes.append(WRITES.submit(lambda: self.store(job, rendered)))

    def _said_missing(self, error: str | None, missing: str, key: str, what: str, step: int, install: str) -> None:
        """One output of a rendered step failed: `missing` (its package is not installed) is said once as
        `install`; any other error is counted and said once."""
        if error == missing:
            self._warn_once(f"{key}:missing", install)
        elif error is not None:
            count_dropped(self._counts)
            self._warn_once(key, f"Could not build {what}.\n%s", step, error)

    def store(self, job: Job, rendered: Rendered) -> None:
        """On the disk's worker: put a rendered step on disk (the timeline atomically, its events, then its
        XSpace for the Profile tab, and the tracer's own beside it, atomically). The step's graph goes to its
        event stream only when it differs from the last one written there: TensorBoard keeps one graph a run
        (the newest, with a warning for each other), which each step's run metadata colours, as TF1's
        `add_graph` once and `add_run_metadata` each step did."""
        if rendered.trace is not None:
            self._write_file(job.path, *rendered.trace)
        xspace = rendered.xspace
        if xspace is not None and job.output_dir is not None and job.spec.profile_host is not None:
            self._write_xspace(profile_run_path(job.output_dir, job.step, job.spec.profile_host), xspace,
                               rendered.native_xspace)
        events, stream = rendered.events, job.events
        if events:
            digest = rendered.graph_digest
            if digest is not None and digest == stream.graph_digest:  # (the stream's, which hooks share)
                events = events[1:]
            try:
                for event in events:
                    stream.add_event(event)
                stream.graph_digest = digest
            except Exception as err:  # TensorBoard output must not end the training run either
                count_dropped(self._counts)
                reason = (err.strerror or str(err)) if isinstance(err, OSError) else type(err).__name__
                self._warn_once(f"tb:{reason}", "Could not write step_%d to TensorBoard in %s (%s); training goes "
                                "on without it.", job.step, job.output_dir, reason)

    def _write_xspace(self, path: str, data: bytes, native: bytes | None) -> None:
        try:
            for file, content in ((path, data), (native_profile_path(path), native)):
                if content is None or (file != path and os.path.lexists(file)):
                    continue  # (never rewritten: xprof caches what it read beside it)
                os.makedirs(os.path.dirname(file), exist_ok=True)
                with atomic_write(file) as out:
                    out.write(content)
        except OSError as err:  # a full disk must not end the training run
            count_dropped(self._counts)
            reason = err.strerror or str(err)
            self._warn_once(f"xplane:{reason}", "Could not write %s for TensorBoard's Profile tab (%s); training "
                            "goes on without it.", path, reason)
            return
        self.profile_retention.retain(path)

    def _write_file(self, path: str, data: Any, result: Any) -> None:
        if path not in self._run_paths and os.path.lexists(path):
            # another fit's (a second model into the same directory, an earlier run of the script): kept
            taken, path = path, _free_name(path)
            self._warn_once("exists", "Timeline %s exists (another fit wrote it): this fit's go beside it, as %s "
                            "and the like. Give each fit its own output_dir to keep the plain names.", taken, path)
        self._run_paths.add(path)
        log.info("Saving timeline into '%s'.", path)
        try:
            with atomic_write(path) as out:
                data.write_to(out)
        except OSError as err:  # a full disk must not end the training run
            count_dropped(self._counts)
            reason = err.strerror or str(err)
            self._warn_once(reason, "Could not write timeline %s (%s); training goes on without it.", path, reason)
            return
        if result.truncated:
            self._warn_once("truncated", "Timeline %s was cut at max_events=%d events; raise max_events to keep "
                            "whole steps.", path, self.writer.max_events)
        self._saved_paths.append(path)
        for old in self.retention.retain(path):  # (keep_last, after `path` is whole)
            if old in self._saved_paths:
                self._saved_paths.remove(old)
