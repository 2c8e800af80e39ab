"""The installed shape, as a new user meets it: a wheel built from this repo, installed (not editable) into a
fresh virtualenv, used from a project that has its own top-level `core` package.

The wheel must carry `hookprof` (from the `core/` folder), `lightning_prof`, `keras_prof` and the `hookprof`
console script, and nothing under `core/`. The fresh venv borrows the heavy dependencies (torch, lightning,
keras, ...) from the running environment's site-packages through a plain path line in a `.pth` file, which
does not run that directory's own `.pth` files, so the editable hookprof installed there cannot leak in.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Left out of the copy the wheel is built from: the build must neither see stale outputs nor write into the repo.
COPY_IGNORE = shutil.ignore_patterns(
    ".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "runs", "lightning_logs", "*.ckpt")


def _run(cmd, timeout=180, **kwargs):
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kwargs)
    assert result.returncode == 0, (
        f"{cmd} exited {result.returncode}\n--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}")
    return result


def _bin(venv: Path, name: str) -> Path:
    return venv / ("Scripts" if os.name == "nt" else "bin") / (name + (".exe" if os.name == "nt" else ""))


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """Build the wheel from a clean copy of the repo and install it into a brand-new venv."""
    root = tmp_path_factory.mktemp("install")

    src = root / "src"
    shutil.copytree(REPO, src, ignore=COPY_IGNORE)
    wheels = root / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", wheels, src])
    (wheel,) = wheels.glob("hookprof-*.whl")

    venv = root / "venv"
    # No pip in the new venv (ensurepip costs seconds): this environment's pip installs into it via --python.
    _run([sys.executable, "-m", "venv", "--without-pip", venv], timeout=60)
    python = _bin(venv, "python")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel])

    # Make the dependencies visible without reinstalling them: one plain path line, no `import` line.
    new_site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    deps_site = Path(sysconfig.get_paths()["purelib"])
    assert new_site != deps_site
    (new_site / "zz_hookprof_test_deps.pth").write_text(f"{deps_site}\n")

    return {"root": root, "wheel": wheel, "venv": venv.resolve(), "python": python, "site": new_site}


def test_wheel_contents(installed):
    with zipfile.ZipFile(installed["wheel"]) as wheel:
        names = wheel.namelist()
        entry_points = next(
            (wheel.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt")), "")

    assert "hookprof/__init__.py" in names, names
    assert "hookprof/cli.py" in names, names
    for package in ("hookprof/hooks/", "hookprof/_runtime/", "hookprof/profiler/", "hookprof/tensorboard/",
                    "hookprof/trace/", "hookprof/tracing/", "lightning_prof/", "keras_prof/"):
        assert f"{package}__init__.py" in names, (package, names)
    assert "hookprof/hooks/profiler_hook.py" in names, names
    assert "lightning_prof/callbacks.py" in names, names
    assert "keras_prof/callbacks.py" in names, names
    # what type checkers read: the callbacks' stubs (their classes are made at import) and PEP 561's markers
    for typed in ("hookprof/py.typed", "lightning_prof/py.typed", "keras_prof/py.typed", "lightning_prof/callbacks.pyi",
                  "keras_prof/callbacks.pyi"):
        assert typed in names, (typed, names)

    # `packages` in pyproject.toml is an explicit list: every module of the three folders must have made it in.
    for folder, package in (("core", "hookprof"), ("lightning_prof", "lightning_prof"), ("keras_prof", "keras_prof")):
        for module in sorted((REPO / folder).rglob("*.py")):
            if "__pycache__" not in module.parts:
                wanted = f"{package}/{module.relative_to(REPO / folder).as_posix()}"
                assert wanted in names, (f"{module} is not in the wheel as {wanted}", names)

    assert not [n for n in names if n.startswith("core/") or n == "core"], names
    assert not [n for n in names if n.startswith("tests/")], names
    top_level = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert top_level == {"hookprof", "lightning_prof", "keras_prof"}, top_level

    assert "[console_scripts]" in entry_points, entry_points
    assert "hookprof = hookprof.cli:main" in entry_points, entry_points


@pytest.mark.parametrize("version, kept", [("2.11.0", True), ("2.10.0", False)])
def test_pip_keeps_an_installed_torch_from_the_floor_on(installed, version, kept):
    """The README: a torch of 2.11 or later already installed is kept. pip, resolving `hookprof[torch]` against a
    venv whose torch claims `version` (its metadata, first on the path), installs nothing at 2.11.0 and wants
    another torch at 2.10.0."""
    fake = installed["site"] / f"torch-{version}.dist-info"
    fake.mkdir()
    try:
        (fake / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
        (fake / "INSTALLER").write_text("pip\n")
        (fake / "RECORD").write_text("")
        result = subprocess.run([sys.executable, "-m", "pip", "--python", installed["python"], "install", "--dry-run",
                                 "--no-index", "--report", "-", "--quiet", f"{installed['wheel']}[torch]"],
                                capture_output=True, text=True, timeout=180)
    finally:
        shutil.rmtree(fake)
    if kept:
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["install"] == [], result.stdout  # torch (and the rest) kept as found
    elif result.returncode == 0:  # a torch wheel pip can reach (this machine's local CPU wheel) replaces it
        assert [item["metadata"]["name"] for item in json.loads(result.stdout)["install"]] == ["torch"]
    else:  # none to be had without an index
        assert "torch>=2.11" in result.stderr, (result.stdout, result.stderr)  # (the floor, not another failure)


USER_SCRIPT = """\
import json, os, sys

