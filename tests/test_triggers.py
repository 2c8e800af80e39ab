"""Triggers (`hookprof.triggers`) and `keep_last`, on real Lightning and Keras fits with planted problems."""

import json
import logging
import math
import os
import re
import time

import keras
import lightning as L
import numpy as np
import pytest
import torch

import hookprof
from hookprof.trace import format as fmt
from hookprof.triggers import LossSpike, MemoryJump, NonFinite, SlowStep, StepObservation
from tests.lightning_models import loader, trainer

assert keras.backend.backend() == "torch"


class Planted(L.LightningModule):
    """An MLP whose training step takes some 20 ms (a sleep: steady, so a busy machine's scheduling noise stays
    small beside it) and, on the step reaching global step `at`, a planted
    problem: a sleep (`slow`), a NaN loss (`nan`); `leak` keeps every step's activation alive."""

    def __init__(self, at=None, problem=None):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
        self.at, self.problem, self.kept = at, problem, []

    def training_step(self, batch, batch_idx):
        x, y = batch
        here = self.at is not None and self.trainer.global_step + 1 == self.at
        time.sleep(0.02)
        if here and self.problem == "slow":
            time.sleep(0.3)
        out = self.net(x)
        if self.problem == "leak":
            self.kept.append(torch.ones(256 * 1024))  # 1 MiB kept every step
        loss = torch.nn.functional.mse_loss(out, y)
        if here and self.problem == "nan":
            loss = loss * float("nan")
        if here and self.problem == "spike":
            loss = loss * 50  # one bad batch: its gradient is clipped away below, so training goes on as before
        return loss

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=1.0, gradient_clip_algorithm="norm")

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def fit_lightning(root, hook, steps, model, *callbacks):
    trainer(str(root), [hook, *callbacks], max_steps=steps, logger=False).fit(model, loader(n=64, batch_size=8))
    return hook


class RunQueueWait(L.Callback):
    """How long the training thread waited for a CPU (the kernel's run-queue delay, `/proc/thread-self/schedstat`)
    from one step's end to the next's, by the global step it reached: what another process on a loaded machine
    took from the step, which no trigger can tell from the training's own slowness."""

    def __init__(self):
        self.waited: dict[int, float] = {}
        self._last = self._read()

    @staticmethod
    def _read() -> float:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9

    def on_train_batch_end(self, trainer, *args):
        now = self._read()
        self.waited[trainer.global_step], self._last = now - self._last, now


def unexplained_slow_steps(messages, waited):
    """The `slow_step` firings whose excess over the median the machine's load does not explain (the training
    thread waited for a CPU for less than half of it during that step)."""
    left = []
    for message in messages:
        found = re.search(r"slow_step fired at step (\d+) \(([\d.]+) ms against a median of ([\d.]+) ms", message)
        if found:
            step, seconds, median = int(found[1]), float(found[2]) / 1e3, float(found[3]) / 1e3
            if waited.get(step, 0.0) < (seconds - median) / 2:
                left.append((message, waited.get(step)))
    return left


def metadata(path):
    with open(path) as f:
        return json.load(f)


def recent_spans(trace):
    return [e for e in trace["traceEvents"] if e.get("cat") == fmt.CAT_RECENT_STEP]


