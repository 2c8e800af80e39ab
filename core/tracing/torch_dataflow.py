"""Tensor dataflow of a traced step from torch's own profiler records, with no second observer.

With `record_shapes` and `profile_memory` on, the profiler keeps, for every op, its tensor arguments with the
`allocation_id` of the memory they live in (views and `.grad` aliases share it: one datum), and, for every
allocation, the op it happened in. So, for `hookprof.tracing.dataflow.find_edges`:
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

import dataclasses
import functools
import operator
from collections.abc import Iterable
from math import prod
from typing import Any, NamedTuple

from hookprof.step_stats import DTYPE_ITEMSIZE, NodeExecStats, TensorDescription
from hookprof.tracing.dataflow import OpData
from hookprof.tracing.torch_private import private, warn_missing

Read = tuple[int, int, TensorDescription]  # (argument position, allocation id, the tensor as read)
_NOTHING: frozenset[int] = frozenset()
_NO_VIEWS: dict[int, int] = {}  # every op's `OpData.views` (the profiler records no views; only ever read)


class Allocation(NamedTuple):
    """One allocation (`nbytes` > 0) or free (`nbytes` < 0) event, with the allocator's totals after it."""

    start_ns: int
    allocation_id: int
    nbytes: int
    device: str  # this project's name: /host:CPU, /device:CUDA:0
    total_allocated: int
    total_reserved: int


def device_name(device: Any) -> str:
    """torch's `cpu` / `cuda:0` as this project's device names `/host:CPU` / `/device:CUDA:0`."""
    text = str(device)
    if text.startswith("cpu"):
        return "/host:CPU"
    kind, _, index = text.partition(":")
    return f"/device:{kind.upper()}:{index or 0}"


@dataclasses.dataclass(slots=True)
class Block:
    """One allocation of the step: its bytes, when it was made and freed (None: it outlived the trace), the
    op it was made in (its profiler id, the op node's `external_id`; None when no op encloses it), the ops
    around that one, innermost first, and, where it was made in allocation plumbing inside that op
    (`aten::empty`: `allocating_op`), the plumbing op's id (`via`; a walk alone records it)."""

    nbytes: int
    start_ns: int
    op: int | None
    outer: tuple[int, ...] = ()
    free_ns: int | None = None
    via: int | None = None

    def outlives(self, node: NodeExecStats) -> bool:
        """Whether the data is still there when `node` ends (not a temporary of it)."""
        return self.free_ns is None or self.free_ns > node.start_ns + node.duration_ns


_NO_TREE = "timelines have no dataflow arrows and no memory tracks, and the Profiler no memory figures"


def event_tree(results: Any) -> EventTree | None:
    """The event tree of a stopped profiler's results; None (and one warning) where this torch has none."""
    event_type = private("torch._C._profiler", "_EventType", _NO_TREE)
    tree = getattr(results, "experimental_event_tree", None)
    if event_type is None:
        return None
    if tree is None:
        warn_missing("_ProfilerResult.experimental_event_tree", _NO_TREE)
        return None
    return EventTree(tree(), event_type)


