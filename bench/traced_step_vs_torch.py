"""Every step traced in a real Lightning fit: this project's ProfilerHook against a callback running
`torch.profiler.profile(record_shapes=True)` around each traced step and `export_chrome_trace` after it (the
peer, the cheapest way a torch user gets the same timeline), at each content level of ours (issue 19).

Both trace the same steps: every step but the first (`save_steps=1`; the first step only starts the count),
or every 10th (`save_steps=10`: 49-step fits, steps 10, 20, 30 and 40 traced, nine untraced steps after
each while the render worker works; the fit's end waits for the last one). With dataflow or memory, a fit's
first traced step walks torch's event tree and the later ones borrow its tensor identities
(`hookprof.tracing.step_identity`): of the every-step fits' 9 traced steps at 20k events, 8 borrow; of the
every-10th fits' 4, 3. Each figure is a fit's extra
time over the same fit untraced, per traced step (a fit returns only once ProfilerHook's files are on
disk). Content levels (the peer records shapes always, and memory for the last level):
- ops: `show_dataflow=False, tensorboard=False`;
- ops + graph: `show_dataflow=False` (the TensorBoard `step_N` graph and run metadata on);
- defaults: dataflow arrows and the TensorBoard step graph;
- dataflow + memory: `show_memory=True, tensorboard=False` (the peer: `profile_memory=True`);
- the defaults as they were before borrowed identities: every traced step walks its own event tree.
Also timed, inside the same every-step fits: the training thread's wait for a traced step (our callback's
batch end, where torch's profiler stops and the step is handed to the background thread, which has kineto
export it and hands it to the render worker) against the peer's
`prof.__exit__` (torch's profiler stop alone); our callback's batch start (it starts the profiler, after
the previous traced step's background work is done); and the share of our traced step's own cost (the batch
end plus the background job: conversion, timeline, TensorBoard events) spent building the step graph and run
metadata (`hookprof.tensorboard.graph.run_metadata_events`).

At about 20k events, also every step traced in 40-step fits (`LONG_STEPS`), ops and the defaults against the
peer, 3 rounds: a fit's own costs (the render worker's start, its first renders, which convert whole, and the
wait for the last render at its end) spread over 39 traced steps rather than 9.
Also the idle cost: the every-10th fit's length with a `ProfilerHook` that traces nothing, against the same fit
without it (whole fit times, in fits of their own that alternate, after the traced fits).
Also the extra CPU time per traced step, of the training process and the render worker together
(`time.process_time`, the reaped children's `getrusage`, and a running worker's `/proc/<pid>/stat`; the
peer has no worker): on a machine whose
other load keeps the worker off a core, wall time charges ours with the worker's waits as well as its work.

MLPs of 40, 400 and 6400 `Linear(64, 64)` layers: about 2k, 20k and 300k events in a traced step (as
torch's export counts them). Medians over rounds that each run every kind once, in an order rotated from
round to round: 5 rounds of 12-step fits at 2k, 5 of 10-step fits at 20k, and at 300k one round of 2-step
fits (one traced step) and no every-10th fits. `HOOKPROF_BENCH_FAST=1`: the two smaller sizes, one round
(under a minute), for a smoke run; `HOOKPROF_BENCH_LAYERS=400`: that size alone. The full run takes about 10
minutes on 2 cores. The wall-time ratios come with the lowest and highest of the rounds' own (each round's
fits against the untraced fit of that round): on a shared VM one round's ratio may stray far from the
medians'. The load average is printed with the table: on a shared machine, read the ratios, which compare
fits of the same rounds.
Numbers on a shared machine drift between fits: read the ratios, which compare fits of the same rounds.
torch runs one intra-op thread: on 2 cores shared with other processes, two threads made a 37 ms step take
0.5 s at random (each op's threads wait at a barrier for a thread the other process holds off its core).
The table goes to stdout; kineto logs each profiler start and stop on stderr.
"""

import logging
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from hookprof._runtime import worker
from hookprof.hooks.capture import CapturePipeline
from hookprof.hooks.profiler_hook import ProfilerHook
from hookprof.tracing.torch_tracer import _Identities
from lightning_prof import HookCallback

GIVE_UP = _Identities.GIVE_UP
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from traced_fit_cost import MLP  # noqa: E402  (the same model of Linear(64, 64) layers)

