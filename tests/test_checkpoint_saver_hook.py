"""CheckpointSaverHook: TF1's unit tests (basic_session_run_hooks_test.CheckpointSaverHookTest) ported onto a
fake saver through hookprof's ManualSession + HookedSession, then real Lightning and Keras fits that save at
TF's steps and resume from a saved checkpoint at its step."""

from __future__ import annotations

import errno
import logging
import os

import keras
import numpy as np
import pytest
import torch

import hookprof
from hookprof import HookedSession, ManualSession, SessionRunArgs, StepState
from hookprof._runtime import atomic_file
from hookprof.hooks.checkpoint_saver_hook import (
    CheckpointSaverHook,
    CheckpointSaverListener,
    latest_checkpoint,
    list_variables,
    load_variable,
)
from tests.conftest import FakeClock, RecordingHook
from tests.lightning_models import TinyModel, loader, trainer

# --- TF's unit tests, on a fake saver ---------------------------------------------------------------------


class FakeSaver:
    """TF's Saver interface: `save(sess, save_path, global_step=...)` returns the path it wrote."""

    def __init__(self, fail=None):
        self.steps = []
        self.fail = fail

    def save(self, sess, save_path, global_step=None):
        if self.fail is not None:
            raise self.fail
        self.steps.append(global_step)
        return f"{save_path}-{global_step}"

    def latest(self):
        return self.steps[-1] if self.steps else None


class MockListener(CheckpointSaverListener):
    """TF's MockCheckpointSaverListener: counts calls (and logs their order into `log`)."""

    def __init__(self, log=None, name="l"):
        self.counts = {"begin": 0, "before_save": 0, "after_save": 0, "end": 0}
        self.ask_for_stop = False
        self.log = log if log is not None else []
        self.name = name

    def begin(self):
        self.counts["begin"] += 1
        self.log.append((self.name, "begin"))

    def before_save(self, session, global_step_value):
        self.counts["before_save"] += 1
        self.log.append((self.name, "before_save", global_step_value))

    def after_save(self, session, global_step_value):
        self.counts["after_save"] += 1
        self.log.append((self.name, "after_save", global_step_value))
        return self.ask_for_stop

    def end(self, session, global_step_value):
        self.counts["end"] += 1
        self.log.append((self.name, "end", global_step_value))


class Loop:
    """TF's `monitored_session._HookedSession(sess, [hook])` over a ManualSession whose train op adds 1."""

    def __init__(self, hook, create_session=False, model=None):
        self.hook = hook
        self.session = ManualSession(model=model)
        self.driver = HookedSession([hook], tracer_factory=None)
        self.driver.begin()
        if create_session:  # TF's MonitoredSession calls it; its unit tests on _HookedSession do not
            self.driver.after_create_session(self.session)
        self.should_stop = False

    def run(self):
        session = self.session
        self.driver.before_run(session, session.global_step, SessionRunArgs())
        session.global_step += 1
        self.should_stop = self.driver.after_run(lambda: StepState(session.global_step)) or self.should_stop
        return self.should_stop

    def end(self):
        self.hook.end(self.session)


def test_raise_when_saver_and_scaffold_both_present(tmp_dir):
    with pytest.raises(ValueError, match="^You cannot provide both saver and scaffold.$"):
        CheckpointSaverHook(tmp_dir, save_steps=1, saver=FakeSaver(), scaffold=object())


def test_raise_in_both_secs_and_steps(tmp_dir):
    with pytest.raises(ValueError, match="^Can not provide both every_secs and every_steps.$"):
        CheckpointSaverHook(tmp_dir, save_secs=10, save_steps=20)


def test_raise_in_none_secs_and_steps(tmp_dir):
    with pytest.raises(ValueError, match="^Either every_secs or every_steps should be provided.$"):
        CheckpointSaverHook(tmp_dir)


def test_other_bad_arguments_are_named(tmp_dir):
    with pytest.raises(ValueError, match="save_steps"):
        CheckpointSaverHook(tmp_dir, save_steps=0)
    with pytest.raises(TypeError, match="`saver` must have TF's `save"):
        CheckpointSaverHook(tmp_dir, save_steps=1, saver=42)
    with pytest.raises(TypeError, match=r"listeners\[0\]"):
        CheckpointSaverHook(tmp_dir, save_steps=1, saver=FakeSaver(), listeners=[object()])
    with pytest.raises(ValueError, match="checkpoint_basename"):
        CheckpointSaverHook(tmp_dir, save_steps=1, checkpoint_basename="a/b")
    with pytest.raises(TypeError, match="checkpoint_dir"):
        CheckpointSaverHook(None, save_steps=1)


