"""Tensor identity of a traced step borrowed from an earlier traced step with the same ops.

Dataflow and memory need to know which allocation each op read. torch keeps that only in its profiler's event
tree, which is read as one Python object per event under the training process's GIL (`EventTree`): about
three times what torch's own profiler costs a step. A training loop repeats the same ops step after step,
and with them the same pattern of reads and allocations, so the tree of one traced step is enough for the
next ones:
- a step whose tree was walked (today's path) also leaves an `IdentityTemplate`: its ops in start order,
  each with its signature (name, argument shapes and types, as kineto's export writes them), the tensors it read
  (each as the allocation that held it, named by the op that made the allocation and its rank among that
  op's allocations, or as data from before the step) and the arguments it writes;
- a later traced step records only what kineto's export holds (torch's cheaper `trace_only` stop, with
  `profile_memory`: the export's `[memory]` instants are its allocations and frees), and `apply_template`
  joins the template to it op by op: same number of ops, same signatures, same allocations per op, or no
  arrows for that step and the reason in its metadata (`DATAFLOW_MISSING`). The allocations, their frees
  and the ops that made them come from the step itself; only which allocation each op read comes from the
  template.

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

from hookprof._runtime.by_fit import ByFit
from hookprof.step_stats import NodeExecStats, TensorDescription
from hookprof.tracing.torch_dataflow import ALLOCATING_PLUMBING, Allocation, Block, EventTree, Read, held_tensors
from hookprof.tracing.tracer import HOST_DEVICE

DATAFLOW_MISSING = "dataflow_missing"  # the step's metadata: why it has no arrows and no memory objects


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


@dataclasses.dataclass
class Interned:
    """A step's argument lists, one object per distinct value: shapes by their JSON, types by their tuple (with
    their dtype names). A borrowing step's conversion starts from a copy of its template's, so that its
    signatures hold the template's own lists where they are equal, and compare at once."""

    shapes: dict[bytes, list] = dataclasses.field(default_factory=dict)
    types: dict[tuple, tuple[list | None, list[str]]] = dataclasses.field(default_factory=dict)

    def copy(self) -> Interned:
        return Interned(dict(self.shapes), dict(self.types))


@dataclasses.dataclass
class IdentityTemplate:
    """What a tree-walked step says about the identity of its tensors, by op position (see the module doc)."""

    signatures: list[tuple]
    reads: list[list[tuple[int, Hashable, TensorDescription]]]  # per op: (argument position, key, tensor)
    written: list[frozenset[int]]
    made: dict[int, list[int]]  # op position -> the bytes of each allocation it made, in time order
    interned: Interned = dataclasses.field(default_factory=Interned)  # its step's argument lists

    @functools.cached_property
    def held(self) -> dict[Hashable, TensorDescription]:
        """What each allocation the step made held, by its key (`EventTree.held`): the same in every step that
        matches, whose allocations have these sizes."""
        return held_tensors(self.reads, {("made", at, rank): nbytes for at, sizes in self.made.items()
                                         for rank, nbytes in enumerate(sizes)})

    @functools.cached_property
    def fixed(self) -> list[bool]:
        """Per op: whether it reads no data the step made (its reads are the same in every matching step)."""
        return [all(key[0] != "made" for _, key, _ in reads) for reads in self.reads]


def _main_thread(rows: list[Row]) -> list[Row]:
    """The rows of the thread with the most ops (the step's own: its backward runs there on CPU)."""
    counts = collections.Counter(row.tid for row in rows)
    if len(counts) <= 1:
        return rows
    tid = counts.most_common(1)[0][0]
    return [row for row in rows if row.tid == tid]


def build_template(tree: EventTree, rows: list[Row], interned: Interned | None = None) -> IdentityTemplate:
    """The template of a step whose event tree was walked, with its export's `rows` (see `Row`) and the
    argument lists they share (`Interned`)."""
    rows = _main_thread(rows)
    position = {row.external_id: i for i, row in enumerate(rows)}
    made: dict[int, list[int]] = {}
    keys: dict[int, Hashable] = {}  # allocation id -> ("made", op position, rank)
    for allocation_id, block in tree.blocks.items():  # (in time order)
        at = -1 if block.op is None else position.get(block.op, -2)
        sizes = made.setdefault(at, [])
        keys[allocation_id] = ("made", at, len(sizes))
        sizes.append(block.nbytes)
    reads: list[list] = [[] for _ in rows]
    written: list[frozenset[int]] = [frozenset()] * len(rows)
    for op_id, op_reads, op_written in tree.ops:
        at = position.get(op_id)
        if at is None:
            continue
        reads[at] = [(argument, keys.get(allocation_id, ("before", allocation_id)), tensor)
                     for argument, allocation_id, tensor in op_reads]
        written[at] = op_written
    return IdentityTemplate([row[SIGNATURE] for row in rows], reads, written, made, interned or Interned())


