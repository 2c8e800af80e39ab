"""A traced step for TensorBoard's Graphs dashboard, as TF1's `add_run_metadata(run_metadata, "step_N")`.

The step's ops become `NodeDef`s named by their module scope (so TensorBoard groups them into name scopes;
ops outside every module, such as `aten::to` or autograd's accumulation, are grouped under their phase:
`backward/...`, `optimizer/...`), its dataflow edges become node inputs with `_output_shapes`, and its stats
become a `RunMetadata` whose `step_stats` carry each node's start, compute time and bytes, so picking
"step_N" colours the graph by compute time or memory. Devices carry TF's full names
(`/job:localhost/replica:0/task:0/device:CPU:0`): TensorBoard's frontend colours only devices whose name ends
in `/device:<type>:<index>`.

The `GraphDef` and `RunMetadata` are written straight in protobuf's wire format, the messages TensorBoard's
protos decode (tests/test_tensorboard_graph.py compares them with the same step built through those protos):
building a message object per node, attribute and shape cost as much as converting the step (2.5-4x what
this costs), while most of a step's nodes share an op, a phase and output shapes, whose encoded fields are
made once per step here.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

import numpy as np

from hookprof._runtime.gc_pause import paused_gc
from hookprof._runtime.wire import (
    SIZES,
    delimited,
    delimited_each,
    each_encoded,
    int_field,
    int_fields,
    joined,
    str_field,
    varint,
    varints,
)
from hookprof.step_stats import KernelsOf, StepShape, StepStats, node_times
from hookprof.trace import format as fmt

_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-/>]")
_DTYPES = {  # tensorflow DataType enum values
    "float32": 1, "float64": 2, "int32": 3, "uint8": 4, "int16": 5, "int8": 6, "complex64": 8, "int64": 9,
    "bool": 10, "bfloat16": 14, "uint16": 17, "complex128": 18, "float16": 19, "uint32": 22, "uint64": 23,
}


_TF_DEVICE_PREFIX = "/job:localhost/replica:0/task:0/device:"


def graph_name(node_name: str) -> str:
    """A node name TensorBoard parses: `/` keeps the scopes, other punctuation becomes `_` or `.`."""
    return _UNSAFE.sub("_", node_name.replace("::", "."))


def node_graph_name(node: Any) -> str:
    """The graph name of an op: its scoped node name, or, for an op outside every module, under its phase."""
    name = node.node_name
    if "/" not in name and node.phase:
        name = f"{node.phase}/{name}"
    return graph_name(name)


def tf_device(device: str) -> str:
    """This project's device name as TF named devices: `/host:CPU` -> `.../device:CPU:0`, `/device:CUDA:1` ->
    `.../device:GPU:1` (TensorBoard colours a graph by device only for names of that shape)."""
    kind, _, index = device.rsplit("/", 1)[-1].partition(":")[2].partition(":")
    kind = {"CUDA": "GPU"}.get(kind.upper(), kind.upper() or "CPU")
    return f"{_TF_DEVICE_PREFIX}{kind}:{int(index) if index.isdigit() else 0}"


_UINT32_MAX = 0xFFFFFFFF


def _str_bytes(tag: bytes, data: bytes) -> bytes:
    """An encoded string field; proto3 leaves out the empty string."""
    return delimited(tag, data) if data else b""


def _shape(shape: tuple[int, ...]) -> bytes:
    """A `TensorShapeProto` (dim = 2: `Dim`, size = 1)."""
    return b"".join(delimited(b"\x12", int_field(b"\x08", int(d))) for d in shape)


class _Signatures:
    """The encoded fields that many nodes of a device share, made once per step: those a node's op, phase,
    output tensors and thread decide (most nodes of a step repeat a few dozen of these)."""

    def __init__(self, device: bytes) -> None:
        self.device = device
        self.device_field = delimited(b"\x22", device) if device else b""  # NodeDef.device (4)
        self.fields: dict[tuple, tuple[bytes, bytes, bytes, bytes]] = {}
        self.outputs: dict[tuple, bytes] = {}

    def of(self, signature: tuple) -> tuple[bytes, bytes, bytes, bytes]:
        """(NodeDef.op (2); NodeDef.device (4) and attr (5); NodeExecStats.output (7); its timeline_label (8)
        and thread_id (10)) for a signature `(op, phase, output key or None, thread id)`."""
        op, phase, key, thread_id = signature
        value = delimited(b"\x12", phase.encode())  # AttrValue.s (2), set even when empty
        attrs = delimited(b"\x2a", delimited(b"\x0a", b"phase") + delimited(b"\x12", value))
        if key:  # AttrValue.list (1): ListValue.shape (7)
            value = delimited(b"\x0a", b"".join(delimited(b"\x3a", _shape(shape)) for _, shape, _ in key))
            attrs += delimited(b"\x2a", delimited(b"\x0a", b"_output_shapes") + delimited(b"\x12", value))
        if not 0 <= thread_id <= _UINT32_MAX:
            raise ValueError(f"thread_id {thread_id} of an {op!r} op is not a uint32 (NodeExecStats.thread_id)")
        fields = self.fields[signature] = (str_field(b"\x12", op), self.device_field + attrs,
                                           self.node_outputs(key) if key else b"",
                                           str_field(b"\x42", op) + int_field(b"\x50", thread_id))
        return fields

    def node_outputs(self, key: tuple) -> bytes:
        """NodeExecStats.output (7): NodeOutput slot (1), tensor_description (3): TensorDescription dtype (1),
        shape (2), allocation_description (4): AllocationDescription requested_bytes (1), allocator_name (3)."""
        entry = self.outputs.get(key)
        if entry is None:
            allocator = str_field(b"\x1a", self.device.decode())
            parts = []
            for slot, (dtype, shape, nbytes) in enumerate(key):
                description = int_field(b"\x08", _DTYPES.get(dtype, 0)) + delimited(b"\x12", _shape(shape)) + \
                    delimited(b"\x22", int_field(b"\x08", nbytes or 0) + allocator)
                parts.append(delimited(b"\x3a", int_field(b"\x08", slot) + delimited(b"\x1a", description)))
            entry = self.outputs[key] = b"".join(parts)
        return entry


def _output_key(node: Any) -> tuple:
    """What a node's outputs put in its graph node and stats: (dtype, shape, bytes) per output."""
    return tuple((t.dtype, tuple(t.shape), t.nbytes) for t in node.outputs)


