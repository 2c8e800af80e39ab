"""The profiler's `XSpace` and XLA's `HloProto`, read with protobuf: what JAX's (and TF's) profiler hands back.

`jax.profiler` records into tsl's `XSpace` (`tsl/profiler/protobuf/xplane.proto`): planes (`/host:CPU`,
`/device:GPU:0`, `/host:metadata`) of lines (threads, streams) of events, each event naming its metadata
and carrying stats (`hlo_op`, `hlo_module`, `program_id`, ...). With `enable_hlo_proto` the metadata plane
also holds each compiled program's `HloProto` (`xla/service/hlo.proto`): its instructions, their shapes,
operands and `OpMetadata` (the JAX name stack, `jit(train_step)/jvp(dense)/dot_general`, and a stack frame).
Neither proto ships with jax: the fields this project reads are declared in `hookprof.trace.xplane` (which also
writes XSpaces for TensorBoard's Profile tab), with their upstream numbers, and parsed by protobuf's C parser;
every other field is kept as unknown.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import Any

from hookprof.trace.xplane import TASK_PLANE, message

METADATA_PLANE = "/host:metadata"  # the plane of the programs' HLO protos
HLO_PROTO_STAT = "Hlo Proto"
PROGRAM_ID_STAT = "program_id"
_PROGRAM_SUFFIX = re.compile(r"\((\d+)\)$")  # a program's metadata event name: `jit_train_step(14)`


def parse_xspace(data: bytes) -> Any:
    """A serialized `XSpace` (what `ProfilerSession.stop()` returns) as a message."""
    return message("XSpace").FromString(data)


def parse_hlo_module(data: bytes) -> Any:
    """The `HloModuleProto` of a serialized `HloProto` (the metadata plane's "Hlo Proto" stat)."""
    return message("HloProto").FromString(data).hlo_module


def stat_value(stat: Any, stat_names: dict[int, str]) -> Any:
    """An `XStat`'s value: a reference resolves to the name it refers to (how the profiler interns strings).
    (The values are a oneof: an unset one reads as empty or zero.)"""
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
