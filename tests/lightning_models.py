"""A tiny LightningModule (y = fc2(relu(fc1(x)))), Trainer settings for fast CPU fits, and a callback that asks
what a fit left where its steps were converted and rendered, at its end."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class TinyModel(L.LightningModule):
    def __init__(self, fail_at_step: int | None = None, fetch_log: bool = True):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 1)
        self.fail_at_step = fail_at_step

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))

    def training_step(self, batch, batch_idx):
        if self.fail_at_step is not None and self.trainer.global_step + 1 == self.fail_at_step:
            raise RuntimeError(f"boom at step {self.fail_at_step}")
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def loader(n: int = 64, batch_size: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))
    return DataLoader(ds, batch_size=batch_size)


def trainer(root: str, callbacks, max_steps: int, **kwargs) -> L.Trainer:
    return L.Trainer(
        max_steps=max_steps, callbacks=callbacks, default_root_dir=root, accelerator="cpu", devices=1,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        log_every_n_steps=1, **kwargs,
    )


class HeldAtTheEnd(L.Callback):
    """At the fit's end, before the ProfilerHook's (placed before it), its traced steps converted and rendered:
    what the process that did it holds for fits (`at_end`: what `held()` says then) and the fit's token, by which
    its renders keep their parts (`token`)."""

    def __init__(self, hook, held):
        self.hook, self.held, self.token, self.at_end = hook, held, None, None

    def on_train_end(self, trainer, pl_module):
        assert self.hook.saved_paths  # (waits for every traced step to be converted and rendered)
        self.token = self.hook.hook.pipeline._fit
        self.at_end = self.held()
