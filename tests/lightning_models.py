"""A tiny LightningModule (y = fc2(relu(fc1(x)))) and Trainer settings for fast CPU fits."""

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
