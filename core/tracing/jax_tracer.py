"""`JaxTracer`: one training step under JAX's profiler, its XLA ops converted into `StepStats`.

The step runs inside a `ProfilerSession` of jaxlib's (what `jax.profiler.start_trace` opens), kept in memory:
no files, no Python-function tracer. Its `stop()` hands back the session's `XSpace`, converted later, off the
training thread: each XLA op execution (a thunk on CPU, an op on an accelerator) becomes an op named after its
HLO instruction (`fusion.3`, `dot.4`), with its program (`jit_train_step`) and duration, on the thread that
ran it; JAX's runtime calls on the dispatching threads (`PjitFunction(train_step)`) become runtime spans; each
program execution becomes a span on an "XLA programs" thread. The program's HLO gives each op its JAX name
stack (`jit(train_step)/transpose(jvp(fc1))/dot_general`), hence its scope (the Keras layer, under the
model's name, as on the torch backend; the optimizer's ops under `optimizer/<name>`), its phase (`transpose`
is the backward pass), its operands and output shapes (FULL_TRACE), its producer -> consumer edges
(dataflow) and its Python stack (`with_stack`). Exporting HLO costs a few ms a step (every loaded program
is serialised), so a trace asks for it only after JAX compiled something new (`_PROGRAMS`).
Imported lazily: `hookprof` never imports jax at top level.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from typing import Any

from hookprof._runtime.fit_run import on_fit_end
from hookprof._runtime.gc_pause import paused_gc
from hookprof._runtime.warn_once import WarnOnce
from hookprof.naming import root_label
from hookprof.run_options import RunOptions, TraceLevel
from hookprof.step_stats import NodeExecStats, StepStats, TensorDescription, tensor_description
from hookprof.trace import format as fmt
from hookprof.tracing import xspace
from hookprof.tracing.dataflow import DataEdge
from hookprof.tracing.tracer import HOST_DEVICE, Tracer, TracerUnavailable

log = logging.getLogger(__name__)
_warn_once = WarnOnce(log)

JAX_WITH_CPU_OPS = "0.8.0"  # the first jax seen to record XLA ops on CPU (0.7.0 does not; 0.8.0, 0.10.2 do)
PROGRAMS_THREAD_ID = 1  # the pseudo-thread of program executions on each device; recorded threads follow it
PROGRAMS_THREAD = "XLA programs"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax.monitoring's event for each compile
_OP_STATS = frozenset({"hlo_op", "hlo_module", "program_id", "run_id"})
_SUFFIX = re.compile(r"\.\d+$")  # `dot.4` -> `dot`: an instruction's name is its kind and a unique number
_WRAPPED = re.compile(r"^([A-Za-z_][\w.]*)\((.*)\)$")  # a name-stack entry under a transform: `jvp(fc1)`
_FUNCTIONS = ("jit", "pjit")  # a name-stack entry that is a called function, not a scope: `jit(relu)`
_VIEWS = frozenset({"bitcast", "get-tuple-element", "tuple"})  # instructions that run nothing: edges pass through

# XLA's PrimitiveType numbers (xla/xla_data.proto) -> the dtype names this project writes
_XLA_DTYPES = {1: "bool", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "uint8", 7: "uint16", 8: "uint32",
               9: "uint64", 10: "float16", 11: "float32", 12: "float64", 15: "complex64", 16: "bfloat16",
               18: "complex128", 19: "float8_e5m2", 20: "float8_e4m3fn"}
_TUPLE = 13


def missing_support() -> str | None:
    """What this JAX lacks for op-level tracing (None when nothing): the README names it in the warning."""
    try:
        from jax._src.lib import _profiler
    except ImportError:
        return "jaxlib's profiler session (jax._src.lib._profiler)"
    if not hasattr(_profiler, "ProfilerSession") or not hasattr(_profiler, "ProfileOptions"):
        return "jaxlib's ProfilerSession and ProfileOptions"
    options = _profiler.ProfileOptions()
    for name in ("python_tracer_level", "enable_hlo_proto"):
        if not hasattr(options, name):
            return f"ProfileOptions.{name} (jax >= {JAX_WITH_CPU_OPS} has it)"
    try:
        import google.protobuf  # noqa: F401
    except ImportError:
        return "the protobuf package, which reads the profiler's XSpace (pip install protobuf)"
    return None


# --- programs: each compiled program's instructions, read once from its HLO -------------------------------


@dataclasses.dataclass(slots=True)
class _Instruction:
    """What the step's ops need of one HLO instruction."""

    opcode: str
    op_name: str  # the JAX name stack, `jit(train_step)/jvp(fc1)/dot_general`
    outputs: list[TensorDescription]
    shape: list[int]  # the output's dims ([] for a scalar or a tuple)
    dtype: str
    operands: list[int]
    stack_frame_id: int  # 0: none
    source_file: str
    source_line: int
    input_shapes: list | None = None  # the operands' shapes and dtypes, filled when the program is read
    input_dtypes: list | None = None


