"""StepCounterHook: TF1's StepCounterHookTest ported to a hand-driven HookedSession, then real fits."""

import logging
import os

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from hookprof import HookedSession, ManualSession, SessionRunArgs, StepState
from hookprof.hooks.step_counter_hook import StepCounterHook
from hookprof.tracing import HostTracer, StepTraceCoordinator
from tests.conftest import FakeClock, NoFastPath, RecordingHook

LOGGER = "hookprof.hooks.step_counter_hook"


class FakeSummaryWriter:
    """An event sink that keeps the summaries by step (TF's fake_summary_writer)."""

    def __init__(self):
        self.summaries = {}
        self.flushed = 0

    def add_event(self, event):
        if event.HasField("summary"):
            self.summaries.setdefault(event.step, []).append(event.summary)

    def flush(self):
        self.flushed += 1

    def close(self):
        pass

    def value(self, step, index=0):
        value = self.summaries[step][0].value[index]
        return value.tag, float(tensor_util.make_ndarray(value.tensor))


def drive(hooks, session=None, fast_path=True):
    hooks = hooks if fast_path else [NoFastPath(h) for h in hooks]
    driver = HookedSession(hooks, HostTracer, StepTraceCoordinator())
    session = session or ManualSession()
    driver.begin()
    driver.after_create_session(session)
    return driver, session


def run(driver, session, increment=1):
    """One `mon_sess.run(train_op)`: train_op increments the global step by `increment`."""
    driver.before_run(session, ("k", session.global_step), SessionRunArgs())
    session.global_step += increment
    driver.after_run(lambda: StepState(session.global_step, {"loss": 0.5}))


# --- TF's StepCounterHookTest ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fast_path", [True, False])
def test_step_counter_every_n_steps(fast_path, caplog):
    clock = FakeClock()
    writer = FakeSummaryWriter()
    hook = StepCounterHook(summary_writer=writer, every_n_steps=10, clock=clock)
    driver, session = drive([hook], fast_path=fast_path)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(30):
            clock.now += 0.01
            run(driver, session)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # logging.warning not called
    driver.end(session)
    assert sorted(writer.summaries) == [11, 21]
    for step in [11, 21]:
        tag, value = writer.value(step)
        assert tag == "global_step/sec"
        assert value > 0
        assert value == pytest.approx(10 / 0.1)  # 10 steps in 10 x 0.01 s
    # TF: logging.info("%s: %g", tag, steps_per_sec), on the steps written
    assert [r.getMessage() for r in caplog.records] == ["global_step/sec: 100"] * 2
    assert all(r.levelno == logging.INFO for r in caplog.records)
    assert writer.flushed  # end() flushes


@pytest.mark.parametrize("fast_path", [True, False])
def test_step_counter_every_n_secs(fast_path):
    clock = FakeClock()
    writer = FakeSummaryWriter()
    hook = StepCounterHook(summary_writer=writer, every_n_steps=None, every_n_secs=0.1, clock=clock)
    driver, session = drive([hook], fast_path=fast_path)
    run(driver, session)
    clock.now += 0.2
    run(driver, session)
    clock.now += 0.2
    run(driver, session)
    driver.end(session)
    assert writer.summaries, "No summaries were created."
    assert sorted(writer.summaries) == [2, 3]
    for step in [2, 3]:
        tag, value = writer.value(step)
        assert tag == "global_step/sec" and value > 0
        assert value == pytest.approx(1 / 0.2)


def test_seconds_schedule_skips_steps_before_the_time_is_up():
    clock = FakeClock()
    writer = FakeSummaryWriter()
    hook = StepCounterHook(every_n_steps=None, every_n_secs=1.0, summary_writer=writer, clock=clock)
    driver, session = drive([hook])
    for _ in range(12):
        clock.now += 0.25
        run(driver, session)
    # count starts at step 1 (t=0.25); 1 s later is step 5 (t=1.25), then 9 (t=2.25)
    assert sorted(writer.summaries) == [5, 9]
    assert [writer.value(s)[1] for s in (5, 9)] == [pytest.approx(4.0), pytest.approx(4.0)]


