"""Whole-fit overhead of hooks that never fire: a Lightning fit and a Keras fit of a tiny model with
ProfilerHook and SummarySaverHook on schedules that never trigger (SummarySaverHook writes its first step,
as TF's did), against the same fit without them, and against the same fit with two empty callbacks (what
the framework itself charges for dispatching every batch event to two callbacks). Runs alternate to share
the machine's drift; medians of 9 each.
"""

import gc
import os
import statistics
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import lightning as L  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import keras_prof  # noqa: E402
import lightning_prof  # noqa: E402
from core import summary  # noqa: E402

STEPS = 1000
NEVER = 10**9
LOSS = summary.scalar("loss", lambda step: step.outputs["loss"], collections=[])


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self.fc(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def lightning_fit(kind: str, out: str) -> float:
    data = DataLoader(TensorDataset(torch.randn(STEPS * 4, 8), torch.randn(STEPS * 4, 1)), batch_size=4)
    callbacks = {"none": [], "empty": [L.Callback(), L.Callback()],
                 "hooks": [lightning_prof.ProfilerHook(save_steps=NEVER, output_dir=out),
                           lightning_prof.SummarySaverHook(save_steps=NEVER, output_dir=out, summary_op=LOSS)]}[kind]
    trainer = L.Trainer(max_steps=STEPS, callbacks=callbacks, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
    start = time.perf_counter()
    trainer.fit(Tiny(), data)
    return time.perf_counter() - start


class _Empty(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        pass

    def on_train_batch_end(self, batch, logs=None):  # (overriding it is what makes Keras dispatch synchronously)
        pass


def keras_fit(kind: str, out: str) -> float:
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.random.randn(STEPS * 4, 8).astype("float32"), np.random.randn(STEPS * 4, 1).astype("float32")
    callbacks = {"none": [], "empty": [_Empty(), _Empty()],
                 "hooks": [keras_prof.ProfilerHook(save_steps=NEVER, output_dir=out),
                           keras_prof.SummarySaverHook(save_steps=NEVER, output_dir=out, summary_op=LOSS)]}[kind]
    start = time.perf_counter()
    model.fit(x, y, batch_size=4, epochs=1, callbacks=callbacks, verbose=0)
    return time.perf_counter() - start


def main():
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    out = tempfile.mkdtemp()
    print(f"| fit ({STEPS} steps) | no callbacks | 2 empty callbacks | 2 idle hooks | hooks vs none | "
          f"hooks vs empty callbacks, per step |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for label, fit in (("Lightning", lightning_fit), ("Keras (torch)", keras_fit)):
        for kind in ("none", "empty", "hooks"):
            fit(kind, out)  # warm up
        times = {"none": [], "empty": [], "hooks": []}
        kinds = list(times)
        for round_ in range(9):  # the order rotates, and each fit starts after a full collection
            for kind in kinds[round_ % 3:] + kinds[: round_ % 3]:
                gc.collect()
                times[kind].append(fit(kind, out))
        n, e, h = (statistics.median(times[k]) for k in ("none", "empty", "hooks"))
        print(f"| {label} | {n:.3f} s | {e:.3f} s | {h:.3f} s | {100 * (h - n) / n:+.1f}% | "
              f"{(h - e) / STEPS * 1e6:+.1f} us ({100 * (h - e) / e:+.1f}%) |")


if __name__ == "__main__":
    main()
