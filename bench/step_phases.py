"""Where a steady every-step traced step's time goes, ours against the peer (`traced_step_vs_torch.py`'s
callback: `torch.profiler.profile(record_shapes=True)` + `export_chrome_trace`), in 40-step Lightning fits of the
400-layer MLP (about 20k events a step), every step traced.

Marks placed before and after the profiler's callbacks split each step into: the batch start (our callback
starts the profiler after the previous traced step's background work), the step's body (forward, backward,
optimizer, under the profiler), the batch end (torch's stop; the peer's export too) and the time from the batch
end to the next batch start (Lightning's loop, and, for ours, the background thread's export of the step, which
holds the GIL, and the other threads' work). Medians over steps 6 on, then over rounds. Also timed: kineto's
export on both sides (the same C++ call: `_ProfilerResult.save`), and what module scopes add to a forward under
the profiler (`_ModuleScopes`, hookprof's `module::` spans), and a 10-step fit's own costs (`short_fit_costs`).
About a minute and a half on 2 cores.
"""

import logging
import os
import shutil
import statistics
import sys
import tempfile
import time

import lightning as L
import torch
from torch.autograd import profiler as autograd_profiler
from torch.utils.data import DataLoader, TensorDataset

from hookprof.tracing import torch_tracer
from hookprof.tracing.torch_private import export_only_config
from lightning_prof import ProfilerHook

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from traced_fit_cost import MLP  # noqa: E402
from traced_step_vs_torch import TorchProfilerPeer  # noqa: E402

STEPS, ROUNDS, LAYERS = 40, 2, 400
KINDS = ("untraced", "peer", "ours, ops", "ours, defaults")
PHASES = ("batch start", "body", "batch end", "batch end to next start")
EXPORTS: dict[str, list[float]] = {"peer": [], "ours": []}  # kineto's export, seconds


class Mark(L.Callback):
    """Records the time at each batch start and end (one before the profiler's callbacks, one after)."""

    def __init__(self, marks: list, start: str, end: str):
        self.marks, self.start, self.end = marks, start, end

    def on_train_batch_start(self, *args):
        self.marks.append((self.start, time.perf_counter()))

    def on_train_batch_end(self, *args):
        self.marks.append((self.end, time.perf_counter()))


class TimedPeer(TorchProfilerPeer):
    """The peer, its `export_chrome_trace` timed."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.prof is None:
            return
        self.prof.__exit__(None, None, None)
        start = time.perf_counter()
        self.prof.export_chrome_trace(os.path.join(self.out, "trace.json"))
        EXPORTS["peer"].append(time.perf_counter() - start)
        self.prof = None


class _TimedResults:
    """kineto's results, their `save` (our export) timed."""

    def __init__(self, results):
        self._results = results

    def __getattr__(self, name):
        return getattr(self._results, name)

    def save(self, path):
        start = time.perf_counter()
        self._results.save(path)
        EXPORTS["ours"].append(time.perf_counter() - start)


class TimedRecording(torch_tracer._Recording):
    def __init__(self, results, *args, **kwargs):
        super().__init__(None if results is None else _TimedResults(results), *args, **kwargs)


def callbacks(kind: str, out: str) -> list:
    if kind == "peer":
        return [TimedPeer(1, out, False)]
    if kind == "ours, ops":
        return [ProfilerHook(save_steps=1, output_dir=out, show_dataflow=False, tensorboard=False)]
    if kind == "ours, defaults":
        return [ProfilerHook(save_steps=1, output_dir=out)]
    return []


def phases(model: MLP, kind: str) -> dict[str, float]:
    """The medians of each phase over a fit's steps 6 on (seconds)."""
    out, marks = tempfile.mkdtemp(), []
    data = DataLoader(TensorDataset(torch.randn(STEPS * 32, 64)), batch_size=32)
    trainer = L.Trainer(max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1,
                        callbacks=[Mark(marks, "s0", "e0"), *callbacks(kind, out), Mark(marks, "s1", "e1")])
    trainer.fit(model, data)
    shutil.rmtree(out, ignore_errors=True)
    found: dict[str, list[float]] = {phase: [] for phase in PHASES}
    times = [t for _, t in marks]
    for i in range(0, len(times) - 3, 4):
        s0, s1, e0, e1 = times[i:i + 4]
        found["batch start"].append(s1 - s0)
        found["body"].append(e0 - s1)
        found["batch end"].append(e1 - e0)
        if i + 4 < len(times):
            found["batch end to next start"].append(times[i + 4] - e1)
    return {phase: statistics.median(values[5:]) for phase, values in found.items()}