@dataclasses.dataclass(slots=True)
class _Program:
    name: str
    by_name: dict[str, _Instruction]
    by_id: dict[int, _Instruction]
    names: dict[int, str]  # instruction id -> name
    stacks: _Stacks

    def stack(self, info: _Instruction) -> list[str] | None:
        """The Python stack that made an instruction, outermost first (None when JAX recorded none)."""
        if info.stack_frame_id:
            return self.stacks(info.stack_frame_id) or None
        return [f"{info.source_file}({info.source_line})"] if info.source_file else None


def _shape_leaves(shape: Any) -> list[tuple[list[int], str]]:
    if shape.element_type == _TUPLE:
        return [leaf for sub in shape.tuple_shapes for leaf in _shape_leaves(sub)]
    return [(list(shape.dimensions), _XLA_DTYPES.get(shape.element_type, f"xla_type_{shape.element_type}"))]


class _Stacks:
    """A program's Python stacks by stack frame id, outermost frame first, as `file(line): function`; each
    built on first use (a program has thousands of frames, a step's ops use a few hundred)."""

    def __init__(self, index: Any) -> None:  # copied out of the proto, which is then freed
        self._files, self._functions = list(index.file_names), list(index.function_names)
        self._locations = [(loc.file_name_id, loc.function_name_id, loc.line) for loc in index.file_locations]
        self._frames = [(frame.file_location_id, frame.parent_frame_id) for frame in index.stack_frames]
        self._built: dict[int, list[str]] = {}

    def __call__(self, frame_id: int) -> list[str]:
        stack = self._built.get(frame_id)
        if stack is None:
            stack = self._built[frame_id] = self._build(frame_id)
        return stack

    def _build(self, frame_id: int) -> list[str]:
        files, functions, locations, frames = self._files, self._functions, self._locations, self._frames
        stack, seen, current = [], set(), frame_id
        while 0 < current <= len(frames) and current not in seen:  # ids are 1-based; 0 ends the chain
            seen.add(current)
            location, parent = frames[current - 1]
            if 0 < location <= len(locations):
                file_id, function_id, line = locations[location - 1]
                file = files[file_id - 1] if 0 < file_id <= len(files) else "?"
                func = functions[function_id - 1] if 0 < function_id <= len(functions) else "?"
                stack.append(f"{file}({line}): {func}")
            current = parent
        return stack[::-1]


