"""A traced step from kineto's own export (`_ProfilerResult.save`: Chrome-trace JSON written in C++), to
`StepStats`, without torch: this module runs in the render worker (`hookprof._runtime.worker`) as well as in
the training process. The exported file is the training process's: it removes it once its `KinetoExport` is
garbage (`hookprof.tracing.torch_tracer`).

`KinetoExport` is what leaves the training process: the exported file's path, the profiler's options, and,
when dataflow or memory were recorded, the compact event tree (`hookprof.tracing.torch_dataflow.EventTree`:
kineto's export has no tensor identities). `to_stats()` reads the file and converts it.

The file gives every field the in-process events gave, with two differences:
- threads are the operating system's thread ids (`tid`), as in torch's own exports;
- flops are not exported: `flops()` computes them from the recorded shapes and arguments with the formulas of
  torch's profiler (`torch/csrc/profiler/util.cpp`, `computeFlops`), for the ops it counts (`conv2d`, `mm`,
  `addmm`, `bmm`, `baddbmm`, `mul`, `add`); a test holds them equal to torch's own on a real step.
Timestamps are exact to the nanosecond: kineto writes them in microseconds with three decimals from a base
(`baseTimeNanoseconds`) close enough that a double holds them whole.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from hookprof._runtime.gc_pause import paused_gc
from hookprof.run_options import RunOptions
from hookprof.step_stats import DeviceStepStats, NodeExecStats, ShapedParts, StepStats
from hookprof.trace import format as fmt
from hookprof.tracing import kineto_replay
from hookprof.tracing.kineto_events import KinetoEvent, decode_trace, decoded
from hookprof.tracing.kineto_replay import CONVERSIONS, FitConversions
from hookprof.tracing.step_identity import (
    BACKWARD_PREFIX,
    DATAFLOW_MISSING,
    MODULE_PREFIX,
    NOT_TENSORS,
    OPTIMIZER_PREFIXES,
    TEMPLATES,
    Interned,
    Row,
    StepRows,
    add_tree_records,
    borrow,
    build_template,
    leave_walked,
)
from hookprof.tracing.torch_dataflow import EventTree
from hookprof.tracing.tracer import HOST_DEVICE

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # CPython's repr of an object: `<... object at 0x7f3fd32cea40>`

# torch's C++ type names as the profiler reports them -> the dtype names this project writes.
_TORCH_DTYPES = {
    "float": "float32", "double": "float64", "c10::Half": "float16", "c10::BFloat16": "bfloat16",
    "long int": "int64", "int": "int32", "short int": "int16", "signed char": "int8",
    "unsigned char": "uint8", "bool": "bool", "c10::complex<float>": "complex64",
    "c10::complex<double>": "complex128", "c10::Float8_e4m3fn": "float8_e4m3fn",
    "c10::Float8_e5m2": "float8_e5m2", "unsigned short": "uint16", "unsigned int": "uint32",
    "unsigned long": "uint64",
}
_KERNEL_ACTIVITIES = {"kernel", "gpu_memcpy", "gpu_memset", "concurrent_kernel"}
_RUNTIME_ACTIVITIES = {"cuda_runtime", "cuda_driver"}
_HOST_ACTIVITIES = {"cpu_op", "user_annotation"} | _RUNTIME_ACTIVITIES
_IDENTITY_ACTIVITIES = ("cpu_op", "user_annotation")  # the rows a template joins (`step_identity.Row`)
# the spans a conversion looks at without Python stacks: a step it can convert again (`kineto_replay`) has the same
_REPLAYED = frozenset(_HOST_ACTIVITIES | _KERNEL_ACTIVITIES)


@dataclasses.dataclass
class KinetoExport:
    """A stopped step as kineto exported it, with what the file lacks; picklable, so it can be converted in
    another process."""

    path: str
    trace_start_ns: int
    options: RunOptions
    torch_version: str
    tree: EventTree | None = None  # when dataflow or memory were recorded (and this torch has the tree)
    # (RECORD, fit token): leave the step's identities for the fit's next steps; (BORROW, fit token): take them
    # from the fit's last such step (`hookprof.tracing.step_identity`); None: neither
    identity: tuple[str, str] | None = None
    # in the training process only (not pickled): told when borrowed identities did not fit this step, once
    # (`report_mismatch`), however many times and wherever the step is converted
    on_mismatch: Callable[[str], None] | None = dataclasses.field(default=None, compare=False, repr=False)
    # the token of the step's fit, whose last converted step this one may be converted as (`kineto_replay`)
    fit: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "on_mismatch": None}

    def report_mismatch(self, reason: str) -> None:
        """Tell the tracer the step's borrowed identities did not fit (`reason`): the one report of this step,
        whether it was converted here (`to_stats`) or in the render worker (its caller relays the reason), and
        however many hooks had it converted."""
        # (taken from the instance at once, so two threads converting the same step cannot both report it; the
        # class's default, None, is what is left)
        on_mismatch = self.__dict__.pop("on_mismatch", None)
        if on_mismatch is not None:
            on_mismatch(reason)

    def to_stats(self) -> StepStats:
        stats = StepStats(metadata={"torch_version": self.torch_version, "trace_start_ns": self.trace_start_ns})
        with open(self.path, "rb") as f:
            raw = f.read()
        options = self.options
        mode, token = self.identity or (None, "")
        # (a recording step's too: its layout, for the next step: `leave_walked`)
        instants: list[KinetoEvent] | None = [] if mode is not None else None
        template = TEMPLATES.recall(token) if mode == BORROW else None
        # a borrowing step's argument lists are its template's own objects where equal: signatures compare at once
        interned = template.interned.copy() if template is not None else Interned()
        with paused_gc():
            data = decode_trace(raw)
            base = data.baseTimeNanoseconds
            if data.deviceProperties:  # each GPU's model and capabilities
                stats.metadata[fmt.DEVICE_PROPERTIES] = data.deviceProperties
            converted = _convert(data.traceEvents, base, stats, options.records_tensors, options.with_stack,
                                 mode is not None, instants, interned, self.fit)
            if isinstance(converted, kineto_replay.Replayed) and converted.source.interned is not None:
                interned = converted.source.interned  # (its nodes' argument lists: a template made of it shares them)
            tree = self.tree
            if mode == RECORD and tree is not None:
                template = build_template(tree, converted.rows(), interned)
                TEMPLATES.remember(token, template)
            elif mode == BORROW:
                tree = None  # (a borrowing step's identities are its template's)
                reason = NO_TEMPLATE if template is None else borrow(
                    template, stats, converted, instants, base, options.record_dataflow, options.record_memory)
                if reason is not None:
                    stats.metadata[DATAFLOW_MISSING] = reason
                    self.report_mismatch(reason)
            if tree is not None:
                add_tree_records(tree, stats, converted.by_external_id(), options.record_dataflow,
                                 options.record_memory)
                if template is not None:  # (made of this step: `leave_walked`)
                    leave_walked(template, stats, converted, tree, instants, base, options.record_dataflow,
                                 options.record_memory)
            # freed while the collector is paused: the collection that its resuming starts looks at every object
            # made while paused and still alive, and the export's parsed events are most of them (0.1 s at 20k ops)
            del data, instants, converted
        return stats


RECORD, BORROW = "record", "borrow"  # `KinetoExport.identity` modes
# why a borrowing step has no arrows when the step to borrow from was converted elsewhere: not its ops' fault
NO_TEMPLATE = ("the step its tensor identities were to be taken from was not converted here (a restarted render "
               "worker, or a failed conversion)")


_RAW: Any = object()  # a row's dims or types as the export gives them (not interned)
_OUTSIDE = (0, "", "", "", -1)  # the stack entry around a thread's outermost events: no scope, phase or optimizer
_COUNTED = frozenset({"aten::conv2d", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::mul",
                      "aten::add"})  # the ops torch's profiler counts flops for
_VALUED = frozenset({"aten::conv2d"})  # the ops whose scalar arguments (`Concrete Inputs`) `flops` reads


def _numel(shape: Any) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _int_list(text: str) -> list[int] | None:
    try:
        return [int(v) for v in text.strip("[]").split(",")]
    except ValueError:
        return None


def flops(name: str, dims: Any, types: Any, concrete: Any) -> int:
    """The floating-point operations torch's profiler counts for one op, from its input shapes (`Input Dims`),
    types (`Input type`) and scalar arguments (`Concrete Inputs`); 0 for the ops it does not count."""
    if name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"):
        first = 0 if name in ("aten::mm", "aten::bmm") else 1
        if len(dims) < first + 2 or not dims[first] or not dims[first][-1]:
            return 0
        mat1, mat2 = dims[first], dims[first + 1]
        count = _numel(mat1) // mat1[-1]
        if name.endswith("bmm"):
            if not mat1[0]:
                return 0
            count //= mat1[0]
        return 2 * count * _numel(mat2)
    if name in ("aten::mul", "aten::add"):  # the first argument's elements, when it is a tensor
        return _numel(dims[0]) if dims and types and types[0] not in NOT_TENSORS else 0
    if name == "aten::conv2d":
        if len(dims) < 7 or len(dims[0]) != 4 or len(dims[1]) != 4 or len(concrete) < 7:
            return 0
        stride, padding, dilation = (_int_list(concrete[i]) for i in (3, 4, 5))
        try:
            groups = int(concrete[6])
        except ValueError:
            return 0
        if not (stride and padding and dilation and groups) or len(stride) != 2 or stride[0] * stride[1] == 0 \
                or len(padding) != 2 or len(dilation) != 2:
            return 0
        (batch, channels, height, width), (out_channels, _, kernel_h, kernel_w) = dims[0], dims[1]
        out_h = (height + 2 * padding[0] - dilation[0] * (kernel_h - 1) - 1) // stride[0] + 1
        out_w = (width + 2 * padding[1] - dilation[1] * (kernel_w - 1) - 1) // stride[1] + 1
        return 2 * batch * out_h * out_w * kernel_h * kernel_w * channels * out_channels // groups
    return 0


def _convert(events: list[KinetoEvent], base: int, stats: StepStats, want_ids: bool = False,
             with_stack: bool = False, want_rows: bool = False,
             instants_out: list[KinetoEvent] | None = None, interned: Interned | None = None,
             fit: str | None = None) -> StepRows:
    """Turn kineto's exported events (times in microseconds after `base` ns) into NodeExecStats: scopes from
    module spans, phases from autograd and optimizer. With `with_stack`, each op gets its Python call
    stack (`args["stack"]`, outermost frame first) from the Python-function spans enclosing it on its
    thread. Returns the step's rows (`StepRows`): with `want_ids`, its op nodes by their profiler id (the event
    tree's link to them: its ops' `correlation_id`, the export's `External id`); with `want_rows`, each op and
    user span as a `Row` in start order. `instants_out`, when given, gets the export's `[memory]` instants
    (`hookprof.tracing.step_identity`).
    Ops share their argument lists (shapes, types, dtypes) where equal, from `interned` and added to it.
    A step of fit `fit` whose ops are those of one of the fit's last two converted steps is converted as that one
    was (`hookprof.tracing.kineto_replay`); one converted here leaves its conversion for the next.
    """
    by_external_id: dict[int, NodeExecStats] = {}
    host = stats.device(HOST_DEVICE)
    records: _Records | None = None
    conversions = CONVERSIONS.setdefault(fit, FitConversions) if fit is not None and not with_stack else None
    if conversions is not None and not conversions.off:
        spans = kineto_replay.spans_of(events, _REPLAYED)
        if len(spans) > ShapedParts.KEEP_NODES_MAX:  # (too large to keep: about 0.4 KB a node)
            conversions.stop()
        else:
            signatures = kineto_replay.signatures(spans, _VALUED)
            replayed = conversions.replay(spans, signatures, base, host)
            if replayed is not None:
                if instants_out is not None:
                    instants_out.extend(kineto_replay.memory_instants(events))
                return replayed
            if not conversions.off:  # (still worth recording for the fit's next step)
                records = _Records(spans, signatures, conversions)
    rows = []
    rows_out: list[Row] | None = [] if want_rows else None
    backward_end = 0  # the end of the step's last backward op: what starts after it is the optimizer's
    kernels: list[tuple[int, NodeExecStats]] = []  # (the launching op's External id, the kernel)
    host_activities = _HOST_ACTIVITIES | {"python_function"} if with_stack else _HOST_ACTIVITIES
    for event in events:
        if event.ph != "X":
            if instants_out is not None and event.name == "[memory]":
                instants_out.append(event)
            continue
        activity = event.cat
        if activity in host_activities:
            start, dur, name = round(event.ts * 1000) + base, round(event.dur * 1000), event.name
            if name.startswith(BACKWARD_PREFIX):
                backward_end = max(backward_end, start + dur)
            elif name.startswith(MODULE_PREFIX):  # the fast C++ span reports itself as an op
                activity = "user_annotation"
            rows.append((start, -dur, event.tid, len(rows), activity, name, event.args))
        elif activity in _KERNEL_ACTIVITIES:
            kernels.append(_add_kernel(event, activity, base, stats))
    rows.sort()
    if kernels and records is not None:  # (each launch's correlation id is in its step's args)
        records.conversions.stop()
        records = None
    launchers: dict[int, NodeExecStats] | None = {} if kernels else None  # External id -> op, for kernels

    # per thread, the open events: (end_ns, scope, phase, optimizer scope, place in start order)
    stacks: dict[int, list[tuple[int, str, str, str, int]]] = {}
    # per forward thread (the first one to run forward ops first): autograd sequence nr -> scope
    forward_scopes: dict[int, dict[int, str]] = {}
    name_counts: dict[str, int] = {}
    nodes = host.node_stats
    dtype_names = _TORCH_DTYPES
    interned = interned if interned is not None else Interned()
    types_cache, shapes_cache = interned.types, interned.shapes
    frames: dict[int, list[tuple[int, str]]] = {}  # thread -> open Python frames (end_ns, "file(line): func")
    cat_op, cat_module, new_row = fmt.CAT_OP, fmt.CAT_MODULE, tuple.__new__  # (a row's `Row`, without its __new__)
    for place, (start, neg_dur, tid, _, activity, name, fields) in enumerate(rows):
        dur = -neg_dur
        if activity == "python_function":
            open_frames = frames.setdefault(tid, [])
            while open_frames and open_frames[-1][0] <= start:
                open_frames.pop()
            # a built-in method's name carries its object's address: dropped, so a call site is one frame
            open_frames.append((start + dur, _ADDRESS.sub("", name) if " at 0x" in name else name))
            continue
        stack = stacks.get(tid)
        if stack is None:
            stack = stacks[tid] = []
            host.thread_names.setdefault(tid, f"CPU thread {tid}")
        while stack and stack[-1][0] <= start:
            ended = stack.pop()
            if records is not None:
                records.popped.append((ended[4], place))
        _, scope, phase, optimizer, parent = stack[-1] if stack else _OUTSIDE
        if records is not None:
            records.parents.append(parent)
            if name.startswith(BACKWARD_PREFIX):
                records.backward.append(place)
        category = cat_op
        op = name
        shapes = dtypes = args = None
        dims = types = _RAW
        if activity == "cpu_op":
            if name.startswith(BACKWARD_PREFIX):
                phase = "backward"
                # The export names the forward thread by torch's own id, not the system's: the step's forward
                # thread is the first to run forward ops (a forward spread over threads is not told apart).
                seqs = next(iter(forward_scopes.values()), None)
                if seqs is not None:
                    scope = seqs.get(fields.sequence, scope)
            else:
                # a step has few distinct signatures: one list each, shared (the timeline and the XSpace
                # serialise each once, by its identity), the dtypes mapped once
                shapes = decoded(fields.dims, shapes_cache)
                if shapes is None:
                    shapes = []
                elif shapes:
                    dims = shapes
                    key = bytes(fields.types)
                    found = types_cache.get(key)
                    if found is None:
                        listed = decoded(fields.types, {})
                        found = types_cache[key] = (listed, [dtype_names.get(d, d) for d in listed or ()])
                    types, dtypes = found
                if name in _COUNTED:
                    listed = types if types is not _RAW else decoded(fields.types, {})
                    count = flops(name, shapes, listed or (), decoded(fields.concrete, {}) or ())
                    if count:
                        args = {"flops": count}
            if with_stack:
                open_frames = frames.get(tid)
                while open_frames and open_frames[-1][0] <= start:
                    open_frames.pop()
                if open_frames:
                    args = {**(args or {}), "stack": [frame for _, frame in open_frames]}
        elif activity == "user_annotation":
            category = fmt.CAT_SPAN
            if name.startswith(MODULE_PREFIX):
                op = name[len(MODULE_PREFIX):]
                scope = f"{scope}/{op}" if scope else op
                category = cat_module
            elif name.startswith(OPTIMIZER_PREFIXES):
                # Lightning runs the whole closure (forward, backward) inside Optimizer.step, so the step
                # span only names the optimizer; the ops after backward inside it are the update.
                # zero_grad is all optimizer work.
                optimizer = "optimizer/" + name.split("#", 1)[1].split(".", 1)[0]
                if name.startswith("Optimizer.zero_grad#"):
                    phase, scope = "optimizer", optimizer
        else:  # cudaLaunchKernel & co.: the launch end of a launch -> kernel arrow
            category = fmt.CAT_RUNTIME
            args = {"correlation": fields.correlation}
        if not phase:
            phase = "optimizer" if backward_end and start >= backward_end else "forward"
            if records is not None:
                records.by_rule.append((place, phase == "optimizer"))
        if phase == "forward" and category == cat_op:
            seq = fields.sequence
            if seq >= 0:
                scopes = forward_scopes.get(tid)
                if scopes is None:
                    scopes = forward_scopes[tid] = {}
                scopes.setdefault(seq, scope)
        if phase == "optimizer" and not scope:
            scope = optimizer or "optimizer"
        stack.append((start + dur, scope, phase if phase != "forward" else "", optimizer, place))

        named = scope if category == cat_module else (f"{scope}/{op}" if scope else op)
        count = name_counts.get(named, 0)
        name_counts[named] = count + 1
        node = NodeExecStats(
            f"{named}_{count}" if count else named, op, start, dur, tid, scope, phase, shapes, dtypes,
            None, category, args,
        )
        nodes.append(node)
        if activity in _IDENTITY_ACTIVITIES:
            external_id = fields.external_id
            if external_id is None:
                external_id = 0  # (as no kernel's: theirs is -1 where missing)
            if rows_out is not None or records is not None:
                row = new_row(Row, (node, external_id, tid, name,
                                    decoded(fields.dims, shapes_cache) if dims is _RAW else dims,
                                    decoded(fields.types, {}) if types is _RAW else types))
                if rows_out is not None:
                    rows_out.append(row)
                if records is not None:
                    records.identity.append((place, name, row.dims, row.types))
                    if activity == "cpu_op":
                        records.ops.append(place)
            if activity == "cpu_op":
                if want_ids:
                    by_external_id[external_id] = node
                if launchers is not None:
                    launchers[external_id] = node
    if launchers:
        # kineto gives each kernel the External id of the innermost op whose launch queued it
        for external_id, kernel in kernels:
            op = launchers.get(external_id)
            if op is not None:
                kernel.args[fmt.ARG_LAUNCHED_BY] = op.node_name
    source = records.keep(base, host, interned) if records is not None else None
    return StepRows(rows_out or [], by_external_id, source)


class _Records:
    """What a conversion records of its step for the fit's next one (`kineto_replay.Conversion`): its spans and
    their signatures, and, per node in start order, what its times decided; kept in its fit's `conversions`."""

    __slots__ = ("spans", "signatures", "conversions", "parents", "popped", "by_rule", "backward", "identity", "ops")

    def __init__(self, spans: list[KinetoEvent], signatures: list[tuple], conversions: FitConversions) -> None:
        self.spans, self.signatures, self.conversions = spans, signatures, conversions
        self.parents: list[int] = []
        self.popped: list[tuple[int, int]] = []
        self.by_rule: list[tuple[int, bool]] = []
        self.backward: list[int] = []
        self.identity: list[tuple[int, str, Any, Any]] = []
        self.ops: list[int] = []

    def keep(self, base: int, host: DeviceStepStats, interned: Interned) -> kineto_replay.Conversion | None:
        """Keep the step's conversion (with the argument lists its nodes share: `interned`) for its fit's next
        step, where it can be replayed: its nodes are its spans (no CUDA runtime calls: their args are each
        step's own), and its sequence numbers are numbers; else the fit records none any more."""
        try:
            if any(node.category == fmt.CAT_RUNTIME for node in host.node_stats):
                raise ValueError("CUDA runtime calls")
            conversion = kineto_replay.Conversion(self.spans, self.signatures, base, host.node_stats, self.parents,
                                                  self.popped, self.by_rule, self.backward, self.identity,
                                                  self.ops, host.thread_names, interned)
        except (TypeError, ValueError, OverflowError):  # (sequence numbers, threads or times that are not numbers)
            self.conversions.stop()
            return None
        self.conversions.keep(conversion)
        return conversion


