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
- CUDA kernels (memcpys, memsets): a `/device:GPU:<n>` plane per device with a line per stream; each event
  carries the step, its `correlation_id`, its launching op (`tf_op`) and its launch configuration
  (`kernel_details`), which xprof's device op stats, op profile and kernel stats read. xprof then takes the
  step from the device alone: a "Steps" line holds it, and it splits it into device compute and the rest. A
  step that ran no kernel has no device plane (a device plane makes xprof read the run as a GPU one);
- stat values are a proto3 `oneof`, so zeros (`group_id` 0) are written.
Nothing here needs tensorflow or xprof: the messages are declared below (the fields hookprof reads and writes,
in the upstream numbering, with XLA's `HloProto` that JAX's XSpace carries); protobuf reads them (JAX's XSpace,
the tests), and `step_xspace` writes its bytes by hand, in protobuf's wire format and field order, from what
nodes alike share encoded once (a 20k-op step: ~0.12 s, where building the messages took ~0.55 s).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import struct
from collections.abc import Iterable
from typing import Any

import numpy as np
import orjson

from hookprof._runtime.gc_pause import paused_gc
from hookprof._runtime.wire import (
    FIXED64,
    LENGTH_DELIMITED,
    VARINT,
    delimited,
    delimited_each,
    each_encoded,
    int_field,
    int_fields,
    joined,
    tag,
    varint,
    varints,
)
from hookprof.step_stats import (
    AllocatorSample,
    NodeExecStats,
    StepShape,
    StepStats,
    TensorAllocation,
    node_times,
)
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
# devices: tsl's GPU planes (kGpuPlanePrefix) for hookprof's CUDA devices (`hookprof.tracing.kineto_trace`)
CUDA_DEVICE_PREFIX = "/device:CUDA:"
GPU_PLANE_PREFIX = "/device:GPU:"
STREAM_LINE_PREFIX = "Stream #"  # a stream's line, as tsl's CUPTI collector names it
STEP_LINE_ID = 0xDEADBEEF - (1 << 32)  # tsl's kThreadIdStepInfo: a device plane's step markers
STEP_LINE = "Steps"  # tsl's kStepLineName
CORRELATION_ID = "correlation_id"
TF_OP = "tf_op"  # a device event's framework op (xprof attributes the kernel's time to it)
KERNEL_DETAILS = "kernel_details"  # "regs:N static_shared:N dynamic_shared:N grid:x,y,z block:x,y,z occ_pct:P"
MEMCPY_DETAILS = "memcpy_details"  # "num_bytes:N"
# a GPU plane's own stats (tsl's device capabilities), from kineto's deviceProperties
_DEVICE_CAPS = (("gpu_device_name", "name"), ("core_count", "numSms"), ("memory_size", "totalGlobalMem"),
                ("compute_cap_major", "computeMajor"), ("compute_cap_minor", "computeMinor"))

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


# Writing: protobuf's wire format by hand (`hookprof._runtime.wire`). Building one protobuf message per event
# and stat cost ~25 us an event (0.5-0.7 s for a 20k-op step, the largest part of a traced step's render);
# what nodes alike share (their stats) is encoded once here and each event adds three varints.
_XSTAT_ID, _XSTAT_DOUBLE, _XSTAT_UINT64, _XSTAT_INT64, _XSTAT_REF = (tag(n, t) for n, t in (
    (1, VARINT), (2, FIXED64), (3, VARINT), (4, VARINT), (7, VARINT)))
_EVENT_ID, _EVENT_OFFSET, _EVENT_DURATION = tag(1, VARINT), tag(2, VARINT), tag(3, VARINT)
_EVENT_STAT = tag(4, LENGTH_DELIMITED)  # XEvent.stats
_LINE_ID, _LINE_NAME, _LINE_EVENT, _LINE_DISPLAY_ID = (tag(n, t) for n, t in (
    (1, VARINT), (2, LENGTH_DELIMITED), (4, LENGTH_DELIMITED), (10, VARINT)))
_PLANE_ID, _PLANE_NAME, _PLANE_LINE, _PLANE_EVENT_METADATA, _PLANE_STAT_METADATA, _PLANE_STAT = (tag(n, t) for n, t in (
    (1, VARINT), (2, LENGTH_DELIMITED), (3, LENGTH_DELIMITED), (4, LENGTH_DELIMITED), (5, LENGTH_DELIMITED),
    (6, LENGTH_DELIMITED)))
