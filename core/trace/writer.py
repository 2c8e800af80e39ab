"""`ChromeTraceWriter`: step stats -> Chrome Trace Event Format, streamed to disk and written atomically.

The file is `{"traceEvents": [...], "displayTimeUnit": "ms", "baseTimeNanoseconds": ..., "metadata": {...}}`,
readable by Perfetto (ui.perfetto.dev) and chrome://tracing. Layout, as TF's `timeline.py` plus what it lacked:
- one process per device, named "<device> Compute", with `process_sort_index`;
- one thread per recorded thread (and the step phases' thread), with `thread_name` and `thread_sort_index`;
- `X` events for ops (`cat` "Op"), module scopes (`cat` "Module"), host spans (`cat` "Span") and kernels,
  `args` holding the node name, op, module scope, phase and, per argument position, `input_shapes`,
  `input_dtypes` and `input_bytes` (None for non-tensor arguments);
- times in microseconds from the step's first event (`baseTimeNanoseconds` gives the absolute start).
Events are serialised by orjson in chunks and streamed (optionally through gzip) to a temp file that is
renamed into place; a cap on the number of events cuts a huge step short and says so in the metadata.
The names (categories, process and thread names, keys) are defined in `hookprof.trace.format`.
"""

from __future__ import annotations

import dataclasses
import gzip
import itertools
import json
import logging
import operator
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import orjson

from hookprof._runtime import arguments
from hookprof._runtime.atomic_file import atomic_write
from hookprof._runtime.gc_pause import paused_gc
from hookprof.step_stats import KernelsOf, NodeExecStats, StepShape, StepStats, TensorDescription, node_times
from hookprof.trace import format as fmt

log = logging.getLogger(__name__)

_CHUNK = 4096


@dataclasses.dataclass
class WriteResult:
    """What a write did: events written, and whether the cap cut the trace short."""

    events: int
    truncated: bool


def write_trace(path: str, events: Iterator[dict[str, Any]], tail: dict[str, Any], compress: bool = False,
                max_events: int | None = None, head: dict[str, Any] | None = None) -> WriteResult:
    """Stream `events` into `path` as `{**head, "traceEvents": [...], **tail}`, atomically, gzip if asked.

    `head` (small: `distributedInfo`) is written first with the spaced separators of kineto's own files,
    because tools find the rank with a regex over the file's start (HolisticTraceAnalysis: `"rank":\\s+N`).
    At most `max_events` events are written; past that the rest is dropped and `tail["metadata"]` records
    `truncated: true`. The file appears only when complete (temp file + rename), never half-written.
    """
    with atomic_write(path) as raw:
        return serialize_trace(raw, events, tail, compress, max_events, head)


def serialize_trace(raw: Any, events: Iterator[dict[str, Any]], tail: dict[str, Any], compress: bool = False,
                    max_events: int | None = None, head: dict[str, Any] | None = None) -> WriteResult:
    """`write_trace`'s serialisation, into any binary file object `raw` (a file, or a `ChunkBuffer`)."""
    count = 0
    truncated = False
    # gzip compresses on a second thread (zlib releases the GIL) while the next chunk of events is built
    out: Any = _BackgroundWriter(gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=1, mtime=0)) \
        if compress else raw
    try:
        out.write(b"{" + (json.dumps(head)[1:-1] + ", ").encode() if head else b"{")
        out.write(b'"traceEvents":[')
        for chunk in _chunks(events):
            size = len(chunk)
            if max_events is not None and count + size > max_events:
                size = max_events - count
                truncated = True
            if size:
                if count:
                    out.write(b",")
                out.write(chunk.joined(size) if type(chunk) is Serialised else orjson.dumps(chunk[:size])[1:-1])
                count += size
            if truncated:
                break
        metadata = {**tail.get(fmt.METADATA, {}), fmt.EVENTS: count}
        if truncated:
            metadata[fmt.TRUNCATED] = True
            metadata[fmt.MAX_EVENTS] = max_events
        out.write(b"]," + orjson.dumps({**tail, fmt.METADATA: metadata}, default=str)[1:])
    finally:
        if out is not raw:
            out.close()
    return WriteResult(count, truncated)