# TF's tests on the default Saver, read back as TF read them (`checkpoint_utils.load_variable(model_dir,
# global_step.name)`): driven by hand, the core hook saves with `session_saver`.

def _saved_step(directory):
    return int(load_variable(directory, "global_step"))


@pytest.mark.parametrize("schedule", [{"save_secs": 2}, {"save_steps": 2}])
def test_default_saver_saves_in_first_step(tmp_dir, schedule):
    loop = Loop(CheckpointSaverHook(tmp_dir, **schedule))
    loop.run()
    assert _saved_step(tmp_dir) == 1


def test_default_saver_save_steps_saves_periodically(tmp_dir):
    loop = Loop(CheckpointSaverHook(tmp_dir, save_steps=2))
    loop.run()
    assert _saved_step(tmp_dir) == 1
    loop.run()  # step 2: not saved
    assert _saved_step(tmp_dir) == 1
    loop.run()
    assert _saved_step(tmp_dir) == 3
    loop.run()
    assert _saved_step(tmp_dir) == 3
    loop.run()
    assert _saved_step(tmp_dir) == 5


def test_default_saver_save_secs_saves_periodically(tmp_dir):
    clock = FakeClock()
    loop = Loop(CheckpointSaverHook(tmp_dir, save_secs=2, clock=clock))
    loop.run()
    assert _saved_step(tmp_dir) == 1
    clock.now += 1.0
    loop.run()  # 1 s later: not saved
    assert _saved_step(tmp_dir) == 1
    clock.now += 1.5
    loop.run()
    assert _saved_step(tmp_dir) == 3
    clock.now += 0.5
    loop.run()
    assert _saved_step(tmp_dir) == 3


def test_default_saver_saves_at_end(tmp_dir):
    loop = Loop(CheckpointSaverHook(tmp_dir, save_secs=2))
    loop.run()
    loop.run()
    loop.end()
    assert _saved_step(tmp_dir) == 2
    assert [os.path.basename(p) for p in loop.hook.saved_paths] == ["model.ckpt-1.npz", "model.ckpt-2.npz"]


def test_default_saver_holds_the_models_state_and_listeners_see_every_save(tmp_dir):
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    listener = MockListener()
    hook = CheckpointSaverHook(tmp_dir, save_steps=2, listeners=[listener])
    loop = Loop(hook, create_session=True, model=model)
    before = model[0].weight.detach().numpy().copy()
    loop.run()
    with torch.no_grad():
        model[0].weight.add_(1.0)
    loop.run()
    loop.run()
    assert listener.counts == {"begin": 1, "before_save": 2, "after_save": 2, "end": 0}  # at 0 and 2
    latest = latest_checkpoint(tmp_dir)
    assert os.path.basename(latest) == "model.ckpt-2.npz"
    assert list_variables(latest) == [("global_step", []), ("model/0.bias", [2]), ("model/0.weight", [2, 3]),
                                      ("model/2.bias", [1]), ("model/2.weight", [1, 2])]
    np.testing.assert_array_equal(load_variable(tmp_dir, "model/0.weight"), model[0].weight.detach().numpy())
    np.testing.assert_array_equal(load_variable(os.path.join(tmp_dir, "model.ckpt-0.npz"), "model/0.weight"),
                                  before)  # (step 0's weights, before the change)
    with pytest.raises(KeyError, match="'model/9.weight' is not in .*it holds"):
        load_variable(tmp_dir, "model/9.weight")
    empty = os.path.join(tmp_dir, "empty")
    os.mkdir(empty)
    with pytest.raises(ValueError, match="No checkpoint in"):
        load_variable(empty, "global_step")


def test_default_saver_listener_stops_training_in_after_save(tmp_dir):
    listener = MockListener()
    listener.ask_for_stop = True
    loop = Loop(CheckpointSaverHook(tmp_dir, save_steps=1, listeners=[listener]))
    assert loop.run() is True  # TF: a listener's after_save returning True requests a stop
    assert _saved_step(tmp_dir) == 1


def test_a_scaffolds_saver_is_used(tmp_dir):
    class Scaffold:
        saver = FakeSaver()

    loop = Loop(CheckpointSaverHook(tmp_dir, save_steps=1, scaffold=Scaffold()))
    loop.run()
    assert Scaffold.saver.steps == [1]


def test_save_secs_saves_in_first_step(tmp_dir):
    saver = FakeSaver()
    loop = Loop(CheckpointSaverHook(tmp_dir, save_secs=2, saver=saver))
    loop.run()
    assert saver.latest() == 1