_SPACE_PLANE, _SPACE_HOSTNAME = tag(1, LENGTH_DELIMITED), tag(4, LENGTH_DELIMITED)
# a map entry's key (1) and value (2); the metadata's own id (1) and name (2)
_KEY, _VALUE, _ID, _NAME = tag(1, VARINT), tag(2, LENGTH_DELIMITED), tag(1, VARINT), tag(2, LENGTH_DELIMITED)
_DISPLAY_NAME = tag(4, LENGTH_DELIMITED)  # XEventMetadata.display_name


class _Plane:
    """One XPlane being encoded: interned event and stat metadata, and XStats made from Python values (each
    the bytes of an `XEvent.stats` field)."""

    def __init__(self, plane_id: int, name: str) -> None:
        self.head = int_field(_PLANE_ID, plane_id) + delimited(_PLANE_NAME, name.encode())
        self.lines: list[bytes] = []
        self.stats: list[bytes] = []
        self._events: dict[str, int] = {}
        self.display_names: dict[int, str] = {}  # an event metadata's display name, where it has one
        self._stats: dict[str, int] = {}
        self._encoded: dict[tuple[str, Any, type], bytes] = {}
        self.fixed = (0, 0)  # the event and stat metadata interned before `fix()`
        self.touched = False  # whether any was looked up again after it
        self._taken: tuple[tuple[dict[str, int], bytes], tuple[dict[str, int], bytes]] | None = None  # (`intern`)
        self.kept_metadata: tuple[bytes, ...] = ()  # (`encode`)

    def event_id(self, name: str) -> int:
        return self._interned(self._events, 0, name)

    def stat_id(self, name: str) -> int:
        return self._interned(self._stats, 1, name)

    def _interned(self, ids: dict[str, int], kind: int, name: str) -> int:
        """The id of metadata `name` in `ids` (the next id on first use); `kind`: its place in `fixed`."""
        found = ids.get(name)
        if found is None:
            found = ids[name] = len(ids) + 1
        elif found <= self.fixed[kind]:
            self.touched = True
        return found

    def fix(self) -> None:
        """Mark the metadata interned so far (a step's own: its number, its marker's name): what is interned
        after it, and whether that looked any of these up (`touched`), is what a next step of the same shape
        may take (`_ShapedHost`)."""
        self.fixed, self.touched = (len(self._events), len(self._stats)), False

    def interned_since_fixed(self) -> tuple[dict[str, int], dict[str, int]]:
        """The event and stat metadata interned after `fix()`, by name."""
        return (dict(itertools.islice(self._events.items(), self.fixed[0], None)),
                dict(itertools.islice(self._stats.items(), self.fixed[1], None)))

    def intern(self, events: dict[str, int], stats: dict[str, int], encoded: tuple[bytes, bytes]) -> None:
        """Take metadata interned after `fix()` in another plane whose `fix()` came at the same counts, and their
        entries as it encoded them (its `kept_metadata`)."""
        self._events.update(events)
        self._stats.update(stats)
        self._taken = ((events, encoded[0]), (stats, encoded[1]))

    def stat(self, name: str, value: Any) -> bytes:
        """An XStat of `name` as an `XEvent.stats` field (`xstat`), kept by its name and value."""
        key = (name, value, type(value))
        found = self._encoded.get(key)
        if found is None:  # a step repeats few: a scope, a phase, an op type, a shape over many events
            found = self._encoded[key] = delimited(_EVENT_STAT, self.xstat(name, value))
        return found

    def own_stat(self, name: str, value: int) -> bytes:
        """`stat` of an int that few events share (an op's own id): not kept."""
        return delimited(_EVENT_STAT, self.xstat(name, value))

    def add_stat(self, name: str, value: Any, unsigned: bool = False) -> None:
        """A stat of the plane itself (`XPlane.stats`)."""
        self.stats.append(delimited(_PLANE_STAT, self.xstat(name, value, unsigned)))

    def xstat(self, name: str, value: Any, unsigned: bool = False) -> bytes:
        """An XStat of `name`: ints as int64 (`unsigned`: uint64), floats as double, strings by reference (each
        distinct string is stored once, as a stat metadata's name: how tsl interns them). The value is a
        `oneof`: zeros written."""
        head = _XSTAT_ID + varint(self.stat_id(name))
        if type(value) is not int:  # (ints the most: an op's own id, a step, bytes)
            if isinstance(value, str):
                return head + _XSTAT_REF + varint(self.stat_id(value))
            if isinstance(value, float):
                return head + _XSTAT_DOUBLE + struct.pack("<d", value)
            value = int(value)
        return head + (_XSTAT_UINT64 if unsigned else _XSTAT_INT64) + varint(value)

    def add_line(self, line_id: int, name: str, events: list[bytes]) -> None:
        """A line (`timestamp_ns` 0) of encoded events, each an `XLine.events` field already."""
        self.lines.append(delimited(_PLANE_LINE, int_field(_LINE_ID, line_id) + delimited(_LINE_NAME, name.encode())
                                    + b"".join(events) + int_field(_LINE_DISPLAY_ID, line_id)))

    def encode(self, since_fixed: tuple[int, int] | None = None) -> bytes:
        """The plane's bytes: its lines, its metadata maps (entries of key 1, value 2), its own stats.
        `since_fixed`: how many event and stat metadata interned after `fix()` to keep encoded (`kept_metadata`,
        for a next step that `intern`s them); metadata interned so from another plane is written as it encoded
        it."""
        metadata = []
        kept = []
        maps = ((_PLANE_EVENT_METADATA, self._events), (_PLANE_STAT_METADATA, self._stats))
        for kind, (field, ids) in enumerate(maps):
            shown = self.display_names if kind == 0 else {}
            items = iter(ids.items())
            taken = self._taken[kind] if self._taken is not None else None
            count = len(taken[0]) if taken is not None else since_fixed[kind] if since_fixed is not None else None
            if count is not None:
                metadata.append(_metadata(field, itertools.islice(items, self.fixed[kind]), shown))
                middle = itertools.islice(items, count)
                if taken is not None:
                    collections.deque(middle, maxlen=0)  # (skipped: encoded in `taken`)
                    kept.append(taken[1])
                else:
                    kept.append(_metadata(field, middle, shown))
                metadata.append(kept[-1])
            metadata.append(_metadata(field, items, shown))
        self.kept_metadata = tuple(kept)
        return self.head + b"".join(self.lines) + b"".join(metadata) + b"".join(self.stats)


