"""Allocations of one traced step from torch's profiler (`profile_memory=True`), as the model's records.

The profiler's event tree holds each allocation and free with its pointer, size, the allocator's running
totals, an `allocation_id` shared by the allocation and its free, and its parent op (whose `correlation_id`
is the op event's record-function id). What an allocation held is the first read of a tensor with that
`allocation_id` through a view covering all of it (`EventTree.held`): identity first, then size.
"""

from __future__ import annotations

from hookprof.step_stats import AllocatorSample, NodeExecStats, StepStats, TensorAllocation
from hookprof.tracing.torch_dataflow import EventTree


def add_allocations(tree: EventTree, stats: StepStats, nodes_by_id: dict[int, NodeExecStats]) -> None:
    """Fill `stats.allocations` and `stats.memory_samples` from the profiler's event tree of the step."""
    held = tree.held
    for event in tree.allocations:
        stats.memory_samples.append(AllocatorSample(event.device, event.start_ns, event.total_allocated,
                                                    event.total_reserved))
        if event.nbytes > 0:
            block = tree.blocks[event.allocation_id]
            record = TensorAllocation(event.allocation_id, event.device, block.nbytes, event.start_ns,
                                      producer=None if block.op is None else nodes_by_id.get(block.op))
            record.tensor = held.get(event.allocation_id)
            record.free_ns = block.free_ns
            stats.allocations.append(record)