def test_save_secs_calls_listeners_at_begin_and_end(tmp_dir):
    listener = MockListener()
    loop = Loop(CheckpointSaverHook(tmp_dir, save_secs=2, saver=FakeSaver(), listeners=[listener]))
    loop.run()  # hook runs here
    loop.run()  # hook won't run here, so it does at end
    loop.end()  # hook runs here
    assert listener.counts == {"begin": 1, "before_save": 2, "after_save": 2, "end": 1}


def test_listener_with_monitored_session(tmp_dir):
    listener, saver = MockListener(), FakeSaver()
    loop = Loop(CheckpointSaverHook(tmp_dir, save_steps=1, saver=saver, listeners=[listener]), create_session=True)
    loop.run()
    loop.run()
    loop.end()
    assert loop.session.global_step == 2
    assert listener.counts == {"begin": 1, "before_save": 3, "after_save": 3, "end": 1}
    assert saver.steps == [0, 1, 2]


def test_listener_stops_training_in_after_save(tmp_dir):
    listener = MockListener()
    loop = Loop(CheckpointSaverHook(tmp_dir, save_steps=1, saver=FakeSaver(), listeners=[listener]),
                create_session=True)
    assert not loop.run()
    assert not loop.run()
    listener.ask_for_stop = True
    assert loop.run()


def test_two_listeners_are_called_in_order_around_each_save(tmp_dir):
    calls = []
    listeners = [MockListener(calls, "a"), MockListener(calls, "b")]

    class Saver(FakeSaver):
        def save(self, sess, save_path, global_step=None):
            calls.append(("save", global_step))
            return super().save(sess, save_path, global_step)

    loop = Loop(CheckpointSaverHook(tmp_dir, save_steps=1, saver=Saver(), listeners=listeners), create_session=True)
    loop.run()
    loop.run()
    loop.end()
    assert listeners[0].counts == listeners[1].counts == {"begin": 1, "before_save": 3, "after_save": 3, "end": 1}
    assert calls[:2] == [("a", "begin"), ("b", "begin")]
    for i, step in enumerate([0, 1, 2]):
        assert calls[2 + 5 * i: 7 + 5 * i] == [("a", "before_save", step), ("b", "before_save", step),
                                               ("save", step), ("a", "after_save", step), ("b", "after_save", step)]
    assert calls[-2:] == [("a", "end", 2), ("b", "end", 2)]


def test_save_secs_saves_periodically(tmp_dir):
    clock, saver = FakeClock(1484695987.209386), FakeSaver()
    start = clock.now
    loop = Loop(CheckpointSaverHook(tmp_dir, save_secs=2, saver=saver, clock=clock))
    loop.run()  # Saved.
    clock.now = start + 0.5
    loop.run()  # Not saved.
    assert saver.latest() == 1
    clock.now = start + 2.5
    loop.run()  # Saved.
    clock.now = start + 2.6
    loop.run()
    clock.now = start + 2.7
    loop.run()
    assert saver.latest() == 3
    clock.now = start + 10
    loop.run()  # Saved.
    assert saver.steps == [1, 3, 6]


def test_save_secs_calls_listeners_periodically(tmp_dir):
    clock, listener = FakeClock(1484695987.209386), MockListener()
    start = clock.now
    loop = Loop(CheckpointSaverHook(tmp_dir, save_secs=2, saver=FakeSaver(), listeners=[listener], clock=clock))
    for offset in (0.5, 0.5, 3.0, 3.5, 4.0, 6.5, 7.0):  # the hook runs at 0.5, 3.0 and 6.5
        clock.now = start + offset
        loop.run()
    clock.now = start + 7.5
    loop.end()  # and here
    assert listener.counts == {"begin": 1, "before_save": 4, "after_save": 4, "end": 1}


def test_save_steps_saves_in_first_step(tmp_dir):
    saver = FakeSaver()
    Loop(CheckpointSaverHook(tmp_dir, save_steps=2, saver=saver)).run()
    assert saver.latest() == 1


def test_save_steps_saves_periodically(tmp_dir):
    saver = FakeSaver()
    loop = Loop(CheckpointSaverHook(tmp_dir, save_steps=2, saver=saver))
    expected_latest = [1, 1, 3, 3, 5]
    for latest in expected_latest:
        loop.run()
        assert saver.latest() == latest


def test_save_saves_at_end(tmp_dir):
    saver = FakeSaver()
    loop = Loop(CheckpointSaverHook(tmp_dir, save_secs=2, saver=saver))
    loop.run()
    loop.run()
    loop.end()
    assert saver.steps == [1, 2]


