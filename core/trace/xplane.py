"""A traced step as an `XSpace` protobuf: what TensorBoard's Profile tab (the `xprof` plugin) reads.

xprof opens `<logdir>/plugins/profile/<run>/<host>.xplane.pb`: tsl's `XSpace` (`tsl/profiler/protobuf/xplane.proto`)
of planes (`/host:CPU`, devices, the `Task Environment`) of lines (threads) of events, each naming an event
metadata (its name and fixed stats) and carrying its own stats. `step_xspace` writes one traced step so that
xprof's own converters read it as a TF or JAX host profile:
- the `/host:CPU` plane has one line per thread (the "Step phases" line first); event offsets are picoseconds
  from the line's `timestamp_ns`, which is 0: times count from the step's first instant, whose epoch time is
  the `Task Environment` plane's `profile_start_time` (epoch ns x 1000 would overflow an int64);
- framework ops keep their names verbatim (`encoder/fc1/aten::addmm`: the module scope, then the op): xprof
  parses a TF or JAX op name (`name:type`) and drops torch's, but takes an event whose metadata carries
  `_ipl_stage_id` (its own id) and `_ipl_stage_cat` (the op type, `aten::addmm`) as is. Framework op stats
  count them, their self time from how they nest on their thread;
- the step: every event carries `group_id` = the global step; the `ProfilerStep#N` span (with `step_name` and
  `step_num`) spans the data wait and the step, and the data wait carries `_ipl_stage_name`, so the overview
  and the input pipeline analysis split the step into input (data wait) and compute (forward, backward,
  optimizer);
- memory: each allocation and free is a `MemoryAllocation` / `MemoryDeallocation` event (TF's allocator
  stats: bytes in use, the peak so far, the tensor's bytes, dtype, shape and producing op) on a line whose id
  xprof keeps for derived lines, which op stats skip;
- stat values are a proto3 `oneof`, so zeros (`group_id` 0) are written.
Nothing here needs tensorflow or xprof: the messages are declared below (the fields hookprof reads and writes,
in the upstream numbering, with XLA's `HloProto` that JAX's XSpace carries) and built with protobuf.
"""

from __future__ import annotations

from typing import Any

import orjson

from hookprof.step_stats import AllocatorSample, NodeExecStats, StepStats, TensorAllocation
from hookprof.trace import format as fmt

HOST_PLANE = "/host:CPU"  # tsl's kHostThreadsPlaneName; hookprof's host device has the same name
TASK_PLANE = "Task Environment"  # tsl's kTaskEnvPlaneName: `profile_start_time` / `profile_stop_time`
PROFILE_START_TIME = "profile_start_time"
PROFILE_STOP_TIME = "profile_stop_time"
XPLANE_SUFFIX = ".xplane.pb"

# tsl's stat and event names (xla/tsl/profiler/utils/xplane_schema.cc)
GROUP_ID = "group_id"
STEP_NAME = "step_name"
STEP_NUM = "step_num"
IS_EAGER = "is_eager"
IPL_STAGE_ID = "_ipl_stage_id"
IPL_STAGE_CAT = "_ipl_stage_cat"
IPL_STAGE_NAME = "_ipl_stage_name"
MEMORY_ALLOCATION = "MemoryAllocation"
MEMORY_DEALLOCATION = "MemoryDeallocation"
# tsl's kThreadIdDerivedMin (0xdeadbeef as a C int) + 8: a derived line, which host op stats skip
MEMORY_LINE_ID = 0xDEADBEEF - (1 << 32) + 8
MEMORY_LINE = "Allocator"

# TF's DataType numbers (tensorflow/core/framework/types.proto), which memory_profile names
_TF_DTYPES = {"float32": 1, "float64": 2, "int32": 3, "uint8": 4, "int16": 5, "int8": 6, "complex64": 8,
              "int64": 9, "bool": 10, "bfloat16": 14, "uint16": 17, "complex128": 18, "float16": 19,
              "uint32": 22, "uint64": 23}

