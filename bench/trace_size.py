"""Timeline size and traced-step cost with and without dataflow and memory, at two step sizes.

A plain torch MLP step (forward, backward, SGD) is traced by TorchTracer and written by ChromeTraceWriter;
the same step under torch.profiler + export_chrome_trace (shapes on, memory as asked) is the peer, timed in
the same process. Median of 5 runs each.
"""

import os
import statistics
import tempfile
import time

import torch

from core import ChromeTraceWriter, RunOptions, TraceLevel
from core.tracing.torch_tracer import TorchTracer

REPEAT = 5


def make_step(layers: int):
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64)

    def step():
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    return model, step


def ours(model, step, path, dataflow, memory, compress=False):
    start = time.perf_counter()
    tracer = TorchTracer(model)
    tracer.start(RunOptions(trace_level=TraceLevel.FULL_TRACE, record_dataflow=dataflow, record_memory=memory))
    step()
    stats = tracer.stop()
    result = ChromeTraceWriter(show_dataflow=dataflow, show_memory=memory, compress=compress).write(stats, path)
    return time.perf_counter() - start, result.events


def torch_peer(step, path, memory):
    start = time.perf_counter()
    with torch.profiler.profile(record_shapes=True, profile_memory=memory) as prof:
        step()
    prof.export_chrome_trace(path)
    return time.perf_counter() - start


def main():
    out = tempfile.mkdtemp()
    print("| step | content | events | file | gzip | traced step, ours | torch.profiler + export | ratio |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for layers in (20, 200):
        model, step = make_step(layers)
        for label, dataflow, memory in (("ops", False, False), ("ops + dataflow", True, False),
                                        ("ops + memory", False, True), ("ops + dataflow + memory", True, True)):
            path, gz, peer = (os.path.join(out, n) for n in ("t.json", "t.json.gz", "p.json"))
            times, peers = [], []
            for _ in range(REPEAT):
                elapsed, events = ours(model, step, path, dataflow, memory)
                times.append(elapsed)
                peers.append(torch_peer(step, peer, memory))
            ours(model, step, gz, dataflow, memory, compress=True)
            t, p = statistics.median(times), statistics.median(peers)
            print(f"| {layers} layers | {label} | {events} | {os.path.getsize(path) / 1e6:.2f} MB | "
                  f"{os.path.getsize(gz) / 1e6:.2f} MB | {t * 1e3:.1f} ms | {p * 1e3:.1f} ms | {t / p:.2f}x |")


if __name__ == "__main__":
    main()