def _read_program(data: bytes) -> _Program:
    """The instructions a program's ops can be: those of its non-fused computations (a fusion runs as one op)."""
    module = xspace.parse_hlo_module(data)
    stacks = _Stacks(module.stack_frame_index)
    by_name: dict[str, _Instruction] = {}
    by_id: dict[int, _Instruction] = {}
    names: dict[int, str] = {}
    for computation in module.computations:
        if computation.is_fusion_computation:
            continue
        for inst in computation.instructions:
            leaves = _shape_leaves(inst.shape)
            outputs = [t for t in (tensor_description(s, d) for s, d in leaves) if t is not None]
            shape, dtype = leaves[0] if len(leaves) == 1 else ([], "tuple")
            meta = inst.metadata
            info = _Instruction(inst.opcode, meta.op_name, outputs, shape, dtype, list(inst.operand_ids),
                                meta.stack_frame_id, meta.source_file, meta.source_line)
            by_name[inst.name] = by_id[inst.id] = info
            names[inst.id] = inst.name
    signatures: dict[tuple, list[str]] = {}
    for info in by_id.values():  # operands' shapes: one shared dtype list per signature (the writer memoises)
        operands = [by_id[i] for i in info.operands if i in by_id]
        info.input_shapes = [o.shape for o in operands]
        dtypes = tuple(o.dtype for o in operands)
        info.input_dtypes = signatures.setdefault(dtypes, list(dtypes))
    return _Program(module.name, by_name, by_id, names, stacks)


class _ProgramCache:
    """The programs read so far, by program id, for the process. A trace exports HLO (`hlo_epoch`) only when
    JAX compiled something since the last trace whose HLO was read (a listener on `jax.monitoring` counts
    compiles), or when the last conversion met a program it could not read."""

    def __init__(self, capacity: int = 64) -> None:
        self._programs: dict[int, _Program] = {}
        self._capacity = capacity
        self._lock = threading.Lock()
        self.need_hlo = False
        self.compiles = 0  # JAX's compiles seen by the listener (-1: no listener, so export every time)
        self._exported_at = -1
        self._listening = False

    def listen(self) -> None:
        """Count JAX's compiles from now on, until the fit running ends (`unlisten`; outside a fit, for the
        process)."""
        if self._listening:
            return
        self._listening = True
        try:
            from jax import monitoring

            monitoring.register_event_duration_secs_listener(self._on_event)
        except (ImportError, AttributeError):
            self.compiles = -1
            return
        on_fit_end("jax-compile-listener", self.unlisten)

    def unlisten(self) -> None:
        """Stop counting (the fit ended: nothing of hookprof's stays registered with JAX). Compiles until the
        next `listen` go unseen, so the next trace exports HLO."""
        if not self._listening:
            return
        self._listening = False
        self.need_hlo = True
        try:
            from jax import monitoring

            monitoring.unregister_event_duration_listener(self._on_event)
        except (ImportError, AttributeError, ValueError, AssertionError):
            pass

    def _on_event(self, event: str, duration: float, **kwargs: Any) -> None:
        if event == COMPILE_EVENT and self.compiles >= 0:
            self.compiles += 1

    def hlo_epoch(self) -> int | None:
        """Whether the trace starting now must export HLO: the compile count to note once its programs are
        read (`read`), or None when every program compiled so far has been read."""
        if self.need_hlo or self.compiles < 0 or self.compiles != self._exported_at:
            return self.compiles
        return None

    def read(self, protos: dict[int, bytes], wanted: set[int], epoch: int | None) -> None:
        """Read the programs among `protos` that the step ran and are not known yet; a trace that exported HLO
        (`epoch`) leaves nothing compiled before it to read."""
        self.add(protos, wanted)
        if epoch is not None:
            self.need_hlo = False
            self._exported_at = max(self._exported_at, epoch)

    def get(self, program_id: int) -> _Program | None:
        return self._programs.get(program_id)

    def add(self, protos: dict[int, bytes], wanted: set[int]) -> None:
        """Read the programs among `protos` that the step ran and are not known yet."""
        for program_id in wanted:
            data = protos.get(program_id)
            if data is None or program_id in self._programs:
                continue
            program = _read_program(data)
            with self._lock:
                if len(self._programs) >= self._capacity:
                    self._programs.pop(next(iter(self._programs)))
                self._programs[program_id] = program


_PROGRAMS = _ProgramCache()


# --- scopes: a name stack as the model's module path ---------------------------------------------------


_TOP_SLASH = re.compile(r"/(?![^()]*\))")  # a slash outside parentheses: `jvp(a/b)` keeps its own