def test_log_warning_if_global_step_not_increased(caplog):
    hook = StepCounterHook(every_n_steps=1, every_n_secs=None)
    driver, session = drive([hook])
    run(driver, session, increment=0)  # Run one step to record global step.
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(30):
            run(driver, session, increment=0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 5  # TF: log_first_n(WARN, ..., 5)
    assert all("global step (session.global_step) has not been increased" in w for w in warnings)
    assert "Current value (could be stable): 0 vs previous value: 0" in warnings[0]
    driver.end(session)


def test_global_step_that_moves_gives_no_warning_even_by_more_than_one(caplog):
    writer = FakeSummaryWriter()
    clock = FakeClock()
    hook = StepCounterHook(every_n_steps=4, summary_writer=writer, clock=clock)
    driver, session = drive([hook])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(8):
            clock.now += 1
            run(driver, session, increment=2)
    assert not caplog.records
    # starts at 2; TF fires when the stale step + 1 reaches 2 + 4: the step from 6 to 8, then the step from 12 to 14
    assert sorted(writer.summaries) == [8, 14]
    assert writer.value(8)[1] == pytest.approx(2.0)  # 6 global steps in 3 s


def test_tf_argument_errors():
    message = "exactly one of every_n_steps and every_n_secs should be provided."
    with pytest.raises(ValueError, match=message):
        StepCounterHook(every_n_steps=None)
    with pytest.raises(ValueError, match=message):
        StepCounterHook(every_n_secs=5)  # TF's default every_n_steps=100 is still set
    with pytest.raises(ValueError, match=message):
        StepCounterHook(every_n_steps=None, every_n_secs=None)
    with pytest.raises(ValueError, match="every_steps"):
        StepCounterHook(every_n_steps=0)
    with pytest.raises(TypeError, match="summary_writer"):
        StepCounterHook(summary_writer=object())
    with pytest.raises(ValueError, match="batch_size"):
        StepCounterHook(batch_size=0)
    assert StepCounterHook().every_n_steps == 100  # TF's default


def test_batch_size_adds_examples_per_second(caplog):
    clock = FakeClock()
    writer = FakeSummaryWriter()
    hook = StepCounterHook(every_n_steps=2, summary_writer=writer, batch_size=8, clock=clock)
    driver, session = drive([hook])
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(3):
            clock.now += 0.5
            run(driver, session)
    assert sorted(writer.summaries) == [3]
    assert writer.value(3, 0) == ("global_step/sec", pytest.approx(2.0))
    assert writer.value(3, 1) == ("examples/sec", pytest.approx(16.0))
    assert [r.getMessage() for r in caplog.records] == ["global_step/sec: 2", "examples/sec: 16"]


def test_no_writer_only_logs_and_output_dir_writes_an_event_file(tmp_dir, caplog):
    clock = FakeClock()
    hook = StepCounterHook(every_n_steps=2, clock=clock)
    driver, session = drive([hook])
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(5):
            clock.now += 1
            run(driver, session)
    driver.end(session)
    assert [r.getMessage() for r in caplog.records] == ["global_step/sec: 1"] * 2
    assert os.listdir(tmp_dir) == []

    out = os.path.join(tmp_dir, "logs")
    hook = StepCounterHook(every_n_steps=2, output_dir=out, clock=clock)
    driver, session = drive([hook])
    for _ in range(5):
        clock.now += 0.25
        run(driver, session)
    driver.end(session)
    acc = EventAccumulator(out, size_guidance={"tensors": 0})
    acc.Reload()
    series = [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors("global_step/sec")]
    assert series == [(3, pytest.approx(4.0)), (5, pytest.approx(4.0))]


def test_quiet_on_promises_exactly_the_steps_with_nothing_to_do():
    clock = FakeClock()
    writer = FakeSummaryWriter()
    hook = StepCounterHook(every_n_steps=3, summary_writer=writer, clock=clock)
    driver, session = drive([hook])
    loud = []
    for _ in range(10):
        clock.now += 1
        if not hook.quiet_on(session.global_step):
            loud.append(session.global_step)
        run(driver, session)
    # the first step starts the count; the steps ending at 4, 7, 10 write (they start at 3, 6, 9)
    assert loud == [0, 3, 6, 9]
    assert sorted(writer.summaries) == [4, 7, 10]


def test_each_run_starts_the_count_again():
    clock = FakeClock()
    writer = FakeSummaryWriter()
    hook = StepCounterHook(every_n_steps=2, summary_writer=writer, clock=clock)
    session = ManualSession()
    for _ in range(2):
        driver, _ = drive([hook], session)
        for _ in range(3):
            clock.now += 1
            run(driver, session)
        driver.end(session)
        clock.now += 100  # time between runs is no training time
    assert sorted(writer.summaries) == [3, 6]
    assert writer.value(6)[1] == pytest.approx(1.0)


def test_only_rank_zero_writes_every_rank_logs(caplog):
    clock = FakeClock()
    writer = FakeSummaryWriter()
    hook = StepCounterHook(every_n_steps=1, summary_writer=writer, clock=clock)
    driver, session = drive([hook], ManualSession(rank=1, world_size=2))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(3):
            clock.now += 1
            run(driver, session)
    assert writer.summaries == {}
    assert len(caplog.records) == 2


# --- real fits -------------------------------------------------------------------------------------------------


def tensor_series(logdir, tag):
    acc = EventAccumulator(logdir, size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    return acc, [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]


def test_lightning_fit_writes_steps_per_second_into_the_logger_run_dir(tmp_dir, caplog):
    from lightning_prof import StepCounterHook as LightningStepCounterHook
    from lightning_prof.hook_callback import HookCallback
    from tests.lightning_models import TinyModel, loader, trainer

    steps = RecordingHook(fetches="global_step")
    hook = LightningStepCounterHook(every_n_steps=3)
    t = trainer(tmp_dir, [HookCallback([steps]), hook], 10)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        t.fit(TinyModel(), loader())
    assert steps.results == list(range(1, 11))
    acc, series = tensor_series(t.log_dir, "global_step/sec")
    assert [s for s, _ in series] == [4, 7, 10]  # step 1 starts the count
    assert all(v > 0 for _, v in series)
    assert [s for s in acc.Tags()["scalars"] if s == "train_loss"]  # one stream with Lightning's own scalars
    assert len([n for n in os.listdir(t.log_dir) if n.startswith("events.out.tfevents")]) == 1
    logged = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(logged) == 3 and all(m.startswith("global_step/sec: ") for m in logged)
    assert [float(m.split(": ")[1]) for m in logged] == [pytest.approx(v, rel=1e-5) for _, v in series]


def test_lightning_fit_with_the_logger_as_summary_writer_and_batch_size(tmp_dir):
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_prof import StepCounterHook as LightningStepCounterHook
    from tests.lightning_models import TinyModel, loader, trainer

    logger = TensorBoardLogger(os.path.join(tmp_dir, "tb"), name="run")
    hook = LightningStepCounterHook(every_n_steps=2, summary_writer=logger, batch_size=8)
    trainer(tmp_dir, [hook], 5, logger=False).fit(TinyModel(), loader())
    _, series = tensor_series(logger.log_dir, "global_step/sec")
    _, examples = tensor_series(logger.log_dir, "examples/sec")
    assert [s for s, _ in series] == [3, 5]
    assert [(s, v) for s, v in examples] == [(s, pytest.approx(v * 8, rel=1e-5)) for s, v in series]


def test_keras_fit_writes_steps_per_second_into_logs_train(tmp_dir, monkeypatch, caplog):
    from keras_prof import StepCounterHook as KerasStepCounterHook
    from tests.test_keras_prof import fit, model

    monkeypatch.chdir(tmp_dir)
    hook = KerasStepCounterHook(every_n_steps=4)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        fit(model(), [hook], epochs=2)  # 6 steps an epoch
    _, series = tensor_series(os.path.join(tmp_dir, "logs", "train"), "global_step/sec")
    assert [s for s, _ in series] == [5, 9]
    assert all(v > 0 for _, v in series)
    assert len([r for r in caplog.records if r.name == LOGGER]) == 2
