"""Tensor dataflow of a traced step from torch's own profiler records, with no second observer.

With `record_shapes` and `profile_memory` on, the profiler keeps, for every op, its tensor arguments with the
`allocation_id` of the memory they live in (views and `.grad` aliases share it: one datum), and, for every
allocation, the op it happened in. So, for `core.dataflow.find_edges`:
- an op's inputs are the allocations its tensor arguments live in;
- its outputs are the allocations made inside it that outlive it, credited to the innermost op that made
  them, skipping allocation plumbing (`empty`, `empty_strided`, ...: the op around them made the tensor);
- an op also writes the arguments its schema marks as written (`Tensor(a!)`: `add_`'s self, every tensor of
  `_foreach_add_`'s list, an `out=` tensor): a new version of that datum, of which it becomes the producer.
  Ops with no registered schema (autograd nodes, user spans) write nothing, unless their name ends in
  `_`; ops that change only a tensor's metadata in place (`unsqueeze_`, `t_`) write nothing.

The granularity is the allocation: the profiler records no storage offset, so a write into one slice of a
tensor (`q` of `p, q = h.chunk(2)`) counts as a new version of all of it. View ops make no new data and
have no outputs of their own here.

torch's execution-trace observer, which this replaces, recorded outputs directly but wrote every op's
arguments as JSON while the step ran: it made each op of the traced step 5-7x slower on the timeline.
"""

from __future__ import annotations

import functools
from math import prod
from typing import Any

from core.dataflow import OpData
from core.step_stats import DTYPE_ITEMSIZE, NodeExecStats, TensorDescription

Read = tuple[int, int, TensorDescription]  # (argument position, allocation id, the tensor as read)


class EventTree:
    """One pass over the profiler's event tree: its ops in start order, each with its argument count and
    the tensors it read, and its allocation and free events in time order."""

    def __init__(self, results: Any) -> None:
        from torch._C._profiler import _EventType

        allocation, torch_op = _EventType.Allocation, _EventType.TorchOp
        self.ops: list[tuple[Any, int, list[Read]]] = []
        self.allocations: list[Any] = []
        stack = list(results.experimental_event_tree())
        while stack:
            event = stack.pop()
            kind, fields = event.typed
            if kind == allocation:
                self.allocations.append(event)
            elif kind == torch_op:
                self.ops.append((event, len(fields.inputs), _reads(fields)))
            stack.extend(event.children)
        self.allocations.sort(key=lambda e: e.start_time_ns)
        self.ops.sort(key=lambda op: op[0].start_time_ns)

    @functools.cached_property
    def held(self) -> dict[int, TensorDescription]:
        """What each allocation held: its earliest read through a view covering all of its bytes, else (the
        CUDA caching allocator rounds block sizes up) its earliest read that fits in it."""
        sizes = {e.typed[1].allocation_id: e.typed[1].alloc_size for e in self.allocations if e.typed[1].alloc_size > 0}
        exact: dict[int, TensorDescription] = {}
        fits: dict[int, TensorDescription] = {}
        for _, _, reads in self.ops:
            for _, allocation_id, tensor in reads:
                size, nbytes = sizes.get(allocation_id), tensor.nbytes
                if size is None or nbytes is None or allocation_id in exact:
                    continue
                if nbytes == size:
                    exact[allocation_id] = tensor
                elif nbytes < size:
                    fits.setdefault(allocation_id, tensor)
        return {**fits, **exact}


def _reads(fields: Any) -> list[Read]:
    """The op's tensor arguments that live in recorded memory, tensor lists flattened, in argument order."""
    found = []
    for position, value in enumerate(fields.inputs):
        for tensor in value if isinstance(value, list) else (value,):
            allocation_id = getattr(tensor, "allocation_id", None)
            if allocation_id is not None and hasattr(tensor, "sizes"):
                dtype = str(tensor.dtype).removeprefix("torch.")
                shape = tuple(tensor.sizes)
                itemsize = DTYPE_ITEMSIZE.get(dtype)
                found.append((position, allocation_id, TensorDescription(
                    dtype, shape, itemsize * prod(shape) if itemsize is not None else None)))
    return found