def _split(op_name: str) -> list[str]:
    """`a/jvp(b/c)/d` -> [`a`, `jvp(b/c)`, `d`]: split at the slashes outside parentheses."""
    return _TOP_SLASH.split(op_name) if "(" in op_name else op_name.split("/")


@dataclasses.dataclass(slots=True)
class _ModelNames:
    """How a model's name stacks become scopes: its name, its top-level layers' names, its optimizer's."""

    root: str = ""
    layers: frozenset[str] = frozenset()
    optimizer: str = ""

    @classmethod
    def of(cls, model: Any) -> _ModelNames:
        if model is None:
            return cls()
        layers = frozenset(getattr(layer, "name", "") for layer in getattr(model, "layers", None) or ())
        optimizer = getattr(getattr(model, "optimizer", None), "name", "") or ""
        return cls(root_label(model), layers, optimizer if isinstance(optimizer, str) else "")

    def scope_and_phase(self, op_name: str) -> tuple[str, str]:
        """(`tiny/fc1`, `backward`) for `jit(train_step)/transpose(jvp(fc1))/dot_general`."""
        parts = _split(op_name)
        if len(parts) < 2:  # an argument's name (`state[0][2]`) or a bare primitive: outside every scope
            return "", "forward"
        top = _WRAPPED.match(parts[0])
        if top is not None and top[1] in _FUNCTIONS:  # the jitted function itself: `jit(train_step)`
            parts = parts[1:]
        backward = False
        scope: list[str] = []
        for part in parts[:-1]:  # the last entry is the primitive (`dot_general`)
            while (match := _WRAPPED.match(part)) is not None:
                if match[1] in _FUNCTIONS:
                    part = ""
                    break
                backward = backward or match[1] == "transpose"
                part = match[2]
            if part:
                scope.extend(p for p in part.split("/") if p)
        if not scope:
            return "", "backward" if backward else "forward"
        if scope[0] == self.optimizer and not backward:
            return "/".join(["optimizer", *scope]), "optimizer"
        if scope[0] in self.layers and self.root:
            scope.insert(0, self.root)
        return "/".join(scope), "backward" if backward else "forward"


# --- the tracer ------------------------------------------------------------------------------------------


class JaxTracer(Tracer):
    """Traces one step with JAX's profiler: the XLA ops every program of the step ran, on their threads.

    Args:
        model: the Keras model being fit (JAX backend): its name, top-level layers and optimizer turn the
            ops' JAX name stacks into scopes like the torch backend's (`tiny/fc1`, `optimizer/adam`); None
            keeps the name stacks as they are.
    """

    name = "jax"

    def __init__(self, model: Any = None) -> None:
        _PROGRAMS.listen()
        self._model = model
        self._session: Any = None
        self._options = RunOptions()
        self._start_ns = 0
        self._hlo_epoch: int | None = None

    def start(self, options: RunOptions) -> None:
        from jax._src import profiler as jax_profiler
        from jax._src.lib import _profiler

        self._options = options
        if options.trace_level < TraceLevel.HARDWARE_TRACE:
            return  # the step's phases only: the coordinator records them
        state = getattr(jax_profiler, "_profile_state", None)
        if getattr(state, "profile_session", None) is not None:
            # a second session would fail when stopped, and end the user's trace with an error
            raise TracerUnavailable("a jax.profiler trace is running (jax.profiler.trace or start_trace); "
                                    "hookprof skips its traces while it runs")
        profile_options = _profiler.ProfileOptions()
        profile_options.python_tracer_level = 0  # every Python call, at a cost; stacks come from the HLO
        self._hlo_epoch = _PROGRAMS.hlo_epoch()
        profile_options.enable_hlo_proto = self._hlo_epoch is not None
        self._start_ns = time.time_ns()
        self._session = _profiler.ProfilerSession(profile_options)

    def _close(self) -> bytes | None:
        session, self._session = self._session, None
        return None if session is None else session.stop()

    def abort(self) -> None:
        try:
            self._close()
        except Exception:  # the session is gone either way; the step's own error matters more
            log.debug("Stopping JAX's profiler session after a failed step raised", exc_info=True)

    def stop(self) -> StepStats:
        return self.stop_recording()()

    def stop_recording(self) -> _Recording:
        """Stop the session now (the step's XSpace comes back as bytes); converting it is left to the caller."""
        return _Recording(self._close(), self._options, _ModelNames.of(self._model), self._start_ns, self._hlo_epoch)


