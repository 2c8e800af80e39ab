"""StopAtStepHook, NanTensorHook and FinalOpsHook: TF1's unit tests ported (driven by hand through
`HookedSession`), then each hook in a real Lightning fit and a real Keras fit."""

import logging
import math

import keras
import numpy as np
import pytest
import torch

from hookprof import HookedSession, ManualSession, SessionRunArgs, StepState, step_feeds
from hookprof.hooks.final_ops_hook import FinalOpsHook
from hookprof.hooks.nan_tensor_hook import NanLossDuringTrainingError, NanTensorHook, is_nan
from hookprof.hooks.stop_at_step_hook import StopAtStepHook
from hookprof.tracing import HostTracer, StepTraceCoordinator, fit_traces
from tests.conftest import NoFastPath, RecordingHook

# -- driving hooks by hand, as TF's tests drive `monitored_session._HookedSession` ----------------------------


def hooked(hooks, global_step=0):
    """A driver and a session after `begin` / `after_create_session`, as TF's tests set them up."""
    session = ManualSession(global_step=global_step)
    driver = HookedSession(hooks, HostTracer, StepTraceCoordinator())
    driver.begin()
    driver.after_create_session(session)
    return driver, session


def run(driver, session, advance=0, outputs=None):
    """`mon_sess.run(train_op)`: one step that moves the global step by `advance` (0: TF's `no_op`).
    Returns whether a hook requested a stop in this step (TF: `mon_sess.should_stop()`)."""
    driver.before_run(session, object(), SessionRunArgs(feed_dict={"batch_idx": 0}))
    session.global_step += advance
    return driver.after_run(lambda: StepState(session.global_step, outputs or {}, session=session))


both_paths = pytest.mark.parametrize("wrap", [lambda h: h, NoFastPath], ids=["quiet_on", "tf_path"])


def test_stop_at_step_arguments_fail_with_tfs_messages():
    # TF: test_raise_in_both_last_step_and_num_steps
    with pytest.raises(ValueError, match=r"^Only one of num_steps or last_step can be specified\.$"):
        StopAtStepHook(num_steps=10, last_step=20)
    with pytest.raises(ValueError, match=r"^One of num_steps or last_step must be specified\.$"):
        StopAtStepHook()
    with pytest.raises(ValueError, match=r"`StopAtStepHook\(num_steps=0\)`: `num_steps` must be an int >= 1"):
        StopAtStepHook(num_steps=0)
    with pytest.raises(TypeError, match=r"`StopAtStepHook\(last_step=2.5\)`: `last_step` must be an int >= 0"):
        StopAtStepHook(last_step=2.5)
    with pytest.raises(TypeError, match="`num_steps` must be an int"):
        StopAtStepHook(num_steps=True)
    assert StopAtStepHook(last_step=np.int64(7)).last_step == 7


@both_paths
def test_stop_based_on_last_step(wrap):
    h = StopAtStepHook(last_step=10)
    driver, session = hooked([wrap(h)], global_step=5)
    assert not run(driver, session)
    session.global_step = 9
    assert not run(driver, session)  # stale 9 + 1 reaches 10, but the real step is 9: no stop
    session.global_step = 10
    assert run(driver, session)
    session.global_step = 11
    assert run(driver, session)  # (TF resets mon_sess._should_stop here; our driver reports per step)


@both_paths
def test_stop_based_on_num_step(wrap):
    h = StopAtStepHook(num_steps=10)
    driver, session = hooked([wrap(h)], global_step=5)
    assert h.stop_at_step == 15
    assert not run(driver, session)
    session.global_step = 13
    assert not run(driver, session)
    session.global_step = 14
    assert not run(driver, session)
    session.global_step = 15
    assert run(driver, session)
    session.global_step = 16
    assert run(driver, session)


@both_paths
def test_stop_based_with_multiple_steps(wrap):
    h = StopAtStepHook(num_steps=10)
    driver, session = hooked([wrap(h)], global_step=5)
    assert not run(driver, session)
    session.global_step = 15
    assert run(driver, session)


