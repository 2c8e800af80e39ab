"""What the Profiler accumulates over traced steps: per node, per step, the figures tfprof reported.

A node is an op execution of the step (named by its unique node name, stable across identical steps) or a
parameter of the model (`_trainable_variables`). Per step and node: run count, exclusive CPU time (time in the
op minus the ops nested in it, so nested ops are never counted twice), accelerator time (kernels attributed
to the op that launched them), requested/peak/residual/output bytes, float ops. Per step also: the step's
span, its data wait, and the busy time of its ops, for the advisor. All of it is plain data, serialisable.

Steps are keyed by `(rank, global step)`: the profiles of a distributed run's ranks merge into one
(`ProfileData.merge`) without adding one rank's step to another's, and the advisor compares the ranks. A step's
figures at step N (`NodeData.figures(N)`) are the mean over the ranks that traced it.

A (rank, step) added again adds up, whether by `add_step` or by `merge`: in tfprof a step number groups "one or
more different run_meta" (TF's `Profiler.add_step`), every traced run of that step counted once; a merged
profile's steps are run metadata too. What a merged profile holds is its own copy.

Output bytes are TF's: the sizes of the tensors an op produced in the step (its outputs' descriptions), read by
a later op or not (TF's `ExecStep::AddMemoryStats` summed every output of the node's executions in the step).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from hookprof.naming import parameter_scopes
from hookprof.step_stats import NodeExecStats, StepStats
from hookprof.trace import format as fmt

# per-step figures of a node, by position
COUNT, MICROS, CPU, ACCEL, BYTES, PEAK, RESIDUAL, OUTPUT, FLOPS = range(9)
N_FIGURES = 9

StepKey = tuple[int, int]  # (rank, global step)

# Collective communication, by event name (op, span or kernel): torch's c10d ops, the backends' own spans
# (`gloo:all_reduce`, which runs on gloo's thread and lasts as long as the rank waits for its peers;
# `nccl:all_reduce`), NCCL's kernels, and `record_param_comms`
COLLECTIVE = re.compile(r"^(c10d::|nccl|gloo:|record_param_comms)|ProcessGroup", re.IGNORECASE)
_BACKEND_CALL = re.compile(r"^(gloo|nccl|mpi|ucc|xccl):", re.IGNORECASE)  # one per collective call


_FRAME = re.compile(r"^(?P<file>.*)\((?P<line>\d+)\): (?P<func>.*)$")


def parse_frame(frame: str) -> tuple[str, str, int]:
    """`path/file.py(123): function` -> (function, file, line); a frame without a file (an op, a built-in
    method, an `nn.Module: Linear_0` span) is all name: (name, "", 0)."""
    match = _FRAME.match(frame)
    return (match["func"], match["file"], int(match["line"])) if match else (frame, "", 0)


@dataclasses.dataclass
class NodeData:
    """One node across steps. `steps` maps a step (rank, global step) to its figures (see the positions above),
    added with `add`; `memory_device` is the device of the memory it allocated (`/device:CUDA:0` for an op run
    on the host), if it allocated any."""

    name: str
    op: str
    scope: str = ""
    device: str = ""
    phase: str = ""
    op_types: list[str] = dataclasses.field(default_factory=list)
    input_shapes: list = dataclasses.field(default_factory=list)
    input_dtypes: list = dataclasses.field(default_factory=list)
    inputs: list[str] = dataclasses.field(default_factory=list)  # producer node names
    stack: list[str] = dataclasses.field(default_factory=list)
    params: int = 0
    memory_device: str = ""  # where its allocations live (ops run on the host, their tensors may not)
    # its figures by (rank, global step), written by `add` alone (`steps` reads them), which keeps `_at`, the same
    # keys by global step, in step with them
    _steps: dict[StepKey, list[float]] = dataclasses.field(default_factory=dict, init=False, repr=False)
    _at: dict[int, list[StepKey]] = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def steps(self) -> Mapping[StepKey, list[float]]:
        """Its figures by (rank, global step), read-only: steps are added with `add`."""
        return MappingProxyType(self._steps)

    def figures(self, step: int) -> list[float]:
        """Figures at `step` (the mean over the ranks that traced it), or (step -1) the mean over the steps this
        node ran in; parameters have no steps."""
        steps = self._steps
        if not steps:
            return [0.0] * N_FIGURES
        rows = list(steps.values()) if step < 0 else [steps[key] for key in self._at.get(step, ())]
        if len(rows) <= 1:
            return rows[0] if rows else [0.0] * N_FIGURES
        return [sum(values) / len(rows) for values in zip(*rows)]

    def ran_at(self, step: int) -> bool:
        """Whether this node ran at global step `step` (on any rank; step -1: at any step)."""
        return bool(self._steps) and (step < 0 or step in self._at)

    def add(self, key: StepKey, figures: list[float]) -> None:
        """Add `figures` (one execution's, or a merged profile's step) to step `key`'s: counts, times and bytes
        add up, the peak is the larger."""
        mine = self._steps.get(key)
        if mine is None:
            self._steps[key] = [float(value) for value in figures]
            self._at.setdefault(key[1], []).append(key)
            return
        for i, value in enumerate(figures):
            mine[i] = max(mine[i], value) if i == PEAK else mine[i] + value


@dataclasses.dataclass
class StepSummary:
    """Per traced step, for the advisor: its span less the data waits inside it (`step_micros`), its data waits
    (before it, and between its batches under accumulation or `steps_per_execution`), op busy time, what traced
    it, and per device the allocator's bytes in use at its end (`allocated`: after the step's last allocation or
    free; empty where the step was traced without memory)."""

    step: int
    step_micros: float = 0.0
    data_wait_micros: float = 0.0
    busy_micros: float = 0.0
    gaps: list[tuple[float, float]] = dataclasses.field(default_factory=list)  # (start offset, length) us
    rank: int = 0
    accelerator_busy: dict[str, float] = dataclasses.field(default_factory=dict)
    allocated: dict[str, float] = dataclasses.field(default_factory=dict)
    # time in collectives (the union of their events, waits for the other ranks included), how many calls,
    # and their names
    collective_micros: float = 0.0
    collective_waits: int = 0
    collectives: list[str] = dataclasses.field(default_factory=list)
    # hookprof's own workers had work during its data wait before it (an earlier traced step's conversion):
    # that wait is not the input pipeline's alone
    data_wait_shared: bool = False

    def add(self, other: StepSummary) -> None:
        """Add another run of the same step (of the same rank) to this one: times add up, the bytes in use at the
        end are the later run's."""
        self.step_micros += other.step_micros
        self.data_wait_micros += other.data_wait_micros
        self.busy_micros += other.busy_micros
        self.gaps.extend(other.gaps)
        for device, micros in other.accelerator_busy.items():
            self.accelerator_busy[device] = self.accelerator_busy.get(device, 0.0) + micros
        self.allocated.update(other.allocated)
        self.collective_micros += other.collective_micros
        self.collective_waits += other.collective_waits
        self.collectives = sorted(set(self.collectives) | set(other.collectives))
        self.data_wait_shared = self.data_wait_shared or other.data_wait_shared


