"""What watching for triggers costs a step that is not traced: a Lightning fit and a Keras fit of a tiny model
with one ProfilerHook on a schedule that never fires, without triggers and with all four
(`SlowStep(factor=1000), NonFinite(), LossSpike(factor=1000), MemoryJump(1 GB)`). A fire would trace a step,
and this fit is made to be noisy: it regresses random targets in batches of 4 (the per-batch loss varies
several-fold) in ~1 ms steps that a busy machine's scheduler stretches several-fold now and then. So the
factors are raised until nothing fires; what a step costs the watch does not depend on them.

The callback's per-step methods are timed from inside the fit (`idle_fit_overhead.Stopwatch`), so the
machine's drift between fits cannot hide a microsecond; medians of 7 fits each, in rotating order. The last
column is the watch's extra cost as a share of the tiny model's whole fit (on any real model, a step takes
milliseconds and the share is a hundredth of it).
"""

import gc
import os
import statistics
import sys
import tempfile

os.environ.setdefault("KERAS_BACKEND", "torch")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import idle_fit_overhead as idle  # noqa: E402
import keras  # noqa: E402
import lightning as L  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import keras_prof  # noqa: E402
import lightning_prof  # noqa: E402
from hookprof.triggers import LossSpike, MemoryJump, NonFinite, SlowStep  # noqa: E402

STEPS = idle.STEPS


WATCHES = ("none", "three", "four")  # no triggers; SlowStep, NonFinite and LossSpike; and MemoryJump too


def _hook(module, out: str, watch: str):
    triggers = {"none": None, "three": [SlowStep(factor=1000), NonFinite(), LossSpike(factor=1000)],
                "four": [SlowStep(factor=1000), NonFinite(), LossSpike(factor=1000), MemoryJump(2**30)]}[watch]
    return module.ProfilerHook(save_steps=idle.NEVER, output_dir=out, triggers=triggers, tensorboard=False)


def lightning_fit(watch: str, out: str, stopwatch: idle.Stopwatch) -> float:
    data = DataLoader(TensorDataset(torch.randn(STEPS * 4, 8), torch.randn(STEPS * 4, 1)), batch_size=4)
    hook = _hook(lightning_prof, out, watch)
    stopwatch.wrap(hook, idle.PER_STEP["lightning"])
    trainer = L.Trainer(max_steps=STEPS, callbacks=[hook], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
    start = idle.time.perf_counter()
    trainer.fit(idle.Tiny(), data)
    assert not hook.hook.fired, hook.hook.fired  # a healthy fit: the watch only watches
    return idle.time.perf_counter() - start


def keras_fit(watch: str, out: str, stopwatch: idle.Stopwatch) -> float:
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.random.randn(STEPS * 4, 8).astype("float32"), np.random.randn(STEPS * 4, 1).astype("float32")
    hook = _hook(keras_prof, out, watch)
    stopwatch.wrap(hook, idle.PER_STEP["keras"])
    start = idle.time.perf_counter()
    model.fit(x, y, batch_size=4, epochs=1, callbacks=[hook, idle._TimeTrainFunctionWrapper(stopwatch)], verbose=0)
    assert not hook.hook.fired, hook.hook.fired
    return idle.time.perf_counter() - start


def main():
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    out = tempfile.mkdtemp()
    print(f"| fit ({STEPS} steps) | inside the callback, no triggers | with SlowStep, NonFinite, LossSpike "
          "| with MemoryJump too | watch cost per step: three / four | four, share of the tiny model's fit |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for label, fit in (("Lightning", lightning_fit), ("Keras (torch)", keras_fit)):
        fit("four", out, idle.Stopwatch())  # warm up
        inside: dict[str, list[float]] = {w: [] for w in WATCHES}
        fits: dict[str, list[float]] = {w: [] for w in WATCHES}
        for round_ in range(7):
            for watch in WATCHES[round_ % 3:] + WATCHES[: round_ % 3]:
                gc.collect()
                stopwatch = idle.Stopwatch()
                fits[watch].append(fit(watch, out, stopwatch))
                inside[watch].append(stopwatch.seconds)
        plain, three, four = (statistics.median(inside[w]) / STEPS * 1e6 for w in WATCHES)
        share = (four - plain) * STEPS / 1e6 / statistics.median(fits["four"])
        print(f"| {label} | {plain:.1f} us | {three:.1f} us | {four:.1f} us | {three - plain:.1f} us / "
              f"{four - plain:.1f} us | {100 * share:.2f}% |", flush=True)


if __name__ == "__main__":
    main()