# ops that only hand out memory for the op around them: the allocation is credited to that op
ALLOCATING_PLUMBING = ("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::resize_")
# in-place ops that change a tensor's metadata (shape, strides), not its data
_METADATA_ONLY = frozenset({"unsqueeze_", "squeeze_", "t_", "transpose_", "swapdims_", "swapaxes_", "detach_",
                            "as_strided_", "set_"})


def allocating_op(event: Any) -> Any:
    """The op an allocation event belongs to: its parent op, or the op around allocation plumbing (never a
    Python-frame event above it: those record no op)."""
    from torch._C._profiler import _EventType

    parent = event.parent
    while (parent is not None and parent.name.startswith(ALLOCATING_PLUMBING) and parent.parent is not None
           and parent.parent.typed[0] == _EventType.TorchOp):
        parent = parent.parent
    return parent


@functools.lru_cache(maxsize=4096)
def written_arguments(name: str, arity: int) -> frozenset[int]:
    """The argument positions an op writes, from torch's registered schemas of that name with that many
    arguments (any overload that writes a position counts: the profiler records no overload name)."""
    short = name.rsplit("::", 1)[-1]
    if short in _METADATA_ONLY:
        return frozenset()
    written: set[int] = set()
    matched = False
    if "::" in name:
        import torch

        try:
            schemas = torch._C._jit_get_schemas_for_operator(name)
        except RuntimeError:
            schemas = []
        for schema in schemas:
            if len(schema.arguments) != arity:
                continue
            matched = True
            written.update(i for i, arg in enumerate(schema.arguments)
                           if arg.alias_info is not None and arg.alias_info.is_write)
    if not matched and short.endswith("_") and not short.endswith("__"):
        written.add(0)  # no schema to read: torch's naming rule for in-place ops
    return frozenset(written)


def step_dataflow(tree: EventTree, nodes_by_id: dict[int, NodeExecStats]) -> list[OpData]:
    """Each recorded op's data read and written, as `OpData` keyed by allocation id, for `find_edges`.

    Also sets each op node's `outputs`: the tensors it wrote (in place, then the data it made, in the order
    of its dataflow slots), and, for an op around the one that made the data (`linear` around `addmm`),
    that data too when it outlives the enclosing op."""
    held = tree.held
    freed: dict[int, int] = {}
    for event in tree.allocations:
        fields = event.typed[1]
        if fields.alloc_size < 0:
            freed[fields.allocation_id] = event.start_time_ns
    made: dict[int, list[tuple[int, TensorDescription]]] = {}  # id(node) -> the data it made, in order
    around: dict[int, list[TensorDescription]] = {}  # id(node) -> data an op inside it made
    for event in tree.allocations:
        fields = event.typed[1]
        tensor = held.get(fields.allocation_id)
        if fields.alloc_size <= 0 or tensor is None:  # a free, or data no op read: no edge can start there
            continue
        op = allocating_op(event)
        node = None if op is None else nodes_by_id.get(op.correlation_id)
        free = freed.get(fields.allocation_id)
        if node is None or (free is not None and free <= node.start_ns + node.duration_ns):
            continue  # a temporary, freed before its op ended
        made.setdefault(id(node), []).append((fields.allocation_id, tensor))
        outer = op.parent
        while outer is not None:
            outer_node = nodes_by_id.get(outer.correlation_id)
            if outer_node is not None:
                if free is not None and free <= outer_node.start_ns + outer_node.duration_ns:
                    break
                around.setdefault(id(outer_node), []).append(tensor)
            outer = outer.parent
    ops: list[OpData] = []
    for event, arity, reads in tree.ops:
        node = nodes_by_id.get(event.correlation_id)
        if node is None:
            continue
        op = OpData(node, [(allocation_id, tensor) for _, allocation_id, tensor in reads], [])
        written = written_arguments(node.op, arity) if reads else frozenset()
        if written:
            op.outputs = [(allocation_id, tensor) for position, allocation_id, tensor in reads if position in written]
            op.mutations = frozenset(range(len(op.outputs)))
        op.outputs.extend(made.get(id(node), ()))
        if op.outputs or id(node) in around:
            node.outputs = [tensor for _, tensor in op.outputs] + around.get(id(node), [])
        ops.append(op)
    return ops
