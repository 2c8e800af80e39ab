"""Real disk faults during real fits, on both frameworks, with ProfilerHook(save_steps=1, show_memory=True) and
SummarySaverHook(save_steps=1): a tmpfs filled and freed, remounted read-only and back, the output directory
removed; an ext4 image shut down (EIO) and mounted again; a directory made unwritable to a process without
root's override (EACCES). The fault starts before step 3 and is gone before step 6.

Each test asserts that `fit` returns, that every file left is readable (json for timelines, TensorBoard's
own reader for event files), which outputs were lost and counted, one warning per output kind naming the path
and the reason, and that writing resumed by itself once the fault was gone.
"""

from __future__ import annotations

import gc
import glob
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import keras
import lightning as L
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

import hookprof
import keras_prof
import lightning_prof
from hookprof import summary
from hookprof._runtime.private_dir import OWNER_FILE
from hookprof.trace import xplane
from hookprof.tracing import xspace
from tests.conftest import timeline_steps
from tests.lightning_models import TinyModel, loader
from tests.reliability.real_disk import Ext4Image, Tmpfs, mounted

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 8
LOST = [3, 4, 5]  # the fault starts before step 3 and is gone before step 6
TIMELINES = [2, 6, 7, 8]  # step 1 only starts ProfilerHook's count (TF 1.14+)
SUMMARIES = [1, 2, 6, 7, 8]


class OnSteps(hookprof.SessionRunHook):
    """Runs `actions[step]` before global step `step`. Before every step it waits until the earlier steps'
    timelines are on disk: they are written on a background thread, so without the wait which step a fault hits
    would be a race, and a tiny model's steps outrun the disk (ProfilerHook would skip traces: see
    `skipped_traces`)."""

    def __init__(self, actions, profiler_hook):
        self.actions, self.profiler_hook = actions, profiler_hook

    def before_run(self, run_context):
        self.profiler_hook.flush()
        action = self.actions.get(run_context.session.global_step + 1)
        if action is not None:
            action()


def summary_op():
    """The loss, and a text of 6 KB: each write needs a new page of the disk, so a full disk fails every one
    (a small record could still fit in the last page of a file)."""
    return summary.merge([summary.scalar("loss", lambda step: float(step.outputs["loss"]), collections=[]),
                          summary.text("notes", "x" * 6000, collections=[])])


def lightning_fit(root, actions, **summary_kwargs):
    """A Lightning fit with its default TensorBoardLogger (log_every_n_steps at Lightning's default, 50: see
    the README on Lightning's own writer), both hooks in the logger's run directory unless told otherwise."""
    profiler = lightning_prof.ProfilerHook(save_steps=1, show_memory=True, output_dir=summary_kwargs.pop("out", None))
    saver = lightning_prof.SummarySaverHook(save_steps=1, summary_op=summary_op(), **summary_kwargs)
    trainer = L.Trainer(max_steps=STEPS, default_root_dir=root, accelerator="cpu", devices=1,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[lightning_prof.HookCallback([OnSteps(actions, profiler.hook)]), profiler, saver])
    trainer.fit(TinyModel(), loader())
    assert trainer.global_step == STEPS  # fit returned, having trained every step
    return profiler.hook, saver.hook


def keras_fit(out, actions, **summary_kwargs):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    profiler = keras_prof.ProfilerHook(save_steps=1, show_memory=True, output_dir=out)
    where = summary_kwargs or {"output_dir": out}
    saver = keras_prof.SummarySaverHook(save_steps=1, summary_op=summary_op(), **where)
    x = keras.random.normal((STEPS * 8, 8), seed=0)
    history = model.fit(x, keras.ops.sum(x, axis=1, keepdims=True), batch_size=8, epochs=1, verbose=0,
                        callbacks=[keras_prof.HookCallback([OnSteps(actions, profiler.hook)]), profiler, saver])
    assert len(history.history["loss"]) == 1 and int(model.optimizer.iterations) == STEPS
    return profiler.hook, saver.hook


def run_dir(root):
    (path,) = glob.glob(os.path.join(root, "lightning_logs", "version_*"))
    return path


