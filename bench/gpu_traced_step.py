"""On a CUDA device: a traced step of a real small model (a 4-layer transformer encoder, batch 64, sequence
128, d_model 512, AdamW) in a Lightning fit, this project's ProfilerHook against `torch.profiler.profile(
record_shapes=True)` + `export_chrome_trace` around the same steps (the peer of traced_step_vs_torch.py, which
records CUDA kernels by default where CUDA is available), and the idle hooks' share of a GPU step.

Each fit runs 41 steps; the traced ones are 10, 20, 30 and 40 (`save_steps=10`). The clock starts at the
third step's start (the trainer's set-up and the first steps' warm-up vary by ±0.5 s between fits, more than
what is measured) and stops when `fit` returns (once ProfilerHook's files are on disk), the device
synchronised at both ends; a figure is that time's excess over the same fit untraced, per traced step. Idle:
`ProfilerHook(save_steps=10**6)` and `StepCounterHook` on every step, nothing traced, against no callback.
Medians of 5 rounds (`HOOKPROF_BENCH_ROUNDS`), kinds in rotated order. Then where ours goes: the training's
waits in our callback on the traced steps, and the time from the last batch's end to `fit`'s return. Skips
without CUDA.
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
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from traced_step_vs_torch import (  # noqa: E402  (the same peer and timed hook as the CPU comparison)
    CONTENTS,
    TimedCallback,
    TimedProfilerHook,
    TorchProfilerPeer,
    _ms,
    per_traced_step,
)

from hookprof.hooks import StepCounterHook  # noqa: E402
from lightning_prof import HookCallback  # noqa: E402

STEPS, EVERY, BATCH, SEQ, WIDTH = 41, 10, 64, 128, 512
ROUNDS = int(os.environ.get("HOOKPROF_BENCH_ROUNDS", 5))
CLOCK_FROM = 2  # the batch index whose start starts the clock
EVERY_FIT_TRACES = (STEPS - 1) // EVERY  # steps 10, 20, 30, 40
SHOWN = ("ops", "defaults (dataflow + graph)", "dataflow + memory")


class StartClock(L.Callback):
    """First among the callbacks: the time the clock starts, at batch CLOCK_FROM's start (device idle)."""

    started = 0.0
    last_end = 0.0  # when the last batch's callbacks were done: what follows is the fit's end

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == CLOCK_FROM:
            torch.cuda.synchronize()
            self.started = time.perf_counter()


class LastBatchEnd(L.Callback):
    """Last among the callbacks: when the last batch's were done (`StartClock.last_end`)."""

    def __init__(self, clock: StartClock) -> None:
        self.clock = clock

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.clock.last_end = time.perf_counter()


class Encoder(L.LightningModule):
    def __init__(self):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(WIDTH, 8, 4 * WIDTH, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = torch.nn.Linear(WIDTH, 1)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.head(self.encoder(x)).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def fit(kind: tuple) -> tuple[float, object]:
    """(fit seconds, the callback) for ("none",), ("idle",), ("torch", memory) or ("ours", content)."""
    out = tempfile.mkdtemp()
    callback = None
    if kind[0] == "torch":
        callback = TorchProfilerPeer(EVERY, out, kind[1])
    elif kind[0] == "ours":
        callback = TimedCallback(TimedProfilerHook(save_steps=EVERY, output_dir=out, **CONTENTS[kind[1]][0]))
    elif kind[0] == "idle":
        from hookprof.hooks.profiler_hook import ProfilerHook

        callback = HookCallback([ProfilerHook(save_steps=10**6, output_dir=out),
                                 StepCounterHook(every_n_steps=10**6, output_dir=out)])
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(STEPS * BATCH, SEQ, WIDTH)), batch_size=BATCH)
    clock = StartClock()
    trainer = L.Trainer(max_steps=STEPS, callbacks=[clock] + ([callback] if callback else []) + [LastBatchEnd(clock)],
                        logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="gpu", devices=1)
    trainer.fit(Encoder(), data)
    torch.cuda.synchronize()
    returned = time.perf_counter()
    if kind[0] == "ours":
        callback.written = len(callback.hook.saved_paths)
    shutil.rmtree(out, ignore_errors=True)
    return returned - clock.started, callback, returned - clock.last_end


def main():
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("hookprof.hooks.profiler_hook").setLevel(logging.WARNING)
    kinds = [("none",), ("idle",), ("torch", False), ("torch", True)] + [("ours", c) for c in SHOWN]
    for kind in kinds[:4]:
        fit(kind)  # warm up: CUDA context, cuBLAS handles, CUPTI
    runs: dict[tuple, list] = {kind: [] for kind in kinds}
    for round_ in range(ROUNDS):
        shift = round_ * 3 % len(kinds)
        for kind in kinds[shift:] + kinds[:shift]:
            runs[kind].append(fit(kind))
    none = statistics.median(e for e, *_ in runs[("none",)])
    idle = statistics.median(e for e, *_ in runs[("idle",)])
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}; untraced step "
          f"{_ms(none / (STEPS - CLOCK_FROM))}; idle hooks' share of a step: {(idle - none) / none:+.1%} "
          f"(fits: {', '.join(f'{e:.3f}' for e, *_ in runs[('none',)])} s without hooks, "
          f"{', '.join(f'{e:.3f}' for e, *_ in runs[('idle',)])} s idle)")
    print("| content | per traced step: ours / torch |")
    print("| --- | ---: |")
    keyed = {("none", EVERY): runs[("none",)]}
    for content in SHOWN:
        memory = CONTENTS[content][1]
        keyed[("ours", EVERY, content)] = runs[("ours", content)]
        keyed[("torch", EVERY, memory)] = runs[("torch", memory)]
        ours, ours_traced = per_traced_step(keyed, ("ours", EVERY, content))
        theirs, theirs_traced = per_traced_step(keyed, ("torch", EVERY, memory))
        skipped = f" ({ours_traced} of {theirs_traced} traced)" if ours_traced != theirs_traced else ""
        print(f"| {content} | {_ms(ours)} / {_ms(theirs)} = {ours / theirs:.2f}x{skipped} |", flush=True)
    # where ours goes: the training's waits in the traced steps' callbacks, and the fit's end after the last batch
    for content in SHOWN:
        callbacks = [c for _, c, _ in runs[("ours", content)]]
        waits = statistics.median(sum(c.starts) + sum(c.ends) for c in callbacks) / EVERY_FIT_TRACES
        tail = statistics.median(t for _, _, t in runs[("ours", content)])
        print(f"{content}: training waits {_ms(waits)} per traced step in our callback; the fit's end "
              f"{_ms(tail)} after its last batch (untraced: {_ms(statistics.median(t for *_, t in runs[('none',)]))})")


if __name__ == "__main__":
    if torch.cuda.is_available():
        main()
    else:
        print("gpu_traced_step: no CUDA device; skipped")