class ProfileData:
    """The accumulated nodes and steps; `Profiler` builds its views and advice on it."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeData] = {}
        self.steps: dict[StepKey, StepSummary] = {}

    def step_numbers(self) -> list[int]:
        """The global steps traced (on any rank), in order."""
        return sorted({step for _, step in self.steps})

    def merge(self, other: ProfileData) -> None:
        """Add a copy of `other`'s steps (another rank's, another run's) to these; a (rank, step) both hold adds
        up, as `add_step` does (see the module doc). `other` is left as it was, and later changes to either
        change only that one."""
        for name, theirs in other.nodes.items():
            mine = self.nodes.get(name)
            if mine is None:
                self.nodes[name] = copy.deepcopy(theirs)
                continue
            for key, figures in theirs.steps.items():
                mine.add(key, figures)
            mine.inputs += [source for source in theirs.inputs if source not in mine.inputs]
            mine.memory_device = mine.memory_device or theirs.memory_device
        for key, summary in other.steps.items():
            self._add_summary(key, summary)

    def _add_summary(self, key: StepKey, summary: StepSummary) -> None:
        mine = self.steps.get(key)
        if mine is None:
            mine = self.steps[key] = StepSummary(summary.step, rank=summary.rank)
        mine.add(summary)

    def add_model(self, model: Any, op_log: dict[str, list[str]] | None = None) -> None:
        """The model's parameters as `_trainable_variables` (or `_variables`) nodes with their counts."""
        for name, shape, dtype, trainable in parameter_scopes(model):
            count = 1
            for dim in shape:
                count *= dim
            node = self.nodes.setdefault(name, NodeData(name, "Parameter", scope=name.rsplit("/", 1)[0]))
            node.op_types = ["Parameter", "_trainable_variables" if trainable else "_variables"]
            node.params = count
            node.input_shapes = [list(shape)]
            node.input_dtypes = [dtype]
        for name, types in (op_log or {}).items():
            node = self.nodes.get(name)
            if node is None:
                raise ValueError(f"op_log names {name!r}, which is no node of the model or of a traced step.")
            node.op_types = sorted(set(node.op_types) | set(types))

    def add_step(self, step: int, stats: StepStats, op_log: dict[str, list[str]] | None = None,
                 rank: int | None = None) -> None:
        """Accumulate one traced step of `rank` (default: the rank its stats say, else 0); adding the same step
        twice adds up, as TF's add_step did (see the module doc)."""
        if rank is None:
            rank = step_rank(stats)
        key = (rank, step)
        ops = [n for dev in stats.dev_stats for n in dev.node_stats if n.category == fmt.CAT_OP]
        parents = _enclosing_ops(ops)
        exclusive = _exclusive_micros(ops, parents)
        unread = _unread_output_bytes(stats, ops, parents)
        device_of = {id(n): dev.device for dev in stats.dev_stats for n in dev.node_stats}
        accelerator = _accelerator_micros(stats)
        allocated: dict[int, list[int]] = {}
        memory_device: dict[int, str] = {}
        for alloc in stats.allocations:
            if alloc.producer is not None:
                memory_device[id(alloc.producer)] = alloc.device
                entry = allocated.setdefault(id(alloc.producer), [0, 0])
                entry[0] += alloc.nbytes
                if alloc.free_ns is None:
                    entry[1] += alloc.nbytes
        producers: dict[int, set[str]] = {}
        for edge in stats.edges:
            producers.setdefault(id(edge.consumer), set()).add(edge.producer.node_name)
        for node in ops:
            data = self.nodes.get(node.node_name)
            if data is None:
                data = self.nodes[node.node_name] = NodeData(
                    node.node_name, node.op, node.scope, device_of.get(id(node), ""), node.phase,
                    op_types=[node.op], input_shapes=list(node.input_shapes or []),
                    input_dtypes=list(node.input_dtypes or []),
                    stack=list((node.args or {}).get("stack", [])))
            for source in producers.get(id(node), ()):
                if source not in data.inputs:
                    data.inputs.append(source)
            data.memory_device = memory_device.get(id(node), data.memory_device)
            cpu = exclusive.get(id(node), 0.0)
            accel = accelerator.get(id(node), 0.0)
            nbytes, residual = allocated.get(id(node), (0, 0))
            output = sum(t.nbytes or 0 for t in node.outputs or ()) + unread.get(id(node), 0)
            # (by position: COUNT, MICROS, CPU, ACCEL, BYTES, PEAK, RESIDUAL, OUTPUT, FLOPS)
            data.add(key, [1.0, cpu + accel, cpu, accel, nbytes, float(nbytes), residual, output,
                           (node.args or {}).get("flops", 0)])
        for name, types in (op_log or {}).items():
            if name in self.nodes:
                self.nodes[name].op_types = sorted(set(self.nodes[name].op_types) | set(types))
        self._add_summary(key, _step_summary(step, rank, stats, ops))


