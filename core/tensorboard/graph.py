"""A traced step for TensorBoard's Graphs dashboard, as TF1's `add_run_metadata(run_metadata, "step_N")`.

The step's ops become `NodeDef`s named by their module scope (so TensorBoard groups them into name scopes;
ops outside every module, such as `aten::to` or autograd's accumulation, are grouped under their phase:
`backward/...`, `optimizer/...`), its dataflow edges become node inputs with `_output_shapes`, and its stats
become a `RunMetadata` whose `step_stats` carry each node's start, compute time and bytes, so picking
"step_N" colours the graph by compute time or memory. Devices carry TF's full names
(`/job:localhost/replica:0/task:0/device:CPU:0`): TensorBoard's frontend colours only devices whose name ends
in `/device:<type>:<index>`. Built with TensorBoard's protos.
"""

from __future__ import annotations

import re
from typing import Any

from hookprof.step_stats import StepStats
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


def _shape_proto(shape: tuple[int, ...]) -> Any:
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto

    return TensorShapeProto(dim=[TensorShapeProto.Dim(size=int(d)) for d in shape])


def step_graph(stats: StepStats) -> Any:
    """The step's dataflow graph: ops as nodes, tensors as edges, module scopes as name scopes."""
    from tensorboard.compat.proto.attr_value_pb2 import AttrValue
    from tensorboard.compat.proto.graph_pb2 import GraphDef
    from tensorboard.compat.proto.node_def_pb2 import NodeDef

    inputs: dict[int, list[str]] = {}
    for edge in stats.edges:
        slot = edge.name.rsplit(":", 1)[-1]
        source = node_graph_name(edge.producer)
        inputs.setdefault(id(edge.consumer), []).append(source if slot == "0" else f"{source}:{slot}")
    graph = GraphDef()
    for dev in stats.dev_stats:
        device = tf_device(dev.device)
        for node in dev.node_stats:
            if node.category != fmt.CAT_OP:
                continue
            attrs = {"phase": AttrValue(s=node.phase.encode())}
            if node.outputs:
                attrs["_output_shapes"] = AttrValue(list=AttrValue.ListValue(
                    shape=[_shape_proto(t.shape) for t in node.outputs]))
            graph.node.append(NodeDef(name=node_graph_name(node), op=node.op, device=device,
                                      input=inputs.get(id(node), []), attr=attrs))
    return graph


def run_metadata(stats: StepStats) -> Any:
    """TF's `RunMetadata` for the step: per-node start, compute time, outputs and bytes allocated."""
    from tensorboard.compat.proto import allocation_description_pb2, tensor_description_pb2
    from tensorboard.compat.proto.config_pb2 import RunMetadata

    allocated: dict[int, int] = {}
    for alloc in stats.allocations:
        if alloc.producer is not None:
            allocated[id(alloc.producer)] = allocated.get(id(alloc.producer), 0) + alloc.nbytes
    meta = RunMetadata()
    for dev in stats.dev_stats:
        device = tf_device(dev.device)
        dev_proto = meta.step_stats.dev_stats.add(device=device)
        for node in dev.node_stats:
            if node.category != fmt.CAT_OP:
                continue
            micros = max(1, node.duration_ns // 1000)
            proto = dev_proto.node_stats.add(
                node_name=node_graph_name(node), all_start_micros=node.start_ns // 1000,
                op_start_rel_micros=0, op_end_rel_micros=micros, all_end_rel_micros=micros,
                timeline_label=node.op, thread_id=node.thread_id,
            )
            if id(node) in allocated:
                proto.memory.add(allocator_name=device, total_bytes=allocated[id(node)],
                                 peak_bytes=allocated[id(node)])
            for slot, tensor in enumerate(node.outputs or ()):
                proto.output.add(slot=slot, tensor_description=tensor_description_pb2.TensorDescription(
                    dtype=_DTYPES.get(tensor.dtype, 0), shape=_shape_proto(tensor.shape),
                    allocation_description=allocation_description_pb2.AllocationDescription(
                        requested_bytes=tensor.nbytes or 0, allocator_name=device)))
    return meta


def run_metadata_events(stats: StepStats, tag: str, step: int) -> list[Any]:
    """TF's `add_run_metadata(run_metadata, tag)` as the two events it writes: the step's graph and its
    tagged run metadata (built here, off the disk's time; an event sink writes them: see `events`)."""
    from tensorboard.compat.proto.event_pb2 import TaggedRunMetadata

    from hookprof.tensorboard.events import new_event

    return [new_event(step, graph_def=step_graph(stats).SerializeToString()),
            new_event(step, tagged_run_metadata=TaggedRunMetadata(
                tag=tag, run_metadata=run_metadata(stats).SerializeToString()))]


def add_run_metadata(writer: Any, stats: StepStats, tag: str, step: int) -> None:
    """Write the step's graph and its tagged run metadata to `writer` (an event sink: see `events`)."""
    for event in run_metadata_events(stats, tag, step):
        writer.add_event(event)