# (message, [(field, number, type, repeated, message type, oneof)]), in the upstream protos' numbering
_I64, _U64, _I32, _F64, _STR, _BYTES, _MSG = "int64", "uint64", "int32", "double", "string", "bytes", "message"
_BOOL = "bool"
_V, _D = "value", "data"  # the oneofs of XStat and XEvent
_SCHEMA: list[tuple[str, list[tuple[str, int, str, bool, str | None, str | None]]]] = [
    # tsl/profiler/protobuf/xplane.proto
    ("XStat", [("metadata_id", 1, _I64, False, None, None), ("double_value", 2, _F64, False, None, _V),
               ("uint64_value", 3, _U64, False, None, _V), ("int64_value", 4, _I64, False, None, _V),
               ("str_value", 5, _STR, False, None, _V), ("bytes_value", 6, _BYTES, False, None, _V),
               ("ref_value", 7, _U64, False, None, _V)]),
    ("XEvent", [("metadata_id", 1, _I64, False, None, None), ("offset_ps", 2, _I64, False, None, _D),
                ("num_occurrences", 5, _I64, False, None, _D), ("duration_ps", 3, _I64, False, None, None),
                ("stats", 4, _MSG, True, "XStat", None)]),
    ("XLine", [("id", 1, _I64, False, None, None), ("display_id", 10, _I64, False, None, None),
               ("name", 2, _STR, False, None, None), ("display_name", 11, _STR, False, None, None),
               ("timestamp_ns", 3, _I64, False, None, None), ("duration_ps", 9, _I64, False, None, None),
               ("events", 4, _MSG, True, "XEvent", None)]),
    ("XEventMetadata", [("id", 1, _I64, False, None, None), ("name", 2, _STR, False, None, None),
                        ("display_name", 4, _STR, False, None, None), ("stats", 5, _MSG, True, "XStat", None)]),
    ("XStatMetadata", [("id", 1, _I64, False, None, None), ("name", 2, _STR, False, None, None)]),
    # a proto map<int64, M> is, on the wire, a repeated message of (key = 1, value = 2)
    ("XEventMetadataEntry", [("key", 1, _I64, False, None, None), ("value", 2, _MSG, False, "XEventMetadata", None)]),
    ("XStatMetadataEntry", [("key", 1, _I64, False, None, None), ("value", 2, _MSG, False, "XStatMetadata", None)]),
    ("XPlane", [("id", 1, _I64, False, None, None), ("name", 2, _STR, False, None, None),
                ("lines", 3, _MSG, True, "XLine", None), ("event_metadata", 4, _MSG, True, "XEventMetadataEntry", None),
                ("stat_metadata", 5, _MSG, True, "XStatMetadataEntry", None), ("stats", 6, _MSG, True, "XStat", None)]),
    ("XSpace", [("planes", 1, _MSG, True, "XPlane", None), ("errors", 2, _STR, True, None, None),
                ("warnings", 3, _STR, True, None, None), ("hostnames", 4, _STR, True, None, None)]),
    # xla/xla_data.proto
    ("ShapeProto", [("element_type", 2, _I32, False, None, None), ("dimensions", 3, _I64, True, None, None),
                    ("tuple_shapes", 4, _MSG, True, "ShapeProto", None)]),
    ("OpMetadata", [("op_type", 1, _STR, False, None, None), ("op_name", 2, _STR, False, None, None),
                    ("source_file", 3, _STR, False, None, None), ("source_line", 4, _I32, False, None, None),
                    ("stack_frame_id", 15, _I32, False, None, None)]),
    # xla/service/hlo.proto
    ("HloInstructionProto", [("name", 1, _STR, False, None, None), ("opcode", 2, _STR, False, None, None),
                             ("shape", 3, _MSG, False, "ShapeProto", None),
                             ("metadata", 7, _MSG, False, "OpMetadata", None), ("id", 35, _I64, False, None, None),
                             ("operand_ids", 36, _I64, True, None, None)]),
    ("HloComputationProto", [("name", 1, _STR, False, None, None),
                             ("instructions", 2, _MSG, True, "HloInstructionProto", None),
                             ("id", 5, _I64, False, None, None),
                             ("is_fusion_computation", 7, _BOOL, False, None, None)]),
    ("FileLocation", [("file_name_id", 1, _I32, False, None, None), ("function_name_id", 2, _I32, False, None, None),
                      ("line", 3, _I32, False, None, None)]),
    ("StackFrame", [("file_location_id", 1, _I32, False, None, None), ("parent_frame_id", 2, _I32, False, None, None)]),
    ("StackFrameIndexProto", [("file_names", 1, _STR, True, None, None), ("function_names", 2, _STR, True, None, None),
                              ("file_locations", 3, _MSG, True, "FileLocation", None),
                              ("stack_frames", 4, _MSG, True, "StackFrame", None)]),
    ("HloModuleProto", [("name", 1, _STR, False, None, None),
                        ("computations", 3, _MSG, True, "HloComputationProto", None),
                        ("entry_computation_id", 6, _I64, False, None, None),
                        ("stack_frame_index", 17, _MSG, False, "StackFrameIndexProto", None)]),
    ("HloProto", [("hlo_module", 1, _MSG, False, "HloModuleProto", None)]),
]
_PACKAGE = "hookprof.xspace"