def test_a_slow_step_is_caught_and_the_next_step_traced_with_the_slow_steps_phases(tmp_path):
    from lightning_prof import ProfilerHook

    hook = ProfilerHook(triggers=[SlowStep(factor=3.0, window=40, min_steps=10)], output_dir=str(tmp_path),
                        tensorboard=False)
    fit_lightning(tmp_path, hook, 60, Planted(at=30, problem="slow"))
    assert [os.path.basename(p) for p in hook.saved_paths] == ["timeline-31.json"]
    assert hook.hook.fired == {"slow_step": 1}
    trace = metadata(hook.saved_paths[0])
    trigger = trace["metadata"][fmt.TRIGGER]
    assert trigger["kind"] == "slow_step" and trigger["step"] == 30
    slow_ms, median_ms = (float(part.split(" ms")[0]) for part in trigger["detail"].split(" against a median of "))
    assert slow_ms >= 300 and slow_ms > 3 * median_ms
    spans = recent_spans(trace)
    by_name = {e["name"]: e for e in spans}
    slow = by_name["step 30 (slow_step)"]
    assert slow["dur"] >= 300_000  # the slow step itself, though the traced step 31 is a normal one
    # its phases, as Lightning marked them: the sleep sits in the forward phase
    phases = [e for e in spans if e["args"]["name"].startswith("recent/step_30/") and e["name"] != slow["name"]]
    assert {e["name"] for e in phases} >= {"forward", "backward", "optimizer"}
    assert max(phases, key=lambda e: e["dur"])["name"] == "forward"
    # and the window of steps before it (40 and the firing one, less the first step, which has no record)
    steps = sorted(int(e["args"]["name"].split("/")[1][5:]) for e in spans if e["name"].startswith("step "))
    assert steps == list(range(1, 31))[-41:]
    # the traced step's own content is untouched: the Step phases thread has one train step, 31
    assert sum(1 for e in trace["traceEvents"] if e.get("name") == "ProfilerStep#31") == 1


def test_a_nan_loss_fires_non_finite_once_within_the_cooldown(tmp_path, caplog):
    from lightning_prof import ProfilerHook

    hook = ProfilerHook(triggers=[NonFinite("loss")], capture_steps=2, cooldown_steps=100,
                        output_dir=str(tmp_path), tensorboard=False)
    with caplog.at_level(logging.WARNING, logger="hookprof"):
        fit_lightning(tmp_path, hook, 40, Planted(at=12, problem="nan"))  # the loss stays NaN from step 12 on
    said = [r.getMessage() for r in caplog.records if "fired" in r.getMessage()]
    assert said == [f"non_finite fired at step 12 (loss = nan): tracing steps 13..14 into '{tmp_path}'."]
    assert [os.path.basename(p) for p in hook.saved_paths] == ["timeline-13.json", "timeline-14.json"]
    assert hook.hook.fired == {"non_finite": 1}
    for path in hook.saved_paths:
        assert metadata(path)["metadata"][fmt.TRIGGER] == {"kind": "non_finite", "step": 12, "detail": "loss = nan"}


def test_a_loss_spike_fires_loss_spike(tmp_path):
    from lightning_prof import ProfilerHook

    hook = ProfilerHook(triggers=[LossSpike(window=40)], output_dir=str(tmp_path), tensorboard=False)
    fit_lightning(tmp_path, hook, 50, Planted(at=35, problem="spike"))
    assert [os.path.basename(p) for p in hook.saved_paths] == ["timeline-36.json"]
    trigger = metadata(hook.saved_paths[0])["metadata"][fmt.TRIGGER]
    assert trigger["kind"] == "loss_spike" and trigger["step"] == 35 and trigger["detail"].startswith("loss ")


@pytest.mark.parametrize("cuda_started_elsewhere", [False, True])
def test_kept_activations_fire_memory_jump(tmp_path, monkeypatch, cuda_started_elsewhere):
    """A CPU fit reads the host's memory, also in a process where something else started CUDA (a GPU
    evaluation before it, another test): the device is the model's, not CUDA's current one."""
    from lightning_prof import ProfilerHook

    if cuda_started_elsewhere:
        import torch

        if torch.cuda.is_available():
            torch.zeros(1, device="cuda")  # really started (on a machine with a GPU)
        else:  # as torch reports a process where CUDA started
            monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
            monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
            monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 << 20)

    hook = ProfilerHook(triggers=[MemoryJump(6 * 2**20, window=40, min_steps=4)], output_dir=str(tmp_path),
                        tensorboard=False)
    fit_lightning(tmp_path, hook, 80, Planted(problem="leak"))
    assert hook.hook.fired == {"memory_jump": 1}
    trigger = metadata(hook.saved_paths[0])["metadata"][fmt.TRIGGER]
    assert trigger["kind"] == "memory_jump" and "host heap in use at the step's end" in trigger["detail"]
    # the host heap is read every 10th step: 1 MiB a step is some 15 MiB above the median of 4 readings at 50
    assert trigger["step"] in (50, 60)


