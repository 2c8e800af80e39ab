"""The torch tracer on a torch without one of the private APIs it uses (`hookprof.tracing.torch_private`):
each is removed for one test (as an older or newer torch may lack it), and the trace goes on with what the
fallback gives, with one warning naming the API and what the trace loses (none where nothing is lost)."""

from __future__ import annotations

import logging

import pytest
import torch

from hookprof import RunOptions, TraceLevel
from hookprof._runtime.warn_once import WarnOnce
from hookprof.tracing import torch_private
from hookprof.tracing.torch_dataflow import written_arguments
from hookprof.tracing.torch_tracer import TorchTracer

ALL = RunOptions(trace_level=TraceLevel.FULL_TRACE, record_dataflow=True, record_memory=True)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(32, 64), torch.nn.Linear(64, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def traced_step():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracer = TorchTracer(model)
    tracer.start(ALL)
    model(torch.randn(16, 32)).sum().backward()
    opt.step()
    return tracer.stop()


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees the process's first warning (they are once per process)."""
    monkeypatch.setattr(torch_private, "_warn_once", WarnOnce(torch_private.log))
    written_arguments.cache_clear()
    yield
    written_arguments.cache_clear()


def warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == torch_private.log.name]


def test_with_every_private_api_the_trace_has_dataflow_memory_and_scopes(caplog):
    stats = traced_step()
    assert stats.edges and stats.allocations and stats.memory_samples
    assert {n.scope for n in stats.all_nodes() if n.category == "Module"} >= {"Net/fc1", "Net/fc2"}
    assert warnings(caplog) == []


def test_without_the_event_tree_the_trace_has_ops_but_no_dataflow_or_memory(monkeypatch, caplog):
    monkeypatch.delattr(torch._C._profiler, "_EventType")
    first, second = traced_step(), traced_step()
    for stats in (first, second):
        assert [n for n in stats.all_nodes() if n.op == "aten::addmm"]
        assert not stats.edges and not stats.allocations and not stats.memory_samples
    (warning,) = warnings(caplog)  # once, not once per step
    assert "torch._C._profiler._EventType" in warning and "no dataflow arrows and no memory tracks" in warning


def test_without_the_record_types_tensors_and_ops_are_told_apart_by_their_fields(monkeypatch, caplog):
    """The event tree's tensor arguments and events are recognised by their types (fast) or, without them, by
    their fields and tags: the same arrows, allocations and shapes, and nothing lost to warn about."""

    def content(stats):
        return ([(e.producer.node_name, e.consumer.node_name, e.tensor) for e in stats.edges],
                [(a.nbytes, a.tensor) for a in stats.allocations],
                {n.node_name: n.outputs for n in stats.all_nodes() if n.outputs})

    with_type = content(traced_step())
    monkeypatch.delattr(torch._C._profiler, "_TensorMetadata")
    without = content(traced_step())
    assert with_type[0] and with_type[1] and with_type[2]
    assert without == with_type
    # without the events' field types, the walk tells ops and allocations by each event's tag
    monkeypatch.delattr(torch._C._profiler, "_ExtraFields_TorchOp")
    monkeypatch.delattr(torch._C._profiler, "_ExtraFields_Allocation")
    assert content(traced_step()) == with_type
    assert warnings(caplog) == []


def test_without_operator_schemas_in_place_writes_are_found_by_name(monkeypatch, caplog):
    assert written_arguments("aten::add", 4) == {3}  # add.out: `Tensor(a!) out`, from its schema
    written_arguments.cache_clear()
    monkeypatch.delattr(torch._C, "_jit_get_schemas_for_operator")
    assert written_arguments("aten::add", 4) == frozenset()  # lost without the schema
    assert written_arguments("aten::add_", 3) == {0}  # torch's naming rule still finds this one
    assert traced_step().edges  # the rest of the dataflow is still there
    (warning,) = warnings(caplog)
    assert "torch._C._jit_get_schemas_for_operator" in warning and "found by op name only" in warning