def _message_classes() -> dict[str, Any]:
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    field = descriptor_pb2.FieldDescriptorProto
    types = {_I64: field.TYPE_INT64, _U64: field.TYPE_UINT64, _I32: field.TYPE_INT32, _F64: field.TYPE_DOUBLE,
             _STR: field.TYPE_STRING, _BYTES: field.TYPE_BYTES, _MSG: field.TYPE_MESSAGE, _BOOL: field.TYPE_BOOL}
    file = descriptor_pb2.FileDescriptorProto(name="hookprof_xspace.proto", package=_PACKAGE, syntax="proto3")
    for name, fields in _SCHEMA:
        message = file.message_type.add(name=name)
        oneofs: dict[str, int] = {}
        for fname, number, ftype, repeated, type_name, oneof in fields:
            entry = message.field.add(name=fname, number=number, type=types[ftype],
                                      label=field.LABEL_REPEATED if repeated else field.LABEL_OPTIONAL)
            if type_name:
                entry.type_name = f".{_PACKAGE}.{type_name}"
            if oneof is not None:
                if oneof not in oneofs:
                    oneofs[oneof] = len(message.oneof_decl)
                    message.oneof_decl.add(name=oneof)
                entry.oneof_index = oneofs[oneof]
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.{name}"))
            for name, _ in _SCHEMA}


_CLASSES: dict[str, Any] = {}


def message(name: str) -> Any:
    """The message class `name` of the schema above (`XSpace`, `HloProto`, ...), built on first use."""
    if not _CLASSES:
        _CLASSES.update(_message_classes())
    return _CLASSES[name]


class _Plane:
    """One XPlane being built: interned event and stat metadata, and `XStat`s made from Python values."""

    def __init__(self, plane: Any) -> None:
        self.plane = plane
        self._events: dict[str, int] = {}
        self._stats: dict[str, int] = {}
        self._stat = message("XStat")

    def event_id(self, name: str) -> int:
        return _interned(self._events, self.plane.event_metadata, name)

    def stat_id(self, name: str) -> int:
        return _interned(self._stats, self.plane.stat_metadata, name)

    def stat(self, name: str, value: Any) -> Any:
        """An XStat of `name`: ints as int64, floats as double, strings by reference (each distinct string is
        stored once, as a stat metadata's name: how tsl interns them)."""
        key = self.stat_id(name)
        if isinstance(value, str):
            return self._stat(metadata_id=key, ref_value=self.stat_id(value))
        if isinstance(value, float):
            return self._stat(metadata_id=key, double_value=value)
        return self._stat(metadata_id=key, int64_value=int(value))


def _interned(ids: dict[str, int], entries: Any, name: str) -> int:
    """The id of metadata `name` in a plane's map `entries` (added, with the next id, on first use)."""
    found = ids.get(name)
    if found is None:
        found = ids[name] = len(ids) + 1
        entry = entries.add(key=found)
        entry.value.id, entry.value.name = found, name
    return found