import core
assert getattr(core, "USER_CORE", False) is True, core.__file__
from core.summary import describe

import torch
import lightning
import hookprof, lightning_prof, keras_prof
import hookprof.hooks, hookprof.cli

import core as core_again
assert core_again is core and core.USER_CORE and describe() == "the user's own summary", core.__file__

torch.manual_seed(0)


class Tiny(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


out = sys.argv[1]
data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
trainer = lightning.Trainer(
    max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False, accelerator="cpu", devices=1,
    callbacks=[lightning_prof.ProfilerHook(save_steps=2, output_dir=out)])
trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))

print(json.dumps({
    "hookprof": hookprof.__file__,
    "lightning_prof": lightning_prof.__file__,
    "keras_prof": keras_prof.__file__,
    "core": core.__file__,
    "user_core": sys.modules["core"].USER_CORE,
    "files": sorted(os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs),
}))
"""


@pytest.fixture(scope="module")
def user_run(installed):
    """A user project with its own `core` package trains a tiny Lightning model with the installed hookprof."""
    project = installed["root"] / "project"
    (project / "core").mkdir(parents=True)
    (project / "core" / "__init__.py").write_text("USER_CORE = True\n")
    (project / "core" / "summary.py").write_text("def describe():\n    return \"the user's own summary\"\n")
    (project / "train.py").write_text(USER_SCRIPT)
    out = installed["root"] / "timelines"

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(KERAS_BACKEND="torch", PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1")
    result = _run([installed["python"], "train.py", out], cwd=project, env=env, timeout=240)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    return {"report": report, "out": out, "env": env, "project": project, "result": result}


def test_user_project_trains_with_installed_hookprof(installed, user_run):
    report, out, result = user_run["report"], user_run["out"], user_run["result"]
    context = f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"

    venv = installed["venv"]
    for package in ("hookprof", "lightning_prof", "keras_prof"):
        assert Path(report[package]).resolve().is_relative_to(venv), (package, report, context)
    assert Path(report["core"]).resolve() == (user_run["project"] / "core" / "__init__.py").resolve(), context
    assert report["user_core"] is True, context

    for step in (2, 4):
        path = out / f"timeline-{step}.json"
        assert f"timeline-{step}.json" in report["files"], (report["files"], context)
        trace = json.loads(path.read_text())
        assert isinstance(trace["traceEvents"], list) and trace["traceEvents"], (path, trace.keys())


def test_console_script_summary(installed, user_run):
    script = _bin(installed["venv"], "hookprof")
    assert script.exists(), sorted(p.name for p in script.parent.iterdir())
    timeline = user_run["out"] / "timeline-4.json"
    result = _run([script, "summary", timeline], cwd=user_run["project"], env=user_run["env"], timeout=120)
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{timeline}: ") and " ops (" in lines[0], (
        f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}")
    assert int(lines[0].split(": ", 1)[1].split(" ops", 1)[0]) > 0, lines[0]


# What a user's type checker makes of the installed wheel (PEP 561: the `py.typed` markers and the callbacks'
# stubs). GOOD calls everything right, and `assert_type` fails where the API hands back `Any` or the wrong type;
# each line of BAD that ends in `# error: CODE` must be flagged with that code, and nothing else.
TYPED_GOOD = """\
from __future__ import annotations

import collections
from typing import assert_type

import keras_prof
import lightning_prof
from hookprof import CaptureOptions, ProfileOptionBuilder, Profiler, ProfilerHook, SummarySaverHook, summary
from hookprof.cli import main
from hookprof.profiler.views import OpViewResult, ViewNode
from hookprof.triggers import LossSpike, MemoryJump, NonFinite, SlowStep

profiler = Profiler()
hook = ProfilerHook(save_steps=10, output_dir="runs", profiler=profiler, keep_last=2,
                    capture=CaptureOptions(render_worker=False, max_pending_writes=4),
                    triggers=[SlowStep(factor=3.0), NonFinite("loss"), LossSpike(), MemoryJump(2**20)])
