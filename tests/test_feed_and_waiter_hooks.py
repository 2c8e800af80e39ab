"""FeedFnHook and GlobalStepWaiterHook: TF1's unit tests ported (driven by hand through `HookedSession`), then
FeedFnHook in a real Lightning fit (step_feeds() and dict batches) and a real Keras fit (a custom train_step)."""

import logging
import time

import keras
import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from hookprof import HookedSession, ManualSession, SessionRunArgs, SessionRunContext, StepState, step_feeds
from hookprof.hooks.feed_fn_hook import FeedFnHook
from hookprof.hooks.global_step_waiter_hook import GlobalStepWaiterHook
from hookprof.tracing import HostTracer, StepTraceCoordinator
from tests.conftest import NoFastPath, RecordingHook
from tests.lightning_models import TinyModel, loader, trainer

WAITER_LOG = "hookprof.hooks.global_step_waiter_hook"


def hooked(hooks, session=None):
    session = session if session is not None else ManualSession()
    driver = HookedSession(hooks, HostTracer, StepTraceCoordinator())
    driver.begin()
    driver.after_create_session(session)
    return driver, session


def run(driver, session, original=None, in_step=None, advance=1):
    """One step (`mon_sess.run(...)`); `in_step()` runs while it runs, as the graph did; returns what it saw."""
    driver.before_run(session, object(), original or SessionRunArgs(feed_dict={"batch_idx": 0}))
    seen = in_step() if in_step else dict(step_feeds())
    session.global_step += advance
    driver.after_run(lambda: StepState(session.global_step, {}, session=session))
    return seen


# -- FeedFnHook: TF's test_feeding_placeholder and the driver's rules -------------------------------------------


def test_feeding_placeholder():
    # TF: x = placeholder; y = x + 1; FeedFnHook(lambda: {x: 1.0}); mon_sess.run(y) == 2
    hook = FeedFnHook(feed_fn=lambda: {"x": 1.0})
    hook.begin()
    driver, session = hooked([hook])
    assert run(driver, session, in_step=lambda: step_feeds()["x"] + 1) == 2
    assert dict(step_feeds()) == {}  # the feeds belong to their step only


def test_feed_fn_runs_before_every_step_and_returns_tfs_run_args():
    values = iter(range(100))
    hook = FeedFnHook(lambda: {"x": next(values)})
    assert hook.before_run(SessionRunContext(SessionRunArgs(), ManualSession())) == SessionRunArgs(
        fetches=None, feed_dict={"x": 0})
    driver, session = hooked([hook])
    assert [run(driver, session) for _ in range(3)] == [{"x": 1}, {"x": 2}, {"x": 3}]
    assert not hook.quiet_on(0)  # TF calls feed_fn on every step: never skipped


def test_feeding_a_name_the_user_feeds_or_another_hook_feeds_is_tfs_error():
    driver, session = hooked([FeedFnHook(lambda: {"batch_idx": 1})])
    with pytest.raises(RuntimeError, match=r"Same tensor is fed by a SessionRunHook and user: \['batch_idx'\]"):
        run(driver, session)
    driver, session = hooked([FeedFnHook(lambda: {"x": 1}), FeedFnHook(lambda: {"x": 2})])
    with pytest.raises(RuntimeError, match=r"Same tensor is fed by two hooks: \['x'\]"):
        run(driver, session)


def test_feed_fn_must_be_callable_and_return_a_dict():
    with pytest.raises(TypeError, match="`feed_fn` must be a function"):
        FeedFnHook({"x": 1})
    with pytest.raises(TypeError, match="into_batch"):
        FeedFnHook(dict, into_batch="yes")
    driver, session = hooked([FeedFnHook(lambda: [1, 2])])
    with pytest.raises(TypeError, match="feed_dict must be a dict"):
        run(driver, session)