def test_saves_at_create_session_on_schedule_and_at_end_with_tfs_log_lines(tmp_dir, caplog):
    # TF's test_summary_writer_defs: checkpoints at steps 0 (session created), 2 (schedule) and 3 (end)
    saver = FakeSaver()
    hook = CheckpointSaverHook(tmp_dir, save_steps=2, saver=saver)
    with caplog.at_level(logging.INFO, logger="hookprof.hooks.checkpoint_saver_hook"):
        loop = Loop(hook, create_session=True)  # Checkpoint saved at step 0.
        loop.run()  # No checkpoint saved at step 1.
        loop.run()  # Checkpoint saved at step 2.
        loop.run()  # No checkpoint saved at step 3.
        loop.end()  # Checkpoint saved at the last step (3)
    assert saver.steps == [0, 2, 3]
    save_path = os.path.join(tmp_dir, "model.ckpt")
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("Saving")] == [
        f"Saving checkpoints for {s} into {save_path}." for s in (0, 2, 3)]
    assert hook.saved_paths == [f"{save_path}-{s}" for s in (0, 2, 3)]
    assert latest_checkpoint(tmp_dir) == f"{save_path}-3"


def test_save_checkpoint_before_first_train_step(tmp_dir):
    saver = FakeSaver()
    loop = Loop(CheckpointSaverHook(tmp_dir, save_steps=2, saver=saver), create_session=True)
    assert saver.latest() == 0  # saved at step 0
    loop.run()
    assert saver.latest() == 0  # not after one step
    loop.run()
    assert saver.latest() == 2  # after save_steps


def test_end_does_not_save_a_step_saved_already(tmp_dir):
    saver, listener = FakeSaver(), MockListener()
    loop = Loop(CheckpointSaverHook(tmp_dir, save_steps=2, saver=saver, listeners=[listener]), create_session=True)
    loop.run()
    loop.run()
    loop.end()
    assert saver.steps == [0, 2]
    assert listener.log[-1] == ("l", "end", 2)


def test_idle_steps_are_quiet(tmp_dir):
    hook = CheckpointSaverHook(tmp_dir, save_steps=3, saver=FakeSaver())
    assert not hook.quiet_on(0)  # never saved yet: the first step saves (TF without after_create_session)
    loop = Loop(hook, create_session=True)
    quiet = []
    for _ in range(7):
        quiet.append(hook.quiet_on(loop.session.global_step))
        loop.run()
    assert quiet == [True, True, False, True, True, False, True]  # steps ending at 3 and 6 save
    assert hook._saver.steps == [0, 3, 6]


def test_a_callable_saver_gets_the_path_and_the_state_file_lists_the_checkpoints(tmp_dir):
    def save(path):
        with atomic_file.atomic_write(path + ".bin") as f:
            f.write(b"x")
        return path + ".bin"

    hook = CheckpointSaverHook(tmp_dir, save_steps=2, saver=save, checkpoint_basename="weights")
    loop = Loop(hook, create_session=True)
    for _ in range(3):
        loop.run()
    loop.end()
    names = [f"weights-{s}.bin" for s in (0, 2, 3)]
    assert sorted(n for n in os.listdir(tmp_dir) if n.endswith(".bin")) == names
    with open(os.path.join(tmp_dir, "checkpoint")) as f:
        assert f.read() == 'model_checkpoint_path: "weights-3.bin"\n' + "".join(
            f'all_model_checkpoint_paths: "{n}"\n' for n in names)
    assert latest_checkpoint(tmp_dir) == os.path.join(tmp_dir, "weights-3.bin")
    # a later run in the same directory keeps the earlier checkpoints listed
    hook2 = CheckpointSaverHook(tmp_dir, save_steps=2, saver=save, checkpoint_basename="weights")
    Loop(hook2, create_session=False).run()
    assert hook2.saved_paths[-1] == os.path.join(tmp_dir, "weights-1.bin")
    assert hook2.saved_paths[:3] == [os.path.join(tmp_dir, n) for n in names]


def test_a_failed_save_is_counted_and_warned_once_and_training_goes_on(tmp_dir, caplog):
    saver, listener = FakeSaver(fail=OSError(errno.ENOSPC, "No space left on device")), MockListener()
    hook = CheckpointSaverHook(tmp_dir, save_steps=1, saver=saver, listeners=[listener])
    with caplog.at_level(logging.WARNING):
        loop = Loop(hook, create_session=True)
        for _ in range(3):
            assert not loop.run()
        loop.end()
    assert hook.dropped_outputs == 4  # steps 0..3
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "No space left on device" in warnings[0].getMessage()
    assert listener.counts == {"begin": 1, "before_save": 4, "after_save": 0, "end": 1}
    assert latest_checkpoint(tmp_dir) is None