def step_rank(stats: StepStats) -> int:
    """The rank a traced step ran on (its metadata's; 0 where it does not say)."""
    return int(stats.metadata.get(fmt.RANK, 0) or 0)


def _enclosing_ops(ops: list[NodeExecStats]) -> dict[int, NodeExecStats]:
    """Each op's innermost enclosing op on its thread (`aten::linear` around `aten::addmm`), by id."""
    parents: dict[int, NodeExecStats] = {}
    by_thread: dict[int, list[NodeExecStats]] = {}
    for node in ops:
        by_thread.setdefault(node.thread_id, []).append(node)
    for nodes in by_thread.values():
        nodes.sort(key=lambda n: (n.start_ns, -n.duration_ns))
        stack: list[NodeExecStats] = []
        for node in nodes:
            while stack and stack[-1].start_ns + stack[-1].duration_ns <= node.start_ns:
                stack.pop()
            if stack:
                parents[id(node)] = stack[-1]
            stack.append(node)
    return parents


def _exclusive_micros(ops: list[NodeExecStats], parents: dict[int, NodeExecStats]) -> dict[int, float]:
    """Each op's own CPU time: its duration less the ops nested in it on its thread."""
    exclusive = {id(node): node.duration_ns / 1000 for node in ops}
    for node in ops:
        parent = parents.get(id(node))
        if parent is not None:
            exclusive[id(parent)] -= node.duration_ns / 1000
    return {key: max(0.0, value) for key, value in exclusive.items()}