def step_xspace(stats: StepStats, hostname: str) -> bytes:
    """One traced step as a serialized `XSpace` for xprof (see the module's doc): the host device's threads,
    the step's phases and, where recorded, its allocations. Other devices' work (CUDA kernels) is left out."""
    step = stats.step if stats.step is not None else 0
    host = next((dev for dev in stats.dev_stats if dev.device == HOST_PLANE), None)
    nodes = host.node_stats if host is not None else []
    phase_spans = {n.op: n for n in nodes if n.category == fmt.CAT_SPAN}
    train = phase_spans.get(fmt.TRAIN_STEP)
    data_wait = phase_spans.get(fmt.DATA_WAIT)
    times = [n.start_ns for n in nodes] + [s.ts_ns for s in stats.memory_samples]
    base = min(times, default=0)
    end = max([n.start_ns + n.duration_ns for n in nodes] + [s.ts_ns for s in stats.memory_samples], default=base)

    space = message("XSpace")(hostnames=[hostname])
    plane = _Plane(space.planes.add(id=1, name=HOST_PLANE))
    event_class = message("XEvent")
    group = plane.stat(GROUP_ID, step)

    described: dict[tuple, tuple[int, list[Any]]] = {}  # what nodes alike have: their metadata and stats
    threads: dict[int, list[NodeExecStats]] = {}
    for node in nodes:
        threads.setdefault(node.thread_id, []).append(node)
    thread_names = host.thread_names if host is not None else {}
    for tid in sorted(threads, key=lambda t: (t != _step_thread(thread_names), t)):
        line_nodes = sorted(threads[tid], key=lambda n: (n.start_ns, -n.duration_ns))
        name = thread_names.get(tid, f"thread {tid}")
        line = plane.plane.lines.add(id=tid, display_id=tid, name=name, timestamp_ns=0)
        events = []
        if tid == _step_thread(thread_names) and train is not None:
            # the step as xprof sees one: from the data wait's start (input time) to the step's end
            start = data_wait.start_ns if data_wait is not None else train.start_ns
            marker = f"{fmt.PROFILER_STEP_PREFIX}{step}"
            events.append(event_class(metadata_id=plane.event_id(marker), offset_ps=(start - base) * 1000,
                                      duration_ps=(train.start_ns + train.duration_ns - start) * 1000,
                                      stats=[group, plane.stat(STEP_NAME, marker), plane.stat(STEP_NUM, step)]))
        for node in line_nodes:
            if node.category == fmt.CAT_SPAN and node.op == fmt.TRAIN_STEP:
                continue  # the marker above holds it
            # nodes alike share their metadata and stats (the dtypes list is one per signature: see kineto_trace)
            shapes = orjson.dumps(node.input_shapes) if node.input_shapes else None
            signature = (node.category, node.op, node.scope, node.phase, shapes, id(node.input_dtypes))
            found = described.get(signature)
            if found is None:  # (the nodes, so their lists, live as long as this: ids are not reused)
                found = described[signature] = _node_stats(plane, node, group, shapes)
            key, node_stats = found
            events.append(event_class(metadata_id=key, offset_ps=(node.start_ns - base) * 1000,
                                      duration_ps=node.duration_ns * 1000, stats=node_stats))
        line.events.extend(events)
    _add_memory(plane, stats, base, group)

    task = _Plane(space.planes.add(id=2, name=TASK_PLANE))
    stat_class = message("XStat")
    task.plane.stats.extend([stat_class(metadata_id=task.stat_id(PROFILE_START_TIME), uint64_value=base),
                             stat_class(metadata_id=task.stat_id(PROFILE_STOP_TIME), uint64_value=end)])
    return space.SerializeToString()


def _step_thread(thread_names: dict[int, str]) -> int | None:
    return next((tid for tid, name in thread_names.items() if name == fmt.STEP_PHASES_THREAD), None)


