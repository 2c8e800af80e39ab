"""The profiler's `XSpace` and XLA's `HloProto`, read with protobuf: what JAX's (and TF's) profiler hands back.

`jax.profiler` records into tsl's `XSpace` (`tsl/profiler/protobuf/xplane.proto`): planes (`/host:CPU`,
`/device:GPU:0`, `/host:metadata`) of lines (threads, streams) of events, each event naming its metadata
and carrying stats (`hlo_op`, `hlo_module`, `program_id`, ...). With `enable_hlo_proto` the metadata plane
also holds each compiled program's `HloProto` (`xla/service/hlo.proto`): its instructions, their shapes,
operands and `OpMetadata` (the JAX name stack, `jit(train_step)/jvp(dense)/dot_general`, and a stack frame).
Neither proto ships with jax, so the fields this project reads are declared here, with their upstream
numbers, and parsed by protobuf's C parser; every other field is skipped as unknown.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import Any

METADATA_PLANE = "/host:metadata"  # the plane of the programs' HLO protos
TASK_PLANE = "Task Environment"  # the plane whose `profile_start_time` stat the event times count from
HLO_PROTO_STAT = "Hlo Proto"
PROGRAM_ID_STAT = "program_id"
_PROGRAM_SUFFIX = re.compile(r"\((\d+)\)$")  # a program's metadata event name: `jit_train_step(14)`

# (message, [(field, number, type, repeated, message type)]), in the upstream protos' numbering
_I64, _U64, _I32, _F64, _STR, _BYTES, _MSG = "int64", "uint64", "int32", "double", "string", "bytes", "message"
_BOOL = "bool"
_SCHEMA: list[tuple[str, list[tuple[str, int, str, bool, str | None]]]] = [
    # tsl/profiler/protobuf/xplane.proto
    ("XStat", [("metadata_id", 1, _I64, False, None), ("double_value", 2, _F64, False, None),
               ("uint64_value", 3, _U64, False, None), ("int64_value", 4, _I64, False, None),
               ("str_value", 5, _STR, False, None), ("bytes_value", 6, _BYTES, False, None),
               ("ref_value", 7, _U64, False, None)]),
    ("XEvent", [("metadata_id", 1, _I64, False, None), ("offset_ps", 2, _I64, False, None),
                ("duration_ps", 3, _I64, False, None), ("stats", 4, _MSG, True, "XStat")]),
    ("XLine", [("id", 1, _I64, False, None), ("name", 2, _STR, False, None), ("timestamp_ns", 3, _I64, False, None),
               ("events", 4, _MSG, True, "XEvent"), ("display_name", 11, _STR, False, None)]),
    ("XEventMetadata", [("id", 1, _I64, False, None), ("name", 2, _STR, False, None),
                        ("stats", 5, _MSG, True, "XStat")]),
    ("XStatMetadata", [("id", 1, _I64, False, None), ("name", 2, _STR, False, None)]),
    # a proto map<int64, M> is, on the wire, a repeated message of (key = 1, value = 2)
    ("XEventMetadataEntry", [("key", 1, _I64, False, None), ("value", 2, _MSG, False, "XEventMetadata")]),
    ("XStatMetadataEntry", [("key", 1, _I64, False, None), ("value", 2, _MSG, False, "XStatMetadata")]),
    ("XPlane", [("id", 1, _I64, False, None), ("name", 2, _STR, False, None), ("lines", 3, _MSG, True, "XLine"),
                ("event_metadata", 4, _MSG, True, "XEventMetadataEntry"),
                ("stat_metadata", 5, _MSG, True, "XStatMetadataEntry"), ("stats", 6, _MSG, True, "XStat")]),
    ("XSpace", [("planes", 1, _MSG, True, "XPlane"), ("errors", 2, _STR, True, None)]),
    # xla/xla_data.proto
    ("ShapeProto", [("element_type", 2, _I32, False, None), ("dimensions", 3, _I64, True, None),
                    ("tuple_shapes", 4, _MSG, True, "ShapeProto")]),
    ("OpMetadata", [("op_type", 1, _STR, False, None), ("op_name", 2, _STR, False, None),
                    ("source_file", 3, _STR, False, None), ("source_line", 4, _I32, False, None),
                    ("stack_frame_id", 15, _I32, False, None)]),
    # xla/service/hlo.proto
    ("HloInstructionProto", [("name", 1, _STR, False, None), ("opcode", 2, _STR, False, None),
                             ("shape", 3, _MSG, False, "ShapeProto"), ("metadata", 7, _MSG, False, "OpMetadata"),
                             ("id", 35, _I64, False, None), ("operand_ids", 36, _I64, True, None)]),
    ("HloComputationProto", [("name", 1, _STR, False, None), ("instructions", 2, _MSG, True, "HloInstructionProto"),
                             ("id", 5, _I64, False, None), ("is_fusion_computation", 7, _BOOL, False, None)]),
    ("FileLocation", [("file_name_id", 1, _I32, False, None), ("function_name_id", 2, _I32, False, None),
                      ("line", 3, _I32, False, None)]),
    ("StackFrame", [("file_location_id", 1, _I32, False, None), ("parent_frame_id", 2, _I32, False, None)]),
    ("StackFrameIndexProto", [("file_names", 1, _STR, True, None), ("function_names", 2, _STR, True, None),
                              ("file_locations", 3, _MSG, True, "FileLocation"),
                              ("stack_frames", 4, _MSG, True, "StackFrame")]),
    ("HloModuleProto", [("name", 1, _STR, False, None), ("computations", 3, _MSG, True, "HloComputationProto"),
                        ("entry_computation_id", 6, _I64, False, None),
                        ("stack_frame_index", 17, _MSG, False, "StackFrameIndexProto")]),
    ("HloProto", [("hlo_module", 1, _MSG, False, "HloModuleProto")]),
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
        for fname, number, ftype, repeated, type_name in fields:
            entry = message.field.add(name=fname, number=number, type=types[ftype],
                                      label=field.LABEL_REPEATED if repeated else field.LABEL_OPTIONAL)
            if type_name:
                entry.type_name = f".{_PACKAGE}.{type_name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.{name}"))
            for name in ("XSpace", "HloProto")}


_CLASSES: dict[str, Any] = {}


def _message(name: str) -> Any:
    if not _CLASSES:
        _CLASSES.update(_message_classes())
    return _CLASSES[name]


def parse_xspace(data: bytes) -> Any:
    """A serialized `XSpace` (what `ProfilerSession.stop()` returns) as a message."""
    return _message("XSpace").FromString(data)


def parse_hlo_module(data: bytes) -> Any:
    """The `HloModuleProto` of a serialized `HloProto` (the metadata plane's "Hlo Proto" stat)."""
    return _message("HloProto").FromString(data).hlo_module


def stat_value(stat: Any, stat_names: dict[int, str]) -> Any:
    """An `XStat`'s value: a reference resolves to the name it refers to (how the profiler interns strings).
    Upstream the values are a oneof; declared here as plain fields, an unset one reads as empty or zero."""
    if stat.ref_value:
        return stat_names.get(stat.ref_value, "")
    if stat.str_value:
        return stat.str_value
    if stat.bytes_value:
        return stat.bytes_value
    if stat.double_value:
        return stat.double_value
    return stat.int64_value or stat.uint64_value


def plane_stats(plane: Any) -> dict[str, Any]:
    """A plane's own stats by name."""
    names = {entry.key: entry.value.name for entry in plane.stat_metadata}
    return {names.get(stat.metadata_id, ""): stat_value(stat, names) for stat in plane.stats}


def profile_start_ns(space: Any) -> int:
    """When the session started (ns since the epoch): event times are relative to it; 0 if not recorded."""
    for plane in space.planes:
        if plane.name == TASK_PLANE:
            return int(plane_stats(plane).get("profile_start_time", 0) or 0)
    return 0


def hlo_protos(space: Any) -> dict[int, bytes]:
    """The serialized `HloProto` of each program in the metadata plane, by program id: its `program_id` stat,
    else the id its name ends with (`jit_train_step(14)`: older jaxlibs have no such stat)."""
    found: dict[int, bytes] = {}
    for plane in space.planes:
        if plane.name != METADATA_PLANE:
            continue
        names = {entry.key: entry.value.name for entry in plane.stat_metadata}
        for entry in plane.event_metadata:
            stats = {names.get(s.metadata_id, ""): s for s in entry.value.stats}
            proto, program = stats.get(HLO_PROTO_STAT), stats.get(PROGRAM_ID_STAT)
            if proto is None:
                continue
            if program is not None:
                found[int(program.int64_value or program.uint64_value)] = proto.bytes_value
            elif (suffix := _PROGRAM_SUFFIX.search(entry.value.name)) is not None:
                found[int(suffix[1])] = proto.bytes_value
    return found


@dataclasses.dataclass(slots=True)
class XEventRow:
    """One event of a plane's line, with absolute times and its stats by name."""

    plane: str
    line: int  # the line's index in its plane
    name: str
    start_ns: int
    duration_ns: int
    stats: dict[str, Any]


def events(space: Any, stat_filter: frozenset[str] | None = None) -> Iterator[XEventRow]:
    """Every event of every plane but the metadata ones, in line order; `stat_filter` keeps only those stats
    (reading stats costs: a step holds thousands of events)."""
    start = profile_start_ns(space)
    for plane in space.planes:
        if plane.name in (METADATA_PLANE, TASK_PLANE):
            continue
        event_names = {entry.key: entry.value.name for entry in plane.event_metadata}
        stat_names = {entry.key: entry.value.name for entry in plane.stat_metadata}
        wanted = stat_names if stat_filter is None else {k: v for k, v in stat_names.items() if v in stat_filter}
        for index, line in enumerate(plane.lines):
            # a session's lines are normalised to its start; a raw (unnormalised) line is in epoch ns already
            base = line.timestamp_ns + (start if line.timestamp_ns < start else 0)
            for event in line.events:
                stats = {}
                for stat in event.stats:
                    name = wanted.get(stat.metadata_id)
                    if name is not None:
                        stats[name] = stat_value(stat, stat_names)
                yield XEventRow(plane.name, index, event_names.get(event.metadata_id, ""),
                                base + event.offset_ps // 1000, event.duration_ps // 1000, stats)


def line_names(space: Any) -> dict[tuple[str, int], str]:
    """(plane name, line index) -> the line's display name (a thread's or a stream's)."""
    return {(plane.name, index): line.display_name or line.name
            for plane in space.planes for index, line in enumerate(plane.lines)}
