"""LoggingTensorHook: TF1's LoggingTensorHookTest ported to a hand-driven HookedSession, then real fits."""

import logging
import re

import numpy as np
import pytest
import torch

from hookprof import HookedSession, ManualSession, SessionRunArgs, StepState
from hookprof.hooks.logging_tensor_hook import LoggingTensorHook
from hookprof.tracing import HostTracer, StepTraceCoordinator
from tests.conftest import FakeClock, NoFastPath, RecordingHook

LOGGER = "hookprof.hooks.logging_tensor_hook"


class Harness:
    """TF's `monitored_session._HookedSession(sess, [hook])` with `mon_sess.run(train_op)`, and its
    `self.logged_message` (what the hook last logged, '' after a reset)."""

    def __init__(self, hooks, caplog, fast_path=True, outputs=None, increment=1):
        hooks = hooks if fast_path else [NoFastPath(h) for h in hooks]
        self.driver = HookedSession(hooks, HostTracer, StepTraceCoordinator())
        self.session = ManualSession()
        self.caplog = caplog
        self.outputs = outputs or (lambda step: {"foo": np.float32(42.0), "bar": step})
        self.increment = increment
        caplog.set_level(logging.INFO, logger=LOGGER)
        self.driver.begin()
        self.driver.after_create_session(self.session)

    def run(self):
        session = self.session
        self.driver.before_run(session, ("k", session.global_step), SessionRunArgs())
        session.global_step += self.increment
        step = session.global_step
        self.driver.after_run(lambda: StepState(step, self.outputs(step)))

    def end(self):
        self.driver.end(self.session)

    @property
    def logged_message(self):
        return "\n".join(r.getMessage() for r in self.caplog.records if r.name == LOGGER)

    def reset(self):
        self.caplog.clear()


# --- TF's LoggingTensorHookTest -------------------------------------------------------------------------------


def test_illegal_args():
    with pytest.raises(ValueError, match="nvalid every_n_iter"):
        LoggingTensorHook(tensors=["t"], every_n_iter=0)
    with pytest.raises(ValueError, match="nvalid every_n_iter"):
        LoggingTensorHook(tensors=["t"], every_n_iter=-10)
    with pytest.raises(ValueError, match="xactly one of"):
        LoggingTensorHook(tensors=["t"], every_n_iter=5, every_n_secs=5)
    with pytest.raises(ValueError, match="xactly one of"):
        LoggingTensorHook(tensors=["t"])
    # TF's exact texts
    with pytest.raises(ValueError, match=r"^invalid every_n_iter=0\.$"):
        LoggingTensorHook(tensors=["t"], every_n_iter=0)
    with pytest.raises(ValueError, match=r"^either at_end and/or exactly one of every_n_iter and every_n_secs "
                                         r"must be provided\.$"):
        LoggingTensorHook(tensors=["t"], at_end=True, every_n_iter=5, every_n_secs=5)
    # not TF's (it took graph tensors): what a fetch is here
    with pytest.raises(TypeError, match="tensors"):
        LoggingTensorHook(tensors="loss", every_n_iter=1)
    with pytest.raises(TypeError, match="tensors"):
        LoggingTensorHook(tensors=[lambda s: 1], every_n_iter=1)
    with pytest.raises(TypeError, match="formatter"):
        LoggingTensorHook(tensors=["t"], every_n_iter=1, formatter="%s")


@pytest.mark.parametrize("fast_path", [True, False])
def test_print_at_end_only(caplog, fast_path):
    hook = LoggingTensorHook(tensors=["foo"], at_end=True)
    mon_sess = Harness([hook], caplog, fast_path)
    for _ in range(3):
        mon_sess.reset()
        mon_sess.run()
        assert "foo" not in mon_sess.logged_message
    for _ in range(10):
        mon_sess.run()
    assert mon_sess.logged_message == ""
    mon_sess.reset()
    mon_sess.end()
    assert re.search("foo", mon_sess.logged_message)
    assert mon_sess.logged_message == "foo = 42.0"


def _validate_print_every_n_steps(caplog, at_end, fast_path):
    hook = LoggingTensorHook(tensors=["foo"], every_n_iter=10, at_end=at_end)
    mon_sess = Harness([hook], caplog, fast_path)
    mon_sess.run()
    assert re.search("foo", mon_sess.logged_message)
    for _ in range(3):
        mon_sess.reset()
        for _ in range(9):
            mon_sess.run()
            assert "foo" not in mon_sess.logged_message
        mon_sess.run()
        assert re.search("foo", mon_sess.logged_message)

    # Add additional run to verify proper reset when called multiple times.
    mon_sess.reset()
    mon_sess.run()
    assert "foo" not in mon_sess.logged_message

    mon_sess.reset()
    mon_sess.end()
    if at_end:
        assert re.search("foo", mon_sess.logged_message)
    else:
        assert "foo" not in mon_sess.logged_message


