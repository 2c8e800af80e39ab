"""Every Python block of the README and of docs/*.md runs as written, from the repository root, as a new user
would run it, and writes what the page says it writes. Every ```python block runs: show code that must not
run in another fence (```sh, ```text)."""

import glob
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))


def python_blocks(page):
    with open(os.path.join(REPO, page)) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


# (page, index of the block in its page, the block)
PAGE_BLOCKS = [(page, i, block) for page in PAGES for i, block in enumerate(python_blocks(page))]
BLOCKS = [block for _, _, block in PAGE_BLOCKS]

# what a block says it writes, by a line of the block: (glob in the working directory, how many files)
WRITES = {
    "ProfilerHook(save_steps=100)])\ntrainer.fit": [("lightning_logs/version_0/timeline-*.json", 3)],
    "epochs=2, callbacks=[ProfilerHook(save_steps=50)]": [("logs/train/timeline-*.json", 2)],
    "epochs=4, callbacks=[ProfilerHook(save_steps=100)]": [("logs/train/timeline-*.json", 2)],
    "SummarySaverHook(save_steps=50": [("lightning_logs/version_0/events.out.tfevents.*", 1)],
    "StopAtStepHook(last_step=200)": [("lightning_logs/version_0/events.out.tfevents.*", 1)],
    "with_timeline_output": [("step200.json_200", 1), ("run.prof", 1), ("lightning_logs/version_0/timeline-*.json", 3)],
}


def test_the_readme_has_its_examples():
    assert len(python_blocks("README.md")) >= 2 and len(BLOCKS) >= 7  # the README opens with Lightning and Keras
    missing = [key for key in WRITES if not any(key in b for b in BLOCKS)]
    assert not missing, missing  # a block WRITES checks was moved out of the pages this test reads


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{page}-block{i}" for page, i, _ in PAGE_BLOCKS])
def test_a_readme_block_runs_as_written(block, tmp_path):
    # the working directory is a copy of where a user stands: the repository root, here with its examples only;
    # a PYTHONPATH the tests were given (a checkout tested without installing it) stays behind it
    os.symlink(os.path.join(REPO, "examples"), tmp_path / "examples")
    pythonpath = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": pythonpath, "PYTHONWARNINGS": "ignore"}
    env.pop("KERAS_BACKEND", None)  # the blocks set it themselves where they need it
    done = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    for key, expected in WRITES.items():
        if key in block:
            for pattern, count in expected:
                assert len(glob.glob(str(tmp_path / pattern))) == count, (pattern, os.listdir(tmp_path))