def test_feeds_go_into_a_dict_batch_and_not_into_other_batches():
    hook = FeedFnHook(lambda: {"scale": 3})
    driver, session = hooked([hook])
    batch = {"x": 1}
    seen = run(driver, session, SessionRunArgs(feed_dict={"batch": batch, "batch_idx": 0}))
    assert batch == {"x": 1, "scale": 3} and seen == {"scale": 3}
    # the same dict again (a dataset that yields one dict): the key this hook put there is no clash
    run(driver, session, SessionRunArgs(feed_dict={"batch": batch, "batch_idx": 1}))
    # a tuple batch is left alone by default; step_feeds() still has the values
    batch = (1, 2)
    assert run(driver, session, SessionRunArgs(feed_dict={"batch": batch, "batch_idx": 2})) == {"scale": 3}
    # into_batch=False: never into the batch
    driver, session = hooked([FeedFnHook(lambda: {"scale": 3}, into_batch=False)])
    batch = {"x": 1}
    assert run(driver, session, SessionRunArgs(feed_dict={"batch": batch, "batch_idx": 0})) == {"scale": 3}
    assert batch == {"x": 1}


def test_a_batch_that_cannot_take_feeds_is_a_clear_error():
    driver, session = hooked([FeedFnHook(lambda: {"scale": 3}, into_batch=True)])
    with pytest.raises(TypeError, match=r"FeedFnHook\(into_batch=True\): the step's batch is a tuple, which "
                                        r"cannot take feeds \['scale'\].*hookprof.step_feeds\(\)"):
        run(driver, session, SessionRunArgs(feed_dict={"batch": (1, 2), "batch_idx": 0}))
    driver, session = hooked([FeedFnHook(lambda: {"scale": 3}, into_batch=True)])
    with pytest.raises(TypeError, match=r"hands hooks no batch.*hookprof.step_feeds\(\)"):
        run(driver, session)  # Keras' arguments: batch_idx only


def test_feeding_a_key_the_batch_dict_already_holds_is_tfs_error():
    driver, session = hooked([FeedFnHook(lambda: {"x": 3})])
    with pytest.raises(RuntimeError, match=r"Same tensor is fed by a SessionRunHook and user: \['x'\]"):
        run(driver, session, SessionRunArgs(feed_dict={"batch": {"x": 1}, "batch_idx": 0}))


# -- GlobalStepWaiterHook: TF's tests ---------------------------------------------------------------------------


class ChiefSession(ManualSession):
    """A worker's session whose global step a fake chief advances: each `sleep` moves it along `steps`."""

    def __init__(self, steps):
        super().__init__()
        self.steps = list(steps)
        self.sleeps = []
        self.reads = 0

    @property
    def global_step(self):
        self.reads += 1
        return self._global_step

    @global_step.setter
    def global_step(self, value):
        self._global_step = value

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        if not self.steps:
            raise AssertionError("Expected before_run() to terminate after the chief's last step")
        self._global_step = self.steps.pop(0)


def test_not_wait_for_step_zero():
    hook = GlobalStepWaiterHook(wait_until_step=0, sleep=pytest.fail)
    hook.begin()
    assert hook.quiet_on(0)
    # before_run returns without waiting for the global step to move
    assert hook.before_run(SessionRunContext(original_args=None, session=ManualSession())) is None
    assert hook.worker_is_started
    hook = GlobalStepWaiterHook(wait_until_step=-5, sleep=pytest.fail)
    hook.begin()
    assert hook.before_run(SessionRunContext(original_args=None, session=ManualSession())) is None


def test_wait_for_step(caplog):
    # TF: the first sleep moves the global step 0 -> 500, the second 500 -> 1100; before_run returns after two
    session = ChiefSession([500, 1100])
    hook = GlobalStepWaiterHook(wait_until_step=1000, sleep=session.sleep)
    hook.begin()
    with caplog.at_level(logging.INFO, logger=WAITER_LOG):
        assert hook.before_run(SessionRunContext(original_args=None, session=session)) is None
    assert session.sleeps == [0.5, 0.5] and session.reads == 3  # the session's step is read on every poll
    assert hook.worker_is_started and hook.quiet_on(1100)
    assert [r.getMessage() for r in caplog.records] == ["Waiting for global step 1000 before starting training."]