class GraphNames:
    """Graph names of nodes and their NodeDef.name field, by (node name, phase) (a pure function of the two), kept
    from one of a fit's traced steps for the next ones, which repeat their node names (a third of the step
    graph's cost at 20k ops): its owner passes it to each step's `graph_and_run_metadata` (the fit's renders:
    `hookprof.hooks.capture`). Emptied past `MAX` names (a 57k-op step's fit; a few MB)."""

    MAX = 1 << 16

    def __init__(self) -> None:
        self.named: dict[tuple[str, str], tuple[bytes, bytes]] = {}


class _Names:
    """Graph names of a step's nodes, as UTF-8: `node_graph_name`, made per scope and per leaf name (a step
    repeats both: `Sequential/3` holds a few dozen ops, `aten::addmm` runs in every layer), and kept in
    `named` (a `GraphNames`') for the next steps."""

    def __init__(self, named: dict[tuple[str, str], tuple[bytes, bytes]]) -> None:
        self.named = named
        self.scopes: dict[str, bytes] = {}  # a scope (or an op's phase) -> its graph name and "/"
        self.leaves: dict[str, bytes] = {}
        self.nodes: dict[int, tuple[bytes, bytes]] = {}  # id(node) -> its graph name, and that as field 1

    def __call__(self, node: Any) -> tuple[bytes, bytes]:
        """The node's graph name, and that as field 1 (NodeDef.name, NodeExecStats.node_name), kept by the node
        (an edge's producer feeds several consumers)."""
        named = self.nodes.get(id(node))
        if named is None:
            named = self.nodes[id(node)] = self.named.get((node.node_name, node.phase)) or self.new(node)
        return named

    def new(self, node: Any) -> tuple[bytes, bytes]:
        """`__call__`'s names for a node whose (node name, phase) `named` does not hold yet, kept there."""
        # `graph_name` works on `/`-free pieces alone: the name is its scope's name, `/`, its leaf's name
        scope, slash, leaf = node.node_name.rpartition("/")
        if not slash:
            scope = node.phase
        leaf_name = self.leaves.get(leaf)
        if leaf_name is None:
            leaf_name = self.leaves[leaf] = graph_name(leaf).encode()
        if slash or scope:
            prefix = self.scopes.get(scope)
            if prefix is None:
                prefix = self.scopes[scope] = graph_name(scope).encode() + b"/"
            leaf_name = prefix + leaf_name
        known = self.named
        if len(known) >= GraphNames.MAX:
            known.clear()
        named = known[(node.node_name, node.phase)] = (leaf_name, _str_bytes(b"\x0a", leaf_name))
        return named