def test_a_healthy_run_of_300_steps_fires_nothing_beside_its_schedule(tmp_path, caplog):
    from lightning_prof import ProfilerHook

    triggers = [SlowStep(), NonFinite(), LossSpike(), MemoryJump(64 * 2**20)]
    hook = ProfilerHook(save_steps=100, triggers=triggers, output_dir=str(tmp_path), tensorboard=False)
    load = RunQueueWait()
    with caplog.at_level(logging.INFO, logger="hookprof"):
        fit_lightning(tmp_path, hook, 300, Planted(), load)
    fired = [r.getMessage() for r in caplog.records if "fired" in r.getMessage()]
    # a step the machine's load held up may fire slow_step (rightly: it was slow); nothing else may fire
    assert len(fired) == sum(hook.hook.fired.values())  # (every firing was seen here)
    assert not unexplained_slow_steps(fired, load.waited), fired
    assert set(hook.hook.fired) <= {"slow_step"}, fired
    # the schedule's timelines whatever fired, and only a firing's own timelines say it
    scheduled = [f"timeline-{s}.json" for s in (100, 200, 300)]
    assert set(scheduled) <= {os.path.basename(p) for p in hook.saved_paths}
    for path in hook.saved_paths:
        assert (fmt.TRIGGER in metadata(path)["metadata"]) == (os.path.basename(path) not in scheduled), path


def test_keep_last_keeps_the_newest_timelines_of_this_run_only(tmp_path):
    from lightning_prof import ProfilerHook

    other_run = tmp_path / "timeline-1000.json"
    other_run.write_text("{}")
    hook = ProfilerHook(save_steps=1, keep_last=3, output_dir=str(tmp_path), tensorboard=False)
    fit_lightning(tmp_path, hook, 11, Planted())  # the first step starts the count: steps 2..11 traced
    newest = [f"timeline-{s}.json" for s in (9, 10, 11)]
    assert [os.path.basename(p) for p in hook.saved_paths] == newest
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith("timeline-")) == sorted(newest + [other_run.name])
    assert hook.hook.removed_timelines == 7
    assert all(metadata(tmp_path / name)["metadata"]["step"] == int(name[9:-5]) for name in newest)


# --- Keras ------------------------------------------------------------------------------------------------


class Planter(keras.layers.Layer):
    """Passes its input through; on its `at`-th training call sleeps (`slow`) or makes it NaN (`nan`)."""

    def __init__(self, at, problem, **kwargs):
        super().__init__(**kwargs)
        self.at, self.problem, self.calls = at, problem, 0

    def call(self, x, training=False):
        if training:
            self.calls += 1
            time.sleep(0.02)
            if self.calls == self.at and self.problem == "slow":
                time.sleep(0.3)
            if self.calls == self.at and self.problem == "nan":
                return x * float("nan")
        return x


def keras_fit(tmp_path, hook, problem, at, steps=60):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"),
                              Planter(at, problem), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((steps * 4, 8)).astype("float32"), rng.standard_normal((steps * 4, 1)).astype("float32")
    model.fit(x, y, batch_size=4, epochs=1, callbacks=[hook], verbose=0)
    return hook


def test_keras_slow_step_fires_and_the_next_step_is_traced(tmp_path):
    from keras_prof import ProfilerHook

    hook = ProfilerHook(triggers=[SlowStep(window=40, min_steps=10)], output_dir=str(tmp_path), tensorboard=False)
    keras_fit(tmp_path, hook, "slow", at=30)
    assert [os.path.basename(p) for p in hook.saved_paths] == ["timeline-31.json"]
    trace = metadata(hook.saved_paths[0])
    assert trace["metadata"][fmt.TRIGGER]["kind"] == "slow_step" and trace["metadata"][fmt.TRIGGER]["step"] == 30
    slow = [e for e in recent_spans(trace) if e["name"] == "step 30 (slow_step)"]
    assert len(slow) == 1 and slow[0]["dur"] >= 300_000
    assert any(e.get("cat") == fmt.CAT_OP for e in trace["traceEvents"])  # the traced step holds its ops