def test_wait_logs_the_current_step_when_it_moved_more_than_1000_steps(caplog):
    session = ChiefSession([1000, 1001, 1500, 2002, 2500, 5000])
    hook = GlobalStepWaiterHook(wait_until_step=5000, sleep=session.sleep)
    hook.begin()
    with caplog.at_level(logging.INFO, logger=WAITER_LOG):
        hook.before_run(SessionRunContext(original_args=None, session=session))
    prefix = "Waiting for global step 5000 before starting training."
    assert [r.getMessage() for r in caplog.records] == [
        prefix, f"{prefix} Current step is 1001.", f"{prefix} Current step is 2002."]
    assert len(session.sleeps) == 6


@pytest.mark.parametrize("wrap", [lambda h: h, NoFastPath], ids=["quiet_on", "tf_path"])
def test_waiter_through_the_driver_waits_once_then_never_again(wrap):
    session = ChiefSession([3, 7])
    hook = GlobalStepWaiterHook(wait_until_step=5, sleep=session.sleep)
    rec = RecordingHook()
    driver, _ = hooked([wrap(hook), rec], session)
    run(driver, session)  # waits: 0 -> 3 -> 7, then the step runs (7 -> 8)
    assert session.sleeps == [0.5, 0.5] and session.global_step == 8
    for _ in range(3):
        run(driver, session)
    assert len(session.sleeps) == 2 and rec.names().count("after_run") == 4
    driver.begin()  # a new fit waits again (TF: begin resets _worker_is_started); step 9 >= 5: no sleep
    run(driver, session)
    assert len(session.sleeps) == 2


def test_waiter_reads_global_step_fn_when_given():
    counter = {"step": 0}

    def sleep(seconds):
        counter["step"] += 2

    hook = GlobalStepWaiterHook(4, global_step_fn=lambda: counter["step"], sleep=sleep)
    hook.begin()
    hook.before_run(SessionRunContext(None, ManualSession()))
    assert counter["step"] == 4 and hook.worker_is_started


def test_waiter_sleeps_through_a_patched_time_sleep():
    """TF's tests (and users') patch `time.sleep`; the default must see the patch, not a reference bound when
    the module was imported (which waited for ever)."""
    from unittest import mock

    session = ChiefSession([3, 7])
    hook = GlobalStepWaiterHook(wait_until_step=5)
    hook.begin()
    with mock.patch.object(time, "sleep", session.sleep):
        hook.before_run(SessionRunContext(original_args=None, session=session))
    assert session.sleeps == [0.5, 0.5] and hook.worker_is_started


def test_waiter_arguments():
    for bad in (1.5, "3", True, None):
        with pytest.raises(TypeError, match=r"`wait_until_step` must be an int"):
            GlobalStepWaiterHook(bad)
    with pytest.raises(TypeError, match="global_step_fn"):
        GlobalStepWaiterHook(1, global_step_fn=3)
    assert GlobalStepWaiterHook(np.int64(7)).wait_until_step == 7


# -- Lightning --------------------------------------------------------------------------------------------------


