"""Where a traced step's tensor identities (what dataflow arrows and memory objects need) can come from, and
what each source costs, on one training step of an MLP of 200 `Linear(64, 64)` + `Tanh` pairs (forward,
backward, SGD; torch on one thread), medians of 7 rounds, the kinds alternating in each round
(issue 33):

- the peer: `torch.profiler.profile(record_shapes=True)` (+ `profile_memory=True`) around the step and
  `export_chrome_trace` after it;
- ours, walking the step's own event tree (`TorchTracer`, a fit's first step that records tensors): the
  profiler's stop, kineto's export and the walk, all in the training process; then the conversion
  (`KinetoExport.to_stats`, in the render worker in a fit);
- ours, borrowing the identities of an earlier step with the same ops (`hookprof.tracing.step_identity`):
  the export-only stop, with memory; then the conversion, which joins the template to the step;
- torch's `ExecutionTraceObserver` (the other C++ source of tensor identities) alone on an untraced step (to
  lend its identities to a neighbouring traced step), and attached to a traced step, with the op durations
  it leaves in kineto's trace (the observer runs inside the ops it records).

Each "step" figure is the whole step (the step's own ~35 ms included) up to the training's next step, wall
and the process's CPU time (`time.process_time`, which the machine's other load moves less). The conversion
runs in another process in a fit: its figure is CPU time that a 2-core machine pays beside the training.
"""

import os
import statistics
import tempfile
import time

import orjson
import torch

from hookprof.run_options import RunOptions, TraceLevel
from hookprof.tracing.torch_tracer import TorchTracer

LAYERS, ROUNDS = 400, 7
DATAFLOW = RunOptions(trace_level=TraceLevel.FULL_TRACE, record_dataflow=True, record_memory=False)
OPS = ("aten::addmm", "aten::mul", "aten::tanh")


def main():
    torch.set_num_threads(1)
    net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh())
                                for _ in range(LAYERS // 2)])
    optimizer = torch.optim.SGD(net.parameters(), lr=0.001)
    x = torch.randn(32, 64)
    out = tempfile.mkdtemp()

    def step():
        (net(x) * 0.5).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(3):
        step()
    fit_state: dict = {}
    times: dict[str, list[tuple[float, float]]] = {}
    converts: dict[str, list[float]] = {}
    durations: dict[str, dict[str, list[float]]] = {}

    def timed(kind, body):
        wall, cpu = time.perf_counter(), time.process_time()
        result = body()
        times.setdefault(kind, []).append((time.perf_counter() - wall, time.process_time() - cpu))
        return result

    def plain():
        step()

    def peer(memory):
        def body():
            with torch.profiler.profile(record_shapes=True, profile_memory=memory) as prof:
                step()
            prof.export_chrome_trace(os.path.join(out, "peer.json"))
        return body

    def ours(state):
        def body():
            tracer = TorchTracer(net)
            tracer.bind_fit(state)
            tracer.start(DATAFLOW)
            step()
            return tracer.stop_recording().export()
        return body

    def execution_trace(traced):
        def body():
            from torch._C import _profiler

            path = os.path.join(out, "et.json")
            _profiler._add_execution_trace_observer(path)
            _profiler._enable_execution_trace_observer()
            if traced:
                with torch.profiler.profile(record_shapes=True) as prof:
                    step()
                prof.export_chrome_trace(os.path.join(out, "et-kineto.json"))
            else:
                step()
            _profiler._disable_execution_trace_observer()
            _profiler._remove_execution_trace_observer()
        return body

    def convert(kind, exported):
        cpu = time.process_time()
        stats = exported.to_stats()
        converts.setdefault(kind, []).append(time.process_time() - cpu)
        assert stats.edges, kind

    def op_durations(kind, path):
        with open(path, "rb") as f:
            for event in orjson.loads(f.read())["traceEvents"]:
                if event.get("name") in OPS and event.get("ph") == "X":
                    durations.setdefault(kind, {}).setdefault(event["name"], []).append(event["dur"])

    # the fit's first traced step: walks its tree and, converted, leaves its identities
    convert("warm-up", timed("warm-up", ours(fit_state)))
    walking: dict = {}  # a fit whose steps all walk their tree (told after each that none was recorded)
    for _ in range(ROUNDS):
        timed("a step, untraced", plain)
        timed("peer: record_shapes + export", peer(False))
        op_durations("peer (record_shapes)", os.path.join(out, "peer.json"))
        timed("peer: record_shapes + profile_memory + export", peer(True))
        convert("ours: own tree walk", timed("ours: own tree walk", ours(walking)))
        walking["torch_identities"].recorded = False
        exported = timed("ours: borrowed identities", ours(fit_state))
        assert exported.identity[0] == "borrow"
        convert("ours: borrowed identities", exported)
        timed("execution trace alone, untraced step", execution_trace(False))
        timed("execution trace + record_shapes + export", execution_trace(True))
        op_durations("execution trace attached", os.path.join(out, "et-kineto.json"))
    print(f"load average: {os.getloadavg()}")
    print("| a step with | wall | CPU | conversion's CPU (render worker) |")
    print("| --- | ---: | ---: | ---: |")
    for kind, values in times.items():
        if kind == "warm-up":  # (its conversion too)
            continue
        wall, cpu = (statistics.median(v[i] for v in values) for i in (0, 1))
        converted = f"{statistics.median(converts[kind]) * 1e3:.0f} ms" if kind in converts else "-"
        print(f"| {kind} | {wall * 1e3:.0f} ms | {cpu * 1e3:.0f} ms | {converted} |")
    print()
    print("| op (median duration) | " + " | ".join(durations) + " |")
    print("| --- |" + " ---: |" * len(durations))
    for op in OPS:
        print(f"| `{op}` | " + " | ".join(f"{statistics.median(d[op]):.1f} us" for d in durations.values()) + " |")


if __name__ == "__main__":
    main()