def test_keras_nan_loss_fires_non_finite(tmp_path):
    from keras_prof import ProfilerHook

    hook = ProfilerHook(triggers=[NonFinite("loss")], output_dir=str(tmp_path), tensorboard=False)
    keras_fit(tmp_path, hook, "nan", at=20, steps=30)
    assert [os.path.basename(p) for p in hook.saved_paths] == ["timeline-21.json"]
    trigger = metadata(hook.saved_paths[0])["metadata"][fmt.TRIGGER]
    assert trigger["kind"] == "non_finite" and trigger["step"] == 20


# --- the triggers themselves --------------------------------------------------------------------------------


def test_loss_spike_compares_with_the_rolling_median_and_skips_non_finite_values():
    spike = LossSpike(factor=3.0, window=5, min_steps=3)
    details = [spike.observe(StepObservation(step, value=v)) for step, v in
               enumerate([1.0, 1.2, 0.9, 2.9, math.nan, 3.5, 1.0], start=1)]
    assert details[:5] == [None] * 5  # 2.9 < 3 x 1.0; NaN is NonFinite's
    assert details[5] == "loss 3.5 against a median of 1.1" and details[6] is None
    # a loss whose batches spread widely (0.1 and 0.9 in turn): 1.6 is 3x the median, yet within 3x the
    # window's usual excursion above it (the 90th percentile, 0.9, is 0.4 above the median 0.5); 1.8 is not
    def noisy():
        spike = LossSpike(factor=3.0, window=20, min_steps=20)
        assert all(spike.observe(StepObservation(step, value=(0.1, 0.9)[step % 2])) is None for step in range(20))
        return spike

    assert noisy().observe(StepObservation(20, value=1.6)) is None
    assert noisy().observe(StepObservation(20, value=1.8)) == "loss 1.8 against a median of 0.5"
    negative = LossSpike(factor=3.0, window=5, min_steps=1)
    assert negative.observe(StepObservation(1, value=-2.0)) is None
    assert negative.observe(StepObservation(2, value=1.9)) is None  # -2 + 2 x 2 = 2: not above
    assert negative.observe(StepObservation(3, value=2.5)) is not None


def test_slow_step_ignores_steps_not_judged_and_waits_for_min_steps():
    slow = SlowStep(factor=2.0, window=4, min_steps=2)
    assert slow.observe(StepObservation(1, seconds=0.01)) is None
    assert slow.observe(StepObservation(2, seconds=1.0)) is None  # one step seen: no median yet
    assert slow.observe(StepObservation(3, seconds=None)) is None  # not judged (a traced step): not counted
    assert slow.observe(StepObservation(4, seconds=0.01)) is None  # the median of .01 and 1 is .505
    assert slow.observe(StepObservation(5, seconds=0.5)) == "500.0 ms against a median of 10.0 ms"


def test_slow_step_needs_an_absolute_excess_so_sub_millisecond_jitter_stays_quiet():
    slow = SlowStep(window=20, min_steps=5)
    for step in range(1, 11):
        assert slow.observe(StepObservation(step, seconds=0.0006)) is None
    assert slow.observe(StepObservation(11, seconds=0.002)) is None  # 3.3x the median, 1.4 ms above it: noise
    assert slow.observe(StepObservation(12, seconds=0.0006 + 0.05)) is not None  # 50 ms above: a stall
    strict = SlowStep(window=20, min_steps=5, min_excess_seconds=0)
    for step in range(1, 11):
        strict.observe(StepObservation(step, seconds=0.0006))
    assert strict.observe(StepObservation(11, seconds=0.002)) == "2.0 ms against a median of 0.6 ms"


