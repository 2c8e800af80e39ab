"""Files hookprof opens for writing or appending refuse to follow a symlink planted in the output directory
(issue 29): an event file reopened by name for each event, and the temp files of atomic writes."""

from __future__ import annotations

import glob
import logging
import os

import keras
import numpy as np
import pytest

import keras_prof
from hookprof import summary
from hookprof._runtime import atomic_file


class PlantSymlink(keras.callbacks.Callback):
    """After batch `at`, replaces the event file in `logdir` with a symlink to `target`: the next event would
    be appended through it."""

    def __init__(self, logdir, target, at):
        super().__init__()
        self.logdir, self.target, self.at, self.planted = logdir, target, at, None

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.at:
            (path,) = glob.glob(os.path.join(self.logdir, "events.out.tfevents.*"))
            os.unlink(path)
            os.symlink(self.target, path)
            self.planted = path


def test_an_event_file_replaced_by_a_symlink_is_not_written_through(tmp_path, caplog):
    summary.clear_collection()
    out, victim = str(tmp_path / "logs"), str(tmp_path / "victim.txt")
    with open(victim, "wb") as f:
        f.write(b"the user's file\n")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.zeros((32, 8), "float32"), np.zeros((32, 1), "float32")
    hook = keras_prof.SummarySaverHook(save_steps=1, output_dir=out,
                                       summary_op=summary.scalar("one", 1.0, collections=[]))
    planter = PlantSymlink(out, victim, at=1)
    with caplog.at_level(logging.WARNING):
        history = model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[hook, planter])
    assert len(history.history["loss"]) == 1  # the fit finished
    with open(victim, "rb") as f:
        assert f.read() == b"the user's file\n"  # nothing appended through the symlink
    assert os.path.islink(planter.planted)
    assert hook.hook.dropped_outputs == 1  # the one event refused; the next ones go to a new file
    others = [p for p in glob.glob(os.path.join(out, "events.out.tfevents.*")) if not os.path.islink(p)]
    assert len(others) == 1 and os.path.getsize(others[0]) > 0
    assert sum("Too many levels of symbolic links" in r.getMessage() for r in caplog.records) == 1


def test_an_atomic_write_temp_file_refuses_a_planted_symlink(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"keep\n")
    temp = str(tmp_path / ".timeline-3.json.1.0123abcd.tmp")
    os.symlink(victim, temp)
    with pytest.raises(OSError):
        atomic_file.FILE_LAYER.open_temp(temp)
    assert victim.read_bytes() == b"keep\n"