class ChunkBuffer:
    """A write-only binary file kept in memory as the chunks written (no copy into one buffer); `write_to`
    puts them in a real file. A rendered timeline waits here for the disk."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.nbytes = 0

    def write(self, data: bytes) -> int:
        self.chunks.append(bytes(data))
        self.nbytes += len(data)
        return len(data)

    def flush(self) -> None:
        pass

    def write_to(self, out: Any) -> None:
        for chunk in self.chunks:
            out.write(chunk)


class _BackgroundWriter:
    """Writes to `out` from a second thread, at most two chunks behind; `close()` finishes the writes, closes
    `out` and raises the first error the thread met (a full disk), which the next `write()` raises too."""

    def __init__(self, out: Any) -> None:
        self._out = out
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=2)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hookprof-trace-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._out.write(data)
                except BaseException as err:  # handed to the writing thread at its next call
                    self._error = err

    def write(self, data: bytes) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(data)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        try:
            if self._error is not None:
                raise self._error
        finally:
            self._out.close()


class ChromeTraceWriter:
    """Writes one step's stats as a Chrome trace.

    Args:
        show_dataflow: flow arrows from each tensor's producer to its consumers (and kernel launches to
            kernels).
        show_memory: tensor objects and allocator counters (needs memory recorded by the tracer).
        compress: gzip the file (level 1: fast, and about 10x smaller for traces).
        max_events: stop adding events after this many; the trace's metadata says it was truncated.
    """

    def __init__(self, show_dataflow: bool = True, show_memory: bool = False, compress: bool = False,
                 max_events: int | None = None) -> None:
        self.show_dataflow = show_dataflow
        self.show_memory = show_memory
        self.compress = compress
        self.max_events = arguments.check_optional_cap("ChromeTraceWriter", "max_events", max_events)

    def events(self, stats: StepStats, process_prefix: str = "", base: int | None = None,
               shape: StepShape | None = None) -> Iterator[dict[str, Any] | Serialised]:
        """The trace events of `stats`: metadata first, then ops, flows and memory; times from `base` (ns,
        default the step's first event). Argument shapes and sizes are `orjson.Fragment`s (JSON serialised
        once per signature and shared): serialise the events with orjson. With the step's `shape`, the op
        events and the dataflow arrows come as runs of serialised events (`Serialised`: `_shaped_op_events`,
        `_shaped_tensor_flows`), which `serialize_trace` writes as they are."""
        if base is None:
            base = stats.start_ns() or 0
        for pid, dev in enumerate(stats.dev_stats):
            yield {"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                   "args": {"name": fmt.compute_process_name(dev.device, process_prefix)}}
            yield {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}
            for order, (tid, name) in enumerate(sorted(dev.thread_names.items())):
                yield {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}
                yield {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                       "args": {"sort_index": order}}
        # the step span is named as torch.profiler names it, so HTA and torch's tools find iterations
        step_name = f"{fmt.PROFILER_STEP_PREFIX}{stats.step if stats.step is not None else 0}"
        if shape is not None:
            yield from _shaped_op_events(stats, base, step_name, shape)
        else:
            inputs: _InputsMemo = {}
            for pid, dev in enumerate(stats.dev_stats):
                for node in dev.node_stats:
                    yield _step_op_event(node, pid, base, inputs, step_name)
        if self.show_dataflow:
            if any(not dev.device.startswith("/host:") for dev in stats.dev_stats):  # (kernels are on theirs)
                yield from _launch_flows(stats, base)
            if shape is not None and len(stats.dev_stats) == 1:
                yield from _shaped_tensor_flows(stats, base, shape)
            else:
                yield from _tensor_flows(stats, base)
        if self.show_memory:
            yield from _memory_events(stats, base, process_prefix)

    def write(self, stats: StepStats, path: str, metadata: dict[str, Any] | None = None,
              distributed: dict[str, Any] | None = None) -> WriteResult:
        """Write `stats` to `path` (atomically). `distributed` (rank, world_size, backend) is recorded as
        the trace's `distributedInfo`, as kineto does, and prefixes process names with the rank."""
        with atomic_write(path) as raw:
            return self._serialize(raw, stats, metadata, distributed)

    def render(self, stats: StepStats, metadata: dict[str, Any] | None = None,
               distributed: dict[str, Any] | None = None, shape: StepShape | None = None
               ) -> tuple[ChunkBuffer, WriteResult]:
        """What `write` puts in the file, in memory: the bytes (to `write_to` a file later) and the result.
        `shape`: the step's (`hookprof.step_stats.StepShape`), for a next step of the same shape to reuse what
        it decides."""
        buffer = ChunkBuffer()
        result = self._serialize(buffer, stats, metadata, distributed, shape)
        return buffer, result

    def _serialize(self, raw: Any, stats: StepStats, metadata: dict[str, Any] | None,
                   distributed: dict[str, Any] | None, shape: StepShape | None = None) -> WriteResult:
        extra: dict[str, Any] = {fmt.STEP: stats.step}
        if self.show_memory and stats.memory_samples:
            extra[fmt.PEAK_ALLOCATED_BYTES] = stats.peak_allocated()
        base = stats.start_ns() or 0
        tail: dict[str, Any] = {
            "displayTimeUnit": "ms",
            fmt.BASE_TIME_NS: base,
            fmt.METADATA: {**stats.metadata, **(metadata or {}), **extra},
        }
        prefix = ""
        if distributed and distributed.get(fmt.WORLD_SIZE, 1) > 1:
            prefix = fmt.rank_prefix(distributed.get(fmt.RANK, 0))
        head = {fmt.DISTRIBUTED_INFO: distributed} if distributed else None
        with paused_gc():
            return serialize_trace(raw, self.events(stats, prefix, base, shape), tail, self.compress, self.max_events,
                                   head)


