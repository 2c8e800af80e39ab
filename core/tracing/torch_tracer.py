"""`TorchTracer`: one training step under torch's profiler, converted straight into `StepStats`.

It reads the profiler's raw kineto results (`kineto_results.events()`), not `profile.events()`, which builds a
Python `FunctionEvent` tree and costs 40-80 ms per 2k events. Module scopes come from global forward hooks
that open a `record_function` span per module call during the traced step only; backward ops inherit the
scope of the forward op they differentiate (matched by autograd's sequence number), so a gradient op shows
under the module whose forward made it. Imported lazily: `hookprof` never imports torch at top level. The
private torch APIs it uses are found by feature detection (`hookprof.tracing.torch_private`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from typing import Any

import torch

from hookprof._runtime.gc_pause import paused_gc
from hookprof.hooks.session_run_hook import RunOptions, TraceLevel
from hookprof.naming import root_label
from hookprof.step_stats import NodeExecStats, StepStats
from hookprof.trace import format as fmt
from hookprof.tracing.dataflow import find_edges
from hookprof.tracing.torch_dataflow import event_tree, step_dataflow
from hookprof.tracing.torch_memory import add_allocations
from hookprof.tracing.torch_private import profiler_enabled, record_function_class, unsupported_torch
from hookprof.tracing.tracer import HOST_DEVICE, Tracer, TracerUnavailable

log = logging.getLogger(__name__)

MODULE_PREFIX = "module::"
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # CPython's repr of an object: `<... object at 0x7f3fd32cea40>`
BACKWARD_PREFIX = "autograd::engine::evaluate_function: "
OPTIMIZER_PREFIXES = ("Optimizer.step#", "Optimizer.zero_grad#")

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


def _module_label(module: Any, local_names: dict[int, str]) -> str:
    """The name a module call gets in scopes: its attribute name in the model, else its own `name`/class."""
    label = local_names.get(id(module))
    return root_label(module) if label is None else label


class _ModuleScopes:
    """Global forward hooks that wrap each module call in a `record_function` span while installed."""

    def __init__(self, root: Any) -> None:
        self._local_names: dict[int, str] = {}
        if root is not None:
            self._local_names[id(root)] = root_label(root)
            for path, module in root.named_modules():
                if path:
                    self._local_names.setdefault(id(module), path.rsplit(".", 1)[-1])
        self._open: list[Any] = []
        self._handles: list[Any] = []

    def install(self) -> None:
        from torch.nn.modules import module as nn_module

        record_function = record_function_class()
        local_names, open_spans = self._local_names, self._open

        def enter(module, args):
            span = record_function(MODULE_PREFIX + _module_label(module, local_names))
            span.__enter__()
            open_spans.append(span)

        def leave(module, args, output):
            if open_spans:
                open_spans.pop().__exit__(None, None, None)

        self._handles = [
            nn_module.register_module_forward_pre_hook(enter),
            nn_module.register_module_forward_hook(leave, always_call=True),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        while self._open:  # a forward that raised between the two hooks
            self._open.pop().__exit__(None, None, None)


@contextlib.contextmanager
def _quiet_kineto() -> Iterator[None]:
    """Kineto prints "profiler_start"/"profiler_stop" lines unless its log level is above USDT (5); it reads
    `KINETO_LOG_LEVEL` when the profiler starts and stops. Set only around ours, unless the user set it."""
    if "KINETO_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["KINETO_LOG_LEVEL"] = "6"
    try:
        yield
    finally:
        os.environ.pop("KINETO_LOG_LEVEL", None)


class TorchTracer(Tracer):
    """Traces one step with torch's profiler (CPU ops, plus CUDA kernels when CUDA is available).

    Args:
        root: the model (`nn.Module`, a LightningModule or a keras Model on the torch backend) whose
            submodule names become the ops' scopes; None traces without module names.
    """

    name = "torch"

    def __init__(self, root: Any = None) -> None:
        self._root = root
        self._prof: Any = None
        self._scopes: _ModuleScopes | None = None
        self._options = RunOptions()

    def start(self, options: RunOptions) -> None:
        from torch.autograd import profiler as autograd_profiler

        unsupported = unsupported_torch()
        if unsupported is not None:
            raise TracerUnavailable(unsupported)
        if profiler_enabled():
            # Starting a second kineto session would silently take over the user's (their trace ends empty).
            raise TracerUnavailable(
                "another torch profiler is running (torch.profiler.profile, or Trainer(profiler='pytorch')); "
                "hookprof skips its traces while it runs"
            )
        self._options = options
        use_cuda = torch.cuda.is_available() and options.trace_level >= TraceLevel.HARDWARE_TRACE
        full = options.trace_level >= TraceLevel.FULL_TRACE
        prof = autograd_profiler.profile(
            use_device="cuda" if use_cuda else None,
            record_shapes=full or options.record_dataflow,
            with_flops=full,
            # dataflow links tensors by the allocation they live in: see hookprof.tracing.torch_dataflow
            profile_memory=options.record_memory or options.record_dataflow,
            with_stack=options.with_stack,
            use_kineto=True,
        )
        scopes = _ModuleScopes(self._root)
        try:
            with _quiet_kineto():
                prof.__enter__()
            self._prof = prof
            scopes.install()
            self._scopes = scopes
        except BaseException:
            scopes.remove()
            self.abort()
            raise

    def _close(self) -> Any:
        prof, self._prof = self._prof, None
        scopes, self._scopes = self._scopes, None
        if scopes is not None:
            scopes.remove()
        if prof is None:
            return None
        with _quiet_kineto():
            prof.__exit__(None, None, None)
        return prof.kineto_results

    def abort(self) -> None:
        self._close()

    def stop(self) -> StepStats:
        return self.stop_recording()()

    def stop_recording(self) -> _Recording:
        """Stop torch's profiler now; the conversion of its events (the costly part) is left to the caller."""
        return _Recording(self._close(), self._options)


