"""hookprof's profile file format, version 1: plain data, never code.

Layout: the 16-byte magic `HOOKPROF-PROFILE`, a little-endian uint32 format version (1), a little-endian uint64
length of the uncompressed payload, then the payload compressed with zlib. The payload is UTF-8 JSON:

    {"format": "hookprof.profile", "version": 1,
     "nodes": [{"name", "op", "scope", "device", "phase", "op_types", "input_shapes", "input_dtypes",
                "inputs", "stack", "params", "memory_device", "steps": {"<step>" or "<step>@<rank>": [9 figures]}}],
     "steps": [{"step", "step_micros", "data_wait_micros", "busy_micros", "gaps", "rank",
                "accelerator_busy", "allocated", "collective_micros", "collective_waits", "collectives",
                "data_wait_shared"}]}

The 9 figures per step are: run count, micros, cpu micros, accelerator micros, requested bytes, peak bytes,
residual bytes, output bytes, float ops. A node's `memory_device` and a step's `allocated` (per device, the
bytes in use at its end) came after the first files of version 1, which load without them; so did a node's
steps of ranks other than 0 (`"<step>@<rank>"`; rank 0's are `"<step>"`, as before), a step's collectives and
its `data_wait_shared`.
Loading checks the magic, the version, the declared size against a limit before inflating anything (and
inflates no more than declared, a MiB at a time, refusing data that inflates faster than 200:1 as it goes),
and every field's type; no pickle, so a hostile file can at worst be refused.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

import orjson

from hookprof._runtime.inflate import InflateRefused, inflate
from hookprof.profiler.profile_data import N_FIGURES, NodeData, ProfileData, StepSummary

MAGIC = b"HOOKPROF-PROFILE"
VERSION = 1
DEFAULT_MAX_BYTES = 1 << 30  # 1 GiB of uncompressed profile
DEFAULT_MAX_RATIO = 200  # zlib'd JSON inflates ~10:1; a bomb of zeros ~1000:1 (judged past 16 MiB)
_HEADER = struct.Struct("<IQ")


def _inflate(data: memoryview, size: int, max_ratio: float) -> bytes:
    """At most `size` bytes of the zlib stream `data`, refused as soon as the output outgrows `max_ratio` times
    the input consumed (past the first 16 MiB): a declared size under the cap whose data is a bomb costs a few
    MiB, not the declared size, before it is refused."""
    offset = 0

    def read(n: int) -> memoryview:
        nonlocal offset
        chunk = data[offset:offset + n]
        offset += len(chunk)
        return chunk

    try:
        payload, ended = inflate(read, gzip=False, limit=size, max_ratio=max_ratio)
    except InflateRefused as err:
        if err.kind == "ratio":
            raise ProfileFormatError(f"the profile's data inflates over {max_ratio:g}:1 (a decompression bomb; "
                                     "serialize.loads(max_ratio=) reads it anyway).") from None
        raise ProfileFormatError("the profile is truncated or its size does not match its header.") from None
    except zlib.error as err:
        raise ProfileFormatError(f"the profile's data is corrupt ({err}).") from None
    if not ended:
        raise ProfileFormatError("the profile is truncated or its size does not match its header.")
    return payload


class ProfileFormatError(ValueError):
    """The bytes are not a hookprof profile this version can read."""


def dumps(data: ProfileData) -> bytes:
    doc = {
        "format": "hookprof.profile",
        "version": VERSION,
        "nodes": [{
            "name": n.name, "op": n.op, "scope": n.scope, "device": n.device, "phase": n.phase,
            "op_types": n.op_types, "input_shapes": n.input_shapes, "input_dtypes": n.input_dtypes,
            "inputs": n.inputs, "stack": n.stack, "params": n.params, "memory_device": n.memory_device,
            "steps": {_step_name(key): figures for key, figures in n.steps.items()},
        } for n in data.nodes.values()],
        "steps": [{
            "step": s.step, "step_micros": s.step_micros, "data_wait_micros": s.data_wait_micros,
            "busy_micros": s.busy_micros, "gaps": [list(g) for g in s.gaps], "rank": s.rank,
            "accelerator_busy": s.accelerator_busy, "allocated": s.allocated,
            "collective_micros": s.collective_micros, "collective_waits": s.collective_waits,
            "collectives": s.collectives, "data_wait_shared": s.data_wait_shared,
        } for s in data.steps.values()],
    }
    payload = orjson.dumps(doc)
    return MAGIC + _HEADER.pack(VERSION, len(payload)) + zlib.compress(payload, 6)


def loads(blob: bytes, max_bytes: int = DEFAULT_MAX_BYTES, max_ratio: float = DEFAULT_MAX_RATIO) -> ProfileData:
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TypeError(f"a serialized profile is bytes, got {type(blob).__name__}.")
    blob = bytes(blob)
    if not blob.startswith(MAGIC):
        raise ProfileFormatError("not a hookprof profile (it does not start with HOOKPROF-PROFILE); "
                                 "give a file written by Profiler.serialize_to_string().")
    if len(blob) < len(MAGIC) + _HEADER.size:
        raise ProfileFormatError("the profile is truncated (its header is incomplete).")
    version, size = _HEADER.unpack_from(blob, len(MAGIC))
    if version != VERSION:
        raise ProfileFormatError(f"profile format version {version}; this hookprof reads version {VERSION}.")
    if size > max_bytes:
        raise ProfileFormatError(f"the profile declares {size} bytes of data, over the limit of {max_bytes}; "
                                 "pass max_bytes= to read it anyway.")
    payload = _inflate(memoryview(blob)[len(MAGIC) + _HEADER.size:], size, max_ratio)
    if len(payload) != size:
        raise ProfileFormatError("the profile is truncated or its size does not match its header.")
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError as err:
        raise ProfileFormatError(f"the profile's data is not valid JSON ({err}).") from None
    return _from_doc(doc)


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise ProfileFormatError(f"malformed profile: {what}.")


def _str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _from_doc(doc: Any) -> ProfileData:
    _check(isinstance(doc, dict) and doc.get("format") == "hookprof.profile", "not a hookprof.profile document")
    _check(doc.get("version") == VERSION, "unknown document version")
    nodes, steps = doc.get("nodes"), doc.get("steps")
    _check(isinstance(nodes, list) and isinstance(steps, list), "'nodes' and 'steps' must be lists")
    data = ProfileData()
    for i, raw in enumerate(nodes):
        _check(isinstance(raw, dict), f"node {i} is not an object")
        for key in ("name", "op", "scope", "device", "phase"):
            _check(isinstance(raw.get(key), str), f"node {i}: {key!r} must be a string")
        for key in ("op_types", "input_dtypes", "inputs", "stack"):
            _check(_str_list(raw.get(key)), f"node {i}: {key!r} must be a list of strings")
        _check(isinstance(raw.get("input_shapes"), list), f"node {i}: 'input_shapes' must be a list")
        _check(isinstance(raw.get("params"), int) and raw["params"] >= 0, f"node {i}: 'params' must be an int >= 0")
        _check(isinstance(raw.get("memory_device", ""), str), f"node {i}: 'memory_device' must be a string")
        per_step = raw.get("steps")
        _check(isinstance(per_step, dict), f"node {i}: 'steps' must be an object")
        node = NodeData(raw["name"], raw["op"], raw["scope"], raw["device"], raw["phase"], raw["op_types"],
                        raw["input_shapes"], raw["input_dtypes"], raw["inputs"], raw["stack"], raw["params"],
                        memory_device=raw.get("memory_device", ""))
        for step, figures in per_step.items():
            key = _step_key(step)
            _check(key is not None, f"node {i}: step {step!r} is not a step number (N, or N@rank)")
            _check(isinstance(figures, list) and len(figures) == N_FIGURES and all(map(_number, figures)),
                   f"node {i}: step {step} must hold {N_FIGURES} numbers")
            _check(key not in node.steps, f"node {i}: step {step!r} is given twice (as N and as N@0, say)")
            node.add(key, figures)
        _check(node.name not in data.nodes, f"node {node.name!r} appears twice")
        data.nodes[node.name] = node
    for i, raw in enumerate(steps):
        _check(isinstance(raw, dict) and isinstance(raw.get("step"), int), f"step entry {i} needs an int 'step'")
        for key in ("step_micros", "data_wait_micros", "busy_micros"):
            _check(_number(raw.get(key)), f"step entry {i}: {key!r} must be a number")
        gaps = raw.get("gaps")
        _check(isinstance(gaps, list) and all(isinstance(g, list) and len(g) == 2 and all(map(_number, g))
                                              for g in gaps), f"step entry {i}: 'gaps' must be [start, length] pairs")
        busy = raw.get("accelerator_busy")
        _check(isinstance(busy, dict) and all(isinstance(k, str) and _number(v) for k, v in busy.items()),
               f"step entry {i}: 'accelerator_busy' must map devices to numbers")
        _check(isinstance(raw.get("rank"), int), f"step entry {i}: 'rank' must be an int")
        allocated = raw.get("allocated", {})
        _check(isinstance(allocated, dict) and all(isinstance(k, str) and _number(v) for k, v in allocated.items()),
               f"step entry {i}: 'allocated' must map devices to numbers")
        collectives = raw.get("collectives", [])
        _check(_number(raw.get("collective_micros", 0)) and isinstance(raw.get("collective_waits", 0), int)
               and _str_list(collectives), f"step entry {i}: 'collective_micros' must be a number, "
               "'collective_waits' an int, 'collectives' a list of names")
        _check(isinstance(raw.get("data_wait_shared", False), bool), f"step entry {i}: 'data_wait_shared' must be "
               "true or false")
        key = (raw["rank"], raw["step"])
        _check(key not in data.steps, f"step {raw['step']} of rank {raw['rank']} appears twice")
        data.steps[key] = StepSummary(raw["step"], raw["step_micros"], raw["data_wait_micros"], raw["busy_micros"],
                                      [tuple(g) for g in gaps], raw["rank"], busy,
                                      {k: float(v) for k, v in allocated.items()},
                                      float(raw.get("collective_micros", 0)), raw.get("collective_waits", 0),
                                      collectives, raw.get("data_wait_shared", False))
    return data


def _step_name(key: tuple[int, int]) -> str:
    """A node's step key in the file: `N` for rank 0 (what profiles before ranks were kept wrote), `N@rank`."""
    rank, step = key
    return str(step) if rank == 0 else f"{step}@{rank}"


def _step_key(name: str) -> tuple[int, int] | None:
    step, _, rank = name.partition("@")
    if not step.isdigit() or (rank and not rank.isdigit()) or (_ and not rank):
        return None
    return (int(rank or 0), int(step))