# One write's serialised argument signatures, by (dtype list identity, shapes JSON or shapes list identity):
# a step repeats few (shapes, dtypes) pairs, so each pair's shapes and byte sizes are serialised once and
# shared, as orjson fragments, by every op that has it (tracers share one dtype list per signature, kineto's
# one shapes list; the nodes hold them alive); and its output tensors, by identity (their nodes hold them).
_InputsMemo = dict


def _step_op_event(node: NodeExecStats, pid: int, base: int, inputs: _InputsMemo, step_name: str) -> dict[str, Any]:
    """`_op_event`, the step's span named as torch.profiler names it."""
    event = _op_event(node, pid, base, inputs)
    if _is_step_span(node):
        event["name"] = step_name
    return event


def _is_step_span(node: NodeExecStats) -> bool:
    """Whether `node` is the step's span (its event's name has the step's number: made anew each step)."""
    return node.category == fmt.CAT_SPAN and node.op == fmt.TRAIN_STEP


def _shaped_op_events(stats: StepStats, base: int, step_name: str, shape: StepShape
                      ) -> Iterator[dict[str, Any] | Serialised]:
    """The op events of `_op_event`, serialised: each its untimed head and tail (up to its start, and from its
    args on: what the step's shape decides, taken from the fit's last step of this shape (`StepShape.recall`),
    or made and kept for the next) around its times (serialised together, by orjson as it serialises them in an
    event), joined by C's iteration (`wire.joined`) into runs of events (`Serialised`). The step's phase spans
    (its span's name has its number; the wait's and the step's args may say hookprof's work ran beside them)
    come between the runs as `_op_event` makes them."""
    kept = shape.recall("timeline")
    made: list[_ShapedDevice] | None = None if kept is not None else []
    inputs: _InputsMemo = {}
    for pid, dev in enumerate(stats.dev_stats):
        nodes = dev.node_stats
        if made is not None:
            heads: list[bytes] = []
            tails: list[bytes] = []
            spans: list[int] = []
            for at, node in enumerate(nodes):
                if node.category == fmt.CAT_SPAN:  # (the step's phases: their name and args are the step's own)
                    spans.append(at)
                    continue
                event = _step_op_event(node, pid, base, inputs, step_name)
                args = event.pop("args")
                del event["ts"], event["dur"]
                heads.append(orjson.dumps(event)[:-1] + b',"ts":')
                tails.append(b',"args":' + orjson.dumps(args) + b"},")
            made.append((heads, tails, spans))
        else:
            heads, tails, spans = kept[pid]
        # each event's `ts` value, `,"dur":` and its `dur` value (in us as `_op_event` makes them: `ns / 1000`,
        # the same double from numpy as from Python), the spans' left out
        starts, durations = node_times(nodes)
        times = np.column_stack(((starts - base) / 1000, durations / 1000))
        times = _float_rows(np.delete(times, spans, axis=0) if spans else times, b',"dur":')
        done = 0  # the events yielded so far (a span's place among them is its node's less the spans before it)
        for count, at in enumerate([*spans, len(nodes)]):
            if at - count > done:
                run = slice(done, at - count)
                yield Serialised(heads[run], times[run], tails[run])
                done = at - count
            if at < len(nodes):
                yield _step_op_event(nodes[at], pid, base, inputs, step_name)
    if made is not None:
        shape.keep("timeline", made)