assert_type(hook.saved_paths, list[str])
assert_type(hook.fired, collections.Counter[str])
callback = lightning_prof.ProfilerHook(save_secs=60.0, ranks=[0], capture_steps=2, name="slow")
assert_type(callback.hook, ProfilerHook)
assert_type(callback.saved_paths, list[str])
summaries = keras_prof.SummarySaverHook(save_steps=5, summary_op=summary.merge_all())
assert_type(summaries.hook, SummarySaverHook)
options = ProfileOptionBuilder(ProfileOptionBuilder.time_and_memory()).with_max_depth(3).build()
assert_type(profiler.profile_operations(options), OpViewResult)
assert_type(profiler.profile_python(options), ViewNode)
assert_type(main(["summary", "runs/timeline-10.json"]), int)
"""

TYPED_BAD = """\
import keras_prof
import lightning_prof
from hookprof import CaptureOptions, Profiler, ProfilerHook
from hookprof.triggers import SlowStep

ProfilerHook(save_steps="x")  # error: arg-type
lightning_prof.ProfilerHook(save_steps="x")  # error: arg-type
keras_prof.ProfilerHook(save_steps=10, profiler="prof")  # error: arg-type
ProfilerHook(save_steps=10, capture={"render_worker": False})  # error: arg-type
ProfilerHook(save_steps=10, triggers=[SlowStep, "loss"])  # error: list-item
lightning_prof.ProfilerHook(save_step=10)  # error: call-arg
CaptureOptions(render_worker="no")  # error: arg-type
paths: int = ProfilerHook(save_steps=1).saved_paths  # error: assignment
Profiler().profile_python({"max_depth": 3}).total["micros"].upper()  # error: attr-defined
from hookprof import ProfilerHok  # error: attr-defined
"""


def test_a_type_checker_reads_the_installed_api(installed, user_run):
    """mypy --strict on a user's scripts, against the wheel installed in the fresh venv: the right calls are clean
    and precisely typed, every misuse is flagged (without `py.typed`, every hookprof name would be `Any`)."""
    pytest.importorskip("mypy", reason="mypy is in the test extra (pip install -e '.[test]')")
    folder = installed["root"] / "typed"
    folder.mkdir()
    (folder / "good.py").write_text(TYPED_GOOD)
    (folder / "bad.py").write_text(TYPED_BAD)
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--python-executable", installed["python"], "--cache-dir", folder / "cache",
         "--strict", "--no-error-summary", "--show-error-codes", "--hide-error-context", "good.py", "bad.py"],
        capture_output=True, text=True, cwd=folder, env=user_run["env"], timeout=600)
    found = sorted({(f, int(line), code) for f, line, code in re.findall(
        r"^(\w+\.py):(\d+): error: .*\[([\w-]+)\]$", done.stdout, re.MULTILINE)})
    wanted = sorted(("bad.py", n, code) for n, line in enumerate(TYPED_BAD.splitlines(), start=1)
                    for code in re.findall(r"# error: ([\w-]+)$", line))
    assert found == wanted, done.stdout + done.stderr
    assert done.returncode == 1 and "good.py" not in done.stdout, done.stdout + done.stderr


def _metadata(wheel: Path) -> tuple[str, dict[str, bytes]]:
    """The wheel's METADATA text, and its files under `.dist-info/` by their name there."""
    with zipfile.ZipFile(wheel) as archive:
        info = {n.split(".dist-info/", 1)[1]: archive.read(n) for n in archive.namelist() if ".dist-info/" in n}
    return info["METADATA"].decode(), info


def test_the_wheel_carries_the_license_and_the_metadata_a_package_index_shows(installed):
    metadata, info = _metadata(installed["wheel"])
    headers, _, description = metadata.partition("\n\n")
    fields = re.findall(r"^([\w-]+): (.*)$", headers, re.MULTILINE)

    # Apache-2.0 asks for its text to travel with every copy
    assert ("License-Expression", "Apache-2.0") in fields and ("License-File", "LICENSE") in fields, headers
    assert info["licenses/LICENSE"] == (REPO / "LICENSE").read_bytes()
    assert info["licenses/LICENSE"].lstrip().startswith(b"Apache License\n                           Version 2.0")
    classifiers = {value for key, value in fields if key == "Classifier"}
    assert {"Typing :: Typed", "Programming Language :: Python :: 3.11"} <= classifiers, classifiers
    assert dict(fields).get("Keywords") and dict(fields).get("Author"), headers

    # the long description is the README: on an index, a link or image relative to the repository leads nowhere
    assert description.startswith("# hookprof"), description[:200]
    targets = re.findall(r"\]\(([^)\s]+)\)|<(?:img|a)\s[^>]*(?:src|href)=\"([^\"]+)\"", description)
    relative = [t for pair in targets for t in pair if t and not re.match(r"https?://|#", t)]
    assert not relative, relative


def test_version_is_the_installed_distributions(installed, user_run):
    version = re.search(r"^Version: (\S+)$", _metadata(installed["wheel"])[0], re.MULTILINE)[1]
    shown = _run([_bin(installed["venv"], "hookprof"), "--version"], env=user_run["env"], cwd=installed["root"])
    assert shown.stdout == f"hookprof {version}\n", shown.stdout
    attribute = _run([installed["python"], "-c", "import hookprof; print(hookprof.__version__)"],
                     env=user_run["env"], cwd=installed["root"])
    assert attribute.stdout == f"{version}\n", attribute.stdout
