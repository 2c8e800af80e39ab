"""A real TensorBoard server (loopback, random free port, bounded wait, always stopped) serves our summaries."""

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from hookprof import summary
from lightning_prof import SummarySaverHook
from tests.lightning_models import TinyModel, loader, trainer

TENSORBOARD = os.path.join(os.path.dirname(sys.executable), "tensorboard")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


@contextlib.contextmanager
def tensorboard_server(logdir: str, ready):
    """A real `tensorboard --logdir` on a free loopback port: yields its base URL once `ready(base)` is true
    (90 s at most), and is always stopped."""
    port = free_port()
    server = subprocess.Popen([TENSORBOARD, "--logdir", logdir, "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if ready(base):
                    break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"tensorboard did not serve the run: {server.stderr.read().decode()[-2000:]}")
            time.sleep(0.5)
        yield base
    finally:
        stop(server)


def stop(process: subprocess.Popen) -> None:
    """End a process the test started: asked first, killed after 20 s."""
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture
def served_run(tmp_dir):
    summary.clear_collection()
    summary.scalar("loss", lambda step: step.outputs["loss"])
    hook = SummarySaverHook(save_steps=2, summary_op=summary.merge_all())
    t = trainer(tmp_dir, [hook], 5)
    t.fit(TinyModel(), loader())
    summary.clear_collection()
    with tensorboard_server(tmp_dir, lambda base: get_json(base + "/data/runs")) as base:
        yield base, os.path.relpath(t.log_dir, tmp_dir)


def test_server_lists_the_run_and_returns_the_scalar_series(served_run):
    base, run = served_run
    assert run in get_json(base + "/data/runs")
    tags = get_json(base + "/data/plugin/scalars/tags")[run]
    assert {"loss", "train_loss"} <= set(tags)  # ours and Lightning's, one run
    series = get_json(f"{base}/data/plugin/scalars/scalars?run={urllib.parse.quote(run)}&tag=loss")
    assert [step for _, step, _ in series] == [1, 3, 5]
    lightning = {step: value for _, step, value in
                 get_json(f"{base}/data/plugin/scalars/scalars?run={urllib.parse.quote(run)}&tag=train_loss")}
    for _, step, value in series:  # the hook saw the step's loss; Lightning logged it at step - 1
        assert value == pytest.approx(lightning[step - 1], rel=1e-5)