FAST = os.environ.get("HOOKPROF_BENCH_FAST") == "1"
# the defaults as before issue 33: every traced step walks its own event tree (none borrows an earlier one's)
WALKING = "defaults, every step walking its tree"
# (layers, steps of an every-step fit, of an every-10th fit (0: none), rounds): about 2k, 20k and 300k events
SIZES = ((40, 12, 49, 1), (400, 10, 49, 1)) if FAST else ((40, 12, 49, 5), (400, 10, 49, 5), (6400, 2, 0, 1))
if os.environ.get("HOOKPROF_BENCH_LAYERS"):
    SIZES = tuple(size for size in SIZES if size[0] == int(os.environ["HOOKPROF_BENCH_LAYERS"]))
LONG_STEPS = 40  # the every-step fits of `long_fits` (at about 20k events)
CONTENTS = {  # label: (ProfilerHook arguments, the peer records memory)
    "ops": ({"show_dataflow": False, "tensorboard": False}, False),
    "ops + graph": ({"show_dataflow": False}, False),
    "defaults (dataflow + graph)": ({}, False),
    "dataflow + memory": ({"show_memory": True, "tensorboard": False}, True),
    WALKING: ({}, False),
}


def traced(global_step: int, every: int) -> bool:
    """Whether the step starting at `global_step` is traced: ProfilerHook's schedule (the first step only
    starts the count; then the step that reaches a multiple of `every`)."""
    return global_step >= 1 and (global_step + 1) % every == 0


class TorchProfilerPeer(L.Callback):
    """`torch.profiler.profile(record_shapes=True)` around each traced step, `export_chrome_trace` after it."""

    def __init__(self, every: int, out: str, memory: bool):
        self.every, self.out, self.memory = every, out, memory
        self.prof = None
        self.stops: list[float] = []  # prof.__exit__: torch's profiler stop
        self.traces = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if traced(trainer.global_step, self.every):
            self.prof = torch.profiler.profile(record_shapes=True, profile_memory=self.memory)
            self.prof.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.prof is None:
            return
        start = time.perf_counter()
        self.prof.__exit__(None, None, None)
        self.stops.append(time.perf_counter() - start)
        self.prof.export_chrome_trace(os.path.join(self.out, f"trace-{trainer.global_step}.json"))
        self.prof = None
        self.traces += 1


class TimedPipeline(CapturePipeline):
    """The capture pipeline, timing its background work per traced step (the export on the background thread
    and the wait for the render worker) and the step graph inside it (timed where it is built:
    `Rendered.graph_seconds`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.by_step: dict[int, float] = {}
        self.graphs: list[float] = []

    def save(self, job):
        start = time.perf_counter()
        super().save(job)
        self.by_step[job.step] = self.by_step.get(job.step, 0.0) + time.perf_counter() - start

    def render_elsewhere(self, job, exported):
        start = time.perf_counter()
        rendered = super().render_elsewhere(job, exported)
        self.by_step[job.step] = self.by_step.get(job.step, 0.0) + time.perf_counter() - start
        return rendered

    def finish(self, job, rendered):
        if rendered is not None and rendered.events is not None:
            self.graphs.append(rendered.graph_seconds)
        super().finish(job, rendered)


class TimedProfilerHook(ProfilerHook):
    """ProfilerHook whose pipeline times its background work per traced step (`jobs`) and the step graphs
    (`graphs`)."""

    pipeline_class = TimedPipeline

    @property
    def jobs(self) -> list[float]:
        self.flush()
        return list(self.pipeline.by_step.values())

    @property
    def graphs(self) -> list[float]:
        return self.pipeline.graphs


class TimedCallback(HookCallback):
    """lightning_prof's callback around one TimedProfilerHook, timing its batch start and end on traced steps."""

    def __init__(self, hook: TimedProfilerHook):
        super().__init__([hook])
        self.hook = hook
        self.starts: list[float] = []
        self.ends: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        start = time.perf_counter()
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if self.hook._request:  # (set by before_run: this step is traced)
            self.starts.append(time.perf_counter() - start)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        tracing = self.hook._request
        start = time.perf_counter()
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if tracing:
            self.ends.append(time.perf_counter() - start)


