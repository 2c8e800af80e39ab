"""Read a timeline written by `ChromeTraceWriter` back into `StepStats`, for offline reports.

Ops, module spans, host spans, kernels and launches come back with their node names, scopes, phases and
arguments; dataflow arrows come back as edges (each arrow names its producer and consumer nodes); memory
objects come back as allocations with their producers and the allocator counter as samples.
"""

from __future__ import annotations

import contextlib
import math
import os
import zlib

import orjson

from hookprof._runtime.inflate import InflateRefused, inflate
from hookprof.step_stats import AllocatorSample, DataEdge, NodeExecStats, StepStats, TensorAllocation, TensorDescription
from hookprof.trace import format as fmt


class TimelineError(ValueError):
    """A file that cannot be read as a timeline: `str()` is one line, `"<path>: <problem>"`."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(path, problem)
        self.path, self.problem = path, problem

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"


_OS_PROBLEMS = ((FileNotFoundError, "no such file"), (IsADirectoryError, "is a directory"),
                (PermissionError, "permission denied"))
_JSON_KINDS = ((dict, "a JSON object"), (list, "a JSON list"), (str, "a JSON string"), (type(None), "JSON null"))


def os_problem(err: OSError) -> str:
    """What stops a file from being read, in a few words: `no such file`, `is a directory`, ..."""
    return next((text for kind, text in _OS_PROBLEMS if isinstance(err, kind)), f"cannot read ({err.strerror or err})")


def _json_kind(value: object) -> str:
    if isinstance(value, bool):
        return f"JSON {str(value).lower()}"
    return next((text for kind, text in _JSON_KINDS if isinstance(value, kind)), "a JSON number")


MAX_BYTES = 512 << 20  # the most a timeline may hold (uncompressed): hookprof's own are far smaller
MAX_RATIO = 200  # the most a .gz timeline may inflate per byte (JSON gzips ~10:1; a bomb ~1000:1), past 16 MiB
MAX_MICROS = 1e17  # a timestamp or duration beyond this (3,000 years in microseconds; epoch times are ~1.8e15)


class InputTooLarge(ValueError):
    """An input refused while reading it: larger than the cap, or inflating faster than MAX_RATIO."""


def read_bounded(f, path: str, max_bytes: int = MAX_BYTES) -> bytes:
    """All of an open binary file, refused (`InputTooLarge`, naming the size) past `max_bytes`: a huge or sparse
    file costs no memory before it is refused."""
    size = 0
    with contextlib.suppress(OSError, AttributeError, ValueError):  # (a stream without a file: read it)
        size = os.fstat(f.fileno()).st_size
    if size > max_bytes:
        raise InputTooLarge(f"{size} bytes, over the limit of {max_bytes}")
    data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise InputTooLarge(f"over {max_bytes} bytes, the limit")
    return data


def inflate_bounded(f, max_bytes: int = MAX_BYTES, max_ratio: float = MAX_RATIO) -> bytes:
    """The decompressed bytes of the gzip stream in the open file `f`, checked while inflating: at most
    `max_bytes`, and past the first 16 MiB at most `max_ratio` bytes out per byte in (a decompression bomb is
    refused after a few MiB of output, not after all of it). Raises `InputTooLarge`, `EOFError` (truncated),
    `zlib.error` (corrupt)."""
    try:
        data, ended = inflate(f.read, gzip=True, limit=max_bytes, max_ratio=max_ratio)
    except InflateRefused as err:
        raise InputTooLarge(str(err)) from None
    if not ended:
        raise EOFError
    return data


def load_trace(path: str) -> dict:
    """Parse a `.json` or `.json.gz` timeline: a JSON object whose `traceEvents` is a list of objects.

    Raises `TimelineError` (a ValueError whose message names the path and the problem) for a missing or
    unreadable file, a directory, a truncated or corrupt gzip file, bytes that are not JSON, JSON that is
    not a timeline, an event whose fields have the wrong types (`ts` not a finite number, a null name), and
    a file over `MAX_BYTES` or a gzip file inflating faster than `MAX_RATIO` (refused while reading it).
    """
    path = os.fspath(path)
    gzipped = path.endswith(".gz")
    try:
        with open(path, "rb") as f:
            data = inflate_bounded(f) if gzipped else read_bounded(f, path)
    except InputTooLarge as err:
        raise TimelineError(path, f"refused: {err}") from None
    except EOFError:
        raise TimelineError(path, "truncated gzip file") from None
    except zlib.error as err:
        problem = "not a gzip file (its name ends in .gz)" if "incorrect header check" in str(err) \
            else f"corrupt gzip file ({err})"
        raise TimelineError(path, problem) from None
    except OSError as err:
        raise TimelineError(path, os_problem(err)) from None
    try:
        trace = orjson.loads(data)
    except orjson.JSONDecodeError as err:
        raise TimelineError(path, "empty file" if not data.strip() else f"not JSON ({err})") from None
    del data
    if not isinstance(trace, dict):
        raise TimelineError(path, f"not a timeline ({_json_kind(trace)}, expected an object with traceEvents)")
    events = trace.get("traceEvents")
    if not isinstance(events, list):
        problem = "a JSON object without a traceEvents list" if events is None \
            else f"its traceEvents is {_json_kind(events)}, expected a list"
        raise TimelineError(path, f"not a timeline ({problem})")
    for i, event in enumerate(events):
        if not isinstance(event, dict):
            raise TimelineError(path, f"not a timeline (traceEvents[{i}] is {_json_kind(event)}, expected an object)")
        problem = _event_problem(event)
        if problem:
            raise TimelineError(path, f"malformed timeline (traceEvents[{i}]{_event_name(event)}: {problem})")
    return trace


def _event_name(event: object) -> str:
    name = event.get("name") if isinstance(event, dict) else None
    return f" {name[:60]!r}" if isinstance(name, str) else ""


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and abs(value) <= MAX_MICROS


def _event_problem(event: dict) -> str | None:
    """What is wrong with one trace event's fields, or None: the types every reader of timelines relies on."""
    for key in ("ts", "dur"):
        if key in event and not _finite(event[key]):
            return f"{key!r} is {_json_kind(event[key]) if not isinstance(event[key], float) else event[key]}, " \
                   f"expected a finite number of microseconds (at most {MAX_MICROS:g})"
    for key in ("name", "cat", "ph"):
        if key in event and not isinstance(event[key], str):
            return f"{key!r} is {_json_kind(event[key])}, expected a string"
    for key in ("pid", "tid", "id"):
        if key in event and (isinstance(event[key], bool) or not isinstance(event[key], (int, str))):
            return f"{key!r} is {_json_kind(event[key])}, expected an int or a string"
    if "args" in event:
        args = event["args"]
        if not isinstance(args, dict):
            return f"'args' is {_json_kind(args)}, expected an object"
        if event.get("ph") == "M" and "name" in args and not isinstance(args["name"], str):
            return f"'args.name' is {_json_kind(args['name'])}, expected a string"
        for key, value in args.items():
            if isinstance(value, float) and not math.isfinite(value):
                return f"'args.{key[:40]}' is {value}, expected a finite number"
    return None


