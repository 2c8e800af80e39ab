"""SummarySaverHook and hookprof.summary against real Trainer.fit / Model.fit, read back with TensorBoard."""

import glob
import logging
import os

import keras
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.util import tensor_util

import hookprof
import keras_prof
import lightning_prof
from hookprof import summary
from tests.conftest import FakeClock, RecordingHook
from tests.lightning_models import TinyModel, loader, trainer


@pytest.fixture(autouse=True)
def fresh_collection():
    summary.clear_collection()
    yield
    summary.clear_collection()


def read(logdir):
    acc = EventAccumulator(logdir, size_guidance={"tensors": 0, "images": 0, "scalars": 0})
    acc.Reload()
    return acc


def tensor_series(acc, tag):
    return [(e.step, tensor_util.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)]


def raw_events(logdir):
    events = []
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        events.extend(EventFileLoader(path).Load())
    return events


def test_lightning_summaries_at_exactly_the_saving_steps_with_the_right_values(tmp_dir):
    calls = []
    summary.scalar("loss", lambda step: (calls.append(step.step), step.outputs["loss"])[1])
    summary.histogram("fc1/weight", lambda step: step.model.fc1.weight)
    summary.image("inputs", lambda step: step.batch[0][:2].reshape(2, 1, 2, 4))  # torch: NCHW
    summary.text("note", lambda step: f"step **{step.step}**")
    losses = RecordingHook(fetches={"loss": "loss", "step": "global_step"})
    hook = lightning_prof.SummarySaverHook(save_steps=3, summary_op=summary.merge_all())
    t = trainer(tmp_dir, [lightning_prof.HookCallback([losses]), hook], 7)
    t.fit(TinyModel(), loader())

    assert calls == [1, 4, 7]  # evaluated only on the saving steps: the first, then every 3
    acc = read(t.log_dir)
    logged = {r["step"]: float(r["loss"]) for r in losses.results}
    series = tensor_series(acc, "loss")
    assert [s for s, _ in series] == [1, 4, 7]
    for step, value in series:
        assert float(value) == pytest.approx(logged[step], rel=1e-6)
    for _step, hist in tensor_series(acc, "fc1/weight"):
        assert hist.shape[1] == 3 and hist[:, 2].sum() == 16 * 8  # bucket counts add up to the weight's numel
    images = acc.Images("inputs/image/0")
    assert [(i.step, i.height, i.width) for i in images] == [(1, 2, 4), (4, 2, 4), (7, 2, 4)]
    texts = tensor_series(acc, "note")
    assert [t[1].item().decode() for t in texts] == ["step **1**", "step **4**", "step **7**"]
    # Lightning's own scalars share the run directory and stream, untouched by the session-start event
    assert [e.step for e in acc.Scalars("train_loss")][:3] == [0, 1, 2]
    assert len(glob.glob(os.path.join(t.log_dir, "events.out.tfevents.*"))) == 1


def test_session_start_comes_first_at_the_first_written_step(tmp_dir):
    summary.scalar("one", 1.0)
    out = os.path.join(tmp_dir, "logs")
    hook = hookprof.SummarySaverHook(save_steps=2, output_dir=out, summary_op=summary.merge_all())
    trainer(tmp_dir, [lightning_prof.HookCallback([hook])], 5, logger=False).fit(TinyModel(), loader())
    events = [e for e in raw_events(out) if not e.HasField("file_version")]
    kinds = [("start" if e.HasField("session_log") else "summary", e.step) for e in events]
    assert kinds == [("start", 1), ("summary", 1), ("summary", 3), ("summary", 5)]
    assert events[0].session_log.status == events[0].session_log.START