def cpu_seconds() -> float:
    """CPU seconds used so far by this process, its reaped children (render workers a fit stopped) and the
    render worker running now: a difference of two readings is what a fit cost, its workers included (one
    running at the first reading and reaped by the second is in both the children's count and the first
    reading, which the difference takes off)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    seconds = time.process_time() + children.ru_utime + children.ru_stime
    process = worker.WORKER._process
    try:
        with open(f"/proc/{process.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (AttributeError, OSError):
        return seconds
    return seconds + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # its utime + stime


def fit(model: MLP, steps: int, kind: tuple) -> tuple[float, object, float]:
    """(fit seconds, the callback, CPU seconds of this process and the render worker) for kind ("none", every),
    ("torch", every, memory) or ("ours", every, content)."""
    out = tempfile.mkdtemp()
    callback = None
    if kind[0] == "torch":
        callback = TorchProfilerPeer(kind[1], out, kind[2])
    elif kind[0] == "idle":  # hookprof on, tracing nothing: its whole cost on untraced steps
        callback = HookCallback([ProfilerHook(save_steps=10**9, output_dir=out)])
    elif kind[0] == "ours":
        callback = TimedCallback(TimedProfilerHook(save_steps=kind[1], output_dir=out, **CONTENTS[kind[2]][0]))
        # (no step borrows tensor identities when none may give up on them)
        _Identities.GIVE_UP = 0 if kind[2] == WALKING else GIVE_UP
    data = DataLoader(TensorDataset(torch.randn(steps * 32, 64)), batch_size=32)
    trainer = L.Trainer(max_steps=steps, callbacks=[callback] if callback else [], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", devices=1)
    start, cpu = time.perf_counter(), cpu_seconds()
    try:
        trainer.fit(model, data)
    finally:
        _Identities.GIVE_UP = GIVE_UP
    elapsed, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    if kind[0] == "ours":
        callback.written = len(callback.hook.saved_paths)
    shutil.rmtree(out, ignore_errors=True)
    return elapsed, callback, cpu


def events_in_step(model: MLP) -> int:
    """Trace events torch's own export writes for one training step of `model` (shapes recorded)."""
    import orjson

    x = torch.randn(32, 64)
    optimizer = model.configure_optimizers()
    with torch.profiler.profile(record_shapes=True) as prof:
        model.training_step((x,), 0).backward()
        optimizer.step()
        optimizer.zero_grad()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path, "rb") as f:
        count = len(orjson.loads(f.read())["traceEvents"])
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    return count