def assert_readable(directory):
    """Every file under `directory` reads whole: timelines as JSON, event files record by record with
    TensorBoard's loader, the Profile tab's XSpaces as protobuf (their step's events all there); no temp file is
    left."""
    for folder, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(folder, name)
            assert not name.endswith(".tmp"), f"a temp file is left: {path}"
            if name.startswith("timeline-"):
                with open(path, "rb") as f:
                    assert json.load(f)["traceEvents"]
            elif name.startswith("events.out.tfevents."):
                list(EventFileLoader(path).Load())
            elif name.endswith(xplane.XPLANE_SUFFIX):
                with open(path, "rb") as f:
                    space = xspace.parse_xspace(f.read())
                assert {e.stats[xplane.GROUP_ID] for e in xspace.events(space, frozenset({xplane.GROUP_ID}))} == {
                    int(os.path.basename(folder).removeprefix("step_"))}


def read_events(directory):
    """(steps of the `loss` summary, steps of the step_N graphs) as TensorBoard reads the directory."""
    acc = EventAccumulator(directory, size_guidance={"tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    loss = [e.step for e in acc.Tensors("loss")] if "loss" in tags["tensors"] else []
    graphs = sorted(int(tag.removeprefix("step_")) for tag in tags["run_metadata"])
    return loss, graphs


def warnings_of(caplog, prefix):
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.getMessage().startswith(prefix)]


def assert_lost_and_warned(caplog, profiler, saver, out, reason):
    """Timelines, step graphs, Profile tab runs and summaries of steps 3-5 lost, counted, and each kind warned
    once with the path and the reason."""
    assert profiler.dropped_outputs == 3 * len(LOST) and saver.dropped_outputs == len(LOST)
    (profile,) = [w for w in warnings_of(caplog, "Could not write") if "Profile tab" in w]
    assert "step_0000000003" in profile and reason in profile
    runs = glob.glob(os.path.join(out, "plugins", "profile", "*", "*" + xplane.XPLANE_SUFFIX))
    assert sorted(int(os.path.basename(os.path.dirname(r)).removeprefix("step_")) for r in runs) == TIMELINES
    (timeline,) = warnings_of(caplog, "Could not write timeline")
    assert os.path.join(out, "timeline-3.json") in timeline and reason in timeline
    (graphs,) = warnings_of(caplog, "Could not write step_3 to TensorBoard")
    assert out in graphs and reason in graphs
    (summaries,) = warnings_of(caplog, "Could not write summaries at step 3")
    assert out in summaries and reason in summaries


@pytest.fixture
def disk(tmp_path):
    with mounted(Tmpfs(str(tmp_path / "disk"))) as d:
        yield d


@pytest.fixture
def ext4(tmp_path):
    with mounted(Ext4Image(str(tmp_path / "disk"), str(tmp_path / "disk.img"))) as d:
        yield d


# --- a full disk, then freed --------------------------------------------------------------------------------

def test_lightning_full_disk_costs_the_steps_it_lasts_and_spares_the_loggers_writer(disk, caplog):
    profiler, saver = lightning_fit(disk.path, {3: disk.fill, 6: disk.free})
    out = run_dir(disk.path)
    assert_readable(out)
    assert timeline_steps(out) == TIMELINES
    assert read_events(out) == (SUMMARIES, TIMELINES)
    # the summaries went to Lightning's own event file before and after: its writer was never handed an event
    # the disk could not take (its thread would have died, and Lightning's finalize re-raised its error)
    (event_file,) = glob.glob(os.path.join(out, "events.out.tfevents.*"))
    assert not event_file.endswith(".hookprof")
    assert_lost_and_warned(caplog, profiler, saver, out, "No space left on device")


def test_keras_full_disk_costs_the_steps_it_lasts_and_writes_a_new_event_file(disk, caplog):
    out = os.path.join(disk.path, "logs")
    profiler, saver = keras_fit(out, {3: disk.fill, 6: disk.free})
    assert_readable(out)
    assert timeline_steps(out) == TIMELINES
    assert read_events(out) == (SUMMARIES, TIMELINES)
    assert len(glob.glob(os.path.join(out, "events.out.tfevents.*"))) == 2  # the failed one, then a new one
    assert_lost_and_warned(caplog, profiler, saver, out, "No space left on device")


# --- a read-only remount, then read-write again -------------------------------------------------------------

def test_lightning_read_only_remount(disk, caplog):
    profiler, saver = lightning_fit(disk.path, {3: lambda: disk.remount("ro"), 6: lambda: disk.remount("rw")})
    out = run_dir(disk.path)
    assert_readable(out)
    assert timeline_steps(out) == TIMELINES
    assert read_events(out) == (SUMMARIES, TIMELINES)
    assert_lost_and_warned(caplog, profiler, saver, out, "Read-only file system")


def test_keras_read_only_remount(disk, caplog):
    out = os.path.join(disk.path, "logs")
    profiler, saver = keras_fit(out, {3: lambda: disk.remount("ro"), 6: lambda: disk.remount("rw")})
    assert_readable(out)
    assert timeline_steps(out) == TIMELINES
    assert read_events(out) == (SUMMARIES, TIMELINES)
    assert_lost_and_warned(caplog, profiler, saver, out, "Read-only file system")


# --- the output directory removed mid-run -------------------------------------------------------------------

def test_lightning_output_directory_removed(disk, caplog):
    """The directory is made again at the next write: nothing after the removal is lost. The logger's file went
    with it, so hookprof's events go to a file of its own from then on (said once); the logger is untouched and
    Lightning's own writes at the end (its hparams.yaml) land in the recreated directory."""
    removed = []

    def remove():
        removed.append(run_dir(disk.path))
        shutil.rmtree(removed[0])

    profiler, saver = lightning_fit(disk.path, {3: remove})
    out = removed[0]
    assert_readable(out)
    assert timeline_steps(out) == [3, 4, 5, 6, 7, 8]
    assert read_events(out) == ([3, 4, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8])
    assert glob.glob(os.path.join(out, "events.out.tfevents.*.hookprof"))
    assert os.path.exists(os.path.join(out, "hparams.yaml"))
    assert profiler.dropped_outputs == 0 and saver.dropped_outputs == 0
    (left,) = warnings_of(caplog, "The TensorBoard writer of")
    assert out in left and "its directory is gone" in left


def test_keras_output_directory_removed(disk, caplog):
    out = os.path.join(disk.path, "logs")
    profiler, saver = keras_fit(out, {3: lambda: shutil.rmtree(out)})
    assert_readable(out)
    assert timeline_steps(out) == [3, 4, 5, 6, 7, 8]
    assert read_events(out) == ([3, 4, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8])
    assert profiler.dropped_outputs == 0 and saver.dropped_outputs == 0


# --- EIO: a disk that fails every write, then is mounted again ----------------------------------------------

@pytest.mark.parametrize("framework", ["lightning", "keras"])
def test_eio_kills_tensorboards_writer_and_hookprof_resumes_in_a_new_file(ext4, caplog, framework):
    """The summaries go to the user's own torch SummaryWriter. No check foresees EIO, so the first event
    after the shutdown kills its thread; hookprof leaves it (open: it is the user's), counts and warns, and
    once the disk is back writes into a new event file of its own beside it."""
    from torch.utils.tensorboard import SummaryWriter

    out = os.path.join(ext4.path, "run")
    writer = SummaryWriter(out)
    actions = {3: ext4.shut_down, 6: ext4.recover}
    try:
        if framework == "lightning":
            profiler, saver = lightning_fit(ext4.path, actions, out=out, summary_writer=writer)
        else:
            profiler, saver = keras_fit(out, actions, summary_writer=writer)
        assert_readable(out)
        assert timeline_steps(out) == TIMELINES
        assert read_events(out) == (SUMMARIES, TIMELINES)
        (theirs,) = [p for p in glob.glob(os.path.join(out, "events.out.tfevents.*")) if not p.endswith(".hookprof")]
        assert [e.step for e in _loss_events(theirs)] == [1, 2]  # the user's writer, up to its death
        resumed = [e.step for p in glob.glob(os.path.join(out, "*.hookprof")) for e in _loss_events(p)]
        assert sorted(resumed) == [6, 7, 8]  # hookprof's own file, once the disk was back
        assert writer.file_writer is not None  # never closed by hookprof
        assert_lost_and_warned(caplog, profiler, saver, out, "Input/output error")
        (left,) = warnings_of(caplog, "The TensorBoard writer of")
        assert out in left and "Input/output error" in left
    finally:
        try:
            writer.close()
        except OSError:  # its thread died with the disk: that error is the user's to see
            pass


def _loss_events(path):
    return [e for e in EventFileLoader(path).Load() if any(v.tag == "loss" for v in e.summary.value)]


# --- EACCES: a process without root's override, and a directory it may not write -----------------------------

EACCES_CHILD = textwrap.dedent("""
    import json, logging, os, sys
    os.environ["KERAS_BACKEND"] = "torch"
    sys.path.insert(0, {repo!r})
    from tests.reliability import test_real_faults as t

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger().addHandler(handler)
    result = {{}}
    for framework in ("lightning", "keras"):
        out = os.path.join(sys.argv[1], framework)
        os.makedirs(out)
        actions = {{3: lambda: os.chmod(out, 0o555), 6: lambda: os.chmod(out, 0o755)}}
        del records[:]
        if framework == "lightning":
            profiler, saver = t.lightning_fit(out, actions, out=out, output_dir=out)
        else:
            profiler, saver = t.keras_fit(out, actions)
        t.assert_readable(out)
        result[framework] = dict(
            timelines=t.timeline_steps(out), events=t.read_events(out), dropped=[profiler.dropped_outputs,
            saver.dropped_outputs], warnings=[r.getMessage() for r in records if r.levelno == logging.WARNING
                                              and r.getMessage().startswith("Could not write")])
    print(json.dumps(result))
""")


def test_eacces_in_a_directory_made_read_only(tmp_path):
    """Root writes a 0o555 directory anyway, so the fit runs in a child without CAP_DAC_OVERRIDE (setpriv).
    New files (timelines) fail with EACCES; event files already open for appending are still written."""
    setpriv = shutil.which("setpriv")
    if setpriv is None or os.geteuid() != 0:
        pytest.skip("needs root and setpriv (util-linux) to run a child without CAP_DAC_OVERRIDE")
    script = tmp_path / "child.py"
    script.write_text(EACCES_CHILD.format(repo=REPO))
    child = subprocess.run([setpriv, "--bounding-set", "-dac_override,-dac_read_search", sys.executable, str(script),
                            str(tmp_path)], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "KERAS_BACKEND": "torch"})
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    for framework in ("lightning", "keras"):
        got = result[framework]
        out = str(tmp_path / framework)
        assert got["timelines"] == TIMELINES
        everything = list(range(1, STEPS + 1))
        assert got["events"] == [everything, everything[1:]]  # appends to its existing event file go on
        assert got["dropped"] == [len(LOST), 0]
        (warning,) = got["warnings"]
        assert os.path.join(out, "timeline-3.json") in warning and "Permission denied" in warning