def step_allocations(instants: list[dict[str, Any]], rows: list[Row], base: int
                     ) -> tuple[list[Allocation], dict[int, Block]]:
    """The step's allocations and frees from kineto's `[memory]` instants, each allocation as a `Block` made in
    the innermost op around it (allocation plumbing skipped, as `allocating_op` does), by an id of this
    step's own. `rows` are in start order (outer first)."""
    parent: list[int] = []  # row position -> the position of the row around it, -1 for none
    open_rows: dict[int, list[int]] = {}
    events = sorted((round(e["ts"] * 1000) + base, i, e) for i, e in enumerate(instants))
    allocations: list[Allocation] = []
    blocks: dict[int, Block] = {}
    live: dict[tuple[str, int], int] = {}  # (device, address) -> allocation id
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

    for time, _, event in events:
        fields = event.get("args") or {}
        nbytes, address = fields.get("Bytes", 0), fields.get("Addr", 0)
        cuda = fields.get("Device Type", 0) != 0  # (kineto's device types: 0 the CPU, 1 CUDA)
        device = f"/device:CUDA:{max(0, fields.get('Device Id', 0))}" if cuda else HOST_DEVICE
        if nbytes > 0:
            allocation_id = len(allocations)
            live[(device, address)] = allocation_id
            at = enclosing(event.get("tid", 0), time)
            while (at >= 0 and rows[at].node.op.startswith(ALLOCATING_PLUMBING) and parent[at] >= 0):
                at = parent[at]
            outer = []
            around = parent[at] if at >= 0 else -1
            while around >= 0:
                outer.append(rows[around].external_id)
                around = parent[around]
            blocks[allocation_id] = Block(nbytes, time, None if at < 0 else rows[at].external_id, tuple(outer))
        else:
            allocation_id = live.pop((device, address), -1 - len(allocations))
            block = blocks.get(allocation_id)
            if block is not None:
                block.free_ns = time
        allocations.append(Allocation(time, allocation_id, nbytes, device, fields.get("Total Allocated", 0),
                                      fields.get("Total Reserved", 0)))
    return allocations, blocks


NOT_TENSORS = ("Scalar", "ScalarList", "TensorList", "GenericList", "")  # kineto's argument types with no shape


def _said(signature: tuple) -> str:
    """An op's signature as the reason for a mismatch says it: `aten::linear, shapes [[4, 8], [16, 8], [16]]`."""
    name, dims, types = signature
    return f"{name}, shapes {[d for d, t in zip(dims or (), types or ()) if t not in NOT_TENSORS]}"


def apply_template(template: IdentityTemplate, rows: list[Row], instants: list[dict[str, Any]], base: int
                   ) -> tuple[EventTree | None, str | None]:
    """The step's identity as an `EventTree` (what dataflow and memory read) from `template` and the step's own
    export (`rows`, its `[memory]` instants); or None and why they do not match."""
    main = _main_thread(rows)
    if len(main) != len(template.signatures):
        return None, (f"its {len(main)} ops differ from the {len(template.signatures)} of the step its tensor "
                      "identities were taken from")
    signatures = [row[SIGNATURE] for row in main]  # (the template's own lists where equal: `Interned`)
    if signatures != template.signatures:
        i, signature = next((i, signature) for i, signature in enumerate(signatures)
                            if signature != template.signatures[i])
        return None, (f"its op {i} ({_said(signature)}) differs from the step its tensor identities were "
                      f"taken from ({_said(template.signatures[i])})")
    allocations, blocks = step_allocations(instants, rows, base)
    index = {row.external_id: i for i, row in enumerate(main)}
    made: dict[int, list[int]] = {}  # op position -> this step's allocation ids it made, in time order
    for allocation_id, block in blocks.items():
        at = -1 if block.op is None else index.get(block.op, -2)
        made.setdefault(at, []).append(allocation_id)
    for at, sizes in template.made.items():
        mine = [blocks[a].nbytes for a in made.get(at, ())]
        if mine != sizes:
            where = {-1: "outside any op", -2: "in ops of other threads"}.get(at) or f"in op {at} ({main[at].name})"
            return None, (f"its allocations {where} ({mine} bytes) differ from those of the step its tensor "
                          f"identities were taken from ({sizes})")
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
    held = {made[key[1]][key[2]]: tensor for key, tensor in template.held.items()}
    return EventTree.from_parts(ops, allocations, blocks, held), None


# Where this process converts steps (the render worker, or a training process without one), the templates of
# the fits whose steps it converted, each fit's newest.
TEMPLATES: ByFit[IdentityTemplate] = ByFit("identity templates")


def held_fits() -> list[str]:
    """The tokens of the fits whose templates this process holds (run in the render worker by `WORKER.call`)."""
    return TEMPLATES.tokens()


def release_fit(token: str) -> None:
    """Fit `token` ended (its `FitRun` closes, after its hooks flushed what they traced): its template goes,
    here and in the render worker, if one runs."""
    TEMPLATES.release(token)