def test_a_restored_schedule_does_not_save_its_step_again(tmp_dir):
    saver = FakeSaver()
    first = CheckpointSaverHook(tmp_dir, save_steps=3, saver=saver)
    loop = Loop(first, create_session=True)
    for _ in range(4):
        loop.run()
    state = first.state_dict()  # what a Lightning checkpoint of step 4 holds: last save at 3
    assert saver.steps == [0, 3]

    resumed_saver = FakeSaver()
    resumed = CheckpointSaverHook(tmp_dir, save_steps=3, saver=resumed_saver)
    driver = HookedSession([resumed], tracer_factory=None)
    driver.begin()
    resumed.load_state_dict(state)
    session = ManualSession(global_step=3)
    driver.after_create_session(session)
    assert resumed_saver.steps == []
    # without a saved schedule (a Keras checkpoint), a step schedule goes on from the last multiple of save_steps
    # (hookprof's PeriodicHook rule): resumed at 4 or 6, the next save is at 6 or 9; a seconds schedule saves the
    # state at the resumed step, as TF's after_create_session did
    for step, expected in ((4, []), (6, [])):
        other = CheckpointSaverHook(tmp_dir, save_steps=3, saver=FakeSaver())
        other.begin()
        other.after_create_session(ManualSession(global_step=step), None)
        assert other._saver.steps == expected
    by_secs = CheckpointSaverHook(tmp_dir, save_secs=60, saver=FakeSaver())
    by_secs.begin()
    by_secs.after_create_session(ManualSession(global_step=4), None)
    assert by_secs._saver.steps == [4]


# --- a real Lightning fit ---------------------------------------------------------------------------------

class StepRecorder(CheckpointSaverListener):
    def __init__(self):
        self.saved = []

    def after_save(self, session, global_step_value):
        self.saved.append(global_step_value)


def _ckpt_steps(directory, extension):
    names = [n for n in os.listdir(directory) if n.startswith("model.ckpt-") and n.endswith(extension)]
    return sorted(int(n[len("model.ckpt-"):-len(extension)]) for n in names)


def test_lightning_saves_at_tfs_steps_and_fit_resumes_from_a_checkpoint(tmp_dir):
    import lightning_prof
    from lightning_prof import CheckpointSaverHook as LightningCheckpointSaverHook

    ckpt_dir = os.path.join(tmp_dir, "ckpt")
    recorder = StepRecorder()
    hook = LightningCheckpointSaverHook(ckpt_dir, save_steps=3, listeners=[recorder])
    trainer(tmp_dir, [hook], max_steps=7).fit(TinyModel(), loader())
    assert recorder.saved == [0, 3, 6, 7]  # session created, schedule, end
    assert _ckpt_steps(ckpt_dir, ".ckpt") == [0, 3, 6, 7]
    for step in (0, 3, 6, 7):
        checkpoint = torch.load(os.path.join(ckpt_dir, f"model.ckpt-{step}.ckpt"), weights_only=False)
        assert checkpoint["global_step"] == step
    assert latest_checkpoint(ckpt_dir) == os.path.join(ckpt_dir, "model.ckpt-7.ckpt")
    assert not [n for n in os.listdir(ckpt_dir) if n.endswith(".tmp")]
    assert hook.hook.dropped_outputs == 0

    recording, resumed_recorder = RecordingHook(), StepRecorder()
    resumed_hook = LightningCheckpointSaverHook(ckpt_dir, save_steps=3, listeners=[resumed_recorder])
    resumed = trainer(tmp_dir, [resumed_hook, lightning_prof.HookCallback([recording])], max_steps=7)
    resumed.fit(TinyModel(), loader(), ckpt_path=os.path.join(ckpt_dir, "model.ckpt-3.ckpt"))
    first_step = next(c[1] for c in recording.calls if c[0] == "before_run")
    assert first_step == 3  # the global step continues from the checkpoint's
    assert resumed.global_step == 7
    assert resumed_recorder.saved == [6, 7]  # the schedule came back with the checkpoint: step 3 not saved again


def test_lightning_full_disk_does_not_end_training(tmp_dir, caplog):
    from lightning_prof import CheckpointSaverHook as LightningCheckpointSaverHook

    class FullDisk(atomic_file.FileLayer):
        def replace(self, source, target):
            raise OSError(errno.ENOSPC, "No space left on device")

    ckpt_dir = os.path.join(tmp_dir, "ckpt")
    hook = LightningCheckpointSaverHook(ckpt_dir, save_steps=2)
    fit_trainer = trainer(tmp_dir, [hook], max_steps=4)
    with atomic_file.use_file_layer(FullDisk()), caplog.at_level(logging.WARNING):
        fit_trainer.fit(TinyModel(), loader())
    assert fit_trainer.global_step == 4
    assert hook.hook.dropped_outputs == 3  # steps 0, 2, 4
    assert os.listdir(ckpt_dir) == []  # no checkpoint, no temp file left
    assert sum("No space left on device" in r.getMessage() for r in caplog.records) == 1


