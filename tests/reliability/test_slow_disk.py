"""A real slow disk (a FUSE passthrough whose every written file takes a second to close): `save_steps=1`
traces come faster than the disk takes them. Training must neither stall nor hold ever more files: at most
`CaptureOptions.max_pending_writes` rendered steps wait, the rest are skipped, counted, said once, and the next
file says how many."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from hookprof.hooks import CaptureOptions

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


@pytest.fixture
def slow_dir(tmp_path):
    """A directory on a filesystem where closing a written file takes 1 s; skips where FUSE cannot mount."""
    try:
        import mfusepy  # noqa: F401  (loads libfuse: an OSError where it is missing)
    except (ImportError, OSError) as err:
        pytest.skip(f"no FUSE for a slow filesystem here ({err}); pip install mfusepy, apt install libfuse2")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse here: a slow filesystem needs FUSE")
    back, mount = tmp_path / "back", tmp_path / "slow"
    back.mkdir()
    mount.mkdir()
    server = subprocess.Popen([sys.executable, os.path.join(HERE, "slow_fs.py"), str(back), str(mount), "1.0"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 10
    while not os.path.ismount(mount):
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            pytest.skip(f"the FUSE filesystem did not mount: {server.communicate()[1][-500:]}")
        time.sleep(0.05)
    try:
        yield str(mount)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
        server.terminate()
        server.wait(timeout=10)
        shutil.rmtree(back, ignore_errors=True)


SCRIPT = textwrap.dedent("""
    import json, logging, os, resource, sys, time
    import lightning as L, torch
    from torch.utils.data import DataLoader, TensorDataset
    from lightning_prof import ProfilerHook

    class Wide(L.LightningModule):  # some 1,600 ops a step: a rendered timeline of about 3 MB
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            time.sleep(0.15)  # the rest of a real step: the disk takes some 7 steps a file
            x = self.fc(batch[0])
            for _ in range(400):
                x = x * 1.0001 + 0.0
            return (x - batch[1]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    def fit(out, steps):
        hook = ProfilerHook(save_steps=1, output_dir=out, tensorboard=False)
        data = DataLoader(TensorDataset(torch.randn(steps * 4, 8), torch.randn(steps * 4, 1)), batch_size=4)
        trainer = L.Trainer(max_steps=steps, callbacks=[hook], logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
        start = time.monotonic()
        trainer.fit(Wide(), data)
        return hook, time.monotonic() - start

    fast, slow, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    warm, fast_seconds = fit(fast, steps)  # the same fit on a fast disk: its memory is the baseline
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("hookprof").addHandler(handler)
    hook, seconds = fit(slow, steps)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"paths": hook.saved_paths, "skipped": hook.hook.skipped_traces,
                      "unreported": hook.hook.pipeline.skipped_since_file, "seconds": seconds,
                      "fast_seconds": fast_seconds,
                      "peak_growth": peak - before, "fast_sizes": [os.path.getsize(p) for p in warm.saved_paths],
                      "warnings": [m for m in records if "faster than the disk" in m]}))
""")


def test_a_slow_disk_skips_traces_rather_than_stalling_or_growing(slow_dir, tmp_path):
    steps = 30
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "fast"), slow_dir, str(steps)],
                          capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    written, skipped = len(result["paths"]), result["skipped"]
    # every step after the first was due; each was either written or skipped, and most were skipped
    assert written + skipped == steps - 1 and skipped > written
    # training was not held up by the disk: waiting for each file (1 s) would add (steps - 1) s to the fast fit
    assert result["seconds"] < result["fast_seconds"] + (steps - 1) / 2, result
    assert CaptureOptions().max_pending_writes == 2  # (the default bound the memory figure below assumes)
    # memory stayed bounded: the skipped files, held, would have taken skipped x their size (ru_maxrss is coarse:
    # the step stats being rendered count too)
    size = min(result["fast_sizes"])
    assert size > 1_000_000
    assert result["peak_growth"] < skipped * size / 2, (result["peak_growth"], skipped, size)
    # one warning; each file says how many steps were skipped before it, and the counts add up
    assert len(result["warnings"]) == 1 and slow_dir in result["warnings"][0]
    counts = []
    for path in result["paths"]:
        with open(path) as f:
            counts.append(json.load(f)["metadata"].get("skipped_traces", 0))
    assert sum(counts) + result["unreported"] == skipped and max(counts) > 0
