"""Each Lightning callback's checkpoint key (`state_key`): short, plain, and the same wherever a run resumes.

The key is the class, the schedule and a user-given `name=`: no path, no quote, no private field. Real
`Trainer.fit`s check what depends on it: a resume from another working directory, Lightning's PyTorch and
simple profilers (which name their spans with it), duplicate keys, and checkpoints that the previous release
saved under its long keys.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import subprocess
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

import hookprof
from hookprof import summary
from lightning_prof import (
    CheckpointSaverHook,
    FeedFnHook,
    FinalOpsHook,
    GlobalStepWaiterHook,
    HookCallback,
    LoggingTensorHook,
    NanTensorHook,
    ProfilerHook,
    SessionRunHook,
    StepCounterHook,
    StopAtStepHook,
    SummarySaverHook,
)
from tests.conftest import FakeClock, timeline_steps
from tests.lightning_models import TinyModel, loader, trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOGGER = "lightning_prof.hook_callback"


class StopAtLoss(SessionRunHook):
    pass


def every_callback(directory: str) -> dict[str, object]:
    """One of each Lightning callback as a user writes it (relative paths, a checkpoint directory in
    `directory`), by the key it must have."""
    loss = summary.scalar("loss", lambda step: step.outputs["loss"], collections=[])
    return {
        "ProfilerHook(save_steps=100)": ProfilerHook(save_steps=100),
        "ProfilerHook(save_secs=30, name=fast)": ProfilerHook(save_secs=30.0, output_dir="prof", name="fast"),
        "SummarySaverHook(save_steps=10)": SummarySaverHook(save_steps=10, output_dir="events", summary_op=loss),
        "SummarySaverHook(save_secs=5, summary_op=summaries)": SummarySaverHook(save_secs=5, summary_op="summaries"),
        "StopAtStepHook(last_step=1000)": StopAtStepHook(last_step=1000),
        "StopAtStepHook(num_steps=10)": StopAtStepHook(num_steps=10),
        "CheckpointSaverHook(save_steps=500)": CheckpointSaverHook(os.path.join(directory, "ckpt"), save_steps=500),
        "StepCounterHook(every_n_steps=100)": StepCounterHook(),
        "LoggingTensorHook(every_n_iter=50)": LoggingTensorHook({"loss": "loss"}, every_n_iter=50),
        "NanTensorHook": NanTensorHook(lambda step: step.outputs["loss"]),
        "FinalOpsHook(name=last)": FinalOpsHook({"loss": "loss"}, name="last"),
        "FeedFnHook": FeedFnHook(lambda: {"lr_scale": 0.5}),
        "GlobalStepWaiterHook(wait_until_step=5)": GlobalStepWaiterHook(5),
        "HookCallback(StopAtLoss, ProfilerHook(save_steps=3))":
            HookCallback([StopAtLoss(), hookprof.ProfilerHook(save_steps=3)]),
    }


def test_every_callback_key_is_short_plain_and_says_what_the_callback_is(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    callbacks = every_callback(str(tmp_path))
    assert {key: callback.state_key for key, callback in callbacks.items()} == {key: key for key in callbacks}
    for callback in callbacks.values():
        key = callback.state_key
        assert len(key) <= 100 and "'" not in key and '"' not in key, key
        # words, numbers and the punctuation of a call: no path, no quote, no source line, no private field
        assert re.fullmatch(r"[A-Za-z][A-Za-z0-9]*(\((\w+=)?[\w.#]+(, (\w+=)?[\w.#()=]+)*\))?", key), key


def test_keys_are_the_same_in_another_process_and_another_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    here = sorted(callback.state_key for callback in every_callback(str(tmp_path)).values())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = ("import json, sys; from tests.test_state_key import every_callback; "
              "print(json.dumps(sorted(c.state_key for c in every_callback(sys.argv[1]).values())))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, *sys.path])}
    done = subprocess.run([sys.executable, "-c", script, str(elsewhere)], capture_output=True, text=True,
                          cwd=str(elsewhere), env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == here


# -- a resume keeps the schedules ------------------------------------------------------------------------------

DURATIONS = {1: 4, 2: 4, 3: 4, 4: 4, 5: 1, 6: 12, 7: 1, 8: 1, 9: 1, 10: 1}  # seconds each global step takes


class Tick(hookprof.SessionRunHook):
    """Moves `clock` by the duration of each finished step."""

    def __init__(self, clock):
        self.clock = clock

    def after_run(self, run_context, run_values):
        self.clock.now += DURATIONS[run_context.session.global_step]


def scheduled(clock):
    """Callbacks as a user writes them in every run (paths relative to where the run starts), one per kind of
    schedule. A step ProfilerHook that lost its schedule goes on from the last multiple of `save_steps`, which
    hides the loss; a summary hook fires at 1, 4, 7 (its first step, then every 3) and a seconds schedule
    counts from the last fire, so the two show whether their schedules came back."""
    loss = summary.scalar("loss", lambda step: step.outputs["loss"], collections=[])
    return [ProfilerHook(save_steps=3, output_dir="timelines", tensorboard=False),
            SummarySaverHook(save_steps=3, output_dir="events", summary_op=loss),
            HookCallback([Tick(clock), hookprof.ProfilerHook(save_secs=10, output_dir="secs", tensorboard=False,
                                                              clock=clock)])]


def summary_steps(directory):
    steps = []
    for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
        steps += [e.step for e in EventFileLoader(path).Load() if e.HasField("summary")]
    return steps


def written(directory):
    """The steps of the step timelines, the seconds timelines and the summaries written in `directory`."""
    return [timeline_steps(os.path.join(directory, name)) for name in ("timelines", "secs")] + [
        summary_steps(os.path.join(directory, "events"))]


WHOLE = [[3, 6, 9], [5, 7], [1, 4, 7, 10]]  # an uninterrupted run of 10 steps
BEFORE, AFTER = [[3], [5], [1, 4]], [[6, 9], [7], [7, 10]]  # that run, cut after step 5 and resumed


def test_a_run_resumed_from_another_working_directory_keeps_the_schedules(tmp_path, monkeypatch):
    whole, first, second = (tmp_path / name for name in ("whole", "first", "second"))
    for directory in (whole, first, second):
        directory.mkdir()
    clock = FakeClock()
    monkeypatch.chdir(whole)
    trainer(str(whole), scheduled(clock), 10, logger=False).fit(TinyModel(), loader())
    assert written(whole) == WHOLE

    clock = FakeClock()
    monkeypatch.chdir(first)
    interrupted = trainer(str(first / "root"), scheduled(clock), 5, logger=False)
    interrupted.fit(TinyModel(), loader())
    ckpt = str(first / "mid.ckpt")
    interrupted.save_checkpoint(ckpt)
    assert sorted(torch.load(ckpt, weights_only=False)["callbacks"]) == [
        "HookCallback(Tick, ProfilerHook(save_secs=10))", "ProfilerHook(save_steps=3)",
        "SummarySaverHook(save_steps=3)"]

    monkeypatch.chdir(second)
    trainer(str(second / "root"), scheduled(clock), 10, logger=False).fit(TinyModel(), loader(), ckpt_path=ckpt)
    assert written(first) == BEFORE
    assert written(second) == AFTER  # what the uninterrupted run wrote after step 5, no more and no fewer


def lightning_profiled_fit(tmp_path, profiler):
    loss = summary.scalar("loss", lambda step: step.outputs["loss"], collections=[])
    callbacks = [ProfilerHook(save_steps=100, output_dir=str(tmp_path / "timelines")),
                 SummarySaverHook(save_steps=2, output_dir=str(tmp_path / "events"), summary_op=loss),
                 StopAtStepHook(last_step=50), CheckpointSaverHook(str(tmp_path / "ckpt"), save_steps=3)]
    trainer(str(tmp_path), callbacks, 6, profiler=profiler).fit(TinyModel(), loader())


def test_lightning_s_pytorch_profiler_writes_a_trace_that_loads(tmp_path):
    lightning_profiled_fit(tmp_path, "pytorch")
    paths = glob.glob(str(tmp_path / "**" / "*.pt.trace.json"), recursive=True)
    assert paths
    names = set()
    for path in paths:
        with open(path) as f:
            names.update(event.get("name", "") for event in json.load(f)["traceEvents"])
    # the callbacks' spans are in it, named by their keys
    assert "[pl][profile][Callback]ProfilerHook(save_steps=100).on_train_batch_end" in names
    assert "[pl][profile][Callback]CheckpointSaverHook(save_steps=3).on_save_checkpoint" in names


def test_lightning_s_simple_profiler_report_lines_stay_short(tmp_path):
    from lightning.pytorch.profilers import SimpleProfiler

    lightning_profiled_fit(tmp_path, SimpleProfiler(dirpath=str(tmp_path), filename="simple"))
    with open(tmp_path / "fit-simple.txt") as f:
        report = f.read().splitlines()
    assert any("[Callback]SummarySaverHook(save_steps=2)." in line for line in report)
    longest = max(report, key=len)
    assert len(longest) < 200, longest


def test_two_callbacks_of_one_key_fail_before_training_and_name_tells_them_apart(tmp_path):
    with pytest.raises(RuntimeError, match=r"state_key` must be unique"):  # Lightning's check of its callbacks
        trainer(str(tmp_path), [ProfilerHook(save_steps=2), ProfilerHook(save_steps=2)], 4)
    a = ProfilerHook(save_steps=2, output_dir=str(tmp_path / "a"), tensorboard=False)
    b = ProfilerHook(save_steps=2, output_dir=str(tmp_path / "b"), tensorboard=False, name="b")
    run = trainer(str(tmp_path), [a, b], 4)
    run.fit(TinyModel(), loader())
    assert timeline_steps(tmp_path / "a") == timeline_steps(tmp_path / "b") == [2, 4]
    ckpt = str(tmp_path / "two.ckpt")
    run.save_checkpoint(ckpt)
    states = torch.load(ckpt, weights_only=False)["callbacks"]
    assert {"ProfilerHook(save_steps=2)", "ProfilerHook(save_steps=2, name=b)"} <= set(states)


class ConfiguresTwoProfilers(TinyModel):
    def __init__(self, directory):
        super().__init__()
        self.directory = directory
        self.steps = 0

    def configure_callbacks(self):  # callbacks Lightning adds without checking their keys
        return [ProfilerHook(save_steps=1, output_dir=os.path.join(self.directory, name)) for name in "ab"]

    def training_step(self, batch, batch_idx):
        self.steps += 1
        return super().training_step(batch, batch_idx)


def test_a_duplicate_key_lightning_does_not_check_fails_before_the_first_step_naming_name(tmp_path):
    model = ConfiguresTwoProfilers(str(tmp_path))
    with pytest.raises(ValueError, match=r"checkpoint key `ProfilerHook\(save_steps=1\)`.*give each its own `name=`"):
        trainer(str(tmp_path), [], 3).fit(model, loader())
    assert model.steps == 0 and not os.path.exists(tmp_path / "a")


@pytest.mark.parametrize("name,error", [("", ValueError), ("a b", ValueError), ("it's", ValueError),
                                        ("runs/fast", ValueError), ("x" * 41, ValueError), (3, TypeError)])
def test_a_bad_name_is_refused_naming_the_argument(name, error):
    with pytest.raises(error, match=r"ProfilerHook\(name=.*\): `name` must be a string of 1 to 40 letters, digits"):
        ProfilerHook(save_steps=1, name=name)
    with pytest.raises(error, match=r"StopAtStepHook\(name=.*\): `name` must be"):
        StopAtStepHook(last_step=1, name=name)


# -- checkpoints of the previous release -------------------------------------------------------------------------


def checkpoint_with_previous_keys(root, callbacks, ckpt):
    """A checkpoint of step 5 as the previous release wrote it: saved now, its callback states moved to the long
    keys that release computed when the Trainer was made (`_previous_key`, the old computation kept for this
    migration, gives them for the callbacks as they are made)."""
    from lightning_prof.hook_callback import _previous_key

    previous = [_previous_key(callback) for callback in callbacks]
    run = trainer(str(root), callbacks, 5, logger=False)
    run.fit(TinyModel(), loader())
    run.save_checkpoint(ckpt)
    checkpoint = torch.load(ckpt, weights_only=False)
    checkpoint["callbacks"] = {key: checkpoint["callbacks"].pop(callback.state_key)
                               for key, callback in zip(previous, callbacks)}
    assert all(len(key) > 100 for key in checkpoint["callbacks"])
    torch.save(checkpoint, ckpt)


def test_the_previous_keys_are_computed_as_the_previous_release_did():
    from lightning_prof.hook_callback import _previous_key

    # as that release wrote them (these two hold no path and no function, so they are the same everywhere)
    assert _previous_key(StopAtStepHook(last_step=5)) == \
        """StopAtStepHook{'hooks': ["StopAtStepHook[('_last_step', 5), ('last_step', 5)]"]}"""
    assert _previous_key(NanTensorHook("loss")) == \
        """NanTensorHook{'hooks': ["NanTensorHook[('fail_on_nan_loss', True), ('loss_tensor', 'loss')]"]}"""


def test_a_checkpoint_under_the_previous_long_keys_restores_the_schedules(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    clock = FakeClock()
    ckpt = str(tmp_path / "previous.ckpt")
    checkpoint_with_previous_keys(tmp_path, scheduled(clock), ckpt)
    assert written(tmp_path) == BEFORE

    resumed = scheduled(clock)
    run = trainer(str(tmp_path), resumed, 10, logger=False)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        run.fit(TinyModel(), loader(), ckpt_path=ckpt)
    assert written(tmp_path) == WHOLE  # the first run's steps and the resumed ones: nothing twice, none missing
    restored = [r for r in caplog.records if "restored the state an earlier hookprof saved" in r.getMessage()]
    assert len(restored) == 3
    run.save_checkpoint(str(tmp_path / "next.ckpt"))  # from now on under the new keys only
    states = torch.load(str(tmp_path / "next.ckpt"), weights_only=False)["callbacks"]
    assert sorted(states) == sorted(callback.state_key for callback in resumed)


def test_a_previous_key_written_elsewhere_restores_by_class_and_schedule(tmp_path, monkeypatch):
    # the previous key held the absolute output_dir (and hookprof's source lines): a run resumed in another
    # directory, or with another hookprof, computes another one; the class and schedule find the state
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    clock = FakeClock()
    ckpt = str(tmp_path / "previous.ckpt")
    monkeypatch.chdir(first)
    checkpoint_with_previous_keys(first, scheduled(clock), ckpt)
    monkeypatch.chdir(second)
    trainer(str(second), scheduled(clock), 10, logger=False).fit(TinyModel(), loader(), ckpt_path=ckpt)
    assert written(first) == BEFORE
    assert written(second) == AFTER


def test_previous_keys_that_could_be_either_callback_s_are_ignored_with_one_warning(tmp_path, monkeypatch, caplog):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()

    def summaries(names):  # two on one schedule: the previous keys told them apart by their directories only
        loss = summary.scalar("loss", lambda step: step.outputs["loss"], collections=[])
        return [SummarySaverHook(save_steps=3, output_dir=directory, summary_op=loss, name=name)
                for directory, name in zip(("a", "b"), names)]

    ckpt = str(tmp_path / "previous.ckpt")
    monkeypatch.chdir(first)
    checkpoint_with_previous_keys(first, summaries((None, "b")), ckpt)

    monkeypatch.chdir(second)  # the keys name first/a and first/b: which callback of this run is whose?
    with caplog.at_level(logging.INFO, logger=LOGGER):
        trainer(str(second), summaries(("a", "b"))[:1], 10, logger=False).fit(TinyModel(), loader(), ckpt_path=ckpt)
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == LOGGER]
    assert len(warned) == 1 and "none is restored" in warned[0].getMessage()
    assert summary_steps(second / "a") == [7, 10]  # from the step alone (1, 4, 7, ...), as the saved one

    monkeypatch.chdir(first)  # from where they were written, each finds its own state under its exact key
    trainer(str(first), summaries(("a", "b")), 10, logger=False).fit(TinyModel(), loader(), ckpt_path=ckpt)
    assert summary_steps(first / "a") == summary_steps(first / "b") == [1, 4, 7, 10]


def test_a_lightning_cli_config_gives_two_profilers_on_one_schedule_their_names(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({"trainer": {"max_steps": 2, "enable_progress_bar": False, "callbacks": [
        {"class_path": "lightning_prof.ProfilerHook",
         "init_args": {"save_steps": 2, "output_dir": str(tmp_path / name), "name": name}} for name in "ab"]}}))
    cli = LightningCLI(TinyModel, run=False, args=["--config", str(config),
                                                    f"--trainer.default_root_dir={tmp_path}"])
    keys = [c.state_key for c in cli.trainer.callbacks if isinstance(c, ProfilerHook)]
    assert keys == ["ProfilerHook(save_steps=2, name=a)", "ProfilerHook(save_steps=2, name=b)"]
    cli.trainer.fit(cli.model, loader())
    assert timeline_steps(tmp_path / "a") == timeline_steps(tmp_path / "b") == [2]
