"""`HostTracer`: wall-clock spans of the step's phases only; works with any framework and backend."""

from __future__ import annotations

from hookprof.run_options import RunOptions
from hookprof.step_stats import StepStats
from hookprof.tracing.tracer import Tracer


class HostTracer(Tracer):
    """Records no ops: the step shows as its phases (data wait, forward, backward, optimizer) on the host.

    The phases come from the framework's callback events, which the coordinator records for every tracer;
    this tracer is the fallback where torch is not the engine (Keras on JAX or TensorFlow).
    """

    name = "host"

    def start(self, options: RunOptions) -> None:
        pass

    def stop(self) -> StepStats:
        return StepStats()

    def abort(self) -> None:
        pass