class Healthy(L.LightningModule):
    """A small model whose steps take well under a millisecond of work: only the host's noise varies them."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_slow_step_stays_quiet_over_twenty_healthy_runs_and_fires_on_a_planted_stall(tmp_path, caplog):
    """No firing over 20 healthy runs of 300 steps, but on a step the machine's load held up (the training thread
    waited for a CPU for at least half the excess): that step was slow, and the trigger says so rightly."""
    from lightning_prof import ProfilerHook

    unexplained = []
    for seed in range(20):
        hook = ProfilerHook(triggers=[SlowStep()], output_dir=str(tmp_path / f"run{seed}"), tensorboard=False)
        load = RunQueueWait()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hookprof"):
            trainer(str(tmp_path), [hook, load], max_steps=300, logger=False).fit(Healthy(seed),
                                                                                  loader(n=64, batch_size=8))
        fired = [r.getMessage() for r in caplog.records if "fired" in r.getMessage()]
        assert len(fired) == sum(hook.hook.fired.values())
        unexplained += unexplained_slow_steps(fired, load.waited)
    assert unexplained == []
    hook = ProfilerHook(triggers=[SlowStep()], output_dir=str(tmp_path / "stall"), tensorboard=False)
    fit_lightning(tmp_path, hook, 80, Planted(at=60, problem="slow"))  # 20 ms steps, one of 320 ms
    assert hook.hook.fired == {"slow_step": 1} and [os.path.basename(p) for p in hook.saved_paths] == [
        "timeline-61.json"]


@pytest.mark.parametrize("make, message", [
    (lambda: SlowStep(factor=1.0), "`factor` must be a number > 1"),
    (lambda: SlowStep(min_excess_seconds=-1), "`min_excess_seconds` must be a number of seconds >= 0"),
    (lambda: SlowStep(window=10, min_steps=20), "make it at most `window`"),
    (lambda: MemoryJump(0), "`bytes` must be an int >= 1"),
    (lambda: NonFinite(3), "`fetch` must be a fetch"),
    (lambda: hookprof.ProfilerHook(triggers=SlowStep()), "`triggers` must be a list"),
    (lambda: hookprof.ProfilerHook(), "or give `triggers`"),
    (lambda: hookprof.ProfilerHook(save_steps=5, keep_last=0), "`keep_last` must be an int >= 1, or None"),
    (lambda: hookprof.ProfilerHook(triggers=[SlowStep()], capture_steps=0), "`capture_steps` must be an int >= 1"),
])
def test_bad_trigger_arguments_are_named_before_training(make, message):
    with pytest.raises((TypeError, ValueError), match=message):
        make()


class SkipsLastBatch(Planted):
    """Returns None (Lightning's way to skip a batch) for each epoch's last batch: that step has no loss."""

    def training_step(self, batch, batch_idx):
        return None if batch_idx == 7 else super().training_step(batch, batch_idx)


def test_a_step_without_the_fetched_value_leaves_the_run_alone(tmp_path, caplog):
    from lightning_prof import ProfilerHook

    hook = ProfilerHook(triggers=[NonFinite("loss"), LossSpike()], output_dir=str(tmp_path), tensorboard=False)
    with caplog.at_level(logging.WARNING, logger="hookprof"):
        fit_lightning(tmp_path, hook, 24, SkipsLastBatch())  # 8 batches an epoch, the 8th skipped
    assert hook.hook.fired == {}
    said = [r.getMessage() for r in caplog.records if "cannot read" in r.getMessage()]
    assert len(said) == 1 and "'loss'" in said[0] and "KeyError" in said[0], said  # once for the shared fetch


def test_hooks_that_differ_only_in_their_triggers_are_two_checkpoint_states_by_name(tmp_path):
    """Triggers are not part of the key (a short key of the schedule): two hooks that differ only in them
    are one key, refused before training (by Lightning, naming state_key), until each has its `name=`."""
    from lightning_prof import ProfilerHook

    def hook(factor, name=None):
        return ProfilerHook(triggers=[SlowStep(factor=factor)], output_dir=str(tmp_path), tensorboard=False,
                            name=name)

    unnamed = [hook(3.0), hook(5.0)]
    assert unnamed[0].state_key == unnamed[1].state_key
    with pytest.raises(RuntimeError, match="state_key` must be unique"):
        trainer(str(tmp_path), unnamed, max_steps=1, logger=False)
    a, b, c = hook(3.0, "a"), hook(5.0, "b"), hook(3.0, "a")
    assert a.state_key != b.state_key and a.state_key == c.state_key
    fit = trainer(str(tmp_path), [a, b], max_steps=1, logger=False)
    fit.fit(Healthy(0), loader(n=8, batch_size=8))
    assert fit.global_step == 1