@both_paths
def test_stop_at_step_in_a_training_loop_stops_on_the_last_step_and_is_quiet_before(wrap):
    h = StopAtStepHook(num_steps=4)
    rec = RecordingHook()
    driver, session = hooked([wrap(h), rec], global_step=3)
    stops = [run(driver, session, advance=1) for _ in range(4)]
    assert stops == [False, False, False, True] and session.global_step == 7
    assert [h.quiet_on(s) for s in (3, 4, 5, 6)] == [True, True, True, False]  # only the step ending at 7
    # a second fit counts num_steps from its own starting step
    driver.begin()
    driver.after_create_session(session)
    assert h.stop_at_step == 11


def test_nan_tensor_hook_arguments():
    with pytest.raises(TypeError, match=r"`NanTensorHook\(loss_tensor=3\)`: `loss_tensor` must be a fetch"):
        NanTensorHook(3)
    with pytest.raises(TypeError, match=r"`NanTensorHook\(fail_on_nan_loss='no'\)`: `fail_on_nan_loss` must be"):
        NanTensorHook("loss", fail_on_nan_loss="no")
    assert str(NanLossDuringTrainingError()) == "NaN loss during training."
    assert issubclass(NanLossDuringTrainingError, RuntimeError)


@pytest.mark.parametrize("loss", [1.0, np.float32(2.0), torch.tensor(3.0), torch.tensor(0.5, dtype=torch.bfloat16),
                                  np.array([1.0, 2.0]), 4, keras.ops.convert_to_tensor(1.5)])
def test_does_not_stop_if_tensor_is_not_nan(loss, caplog):
    h = NanTensorHook(loss_tensor="loss")
    driver, session = hooked([h])
    with caplog.at_level(logging.WARNING):
        assert not run(driver, session, advance=1, outputs={"loss": loss})
    assert not caplog.records


@pytest.mark.parametrize("loss", [math.nan, np.float32("nan"), torch.tensor(float("nan")),
                                  torch.tensor([1.0, float("nan")], dtype=torch.bfloat16), np.array([np.nan]),
                                  keras.ops.convert_to_tensor(float("nan"))])
def test_stops_without_failing_if_tensor_is_nan_and_fail_on_nan_loss_is_false(loss, caplog):
    h = NanTensorHook(loss_tensor=lambda step: step.outputs["loss"], fail_on_nan_loss=False)
    rec = RecordingHook()
    driver, session = hooked([h, rec])
    with caplog.at_level(logging.WARNING):
        assert run(driver, session, advance=1, outputs={"loss": loss})
    assert rec.calls[-1] == ("after_run", 1)  # the stop takes effect after every hook's after_run
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("WARNING", "Model diverged with loss = NaN.")]


def test_fails_if_tensor_is_nan(caplog):
    h = NanTensorHook(loss_tensor="loss")
    driver, session = hooked([h])
    assert not run(driver, session, advance=1, outputs={"loss": 0.3})
    with caplog.at_level(logging.WARNING), pytest.raises(NanLossDuringTrainingError, match="NaN loss during training"):
        run(driver, session, advance=1, outputs={"loss": float("nan")})
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("ERROR", "Model diverged with loss = NaN.")]


def test_nan_check_of_a_value_that_is_no_number_says_so():
    assert not is_nan(torch.tensor([1, 2]))  # integer tensors are never NaN
    with pytest.raises(TypeError, match="the loss_tensor value is a dict"):
        is_nan({"a": 1})


def test_final_ops_is_scalar_tensor():
    # TF runs the final ops in end() even when no step ran: here on the current state (no step outputs)
    hook = FinalOpsHook(lambda step: 4)
    hook.begin()
    hook.end(ManualSession())
    assert hook.final_ops_values == 4


def test_final_ops_is_tensor():
    expected_values = [1, 6, 3, 5, 2, 4]
    hook = FinalOpsHook(lambda step: np.array(expected_values))
    hook.begin()
    hook.end(ManualSession())
    assert hook.final_ops_values.tolist() == expected_values