class _Recording:
    """A stopped step's XSpace, converted to `StepStats` when called; safe to call on another thread."""

    def __init__(self, data: bytes | None, options: RunOptions, names: _ModelNames, start_ns: int,
                 hlo_epoch: int | None) -> None:
        self._data = data
        self._options = options
        self._names = names
        self._start_ns = start_ns
        self._hlo_epoch = hlo_epoch  # the session exported HLO: the compile count when it started

    def __call__(self) -> StepStats:
        import jax

        data, self._data = self._data, None
        stats = StepStats(metadata={"jax_version": jax.__version__}, native_xspace=data)
        if data is not None:
            with paused_gc():
                _convert(xspace.parse_xspace(data), stats, self._options, self._names, self._start_ns,
                         self._hlo_epoch)
        return stats


def _convert(space: Any, stats: StepStats, options: RunOptions, names: _ModelNames, start_ns: int,
             hlo_epoch: int | None = None) -> None:
    """Fill `stats` from a session's XSpace: XLA ops, runtime spans, program executions and their edges."""
    stats.metadata["trace_start_ns"] = xspace.profile_start_ns(space) or start_ns
    rows = [row for row in xspace.events(space, _OP_STATS) if row.start_ns >= start_ns]
    ran = {int(row.stats.get("program_id", 0)) for row in rows if "hlo_op" in row.stats}
    if not ran and rows:
        import jax

        _warn_once("no ops", "JAX's profiler recorded no XLA op of the traced step (jax %s; on CPU, jax >= %s records "
                   "them): its timeline shows JAX's runtime calls and the step's phases only.", jax.__version__,
                   JAX_WITH_CPU_OPS)
    unknown = {p for p in ran if _PROGRAMS.get(p) is None}
    if unknown or hlo_epoch is not None:
        _PROGRAMS.read(xspace.hlo_protos(space) if hlo_epoch is not None else {}, unknown, hlo_epoch)
        unknown = {p for p in unknown if _PROGRAMS.get(p) is None}
    if unknown:  # a program this trace could not read (evicted, or run without HLO): the next one exports HLO
        _PROGRAMS.need_hlo = True
    threads = xspace.line_names(space)
    op_lines = {(row.plane, row.line) for row in rows if "hlo_op" in row.stats}
    full = options.trace_level >= TraceLevel.FULL_TRACE
    scopes: dict[str, tuple[str, str]] = {}
    name_counts: dict[str, int] = {}
    runs: dict[tuple[str, int, int], dict[str, NodeExecStats]] = {}  # (device, program, run) -> ops by HLO name
    tids: dict[tuple[str, int], int] = {}
    for row in sorted(rows, key=lambda r: (r.start_ns, -r.duration_ns)):
        device = row.plane if row.plane.startswith("/device:") else HOST_DEVICE
        dev = stats.device(device)
        tid = tids.get((row.plane, row.line))
        if tid is None:
            tid = tids[(row.plane, row.line)] = PROGRAMS_THREAD_ID + 1 + sum(1 for k in tids if k[0] == row.plane)
            dev.thread_names[tid] = threads.get((row.plane, row.line), f"thread {tid}")
        hlo_op = row.stats.get("hlo_op")
        if hlo_op is None:
            if (row.plane, row.line) in op_lines or not row.duration_ns:
                continue  # the executors' own markers: on the threads that run the ops, and instants elsewhere
            dev.node_stats.append(NodeExecStats(_unique(row.name, name_counts), row.name, row.start_ns,
                                                row.duration_ns, tid, category=fmt.CAT_RUNTIME))
            continue
        program_id = int(row.stats.get("program_id", 0))
        program = _PROGRAMS.get(program_id)
        info = program.by_name.get(hlo_op) if program is not None else None
        scope, phase = "", "forward"
        args: dict[str, Any] = {"hlo_module": row.stats.get("hlo_module", "")}
        if info is not None:
            found = scopes.get(info.op_name)
            if found is None:
                found = scopes[info.op_name] = names.scope_and_phase(info.op_name)
            scope, phase = found
            if info.op_name:
                args["op_name"] = info.op_name
            stack = program.stack(info) if options.with_stack else None
            if stack:
                args["stack"] = stack
        node = NodeExecStats(
            _unique(f"{scope}/{hlo_op}" if scope else hlo_op, name_counts), _SUFFIX.sub("", hlo_op), row.start_ns,
            row.duration_ns, tid, scope, phase,
            info.input_shapes if full and info is not None else None,
            info.input_dtypes if full and info is not None else None,
            info.outputs if full and info is not None and info.outputs else None, fmt.CAT_OP, args,
        )
        dev.node_stats.append(node)
        runs.setdefault((device, program_id, int(row.stats.get("run_id", 0))), {})[hlo_op] = node
    for (device, program_id, run_id), ops in runs.items():
        _add_program_span(stats, device, program_id, run_id, ops, name_counts)
        if options.record_dataflow and _PROGRAMS.get(program_id) is not None:
            stats.edges.extend(_edges(_PROGRAMS.get(program_id), ops))


