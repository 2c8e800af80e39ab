"""Optional dependencies that are not installed: a hook that cannot work without one fails when it is made, before
training, naming the hookprof extra that installs it; one that works without it (ProfilerHook's step graphs,
StepCounterHook's summaries under an adapter's default directory) trains on and says once what to install; the
`hookprof` command names the extra in its one line.

Each case runs in a child process where the module cannot be imported (`tests/without_modules/sitecustomize.py`,
a meta path finder), as on a machine where it was never installed: the shared environment has every extra.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.test_cli import COMMAND, assert_fails_with, run_dir  # noqa: F401  (run_dir: the traced timelines)

WITHOUT_MODULES = os.path.join(os.path.dirname(__file__), "without_modules")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def env_without(*modules: str) -> dict[str, str]:
    """This process's environment, with `modules` not importable in a child started with it."""
    path = os.pathsep.join(p for p in (WITHOUT_MODULES, REPO, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "HOOKPROF_TEST_WITHOUT": ",".join(modules), "KERAS_BACKEND": "torch"}


def run_without(modules: tuple[str, ...], script: str, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, cwd=REPO,
                          env=env_without(*modules), timeout=300)
    assert done.returncode == 0, done.stderr
    return done


def test_the_blocker_hides_the_module_as_if_it_were_not_installed():
    done = run_without(("tensorboard",), "import importlib.util, json\n"
                       "try:\n    import tensorboard\nexcept ModuleNotFoundError as err:\n"
                       "    print(json.dumps(err.name))\n"
                       "print(json.dumps(importlib.util.find_spec('numpy') is not None))")
    assert done.stdout.split() == ['"tensorboard"', "true"], done.stdout


MADE = """
import json, sys
import hookprof, keras_prof, lightning_prof
from hookprof import summary

op = summary.merge([summary.scalar("loss", lambda step: 1.0)])
makers = {
    "hookprof.SummarySaverHook": lambda: hookprof.SummarySaverHook(save_steps=1, output_dir=sys.argv[1], summary_op=op),
    "lightning_prof.SummarySaverHook": lambda: lightning_prof.SummarySaverHook(save_steps=1, summary_op=op),
    "keras_prof.SummarySaverHook": lambda: keras_prof.SummarySaverHook(save_steps=1, summary_op=op),
    "StepCounterHook(output_dir)": lambda: lightning_prof.StepCounterHook(output_dir=sys.argv[1]),
    "StepCounterHook(summary_writer)": lambda: keras_prof.StepCounterHook(summary_writer=sys.argv[1]),
    "StepCounterHook()": lambda: lightning_prof.StepCounterHook(),
    "ProfilerHook()": lambda: lightning_prof.ProfilerHook(save_steps=1),
}
made = {}
for name, make in makers.items():
    try:
        make()
        made[name] = None
    except ModuleNotFoundError as err:
        made[name] = [type(err).__name__, err.name, str(err)]
print(json.dumps(made))
"""


def test_hooks_that_need_tensorboard_fail_when_made_naming_the_extra(tmp_path):
    made = json.loads(run_without(("tensorboard",), MADE, str(tmp_path)).stdout.splitlines()[-1])
    # nothing to write without it: made, they fail before training, each naming hookprof's extra
    for name in ("hookprof.SummarySaverHook", "lightning_prof.SummarySaverHook", "keras_prof.SummarySaverHook"):
        assert made[name] == ["MissingExtraError", "tensorboard", "SummarySaverHook needs the tensorboard package, "
                              "which is not installed: pip install 'hookprof[tensorboard]'"], made[name]
    for name in ("StepCounterHook(output_dir)", "StepCounterHook(summary_writer)"):
        kind, module, message = made[name]
        assert (kind, module) == ("MissingExtraError", "tensorboard"), made[name]
        assert message.startswith("StepCounterHook(output_dir=..., summary_writer=...) needs the tensorboard package")
        assert message.endswith("pip install 'hookprof[tensorboard]'"), message
    # what still works without it is made
    assert made["StepCounterHook()"] is None and made["ProfilerHook()"] is None, made
    assert not list(tmp_path.iterdir())  # and none of them wrote anything


FIT = """
import logging, json, sys
import lightning_prof
from tests.lightning_models import TinyModel, loader, trainer

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stdout)
counter, profiler = lightning_prof.StepCounterHook(every_n_steps=2), lightning_prof.ProfilerHook(save_steps=2)
fit = trainer(sys.argv[1], [counter, profiler], max_steps=6, logger=False)
fit.fit(TinyModel(), loader())
print(json.dumps({"global_step": fit.global_step, "saved": profiler.saved_paths}))
"""


def test_a_fit_without_tensorboard_trains_writes_timelines_and_says_once_what_to_install(tmp_path):
    done = run_without(("tensorboard",), FIT, str(tmp_path))
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["global_step"] == 6 and len(result["saved"]) == 3, result
    assert all(os.path.exists(p) and p.endswith(".json") for p in result["saved"]), result
    assert not [f for _, _, files in os.walk(tmp_path) for f in files if "tfevents" in f]  # no event file
    warnings = [line for line in done.stdout.splitlines() if line.startswith("WARNING")]
    assert len([w for w in warnings if "StepCounterHook logs global_step/sec but writes no summaries" in w]) == 1
    assert len([w for w in warnings if "The tensorboard package is not installed" in w]) == 1, warnings
    assert all("pip install 'hookprof[tensorboard]'" in w for w in warnings if "tensorboard package" in w), warnings
    assert len([line for line in done.stdout.splitlines() if "global_step/sec: " in line]) >= 2, done.stdout


def test_profile_to_pprof_without_protobuf_is_one_line_naming_the_extra(run_dir, tmp_path):  # noqa: F811
    out = tmp_path / "code.pb.gz"
    done = subprocess.run([*COMMAND, "profile", str(run_dir / "runs" / "timeline-2.json"), "--view", "code",
                           "--output", f"pprof:outfile={out}"], capture_output=True, text=True, cwd=tmp_path,
                          env=env_without("google.protobuf"), timeout=120)
    assert_fails_with(done, "hookprof profile: option 'output' 'pprof:outfile=...' needs the protobuf package, which "
                      "is not installed: pip install 'hookprof[pprof]'")
    assert not out.exists()