class _Recording:
    """A stopped step's kineto results, converted to `StepStats` when called. Safe to call on another
    thread: the results no longer change once the profiler stopped."""

    def __init__(self, results: Any, options: RunOptions) -> None:
        self._results = results
        self._options = options

    def __call__(self) -> StepStats:
        results, self._results = self._results, None
        stats = StepStats(metadata={"torch_version": torch.__version__})
        if results is not None:
            with paused_gc():
                self._collect(results, stats)
        return stats

    def _collect(self, results: Any, stats: StepStats) -> None:
        options = self._options
        stats.metadata["trace_start_ns"] = results.trace_start_ns()
        want_ids = options.record_dataflow or options.record_memory
        by_external_id = _convert(results.events(), stats, want_ids, options.with_stack)
        tree = event_tree(results) if want_ids else None  # (None where this torch has no event tree)
        if tree is not None:
            if options.record_dataflow:
                stats.edges = find_edges(step_dataflow(tree, by_external_id))
            if options.record_memory:
                add_allocations(tree, stats, by_external_id)


def _convert(events: list, stats: StepStats, want_ids: bool = False, with_stack: bool = False
             ) -> dict[int, NodeExecStats]:
    """Turn kineto events into NodeExecStats: scopes from module spans, phases from autograd and optimizer.

    Each pybind accessor costs about a microsecond and `shapes()` + `dtypes()` about eight, so every field
    is read once, and only for the events that need it. With `with_stack`, each op gets its Python call
    stack (`args["stack"]`, outermost frame first) from the Python-function spans enclosing it on its
    thread. With `want_ids`, returns the op nodes by their profiler id (the event tree's link to them: its
    ops' `correlation_id`).
    """
    by_external_id: dict[int, NodeExecStats] = {}
    host = stats.device(HOST_DEVICE)
    rows = []
    backward_end = 0  # the end of the step's last backward op: what starts after it is the optimizer's
    host_activities = _HOST_ACTIVITIES | {"python_function"} if with_stack else _HOST_ACTIVITIES
    for ev in events:
        activity = ev.activity_type()
        if activity in host_activities:
            start, dur, name = ev.start_ns(), ev.duration_ns(), ev.name()
            if name.startswith(BACKWARD_PREFIX):
                backward_end = max(backward_end, start + dur)
            elif name.startswith(MODULE_PREFIX):  # the fast C++ span reports itself as an op
                activity = "user_annotation"
            rows.append((start, -dur, ev.start_thread_id(), len(rows), activity, name, ev))
        elif activity in _KERNEL_ACTIVITIES:
            _add_kernel(ev, activity, stats)
    rows.sort()

    # per thread, the open events: (end_ns, scope, phase, optimizer scope)
    stacks: dict[int, list[tuple[int, str, str, str]]] = {}
    forward_scopes: dict[tuple[int, int], str] = {}  # (thread, autograd sequence nr) -> scope
    name_counts: dict[str, int] = {}
    nodes = host.node_stats
    dtype_names = _TORCH_DTYPES
    dtype_cache: dict[tuple, list[str]] = {}
    frames: dict[int, list[tuple[int, str]]] = {}  # thread -> open Python frames (end_ns, "file(line): func")
    for start, neg_dur, tid, _, activity, name, ev in rows:
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
            stack.pop()
        scope, phase, optimizer = stack[-1][1:] if stack else ("", "", "")
        category = fmt.CAT_OP
        op = name
        shapes = dtypes = args = None
        if activity == "cpu_op":
            if name.startswith(BACKWARD_PREFIX):
                phase = "backward"
                scope = forward_scopes.get((ev.fwd_thread_id(), ev.sequence_nr()), scope)
            else:
                shapes = ev.shapes()
                if shapes:
                    raw = tuple(ev.dtypes())
                    dtypes = dtype_cache.get(raw)
                    if dtypes is None:  # a step has few distinct signatures: map each once, share the list
                        dtypes = dtype_cache[raw] = [dtype_names.get(d, d) for d in raw]
                flops = ev.flops()
                if flops:
                    args = {"flops": flops}
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
                category = fmt.CAT_MODULE
            elif name.startswith(OPTIMIZER_PREFIXES):
                # Lightning runs the whole closure (forward, backward) inside Optimizer.step, so the step
                # span only names the optimizer; the ops after backward inside it are the update.
                # zero_grad is all optimizer work.
                optimizer = "optimizer/" + name.split("#", 1)[1].split(".", 1)[0]
                if name.startswith("Optimizer.zero_grad#"):
                    phase, scope = "optimizer", optimizer
        else:  # cudaLaunchKernel & co.: the launch end of a launch -> kernel arrow
            category = fmt.CAT_RUNTIME
            args = {"correlation": ev.correlation_id()}
        if not phase:
            phase = "optimizer" if backward_end and start >= backward_end else "forward"
        if phase == "forward" and category == fmt.CAT_OP:
            seq = ev.sequence_nr()
            if seq >= 0 and (tid, seq) not in forward_scopes:
                forward_scopes[(tid, seq)] = scope
        if phase == "optimizer" and not scope:
            scope = optimizer or "optimizer"
        stack.append((start + dur, scope, phase if phase != "forward" else "", optimizer))

        base = scope if category == fmt.CAT_MODULE else (f"{scope}/{op}" if scope else op)
        count = name_counts.get(base, 0)
        name_counts[base] = count + 1
        node = NodeExecStats(
            f"{base}_{count}" if count else base, op, start, dur, tid, scope, phase, shapes, dtypes,
            None, category, args,
        )
        nodes.append(node)
        if want_ids and activity == "cpu_op":
            by_external_id[ev.external_id()] = node
    return by_external_id


def _add_kernel(ev: Any, activity: str, stats: StepStats) -> None:
    device = stats.device(f"/device:CUDA:{ev.device_index()}")
    stream = ev.device_resource_id()
    device.thread_names.setdefault(stream, f"stream {stream}")
    device.node_stats.append(
        NodeExecStats(
            node_name=ev.name(), op=ev.name(), start_ns=ev.start_ns(), duration_ns=ev.duration_ns(),
            thread_id=stream, category=fmt.CAT_KERNEL, args={"correlation": ev.correlation_id(), "kind": activity},
        )
    )
