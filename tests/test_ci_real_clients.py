"""In CI (`.ci/run` sets HOOKPROF_REQUIRE_REAL_CLIENTS=1 after installing Chromium, Go and libfuse 2) a skipped
real-client test fails the run, whether it skips in its body, by a mark or by a module-level import; other tiers
and CUDA tests skip as before. Checked by running pytest on small test files beside a copy of tests/conftest.py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration  # (it runs pytest in a child; the tools it names are only in its strings)

SKIPS = '''
import pytest

def test_drives_chromium():  # a real client by its source (the tier rule in conftest)
    CHROMIUM = None
    if CHROMIUM is None:
        pytest.skip("no Chromium installed")

@pytest.mark.skipif(True, reason="no Go toolchain (go tool pprof)")
def test_go_tool_pprof():
    pass

def test_a_unit():
    pytest.skip("not on this machine")

@pytest.mark.cuda
def test_on_a_gpu():
    pytest.skip("no CUDA device")
'''

MODULE_SKIP = '''
import pytest

websocket = pytest.importorskip("no_such_module_hookprof_test", reason="a CDP client drives CHROMIUM")

def test_dashboard():
    pass
'''


@pytest.fixture
def folder(tmp_path):
    shutil.copy(os.path.join(os.path.dirname(__file__), "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_skips.py").write_text(SKIPS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    cuda\n    unit\n    integration\n    real_client\n")
    return tmp_path


def pytest_in(folder, required: bool, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HOOKPROF_REQUIRE_REAL_CLIENTS"}
    if required:
        env["HOOKPROF_REQUIRE_REAL_CLIENTS"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True, cwd=folder, env=env, timeout=300)


def outcomes(done: subprocess.CompletedProcess) -> dict[str, str]:
    return dict(re.findall(r"^test_\w+\.py::(\w+) (PASSED|FAILED|SKIPPED|ERROR)", done.stdout, re.MULTILINE))


def test_required_real_client_skips_fail_and_the_others_still_skip(folder):
    done = pytest_in(folder, True, "test_skips.py")
    assert done.returncode == 1, done.stdout + done.stderr
    assert outcomes(done) == {"test_drives_chromium": "FAILED", "test_go_tool_pprof": "ERROR",  # (at setup)
                              "test_a_unit": "SKIPPED", "test_on_a_gpu": "SKIPPED"}, done.stdout
    assert "HOOKPROF_REQUIRE_REAL_CLIENTS=1: a real-client test must run here, not skip (no Chromium installed)" \
        in done.stdout, done.stdout
    assert "(no Go toolchain (go tool pprof))" in done.stdout, done.stdout


def test_without_the_variable_they_skip(folder):
    done = pytest_in(folder, False, "test_skips.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert set(outcomes(done).values()) == {"SKIPPED"} and len(outcomes(done)) == 4, done.stdout


def test_a_real_client_module_skipped_at_import_fails_when_required(folder):
    (folder / "test_module_skip.py").write_text(MODULE_SKIP)
    required, not_required = pytest_in(folder, True, "test_module_skip.py"), pytest_in(folder, False,
                                                                                       "test_module_skip.py")
    assert required.returncode != 0 and "a real-client test must run here, not skip" in required.stdout, \
        required.stdout
    assert not_required.returncode == 5 and "1 skipped" in not_required.stdout, not_required.stdout  # no test ran