def _node_stats(plane: _Plane, node: NodeExecStats, group: Any, shapes: bytes | None) -> tuple[int, list[Any]]:
    """A node's event metadata (ops: by scope and op) and its event's stats: its step, what makes xprof count
    an op (read from the event itself, not its metadata), and what the timeline's args say of it (the trace
    viewer shows them)."""
    stats = [group]
    if node.category == fmt.CAT_OP:
        key = plane.event_id(f"{node.scope}/{node.op}" if node.scope else node.op)
        stats += [plane.stat(IPL_STAGE_ID, key), plane.stat(IPL_STAGE_CAT, node.op), plane.stat(IS_EAGER, 1)]
    else:
        key = plane.event_id(node.op)
    if node.category == fmt.CAT_SPAN and node.op == fmt.DATA_WAIT:
        stats.append(plane.stat(IPL_STAGE_NAME, fmt.DATA_WAIT))
    if node.phase:
        stats.append(plane.stat(fmt.ARG_PHASE, node.phase))
    if node.scope:
        stats.append(plane.stat(fmt.ARG_SCOPE, node.scope))
    if shapes is not None:
        stats.append(plane.stat(fmt.ARG_INPUT_SHAPES, shapes.decode()))
        if node.input_dtypes:
            stats.append(plane.stat(fmt.ARG_INPUT_DTYPES, orjson.dumps(node.input_dtypes).decode()))
    return key, stats


def _add_memory(plane: _Plane, stats: StepStats, base: int, group: Any) -> None:
    """The allocator's samples as TF's memory events, each allocation or free with the tensor it concerns."""
    if not stats.memory_samples:
        return
    made = {(a.device, a.alloc_ns): a for a in stats.allocations}
    freed = {(a.device, a.free_ns): a for a in stats.allocations if a.free_ns is not None}
    event_class = message("XEvent")
    line = plane.plane.lines.add(id=MEMORY_LINE_ID, display_id=MEMORY_LINE_ID, name=MEMORY_LINE, timestamp_ns=0)
    events = []
    last: dict[str, int] = {}
    peaks: dict[str, int] = {}
    for sample in sorted(stats.memory_samples, key=lambda s: s.ts_ns):
        device = sample.device
        allocation = made.get((device, sample.ts_ns))
        released = None if allocation is not None else freed.get((device, sample.ts_ns))
        growing = sample.total_allocated >= last.get(device, 0)
        is_allocation = allocation is not None or (released is None and growing)
        last[device] = sample.total_allocated
        peaks[device] = max(peaks.get(device, 0), sample.total_allocated)
        events.append(event_class(
            metadata_id=plane.event_id(MEMORY_ALLOCATION if is_allocation else MEMORY_DEALLOCATION),
            offset_ps=(sample.ts_ns - base) * 1000,
            stats=_memory_stats(plane, sample, allocation or released, peaks[device], group)))
    line.events.extend(events)


def _memory_stats(plane: _Plane, sample: AllocatorSample, tensor: TensorAllocation | None, peak: int,
                  group: Any) -> list[Any]:
    # xprof's bytes in use are bytes_allocated + bytes_reserved (TF's heap and stack): torch's reserved bytes
    # (its cache, which includes the allocated ones) go in bytes_available, as what could be handed out
    stats = [group, plane.stat("allocator_name", sample.device), plane.stat("bytes_allocated", sample.total_allocated),
             plane.stat("bytes_reserved", 0),
             plane.stat("bytes_available", max(0, sample.total_reserved - sample.total_allocated)),
             plane.stat("peak_bytes_in_use", peak)]
    if tensor is not None:
        stats += [plane.stat("requested_bytes", tensor.nbytes), plane.stat("allocation_bytes", tensor.nbytes),
                  plane.stat("addr", tensor.allocation_id), plane.stat("region_type", "output")]
        if tensor.producer is not None:
            stats.append(plane.stat("tf_op", tensor.producer.node_name))
        if tensor.tensor is not None:
            stats.append(plane.stat("shape", orjson.dumps(list(tensor.tensor.shape)).decode()))
            dtype = _TF_DTYPES.get(tensor.tensor.dtype)
            if dtype is not None:
                stats.append(plane.stat("data_type", dtype))
    return stats