def _metadata(field: bytes, items: Iterable[tuple[str, int]], shown: dict[int, str]) -> bytes:
    """Metadata map entries (`field`: the plane's event or stat metadata), of `items` (name, id)."""
    metadata = []
    for name, key in items:  # (a step has thousands: `delimited` and `int_field` inlined; ids > 0)
        encoded_key, encoded_name = varint(key), name.encode()
        body = _ID + encoded_key + _NAME + varint(len(encoded_name)) + encoded_name
        if key in shown:
            body += delimited(_DISPLAY_NAME, shown[key].encode())
        entry = _KEY + encoded_key + _VALUE + varint(len(body)) + body
        metadata.append(field + varint(len(entry)) + entry)
    return b"".join(metadata)


def _event(metadata_id: int, offset_ps: int, duration_ps: int, stats: bytes) -> bytes:
    """An `XEvent` as an `XLine.events` field (`offset_ps`, of the `data` oneof, written even when 0)."""
    return delimited(_LINE_EVENT, _event_head(metadata_id) + varint(offset_ps) + _duration(duration_ps) + stats)


def _event_head(metadata_id: int) -> bytes:
    """An event's fields up to its offset's value: its metadata id and the offset's tag."""
    return _EVENT_ID + varint(metadata_id) + _EVENT_OFFSET


def _duration(duration_ps: int) -> bytes:
    """An event's `duration_ps` field (left out when 0)."""
    return _EVENT_DURATION + varint(duration_ps) if duration_ps else b""


def step_xspace(stats: StepStats, hostname: str, shape: StepShape | None = None) -> bytes:
    """One traced step as a serialized `XSpace` for xprof (see the module's doc): the host device's threads,
    the step's phases and, where recorded, its allocations; each CUDA device that ran kernels, a GPU plane.
    With the step's `shape` (`hookprof.step_stats.StepShape`): a step of the last one's shape takes its host
    events' metadata and stats from it, and this one's are kept for the next."""
    with paused_gc():  # (its many small objects made the collector's full passes over the step's nodes cost 2x)
        return _step_xspace(stats, hostname, shape)