# What a step's shape decides of its op events on one device (`_shaped_op_events`): each event's JSON before its
# times and after them (with the comma after the event), the step's phase spans left out, and their places among
# the device's nodes
_ShapedDevice = tuple[list[bytes], list[bytes], list[int]]


def _op_event(node: NodeExecStats, pid: int, base: int, inputs: _InputsMemo) -> dict[str, Any]:
    args: dict[str, Any] = {fmt.ARG_NAME: node.node_name, fmt.ARG_OP: node.op}
    if node.scope:
        args[fmt.ARG_SCOPE] = node.scope
    if node.phase:
        args[fmt.ARG_PHASE] = node.phase
    if node.input_shapes:
        # one entry per argument position, as recorded (torch's own traces use the same parallel lists)
        fragments = inputs.get((id(node.input_dtypes), id(node.input_shapes)))
        if fragments is None:  # (a tracer that shares its shapes lists, as the dtypes, finds them above)
            shapes = orjson.dumps(node.input_shapes)
            key = (id(node.input_dtypes), shapes)
            fragments = inputs.get(key)
            if fragments is None:
                fragments = inputs[key] = (orjson.Fragment(shapes), orjson.Fragment(orjson.dumps(node.input_bytes())),
                                           orjson.Fragment(orjson.dumps(node.input_dtypes)))
            inputs[(id(node.input_dtypes), id(node.input_shapes))] = fragments
        args[fmt.ARG_INPUT_SHAPES], args[fmt.ARG_INPUT_BYTES], args[fmt.ARG_INPUT_DTYPES] = fragments
    if node.outputs:
        # a step's tensors are shared descriptions (a few per signature): each serialised once
        args[fmt.ARG_OUTPUTS] = [inputs.get(id(t)) or _tensor_fragment(t, inputs) for t in node.outputs]
    if node.args:
        args.update(node.args)
    return {
        "ph": "X", "cat": node.category, "name": node.op, "pid": pid, "tid": node.thread_id,
        "ts": (node.start_ns - base) / 1000, "dur": node.duration_ns / 1000, "args": args,
    }


def _tensor_fragment(tensor: TensorDescription, inputs: _InputsMemo) -> orjson.Fragment:
    fragment = inputs[id(tensor)] = orjson.Fragment(orjson.dumps(tensor.to_json()))
    return fragment


def _launch_flows(stats: StepStats, base: int) -> Iterable[dict[str, Any]]:
    """Arrows from each CUDA runtime launch to the kernel it launched (matched by correlation id)."""
    launches: dict[int, tuple[int, NodeExecStats]] = {}
    kernels: list[tuple[int, NodeExecStats]] = []
    for pid, dev in enumerate(stats.dev_stats):
        for node in dev.node_stats:
            correlation = node.args.get("correlation") if node.args else None
            if correlation is None:
                continue
            if node.category == fmt.CAT_KERNEL:
                kernels.append((pid, node))
            else:
                launches[correlation] = (pid, node)
    for pid, kernel in kernels:
        launch = launches.get(kernel.args["correlation"])
        if launch is None:
            continue
        lpid, lnode = launch
        flow_id = kernel.args["correlation"]
        yield {"ph": "s", "cat": fmt.CAT_DATAFLOW, "name": fmt.LAUNCH_FLOW, "id": flow_id, "pid": lpid,
               "tid": lnode.thread_id, "ts": (lnode.start_ns - base) / 1000}
        yield {"ph": "t", "cat": fmt.CAT_DATAFLOW, "name": fmt.LAUNCH_FLOW, "id": flow_id, "pid": pid, "bp": "e",
               "tid": kernel.thread_id, "ts": (kernel.start_ns - base) / 1000}