def main():
    torch.set_num_threads(1)  # (see the module doc: on 2 shared cores, two intra-op threads stall at random)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("hookprof.hooks.profiler_hook").setLevel(logging.WARNING)
    print("| step (torch's events) | content | every step: ours / torch, per traced step | every 10th: ours / torch | "
          "CPU, every step: ours / torch | CPU, every 10th | "
          "training waits, ours: batch end / torch's profiler stop | ours: batch start | "
          "step graph + run metadata / our traced step |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for layers, steps_every, steps_tenth, rounds in SIZES:
        model = MLP(layers)
        events = events_in_step(model)
        schedules = {1: steps_every, **({10: steps_tenth} if steps_tenth else {})}
        kinds = []
        for every in schedules:
            kinds += [("none", every), ("torch", every, False), ("torch", every, True)]
            kinds += [("ours", every, content) for content in CONTENTS]
        if layers < 1000:
            for kind in kinds[:4]:
                fit(model, schedules[kind[1]], kind)  # warm up (the largest model's rounds run after these)
        runs: dict[tuple, list[tuple[float, object]]] = {kind: [] for kind in kinds}
        for round_ in range(rounds):
            shift = round_ * 3 % len(kinds)
            for kind in kinds[shift:] + kinds[:shift]:
                runs[kind].append(fit(model, schedules[kind[1]], kind))
        for content, (_, memory) in CONTENTS.items():
            cells = []
            for every in schedules:
                ours, ours_traced = per_traced_step(runs, ("ours", every, content))
                theirs, theirs_traced = per_traced_step(runs, ("torch", every, memory))
                skipped = f" ({ours_traced} of {theirs_traced} traced)" if ours_traced != theirs_traced else ""
                low, high = round_ratios(runs, ("ours", every, content), ("torch", every, memory))
                cells.append(f"{_ms(ours)} / {_ms(theirs)} = {ours / theirs:.2f}x (rounds {low:.2f}-{high:.2f}x)"
                             f"{skipped}")
            if len(cells) == 1:
                cells.append("-")
            for every in schedules:
                ours = per_traced_step(runs, ("ours", every, content), 2)[0]
                theirs = per_traced_step(runs, ("torch", every, memory), 2)[0]
                cells.append(f"{_ms(ours)} / {_ms(theirs)} = {ours / theirs:.2f}x")
            if len(cells) == 3:
                cells.append("-")
            ours_every = [run[1] for run in runs[("ours", 1, content)]]
            wait = _median(c.ends for c in ours_every)
            stop = _median(c.stops for _, c, _ in runs[("torch", 1, memory)])
            start = _median(c.starts for c in ours_every)
            share = "-"
            if any(c.hook.graphs for c in ours_every):
                own = statistics.median(end + job for c in ours_every for end, job in zip(c.ends, c.hook.jobs))
                graph = _median(c.hook.graphs for c in ours_every)
                share = f"{_ms(graph)} / {_ms(own)} = {graph / own:.0%}"
            print(f"| {layers} layers ({events:,}) | {content} | {cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} | "
                  f"{_ms(wait)} / {_ms(stop)} = {wait / stop:.2f}x | {_ms(start)} | {share} |", flush=True)
        if layers == 400:
            long_fits(model, min(rounds, 3))
        # idle: fits that trace nothing, alternating with untraced ones and after a traced fit's leftovers (its
        # freed steps, a worker's exit) are gone, in the every-10th fits' length
        every, idle_runs = max(schedules), {"idle": [], "none": []}
        for round_ in range(2 * rounds + 3):
            for name in ("idle", "none") if round_ % 2 else ("none", "idle"):
                idle_runs[name].append(fit(model, schedules[every], (name, every))[0])
        idle, none = (statistics.median(idle_runs[name]) for name in ("idle", "none"))
        print(f"(idle: a {schedules[every]}-step fit with a ProfilerHook that traces nothing / without it, "
              f"{len(idle_runs['idle'])} alternating fits each: {idle:.2f} s / {none:.2f} s = {idle / none:.3f}x)",
              flush=True)
        print(f"(load average after {layers} layers: {', '.join(f'{x:.1f}' for x in os.getloadavg())})", flush=True)
        del model


def long_fits(model: MLP, rounds: int) -> None:
    """Every step traced in fits LONG_STEPS long, ops and the defaults against the peer: what a traced step costs
    once a fit's own costs (the render worker's start, a fit's first renders, which convert its steps whole, the
    wait for the last render at its end) are spread over more steps, as in a longer fit."""
    kinds = [("none", 1), ("torch", 1, False), ("ours", 1, "ops"), ("ours", 1, "defaults (dataflow + graph)")]
    runs: dict[tuple, list] = {kind: [] for kind in kinds}
    for round_ in range(rounds):
        for kind in kinds[round_ % len(kinds):] + kinds[:round_ % len(kinds)]:
            runs[kind].append(fit(model, LONG_STEPS, kind))
    theirs, traced = per_traced_step(runs, kinds[1])
    cells = []
    for kind in kinds[2:]:
        ours, written = per_traced_step(runs, kind)
        skipped = f" ({written} of {traced} traced)" if written != traced else ""
        low, high = round_ratios(runs, kind, kinds[1])
        cells.append(f"{kind[2]} {_ms(ours)} / {_ms(theirs)} = {ours / theirs:.2f}x (rounds {low:.2f}-{high:.2f}x)"
                     f"{skipped}")
    print(f"(every step in {LONG_STEPS}-step fits, {rounds} rounds: {'; '.join(cells)})", flush=True)


def per_traced_step(runs: dict[tuple, list], kind: tuple, measure: int = 0) -> tuple[float, int]:
    """(median extra seconds per traced step over the untraced fit of the same schedule, steps traced a fit):
    wall time (`measure` 0) or CPU time of this process and the render worker (2)."""
    none = statistics.median(run[measure] for run in runs[("none", kind[1])])
    callback = runs[kind][0][1]
    traced = callback.traces if kind[0] == "torch" else callback.written
    return (statistics.median(run[measure] for run in runs[kind]) - none) / max(1, traced), traced


def round_ratios(runs: dict[tuple, list], ours: tuple, theirs: tuple) -> tuple[float, float]:
    """The lowest and highest of the rounds' own ratios of `ours`' extra wall time to `theirs`' (each over the
    untraced fit of the same round): how far one round's figure strays from the medians' on this machine."""
    ratios = [(mine[0] - none[0]) / max(1e-9, peer[0] - none[0])
              for mine, peer, none in zip(runs[ours], runs[theirs], runs[("none", ours[1])])]
    return min(ratios), max(ratios)


def _median(lists) -> float:
    return statistics.median([x for values in lists for x in values])


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


if __name__ == "__main__":
    main()