def _step_xspace(stats: StepStats, hostname: str, shape: StepShape | None = None) -> bytes:
    step = stats.step if stats.step is not None else 0
    host = next((dev for dev in stats.dev_stats if dev.device == HOST_PLANE), None)
    nodes = host.node_stats if host is not None else []
    spans = [n for n in nodes if n.category == fmt.CAT_SPAN]
    train = next((n for n in spans if n.op == fmt.TRAIN_STEP), None)
    # the wait before the step (those inside it, between an accumulation window's or a Keras call's batches,
    # start after it does)
    data_wait = None if train is None else min(
        (n for n in spans if n.op == fmt.DATA_WAIT and n.start_ns < train.start_ns),
        key=lambda n: n.start_ns, default=None)
    threads: dict[int, list[NodeExecStats]] = {}
    for node in nodes:
        threads.setdefault(node.thread_id, []).append(node)
    thread_names = host.thread_names if host is not None else {}
    step_thread = _step_thread(thread_names)
    lines = [(tid, *_line(threads[tid])) for tid in sorted(threads, key=lambda t: (t != step_thread, t))]
    devices = _cuda_kernels(stats)
    kernels = [k for _, streams in devices for stream in streams.values() for k in stream]
    samples = [s.ts_ns for s in stats.memory_samples]
    base = min([int(starts[0]) for _, _, starts, _ in lines] + samples + [k.start_ns for k in kernels], default=0)
    end = max([int((starts + durations).max()) for _, _, starts, durations in lines] + samples
              + [k.start_ns + k.duration_ns for k in kernels], default=base)
    # the step as xprof sees one: from the data wait's start (input time) to the step's end
    step_span = None
    if train is not None:
        step_span = (data_wait.start_ns if data_wait is not None else train.start_ns,
                     train.start_ns + train.duration_ns)
    marker = f"{fmt.PROFILER_STEP_PREFIX}{step}"

    plane = _Plane(1, HOST_PLANE)
    group = plane.stat(GROUP_ID, step)
    marker_event = None  # (the step thread's line comes first, the marker first in it)
    if step_thread in threads and step_span is not None:
        marker_event = _event(plane.event_id(marker), (step_span[0] - base) * 1000,
                              (step_span[1] - step_span[0]) * 1000,
                              group + plane.stat(STEP_NAME, marker) + plane.stat(STEP_NUM, step))
    plane.fix()
    kept = None if shape is None else shape.recall("xspace")
    if kept is not None and not kept.fits(plane, lines, threads):
        kept = None
    made = _ShapedHost(plane.fixed, []) if shape is not None and kept is None else None
    described: dict[tuple, tuple[bytes, bytes]] = {}  # what nodes alike have: their metadata and stats but group
    unscoped: dict[tuple, tuple[bytes, bytes]] = {}  # the same but their scope: the stats around it
    shapes_json: dict[int, bytes] = {}  # id(a node's input shapes) -> them as JSON (the nodes hold them)
    skip = len(group)
    for number, (tid, line_nodes, starts, durations) in enumerate(lines):
        if kept is not None:
            evented, heads, tails = kept.lines[number]
        else:  # (a step not of the last one's shape: its nodes' metadata and stats, looked up per node)
            evented = np.array([node.category != fmt.CAT_SPAN or node.op != fmt.TRAIN_STEP for node in line_nodes],
                               dtype=bool)  # (the marker holds the step's span)
            heads, tails = [], []
            for node in itertools.compress(line_nodes, evented):
                # nodes alike share their metadata and stats (the dtypes list is one per signature: kineto_trace)
                shapes = None
                if node.input_shapes:  # (kineto's steps share one list per signature: serialised once)
                    shapes = shapes_json.get(id(node.input_shapes))
                    if shapes is None:
                        shapes = shapes_json[id(node.input_shapes)] = orjson.dumps(node.input_shapes)
                signature = (node.category, node.op, node.scope, node.phase, shapes, id(node.input_dtypes))
                part = described.get(signature)
                if part is None:  # (the nodes, so their lists, live as long as this: ids are not reused)
                    key, node_stats = _node_stats(plane, node, group, shapes, unscoped)
                    part = described[signature] = (_event_head(key), node_stats[skip:])  # (it starts with group)
                heads.append(part[0])
                tails.append(part[1])
            if made is not None:
                made.lines.append((evented, heads, tails))
        # the events around their times, column by column: iterated by C, where a step has tens of thousands
        offsets = varints((starts[evented] - base) * 1000)  # (int64 picoseconds: 106 days)
        duration_fields = each_encoded(durations[evented] * 1000, functools.partial(int_fields, _EVENT_DURATION))
        events = delimited_each(_LINE_EVENT, joined(heads, offsets, duration_fields, itertools.repeat(group), tails))
        plane.add_line(tid, thread_names.get(tid, f"thread {tid}"),
                       [marker_event, events] if tid == step_thread and marker_event is not None else [events])
    if kept is not None:
        plane.intern(kept.events, kept.stats, kept.metadata)
    elif made is not None:
        made.in_order = all(line == threads[tid] for tid, line, _, _ in lines)
        made.touched = plane.touched
        made.events, made.stats = plane.interned_since_fixed()
    _add_memory(plane, stats, base, group)

    planes = [plane.encode((len(made.events), len(made.stats)) if made is not None else None)]
    if made is not None:
        made.metadata = plane.kept_metadata
        shape.keep("xspace", made)
    if devices:
        ops = {n.node_name: n for n in nodes if n.category == fmt.CAT_OP}
        properties = {p.get("id"): p for p in stats.metadata.get(fmt.DEVICE_PROPERTIES) or ()}
        planes += [_device_plane(ordinal, streams, ops, base, step, marker, step_span, properties.get(ordinal))
                   for ordinal, streams in devices]

    task = _Plane(2, TASK_PLANE)
    for name, value in ((PROFILE_START_TIME, base), (PROFILE_STOP_TIME, end)):
        task.add_stat(name, value, unsigned=True)
    planes.append(task.encode())
    return b"".join(delimited(_SPACE_PLANE, p) for p in planes) + delimited(_SPACE_HOSTNAME, hostname.encode())


