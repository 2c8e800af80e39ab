"""Preemption: SIGTERM (what SLURM and Kubernetes send) at seeded random moments of a fit with
ProfilerHook(save_steps=1, show_memory=True) and SummarySaverHook(save_steps=1), in a child process.

Lightning handles SIGTERM itself (2.6: its handler, installed for the fit only, marks the trainer; the batch
running ends and the fit leaves through `on_exception`, where hookprof closes its hooks), so every traced step
has its timeline. Keras leaves SIGTERM's default action, which ends the process at once: hookprof installs no
handler (see the README's Guarantees), so the timeline being written is absent, never partial, and its temp
file is removed by the next run in the directory. On both, every summary of a step that had ended is in an
event file that TensorBoard reads: each event is written and flushed when its step ends.
"""

from __future__ import annotations

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
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import timeline_steps

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = textwrap.dedent("""
    import os, sys
    os.environ["KERAS_BACKEND"] = "torch"
    sys.path.insert(0, {repo!r})
    import hookprof
    from hookprof import summary

    class Report(hookprof.SessionRunHook):
        '''Prints each step once the hooks before it are done with it, its timeline on disk (the wait also
        keeps a tiny model's steps from outrunning the disk, where ProfilerHook would skip traces).'''
        def __init__(self, profiler_hook):
            self.profiler_hook = profiler_hook
        def after_run(self, run_context, run_values):
            self.profiler_hook.flush()
            print("step", run_context.session.global_step, flush=True)

    framework, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    op = summary.scalar("loss", lambda step: float(step.outputs["loss"]), collections=[])
    if framework == "lightning":
        import lightning as L
        from lightning_prof import HookCallback, ProfilerHook, SummarySaverHook
        from tests.lightning_models import TinyModel, loader

        prof = ProfilerHook(save_steps=1, show_memory=True)
        hooks = [prof, SummarySaverHook(save_steps=1, summary_op=op), HookCallback([Report(prof.hook)])]
        L.Trainer(max_steps=steps, callbacks=hooks, default_root_dir=out, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, accelerator="cpu").fit(
                  TinyModel(), loader(n=8 * steps))
    else:
        import keras
        import numpy as np
        from keras_prof import HookCallback, ProfilerHook, SummarySaverHook

        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        prof = ProfilerHook(save_steps=1, show_memory=True, output_dir=out)
        hooks = [prof, SummarySaverHook(save_steps=1, output_dir=out, summary_op=op), HookCallback([Report(prof.hook)])]
        x = np.random.default_rng(0).standard_normal((8 * steps, 8)).astype("float32")
        model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0, callbacks=hooks)
    print("done", flush=True)
""")


def run_child(framework, out, steps, term_after=None):
    """Run a fit; with `term_after`, SIGTERM it that many seconds after its second step. Returns (exit code,
    the last step it reported done, stderr)."""
    script = os.path.join(os.path.dirname(out), f"child_{framework}.py")
    with open(script, "w") as f:
        f.write(CHILD.format(repo=REPO))
    child = subprocess.Popen([sys.executable, script, framework, out, str(steps)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "KERAS_BACKEND": "torch"})
    try:
        if term_after is not None:
            for line in child.stdout:
                if line.strip() == "step 2":
                    break
            time.sleep(term_after)
            child.send_signal(signal.SIGTERM)
        stdout, stderr = child.communicate(timeout=300)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    done = [int(line.split()[1]) for line in stdout.splitlines() if line.startswith("step ")]
    return child.returncode, max(done, default=2 if term_after is not None else 0), stderr


def read_events(directory):
    acc = EventAccumulator(directory, size_guidance={"tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    return [e.step for e in acc.Tensors("loss")], sorted(int(t.removeprefix("step_")) for t in tags["run_metadata"])


def assert_whole(directory):
    for path in glob.glob(os.path.join(directory, "timeline-*.json")):
        with open(path, "rb") as f:
            assert json.load(f)["traceEvents"], path


@pytest.mark.parametrize("seed", [1, 2])
def test_lightning_sigterm_finishes_every_traced_step(tmp_path, seed):
    out = str(tmp_path / "run")
    code, last, stderr = run_child("lightning", out, 100_000, term_after=random.Random(seed).uniform(0.0, 1.5))
    assert code != -signal.SIGTERM, "Lightning's handler, not the default action, ended the fit"
    assert "Received SIGTERM" in stderr or code == 0
    (run,) = glob.glob(os.path.join(out, "lightning_logs", "version_*"))
    assert last >= 3
    assert timeline_steps(run) == list(range(2, last + 1))  # on_exception waited for the last one
    assert_whole(run)
    loss, graphs = read_events(run)
    assert loss == list(range(1, last + 1)) and graphs == list(range(2, last + 1))
    assert not [n for n in os.listdir(run) if n.endswith(".tmp")]


@pytest.mark.parametrize("seed", [1, 2])
def test_keras_sigterm_leaves_only_whole_files_and_the_next_run_cleans_up(tmp_path, seed):
    out = str(tmp_path / "run")
    code, last, _ = run_child("keras", out, 100_000, term_after=random.Random(seed).uniform(0.0, 1.5))
    assert code == -signal.SIGTERM  # the default action: no handler of hookprof's delayed it
    assert last >= 3
    timelines = timeline_steps(out)
    assert_whole(out)
    # every ended step's timeline, and the one running when the signal came if its file was done
    assert timelines in (list(range(2, last + 1)), list(range(2, last + 2)))
    loss, graphs = read_events(out)
    assert loss[:last] == list(range(1, last + 1))  # every ended step's summary was on disk
    assert graphs[:last - 1] == list(range(2, last + 1))
    # the next run in the directory removes a temp file the killed one left mid-write
    code, _, stderr = run_child("keras", out, 3)
    assert code == 0, stderr[-3000:]
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]
    assert_whole(out)