def test_final_ops_triggers_out_of_range_error(caplog):
    data = iter([0])
    hook = FinalOpsHook(lambda step: next(data))
    driver, session = hooked([hook])
    run(driver, session, advance=1)
    next(data)  # the input source is exhausted, as TF's one-element dataset after its step
    with caplog.at_level(logging.WARNING), pytest.raises(StopIteration):
        hook.end(session)
    assert "dependency back to some input source" in caplog.records[-1].getMessage()


def test_final_ops_with_dictionary():
    expected_values = [4, -3]
    hook = FinalOpsHook({"x": lambda step: step_feeds()["x"]}, final_ops_feed_dict={"x": expected_values})
    hook.begin()
    hook.end(ManualSession())
    assert hook.final_ops_values == {"x": expected_values}
    assert "x" not in step_feeds()  # the feeds last only while the final ops run


def test_final_ops_run_on_the_last_finished_step():
    hook = FinalOpsHook({"loss": "loss", "step": "global_step", "both": ["loss", lambda s: s.step * 10]})
    driver, session = hooked([hook])
    for i in range(3):
        run(driver, session, advance=1, outputs={"loss": 0.5 * (i + 1)})
    assert hook.final_ops_values is None  # nothing before end()
    assert hook.quiet_on(0)
    driver.end(session)
    assert hook.final_ops_values == {"loss": 1.5, "step": 3, "both": [1.5, 30]}


def test_final_ops_without_a_step_cannot_read_step_outputs(caplog):
    hook = FinalOpsHook(["global_step", "loss"])
    with caplog.at_level(logging.WARNING), pytest.raises(KeyError, match="'loss'"):
        hook.end(ManualSession(global_step=7))
    assert "no training step finished" in caplog.records[-1].getMessage()
    assert FinalOpsHook(["global_step"]).end(ManualSession(global_step=7)) is None


def test_final_ops_arguments():
    with pytest.raises(TypeError, match=r"`FinalOpsHook\(final_ops=\{'a': 3\}\)`: `final_ops` must be a fetch"):
        FinalOpsHook({"a": 3})
    with pytest.raises(TypeError, match="`final_ops_feed_dict` must be a dict"):
        FinalOpsHook("loss", final_ops_feed_dict=[1])
    hook = FinalOpsHook(None)  # TF: nothing to run
    hook.end(ManualSession())
    assert hook.final_ops_values is None


# -- Lightning ------------------------------------------------------------------------------------------------


def _nan_lightning_model(nan_at):
    from tests.lightning_models import TinyModel

    class NanModel(TinyModel):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            if self.trainer.global_step + 1 >= nan_at:
                loss = loss * float("nan")
            return loss

    return NanModel()


def _ended(hook):
    """Records whether `end()` ran on a hook (a wrapper around its own end)."""
    calls = []
    original = hook.end
    hook.end = lambda session: (calls.append(session.global_step), original(session))
    return calls


def test_lightning_stop_at_step(tmp_dir):
    from lightning_prof import StopAtStepHook as LStop
    from tests.lightning_models import TinyModel, loader, trainer

    cb = LStop(last_step=5)
    ends = _ended(cb.hook)
    t = trainer(tmp_dir, [cb], 100)
    t.fit(TinyModel(), loader())  # 8 steps per epoch: it stops inside the first epoch
    assert t.global_step == 5 and ends == [5]

    cb = LStop(num_steps=3)
    ends = _ended(cb.hook)
    t = trainer(tmp_dir, [cb], 100, max_epochs=5)
    t.fit(TinyModel(), loader())
    assert t.global_step == 3 and ends == [3]

    with pytest.raises(ValueError, match=r"^One of num_steps or last_step must be specified\.$"):
        LStop()