@dataclasses.dataclass
class _ShapedHost:
    """What the host plane of a step's XSpace took from its shape: per line, whether each node (in line order) is
    an event (all but the step's span, which the marker holds), and each event's metadata field and its stats
    but the step's `group_id` (`heads`, `tails`: the columns its times are joined between);
    the metadata its nodes interned, after the step's own (`fixed`: their counts), and its map entries, encoded
    (the metadata interned after them, of allocations, is the step's own); whether its nodes looked
    any of the step's own up (`touched`); whether each line's nodes were in the step's order."""

    fixed: tuple[int, int]
    lines: list[tuple[np.ndarray, list[bytes], list[bytes]]]  # (evented, heads, tails)
    events: dict[str, int] = dataclasses.field(default_factory=dict)
    stats: dict[str, int] = dataclasses.field(default_factory=dict)
    metadata: tuple[bytes, ...] = ()  # their entries, encoded (events', stats')
    touched: bool = False
    in_order: bool = False

    def fits(self, plane: _Plane, lines: list[tuple[int, list[NodeExecStats], np.ndarray, np.ndarray]],
             threads: dict[int, list[NodeExecStats]]) -> bool:
        """Whether a step of the same shape whose plane interned its own metadata (`fix()`ed) and whose lines
        are `lines` encodes its nodes as this one did: its lines' nodes in its order too (so in the same order
        as this one's), its own metadata as many, none of them interned by this one's nodes (a node's name
        equal to the new step's marker), and none of this one's looked up by its nodes."""
        return (self.in_order and not self.touched and plane.fixed == self.fixed
                and all(line == threads[tid] for tid, line, _, _ in lines)
                and not any(name in self.events for name in plane._events)
                and not any(name in self.stats for name in plane._stats))


def _line(nodes: list[NodeExecStats]) -> tuple[list[NodeExecStats], np.ndarray, np.ndarray]:
    """A thread's nodes in time order (of two that start together, the longer first: the outer one), and their
    starts and durations (ns), sorted by numpy (a step has tens of thousands)."""
    starts, durations = node_times(nodes)
    later, same = starts[1:] > starts[:-1], starts[1:] == starts[:-1]
    if np.all(later | same & (durations[1:] <= durations[:-1])):  # (as they mostly come: their own order)
        return nodes, starts, durations
    order = np.lexsort((-durations, starts))  # (a stable sort, as `sorted`)
    return list(map(nodes.__getitem__, order.tolist())), starts[order], durations[order]


