"""The code view as a pprof profile (`go tool pprof`, speedscope, Perfetto read it): gzipped `profile.proto`.

The message classes are built at run time from the public schema (github.com/google/pprof, proto/profile.proto:
Profile, ValueType, Sample, Location, Line, Function) with protobuf's descriptor API, so no generated code
and no new dependency (protobuf comes with tensorboard). Each op becomes a sample whose stack is its Python
call stack (innermost first, as pprof wants) with two values: time (microseconds) and requested bytes;
time is the default sample type (`default_sample_type`; without it pprof shows the last type, the bytes).

Frames are torch's `with_stack` strings, `path/file.py(123): function` (line: where the function starts, or
for a frame already running when tracing began, such as the script's `<module>`, its current line). Each
becomes a Function with its name, file and line. Only `name` is set, not `system_name`: pprof "demangles"
a function whose `system_name` equals its name, and takes a name with `<...>` or `::` for C++, dropping
its template arguments, so `<module>`, `<lambda>` and `<built-in method ...>` would come out empty and
show as `<unknown>`. (The tracer drops the object address CPython puts in a built-in method's name, so
the same call site is one function across steps and runs.) The one Mapping says the profile is symbolized
(has functions, files, lines): pprof then looks for no binary to symbolize it with.
"""

from __future__ import annotations

import functools
import gzip
from typing import Any

from hookprof.profiler.profile_data import BYTES, MICROS, ProfileData, parse_frame


@functools.lru_cache(maxsize=1)
def _classes() -> dict[str, Any]:
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="hookprof_pprof_profile.proto", package="perftools.profiles",
                                              syntax="proto3")

    def field(msg: Any, name: str, number: int, kind: int, repeated: bool, type_name: str | None) -> None:
        extra = {"type_name": type_name} if type_name else {}
        msg.field.add(name=name, number=number, type=kind,
                      label=F.LABEL_REPEATED if repeated else F.LABEL_OPTIONAL, **extra)

    def message(name: str, *fields: tuple) -> None:
        msg = file.message_type.add(name=name)
        for number, spec in enumerate(fields, start=1):
            field(msg, spec[0], number, *spec[1:])

    i64, u64, msg_t = F.TYPE_INT64, F.TYPE_UINT64, F.TYPE_MESSAGE
    message("ValueType", ("type", i64, False, None), ("unit", i64, False, None))
    message("Sample", ("location_id", u64, True, None), ("value", i64, True, None))
    message("Line", ("function_id", u64, False, None), ("line", i64, False, None))
    message("Location", ("id", u64, False, None), ("mapping_id", u64, False, None), ("address", u64, False, None),
            ("line", msg_t, True, ".perftools.profiles.Line"))
    message("Mapping", ("id", u64, False, None), ("memory_start", u64, False, None),
            ("memory_limit", u64, False, None), ("file_offset", u64, False, None), ("filename", i64, False, None),
            ("build_id", i64, False, None), ("has_functions", F.TYPE_BOOL, False, None),
            ("has_filenames", F.TYPE_BOOL, False, None), ("has_line_numbers", F.TYPE_BOOL, False, None),
            ("has_inline_frames", F.TYPE_BOOL, False, None))
    message("Function", ("id", u64, False, None), ("name", i64, False, None), ("system_name", i64, False, None),
            ("filename", i64, False, None), ("start_line", i64, False, None))
    profile = file.message_type.add(name="Profile")
    # field numbers of profile.proto: sample_type 1, sample 2, mapping 3, location 4, function 5,
    # string_table 6, default_sample_type 14
    for name, number, kind, repeated, type_name in (
            ("sample_type", 1, msg_t, True, ".perftools.profiles.ValueType"),
            ("sample", 2, msg_t, True, ".perftools.profiles.Sample"),
            ("mapping", 3, msg_t, True, ".perftools.profiles.Mapping"),
            ("location", 4, msg_t, True, ".perftools.profiles.Location"),
            ("function", 5, msg_t, True, ".perftools.profiles.Function"),
            ("string_table", 6, F.TYPE_STRING, True, None),
            ("default_sample_type", 14, i64, False, None)):
        field(profile, name, number, kind, repeated, type_name)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"perftools.profiles.{name}"))
            for name in ("Profile", "ValueType", "Sample", "Mapping", "Location", "Line", "Function")}


def build_profile(data: ProfileData, step: int, shown_ops: set[str] | None = None) -> Any:
    """A pprof `Profile` of the ops' Python stacks (optionally only the ops in `shown_ops`)."""
    classes = _classes()
    profile = classes["Profile"]()
    strings: dict[str, int] = {"": 0}

    def string(text: str) -> int:
        if text not in strings:
            strings[text] = len(strings)
        return strings[text]

    profile.sample_type.add(type=string("time"), unit=string("microseconds"))
    profile.sample_type.add(type=string("requested_bytes"), unit=string("bytes"))
    profile.default_sample_type = string("time")
    profile.mapping.add(id=1, has_functions=True, has_filenames=True, has_line_numbers=True)
    locations: dict[tuple[str, str, int], int] = {}
    for node in data.nodes.values():
        if not node.steps or not node.stack or (shown_ops is not None and node.name not in shown_ops):
            continue
        figures = node.figures(step)
        ids = []
        for frame in reversed(node.stack + [node.op]):  # innermost first: the op, then its callers
            key = parse_frame(frame)
            location = locations.get(key)
            if location is None:
                location = locations[key] = len(locations) + 1
                func, filename, line = key
                # no system_name: pprof would "demangle" it (see the module's docstring)
                profile.function.add(id=location, name=string(func), filename=string(filename), start_line=line)
                profile.location.add(id=location, mapping_id=1,
                                     line=[classes["Line"](function_id=location, line=line)])
            ids.append(location)
        profile.sample.add(location_id=ids, value=[int(round(figures[MICROS])), int(figures[BYTES])])
    profile.string_table.extend(sorted(strings, key=strings.get))
    return profile


def write_pprof(path: str, data: ProfileData, step: int, shown_ops: set[str] | None = None) -> None:
    from hookprof._runtime.atomic_file import atomic_write

    profile = build_profile(data, step, shown_ops)
    if not profile.sample:
        raise ValueError("pprof output: no op has a Python stack; trace with ProfilerHook(with_stack=True).")
    with atomic_write(path) as f:
        f.write(gzip.compress(profile.SerializeToString()))