def _unread_output_bytes(stats: StepStats, ops: list[NodeExecStats], parents: dict[int, NodeExecStats]
                         ) -> dict[int, int]:
    """Output bytes the ops' `outputs` leave out, by op id: the data an op made that outlives it but no op of
    the step read (the dataflow describes read data only: a fetched loss, a tensor kept for later), or, in a
    step traced without dataflow, all the data it made. Each counts for the op that made it and for every
    enclosing op it outlives, as read data does (`aten::linear` returns what its `aten::addmm` made)."""
    if not stats.allocations:
        return {}
    known = {id(node) for node in ops}
    described = bool(stats.edges) or any(node.outputs for node in ops)
    out: dict[int, int] = {}
    for alloc in stats.allocations:
        node = alloc.producer
        if node is None or id(node) not in known or (described and alloc.tensor is not None):
            continue  # with dataflow, data an op read is already among its producer's `outputs`
        nbytes = alloc.nbytes if alloc.tensor is None or alloc.tensor.nbytes is None else alloc.tensor.nbytes
        while node is not None and (alloc.free_ns is None or alloc.free_ns > node.start_ns + node.duration_ns):
            out[id(node)] = out.get(id(node), 0) + nbytes
            node = parents.get(id(node))
    return out


def _accelerator_micros(stats: StepStats) -> dict[int, float]:
    """Kernel time per op that launched it: kernel -> runtime launch (correlation) -> enclosing op."""
    kernels: dict[int, float] = {}
    for dev in stats.dev_stats:
        for node in dev.node_stats:
            if node.category == fmt.CAT_KERNEL and node.args:
                corr = node.args.get("correlation")
                kernels[corr] = kernels.get(corr, 0.0) + node.duration_ns / 1000
    if not kernels:
        return {}
    out: dict[int, float] = {}
    for dev in stats.dev_stats:
        nodes = sorted(dev.node_stats, key=lambda n: (n.thread_id, n.start_ns, -n.duration_ns))
        stack: list[NodeExecStats] = []
        for node in nodes:
            while stack and (stack[-1].thread_id != node.thread_id
                             or stack[-1].start_ns + stack[-1].duration_ns <= node.start_ns):
                stack.pop()
            if node.category == fmt.CAT_RUNTIME and node.args and node.args.get("correlation") in kernels:
                owner = next((n for n in reversed(stack) if n.category == fmt.CAT_OP), None)
                if owner is not None:
                    out[id(owner)] = out.get(id(owner), 0.0) + kernels[node.args["correlation"]]
            if node.category == fmt.CAT_OP:
                stack.append(node)
    return out