def graph_and_run_metadata(stats: StepStats, names: GraphNames | None = None, shape: StepShape | None = None
                           ) -> tuple[bytes, bytes]:
    """The step's dataflow graph (a serialised `GraphDef`: ops as nodes, tensors as edges, module scopes as
    name scopes) and its serialised `RunMetadata` (per-node start, compute time, outputs and bytes
    allocated): the graph and what its nodes' stats hold but their times in one pass over the step, then
    their times around those (the garbage collector paused: a full pass over a large step's objects cost as
    much as building its graph). `names`: the graph names kept from the fit's earlier steps
    (None: this step's own). With the step's `shape`: a step of its fit's last one's shape takes its graph and
    its nodes' untimed fields from it (`StepShape.recall`), and this one's are kept for the next."""
    with paused_gc():
        if stats.allocations:  # (their bytes are in their nodes' stats: not decided by the shape)
            shape = None
        parts = None if shape is None else shape.recall("graph")
        if parts is None:
            parts = _graph_and_untimed_stats(stats, (names if names is not None else GraphNames()).named)
            if shape is not None:
                shape.keep("graph", parts)
        return parts[0], _run_metadata(stats, parts[1])


# Per device of a step: its DeviceStepStats.device field, whether each of its nodes is an op (has stats), and each
# op's NodeExecStats fields before and after its times (node_name; memory, output, timeline_label and thread_id)
_Untimed = list[tuple[bytes, list[bool], list[bytes], list[bytes]]]