# --- a real Keras fit -------------------------------------------------------------------------------------

def _keras_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def _keras_data(n=48):
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, 8)).astype("float32"), rng.standard_normal((n, 1)).astype("float32")


class WeightsAtSave(CheckpointSaverListener):
    def __init__(self):
        self.weights = {}

    def before_save(self, session, global_step_value):
        self.weights[global_step_value] = [np.array(w) for w in session.model.get_weights()]


def test_keras_saves_at_tfs_steps_and_load_model_resumes_at_its_step(tmp_dir):
    import keras_prof
    from keras_prof import CheckpointSaverHook as KerasCheckpointSaverHook

    x, y = _keras_data()
    weights = WeightsAtSave()
    hook = KerasCheckpointSaverHook(tmp_dir, save_steps=5, listeners=[weights])
    _keras_model().fit(x, y, batch_size=8, epochs=2, callbacks=[hook], verbose=0)  # 12 steps
    assert _ckpt_steps(tmp_dir, ".keras") == [0, 5, 10, 12]
    assert latest_checkpoint(tmp_dir) == os.path.join(tmp_dir, "model.ckpt-12.keras")
    assert not [n for n in os.listdir(tmp_dir) if n.endswith(".tmp")]

    model = keras.models.load_model(os.path.join(tmp_dir, "model.ckpt-5.keras"))
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 5
    for loaded, saved in zip(model.get_weights(), weights.weights[5]):
        np.testing.assert_array_equal(loaded, saved)

    recording, recorder = RecordingHook(), StepRecorder()
    resumed_hook = KerasCheckpointSaverHook(tmp_dir, save_steps=5, listeners=[recorder])
    model.fit(x, y, batch_size=8, epochs=1, callbacks=[resumed_hook, keras_prof.HookCallback([recording])],
              verbose=0)
    first_step = next(c[1] for c in recording.calls if c[0] == "before_run")
    assert first_step == 5  # optimizer.iterations continued from the checkpoint's
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 11
    assert recorder.saved == [10, 11]  # step 5 is not saved again; 10 on schedule, 11 at the end


# --- real faults (issue 29): a full disk under a user's saver, a full TMPDIR, a bad checkpoint_dir -------------

def test_a_bad_checkpoint_dir_is_named_as_checkpoint_dir(tmp_dir):
    a_file = os.path.join(tmp_dir, "a-file")
    with open(a_file, "w"):
        pass
    with pytest.raises(ValueError) as raised:
        CheckpointSaverHook(os.path.join(a_file, "ckpt"), save_steps=1, saver=FakeSaver())
    message = str(raised.value)
    assert message.startswith("`CheckpointSaverHook(checkpoint_dir=") and "pass a directory for `checkpoint_dir`" in \
        message and "output_dir" not in message
    with pytest.raises(TypeError, match="`strict` must be True or False"):
        CheckpointSaverHook(tmp_dir, save_steps=1, saver=FakeSaver(), strict="yes")


def test_any_error_of_a_saver_is_a_failed_save_unless_strict(tmp_dir, caplog):
    hook = CheckpointSaverHook(tmp_dir, save_steps=1, saver=FakeSaver(fail=RuntimeError("file write failed")))
    with caplog.at_level(logging.WARNING):
        loop = Loop(hook, create_session=True)
        loop.run()
        loop.end()
    assert hook.failed_saves == hook.dropped_outputs == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "RuntimeError: file write failed" in warnings[0]
    assert os.path.join(tmp_dir, "model.ckpt-0") in warnings[0]
    strict = CheckpointSaverHook(tmp_dir, save_steps=1, saver=FakeSaver(fail=RuntimeError("boom")), strict=True)
    with pytest.raises(RuntimeError, match="boom"):
        Loop(strict, create_session=True)


@pytest.fixture
def full_tmpfs(tmp_path):
    from tests.reliability.real_disk import Tmpfs

    disk = Tmpfs(str(tmp_path / "full"), size="1m")
    try:
        disk.fill()
        yield disk
    finally:
        disk.unmount()


