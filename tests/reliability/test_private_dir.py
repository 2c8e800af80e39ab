"""The private export directory under TMPDIR, with real faults: removed mid-fit (a tmp cleaner), swept by a
neighbour in another PID namespace (two containers sharing /tmp), and left by a process that died."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap

import lightning as L
import pytest

from hookprof._runtime.private_dir import PrivateDirectory, remove_unclaimed
from lightning_prof import ProfilerHook
from tests.conftest import timeline_steps
from tests.lightning_models import TinyModel, loader, trainer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATTERN = re.compile(r"^hookprof-(\d+)-")


@pytest.fixture
def tmpdir_env(tmp_path, monkeypatch):
    """A TMPDIR of the test's own (tempfile caches the one it found first)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


class RemoveExportsAt(L.Callback):
    """A tmp cleaner: `rm -rf $TMPDIR/*` at the start of the given steps."""

    def __init__(self, tmp, steps):
        self.tmp, self.steps, self.removed = tmp, steps, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step + 1 in self.steps:
            for name in os.listdir(self.tmp):
                subprocess.run(["rm", "-rf", os.path.join(self.tmp, name)], check=True)
                self.removed.append(name)


def test_an_export_directory_removed_mid_fit_is_made_again_and_no_timeline_is_lost(tmpdir_env, tmp_path, caplog):
    from hookprof.hooks.capture import RENDERS_IN_FLIGHT

    out = str(tmp_path / "out")
    removals = (4, 4 + RENDERS_IN_FLIGHT + 1)  # (apart: the step at the first is rendered by the second)
    cleaner = RemoveExportsAt(tmpdir_env, set(removals))
    hook = ProfilerHook(save_steps=1, output_dir=out, tensorboard=False)
    trainer(out, [hook, cleaner], removals[1] + 2, logger=False).fit(TinyModel(), loader())
    assert any(PATTERN.match(name) for name in cleaner.removed)  # the live directory was removed, twice
    written = set(timeline_steps(out))
    # every step traced after a removal has its timeline (the directory is made again); the steps whose exports
    # were removed while they waited for their render (the RENDERS_IN_FLIGHT ones just before each removal) may
    # be lost, said so
    waited = {step - back for step in removals for back in range(1, RENDERS_IN_FLIGHT + 1)}
    assert {removals[0], *range(removals[1], removals[1] + 3)} <= written <= set(range(2, removals[1] + 3))
    lost = set(range(2, removals[1] + 3)) - written
    assert lost <= waited
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert not [w for w in warnings if "full" in w or "read-only" in w]
    assert len([w for w in warnings if "was removed from the temporary directory" in w]) == min(1, len(lost))
    (left,) = os.listdir(tmpdir_env)  # the one it made again, ours until this process exits
    assert PATTERN.match(left) and int(PATTERN.match(left).group(1)) == os.getpid()


def test_a_neighbour_in_another_pid_namespace_leaves_a_live_directory_alone(tmpdir_env):
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs unshare and root for a PID namespace")
    ours = PrivateDirectory("hookprof-")
    path = ours.path()
    # a process that died without cleaning up (os._exit: no atexit), in this namespace
    dead = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {REPO!r})
        from hookprof._runtime.private_dir import PrivateDirectory
        print(PrivateDirectory("hookprof-").path(), flush=True)
        os._exit(0)
    """)], capture_output=True, text=True, check=True).stdout.strip()
    assert os.path.isdir(dead)
    sweep = textwrap.dedent(f"""
        import os, re, sys
        sys.path.insert(0, {REPO!r})
        from hookprof._runtime.private_dir import remove_unclaimed
        # from in here, this test's pid is no live process: a pid check would call its directory stale
        print(sorted(remove_unclaimed({str(tmpdir_env)!r}, re.compile(r"^hookprof-(\\d+)-"))))
    """)
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", sweep],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    if done.returncode != 0 and "Operation not permitted" in done.stderr:
        pytest.skip(f"no PID namespace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str([os.path.basename(dead)])  # the dead one's, not ours
    assert os.path.isdir(path) and ours.path() == path
    ours.release()
    assert not os.path.exists(path)


def test_a_directory_without_its_lock_file_is_left_while_young(tmpdir_env):
    young = tmpdir_env / "hookprof-999999-young"
    young.mkdir()
    assert remove_unclaimed(str(tmpdir_env), PATTERN) == []
    os.utime(young, (0, 0))  # long ago, and pid 999999 is not running
    assert remove_unclaimed(str(tmpdir_env), PATTERN) == ["hookprof-999999-young"]