class EventTree:
    """One pass over the profiler's event tree, kept as plain values (it pickles: the render worker gets it):
    its ops in start order, each as (profiler id, the tensors it read, the argument positions it writes);
    its allocation and free events in time order, as `Allocation`s; and each allocation as a `Block`, by
    allocation id. Made by `event_tree`."""

    def __init__(self, roots: Any, event_type: Any) -> None:
        allocation, torch_op = event_type.Allocation, event_type.TorchOp
        # Each pybind accessor builds new Python objects (`fields.inputs` a whole list of them): each is read
        # once, in one comprehension per accessor over the events in visiting order (tree walks are the
        # costly part of a traced step with dataflow, and run under the training process's GIL).
        events = []
        stack = list(roots)
        while stack:
            event = stack.pop()
            events.append(event)
            stack.extend(event.children)
        op_type = private("torch._C._profiler", "_ExtraFields_TorchOp")
        allocation_type = private("torch._C._profiler", "_ExtraFields_Allocation")
        if op_type is not None and allocation_type is not None:  # (the fields' type tells the kind at no cost)
            fields_of = [event.extra_fields for event in events]
            op_events = [(e, f) for e, f in zip(events, fields_of) if type(f) is op_type]
            allocation_events = [(e, f) for e, f in zip(events, fields_of) if type(f) is allocation_type]
        else:
            typed = [(event, *event.typed) for event in events]
            op_events = [(e, f) for e, kind, f in typed if kind == torch_op]
            allocation_events = [(e, f) for e, kind, f in typed if kind == allocation]
        reads = _Reads()
        ops = []
        for event, fields in op_events:
            inputs = fields.inputs
            found = reads(inputs)
            ops.append((event.start_time_ns, event.correlation_id, found,
                        written_arguments(event.name, len(inputs)) if found else _NOTHING))
        first = operator.itemgetter(0)
        ops.sort(key=first)
        self.ops: list[tuple[int, list[Read], frozenset[int]]] = [op[1:] for op in ops]
        timed = sorted(((event.start_time_ns, fields, event) for event, fields in allocation_events), key=first)
        self.allocations: list[Allocation] = []
        self.blocks: dict[int, Block] = {}
        devices: dict[str, str] = {}
        for start, fields, event in timed:
            device = str(fields.device)
            device = devices.get(device) or devices.setdefault(device, device_name(device))
            self.allocations.append(Allocation(start, fields.allocation_id, fields.alloc_size, device,
                                               fields.total_allocated, fields.total_reserved))
            if fields.alloc_size > 0:
                op = allocating_op(event, torch_op)
                outer = []
                parent = None if op is None else op.parent
                while parent is not None:
                    outer.append(parent.correlation_id)
                    parent = parent.parent
                via = event.parent
                self.blocks[fields.allocation_id] = Block(fields.alloc_size, start,
                                                          None if op is None else op.correlation_id, tuple(outer),
                                                          via=None if via is op else via.correlation_id)
            else:
                block = self.blocks.get(fields.allocation_id)
                if block is not None:
                    block.free_ns = start

    @classmethod
    def from_parts(cls, ops: list[tuple[Any, list[Read], frozenset[int]]], allocations: list[Allocation],
                   blocks: dict[int, Block], held: dict[int, TensorDescription] | None = None) -> EventTree:
        """A tree made of what its walk would have found, from another source
        (`hookprof.tracing.step_identity`): ops in start order, allocations in time order, blocks by id, and
        what each allocation held (`held`) where that source knows it already."""
        tree = cls.__new__(cls)
        tree.ops, tree.allocations, tree.blocks = ops, allocations, blocks
        if held is not None:
            tree.__dict__["held"] = held
        return tree

    @functools.cached_property
    def held(self) -> dict[int, TensorDescription]:
        """What each allocation held (`held_tensors`)."""
        return held_tensors((reads for _, reads, _ in self.ops),
                            {allocation_id: block.nbytes for allocation_id, block in self.blocks.items()})


def held_tensors(reads: Iterable[list[Read]], sizes: dict[Any, int]) -> dict[Any, TensorDescription]:
    """What each allocation held, of those `sizes` gives the bytes of, by their key in the ops' `reads`: its
    earliest read through a view covering all of its bytes, else (the CUDA caching allocator rounds block
    sizes up) its earliest read that fits in it."""
    exact: dict[Any, TensorDescription] = {}
    fits: dict[Any, TensorDescription] = {}
    for op_reads in reads:
        for _, key, tensor in op_reads:
            size, nbytes = sizes.get(key), tensor.nbytes
            if size is None or nbytes is None or key in exact:
                continue
            if nbytes == size:
                exact[key] = tensor
            elif nbytes < size:
                fits.setdefault(key, tensor)
    return {**fits, **exact}