class DictModel(L.LightningModule):
    """A model trained on dict batches that records what the fed values look like inside training_step."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 1)
        self.seen = []

    def training_step(self, batch, batch_idx):
        feeds = dict(step_feeds())
        self.seen.append((self.trainer.global_step, feeds, {k: v for k, v in batch.items() if k not in ("x", "y")}))
        return torch.nn.functional.mse_loss(self.fc(batch["x"]), batch["y"]) * batch.get("scale", 1.0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def dict_loader(n=32, batch_size=8):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)
    return DataLoader([{"x": x[i], "y": y[i]} for i in range(n)], batch_size=batch_size)


def counting_feed():
    calls = []

    def feed_fn():
        calls.append(len(calls))
        return {"scale": 0.5, "step_no": len(calls)}

    return feed_fn, calls


def test_lightning_feeds_reach_training_step_and_dict_batches(tmp_dir):
    from lightning_prof import FeedFnHook as LFeed

    feed_fn, calls = counting_feed()
    model = DictModel()
    trainer(tmp_dir, [LFeed(feed_fn)], max_steps=6).fit(model, dict_loader())
    assert len(calls) == 6
    assert [s[0] for s in model.seen] == list(range(6))
    for i, (_, feeds, extra) in enumerate(model.seen):
        assert feeds == {"scale": 0.5, "step_no": i + 1} and extra == feeds
    assert dict(step_feeds()) == {}


def test_lightning_gradient_accumulation_feeds_once_per_step_into_every_micro_batch(tmp_dir):
    from lightning_prof import FeedFnHook as LFeed
    from lightning_prof import HookCallback

    feed_fn, calls = counting_feed()
    model = DictModel()
    # another hookprof callback first: it drives the fit's hooks, FeedFnHook's included
    trainer(tmp_dir, [HookCallback([RecordingHook()]), LFeed(feed_fn)], max_steps=2,
            accumulate_grad_batches=2).fit(model, dict_loader())
    assert len(calls) == 2
    assert [(s[0], s[2]["step_no"]) for s in model.seen] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [s[1]["step_no"] for s in model.seen] == [1, 1, 2, 2]


def test_lightning_tuple_batches_read_step_feeds_and_into_batch_true_fails_clearly(tmp_dir):
    from lightning_prof import FeedFnHook as LFeed

    seen = []

    class Model(TinyModel):
        def training_step(self, batch, batch_idx):
            seen.append(dict(step_feeds()))
            return super().training_step(batch, batch_idx)

    trainer(tmp_dir, [LFeed(lambda: {"scale": 2.0})], max_steps=3).fit(Model(), loader())
    assert seen == [{"scale": 2.0}] * 3

    with pytest.raises(TypeError, match=r"FeedFnHook\(into_batch=True\): the step's batch is a list.*"
                                        r"hookprof.step_feeds\(\)"):
        trainer(tmp_dir, [LFeed(lambda: {"scale": 2.0}, into_batch=True)], max_steps=3).fit(Model(), loader())
    assert dict(step_feeds()) == {}  # the failed step's feeds were dropped


def test_lightning_waiter_passes_when_resumed_past_the_step_and_is_quiet(tmp_dir):
    from lightning_prof import GlobalStepWaiterHook as LWait

    cb = LWait(wait_until_step=0, sleep=pytest.fail)
    trainer(tmp_dir, [cb], max_steps=3).fit(TinyModel(), loader())
    assert cb.hook.worker_is_started
    # a shared counter another process advances: here the fake sleep plays the chief
    shared = {"step": 0}
    cb = LWait(wait_until_step=2, global_step_fn=lambda: shared["step"], sleep=lambda s: shared.update(step=2))
    trainer(tmp_dir, [cb], max_steps=3).fit(TinyModel(), loader())
    assert cb.hook.worker_is_started and shared["step"] == 2


# -- Keras ------------------------------------------------------------------------------------------------------


class FeedSequential(keras.Sequential):
    """A Sequential whose train_step records what hookprof.step_feeds() holds while it runs."""

    def train_step(self, data):
        self.seen.append(dict(step_feeds()))
        return super().train_step(data)


def test_keras_step_feeds_are_visible_inside_train_step():
    from keras_prof import FeedFnHook as KFeed
    from keras_prof import GlobalStepWaiterHook as KWait

    keras.utils.set_random_seed(0)
    m = FeedSequential([keras.Input((8,)), keras.layers.Dense(1)])
    m.seen = []
    m.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    feed_fn, calls = counting_feed()
    waiter = KWait(0, sleep=pytest.fail)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((24, 8)).astype("float32"), rng.standard_normal((24, 1)).astype("float32")
    m.fit(x, y, batch_size=8, epochs=2, callbacks=[waiter, KFeed(feed_fn)], verbose=0)
    assert len(calls) == 6 and waiter.hook.worker_is_started
    assert m.seen == [{"scale": 0.5, "step_no": i + 1} for i in range(6)]
    assert dict(step_feeds()) == {}