def read_timeline(path: str) -> StepStats:
    """The StepStats of the timeline at `path` (`.json` or `.json.gz`)."""
    trace = load_trace(path)
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError(f"{path!r} is not a Chrome trace (no traceEvents list).")
    base = int(trace.get(fmt.BASE_TIME_NS, 0))
    metadata = trace.get(fmt.METADATA, {})
    stats = StepStats(step=metadata.get(fmt.STEP), metadata={k: v for k, v in metadata.items() if k != fmt.EVENTS})
    if fmt.DISTRIBUTED_INFO in trace and fmt.RANK in trace[fmt.DISTRIBUTED_INFO]:
        stats.metadata[fmt.RANK] = trace[fmt.DISTRIBUTED_INFO][fmt.RANK]
    compute: dict[int, str] = {}
    tensors: dict[int, str] = {}
    for event in trace["traceEvents"]:
        if event.get("ph") == "M" and event.get("name") == "process_name":
            process = fmt.process_device(str(event.get("args", {}).get("name", "")))
            if process is not None:
                device, suffix = process
                (compute if suffix == fmt.COMPUTE_SUFFIX else tensors)[event["pid"]] = device
        elif event.get("ph") == "M" and event.get("name") == "thread_name" and event.get("pid") in compute:
            stats.device(compute[event["pid"]]).thread_names[event["tid"]] = event["args"]["name"]

    def ns(us: float) -> int:
        return base + int(round(us * 1000))

    by_name: dict[str, NodeExecStats] = {}
    allocations: dict[int, TensorAllocation] = {}
    flows: dict[int, dict] = {}
    for event in trace["traceEvents"]:
        ph = event.get("ph")
        if ph == "X" and event.get("cat") in fmt.NODE_CATEGORIES and event.get("pid") in compute:
            args = dict(event.get("args", {}))
            node = NodeExecStats(
                node_name=args.pop(fmt.ARG_NAME, event["name"]), op=args.pop(fmt.ARG_OP, event["name"]),
                start_ns=ns(event["ts"]), duration_ns=int(round(event.get("dur", 0) * 1000)),
                thread_id=event.get("tid", 0), scope=args.pop(fmt.ARG_SCOPE, ""), phase=args.pop(fmt.ARG_PHASE, ""),
                input_shapes=args.pop(fmt.ARG_INPUT_SHAPES, None), input_dtypes=args.pop(fmt.ARG_INPUT_DTYPES, None),
                category=event["cat"])
            args.pop(fmt.ARG_INPUT_BYTES, None)
            outputs = args.pop(fmt.ARG_OUTPUTS, None)
            if outputs:
                node.outputs = [TensorDescription(o["dtype"], tuple(o["shape"]), o.get("bytes")) for o in outputs]
            node.args = args or None
            stats.device(compute[event["pid"]]).node_stats.append(node)
            by_name[node.node_name] = node
        elif ph in ("s", "t") and event.get("cat") == fmt.CAT_DATAFLOW and fmt.ARG_PRODUCER in event.get("args", {}):
            flows[event["id"]] = {**event["args"], "tensor": event.get("name")}
        elif ph == "C" and event.get("pid") in tensors:
            args = event.get("args", {})
            stats.memory_samples.append(AllocatorSample(tensors[event["pid"]], ns(event["ts"]),
                                                        int(args.get(fmt.ARG_ALLOCATED, 0)),
                                                        int(args.get(fmt.ARG_RESERVED, 0))))
        elif ph in ("N", "O", "D") and event.get("pid") in tensors:
            alloc = allocations.get(event["id"])
            if alloc is None:
                alloc = TensorAllocation(event["id"], tensors[event["pid"]], 0, ns(event["ts"]))
                allocations[event["id"]] = alloc
            if ph == "O":
                snapshot = event.get("args", {}).get("snapshot", {})
                alloc.nbytes = int(snapshot.get("bytes", 0))
                alloc.producer = snapshot.get(fmt.ARG_PRODUCER)  # a name for now; resolved below
                if "shape" in snapshot:
                    alloc.tensor = TensorDescription(snapshot.get("dtype", ""), tuple(snapshot["shape"]), alloc.nbytes)
            elif ph == "D":
                alloc.free_ns = ns(event["ts"])
    for args in flows.values():
        producer, consumer = by_name.get(args[fmt.ARG_PRODUCER]), by_name.get(args.get(fmt.ARG_CONSUMER, ""))
        if producer is not None and consumer is not None:
            tensor = TensorDescription(args.get("dtype", ""), tuple(args.get("shape", ())), args.get("bytes"))
            stats.edges.append(DataEdge(producer, consumer, tensor, args.get("tensor", f"{producer.node_name}:0")))
    for alloc in allocations.values():
        alloc.producer = by_name.get(alloc.producer) if isinstance(alloc.producer, str) else None
        stats.allocations.append(alloc)
    return stats