def _add_kernel(event: KinetoEvent, activity: str, base: int, stats: StepStats) -> tuple[int, NodeExecStats]:
    """A kernel, memcpy or memset on its device's stream; returns it with its launching op's External id."""
    fields = event.args
    index = fields.device
    device = stats.device(f"/device:CUDA:{index}")
    stream = event.tid if fields.stream is None else fields.stream
    device.thread_names.setdefault(stream, f"stream {stream}")
    name = event.name
    kernel = NodeExecStats(
        node_name=name, op=name, start_ns=round(event.ts * 1000) + base, duration_ns=round(event.dur * 1000),
        thread_id=stream, category=fmt.CAT_KERNEL,
        args={fmt.ARG_CORRELATION: fields.correlation, fmt.ARG_KERNEL_KIND: activity, fmt.ARG_STREAM: stream,
              fmt.ARG_DEVICE: index},
    )
    # the launch configuration (kernels), the bytes (memcpys, memsets)
    for key, value in ((fmt.ARG_GRID, fields.grid), (fmt.ARG_BLOCK, fields.block),
                       (fmt.ARG_REGISTERS, fields.registers), (fmt.ARG_SHARED_MEMORY, fields.shared_memory),
                       (fmt.ARG_OCCUPANCY, fields.occupancy), (fmt.ARG_BYTES, fields.bytes)):
        if value is not None:
            kernel.args[key] = value
    device.node_stats.append(kernel)
    return -1 if fields.external_id is None else fields.external_id, kernel