def test_save_secs_follows_the_clock(tmp_dir):
    clock = FakeClock()

    class Tick(hookprof.SessionRunHook):
        def after_run(self, run_context, run_values):
            clock.now += 4

    summary.scalar("step", lambda step: step.step)
    out = os.path.join(tmp_dir, "logs")
    hook = hookprof.SummarySaverHook(save_secs=10, output_dir=out, summary_op=summary.merge_all(), clock=clock)
    trainer(tmp_dir, [lightning_prof.HookCallback([Tick(), hook])], 9, logger=False).fit(TinyModel(), loader())
    # step k starts at t=4(k-1). Writes at step 1 (its fire recorded at t=4, when it ends); then at the first
    # step starting 10 s after the last fire: step 5 (t=16; fire at t=20), step 9 (t=32)
    assert [s for s, _ in tensor_series(read(out), "step")] == [1, 5, 9]


def test_a_failing_summary_is_skipped_with_its_name_and_step_unless_strict(tmp_dir, caplog):
    summary.scalar("good", lambda step: step.step)
    summary.scalar("bad", lambda step: step.outputs["nope"])
    summary.image("five_d", lambda step: np.zeros((1, 1, 2, 2, 3)))
    out = os.path.join(tmp_dir, "logs")
    hook = hookprof.SummarySaverHook(save_steps=2, output_dir=out, summary_op=summary.merge_all())
    t = trainer(tmp_dir, [lightning_prof.HookCallback([hook])], 4, logger=False)
    t.fit(TinyModel(), loader())
    assert t.global_step == 4 and hook.summary_errors == 4  # 2 bad summaries x 2 writes (steps 1, 3)
    assert [s for s, _ in tensor_series(read(out), "good")] == [1, 3]
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("summary 'bad' (scalar) at step 1: its value function raised KeyError" in m for m in messages)
    assert any("summary 'five_d' (image) at step 1: an image needs 3 or 4 dimensions" in m for m in messages)
    assert len([m for m in messages if "'bad'" in m]) == 1  # warned once, not every step

    summary.clear_collection()
    summary.scalar("bad", lambda step: step.outputs["nope"])
    strict = hookprof.SummarySaverHook(save_steps=2, output_dir=out, summary_op=summary.merge_all(), strict=True)
    with pytest.raises(summary.SummaryError, match=r"summary 'bad' \(scalar\) at step 1"):
        trainer(tmp_dir, [lightning_prof.HookCallback([strict])], 4, logger=False).fit(TinyModel(), loader())


def test_values_of_the_wrong_kind_are_named():
    with pytest.raises(summary.SummaryError,
                       match=r"summary 'lr' \(scalar\) at step None: a scalar needs one number, got the string 'fast'"):
        summary.scalar("lr", "fast")
    with pytest.raises(summary.SummaryError, match=r"summary 'w' \(scalar\).*a scalar needs one number, got float"):
        summary.scalar("w", np.ones((2, 2)))
    with pytest.raises(summary.SummaryError, match=r"summary 'h' \(histogram\).*finite"):
        summary.histogram("h", np.array([1.0, np.nan]))
    with pytest.raises(summary.SummaryError, match=r"summary 'img' \(image\).*1, 3 or 4 channels, got 5"):
        summary.image("img", lambda s: np.zeros((2, 4, 4, 5))).values(hookprof.StepState(3))
    with pytest.raises(ValueError, match=r"sample_rate"):
        summary.audio("a", np.zeros((1, 10)), sample_rate=0)


def test_tf_argument_rules():
    op = summary.scalar("x", 1.0)
    with pytest.raises(ValueError, match=r"^Exactly one of scaffold or summary_op must be provided\.$"):
        hookprof.SummarySaverHook(save_steps=1, output_dir="/tmp")
    with pytest.raises(ValueError, match=r"^Exactly one of scaffold or summary_op must be provided\.$"):
        hookprof.SummarySaverHook(save_steps=1, scaffold=summary.Scaffold(), summary_op=op)
    with pytest.raises(ValueError, match=r"exactly one of `save_steps` or `save_secs`"):
        lightning_prof.SummarySaverHook(summary_op=op)
    with pytest.raises(TypeError, match=r"`summary_writer` must be a TensorBoard writer.*got int"):
        keras_prof.SummarySaverHook(save_steps=1, summary_op=op, summary_writer=3)
    with pytest.raises(TypeError, match=r"`summary_op` must be a summary op"):
        hookprof.SummarySaverHook(save_steps=1, summary_op="loss")
    assert summary.merge_all("nothing-here") is None
    assert summary.Scaffold().summary_op.ops == (op,)  # Scaffold defaults to merge_all, as TF