def test_lightning_nan_stop_ends_cleanly_after_the_nan_step(tmp_dir, caplog):
    from lightning_prof import NanTensorHook as LNan
    from tests.lightning_models import loader, trainer

    cb = LNan("loss", fail_on_nan_loss=False)
    rec = RecordingHook()
    ends = _ended(cb.hook)
    from lightning_prof import HookCallback

    t = trainer(tmp_dir, [cb, HookCallback([rec])], 100)
    with caplog.at_level(logging.WARNING):
        t.fit(_nan_lightning_model(nan_at=3), loader())
    assert t.global_step == 3 and ends == [3]
    assert rec.calls[-2:] == [("after_run", 3), ("end",)]
    assert "Model diverged with loss = NaN." in caplog.text


def test_lightning_nan_failure_fails_fit_and_stops_the_trace(tmp_dir):
    import os

    from lightning_prof import NanTensorHook as LNan
    from lightning_prof import ProfilerHook
    from tests.lightning_models import loader, trainer

    cb = LNan("loss")
    ends = _ended(cb.hook)
    prof = ProfilerHook(save_steps=1, output_dir=os.path.join(tmp_dir, "prof"))
    t = trainer(tmp_dir, [cb, prof], 100)
    with pytest.raises(NanLossDuringTrainingError, match="NaN loss during training"):
        t.fit(_nan_lightning_model(nan_at=2), loader())
    assert t.global_step == 2 and ends == []
    assert not torch._C._autograd._profiler_enabled() and fit_traces() is None
    with pytest.raises(TypeError, match="`loss_tensor` must be a fetch"):
        LNan(None)


def test_lightning_final_ops_after_fit(tmp_dir):
    from lightning_prof import FinalOpsHook as LFinal
    from tests.lightning_models import TinyModel, loader, trainer

    cb = LFinal({"loss": "loss", "logged": "train_loss", "step": "global_step",
                 "w": lambda step: step.model.fc1.weight.detach().clone()})
    model = TinyModel()
    t = trainer(tmp_dir, [cb], 4)
    t.fit(model, loader())
    values = cb.final_ops_values
    assert values is cb.hook.final_ops_values
    assert values["step"] == 4 and float(values["loss"]) == pytest.approx(float(values["logged"]))
    assert torch.equal(values["w"], model.fc1.weight.detach())
    with pytest.raises(TypeError, match="`final_ops` must be a fetch"):
        LFinal(5)


def test_lightning_callbacks_of_one_class_with_other_settings_share_a_trainer(tmp_dir):
    from lightning_prof import FinalOpsHook as LFinal
    from lightning_prof import NanTensorHook as LNan
    from lightning_prof import StopAtStepHook as LStop
    from tests.lightning_models import TinyModel, loader, trainer

    def weight_sum(step):
        return float(step.model.fc1.weight.sum())

    first, second = LFinal({"loss": "loss"}), LFinal(weight_sum, name="weights")
    callbacks = [LStop(last_step=2), LStop(num_steps=5), LNan("loss"), LNan("train_loss", False, name="logged"),
                 first, second]
    assert len({cb.state_key for cb in callbacks}) == len(callbacks)
    assert LFinal(weight_sum, name="weights").state_key == second.state_key  # the same in the run that resumes
    t = trainer(tmp_dir, callbacks, 10)
    t.fit(TinyModel(), loader())
    assert t.global_step == 2
    assert set(first.final_ops_values) == {"loss"} and isinstance(second.final_ops_values, float)


# -- Keras ----------------------------------------------------------------------------------------------------


class NanSequential(keras.Sequential):
    """A Sequential whose loss is NaN from global step `nan_at` on (1-based)."""

    nan_at: int | None = None

    def compute_loss(self, *args, **kwargs):
        loss = super().compute_loss(*args, **kwargs)
        if self.nan_at is not None and int(self.optimizer.iterations) + 1 >= self.nan_at:
            loss = loss * float("nan")
        return loss


def keras_model(nan_at=None):
    keras.utils.set_random_seed(0)
    m = NanSequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="fc1"),
                       keras.layers.Dense(1, name="fc2")], name="tiny")
    m.nan_at = nan_at
    m.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return m


def keras_fit(m, callbacks, epochs=2, n=48):
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((n, 8)).astype("float32"), rng.standard_normal((n, 1)).astype("float32")
    return m.fit(x, y, batch_size=8, epochs=epochs, callbacks=callbacks, verbose=0)


