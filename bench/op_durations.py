"""Op durations on a default timeline against torch.profiler's own, per op type (issue 33).

A timeline's op durations are what users read: recording dataflow and memory must not stretch them. A
Lightning fit of a model of `Linear(64, 64)` -> `tanh` -> `* 0.5` layers (aten::addmm, aten::tanh, aten::mul
in the forward pass; aten::mul again in the backward), every 10th step traced by `ProfilerHook` with its
defaults (dataflow arrows and the TensorBoard step graph; the first traced step walks torch's event tree, the
later ones borrow its tensor identities: `hookprof.tracing.step_identity`) and, in a fit of its own, by
`torch.profiler.profile(record_shapes=True, profile_memory=True)` + `export_chrome_trace` on the same steps
(the same content torch's profiler can record). For each op type, the median duration over all its calls in
all traced steps, read from our timelines and from torch's exports; fits alternate, 3 of each (rotating
which goes first). Also split: our first traced step (its own tree) and the later ones (borrowed).
"""

import glob
import logging
import os
import shutil
import statistics
import sys
import tempfile

import lightning as L
import orjson
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_prof import ProfilerHook

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from traced_step_vs_torch import TorchProfilerPeer  # noqa: E402  (the peer callback, same schedule)

OPS = ("aten::addmm", "aten::mul", "aten::tanh")
LAYERS, STEPS, EVERY, ROUNDS = 100, 49, 10, 3


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(LAYERS))

    def training_step(self, batch, batch_idx):
        h = batch[0]
        for layer in self.layers:
            h = torch.tanh(layer(h)) * 0.5
        return h.square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.001)


def fit(kind: str) -> dict[str, dict[str, list[float]]]:
    """{"first"/"later": {op: durations in us}} of one fit's traced steps."""
    out = tempfile.mkdtemp()
    callback = (ProfilerHook(save_steps=EVERY, output_dir=out) if kind == "ours"
                else TorchProfilerPeer(EVERY, out, memory=True))
    data = DataLoader(TensorDataset(torch.randn(STEPS * 32, 64)), batch_size=32)
    L.Trainer(max_steps=STEPS, callbacks=[callback], logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1
              ).fit(Net(), data)
    pattern = "timeline-*.json" if kind == "ours" else "trace-*.json"
    files = sorted(glob.glob(os.path.join(out, pattern)), key=lambda p: int(p.rsplit("-", 1)[1].split(".")[0]))
    durations: dict[str, dict[str, list[float]]] = {"first": {}, "later": {}}
    for i, path in enumerate(files):
        with open(path, "rb") as f:
            events = orjson.loads(f.read())["traceEvents"]
        part = durations["first" if i == 0 else "later"]
        for event in events:
            if event.get("ph") == "X" and event.get("name") in OPS and event.get("cat") in ("Op", "cpu_op"):
                part.setdefault(event["name"], []).append(event["dur"])
    shutil.rmtree(out, ignore_errors=True)
    return durations


def main():
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("hookprof.hooks.profiler_hook").setLevel(logging.WARNING)
    fit("ours")  # warm up
    runs: dict[str, list] = {"ours": [], "torch": []}
    for round_ in range(ROUNDS):
        for kind in (("ours", "torch") if round_ % 2 == 0 else ("torch", "ours")):
            runs[kind].append(fit(kind))
    print(f"load average: {os.getloadavg()}")
    print("| op | torch.profiler (shapes + memory) | ours, all traced steps | ratio | ours, first traced step "
          "(own tree) | ours, later steps (borrowed) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for op in OPS:
        theirs = statistics.median(d for run in runs["torch"] for part in run.values() for d in part.get(op, ()))
        ours = statistics.median(d for run in runs["ours"] for part in run.values() for d in part.get(op, ()))
        first = statistics.median(d for run in runs["ours"] for d in run["first"].get(op, ()))
        later = statistics.median(d for run in runs["ours"] for d in run["later"].get(op, ()))
        print(f"| `{op}` | {theirs:.1f} us | {ours:.1f} us | {ours / theirs:.2f}x | {first:.1f} us | {later:.1f} us |",
              flush=True)


if __name__ == "__main__":
    main()
