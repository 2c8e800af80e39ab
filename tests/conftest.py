"""Shared test fixtures: tiny real models for Lightning and Keras (torch backend), and a recording hook."""

from __future__ import annotations

import inspect
import os
import re

os.environ.setdefault("KERAS_BACKEND", "torch")  # before anything imports keras

import pytest

from hookprof import SessionRunArgs, SessionRunHook
from hookprof.trace.reader import load_trace  # noqa: F401  (tests read traces the way users' tools do)

# Test tiers (`pytest -m unit`, `-m integration`, `-m real_client`; `make test` runs all): a test is
# `real_client` when it drives a tool or system facility outside Python (Chromium, go tool pprof, a tensorboard
# server, a tmpfs/ext4/FUSE mount, a PID namespace, a CUDA device), else `integration` when it runs a real
# Lightning or Keras fit or a child Python process (a script, the CLI), else `unit`. Read from the source of
# each test and of its fixtures (a helper it calls is known by name below); a test marked with a tier keeps it.
TIERS = ("unit", "integration", "real_client")
_REAL_CLIENT = re.compile(r"CHROMIUM|chromium|go_pprof|\bgo tool\b|which\(\"go\"\)|tensorboard_server|"
                          r"serve_tensorboard|\"--logdir\"|Tmpfs|mounted\(|\bext4\b|slow_fs|SlowFs|unshare")
_REAL_FIT = re.compile(r"\bfit\(|\.fit\(|\w+_fit\(|\bfit_\w+\(|\btrainer\(|Trainer\(|run_fit|ddp_run|"
                       r"keras_jax_fit|sys\.executable|subprocess\.|Popen|run_cli|run_child|run_without|profiled_fit|fit_and_")


def _source(function) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


def tier_of(item) -> str:
    """The tier of a test, from its function's source and its fixtures' (a fixture may run the fit)."""
    fixtures = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    source = "\n".join([_source(getattr(item, "function", None))] + [
        _source(definition.func) for definitions in fixtures.values() for definition in definitions
        if definition.baseid])  # (the project's own fixtures, not pytest's)
    if _REAL_CLIENT.search(source):
        return "real_client"
    return "integration" if _REAL_FIT.search(source) else "unit"


def pytest_collection_modifyitems(items):
    for item in items:
        own = [mark.name for mark in item.iter_markers() if mark.name in TIERS]
        if not own:
            item.add_marker(getattr(pytest.mark, "real_client" if item.get_closest_marker("cuda") else tier_of(item)))


class RecordingHook(SessionRunHook):
    """Records every lifecycle call; optionally fetches, traces, or stops at a step."""

    def __init__(self, fetches=None, options=None, stop_at=None):
        self.calls: list[tuple] = []
        self.results: list = []
        self.metadata: list = []
        self.fetches = fetches
        self.options = options
        self.stop_at = stop_at

    def begin(self):
        self.calls.append(("begin",))

    def after_create_session(self, session, coord):
        self.calls.append(("after_create_session",))

    def before_run(self, run_context):
        self.calls.append(("before_run", run_context.session.global_step))
        if self.fetches is None and self.options is None:
            return None
        return SessionRunArgs(fetches=self.fetches, options=self.options)

    def after_run(self, run_context, run_values):
        step = run_context.session.global_step
        self.calls.append(("after_run", step))
        self.results.append(run_values.results)
        self.metadata.append(run_values.run_metadata)
        if self.stop_at is not None and step >= self.stop_at:
            run_context.request_stop()

    def end(self, session):
        self.calls.append(("end",))

    def names(self):
        return [c[0] for c in self.calls]


class FakeClock:
    """A seconds clock the test moves by hand."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def op_events(trace, cat="Op"):
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == cat]


def timeline_steps(directory):
    """The step numbers of the timeline-<step>.json (or .json.gz) files in `directory`, sorted."""
    names = [n.removesuffix(".gz") for n in os.listdir(directory) if n.startswith("timeline-")]
    return sorted(int(n[len("timeline-"):-len(".json")]) for n in names if n.endswith(".json"))


def skip_where_cuda_started(why: str = "") -> None:
    """Skip a test of CPU steps in a process that has started CUDA (an earlier test ran a model on the GPU, as on a
    GPU machine): its steps record the CUDA runtime's calls, each with a per-step correlation id, so no two have
    one shape and a borrowing step's host holds more than its ops."""
    import torch

    if torch.cuda.is_initialized():
        pytest.skip("this process has started CUDA" + (f": {why}" if why else ""))


@pytest.fixture
def tmp_dir(tmp_path):
    return str(tmp_path)


class NoFastPath:
    """A hook seen without `quiet_on` (duck-typed, as hooks ported from TF are): the driver calls its
    before_run/after_run on every step, as TF did."""

    def __init__(self, hook):
        self.hook = hook

    def __getattr__(self, name):
        if name == "quiet_on":
            raise AttributeError(name)
        return getattr(self.hook, name)


# The Lightning and Keras fits' tests (`pytestmark = NO_UNCLOSED_RESOURCES`): a file, pipe or process that hookprof
# leaves unclosed is an error there (a ResourceWarning raised in a finalizer reaches pytest as unraisable).
NO_UNCLOSED_RESOURCES = [pytest.mark.filterwarnings("error::ResourceWarning"),
                         pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")]


# CI installs what the real-client tests drive (`.ci/run`: Chromium, Go, libfuse 2) and sets this: there a skipped
# real-client test is a failure, so a missing tool cannot pass unseen. CUDA tests still skip without a GPU.
REQUIRE_REAL_CLIENTS = os.environ.get("HOOKPROF_REQUIRE_REAL_CLIENTS") == "1"
_REQUIRED = "HOOKPROF_REQUIRE_REAL_CLIENTS=1: a real-client test must run here, not skip"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if (REQUIRE_REAL_CLIENTS and report.skipped and item.get_closest_marker("real_client")
            and not item.get_closest_marker("cuda") and not hasattr(report, "wasxfail")):
        report.outcome, report.longrepr = "failed", _required_failure(report)


def _required_failure(report) -> str:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return f"{_REQUIRED} ({reason.removeprefix('Skipped: ')})"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A whole real-client module skipped at import (`pytest.importorskip` of what drives the tool) fails too."""
    report = (yield).get_result()
    if REQUIRE_REAL_CLIENTS and report.skipped and isinstance(collector, pytest.Module):
        if _REAL_CLIENT.search(collector.path.read_text()):
            report.outcome, report.longrepr = "failed", _required_failure(report)
