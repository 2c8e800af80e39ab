"""Whole-fit overhead of hooks that never fire: a Lightning fit and a Keras fit of a tiny model with
ProfilerHook and SummarySaverHook on schedules that never trigger (SummarySaverHook writes its first step,
as TF's did), against the same fit without them. Runs alternate (A, B, A, B, ...) to share the machine's
drift; medians of 7 each.
"""

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


def lightning_fit(with_hooks: bool, out: str) -> float:
    data = DataLoader(TensorDataset(torch.randn(STEPS * 4, 8), torch.randn(STEPS * 4, 1)), batch_size=4)
    callbacks = [lightning_prof.ProfilerHook(save_steps=NEVER, output_dir=out),
                 lightning_prof.SummarySaverHook(save_steps=NEVER, output_dir=out, summary_op=LOSS)] if with_hooks else []
    trainer = L.Trainer(max_steps=STEPS, callbacks=callbacks, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
    start = time.perf_counter()
    trainer.fit(Tiny(), data)
    return time.perf_counter() - start


def keras_fit(with_hooks: bool, out: str) -> float:
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.random.randn(STEPS * 4, 8).astype("float32"), np.random.randn(STEPS * 4, 1).astype("float32")
    callbacks = [keras_prof.ProfilerHook(save_steps=NEVER, output_dir=out),
                 keras_prof.SummarySaverHook(save_steps=NEVER, output_dir=out, summary_op=LOSS)] if with_hooks else []
    start = time.perf_counter()
    model.fit(x, y, batch_size=4, epochs=1, callbacks=callbacks, verbose=0)
    return time.perf_counter() - start


def main():
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    out = tempfile.mkdtemp()
    print(f"| fit ({STEPS} steps) | without hooks | with 2 idle hooks | difference | per step |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for label, fit in (("Lightning", lightning_fit), ("Keras (torch)", keras_fit)):
        fit(False, out), fit(True, out)  # warm up
        bare, hooked = [], []
        for _ in range(7):
            bare.append(fit(False, out))
            hooked.append(fit(True, out))
        b, h = statistics.median(bare), statistics.median(hooked)
        print(f"| {label} | {b:.3f} s | {h:.3f} s | {100 * (h - b) / b:+.1f}% | {(h - b) / STEPS * 1e6:+.1f} us |")


if __name__ == "__main__":
    main()