def test_keras_stop_at_step():
    from keras_prof import StopAtStepHook as KStop

    m = keras_model()
    cb = KStop(last_step=4)
    ends = _ended(cb.hook)
    keras_fit(m, [cb], epochs=5)
    assert int(m.optimizer.iterations) == 4 and ends == [4]

    cb = KStop(num_steps=8)  # counted from where the second fit starts; crosses an epoch (6 steps each)
    ends = _ended(cb.hook)
    keras_fit(m, [cb], epochs=5)
    assert int(m.optimizer.iterations) == 12 and ends == [12]

    with pytest.raises(ValueError, match=r"^Only one of num_steps or last_step can be specified\.$"):
        KStop(num_steps=1, last_step=1)


def test_keras_nan_stop_ends_cleanly_after_the_nan_step(caplog):
    from keras_prof import HookCallback
    from keras_prof import NanTensorHook as KNan

    m = keras_model(nan_at=3)
    cb = KNan("loss", fail_on_nan_loss=False)
    rec = RecordingHook()
    ends = _ended(cb.hook)
    with caplog.at_level(logging.WARNING):
        keras_fit(m, [cb, HookCallback([rec])], epochs=3)
    assert int(m.optimizer.iterations) == 3 and ends == [3]
    assert rec.calls[-2:] == [("after_run", 3), ("end",)]
    assert "Model diverged with loss = NaN." in caplog.text


def test_keras_nan_failure_fails_fit_stops_the_trace_and_restores_the_model(tmp_dir):
    from keras_prof import NanTensorHook as KNan
    from keras_prof import ProfilerHook
    from keras_prof.hook_callback import _TrainStepWatch

    m = keras_model(nan_at=2)
    cb = KNan("loss")
    ends = _ended(cb.hook)
    prof = ProfilerHook(save_steps=1, output_dir=tmp_dir)
    with pytest.raises(NanLossDuringTrainingError, match="NaN loss during training"):
        keras_fit(m, [prof, cb], epochs=2)  # the ProfilerHook's callback drives the fit (it comes first)
    assert int(m.optimizer.iterations) == 2 and ends == []
    assert not torch._C._autograd._profiler_enabled() and fit_traces() is None
    assert not isinstance(m.train_function, _TrainStepWatch)
    assert cb._fit is None and prof._fit is None

    # the model trains again, with the same callbacks, once its loss is sound
    healthy = keras_model()
    keras_fit(healthy, [prof, KNan("loss")], epochs=1)
    assert int(healthy.optimizer.iterations) == 6


def test_keras_final_ops_after_fit():
    from keras_prof import FinalOpsHook as KFinal

    m = keras_model()
    cb = KFinal({"loss": "loss", "step": "global_step", "kernel": lambda s: keras.ops.convert_to_numpy(
        s.model.get_layer("fc1").kernel)})
    history = keras_fit(m, [cb], epochs=2)
    values = cb.final_ops_values
    assert values["step"] == 12
    assert float(values["loss"]) == pytest.approx(history.history["loss"][-1], rel=1e-5)
    np.testing.assert_array_equal(values["kernel"], keras.ops.convert_to_numpy(m.get_layer("fc1").kernel))


@pytest.mark.filterwarnings("error::DeprecationWarning")
def test_a_keras_variable_is_checked_for_nan_without_numpys_copy_warning():
    """NanTensorHook and the NonFinite trigger read a Keras variable through its backend tensor, as summaries
    do: numpy.asarray of it warned (numpy 2, torch's __array__ without `copy`), an error under -W error."""
    import keras
    import numpy as np

    from hookprof._runtime.values import is_nan, is_non_finite

    variable = keras.Variable(np.ones((2, 2), "float32"))
    assert not is_nan(variable) and not is_non_finite(variable, "NonFinite", "fetch")
    variable.assign(np.full((2, 2), np.inf, "float32"))
    assert not is_nan(variable) and is_non_finite(variable, "NonFinite", "fetch")
