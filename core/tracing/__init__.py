"""Tracers fill a traced step's `RunMetadata`; a fit's `StepTraceCoordinator` runs at most one per step.

`TorchTracer` lives in `hookprof.tracing.torch_tracer` and `JaxTracer` in `hookprof.tracing.jax_tracer`; each is
imported only where its framework is the engine.
"""

from hookprof.tracing.coordinator import StepTraceCoordinator, fit_traces
from hookprof.tracing.host import HostTracer
from hookprof.tracing.tracer import HOST_DEVICE, Tracer, TracerFactory, TracerUnavailable

__all__ = ["HOST_DEVICE", "HostTracer", "StepTraceCoordinator", "Tracer", "TracerFactory", "TracerUnavailable",
           "fit_traces"]
