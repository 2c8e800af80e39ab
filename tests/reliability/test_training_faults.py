"""Training faults: KeyboardInterrupt and NaN losses keep TF's end() rules, stop the profiler, keep files
whole, and a later fit traces again; a resumed run (a fresh process) continues both hooks' schedules."""

import glob
import json
import math
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

import hookprof
from hookprof import RunOptions, TraceLevel, summary
from lightning_prof import HookCallback, ProfilerHook
from tests.conftest import RecordingHook, timeline_steps
from tests.lightning_models import TinyModel, loader, trainer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Interrupted(TinyModel):
    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == 2:
            raise KeyboardInterrupt
        return super().training_step(batch, batch_idx)


def test_keyboard_interrupt(tmp_dir):
    previous = signal.getsignal(signal.SIGINT)
    rec = RecordingHook(options=RunOptions(trace_level=TraceLevel.FULL_TRACE))
    out = os.path.join(tmp_dir, "logs")
    saver = hookprof.SummarySaverHook(save_steps=1, output_dir=out, summary_op=summary.scalar("c", 1.0, collections=[]))
    try:
        with pytest.raises(SystemExit):  # Lightning's graceful shutdown
            trainer(tmp_dir, [HookCallback([rec, saver]), ProfilerHook(save_steps=1, output_dir=tmp_dir)], 10,
                    logger=False).fit(Interrupted(), loader())
    finally:
        signal.signal(signal.SIGINT, previous)  # Lightning ignores SIGINT from then on
    assert rec.names() == ["begin", "after_create_session"] + ["before_run", "after_run"] * 2 + ["before_run"]
    assert not torch._C._autograd._profiler_enabled()
    assert timeline_steps(tmp_dir) == [2]  # step 2's; step 3 raised before its trace ended: none, not a partial one
    for path in glob.glob(os.path.join(tmp_dir, "timeline-*.json")):
        json.load(open(path))
    (events,) = glob.glob(os.path.join(out, "events.out.tfevents.*"))
    assert [e.step for e in EventFileLoader(events).Load() if e.HasField("summary")] == [1, 2]
    again = ProfilerHook(save_steps=1, output_dir=os.path.join(tmp_dir, "again"))
    trainer(tmp_dir, [again], 3, logger=False).fit(TinyModel(), loader())
    assert timeline_steps(os.path.join(tmp_dir, "again")) == [2, 3]


class GoesNaN(TinyModel):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.trainer.global_step >= 2 else loss


def test_nan_loss_is_a_clean_step_and_bad_summaries_are_skipped(tmp_dir):
    rec = RecordingHook(fetches="loss")
    op = summary.merge([summary.scalar("loss", lambda step: step.outputs["loss"], collections=[]),
                        summary.histogram("w", lambda step: step.model.fc1.weight, collections=[])])
    out = os.path.join(tmp_dir, "logs")
    saver = hookprof.SummarySaverHook(save_steps=1, output_dir=out, summary_op=op)
    prof = ProfilerHook(save_steps=2, output_dir=tmp_dir, tensorboard=False)
    t = trainer(tmp_dir, [HookCallback([rec, saver]), prof], 5, logger=False)
    t.fit(GoesNaN(), loader())
    assert t.global_step == 5 and rec.names()[-1] == "end"  # TF: a clean finish calls end()
    assert math.isnan(float(rec.results[-1]))
    assert saver.summary_errors >= 2  # NaN weights: the histogram is skipped, the NaN loss is written
    (events,) = glob.glob(os.path.join(out, "events.out.tfevents.*"))
    steps = [e.step for e in EventFileLoader(events).Load() if e.HasField("summary")]
    assert steps == [1, 2, 3, 4, 5]
    assert timeline_steps(tmp_dir) == [2, 4]


RESUME = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    from hookprof import summary
    from lightning_prof import ProfilerHook, SummarySaverHook
    from tests.lightning_models import TinyModel, loader, trainer
    out, steps, ckpt = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    op = summary.scalar("loss", lambda step: step.outputs["loss"])
    hooks = [ProfilerHook(save_steps=3, output_dir=out, tensorboard=False),
             SummarySaverHook(save_steps=3, output_dir=out, summary_op=op)]
    t = trainer(out, hooks, steps, logger=False)
    t.fit(TinyModel(), loader(), ckpt_path=ckpt if ckpt != "-" else None)
    t.save_checkpoint(ckpt if ckpt != "-" else out + "/mid.ckpt")
