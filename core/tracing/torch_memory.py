"""Allocations of one traced step from torch's profiler (`profile_memory=True`), as the model's records.

The profiler's event tree holds each allocation and free with its pointer, size, the allocator's running
totals, an `allocation_id` shared by the allocation and its free, and its parent op (whose `correlation_id`
is the op event's record-function id). What an allocation held is the first read of a tensor with that
`allocation_id` through a view covering all of it (`EventTree.held`): identity first, then size.
"""

from __future__ import annotations

from collections.abc import Callable

from hookprof.step_stats import AllocatorSample, NodeExecStats, StepStats, TensorAllocation, TensorDescription
from hookprof.tracing.torch_dataflow import Allocation, EventTree


def add_allocations(tree: EventTree, stats: StepStats, nodes_by_id: dict[int, NodeExecStats]) -> None:
    """Fill `stats.allocations` and `stats.memory_samples` from the profiler's event tree of the step."""
    held, blocks = tree.held, tree.blocks

    def made(event: Allocation) -> tuple[NodeExecStats | None, TensorDescription | None, int | None]:
        block = blocks[event.allocation_id]
        return (None if block.op is None else nodes_by_id.get(block.op)), held.get(event.allocation_id), block.free_ns

    add_memory(stats, tree.allocations, made)


def add_memory(stats: StepStats, events: list[Allocation],
               made: Callable[[Allocation], tuple[NodeExecStats | None, TensorDescription | None, int | None]]
               ) -> None:
    """Add the step's allocation and free `events` (in time order) to `stats`: the allocator's samples, and a
    record of each allocation, with what `made(event)` says of it: the node that made it, the tensor it held
    and when it was freed (each None where unknown)."""
    for event in events:
        stats.memory_samples.append(AllocatorSample(event.device, event.start_ns, event.total_allocated,
                                                    event.total_reserved))
        if event.nbytes > 0:
            producer, tensor, free_ns = made(event)
            stats.allocations.append(TensorAllocation(event.allocation_id, event.device, event.nbytes, event.start_ns,
                                                      free_ns, producer, tensor))