class _Reads:
    """An op's tensor arguments that live in recorded memory (tensor lists flattened), in argument order, from
    its `fields.inputs`. A step has few distinct (dtype, shape) pairs: each one's `TensorDescription` is made
    once and shared (it is a value, never changed)."""

    def __init__(self) -> None:
        self._described: dict[tuple[Any, tuple[int, ...]], TensorDescription] = {}
        # torch's tensor record type, to tell tensors from the scalars and lists among the inputs
        self._tensor_type = private("torch._C._profiler", "_TensorMetadata")  # (else: duck typing, slower)

    def __call__(self, inputs: list) -> list[Read]:
        tensor_type = self._tensor_type
        found = []
        for position, value in enumerate(inputs):
            for tensor in value if type(value) is list else (value,):
                if type(tensor) is tensor_type:
                    allocation_id = tensor.allocation_id
                elif tensor_type is None and hasattr(tensor, "sizes"):
                    allocation_id = getattr(tensor, "allocation_id", None)
                else:
                    continue
                if allocation_id is None:
                    continue
                key = (tensor.dtype, tuple(tensor.sizes))
                description = self._described.get(key)
                if description is None:
                    description = self._described[key] = _describe(*key)
                found.append((position, allocation_id, description))
        return found


def _describe(dtype: Any, shape: tuple[int, ...]) -> TensorDescription:
    name = str(dtype).removeprefix("torch.")
    itemsize = DTYPE_ITEMSIZE.get(name)
    return TensorDescription(name, shape, itemsize * prod(shape) if itemsize is not None else None)


# ops that only hand out memory for the op around them: the allocation is credited to that op
ALLOCATING_PLUMBING = ("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::resize_")
# in-place ops that change a tensor's metadata (shape, strides), not its data
_METADATA_ONLY = frozenset({"unsqueeze_", "squeeze_", "t_", "transpose_", "swapdims_", "swapaxes_", "detach_",
                            "as_strided_", "set_"})


def allocating_op(event: Any, torch_op: Any) -> Any:
    """The op an allocation event belongs to: its parent op, or the op around allocation plumbing (never a
    Python-frame event above it: those record no op). `torch_op` is the tree's op event type."""
    parent = event.parent
    while (parent is not None and parent.name.startswith(ALLOCATING_PLUMBING) and parent.parent is not None
           and parent.parent.typed[0] == torch_op):
        parent = parent.parent
    return parent


_NO_SCHEMAS = ("in-place writes are found by op name only (a trailing `_`), so ops that write an `out=` tensor "
               "or a list of tensors start no dataflow arrows")


@functools.lru_cache(maxsize=4096)
def written_arguments(name: str, arity: int) -> frozenset[int]:
    """The argument positions an op writes, from torch's registered schemas of that name with that many
    arguments (any overload that writes a position counts: the profiler records no overload name)."""
    short = name.rsplit("::", 1)[-1]
    if short in _METADATA_ONLY:
        return frozenset()
    written: set[int] = set()
    matched = False
    schemas_of = private("torch._C", "_jit_get_schemas_for_operator", _NO_SCHEMAS) if "::" in name else None
    if schemas_of is not None:
        try:
            schemas = schemas_of(name)
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
    made: dict[int, list[tuple[int, TensorDescription]]] = {}  # id(node) -> the data it made, in order
    around: dict[int, list[TensorDescription]] = {}  # id(node) -> data an op inside it made
    for allocation_id, block in tree.blocks.items():
        tensor = held.get(allocation_id)
        node = None if block.op is None else nodes_by_id.get(block.op)
        if tensor is None or node is None or not block.outlives(node):
            continue  # data no op read (no edge can start there), or a temporary of its op
        made.setdefault(id(node), []).append((allocation_id, tensor))
        for outer in block.outer:
            outer_node = nodes_by_id.get(outer)
            if outer_node is not None:
                if not block.outlives(outer_node):
                    break
                around.setdefault(id(outer_node), []).append(tensor)
    ops: list[OpData] = []
    for op_id, reads, written in tree.ops:
        node = nodes_by_id.get(op_id)
        if node is None:
            continue
        key = id(node)
        node_made = made.get(key)
        if not (reads or node_made or key in around):
            continue  # (an op that reads and makes nothing has no part in the dataflow)
        op = OpData(node, [(allocation_id, tensor) for _, allocation_id, tensor in reads], [], _NO_VIEWS)
        if written:
            op.outputs = [(allocation_id, tensor) for position, allocation_id, tensor in reads if position in written]
            op.mutations = frozenset(range(len(op.outputs)))
        if node_made:
            op.outputs.extend(node_made)
        if op.outputs or key in around:
            node.outputs = [tensor for _, tensor in op.outputs] + around.get(key, [])
        ops.append(op)
    return ops