def test_a_new_event_file_is_read_after_the_files_already_there(tmp_path):
    """TensorBoard reads a directory's event files in name order. A file hookprof starts (after another
    writer's, or after one of its own failed) is named to come after them, even within the same second or
    behind a clock that moved back."""
    from tensorboard.compat.proto.event_pb2 import Event

    from hookprof.tensorboard.events import EventWriter

    theirs = tmp_path / "events.out.tfevents.9999999990.host.1.12"  # newer than now, with a longer counter
    theirs.write_bytes(b"")
    writer = EventWriter(str(tmp_path))
    writer.add_event(Event(step=1))
    assert sorted(p.name for p in tmp_path.iterdir())[-1] == os.path.basename(writer.path)
    assert os.path.basename(writer.path).startswith("events.out.tfevents.9999999991.")


# --- a temporary directory too small for kineto's export of each traced step, then grown -------------------

def test_a_temporary_directory_without_room_costs_the_traces_until_it_has_room(tmp_path, monkeypatch, caplog):
    import tempfile

    with mounted(Tmpfs(str(tmp_path / "tmp"), size="16k")) as tmp:  # an export of this step is ~80 KB
        monkeypatch.setattr(tempfile, "tempdir", tmp.path)  # (what TMPDIR sets, read once per process)
        out = str(tmp_path / "out")
        grow = lambda: subprocess.run(["mount", "-o", "remount,size=8m", tmp.path], check=True)  # noqa: E731
        profiler, _ = lightning_fit(str(tmp_path), {6: grow}, out=out)
        assert_readable(out)
        assert timeline_steps(out) == [6, 7, 8]
        assert profiler.dropped_outputs == 4  # steps 2-5
        (warning,) = warnings_of(caplog, "Could not export traced step 2")
        assert tmp.path in warning and "TMPDIR" in warning
        gc.collect()
        left = [os.path.join(folder, name) for folder, _, names in os.walk(tmp.path) for name in names
                if name != OWNER_FILE]  # (the lock that claims this process's export directory while it lives)
        assert left == []  # no export, and none of kineto's own temp files, left behind
