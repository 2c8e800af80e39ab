"""Tensor dataflow of a traced step from torch's own profiler records, with no second observer.

With `record_shapes` and `profile_memory` on, the profiler keeps, for every op, its tensor arguments with the
`allocation_id` of the memory they live in (views and `.grad` aliases share it: one datum), and, for every
allocation, the op it happened in. So, for `core.dataflow.find_edges`:
- an op's inputs are the allocations its tensor arguments live in;
- its outputs are the allocations made inside it that outlive it, credited to the innermost op that made
  them, skipping allocation plumbing (`empty`, `empty_strided`, ...: the op around them made the tensor);
- an in-place op (`add_`, `zero_`, `_foreach_add_`: a trailing underscore, torch's naming rule) also
  writes its first argument: a new version of that datum, of which it becomes the producer.

torch's execution-trace observer, which this replaces, recorded outputs directly but wrote every op's
arguments as JSON while the step ran: it made each op of the traced step 5-7x slower on the timeline.
"""

from __future__ import annotations

from math import prod
from typing import Any

from core.dataflow import OpData
from core.step_stats import DTYPE_ITEMSIZE, NodeExecStats, TensorDescription


class EventTree:
    """One pass over the profiler's event tree: its ops in start order, each with the tensors it read as
    (allocation id, description), and its allocation and free events in time order."""

    def __init__(self, results: Any) -> None:
        from torch._C._profiler import _EventType

        allocation, torch_op = _EventType.Allocation, _EventType.TorchOp
        self.ops: list[tuple[Any, list[tuple[int, TensorDescription]]]] = []
        self.allocations: list[Any] = []
        stack = list(results.experimental_event_tree())
        while stack:
            event = stack.pop()
            kind, fields = event.typed
            if kind == allocation:
                self.allocations.append(event)
            elif kind == torch_op:
                self.ops.append((event, _reads(fields)))
            stack.extend(event.children)
        self.allocations.sort(key=lambda e: e.start_time_ns)
        self.ops.sort(key=lambda op: op[0].start_time_ns)

    def whole_views(self, sizes: dict[int, int]) -> dict[int, TensorDescription]:
        """For each allocation in `sizes` (id -> bytes), its earliest read through a view covering all of its
        bytes (an expanded or sliced view has other sizes): what the allocation held."""
        found: dict[int, TensorDescription] = {}
        for _, reads in self.ops:
            for allocation_id, tensor in reads:
                if allocation_id not in found and tensor.nbytes is not None and sizes.get(allocation_id) == tensor.nbytes:
                    found[allocation_id] = tensor
        return found


def _reads(fields: Any) -> list[tuple[int, TensorDescription]]:
    """The op's tensor arguments that live in recorded memory, tensor lists flattened, in argument order."""
    found = []
    for value in fields.inputs:
        for tensor in value if isinstance(value, list) else (value,):
            allocation_id = getattr(tensor, "allocation_id", None)
            if allocation_id is not None and hasattr(tensor, "sizes"):
                dtype = str(tensor.dtype).removeprefix("torch.")
                shape = tuple(tensor.sizes)
                itemsize = DTYPE_ITEMSIZE.get(dtype)
                found.append((allocation_id, TensorDescription(
                    dtype, shape, itemsize * prod(shape) if itemsize is not None else None)))
    return found


# ops that only hand out memory for the op around them: the allocation is credited to that op
ALLOCATING_PLUMBING = ("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::resize_")


def allocating_op(event: Any) -> Any:
    """The op an allocation event belongs to: its parent, or the op around allocation plumbing."""
    parent = event.parent
    while parent is not None and parent.name.startswith(ALLOCATING_PLUMBING) and parent.parent is not None:
        parent = parent.parent
    return parent


def step_dataflow(tree: EventTree, nodes_by_id: dict[int, NodeExecStats]) -> list[OpData]:
    """Each recorded op's data read and written, as `OpData` keyed by allocation id, for `find_edges`.
    Also sets each producing node's `outputs` (the tensors it made, as their first whole read saw them)."""
    # allocation id -> (node that made it, bytes); only allocations that outlive the op that made them
    made: dict[int, tuple[NodeExecStats, int]] = {}
    for event in tree.allocations:
        fields = event.typed[1]
        if fields.alloc_size > 0:
            op = allocating_op(event)
            node = None if op is None else nodes_by_id.get(op.correlation_id)
            if node is not None:
                made[fields.allocation_id] = (node, fields.alloc_size)
        else:
            entry = made.get(fields.allocation_id)
            if entry is not None and event.start_time_ns <= entry[0].start_ns + entry[0].duration_ns:
                del made[fields.allocation_id]  # a temporary, freed before its op ended
    whole = tree.whole_views({allocation_id: nbytes for allocation_id, (_, nbytes) in made.items()})
    outputs: dict[int, list[tuple[int, TensorDescription]]] = {}  # id(node) -> what it made, in order
    for allocation_id, (node, _) in made.items():
        outputs.setdefault(id(node), []).append((allocation_id, whole.get(allocation_id, _UNKNOWN)))
    ops: list[OpData] = []
    for event, reads in tree.ops:
        node = nodes_by_id.get(event.correlation_id)
        if node is None:
            continue
        op = OpData(node, reads, [])
        name = node.op.rsplit("::", 1)[-1]
        if name.endswith("_") and not name.endswith("__") and reads:  # in place: writes its first argument
            op.outputs.append(reads[0])
            op.mutations = frozenset({0})
        fresh = outputs.get(id(node))
        if fresh:
            op.outputs.extend(fresh)
            node.outputs = [tensor for _, tensor in fresh if tensor is not _UNKNOWN]
        ops.append(op)
    return ops


_UNKNOWN = TensorDescription("unknown", (), None)