""")


def test_resume_in_a_fresh_process_continues_both_schedules(tmp_dir):
    script = os.path.join(tmp_dir, "run.py")
    with open(script, "w") as f:
        f.write(RESUME.format(repo=REPO))
    for steps, ckpt in ((5, "-"), (10, os.path.join(tmp_dir, "mid.ckpt"))):
        done = subprocess.run([sys.executable, script, tmp_dir, str(steps), ckpt], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    assert timeline_steps(tmp_dir) == [3, 6, 9]  # no duplicate, none missing across the restart
    steps = []
    for path in sorted(glob.glob(os.path.join(tmp_dir, "events.out.tfevents.*"))):
        steps += [e.step for e in EventFileLoader(path).Load() if e.HasField("summary")]
    assert steps == [1, 4, 7, 10]


KERAS_RESUME = textwrap.dedent("""
    import os, sys
    os.environ["KERAS_BACKEND"] = "torch"
    sys.path.insert(0, {repo!r})
    import keras, numpy as np
    from keras_prof import ProfilerHook, SummarySaverHook, summary
    out, backup, crash = sys.argv[1], sys.argv[2], sys.argv[3] == "crash"

    class Crash(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if crash and int(self.model.optimizer.iterations) == 7:
                raise RuntimeError("crash at step 7")

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.random.rand(96, 8).astype("float32"), np.random.rand(96, 1).astype("float32")
    callbacks = [keras.callbacks.BackupAndRestore(backup, save_freq=5),
                 ProfilerHook(save_steps=4, output_dir=out, tensorboard=False),
                 SummarySaverHook(save_steps=4, output_dir=out, summary_op=summary.scalar(
                     "loss", lambda step: step.outputs["loss"], collections=[])), Crash()]
    model.fit(x, y, batch_size=8, epochs=1, callbacks=callbacks, verbose=0)
""")


def test_keras_resume_through_its_own_checkpoint_continues_the_schedule(tmp_dir):
    script = os.path.join(tmp_dir, "fit.py")
    with open(script, "w") as f:
        f.write(KERAS_RESUME.format(repo=REPO))
    out, backup = os.path.join(tmp_dir, "out"), os.path.join(tmp_dir, "backup")
    crashed = subprocess.run([sys.executable, script, out, backup, "crash"], capture_output=True, text=True,
                             timeout=300)
    assert crashed.returncode != 0 and "crash at step 7" in crashed.stderr
    assert timeline_steps(out) == [4]
    resumed = subprocess.run([sys.executable, script, out, backup, "go"], capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    # Keras restored its backup of step 5; the schedule goes on at 8, 12, 16: 4 not written twice, none missing
    assert timeline_steps(out) == [4, 8, 12, 16]
    # summaries on the uninterrupted run's schedule (the first step, then every 4th), none twice (the resumed fit
    # runs to step 17, as the timelines' 16 shows)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(out)
    events.Reload()
    assert [event.step for event in events.Tensors("loss")] == [1, 5, 9, 13, 17]


def _open_writers():
    from hookprof.tensorboard import events as event_writer

    return dict(event_writer._users)


def test_a_failed_fit_closes_its_writers_without_calling_end(tmp_dir):
    import keras
    import numpy as np

    import keras_prof

    op = summary.scalar("c", 1.0, collections=[])
    rec = RecordingHook()
    lightning_dir = os.path.join(tmp_dir, "lightning")
    hooks = [rec, hookprof.SummarySaverHook(save_steps=1, output_dir=lightning_dir, summary_op=op),
             hookprof.ProfilerHook(save_steps=1, output_dir=lightning_dir)]
    with pytest.raises(RuntimeError, match="boom"):
        trainer(tmp_dir, [HookCallback(hooks)], 10, logger=False).fit(TinyModel(fail_at_step=3), loader())
    assert "end" not in rec.names()
    assert os.path.abspath(lightning_dir) not in _open_writers()  # released, not left to interpreter exit

    keras_dir = os.path.join(tmp_dir, "keras")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    original = model.train_step
    def failing_step(data):
        if int(model.optimizer.iterations) == 2:
            raise RuntimeError("boom")
        return original(data)

    model.train_step = failing_step
    saver = keras_prof.SummarySaverHook(save_steps=1, output_dir=keras_dir, summary_op=op)
    with pytest.raises(RuntimeError, match="boom"):
        model.fit(np.zeros((32, 8), "float32"), np.zeros((32, 1), "float32"), batch_size=8, verbose=0,
                  callbacks=[saver])
    assert os.path.abspath(keras_dir) not in _open_writers()
