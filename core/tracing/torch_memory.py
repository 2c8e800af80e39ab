"""Allocations of one traced step from torch's profiler (`profile_memory=True`), as the model's records.

The profiler's event tree holds each allocation and free with its pointer, size, the allocator's running
totals, an `allocation_id` shared by the allocation and its free, and its parent op (whose `correlation_id`
is the op event's record-function id). The tensor an allocation held is named by the first op that read a
tensor with that `allocation_id` through a view covering the whole allocation (an expanded or sliced view
has other sizes): identity first, then a consistency check of the size.
"""

from __future__ import annotations

from math import prod
from typing import Any

from core.step_stats import DTYPE_ITEMSIZE, AllocatorSample, NodeExecStats, StepStats, TensorAllocation, TensorDescription

# ops that only hand out memory for the op around them: the allocation is credited to that op
_ALLOCATING_PLUMBING = ("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::resize_")


def device_name(device: Any) -> str:
    """torch's `cpu` / `cuda:0` as this project's device names `/host:CPU` / `/device:CUDA:0`."""
    text = str(device)
    if text.startswith("cpu"):
        return "/host:CPU"
    kind, _, index = text.partition(":")
    return f"/device:{kind.upper()}:{index or 0}"


def add_allocations(results: Any, stats: StepStats, nodes_by_id: dict[int, NodeExecStats]) -> None:
    """Fill `stats.allocations` and `stats.memory_samples` from the profiler results of the step."""
    from torch._C._profiler import _EventType

    allocation, torch_op = _EventType.Allocation, _EventType.TorchOp
    reads: dict[int, list[tuple[int, str, tuple]]] = {}  # allocation id -> (start, dtype, sizes) of reads
    open_allocations: dict[int, TensorAllocation] = {}
    stack = list(results.experimental_event_tree())
    events = []
    while stack:
        event = stack.pop()
        kind, fields = event.typed
        if kind == allocation:
            events.append(event)
        elif kind == torch_op:
            for tensor in fields.inputs:
                allocation_id = getattr(tensor, "allocation_id", None)
                if allocation_id is not None and hasattr(tensor, "sizes"):
                    dtype = str(tensor.dtype).removeprefix("torch.")
                    reads.setdefault(allocation_id, []).append((event.start_time_ns, dtype, tuple(tensor.sizes)))
        stack.extend(event.children)
    events.sort(key=lambda e: e.start_time_ns)
    for event in events:
        fields = event.typed[1]
        device = device_name(fields.device)
        stats.memory_samples.append(
            AllocatorSample(device, event.start_time_ns, fields.total_allocated, fields.total_reserved))
        if fields.alloc_size > 0:
            record = TensorAllocation(fields.allocation_id, device, fields.alloc_size, event.start_time_ns,
                                      producer=_producer(event, nodes_by_id))
            record.tensor = _whole_view(reads.get(fields.allocation_id, []), fields.alloc_size)
            stats.allocations.append(record)
            open_allocations[fields.allocation_id] = record
        else:
            record = open_allocations.pop(fields.allocation_id, None)
            if record is not None:
                record.free_ns = event.start_time_ns


def _whole_view(reads: list[tuple[int, str, tuple]], nbytes: int) -> TensorDescription | None:
    """The earliest recorded read of the allocation whose view spans all of its bytes."""
    for _, dtype, shape in sorted(reads):
        itemsize = DTYPE_ITEMSIZE.get(dtype)
        if itemsize is not None and itemsize * prod(shape) == nbytes:
            return TensorDescription(dtype, shape, nbytes)
    return None


def _producer(event: Any, nodes_by_id: dict[int, NodeExecStats]) -> NodeExecStats | None:
    parent = event.parent
    while parent is not None and parent.name.startswith(_ALLOCATING_PLUMBING) and parent.parent is not None:
        parent = parent.parent
    return None if parent is None else nodes_by_id.get(parent.correlation_id)