@pytest.mark.parametrize("fast_path", [True, False])
def test_print_every_n_steps(caplog, fast_path):
    _validate_print_every_n_steps(caplog, at_end=False, fast_path=fast_path)
    # Verify proper reset.
    caplog.clear()
    _validate_print_every_n_steps(caplog, at_end=False, fast_path=fast_path)


@pytest.mark.parametrize("fast_path", [True, False])
def test_print_every_n_steps_and_end(caplog, fast_path):
    _validate_print_every_n_steps(caplog, at_end=True, fast_path=fast_path)
    caplog.clear()
    _validate_print_every_n_steps(caplog, at_end=True, fast_path=fast_path)


def test_print_first_step(caplog):
    # if it runs every iteration, first iteration has None duration.
    hook = LoggingTensorHook(tensors={"foo": "foo"}, every_n_iter=1)
    mon_sess = Harness([hook], caplog)
    mon_sess.run()
    assert re.search("foo", mon_sess.logged_message)
    # in first run, elapsed time is None.
    assert "sec" not in mon_sess.logged_message
    mon_sess.reset()
    mon_sess.run()
    assert re.fullmatch(r"foo = 42\.0 \(\d+\.\d{3} sec\)", mon_sess.logged_message)


def _validate_print_every_n_secs(caplog, at_end, fast_path):
    clock = FakeClock()
    hook = LoggingTensorHook(tensors=["foo"], every_n_secs=1.0, at_end=at_end, clock=clock)
    mon_sess = Harness([hook], caplog, fast_path)

    mon_sess.run()
    assert re.search("foo", mon_sess.logged_message)

    mon_sess.reset()
    mon_sess.run()
    assert "foo" not in mon_sess.logged_message
    clock.now += 1.0

    mon_sess.reset()
    mon_sess.run()
    assert re.search("foo", mon_sess.logged_message)
    assert mon_sess.logged_message == "foo = 42.0 (1.000 sec)"

    mon_sess.reset()
    mon_sess.end()
    if at_end:
        assert re.search("foo", mon_sess.logged_message)
    else:
        assert "foo" not in mon_sess.logged_message


@pytest.mark.parametrize("fast_path", [True, False])
def test_print_every_n_secs(caplog, fast_path):
    _validate_print_every_n_secs(caplog, at_end=False, fast_path=fast_path)
    caplog.clear()
    _validate_print_every_n_secs(caplog, at_end=False, fast_path=fast_path)


@pytest.mark.parametrize("fast_path", [True, False])
def test_print_every_n_secs_and_end(caplog, fast_path):
    _validate_print_every_n_secs(caplog, at_end=True, fast_path=fast_path)
    caplog.clear()
    _validate_print_every_n_secs(caplog, at_end=True, fast_path=fast_path)


def test_print_formatter(caplog):
    hook = LoggingTensorHook(tensors=["foo"], every_n_iter=10, formatter=lambda items: f"qqq={items['foo']}")
    mon_sess = Harness([hook], caplog)
    mon_sess.run()
    assert mon_sess.logged_message == "qqq=42.0"


# --- the format and the counting, in detail --------------------------------------------------------------------


def test_dict_tags_in_sorted_order_list_in_given_order_with_elapsed_seconds(caplog):
    clock = FakeClock()
    hooks = [LoggingTensorHook({"z": "foo", "a": "bar", "m": lambda s: s.step * 10}, every_n_iter=2, clock=clock),
             LoggingTensorHook(["foo", "bar"], every_n_iter=2, clock=clock)]
    mon_sess = Harness(hooks, caplog)
    for _ in range(3):
        clock.now += 1.25
        mon_sess.run()
    assert mon_sess.logged_message.splitlines() == [
        "a = 1, m = 10, z = 42.0",
        "foo = 42.0, bar = 1",
        "a = 3, m = 30, z = 42.0 (2.500 sec)",
        "foo = 42.0, bar = 3 (2.500 sec)",
    ]
    assert all(r.levelno == logging.INFO for r in caplog.records)


def test_tensors_are_printed_as_numpy_with_suppress(caplog):
    outputs = {"loss": torch.tensor(0.5, requires_grad=True) * 1, "w": torch.tensor([1e-8, 1.0])}
    hook = LoggingTensorHook(["loss", "w"], every_n_iter=1)
    mon_sess = Harness([hook], caplog, outputs=lambda step: outputs)
    mon_sess.run()
    # suppress=True (TF's): fixed-point, not numpy's default "[1.e-08 1.e+00]"
    assert mon_sess.logged_message == "loss = 0.5, w = [0.00000001 1.        ]"
    assert np.get_printoptions()["suppress"] is False  # restored


def test_fetches_only_on_the_logging_steps(caplog):
    calls = []
    hook = LoggingTensorHook({"step": lambda s: calls.append(s.step) or s.step}, every_n_iter=4)
    mon_sess = Harness([hook], caplog)
    loud = []
    for _ in range(10):
        if not hook.quiet_on(mon_sess.session.global_step):
            loud.append(mon_sess.session.global_step)
        mon_sess.run()
    assert calls == [1, 5, 9]  # iterations 0, 4, 8
    assert loud == [0, 4, 8]  # quiet on every other step (the first is never promised quiet)