class Last(L.Callback):
    """When the fit's last batch ended."""

    def on_train_batch_end(self, *args):
        self.at = time.perf_counter()


def short_fit_costs(model: MLP, fits: int = 3) -> list[tuple[list[float], float]]:
    """A 10-step fit's own costs, every step traced with the defaults: each traced step's batch start (ms; the
    callback waits there for the previous step's background work) and how long `fit` returned after the last
    batch end (ms), per fit."""
    found = []
    for _ in range(fits):
        out, marks, last = tempfile.mkdtemp(), [], Last()
        data = DataLoader(TensorDataset(torch.randn(10 * 32, 64)), batch_size=32)
        trainer = L.Trainer(max_steps=10, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, accelerator="cpu", devices=1,
                            callbacks=[Mark(marks, "s0", "e0"), *callbacks("ours, defaults", out),
                                       Mark(marks, "s1", "e1"), last])
        trainer.fit(model, data)
        returned = time.perf_counter()
        shutil.rmtree(out, ignore_errors=True)
        times = [t for _, t in marks]
        starts = [(times[i + 1] - times[i]) * 1e3 for i in range(4, len(times) - 3, 4)]  # (step 1 is not traced)
        found.append((starts, (returned - last.at) * 1e3))
    return found


def scopes_cost(model: MLP) -> tuple[float, float]:
    """Median seconds of the model's forward under an export-only profiler, without and with module scopes."""
    x, config = torch.randn(32, 64), export_only_config()
    results: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(30):
        with_scopes = bool(round_ % 2)
        with autograd_profiler.profile(use_kineto=True, record_shapes=True, experimental_config=config):
            scopes = torch_tracer._ModuleScopes(model) if with_scopes else None
            if scopes is not None:
                scopes.install()
            start = time.perf_counter()
            model(x)
            results[with_scopes].append(time.perf_counter() - start)
            if scopes is not None:
                scopes.remove()
    return statistics.median(results[False][3:]), statistics.median(results[True][3:])


def main():
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("hookprof.hooks.profiler_hook").setLevel(logging.WARNING)
    torch_tracer._Recording = TimedRecording  # (the tracer makes its recordings through the module's name)
    model = MLP(LAYERS)
    runs: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}
    for round_ in range(ROUNDS):
        for kind in KINDS[round_ % len(KINDS):] + KINDS[:round_ % len(KINDS)]:
            runs[kind].append(phases(model, kind))
    print(f"| {STEPS}-step fits, {LAYERS} layers, every step traced | " + " | ".join(PHASES) + " |")
    print("| --- |" + " ---: |" * len(PHASES))
    for kind in KINDS:
        cells = [f"{statistics.median(run[phase] for run in runs[kind]) * 1e3:.1f} ms" for phase in PHASES]
        print(f"| {kind} | " + " | ".join(cells) + " |")
    peer, ours = (statistics.median(EXPORTS[side]) * 1e3 for side in ("peer", "ours"))
    print(f"(kineto's export of a step: the peer's export_chrome_trace {peer:.1f} ms, ours {ours:.1f} ms)")
    for starts, end in short_fit_costs(model):
        print(f"(a 10-step fit, the defaults: traced steps' batch starts {', '.join(f'{x:.0f}' for x in starts)} "
              f"ms; fit returned {end:.0f} ms after the last batch end)")
    without, with_scopes = scopes_cost(model.net)
    print(f"(a {LAYERS}-layer forward under the profiler: {without * 1e3:.2f} ms, with module scopes "
          f"{with_scopes * 1e3:.2f} ms)")
    print(f"(load average: {', '.join(f'{x:.1f}' for x in os.getloadavg())})")


if __name__ == "__main__":
    main()