def _step_thread(thread_names: dict[int, str]) -> int | None:
    return next((tid for tid, name in thread_names.items() if name == fmt.STEP_PHASES_THREAD), None)


def _node_stats(plane: _Plane, node: NodeExecStats, group: bytes, shapes: bytes | None,
                unscoped: dict[tuple, tuple[bytes, bytes]]) -> tuple[int, bytes]:
    """A node's event metadata (ops: by scope and op) and its event's stats: its step, what makes xprof count
    an op (read from the event itself, not its metadata), and what the timeline's args say of it (the trace
    viewer shows them). The stats before and after its scope are those of every node alike but for the scope,
    made once (`unscoped`); stats are interned in the order they are written either way."""
    if node.category == fmt.CAT_OP:
        key = plane.event_id(_op_name(node))
        head = group + plane.own_stat(IPL_STAGE_ID, key)
    else:
        key = plane.event_id(node.op)
        head = group
    signature = (node.category, node.op, node.phase, shapes, id(node.input_dtypes))
    around = unscoped.get(signature)
    if around is None:
        before = []
        if node.category == fmt.CAT_OP:
            before += [plane.stat(IPL_STAGE_CAT, node.op), plane.stat(IS_EAGER, 1)]
        if node.category == fmt.CAT_SPAN and node.op == fmt.DATA_WAIT:
            before.append(plane.stat(IPL_STAGE_NAME, fmt.DATA_WAIT))
        if node.phase:
            before.append(plane.stat(fmt.ARG_PHASE, node.phase))
        scope = plane.stat(fmt.ARG_SCOPE, node.scope) if node.scope else b""
        after = []
        if shapes is not None:
            after.append(plane.stat(fmt.ARG_INPUT_SHAPES, shapes.decode()))
            if node.input_dtypes:
                after.append(plane.stat(fmt.ARG_INPUT_DTYPES, orjson.dumps(node.input_dtypes).decode()))
        around = unscoped[signature] = (b"".join(before), b"".join(after))
    else:
        scope = plane.stat(fmt.ARG_SCOPE, node.scope) if node.scope else b""
    return key, head + around[0] + scope + around[1]


def _op_name(op: NodeExecStats) -> str:
    """An op's name in the XSpace: its module scope, then torch's op (`encoder/fc1/aten::addmm`)."""
    return f"{op.scope}/{op.op}" if op.scope else op.op


def _cuda_kernels(stats: StepStats) -> list[tuple[int, dict[int, list[NodeExecStats]]]]:
    """The step's kernels, memcpys and memsets by CUDA device (its ordinal) and stream, in start order."""
    devices = []
    for dev in stats.dev_stats:
        if not dev.device.startswith(CUDA_DEVICE_PREFIX):
            continue
        streams: dict[int, list[NodeExecStats]] = {}
        for node in dev.node_stats:
            if node.category == fmt.CAT_KERNEL:
                streams.setdefault(node.thread_id, []).append(node)
        if streams:
            for kernels in streams.values():
                kernels.sort(key=lambda k: k.start_ns)
            devices.append((int(dev.device[len(CUDA_DEVICE_PREFIX):]), streams))
    return sorted(devices, key=lambda device: device[0])


