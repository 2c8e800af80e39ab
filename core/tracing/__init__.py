"""Tracers fill a step's `RunMetadata`; `STEP_TRACES` makes sure only one runs per step.

`TorchTracer` lives in `core.tracing.torch_tracer` and is imported only where torch is the engine.
"""

from core.tracing.base import (
    HOST_DEVICE,
    STEP_TRACES,
    StepTraceCoordinator,
    Tracer,
    TracerFactory,
    TracerUnavailable,
)
from core.tracing.host import HostTracer

__all__ = ["HOST_DEVICE", "STEP_TRACES", "HostTracer", "StepTraceCoordinator", "Tracer", "TracerFactory", "TracerUnavailable"]