def test_lightning_user_saver_torch_save_on_a_real_full_disk_does_not_end_training(tmp_dir, full_tmpfs, caplog):
    """torch.save on a full disk raises RuntimeError (PytorchStreamWriter), not OSError: the old code let it
    end the fit."""
    from lightning_prof import CheckpointSaverHook as LightningCheckpointSaverHook

    model = TinyModel()

    def save(path):
        torch.save(model.state_dict(), path + ".pt")
        return path + ".pt"

    ckpt_dir = os.path.join(full_tmpfs.path, "ckpt")
    hook = LightningCheckpointSaverHook(ckpt_dir, save_steps=2, saver=save)
    fit_trainer = trainer(tmp_dir, [hook], max_steps=4)
    with caplog.at_level(logging.WARNING):
        fit_trainer.fit(model, loader())
    assert fit_trainer.global_step == 4
    assert hook.hook.failed_saves == 3  # steps 0, 2, 4
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and "Could not save the checkpoint" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert os.path.join(ckpt_dir, "model.ckpt-0") in warnings[0] and "RuntimeError" in warnings[0]
    assert f"{ckpt_dir} is full" in warnings[0]
    assert latest_checkpoint(ckpt_dir) is None

    strict = LightningCheckpointSaverHook(ckpt_dir, save_steps=2, saver=save, strict=True)
    with pytest.raises(RuntimeError):
        trainer(tmp_dir, [strict], max_steps=4).fit(model, loader())


def test_keras_save_with_only_tmpdir_full_names_tmpdir_not_the_checkpoint_dir(tmp_dir, full_tmpfs, monkeypatch,
                                                                               caplog):
    """Keras writes a model's assets into TMPDIR before zipping them into the .keras file; with TMPDIR full (a
    real tmpfs, filled once the run has started: Python's tempfile chose it then) and the checkpoint directory
    with room, the warning says which directory is full instead of blaming the checkpoint directory."""
    import tempfile

    from keras_prof import CheckpointSaverHook as KerasCheckpointSaverHook

    @keras.saving.register_keras_serializable("hookprof_tests")
    class Vocabulary(keras.layers.Layer):
        def call(self, x):
            return x

        def save_assets(self, directory):
            with open(os.path.join(directory, "vocabulary.txt"), "w") as f:
                f.write("token\n" * 1000)

        def load_assets(self, directory):
            pass

    monkeypatch.setattr(tempfile, "tempdir", full_tmpfs.path)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), Vocabulary(), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    x, y = _keras_data(16)
    ckpt_dir = os.path.join(tmp_dir, "ckpt")
    hook = KerasCheckpointSaverHook(ckpt_dir, save_steps=2)
    with caplog.at_level(logging.WARNING):
        model.fit(x, y, batch_size=4, epochs=1, callbacks=[hook], verbose=0)
    assert hook.hook.failed_saves == 3  # steps 0, 2, 4: Keras' own temporaries cannot be written
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and "Could not save the checkpoint" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert f"the temporary directory {full_tmpfs.path} (TMPDIR) is full" in warnings[0]
    assert "the checkpoint directory has room" in warnings[0]
    assert not [n for n in os.listdir(ckpt_dir) if n.endswith(".tmp")]


@pytest.mark.parametrize("order", ["saver first", "saver last"])
def test_a_resumed_run_keeps_the_schedules_whatever_the_order_of_the_callbacks(tmp_dir, order):
    """A checkpoint written by CheckpointSaverHook in a step is taken before the later callbacks' after_run of
    that step: their saved schedules must still be the ones they have after it (TF's saver ran after the step)."""
    import lightning_prof
    from lightning_prof import CheckpointSaverHook as LightningCheckpointSaverHook

    def run(out, max_steps, ckpt_path=None):
        profiler = lightning_prof.ProfilerHook(save_steps=4, output_dir=os.path.join(tmp_dir, out),
                                               tensorboard=False)
        loss = hookprof.summary.scalar("loss", lambda s: s.outputs["loss"])
        summaries = lightning_prof.SummarySaverHook(save_steps=4, output_dir=os.path.join(tmp_dir, out),
                                                    summary_op=loss)
        saver = LightningCheckpointSaverHook(os.path.join(tmp_dir, out, "ckpt"), save_steps=8)
        callbacks = [saver, profiler, summaries] if order == "saver first" else [profiler, summaries, saver]
        trainer(tmp_dir, callbacks, max_steps=max_steps).fit(TinyModel(), loader(n=160), ckpt_path=ckpt_path)
        return [int(os.path.basename(p).split("-")[1].split(".")[0]) for p in profiler.saved_paths]

    def summary_steps(out):
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        accumulator = EventAccumulator(os.path.join(tmp_dir, out))
        accumulator.Reload()
        return [event.step for event in accumulator.Tensors("loss")]

    assert run("whole", 16) == [4, 8, 12, 16]
    run("first", 8)
    resumed = run("resumed", 16, os.path.join(tmp_dir, "first", "ckpt", "model.ckpt-8.ckpt"))
    assert resumed == [12, 16]
    whole = summary_steps("whole")
    assert len(whole) >= 4 and summary_steps("resumed") == [step for step in whole if step > 8]