def _tensor_flows(stats: StepStats, base: int) -> Iterable[dict[str, Any]]:
    """TF's dataflow arrows: for each producer -> consumer edge, `s` at the producer's end, `t` at the
    consumer's start (binding to the enclosing slice), named after the tensor. Where both ops ran kernels
    (the tensor lives on the accelerator), the arrow joins the producer's last kernel to the consumer's first,
    on their streams, as TF drew dataflow between GPU ops."""
    if not stats.edges:
        return
    # a step on one device (every op's pid 0) ran no kernels: they sit on their own devices, beside the host's
    pids = {id(node): pid for pid, dev in enumerate(stats.dev_stats) for node in dev.node_stats} \
        if len(stats.dev_stats) > 1 else {}
    kernels_of = KernelsOf(stats) if pids else None
    shapes: dict[int, list[int]] = {}  # id(tensor) -> its shape as a list (the edges hold the tensors)
    for flow_id, edge in enumerate(stats.edges, start=1 << 32):  # above any kernel correlation id
        producer, consumer, tensor = edge.producer, edge.consumer, edge.tensor
        shape = shapes.get(id(tensor))
        if shape is None:
            shape = shapes[id(tensor)] = list(tensor.shape)
        args = {"dtype": tensor.dtype, "shape": shape, "bytes": tensor.nbytes,
                fmt.ARG_PRODUCER: producer.node_name, fmt.ARG_CONSUMER: consumer.node_name}
        if kernels_of is not None and (made := kernels_of(producer)) and (read := kernels_of(consumer)):
            (source_pid, source), (target_pid, target) = max(made, key=lambda k: _end(k[1])), read[0]
        else:
            (source_pid, source), (target_pid, target) = ((pids.get(id(producer), 0), producer),
                                                          (pids.get(id(consumer), 0), consumer))
        yield {"ph": "s", "cat": fmt.CAT_DATAFLOW, "name": edge.name, "id": flow_id, "pid": source_pid,
               "tid": source.thread_id, "ts": _flow_start_us(source, base), "args": args}
        yield {"ph": "t", "cat": fmt.CAT_DATAFLOW, "name": edge.name, "id": flow_id, "pid": target_pid,
               "tid": target.thread_id, "ts": (target.start_ns - base) / 1000, "bp": "e", "args": args}


def _shaped_tensor_flows(stats: StepStats, base: int, shape: StepShape) -> Iterator[Serialised]:
    """The arrows of `_tensor_flows` (a step on the host alone), serialised: each event's untimed head and tail
    (up to its time, and after it: what the step's shape decides, taken from the fit's last step of this shape
    or made and kept for the next) around its time, joined by C's iteration (`wire.joined`)."""
    kept = shape.recall("flows")
    if kept is None:
        kept = ([], [])
        for event in _tensor_flows(stats, base):
            keys = list(event)
            at = keys.index("ts")
            kept[0].append(orjson.dumps({key: event[key] for key in keys[:at]})[:-1] + b',"ts":')
            kept[1].append(b"," + orjson.dumps({key: event[key] for key in keys[at + 1:]})[1:] + b",")
        shape.keep("flows", kept)
    if not kept[0]:
        return
    # (as `_tensor_flows` times them: the producer's end, the consumer's start; the same float operations)
    producers, consumers = list(map(_PRODUCER, stats.edges)), list(map(_CONSUMER, stats.edges))
    starts, durations = node_times(producers)
    flow_starts = (starts + durations - base) / 1000 - np.minimum(0.001, durations / 2000)
    times = _floats(np.column_stack((flow_starts, (node_times(consumers)[0] - base) / 1000)).ravel())
    yield Serialised(kept[0], times, kept[1])


_PRODUCER, _CONSUMER = operator.attrgetter("producer"), operator.attrgetter("consumer")


def _floats(values: np.ndarray) -> list[bytes]:
    """Each double's JSON, as orjson writes a Python float (the same shortest repr), written together."""
    return orjson.dumps(values, option=orjson.OPT_SERIALIZE_NUMPY)[1:-1].split(b",") if len(values) else []


def _float_rows(rows: np.ndarray, between: bytes) -> list[bytes]:
    """Each row of doubles as `_floats` writes them, its values joined by `between`: one bytes per row."""
    if not len(rows):
        return []
    text = orjson.dumps(rows, option=orjson.OPT_SERIALIZE_NUMPY)[2:-2]  # ([[a,b],[c,d]]: no other brackets)
    return text.replace(b"],[", b"\n").replace(b",", between).split(b"\n")