def _device_plane(ordinal: int, streams: dict[int, list[NodeExecStats]], ops: dict[str, NodeExecStats], base: int,
                  step: int, marker: str, step_span: tuple[int, int] | None, properties: dict | None) -> bytes:
    """A CUDA device's kernels as tsl's GPU plane: a line per stream, each kernel with its step (`group_id`),
    its `correlation_id`, its launching op (`tf_op`: xprof's framework op stats, op profile and kernel stats
    attribute the kernel's time to it) and its launch configuration (`kernel_details`); and a "Steps" line
    with the step's span, which xprof takes as the step on a GPU (it splits it by the device's events alone).
    The plane's stats are the GPU's model and capabilities where kineto exported them (`properties`)."""
    plane = _Plane(3 + ordinal, f"{GPU_PLANE_PREFIX}{ordinal}")  # (ids: the host's 1, the task's 2)
    for stat, key in _DEVICE_CAPS:
        if properties and properties.get(key) is not None:
            plane.add_stat(stat, properties[key])
    if properties and str(properties.get("name", "")).upper().startswith("NVIDIA"):
        plane.add_stat("device_vendor", "Nvidia")  # (tsl's vendor name; ROCm's torch names its GPUs CUDA too)
    group, eager = plane.stat(GROUP_ID, step), plane.stat(IS_EAGER, 1)
    for stream in sorted(streams):
        events = []
        for kernel in streams[stream]:
            args = kernel.args or {}
            stats = [group, plane.stat(CORRELATION_ID, args.get(fmt.ARG_CORRELATION, 0))]
            op = ops.get(args.get(fmt.ARG_LAUNCHED_BY))
            if op is not None:
                stats += [plane.stat(TF_OP, _op_name(op)), eager]
            details = _kernel_details(args)
            if details:
                stats.append(plane.stat(KERNEL_DETAILS, details))
            name = kernel.op
            if args.get(fmt.ARG_KERNEL_KIND) == "gpu_memcpy":
                if fmt.ARG_BYTES in args:
                    stats.append(plane.stat(MEMCPY_DETAILS, f"num_bytes:{args[fmt.ARG_BYTES]}"))
                # xprof tells a copy's direction by its name (`MemcpyHToD...`); the trace viewer shows kineto's
                name = name.replace("Memcpy ", "Memcpy", 1)
                plane.display_names[plane.event_id(name)] = kernel.op
            events.append(_event(plane.event_id(name), (kernel.start_ns - base) * 1000, kernel.duration_ns * 1000,
                                 b"".join(stats)))
        plane.add_line(stream, f"{STREAM_LINE_PREFIX}{stream}", events)
    kernels = [k for stream in streams.values() for k in stream]
    # the host's step (from its data wait), to its last kernel's end if that is later
    first = min([k.start_ns for k in kernels] + ([step_span[0]] if step_span else []))
    last = max([k.start_ns + k.duration_ns for k in kernels] + ([step_span[1]] if step_span else []))
    step_stats = group + plane.stat(STEP_NAME, marker) + plane.stat(STEP_NUM, step)
    plane.add_line(STEP_LINE_ID, STEP_LINE,
                   [_event(plane.event_id(marker), (first - base) * 1000, (last - first) * 1000, step_stats)])
    return plane.encode()


def _kernel_details(args: dict) -> str | None:
    """A kernel's launch configuration as xprof's kernel stats parse it; None for a memcpy or memset. kineto
    exports the shared memory as one figure (static and dynamic): written as static."""
    grid, block = args.get(fmt.ARG_GRID), args.get(fmt.ARG_BLOCK)
    if not grid or not block:
        return None
    return (f"regs:{args.get(fmt.ARG_REGISTERS, 0)} static_shared:{args.get(fmt.ARG_SHARED_MEMORY, 0)} "
            f"dynamic_shared:0 grid:{','.join(map(str, grid))} block:{','.join(map(str, block))} "
            f"occ_pct:{args.get(fmt.ARG_OCCUPANCY, 0)}")


def _add_memory(plane: _Plane, stats: StepStats, base: int, group: bytes) -> None:
    """The allocator's samples as TF's memory events, each allocation or free with the tensor it concerns."""
    if not stats.memory_samples:
        return
    made = {(a.device, a.alloc_ns): a for a in stats.allocations}
    freed = {(a.device, a.free_ns): a for a in stats.allocations if a.free_ns is not None}
    events = []
    last: dict[str, int] = {}
    peaks: dict[str, int] = {}
    kinds = plane.event_id(MEMORY_ALLOCATION), plane.event_id(MEMORY_DEALLOCATION)
    for sample in sorted(stats.memory_samples, key=lambda s: s.ts_ns):
        device = sample.device
        allocation = made.get((device, sample.ts_ns))
        released = None if allocation is not None else freed.get((device, sample.ts_ns))
        growing = sample.total_allocated >= last.get(device, 0)
        is_allocation = allocation is not None or (released is None and growing)
        last[device] = sample.total_allocated
        peaks[device] = max(peaks.get(device, 0), sample.total_allocated)
        events.append(_event(kinds[0] if is_allocation else kinds[1], (sample.ts_ns - base) * 1000, 0,
                             _memory_stats(plane, sample, allocation or released, peaks[device], group)))
    plane.add_line(MEMORY_LINE_ID, MEMORY_LINE, events)


def _memory_stats(plane: _Plane, sample: AllocatorSample, tensor: TensorAllocation | None, peak: int,
                  group: bytes) -> bytes:
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
    return b"".join(stats)