def _run_metadata(stats: StepStats, untimed: _Untimed) -> bytes:
    """The step's serialised RunMetadata: its ops' `untimed` fields (`_graph_and_untimed_stats`) around their
    times, NodeExecStats all_start_micros (2), op_end_rel_micros (4) and all_end_rel_micros (5), joined column
    by column: iterated by C, where a step has tens of thousands of ops."""
    devices = []
    for dev, (device_field, is_op, names, rest) in zip(stats.dev_stats, untimed):
        ops = list(itertools.compress(dev.node_stats, is_op))
        # microseconds since the epoch; compute times of at least 1
        starts, durations = node_times(ops)
        starts = int_fields(b"\x10", starts // 1000)
        micros = np.maximum(durations // 1000, 1)
        durations = each_encoded(micros, _durations)
        node_stats = delimited_each(b"\x12", joined(names, starts, durations, rest))
        devices.append(delimited(b"\x0a", device_field + node_stats))  # StepStats.dev_stats (1): DeviceStepStats
    # RunMetadata.step_stats (1), set once a device is added
    return delimited(b"\x0a", b"".join(devices)) if devices else b""


def _durations(micros: np.ndarray) -> list[bytes]:
    """NodeExecStats.op_end_rel_micros (4) and all_end_rel_micros (5) of each compute time in `micros`."""
    return [b"\x20%s\x28%s" % (fields, fields) for fields in varints(micros)]


def _graph_and_untimed_stats(stats: StepStats, named: dict[tuple[str, str], tuple[bytes, bytes]]
                             ) -> tuple[bytes, _Untimed]:
    """The step's serialised GraphDef and its nodes' untimed NodeExecStats fields (`_run_metadata`'s), which its
    ops, phases, outputs, dataflow and allocations decide."""
    name_of = _Names(named)
    inputs: dict[int, list[bytes]] = {}  # id(consumer) -> its NodeDef.input (3) fields
    for edge in stats.edges:
        slot = edge.name.rsplit(":", 1)[-1]
        source = name_of(edge.producer)[0]
        inputs.setdefault(id(edge.consumer), []).append(
            delimited(b"\x1a", source if slot == "0" else b"%s:%s" % (source, slot.encode())))
    allocated: dict[int, int] = {}
    for alloc in stats.allocations:
        if alloc.producer is not None:
            allocated[id(alloc.producer)] = allocated.get(id(alloc.producer), 0) + alloc.nbytes

    sizes = SIZES
    graph: list[bytes] = []
    # An op that ran kernels (itself or through the ops nested in it) ran on their device, as TF placed it:
    # its NodeDef names that device (and its outputs that allocator), so TensorBoard colours it as a GPU op;
    # its stats stay on the host's line.
    kernels_of = KernelsOf(stats)
    output_keys: dict[tuple[int, ...], tuple] = {}  # ids of a node's output tensors (their nodes hold them) -> key
    placed: dict[int, _Signatures] = {}  # kernel device index in dev_stats -> its signatures
    untimed: _Untimed = []
    for dev in stats.dev_stats:
        own = _Signatures(tf_device(dev.device).encode())
        is_op = [node.category == fmt.CAT_OP for node in dev.node_stats]
        names: list[bytes] = []
        rest: list[bytes] = []
        untimed.append((delimited(b"\x0a", own.device) if own.device else b"", is_op, names, rest))  # device (1)
        for node in itertools.compress(dev.node_stats, is_op):
            name_field = (named.get((node.node_name, node.phase)) or name_of.new(node))[1]
            key = None
            if node.outputs:  # (a step's nodes share their tensors' descriptions: each key made once)
                tensors = tuple(map(id, node.outputs))
                key = output_keys.get(tensors)
                if key is None:
                    key = output_keys[tensors] = _output_key(node)
            signature = (node.op, node.phase, key, node.thread_id)
            kernels = kernels_of(node)
            if kernels:
                index = kernels[0][0]
                shared = placed.get(index) or placed.setdefault(
                    index, _Signatures(tf_device(stats.dev_stats[index].device).encode()))
            else:
                shared = own
            op_field, attrs, outputs, label = shared.fields.get(signature) or shared.of(signature)
            # GraphDef.node (1): NodeDef name (1), op (2), input (3), device (4), attr (5)
            node_inputs = inputs.get(id(node))
            fields = name_field + op_field + (b"".join(node_inputs) if node_inputs else b"") + attrs
            size = len(fields)
            graph.append(b"\x0a" + (sizes[size] if size < 2048 else varint(size)) + fields)
            # NodeExecStats memory (6): AllocatorMemoryUsed allocator_name (1), total_bytes (2), peak_bytes (3)
            nbytes = allocated.get(id(node))
            if nbytes is not None:
                outputs = delimited(b"\x32", str_field(b"\x0a", shared.device.decode()) + int_field(b"\x10", nbytes) +
                                    int_field(b"\x18", nbytes)) + outputs
            names.append(name_field)
            rest.append(outputs + label)
    return b"".join(graph), untimed


def step_graph(stats: StepStats) -> Any:
    """The step's dataflow graph as TensorBoard's `GraphDef` (see `graph_and_run_metadata`)."""
    from tensorboard.compat.proto.graph_pb2 import GraphDef

    return GraphDef.FromString(graph_and_run_metadata(stats)[0])


def run_metadata(stats: StepStats) -> Any:
    """TF's `RunMetadata` for the step: per-node start, compute time, outputs and bytes allocated."""
    from tensorboard.compat.proto.config_pb2 import RunMetadata

    return RunMetadata.FromString(graph_and_run_metadata(stats)[1])


def run_metadata_events(stats: StepStats, tag: str, step: int, names: GraphNames | None = None,
                        shape: StepShape | None = None) -> list[Any]:
    """TF's `add_run_metadata(run_metadata, tag)` as the two events it writes: the step's graph and its
    tagged run metadata (built here, off the disk's time; an event sink writes them: see `events`); `names`, `shape`:
    see `graph_and_run_metadata`."""
    from tensorboard.compat.proto.event_pb2 import TaggedRunMetadata

    from hookprof.tensorboard.events import new_event

    graph, metadata = graph_and_run_metadata(stats, names, shape)
    return [new_event(step, graph_def=graph),
            new_event(step, tagged_run_metadata=TaggedRunMetadata(tag=tag, run_metadata=metadata))]