def _step_summary(step: int, rank: int, stats: StepStats, ops: list[NodeExecStats]) -> StepSummary:
    spans = {n.op: n for dev in stats.dev_stats for n in dev.node_stats if n.category == fmt.CAT_SPAN}
    waits = [n for dev in stats.dev_stats for n in dev.node_stats
             if n.category == fmt.CAT_SPAN and n.op == fmt.DATA_WAIT]
    summary = StepSummary(step, rank=rank)
    _add_collectives(summary, stats)
    # the data waits: before the step, and inside it between its batches (accumulation, steps_per_execution);
    # the step's own time is its span less those inside it
    summary.data_wait_micros += sum(wait.duration_ns for wait in waits) / 1000
    summary.data_wait_shared = any(wait.args and wait.args.get(fmt.ARG_SHARED_WITH_HOOKPROF) for wait in waits)
    train = spans.get(fmt.TRAIN_STEP)
    if train is not None:
        inside = sum(wait.duration_ns for wait in waits if wait.start_ns >= train.start_ns)
        summary.step_micros += max(0, train.duration_ns - inside) / 1000
        # busy: the union of op intervals over the host's threads (on CUDA the backward runs on autograd's
        # device thread while the step's thread waits for it); gaps: what is left
        intervals = sorted((n.start_ns, n.start_ns + n.duration_ns) for n in ops)
        busy, cursor = 0, train.start_ns
        for start, end in intervals:
            if start > cursor:
                if start - cursor > 50_000:  # 50 us and more: a gap worth naming
                    summary.gaps.append(((cursor - train.start_ns) / 1000, (start - cursor) / 1000))
            if end > cursor:
                busy += end - max(start, cursor)
                cursor = end
        summary.busy_micros += busy / 1000
    for dev in stats.dev_stats:
        kernel_time = sum(n.duration_ns for n in dev.node_stats if n.category == fmt.CAT_KERNEL)
        if kernel_time:
            summary.accelerator_busy[dev.device] = summary.accelerator_busy.get(dev.device, 0.0) + kernel_time / 1000
    last: dict[str, tuple[int, int]] = {}  # device -> (time, bytes in use) of its last allocator sample
    for sample in stats.memory_samples:
        if sample.ts_ns >= last.get(sample.device, (-1, 0))[0]:
            last[sample.device] = (sample.ts_ns, sample.total_allocated)
    summary.allocated.update({device: float(nbytes) for device, (_, nbytes) in last.items()})
    return summary


def _add_collectives(summary: StepSummary, stats: StepStats) -> None:
    """The step's time in collectives: the union of their events' intervals (an op, the backend's span on its
    own thread and a kernel of one call overlap; the wall time is what the rank spent), and the calls: the
    backend's events (`gloo:all_reduce`), else torch's c10d ops."""
    events = [n for dev in stats.dev_stats for n in dev.node_stats if COLLECTIVE.search(n.op)]
    if not events:
        return
    micros, end = 0, None
    for start, stop in sorted((n.start_ns, n.start_ns + n.duration_ns) for n in events):
        if end is None or start > end:
            micros += stop - start
            end = stop
        elif stop > end:
            micros += stop - end
            end = stop
    calls = [n for n in events if _BACKEND_CALL.match(n.op)] or [n for n in events if n.op.startswith("c10d::")]
    summary.collective_micros += micros / 1000
    summary.collective_waits += len(calls)
    summary.collectives = sorted(set(summary.collectives) | {n.op for n in calls or events})