@pytest.mark.parametrize("tamper, why", [
    (lambda state: state["hooks"][0]["timer"].update(last_triggered_step="8"), "is not one it writes"),
    (lambda state: state["hooks"][0]["timer"].update(last_triggered_step=-4), "is not one it writes"),
    (lambda state: state["hooks"][0].update(timer=[8]), "is not one it writes"),
    (lambda state: state["hooks"][0]["timer"].update(last_triggered_step=10**9), "after the resumed run's step 8"),
    (lambda state: state.update(hooks={"a": 1}), "not one it writes"),
])
def test_tampered_hook_state_in_a_checkpoint_is_said_once_and_the_schedule_starts_afresh(tmp_dir, caplog, tamper,
                                                                                       why):
    import lightning_prof
    from lightning_prof import CheckpointSaverHook as LightningCheckpointSaverHook

    def run(out, max_steps, ckpt_path=None):
        profiler = lightning_prof.ProfilerHook(save_steps=4, output_dir=os.path.join(tmp_dir, out),
                                               tensorboard=False)
        saver = LightningCheckpointSaverHook(os.path.join(tmp_dir, out, "ckpt"), save_steps=8)
        trainer(tmp_dir, [profiler, saver], max_steps=max_steps).fit(TinyModel(), loader(n=160), ckpt_path=ckpt_path)
        return profiler, [int(os.path.basename(p).split("-")[1].split(".")[0]) for p in profiler.saved_paths]

    profiler, _ = run("first", 8)
    checkpoint = torch.load(os.path.join(tmp_dir, "first", "ckpt", "model.ckpt-8.ckpt"), weights_only=False)
    tamper(checkpoint["callbacks"][profiler.state_key])
    torch.save(checkpoint, os.path.join(tmp_dir, "tampered.ckpt"))
    with caplog.at_level(logging.WARNING):
        _, resumed = run("resumed", 16, os.path.join(tmp_dir, "tampered.ckpt"))
    assert resumed == [12, 16]  # as a resume without a saved schedule: from the last multiple of save_steps
    (warning,) = [r.getMessage() for r in caplog.records if "ignores" in r.getMessage()]
    assert why in warning and "ProfilerHook" in warning


def test_an_older_keras_saves_through_a_claimed_scratch_directory_and_sweeps_dead_ones(tmp_dir):
    """An older Keras saves to a path only: the model goes through a scratch directory beside the checkpoint,
    claimed by a lock while the save runs. A save killed midway (a process that died inside it) leaves one that
    the next save removes; a live process's, mid-save, is left alone; the fit's own leave nothing."""
    import signal
    import subprocess
    import sys
    import textwrap

    from keras_prof.callbacks import save_through_directory

    def held(then):  # a process inside a save's scratch directory in tmp_dir; `then` ends it
        return subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
            import os, sys, time
            from hookprof._runtime.private_dir import claimed_directory
            with claimed_directory(".keras-save-", {tmp_dir!r}) as path:
                print(path, flush=True)
                {then}
        """)], stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))

    live = held("time.sleep(600)")
    dead = None
    try:
        live_path = live.stdout.readline().strip()
        dead = held("os._exit(0)")  # (after the live one's claim, which swept; os._exit: nothing cleaned)
        dead_path = dead.stdout.readline().strip()
        dead.wait(30)
        assert os.path.isdir(dead_path) and os.path.isdir(live_path)
        model = _keras_model()
        target = os.path.join(tmp_dir, "model.keras")
        with open(target, "wb") as out:
            save_through_directory(model, out, tmp_dir)  # (on this Keras too: its save takes a path)
        assert keras.models.load_model(target).count_params() == model.count_params()  # whole, loadable
        left = sorted(name for name in os.listdir(tmp_dir) if name.startswith(".keras-save-"))
        assert left == [os.path.basename(live_path)]  # the dead one's swept, the live one's kept, ours gone
    finally:
        live.send_signal(signal.SIGKILL)
        live.wait()
        for process in (dead, live):
            if process is not None:
                process.stdout.close()


def test_default_saver_keeps_a_bfloat16_models_weights_as_float32(tmp_dir):
    """numpy has no bfloat16: the saver reads a bf16 model's weights as hookprof's summaries read tensors
    (`hookprof.summary.to_numpy`: float32, every value exact), where `tensor.numpy()` raised."""
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    Loop(CheckpointSaverHook(tmp_dir, save_steps=1), create_session=True, model=model).run()
    saved = load_variable(tmp_dir, "model/weight")
    assert saved.dtype == np.float32
    np.testing.assert_array_equal(saved, model.weight.detach().float().numpy())
