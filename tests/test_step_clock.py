"""The step clock is the optimizer's: schedules and stops follow the global step whatever one step advances it
by (Keras' `steps_per_execution`, two optimizers in one Lightning step), as TF's `steps_per_run` did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import lightning as L
import torch

from lightning_prof import ProfilerHook
from tests.conftest import timeline_steps
from tests.lightning_models import loader, trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


JAX_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import keras
    from hookprof import SessionRunHook
    from keras_prof import HookCallback, ProfilerHook, StepCounterHook, StopAtStepHook
    out = sys.argv[1]
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((104, 8)).astype("float32"), rng.standard_normal((104, 1)).astype("float32")

    def model():
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
        m.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=4)
        return m

    traced = model()  # 12 batches an epoch, 3 train-function calls of 4 steps; 24 steps in 2 epochs
    hook = ProfilerHook(save_steps=8, output_dir=os.path.join(out, "prof"))
    counter = StepCounterHook(every_n_steps=8, output_dir=os.path.join(out, "counter"))
    traced.fit(x[:96], y[:96], batch_size=8, epochs=2, callbacks=[hook, counter], verbose=0)
    stopped = model()
    stopped.fit(x[:96], y[:96], batch_size=8, epochs=4, callbacks=[StopAtStepHook(last_step=12)], verbose=0)
    class Clock(SessionRunHook):  # the global step hooks see, after each step
        seen = []

        def after_run(self, run_context, run_values):
            self.seen.append(run_context.session.global_step)

    uneven = model()  # 13 batches an epoch: calls of 4, 4, 4 and 1 step
    uneven.fit(x[:104], y[:104], batch_size=8, epochs=2, callbacks=[HookCallback([Clock()])], verbose=0)
    json.dump({"uneven": [int(uneven.optimizer.iterations), Clock.seen],
               "backend": keras.backend.backend(), "traced_steps": int(traced.optimizer.iterations),
               "paths": [os.path.basename(p) for p in hook.saved_paths],
               "stopped_at": int(stopped.optimizer.iterations)}, open(os.path.join(out, "result.json"), "w"))
""")


def test_keras_steps_per_execution_traces_and_stops_on_the_optimizers_steps(tmp_path):
    """Keras on JAX runs `steps_per_execution` batches per train-function call (the torch backend refuses more
    than 1): the global step advances 4 a call, and the schedule and the stop follow it."""
    script = tmp_path / "fit.py"
    script.write_text(JAX_SCRIPT)
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)  # (a checkout's hookprof first)
    env = {**os.environ, "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["backend"] == "jax" and result["traced_steps"] == 24
    assert result["paths"] == ["timeline-8.json", "timeline-16.json", "timeline-24.json"]
    assert result["stopped_at"] == 12
    # the step counter's first step only starts the count (step 4), then every 8 steps: 12 and 20 (it judged the
    # coming step as one more than the last, and counted at 16 only)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    counter = EventAccumulator(str(tmp_path / "counter"), size_guidance={"tensors": 0})
    counter.Reload()
    assert [e.step for e in counter.Tensors("global_step/sec")] == [12, 20], counter.Tags()
    # a call of one batch (an epoch's last) advances the step by one: the hooks' step stays the optimizer's
    iterations, seen = result["uneven"]
    assert iterations == 26 and seen == [4, 8, 12, 13, 17, 21, 25, 26]


class TwoOptimizers(L.LightningModule):
    """Manual optimization: a generator and a critic, each stepped once a batch (global step +2 a batch)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.g, self.c = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, _ = batch
        opt_g, opt_c = self.optimizers()
        loss_c = self.c(self.g(x).detach()).pow(2).mean()
        opt_c.zero_grad()
        self.manual_backward(loss_c)
        opt_c.step()
        loss_g = -self.c(self.g(x)).mean()
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.g.parameters(), lr=0.01), torch.optim.SGD(self.c.parameters(), lr=0.01)


def test_lightning_two_optimizers_trace_the_steps_of_the_schedule(tmp_dir):
    hook = ProfilerHook(save_steps=4, output_dir=tmp_dir, tensorboard=False)
    fit = trainer(tmp_dir, [hook], 20, logger=False)
    fit.fit(TwoOptimizers(), loader())  # 8 batches an epoch, +2 a batch: 10 batches
    assert fit.global_step == 20
    assert timeline_steps(tmp_dir) == [4, 8, 12, 16, 20]
    assert [os.path.basename(p) for p in hook.saved_paths] == [f"timeline-{s}.json" for s in (4, 8, 12, 16, 20)]
