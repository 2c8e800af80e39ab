"""TorchTracer on plain torch: nested module scopes, backward scopes, tensor sizes, clean start/stop."""

import subprocess
import sys
import textwrap
from collections import Counter

import pytest
import torch

from hookprof import RunOptions, TraceLevel
from hookprof.tracing.torch_private import export_only_config
from hookprof.tracing.torch_tracer import TorchTracer
from tests.conftest import skip_where_cuda_started

FULL = RunOptions(trace_level=TraceLevel.FULL_TRACE)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(256, 256)

    def forward(self, x):
        return torch.relu(self.proj(x))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Sequential(Block(), Block())
        self.head = torch.nn.Linear(256, 1)

    def forward(self, x):
        return self.head(self.encoder(x))


def traced_step(model, tracer):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracer.start(FULL)
    loss = model(torch.randn(64, 256)).sum()
    loss.backward()
    opt.step()
    return tracer.stop()


def test_nested_scopes_backward_scopes_and_tensor_sizes():
    model = Net()
    stats = traced_step(model, TorchTracer(model))
    nodes = list(stats.all_nodes())
    addmm = [n for n in nodes if n.op == "aten::addmm" and n.phase == "forward"]
    assert sorted(n.scope for n in addmm) == ["Net/encoder/0/proj", "Net/encoder/1/proj", "Net/head"]
    relu = [n for n in nodes if n.op == "aten::relu"]
    assert sorted(n.scope for n in relu) == ["Net/encoder/0", "Net/encoder/1"]
    # the 64x256 float32 activation fed to the second block's projection: 65536 bytes
    second = next(n for n in addmm if n.scope == "Net/encoder/1/proj")
    assert [(t.dtype, t.shape, t.nbytes) for t in second.inputs[:2]] == [
        ("float32", (256,), 1024), ("float32", (64, 256), 65536)]
    grads = [n for n in nodes if n.op == "autograd::engine::evaluate_function: AddmmBackward0"]
    assert sorted(n.scope for n in grads) == ["Net/encoder/0/proj", "Net/encoder/1/proj", "Net/head"]
    assert all(n.phase == "backward" for n in grads)
    assert {n.scope for n in nodes if n.phase == "optimizer" and n.category == "Op"} == {"optimizer/SGD"}
    assert len({n.node_name for n in nodes}) == len(nodes)  # node names are unique in the step
    modules = [n for n in nodes if n.category == "Module"]
    assert {n.scope for n in modules} >= {"Net", "Net/encoder", "Net/encoder/0", "Net/head"}


def test_scope_hooks_exist_only_during_the_traced_step():
    from torch.nn.modules import module as nn_module

    before = (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks))
    model = Net()
    tracer = TorchTracer(model)
    tracer.start(FULL)
    assert len(nn_module._global_forward_pre_hooks) == before[0] + 1
    model(torch.randn(2, 256))
    tracer.stop()
    assert (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)) == before
    assert not torch._C._autograd._profiler_enabled()


def test_abort_after_a_forward_that_raised_closes_everything():
    class Raises(torch.nn.Module):
        def forward(self, x):
            raise ValueError("bad forward")

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Raises())
    tracer = TorchTracer(model)
    tracer.start(FULL)
    try:
        model(torch.randn(2, 4))
    except ValueError:
        tracer.abort()
    assert not torch._C._autograd._profiler_enabled()
    again = TorchTracer(model[0])
    again.start(FULL)
    model[0](torch.randn(2, 4))
    assert any(n.op == "aten::addmm" for n in again.stop().all_nodes())


def step_content(model, tracer, options):
    """(the stopped recording's kineto results, the step's ops as a multiset of their content)."""
    torch.manual_seed(0)
    model.zero_grad(set_to_none=True)  # (each step makes its gradients: the same ops each time)
    tracer.start(options)
    model(torch.randn(8, 256)).sum().backward()
    recording = tracer.stop_recording()
    results = recording._results
    stats = recording()
    ops = Counter((n.op, n.scope, n.phase, n.category, repr(n.input_shapes), repr(n.input_dtypes),
                   repr(sorted((n.args or {}).items()))) for n in stats.all_nodes())
    return results, ops