def test_summary_writer_wins_and_accepts_the_ecosystems_writers(tmp_dir):
    from lightning.pytorch.loggers import TensorBoardLogger
    from torch.utils.tensorboard import SummaryWriter

    summary.scalar("s", lambda step: step.step)
    torch_dir = os.path.join(tmp_dir, "torch")
    writer = SummaryWriter(torch_dir)
    hook = hookprof.SummarySaverHook(save_steps=2, output_dir=os.path.join(tmp_dir, "ignored"),
                                 summary_writer=writer, summary_op=summary.merge_all())
    trainer(tmp_dir, [lightning_prof.HookCallback([hook])], 3, logger=False).fit(TinyModel(), loader())
    writer.close()
    assert [s for s, _ in tensor_series(read(torch_dir), "s")] == [1, 3]
    assert not os.path.exists(os.path.join(tmp_dir, "ignored"))

    logger = TensorBoardLogger(os.path.join(tmp_dir, "tb"), name="run")
    hook = lightning_prof.SummarySaverHook(save_steps=2, summary_writer=logger, summary_op=summary.merge_all())
    trainer(tmp_dir, [hook], 3, logger=logger).fit(TinyModel(), loader())
    assert [s for s, _ in tensor_series(read(logger.log_dir), "s")] == [1, 3]


def test_keras_summaries_on_the_saving_steps(tmp_dir):
    calls = []
    summary.scalar("loss", lambda step: (calls.append(step.step), step.outputs["loss"])[1])
    summary.histogram("fc1/kernel", lambda step: step.model.get_layer("fc1").kernel)
    summary.image("inputs", lambda step: step.batch[0][:1].reshape(1, 2, 4, 1))  # Keras' layout: channels_last
    summary.image("rgb", lambda step: step.batch[0][:2].reshape(2, 2, 1, 4)[..., :3])  # (torch tensors, NHWC)
    logs = RecordingHook(fetches={"loss": "loss", "step": "global_step"})
    out = os.path.join(tmp_dir, "logs", "train")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="fc1"), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.random.default_rng(0).standard_normal((48, 8)).astype("float32"), np.zeros((48, 1), "float32")
    hook = keras_prof.SummarySaverHook(save_steps=4, output_dir=out, summary_op=summary.merge_all())
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[keras_prof.HookCallback([logs]), hook])
    assert calls == [1, 5, 9]
    acc = read(out)
    logged = {r["step"]: float(r["loss"]) for r in logs.results}
    assert [(s, pytest.approx(logged[s])) for s, v in tensor_series(acc, "loss")] == \
        [(s, float(v)) for s, v in tensor_series(acc, "loss")]
    assert [int(h[:, 2].sum()) for _, h in tensor_series(acc, "fc1/kernel")] == [128, 128, 128]
    assert [(i.height, i.width) for i in acc.Images("inputs/image")] == [(2, 4)] * 3
    assert [(i.height, i.width) for i in acc.Images("rgb/image/0")] == [(2, 1)] * 3


def test_keras_default_dir_is_where_keras_tensorboard_writes(tmp_dir, monkeypatch):
    from tests.test_keras_prof import fit, model

    monkeypatch.chdir(tmp_dir)
    hook = keras_prof.SummarySaverHook(save_steps=1, summary_op=summary.scalar("one", 1.0, collections=[]))
    fit(model(), [hook], epochs=1, n=8)  # the default is the fit's working directory's logs/train
    assert hook.hook.output_dir == os.path.join(tmp_dir, "logs", "train")
    assert glob.glob(os.path.join(tmp_dir, "logs", "train", "events.out.tfevents.*"))
