"""Tensor identity of a traced step borrowed from an earlier traced step with the same ops.

Dataflow and memory need to know which allocation each op read. torch keeps that only in its profiler's event
tree, which is read as one Python object per event under the training process's GIL (`EventTree`): about
three times what torch's own profiler costs a step. A training loop repeats the same ops step after step,
and with them the same pattern of reads and allocations, so the tree of one traced step is enough for the
next ones:
- a step whose tree was walked (today's path) also leaves an `IdentityTemplate`: its own threads' ops, thread
  by thread, each thread's in start order (`_step_rows`),
  each with its signature (name, argument shapes and types, as kineto's export writes them), the tensors it read
  (each as the allocation that held it, named by the op that made the allocation and its rank among that
  op's allocations, or as data from before the step) and the arguments it writes;
- a later traced step records only what kineto's export holds (torch's cheaper `trace_only` stop, with
  `profile_memory`: the export's `[memory]` instants are its allocations and frees), and `apply_template`
  joins the template to it op by op: same number of ops, same signatures, same allocations per op, or no
  arrows for that step and the reason in its metadata (`DATAFLOW_MISSING`). The allocations, their frees
  and the ops that made them come from the step itself; only which allocation each op read comes from the
  template;
- a walked step that ran one run of ops a later step does not (a DDP fit's second step rebuilds its gradient
  buckets) lends it the template without those ops (`borrow`), which the template keeps for the next steps
  like it;
- a borrowing step whose nodes, allocations and frees come in the same order as the fit's last borrowing
  step's (`_layout`: on CPU, every step of a training loop but a few) has that step's arrows, outputs and
  allocations, place by place, with its own nodes and times (`BorrowedStep`): its allocations are not joined
  to its ops, nor its arrows found, again (about 0.1 s of the render worker's CPU at 20k ops). The walked
  step leaves the same for the first borrowing step after it (`leave_walked`), where its walk's allocations
  are the export's, made in the same ops.

Templates live where steps are converted (the render worker, or the training process without one), by fit
(`TEMPLATES`, a `hookprof._runtime.by_fit.ByFit`: a token per fit). A fit's template is its own: it goes when the
fit ends (`release_fit`, registered with the fit's `FitRun`: here and in the render worker). torch is not imported
here.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Hashable
from typing import Any, NamedTuple

import numpy as np

from hookprof._runtime.by_fit import ByFit
from hookprof.step_stats import DataEdge, NodeExecStats, StepStats, TensorDescription, node_times
from hookprof.tracing.dataflow import find_edges
from hookprof.tracing.kineto_events import KinetoEvent
from hookprof.tracing.torch_dataflow import (
    ALLOCATING_PLUMBING,
    Allocation,
    Block,
    EventTree,
    Read,
    held_tensors,
    step_dataflow,
)
from hookprof.tracing.torch_memory import add_allocations, add_memory
from hookprof.tracing.tracer import HOST_DEVICE

DATAFLOW_MISSING = "dataflow_missing"  # the step's metadata: why it has no arrows and no memory objects


# the names of spans of hookprof's module calls and of autograd's backward functions, in kineto's export
MODULE_PREFIX = "module::"
BACKWARD_PREFIX = "autograd::engine::evaluate_function: "
OPTIMIZER_PREFIXES = ("Optimizer.step#", "Optimizer.zero_grad#")
# what only the step's own threads run (`_step_rows`)
STEP_THREAD_PREFIXES = (MODULE_PREFIX, BACKWARD_PREFIX, *OPTIMIZER_PREFIXES)

SIGNATURE = slice(3, None)  # a Row's signature: (name, dims, types)


class Row(NamedTuple):
    """One op or user span of kineto's export, in start order: its node, its External id (the event tree's
    `correlation_id`), its thread, and its signature: its name and its arguments' shapes and types as the
    export writes them (the lists themselves, compared as they are), what two steps' ops must share for one to
    lend the other its tensor identities (`row[SIGNATURE]`)."""

    node: NodeExecStats
    external_id: int
    tid: int
    name: str
    dims: list | None
    types: list | None


class StepRows:
    """A converted step's rows (`Row`s, in start order) and its ops by External id (the event tree's link to
    them), as `borrow` and `add_tree_records` read them, and what converted it (`source`: a
    `hookprof.tracing.kineto_replay.Conversion`, or None), on which `borrow` keeps what it found of the step's
    ops (`Matched`): a later step converted as the same one was has the same ops, and is not compared with the
    template again. A step so converted makes its rows and ids only where they are read (`Replayed`)."""

    __slots__ = ("_rows", "_by_external_id", "source")

    def __init__(self, rows: list[Row], by_external_id: dict[int, NodeExecStats], source: Any = None) -> None:
        self._rows, self._by_external_id, self.source = rows, by_external_id, source

    def rows(self) -> list[Row]:
        return self._rows

    def by_external_id(self) -> dict[int, NodeExecStats]:
        return self._by_external_id

    def matched(self, template: IdentityTemplate) -> Matched | None:
        """What `borrow` found of the step's ops against `template`, where a step converted alike was borrowed
        with it; else None."""
        found = None if self.source is None else self.source.matched
        return found if found is not None and found.template is template else None

    def match(self, found: Matched) -> None:
        if self.source is not None:
            self.source.matched = found


class Matched(NamedTuple):
    """A step's ops were its template's (`_differs` found none that differ): whether its arrows can be taken by
    place (`BorrowedStep`: its host's nodes are its ops alone, on one thread), and that thread."""

    template: IdentityTemplate
    by_place: bool
    tid: int


@dataclasses.dataclass
class Interned:
    """A step's argument lists, one object per distinct value, by their JSON: shapes, and types (with their dtype
    names). A borrowing step's conversion starts from a copy of its template's, so that its signatures hold the
    template's own lists where they are equal, and compare at once."""

    shapes: dict[bytes, list] = dataclasses.field(default_factory=dict)
    types: dict[bytes, tuple[list | None, list[str]]] = dataclasses.field(default_factory=dict)

    def copy(self) -> Interned:
        return Interned(dict(self.shapes), dict(self.types))


@dataclasses.dataclass
class IdentityTemplate:
    """What a tree-walked step says about the identity of its tensors, by op position (see the module doc)."""

    signatures: list[tuple]
    reads: list[list[tuple[int, Hashable, TensorDescription]]]  # per op: (argument position, key, tensor)
    written: list[frozenset[int]]
    made: dict[int, list[tuple[int, str]]]  # op position -> (bytes, device) of each allocation it made, in time order
    interned: Interned = dataclasses.field(default_factory=Interned)  # its step's argument lists
    # ("made", op position, rank) -> the position of the allocation plumbing op it was made in, inside that op
    # (`hookprof.tracing.torch_dataflow.allocating_op`), where it was (`without_extra_ops` reads it)
    via: dict[tuple, int] = dataclasses.field(default_factory=dict)
    # the ("made", op position, rank) of the allocations still held at the step's end (its data lasts into the next)
    lasting: frozenset[tuple] = frozenset()
    # what the fit's last borrowing step (or its walked step: `leave_walked`) found, for its next one of the same
    # layout
    last: BorrowedStep | None = dataclasses.field(default=None, compare=False, repr=False)
    # this template without one run of its ops that a step lacked, once a step borrowed it (`borrow`); whether
    # this template is one such (none is made of it again: its keys are another template's places)
    lighter: IdentityTemplate | None = dataclasses.field(default=None, compare=False, repr=False)
    derived: bool = dataclasses.field(default=False, compare=False, repr=False)

    @functools.cached_property
    def held(self) -> dict[Hashable, TensorDescription]:
        """What each allocation the step made held, by its key (`EventTree.held`): the same in every step that
        matches, whose allocations have these sizes."""
        return held_tensors(self.reads, {("made", at, rank): nbytes for at, made in self.made.items()
                                         for rank, (nbytes, _) in enumerate(made)})

    @functools.cached_property
    def fixed(self) -> list[bool]:
        """Per op: whether it reads no data the step made (its reads are the same in every matching step)."""
        return [all(key[0] != "made" for _, key, _ in reads) for reads in self.reads]


def without_extra_ops(template: IdentityTemplate, step: StepRows) -> IdentityTemplate | None:
    """The template as it would be of its step without one run of its ops that `step` lacks, where that is what
    sets them apart: `step`'s ops (its own threads', `_step_rows`) are the template's first and last ones, and
    the template has a contiguous run of others between them (the fit's first steps often do: DDP rebuilds its
    gradient buckets in its second, with broadcasts and copies). None elsewhere: where ops alike around that
    run could put it a place earlier or later (which op is which could not be told), and where an op that both
    have reads data that one of the others made (the step lacks it: what that op read there cannot be known).
    The ops that both have read what they read in the template's step, and make what they made there, each
    at its new place. A step given identities so is still checked against its own allocations
    (`apply_template`).

    This assumes that what the run made and left stands, in the steps without it, where an earlier step's run
    left it: an op before the run that read data the run then replaces would read, without the run, what ops
    after it read, and no arrow joins the two (a writer before the run and a reader after it, say). Nothing in
    the step's allocations can show that; the DDP rebuild does not do it (`tests/test_step_identity.py` holds
    each step so borrowing to its own walk). Only a walked step's template is so lightened."""
    signatures = template.signatures
    main = [row[SIGNATURE] for row in _step_rows(step.rows())]
    extra = len(signatures) - len(main)
    if extra <= 0 or not main or template.derived:
        return None
    count = len(main)
    first = 0  # (how many ops both start with)
    while first < count and main[first] == signatures[first]:
        first += 1
    last = 0  # (how many both end with)
    while last < count and main[-1 - last] == signatures[-1 - last]:
        last += 1
    # the others run from the end of the common start to the common end, at one place only: where ops alike
    # around them could put them a place earlier or later, which op is which could not be told
    if first + last != count:
        return None
    end = first + extra

    def place(at: int) -> int:
        return at - extra if at >= end else at

    # what the others made goes: the allocations they own, and those made in their allocation plumbing that an
    # op around them owns (DDP's bucket rebuild allocates in `aten::empty` ops right inside its forward)
    kept: dict[tuple, tuple] = {}  # ("made", at, rank) of an allocation that stays -> its key after
    made: dict[int, list[tuple[int, str]]] = {}
    for at, allocations in template.made.items():
        if first <= at < end:
            continue
        mine = made[place(at)] = []
        for rank, allocation in enumerate(allocations):
            key = ("made", at, rank)
            inside = template.via.get(key)
            if inside is None or not first <= inside < end:
                kept[key] = ("made", place(at), len(mine))
                mine.append(allocation)
    reads = []
    for at, op_reads in enumerate(template.reads):
        if first <= at < end:
            continue
        mapped = []
        for argument, key, tensor in op_reads:
            if key[0] == "made":
                if key in kept:
                    key = kept[key]
                elif key in template.lasting:  # (what the others made and left: in a step without them, data
                    key = ("before", key)      # from before it, which they made in an earlier step)
                else:  # (a temporary of theirs: what the op reads without them cannot be known)
                    return None
            mapped.append((argument, key, tensor))
        reads.append(mapped)
    written = template.written[:first] + template.written[end:]
    return IdentityTemplate(signatures[:first] + signatures[end:], reads, written, made, template.interned,
                            derived=True)


def _step_rows(rows: list[Row]) -> list[Row]:
    """The rows of the step's own threads, thread by thread (in the order each first ran an op), each thread's in
    start order: the thread of the step's first op and the thread with the most ops (the training's: its
    backward runs there on CPU), and those that run its module calls, its optimizer or its backward (on CUDA,
    autograd runs the backward on a thread of its own). Others (a DataLoader's pin-memory thread, say) run ops
    whose number and times vary from step to step."""
    counts = collections.Counter(row.tid for row in rows)
    if len(counts) <= 1:
        return rows
    own = {rows[0].tid, counts.most_common(1)[0][0]}
    own.update(row.tid for row in rows if row.name.startswith(STEP_THREAD_PREFIXES))
    by_thread: dict[int, list[Row]] = {}
    for row in rows:
        if row.tid in own:
            by_thread.setdefault(row.tid, []).append(row)
    return [row for thread in by_thread.values() for row in thread]


def _devices(allocations: list[Allocation]) -> dict[int, str]:
    """The device of each allocation (not free) among `allocations`, by its id."""
    return {a.allocation_id: a.device for a in allocations if a.nbytes > 0}


def _bytes_on(made: list[tuple[int, str]]) -> str:
    """Allocations as a mismatch's reason says them: `[512, 512] bytes on /device:CUDA:0`."""
    devices = sorted({device for _, device in made})
    return f"{[nbytes for nbytes, _ in made]} bytes" + (f" on {', '.join(devices)}" if devices else "")


def build_template(tree: EventTree, rows: list[Row], interned: Interned | None = None) -> IdentityTemplate:
    """The template of a step whose event tree was walked, with its export's `rows` (see `Row`) and the
    argument lists they share (`Interned`)."""
    rows = _step_rows(rows)
    position = {row.external_id: i for i, row in enumerate(rows)}
    made: dict[int, list[tuple[int, str]]] = {}
    keys: dict[int, Hashable] = {}  # allocation id -> ("made", op position, rank)
    via: dict[tuple, int] = {}
    lasting = set()
    devices = _devices(tree.allocations)
    for allocation_id, block in tree.blocks.items():  # (in time order)
        at = -1 if block.op is None else position.get(block.op, -2)
        by_op = made.setdefault(at, [])
        key = keys[allocation_id] = ("made", at, len(by_op))
        by_op.append((block.nbytes, devices[allocation_id]))
        if block.via is not None and block.via in position:
            via[key] = position[block.via]
        if block.free_ns is None:
            lasting.add(key)
    reads: list[list] = [[] for _ in rows]
    written: list[frozenset[int]] = [frozenset()] * len(rows)
    for op_id, op_reads, op_written in tree.ops:
        at = position.get(op_id)
        if at is None:
            continue
        reads[at] = [(argument, keys.get(allocation_id, ("before", allocation_id)), tensor)
                     for argument, allocation_id, tensor in op_reads]
        written[at] = op_written
    return IdentityTemplate([row[SIGNATURE] for row in rows], reads, written, made, interned or Interned(), via,
                            frozenset(lasting))


def memory_events(instants: list[KinetoEvent], base: int) -> tuple[list[Allocation], list[int]]:
    """kineto's `[memory]` instants as the step's allocations and frees in time order, with each one's thread: an
    allocation's id (this step's own) is its place in the list, a free has the id of the allocation it frees
    (the last one at its address), or a negative one of its own for memory from before the step."""
    allocations: list[Allocation] = []
    threads: list[int] = []
    live: dict[tuple[str, int], int] = {}  # (device, address) -> allocation id
    for time, _, event in sorted((round(e.ts * 1000) + base, i, e) for i, e in enumerate(instants)):
        fields = event.args
        nbytes, address = fields.nbytes, fields.address
        cuda = fields.device_type != 0  # (kineto's device types: 0 the CPU, 1 CUDA)
        device = f"/device:CUDA:{max(0, fields.device_id)}" if cuda else HOST_DEVICE
        if nbytes > 0:
            allocation_id = live[(device, address)] = len(allocations)
        else:
            allocation_id = live.pop((device, address), -1 - len(allocations))
        allocations.append(Allocation(time, allocation_id, nbytes, device, fields.total_allocated,
                                      fields.total_reserved))
        threads.append(event.tid)
    return allocations, threads


def step_allocations(allocations: list[Allocation], threads: list[int], rows: list[Row]) -> dict[int, Block]:
    """The step's allocations (`memory_events`) as `Block`s by id, each made in the innermost op around it on
    its thread (allocation plumbing skipped, as `allocating_op` does). `rows` are in start order (outer
    first)."""
    parent: list[int] = []  # row position -> the position of the row around it, -1 for none
    open_rows: dict[int, list[int]] = {}
    blocks: dict[int, Block] = {}
    cursor = 0

    ends: list[int] = []  # row position -> its end, for the rows reached so far

    def enclosing(tid: int, time: int) -> int:
        nonlocal cursor
        count = len(rows)
        while cursor < count:
            row = rows[cursor]
            start = row.node.start_ns
            if start > time:
                break
            stack = open_rows.get(row.tid)
            if stack is None:
                stack = open_rows[row.tid] = []
            while stack and ends[stack[-1]] <= start:
                stack.pop()
            parent.append(stack[-1] if stack else -1)
            ends.append(start + row.node.duration_ns)
            stack.append(cursor)
            cursor += 1
        stack = open_rows.get(tid)
        while stack and ends[stack[-1]] < time:
            stack.pop()
        return stack[-1] if stack else -1

    for event, tid in zip(allocations, threads):
        time = event.start_ns
        if event.nbytes > 0:
            at = enclosing(tid, time)
            while (at >= 0 and rows[at].node.op.startswith(ALLOCATING_PLUMBING) and parent[at] >= 0):
                at = parent[at]
            outer = []
            around = parent[at] if at >= 0 else -1
            while around >= 0:
                outer.append(rows[around].external_id)
                around = parent[around]
            blocks[event.allocation_id] = Block(event.nbytes, time, None if at < 0 else rows[at].external_id,
                                                tuple(outer))
        else:
            block = blocks.get(event.allocation_id)
            if block is not None:
                block.free_ns = time
    return blocks


NOT_TENSORS = ("Scalar", "ScalarList", "TensorList", "GenericList", "")  # kineto's argument types with no shape


def _said(signature: tuple) -> str:
    """An op's signature as the reason for a mismatch says it: `aten::linear, shapes [[4, 8], [16, 8], [16]]`."""
    name, dims, types = signature
    return f"{name}, shapes {[d for d, t in zip(dims or (), types or ()) if t not in NOT_TENSORS]}"


def _differs(template: IdentityTemplate, main: list[Row]) -> str | None:
    """Why the step's ops (`main`, its own threads' rows: `_step_rows`) differ from its template's; None where they
    do not."""
    if len(main) != len(template.signatures):
        return (f"its {len(main)} ops differ from the {len(template.signatures)} of the step its tensor "
                "identities were taken from")
    signatures = [row[SIGNATURE] for row in main]  # (the template's own lists where equal: `Interned`)
    if signatures != template.signatures:
        i, signature = next((i, signature) for i, signature in enumerate(signatures)
                            if signature != template.signatures[i])
        return (f"its op {i} ({_said(signature)}) differs from the step its tensor identities were taken from "
                f"({_said(template.signatures[i])})")
    return None


def apply_template(template: IdentityTemplate, main: list[Row], rows: list[Row], allocations: list[Allocation],
                   threads: list[int]) -> tuple[EventTree | None, str | None]:
    """The step's identity as an `EventTree` (what dataflow and memory read) from `template` and the step's own
    export (`rows`, `main` those of its own threads, whose ops are the template's: `_differs`; its allocations
    and frees with their threads: `memory_events`); or None and why they do not match."""
    blocks = step_allocations(allocations, threads, rows)
    index = {row.external_id: i for i, row in enumerate(main)}
    made: dict[int, list[int]] = {}  # op position -> this step's allocation ids it made, in time order
    for allocation_id, block in blocks.items():
        at = -1 if block.op is None else index.get(block.op, -2)
        made.setdefault(at, []).append(allocation_id)
    devices = _devices(allocations)
    # (bytes and device: the ops of two threads alike, a replica's each, could trade places from step to step)
    for at, theirs in template.made.items():
        mine = [(blocks[a].nbytes, devices[a]) for a in made.get(at, ())]
        if mine != theirs:
            where = {-1: "outside any op", -2: "in ops of other threads"}.get(at) or f"in op {at} ({main[at].name})"
            return None, (f"its allocations {where} ({_bytes_on(mine)}) differ from those of the step its tensor "
                          f"identities were taken from ({_bytes_on(theirs)})")
    ops = []
    for row, reads, written, fixed in zip(main, template.reads, template.written, template.fixed):
        if fixed:  # (shared with the template: nothing changes reads)
            ops.append((row.external_id, reads, written))
            continue
        mapped: list[Read] = []
        for argument, key, tensor in reads:
            if key[0] == "made":
                mapped.append((argument, made[key[1]][key[2]], tensor))
            else:
                mapped.append((argument, key, tensor))
        ops.append((row.external_id, mapped, written))
    if main and main[0].tid != main[-1].tid:
        # ops of several threads (`_step_rows`: thread by thread): in start order, as a walk has them, and what
        # each allocation held found from their reads in that order, which may interleave otherwise than the
        # template's did
        order = sorted(range(len(ops)), key=lambda i: main[i].node.start_ns)
        return EventTree.from_parts([ops[i] for i in order], allocations, blocks), None
    held = {made[key[1]][key[2]]: tensor for key, tensor in template.held.items()}
    return EventTree.from_parts(ops, allocations, blocks, held), None


def add_tree_records(tree: EventTree, stats: StepStats, nodes_by_id: dict[int, NodeExecStats], dataflow: bool,
                     memory: bool) -> None:
    """The step's arrows and its nodes' outputs (`dataflow`), its allocations and the allocator's samples
    (`memory`), from its identities (`tree`: walked, or a template's applied to it)."""
    if dataflow:
        stats.edges = find_edges(step_dataflow(tree, nodes_by_id))
    if memory:
        add_allocations(tree, stats, nodes_by_id)


def _layout(nodes: list[NodeExecStats], allocations: list[Allocation], threads: list[int], tid: int) -> tuple:
    """What a borrowing step's arrows, outputs and allocations follow from, besides its ops (its template's) and
    times: the order of its nodes' starts and ends and of its allocations and the frees of them (which comes
    first, which fall together), each allocation's bytes, device and whether it was on thread `tid` (the
    step's), and which allocation each such free frees. Frees of memory from before the step change nothing
    of them and are left out (their number varies from step to step)."""
    # (nodes in start order; allocations in time order, by rank: frees point to their allocation's)
    ranks: dict[int, int] = {}
    events: list[tuple[int, int, str, bool]] = []
    times: list[int] = []
    for event, thread in zip(allocations, threads):
        if event.nbytes > 0:
            ranks[event.allocation_id] = len(ranks)
            events.append((event.nbytes, -1, event.device, thread == tid))
        elif event.allocation_id >= 0:
            events.append((0, ranks[event.allocation_id], event.device, thread == tid))
        else:
            continue
        times.append(event.start_ns)
    count = len(nodes)
    starts, durations = node_times(nodes)
    values = np.concatenate((starts, starts + durations,
                             np.array(times, np.int64)))
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    return count, order.tobytes(), np.packbits(ordered[1:] == ordered[:-1]).tobytes(), events


class BorrowedStep:
    """A borrowing step's arrows, its nodes' outputs and its allocations' producers and tensors, by their
    places (its host's nodes in order, its allocations by rank), with what they follow from (`_layout`, and
    which of them were recorded): the fit's next borrowing step of the same layout has the same, its own nodes
    and times put in (`give`), without joining its allocations to its ops or finding its arrows again. Kept
    on the fit's template (`IdentityTemplate.last`); made only where the step's ops all ran on one thread, on
    the host alone."""

    __slots__ = ("layout", "recorded", "edges", "outputs", "made")

    def __init__(self, layout: tuple, recorded: tuple[bool, bool], stats: StepStats,
                 nodes: list[NodeExecStats]) -> None:
        self.layout, self.recorded = layout, recorded
        place = {id(node): i for i, node in enumerate(nodes)}
        # (an edge's name is its producer's node name and the output's slot: `find_edges`)
        self.edges = [(place[id(e.producer)], place[id(e.consumer)], e.tensor, e.name[len(e.producer.node_name):])
                      for e in stats.edges]
        self.outputs = [(i, node.outputs) for i, node in enumerate(nodes) if node.outputs is not None]
        self.made = [(None if a.producer is None else place[id(a.producer)], a.tensor) for a in stats.allocations]

    def give(self, stats: StepStats, nodes: list[NodeExecStats], allocations: list[Allocation]) -> None:
        """Give a step of this one's layout (`nodes`, its `allocations` and frees) its arrows, outputs and
        allocations."""
        dataflow, memory = self.recorded
        if dataflow:
            stats.edges = [DataEdge(nodes[p], nodes[c], tensor, nodes[p].node_name + slot)
                           for p, c, tensor, slot in self.edges]
            for i, outputs in self.outputs:
                nodes[i].outputs = list(outputs)
        if memory:
            made = iter(self.made)
            freed = {e.allocation_id: e.start_ns for e in allocations if e.nbytes <= 0 and e.allocation_id >= 0}

            def block(event: Allocation) -> tuple[NodeExecStats | None, TensorDescription | None, int | None]:
                producer, tensor = next(made)
                return None if producer is None else nodes[producer], tensor, freed.get(event.allocation_id)

            add_memory(stats, allocations, block)


def borrow(template: IdentityTemplate, stats: StepStats, step: StepRows, instants: list[KinetoEvent], base: int,
           dataflow: bool, memory: bool) -> str | None:
    """Give a step the arrows and memory records (those `dataflow` and `memory` ask for) that `template`'s
    identities make of its own export (`step`: its rows; its `[memory]` instants, its times after `base` ns); or
    say why they do not fit it. A step of the layout of the fit's last borrowing step takes what that one found
    (`BorrowedStep`). A step that lacks one run of the template's ops takes what the template without them gives
    (`without_extra_ops`), which the template keeps for the next steps like it (`IdentityTemplate.lighter`) and
    stays the fit's: a fit whose walked step was the odd one (DDP's bucket rebuild) borrows the lighter one at
    each step, one whose step without the run is the odd one (a step a `GradScaler` skips) borrows the walked
    step's own again at the next."""
    kept = template.lighter
    # (a step converted as one that borrowed the lighter one has its ops: tried first, the walked step's rows,
    # which would say at once that they differ, are not made at each step)
    first = kept is not None and step.matched(kept) is not None
    if first and _borrow_from(kept, stats, step, instants, base, dataflow, memory) is None:
        return None
    reason = _borrow_from(template, stats, step, instants, base, dataflow, memory)
    if reason is None:
        return None
    if kept is not None and not first and _borrow_from(kept, stats, step, instants, base, dataflow, memory) is None:
        return None
    lighter = without_extra_ops(template, step)
    if lighter is None or _borrow_from(lighter, stats, step, instants, base, dataflow, memory) is not None:
        return reason
    template.lighter = lighter
    return None


def _borrow_from(template: IdentityTemplate, stats: StepStats, step: StepRows, instants: list[KinetoEvent],
                 base: int, dataflow: bool, memory: bool) -> str | None:
    """`borrow` from `template` as it is."""
    host = stats.device(HOST_DEVICE)
    matched = step.matched(template)
    if matched is None:
        rows = step.rows()
        main = _step_rows(rows)
        reason = _differs(template, main)
        if reason is not None:
            return reason
        matched = _matched(template, stats, rows, main)
        step.match(matched)
    allocations, threads = memory_events(instants, base)
    layout = _layout(host.node_stats, allocations, threads, matched.tid) if matched.by_place else None
    last = template.last
    if layout is not None and last is not None and last.recorded == (dataflow, memory) and last.layout == layout:
        last.give(stats, host.node_stats, allocations)
        return None
    rows = step.rows()
    tree, reason = apply_template(template, _step_rows(rows), rows, allocations, threads)
    if tree is None:
        return reason
    add_tree_records(tree, stats, step.by_external_id(), dataflow, memory)
    if layout is not None:
        template.last = BorrowedStep(layout, (dataflow, memory), stats, host.node_stats)
    return None


def _matched(template: IdentityTemplate, stats: StepStats, rows: list[Row], main: list[Row]) -> Matched:
    """A step whose ops are `template`'s (its `rows`, `main` those of its own threads: `_step_rows`)."""
    # (by place: the host's nodes must be its rows alone, or a node that is none, a CUDA runtime call say, could
    # trade places with an op from one step to the next and leave the order of starts and ends as it was; one
    # thread: `_step_rows` groups them)
    by_place = bool(len(stats.dev_stats) == 1 and len(main) == len(rows) == len(stats.device(HOST_DEVICE).node_stats)
                    and rows and main[0].tid == main[-1].tid)
    return Matched(template, by_place, rows[0].tid if rows else 0)


def leave_walked(template: IdentityTemplate, stats: StepStats, step: StepRows, tree: EventTree,
                 instants: list[KinetoEvent], base: int, dataflow: bool, memory: bool) -> None:
    """The walked step that `template` was made of (`tree`, its walk) leaves, for the fit's next borrowing step,
    what a borrowing step leaves (`borrow`): that its ops are the template's (`Matched`), and its arrows, outputs
    and allocations by place (`BorrowedStep`), as its walk found them (`stats`, `add_tree_records`; its
    `[memory]` instants after `base` ns: its layout). A next step of its layout is given them: joining the
    template to the step it was made of finds what its walk found, and to a step of the same layout, the same
    by place. That holds where the walk's allocations are the export's, made in the same ops: their bytes and
    devices in time order, and for each the op the export nests it in (`step_allocations`, as a borrowing step
    is joined) is the one the walk found. Elsewhere, or where the step's ops are not one thread's alone on the
    host, no `BorrowedStep` is left, and the next step is joined."""
    rows = step.rows()
    matched = _matched(template, stats, rows, _step_rows(rows))
    step.match(matched)
    if not matched.by_place:
        return
    allocations, threads = memory_events(instants, base)
    made = [a for a in allocations if a.nbytes > 0]
    walked = [a for a in tree.allocations if a.nbytes > 0]
    if [(a.nbytes, a.device) for a in walked] != [(a.nbytes, a.device) for a in made]:
        return
    blocks = step_allocations(allocations, threads, rows)
    if [tree.blocks[a.allocation_id].op for a in walked] != [blocks[a.allocation_id].op for a in made]:
        return
    nodes = stats.device(HOST_DEVICE).node_stats
    template.last = BorrowedStep(_layout(nodes, allocations, threads, matched.tid), (dataflow, memory), stats, nodes)


# Where this process converts steps (the render worker, or a training process without one), the templates of
# the fits whose steps it converted, each fit's newest.
TEMPLATES: ByFit[IdentityTemplate] = ByFit("identity templates")


def release_fit(token: str) -> None:
    """Fit `token` ended (its `FitRun` closes, after its hooks flushed what they traced): its template goes,
    here and in the render worker, if one runs."""
    TEMPLATES.release(token)
