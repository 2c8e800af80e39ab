"""A training run killed with SIGKILL at random moments leaves no corrupt file and no temp file behind."""

import glob
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    import lightning as L
    import hookprof
    from hookprof import summary
    from lightning_prof import HookCallback, ProfilerHook, SummarySaverHook
    from tests.lightning_models import TinyModel, loader

    class Started(hookprof.SessionRunHook):
        def after_run(self, run_context, run_values):
            if run_context.session.global_step == 2:
                print("started", flush=True)

    out = sys.argv[1]
    op = summary.scalar("loss", lambda step: step.outputs["loss"])
    hooks = [ProfilerHook(save_steps=1, output_dir=out, show_memory=True),
             SummarySaverHook(save_steps=1, output_dir=out, summary_op=op), HookCallback([Started()])]
    L.Trainer(max_steps=int(sys.argv[2]), callbacks=hooks, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, accelerator="cpu").fit(TinyModel(), loader(n=4096))
""")


def run_child(out, steps, kill_after=None):
    script = os.path.join(out, "child.py")
    with open(script, "w") as f:
        f.write(CHILD.format(repo=REPO))
    child = subprocess.Popen([sys.executable, script, out, str(steps)], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    try:
        if kill_after is None:
            assert child.wait(timeout=300) == 0
            return
        assert child.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 60  # the files start once the render worker is up: count from the first
        while not glob.glob(os.path.join(out, "timeline-*.json")) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(kill_after)
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigkill_mid_run_leaves_only_whole_files(tmp_path, seed):
    out = str(tmp_path)
    run_child(out, 100_000, kill_after=random.Random(seed).uniform(0.05, 1.5))
    timelines = glob.glob(os.path.join(out, "timeline-*.json"))
    assert timelines, "the run wrote timelines before it was killed"
    for path in timelines:
        with open(path, "rb") as f:
            json.load(f)  # every timeline on disk is whole
    events = glob.glob(os.path.join(out, "events.out.tfevents.*"))
    assert events
    for path in events:  # readable by TensorBoard up to its last complete record
        records = list(EventFileLoader(path).Load())
        assert any(r.HasField("summary") for r in records)
    # the next run in the same directory removes what the killed one left half-written
    run_child(out, 3)
    assert [n for n in os.listdir(out) if n.endswith(".tmp")] == []