def _unique(base: str, counts: dict[str, int]) -> str:
    count = counts.get(base, 0)
    counts[base] = count + 1
    return f"{base}_{count}" if count else base


def _add_program_span(stats: StepStats, device: str, program_id: int, run_id: int, ops: dict[str, NodeExecStats],
                      name_counts: dict[str, int]) -> None:
    """One execution of a program, from its first op's start to its last op's end, on the programs thread."""
    first = min(node.start_ns for node in ops.values())
    last = max(node.start_ns + node.duration_ns for node in ops.values())
    name = next(iter(ops.values())).args.get("hlo_module") or f"program {program_id}"
    dev = stats.device(device)
    dev.thread_names.setdefault(PROGRAMS_THREAD_ID, PROGRAMS_THREAD)
    dev.node_stats.append(NodeExecStats(_unique(name, name_counts), name, first, last - first, PROGRAMS_THREAD_ID,
                                        category=fmt.CAT_MODULE, args={"program_id": program_id, "run_id": run_id}))


def _edges(program: _Program, ops: dict[str, NodeExecStats]) -> list[DataEdge]:
    """Producer -> consumer edges among one execution's ops, from the HLO's operands (through the
    instructions that run nothing: bitcasts, tuples); a producer must end before its consumer starts."""
    edges = []
    for name, consumer in ops.items():
        info = program.by_name.get(name)
        if info is None:
            continue
        seen: set[int] = set()
        for operand in info.operands:
            read = program.by_id.get(operand)  # the datum as the consumer reads it
            for producer_id in _producers(program, operand, ops):
                producer = ops[program.names[producer_id]]
                if producer_id in seen or producer.start_ns + producer.duration_ns > consumer.start_ns:
                    continue
                seen.add(producer_id)
                outputs = read.outputs if read is not None and len(read.outputs) == 1 else \
                    program.by_id[producer_id].outputs
                if outputs:
                    edges.append(DataEdge(producer, consumer, outputs[0], f"{producer.node_name}:0"))
    return edges


def _producers(program: _Program, instruction: int, ops: dict[str, NodeExecStats], depth: int = 0) -> list[int]:
    """The executed instructions whose output `instruction` is, or passes on unchanged."""
    name = program.names.get(instruction)
    if name in ops:
        return [instruction]
    info = program.by_id.get(instruction)
    if info is None or info.opcode not in _VIEWS or depth > 16:
        return []
    return [p for operand in info.operands for p in _producers(program, operand, ops, depth + 1)]