@pytest.mark.skipif(export_only_config() is None, reason="this torch has no _ExperimentalConfig(trace_only=)")
def test_a_step_that_needs_only_the_export_stops_without_python_events_and_keeps_its_content(monkeypatch):
    """Ops-only steps ask torch to build nothing for Python at the stop (`trace_only`): kineto's export, all
    the timeline reads, has the same events, shapes, scopes and FLOPs as after a full stop."""
    from hookprof.tracing import torch_tracer

    model = Net()
    results, cheap = step_content(model, TorchTracer(model), FULL)
    assert len(results.experimental_event_tree()) == 0  # nothing was built for Python
    monkeypatch.setattr(torch_tracer, "export_only_config", lambda: None)
    results, full = step_content(model, TorchTracer(model), FULL)
    assert len(results.experimental_event_tree()) > 0
    assert cheap == full and any(op[0] == "aten::addmm" and "flops" in op[6] for op in full)


@pytest.mark.skipif(export_only_config() is None, reason="this torch has no _ExperimentalConfig(trace_only=)")
def test_a_cpu_model_on_a_host_with_a_gpu_traces_as_on_a_cpu_host(monkeypatch):
    """CUDA activity is recorded where the process has started CUDA, not wherever a GPU is there: seen on the
    lent H100, a CPU model's steps carried the CUDA runtime's calls (each with a per-step correlation id) and
    took the CUDA paths (a full stop, every step walking its tree). Here a GPU is said to be there, and the
    process never started CUDA: the step stops cheaply, as on a CPU host."""
    skip_where_cuda_started()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = Net()
    results, _ = step_content(model, TorchTracer(model), FULL)
    assert len(results.experimental_event_tree()) == 0


def test_dataflow_memory_and_stacks_keep_the_full_stop():
    """Dataflow and memory read the event tree, and torch refuses the cheap stop with Python stacks."""
    model = Net()
    for options in (RunOptions(trace_level=TraceLevel.FULL_TRACE, record_dataflow=True),
                    RunOptions(trace_level=TraceLevel.FULL_TRACE, record_memory=True),
                    RunOptions(trace_level=TraceLevel.FULL_TRACE, with_stack=True)):
        results, _ = step_content(model, TorchTracer(model), options)
        assert len(results.experimental_event_tree()) > 0, options


def test_profiler_prints_no_per_start_log_lines():
    script = textwrap.dedent("""
        import torch
        from hookprof import RunOptions, TraceLevel
        from hookprof.tracing.torch_tracer import TorchTracer
        m = torch.nn.Linear(4, 4)
        for _ in range(3):
            t = TorchTracer(m)
            t.start(RunOptions(trace_level=TraceLevel.FULL_TRACE))
            m(torch.randn(2, 4)).sum().backward()
            assert any(n.op == "aten::addmm" for n in t.stop().all_nodes())
        print("traced")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "traced"
    assert "profiler_start" not in done.stderr and "USDT" not in done.stderr, done.stderr


def test_a_hand_written_loop_with_manual_session(tmp_path):
    """The ManualSession example: hooks around a plain PyTorch loop, no framework."""
    import os

    from hookprof import HookedSession, ManualSession, ProfilerHook, SessionRunArgs, StepState

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = ManualSession(model)
    driver = HookedSession([ProfilerHook(save_steps=2, output_dir=str(tmp_path), tensorboard=False)],
                           tracer_factory=lambda: TorchTracer(model))
    driver.begin()
    driver.after_create_session(session)
    for _ in range(5):
        driver.before_run(session, session.global_step, SessionRunArgs())
        loss = model(torch.randn(4, 256)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        session.global_step += 1
        driver.after_run(lambda: StepState(session.global_step, {"loss": loss}))
    driver.end(session)
    assert sorted(os.listdir(tmp_path)) == ["timeline-2.json", "timeline-4.json"]  # as in a Lightning fit