def test_without_profiler_enabled_the_tracer_traces_and_says_what_it_cannot_check(monkeypatch, caplog):
    monkeypatch.delattr(torch._C._autograd, "_profiler_enabled")
    assert [n for n in traced_step().all_nodes() if n.op == "aten::addmm"]
    (warning,) = warnings(caplog)
    assert "torch._C._autograd._profiler_enabled" in warning and "another torch profiler" in warning


def test_without_the_fast_span_module_scopes_come_from_record_function(monkeypatch, caplog):
    monkeypatch.delattr(torch._C._profiler, "_RecordFunctionFast")
    assert torch_private.record_function_class() is torch.autograd.profiler.record_function
    stats = traced_step()
    assert {n.scope for n in stats.all_nodes() if n.category == "Module"} >= {"Net/fc1", "Net/fc2"}
    assert {n.scope for n in stats.all_nodes() if n.op == "aten::addmm" and n.phase == "forward"} == {
        "Net/fc1", "Net/fc2"}
    assert warnings(caplog) == []  # the same content, only slower: nothing to say


@pytest.mark.skipif(torch_private.export_only_config() is None,
                    reason="this torch has no _ExperimentalConfig(trace_only=): every step stops in full")
def test_without_the_export_only_option_an_ops_only_step_stops_in_full(monkeypatch, caplog):
    """A torch whose `_ExperimentalConfig` has no `trace_only` (or no such class): the same timeline, from the
    full stop, and nothing lost to warn about."""

    def ops_only_step():
        tracer = TorchTracer(Net())
        tracer.start(RunOptions(trace_level=TraceLevel.FULL_TRACE))
        tracer._root(torch.randn(16, 32)).sum().backward()
        recording = tracer.stop_recording()
        return recording._results, recording()

    results, stats = ops_only_step()
    assert len(results.experimental_event_tree()) == 0  # this torch has it: the cheap stop
    monkeypatch.setattr(torch._C._profiler, "_ExperimentalConfig", lambda **options: (_ for _ in ()).throw(
        TypeError(f"__init__() got an unexpected keyword argument {next(iter(options))!r}")))
    results, stats = ops_only_step()
    assert len(results.experimental_event_tree()) > 0
    assert {n.scope for n in stats.all_nodes() if n.op == "aten::addmm"} == {"Net/fc1", "Net/fc2"}
    monkeypatch.delattr(torch._C._profiler, "_ExperimentalConfig")
    results, stats = ops_only_step()
    assert len(results.experimental_event_tree()) > 0 and [n for n in stats.all_nodes() if n.op == "aten::addmm"]
    assert warnings(caplog) == []


def test_a_torch_whose_profiler_events_lack_what_the_tracer_reads_trains_untraced_with_one_warning(
        monkeypatch, caplog, tmp_path):
    """torch 2.3's profiler results have no `trace_start_ns` (the README lists what was run): the fit trains
    on, every step untraced, and one warning says why and which torch to install."""
    from hookprof.tracing.torch_private import unsupported_torch
    from lightning_prof import ProfilerHook
    from tests.lightning_models import TinyModel, loader, trainer

    monkeypatch.delattr(torch._C._autograd._ProfilerResult, "trace_start_ns")
    unsupported_torch.cache_clear()
    try:
        hook = ProfilerHook(save_steps=1, output_dir=str(tmp_path))
        trainer(str(tmp_path), [hook], 4, logger=False).fit(TinyModel(), loader())
    finally:
        unsupported_torch.cache_clear()
    assert hook.saved_paths == []
    (warning,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Step not traced")]
    assert "_ProfilerResult.trace_start_ns" in warning and "pip install 'torch>=2.11'" in warning


def test_the_torch_the_message_asks_for_is_the_floor_pip_installs():
    """The unsupported-torch message, the `torch` and `lightning` extras' floors: one version, the oldest run."""
    import tomllib
    from pathlib import Path

    extras = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    floors = {r for extra in ("torch", "lightning") for r in extras[extra] if r.startswith("torch")}
    assert floors == {f"torch>={torch_private.OLDEST_TORCH_RUN}"}, floors
