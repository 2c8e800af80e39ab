"""Train an MLP on the bundled two-moons data with Lightning, writing a timeline every 100 steps."""

import argparse

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from examples.data import two_moons
from lightning_prof import ProfilerHook


class MoonsClassifier(L.LightningModule):
    def __init__(self, hidden: int = 64):
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(2, hidden), torch.nn.ReLU(),
                                           torch.nn.Linear(hidden, hidden), torch.nn.ReLU())
        self.head = torch.nn.Linear(hidden, 1)

    def forward(self, x):
        return self.head(self.encoder(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.binary_cross_entropy_with_logits(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def main(output_dir: str, max_steps: int = 300, save_steps: int = 100) -> list[str]:
    x, y = two_moons()
    loader = DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=64, shuffle=True)
    hook = ProfilerHook(save_steps=save_steps, output_dir=output_dir)
    trainer = L.Trainer(max_steps=max_steps, callbacks=[hook], accelerator="cpu", devices=1,
                        default_root_dir=output_dir, enable_checkpointing=False, enable_model_summary=False,
                        enable_progress_bar=False, logger=False)
    trainer.fit(MoonsClassifier(), loader)
    return hook.saved_paths


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output-dir", default="runs/demo/lightning")
    parser.add_argument("--max-steps", type=int, default=300)
    args = parser.parse_args()
    print("\n".join(main(args.output_dir, args.max_steps)))
