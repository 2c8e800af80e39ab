"""The step-stats model: what one traced step did, framework-neutral (TF's `StepStats` proto, in Python).

A `StepStats` holds one `DeviceStepStats` per device; each holds the op executions (`NodeExecStats`) that ran
there, on which thread, when, and on which tensors. Times are integer nanoseconds since the Unix epoch, the
clock torch.profiler and `time.time_ns()` share, so host spans and op events line up.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# Bytes per element for the dtype names this project writes (canonical numpy-style names).
DTYPE_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "complex128": 16, "complex64": 8, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
    "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1,
}


@dataclasses.dataclass(slots=True)
class TensorDescription:
    """A tensor an op read or wrote: dtype name, shape, and size in bytes (None when not a dense tensor)."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "bytes": self.nbytes}


@dataclasses.dataclass(slots=True)
class NodeExecStats:
    """One op execution: `op` is the type (`aten::addmm`), `node_name` is unique within the step.

    `scope` is the module path it ran in (`encoder/fc1`; backward ops inherit the scope of the forward op
    they differentiate); `phase` is `data`, `forward`, `backward`, `optimizer` or `step` where known.
    """

    node_name: str
    op: str
    start_ns: int
    duration_ns: int
    thread_id: int
    scope: str = ""
    phase: str = ""
    inputs: list[TensorDescription] = dataclasses.field(default_factory=list)
    outputs: list[TensorDescription] = dataclasses.field(default_factory=list)
    category: str = "Op"  # "Op" for framework ops, "Kernel" for device kernels, "Span" for host spans
    args: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def end_ns(self) -> int:
        return self.start_ns + self.duration_ns


@dataclasses.dataclass(slots=True)
class DeviceStepStats:
    """Everything that ran on one device (`/host:CPU`, `/device:CUDA:0`), with its threads' names."""

    device: str
    node_stats: list[NodeExecStats] = dataclasses.field(default_factory=list)
    thread_names: dict[int, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(slots=True)
class StepStats:
    """One traced step: the devices, the global step it belongs to, and where it came from."""

    dev_stats: list[DeviceStepStats] = dataclasses.field(default_factory=list)
    step: int | None = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    def device(self, name: str) -> DeviceStepStats:
        """The stats of device `name`, created empty on first use."""
        for dev in self.dev_stats:
            if dev.device == name:
                return dev
        dev = DeviceStepStats(name)
        self.dev_stats.append(dev)
        return dev

    def all_nodes(self):
        """Every op execution of the step, device by device."""
        for dev in self.dev_stats:
            yield from dev.node_stats

    def start_ns(self) -> int | None:
        """The earliest start of any recorded execution (None for an empty step)."""
        return min((n.start_ns for n in self.all_nodes()), default=None)