@pytest.mark.parametrize("fast_path", [True, False])
def test_a_global_step_that_starts_late_counts_iterations_of_this_run(caplog, fast_path):
    hook = LoggingTensorHook(["bar"], every_n_iter=3)
    mon_sess = Harness([hook], caplog, fast_path)
    mon_sess.session.global_step = 100  # a resumed run: TF counts the hook's own iterations from begin()
    for _ in range(7):
        mon_sess.run()
    assert [m.split(" (")[0] for m in mon_sess.logged_message.splitlines()] == ["bar = 101", "bar = 104", "bar = 107"]


def test_a_global_step_that_does_not_move_still_counts_every_run_without_the_fast_path(caplog):
    # TF counted session.run calls: with a train op that leaves the global step alone, it still logs every N
    hook = LoggingTensorHook(["foo"], every_n_iter=2)
    mon_sess = Harness([NoFastPath(hook)], caplog, increment=0)
    for _ in range(5):
        mon_sess.run()
    assert len(mon_sess.logged_message.splitlines()) == 3


def test_at_end_with_no_step_warns_instead_of_failing(caplog):
    hook = LoggingTensorHook(["foo"], at_end=True)
    mon_sess = Harness([hook], caplog)
    mon_sess.end()
    assert "no step ran" in mon_sess.logged_message


# --- real fits -------------------------------------------------------------------------------------------------


def logged(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def loss_of(message):
    return float(re.match(r"loss = ([-+0-9.e]+)", message).group(1))


def test_lightning_fit_logs_the_loss_at_the_right_iterations(tmp_dir, caplog):
    from lightning_prof import LoggingTensorHook as LightningLoggingTensorHook
    from lightning_prof.hook_callback import HookCallback
    from tests.lightning_models import TinyModel, loader, trainer

    losses = RecordingHook(fetches={"loss": "loss", "step": "global_step"})
    hook = LightningLoggingTensorHook({"loss": "loss"}, every_n_iter=3, at_end=True)
    caplog.set_level(logging.INFO, logger=LOGGER)
    trainer(tmp_dir, [HookCallback([losses]), hook], 7).fit(TinyModel(), loader())
    by_step = {r["step"]: float(r["loss"]) for r in losses.results}
    messages = logged(caplog)
    assert len(messages) == 4  # iterations 0, 3, 6 (global steps 1, 4, 7), and at the end
    assert [loss_of(m) for m in messages] == [pytest.approx(by_step[s], rel=1e-5) for s in (1, 4, 7, 7)]
    assert " sec)" not in messages[0] and all(re.search(r" \(\d+\.\d{3} sec\)$", m) for m in messages[1:])


def test_lightning_fit_logs_a_logged_metric_every_n_secs(tmp_dir, caplog):
    from lightning_prof import LoggingTensorHook as LightningLoggingTensorHook
    from tests.lightning_models import TinyModel, loader, trainer

    hook = LightningLoggingTensorHook(["train_loss"], every_n_secs=3600)
    caplog.set_level(logging.INFO, logger=LOGGER)
    trainer(tmp_dir, [hook], 5).fit(TinyModel(), loader())
    (message,) = logged(caplog)  # the first step only: an hour never passes
    assert message.startswith("train_loss = ")


def test_two_lightning_hooks_with_other_tensors_in_one_fit(tmp_dir, caplog):
    from lightning_prof import LoggingTensorHook as LightningLoggingTensorHook
    from tests.lightning_models import TinyModel, loader, trainer

    hooks = [LightningLoggingTensorHook(["loss"], every_n_iter=2),
             LightningLoggingTensorHook({"step": "global_step"}, every_n_iter=2, name="step")]
    caplog.set_level(logging.INFO, logger=LOGGER)
    trainer(tmp_dir, hooks, 3).fit(TinyModel(), loader())
    assert [m.split(" (")[0] for m in logged(caplog)][1::2] == ["step = 1", "step = 3"]


def test_keras_fit_logs_the_loss_at_the_right_iterations(tmp_dir, caplog, monkeypatch):
    from keras_prof import LoggingTensorHook as KerasLoggingTensorHook
    from keras_prof.hook_callback import HookCallback
    from tests.test_keras_prof import fit, model

    monkeypatch.chdir(tmp_dir)
    losses = RecordingHook(fetches={"loss": "loss", "step": "global_step"})
    hook = KerasLoggingTensorHook(["loss"], every_n_iter=4)
    caplog.set_level(logging.INFO, logger=LOGGER)
    fit(model(), [HookCallback([losses]), hook], epochs=2)  # 12 steps
    by_step = {r["step"]: float(r["loss"]) for r in losses.results}
    messages = logged(caplog)
    assert [loss_of(m) for m in messages] == [pytest.approx(by_step[s], rel=1e-5) for s in (1, 5, 9)]