def _end(node: NodeExecStats) -> int:
    return node.start_ns + node.duration_ns


def _flow_start_us(source: NodeExecStats, base: int) -> float:
    """An arrow's start (us after `base`): just inside its source's end, so that it binds to that slice."""
    return (_end(source) - base) / 1000 - min(0.001, source.duration_ns / 2000)


def _memory_events(stats: StepStats, base: int, process_prefix: str = "") -> Iterable[dict[str, Any]]:
    """TF's show_memory: per device a "<device> Tensors" process with one object per allocation (`N` when
    made, `O` snapshot of bytes/shape/dtype/producer, `D` when freed) and a `C` counter of the allocator's
    bytes in use; the step's peak goes in the process label."""
    if not stats.memory_samples and not stats.allocations:
        return
    devices = sorted({s.device for s in stats.memory_samples} | {a.device for a in stats.allocations})
    first = len(stats.dev_stats)
    pids = {device: first + i for i, device in enumerate(devices)}
    peaks = stats.peak_allocated()
    for device, pid in pids.items():
        yield {"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
               "args": {"name": fmt.tensors_process_name(device, process_prefix)}}
        yield {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}
        yield {"ph": "M", "name": "process_labels", "pid": pid, "tid": 0,
               "args": {"labels": f"peak allocated {peaks.get(device, 0)} B",
                        fmt.PEAK_ALLOCATED_BYTES: peaks.get(device, 0)}}
    for sample in stats.memory_samples:
        yield {"ph": "C", "cat": fmt.CAT_MEMORY, "name": fmt.ALLOCATOR_COUNTER, "pid": pids[sample.device], "tid": 0,
               "ts": (sample.ts_ns - base) / 1000,
               "args": {fmt.ARG_ALLOCATED: sample.total_allocated, fmt.ARG_RESERVED: sample.total_reserved}}
    for alloc in stats.allocations:
        pid = pids[alloc.device]
        name = alloc.producer.node_name if alloc.producer is not None else "tensor"
        common = {"cat": fmt.CAT_TENSOR, "name": name, "id": alloc.allocation_id, "pid": pid, "tid": 0}
        ts = (alloc.alloc_ns - base) / 1000
        snapshot: dict[str, Any] = {"bytes": alloc.nbytes, fmt.ARG_PRODUCER: name}
        if alloc.tensor is not None:
            snapshot["shape"] = list(alloc.tensor.shape)
            snapshot["dtype"] = alloc.tensor.dtype
        yield {"ph": "N", "ts": ts, **common}
        yield {"ph": "O", "ts": ts, "args": {"snapshot": snapshot}, **common}
        if alloc.free_ns is not None:
            yield {"ph": "D", "ts": (alloc.free_ns - base) / 1000, **common}


class Serialised:
    """Events already serialised, in order: an item of an event stream that `serialize_trace` writes as they
    are, counted and cut as so many events. Each event is one piece from each of `columns` (bytes), its last
    piece ending in the comma that follows it; the run is joined by C's iteration (`zip`, `join`), where a
    step's tens of thousands of op events and arrows made into one `orjson.Fragment` each cost a Python call
    each (`_shaped_op_events`)."""

    __slots__ = ("_pieces", "_width")

    def __init__(self, *columns: Iterable[bytes]) -> None:
        self._width = len(columns)
        self._pieces = list(itertools.chain.from_iterable(zip(*columns)))

    def __len__(self) -> int:
        return len(self._pieces) // self._width

    def joined(self, count: int | None = None) -> bytes:
        """The JSON of the first `count` events (all: None), comma-separated."""
        return b"".join(self._pieces if count is None else self._pieces[:count * self._width])[:-1]


def _chunks(events: Iterable[Any]) -> Iterator[list[Any] | Serialised]:
    """`events` in lists of `_CHUNK` to serialise together, and each `Serialised` run as it is."""
    events = iter(events)
    while True:
        chunk = list(itertools.islice(events, _CHUNK))
        if not chunk:
            return
        # (a run ends the chunk it is in: the events before it, the run, then the next chunk)
        runs = [i for i, event in enumerate(chunk) if type(event) is Serialised]
        start = 0
        for at in runs:
            if at > start:
                yield chunk[start:at]
            yield chunk[at]
            start = at + 1
        if start < len(chunk):
            yield chunk[start:] if start else chunk
