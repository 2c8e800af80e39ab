"""A traced step converted again from its fit's last conversion (`hookprof.tracing.kineto_trace`), where its ops are
that step's: the same ops, with the same names, threads and arguments, in the same order, nested alike.

A fit traces the same training step again and again: converting each one's export event by event (its scopes,
phases, names and argument lists found anew for each of 20k ops) cost the render worker about 80 ms of CPU a
step. A conversion leaves a `Conversion`: its ops' signatures in the export's order, its nodes (their untimed
fields), and what their times decided (which event each one was nested in, which ended before it started,
which ops were the optimizer's for starting after the backward's end). The fit's next step whose signatures are
the same, and whose own times decide the same (checked at once, with numpy), gets the last step's nodes with its
own times, External ids and sequence numbers, without going through its events one by one. Anything else (a
step with kernels or Python stacks, ops that differ, times that nest otherwise) is converted in full, and leaves
its own.

What a fit keeps here is its last two kinds of steps' conversions (`CONVERSIONS`, by the fit's token, released
when the fit ends; about 0.4 KB a node each, and none of a step of more nodes than the renderers keep parts of:
`hookprof.step_stats.ShapedParts.KEEP_NODES_MAX`), where its steps are converted (the render worker, or the training
process without one). A replayed step's nodes share the kept argument lists and args dicts (`{"flops": n}`)
with the step they were converted from, as a borrowing step's share its template's argument lists: nothing
changes a converted step's nodes. torch-free.
"""

from __future__ import annotations

import functools
import itertools
import operator
from typing import Any

import msgspec
import numpy as np

from hookprof._runtime.by_fit import ByFit
from hookprof.step_stats import DeviceStepStats, NodeExecStats
from hookprof.tracing.kineto_events import KinetoEvent
from hookprof.tracing.step_identity import Matched, Row, StepRows

_NODE = operator.attrgetter("node_name", "op", "thread_id", "scope", "phase", "input_shapes", "input_dtypes",
                            "category", "args")
_new_row = functools.partial(tuple.__new__, Row)  # (a `Row` from a tuple, without its __new__'s Python call)


def spans_of(events: list[KinetoEvent], converted: frozenset[str]) -> list[KinetoEvent]:
    """The spans of `events` whose categories are `converted`, in the export's order."""
    return [event for event in events if event.ph == "X" and event.cat in converted]


def signatures(spans: list[KinetoEvent], valued: frozenset[str]) -> list[tuple]:
    """Each span's signature: what two steps' spans must share for one to be converted as the other was (all but
    times and ids: category, name, thread, argument shapes and types as the export writes them, and the values of
    scalar arguments of the ops whose conversion reads them: `valued`; an optimizer's scalars change from step to
    step)."""
    # (a list comprehension: faster here than `map` with `operator.attrgetter` over the records)
    return [(e.cat, e.name, e.tid, (a := e.args).dims, a.types, a.concrete if e.name in valued else None)
            for e in spans]


def memory_instants(events: list[KinetoEvent]) -> list[KinetoEvent]:
    """The export's `[memory]` instants (its allocations and frees), in its order."""
    return [event for event in events if event.ph != "X" and event.name == "[memory]"]


_TID = operator.attrgetter("tid")


def _times(spans: list[KinetoEvent], base: int) -> tuple[np.ndarray, np.ndarray]:
    """Each span's start (ns since the epoch) and duration (ns), as the conversion rounds them (`round(ts *
    1000)`: numpy's `rint` rounds halves to even as Python's `round` does, on the same doubles)."""
    count = len(spans)
    starts = np.rint(np.fromiter(map(_TS, spans), np.float64, count) * 1000).astype(np.int64) + base
    durations = np.rint(np.fromiter(map(_DUR, spans), np.float64, count) * 1000).astype(np.int64)
    return starts, durations


_TS, _DUR = operator.attrgetter("ts"), operator.attrgetter("dur")


def _order(starts: np.ndarray, durations: np.ndarray, threads: np.ndarray) -> np.ndarray:
    """The spans' places in start order, as the conversion sorts them: by start, the longer first, by thread,
    by place in the export."""
    return np.lexsort((np.arange(len(starts)), threads, -durations, starts))


class Conversion:
    """What converting one step decided (see the module's doc), for the fit's next step of the same ops.

    Made from the conversion's own records: `spans`/`signatures` (`signatures`), `nodes` in start order, and per
    node in start order: `parents` (the place of the span it was nested in, -1 for none), `popped` (pairs: a
    span that had ended, the node at whose start it was found so), `by_rule` (pairs: a node whose phase its start
    decided, whether it was the optimizer's), `backward` (the places of autograd's backward functions, whose
    last end the rule compares with), `identity` (the ops and user spans that are `Row`s: each one's place, name,
    argument shapes and types), `ops` (the places of the ops: by External id).
    The nodes' fields are kept as columns (`_NODE`), put together again for each step replayed."""

    __slots__ = ("signatures", "order", "threads", "columns", "parents", "popped", "by_rule", "backward",
                 "sequences", "identity", "ops", "thread_names", "matched", "interned")

    def __init__(self, spans: list[KinetoEvent], signatures: list[tuple], base: int, nodes: list[NodeExecStats],
                 parents: list[int], popped: list[tuple[int, int]], by_rule: list[tuple[int, bool]],
                 backward: list[int], identity: list[tuple[int, str, Any, Any]], ops: list[int],
                 thread_names: dict[int, str], interned: Any = None) -> None:
        self.signatures = _detached(signatures)
        starts, durations = _times(spans, base)
        self.threads = np.fromiter(map(_TID, spans), np.int64, len(spans))
        self.order = _order(starts, durations, self.threads)
        self.columns = tuple(map(list, zip(*map(_NODE, nodes)))) if nodes else ((),) * 9
        self.parents = np.array(parents, np.int64)
        self.popped = _pairs(popped)
        self.by_rule = _pairs(by_rule)
        self.backward = np.array(backward, np.int64)
        self.sequences = _sequences(spans)[self.order]
        self.identity = tuple(map(list, zip(*identity))) if identity else ((),) * 4
        self.ops = ops
        self.thread_names = dict(thread_names)
        self.matched: Matched | None = None  # (what `borrow` found of its steps' ops: `StepRows`)
        # its step's argument lists (`step_identity.Interned`), which a step converted as it was shares: a
        # template made from such a step takes them
        self.interned = interned

    def replay(self, spans: list[KinetoEvent], signatures: list[tuple], base: int, host: DeviceStepStats
               ) -> Replayed | None:
        """Convert a step whose `spans` (`signatures`) are this one's: its nodes onto `host`; returns its rows
        (`Replayed`). None, with nothing done, where they differ, or where its times order or nest its spans
        otherwise, or its sequence numbers are not this one's shifted."""
        if signatures != self.signatures:
            return None
        starts, durations = _times(spans, base)
        order = self.order
        if not np.array_equal(_order(starts, durations, self.threads), order):
            return None
        starts, durations = starts[order], durations[order]
        ends = starts + durations
        parents, nested, popped, by_rule = self.parents, self.parents >= 0, self.popped, self.by_rule
        # (the conversion's stack: at each span's start, the spans found ended had ended, the one it was found
        # nested in had not)
        if not (np.all(ends[parents[nested]] > starts[nested]) and np.all(ends[popped[:, 0]] <= starts[popped[:, 1]])):
            return None
        backward_end = int(ends[self.backward].max()) if len(self.backward) else 0
        if len(by_rule) and not np.array_equal(starts[by_rule[:, 0]] >= backward_end if backward_end else
                                               np.zeros(len(by_rule), bool), by_rule[:, 1] != 0):
            return None
        try:
            sequences = _sequences(spans)[order]
        except (TypeError, ValueError, OverflowError):  # (a sequence number that is none)
            return None
        if not _shifted(sequences, self.sequences):
            return None
        names, ops, threads, scopes, phases, shapes, dtypes, categories, args = self.columns
        nodes = list(map(NodeExecStats, names, ops, starts.tolist(), durations.tolist(), threads, scopes, phases,
                         shapes, dtypes, itertools.repeat(None), categories, args))
        host.node_stats.extend(nodes)
        for tid, name in self.thread_names.items():
            host.thread_names.setdefault(tid, name)
        return Replayed(self, nodes, spans)


class Replayed(StepRows):
    """The rows of a step converted as an earlier one was (`Conversion.replay`): made from its nodes and its
    spans' External ids where first read (a borrowing step of the same ops and layout as the fit's last one
    reads neither: `hookprof.tracing.step_identity.borrow`)."""

    __slots__ = ("_nodes", "_spans", "_external")

    def __init__(self, conversion: Conversion, nodes: list[NodeExecStats], spans: list[KinetoEvent]) -> None:
        super().__init__(None, None, conversion)  # type: ignore[arg-type]
        self._nodes, self._spans = nodes, spans  # (its spans in the export's order)
        self._external: list[Any] | None = None

    def external_ids(self) -> list[Any]:
        """Each node's External id (0 for an op without one, as the conversion has them), in start order."""
        if self._external is None:
            spans = self._spans
            self._external = [0 if (value := spans[i].args.external_id) is None else value
                              for i in self.source.order.tolist()]
        return self._external

    def rows(self) -> list[Row]:
        if self._rows is None:
            conversion, nodes, external = self.source, self._nodes, self.external_ids()
            at, names, dims, types = conversion.identity
            self._rows = list(map(_new_row, zip(map(nodes.__getitem__, at), map(external.__getitem__, at),
                                                map(conversion.columns[2].__getitem__, at), names, dims, types)))
        return self._rows

    def by_external_id(self) -> dict[int, NodeExecStats]:
        if self._by_external_id is None:
            ops, nodes, external = self.source.ops, self._nodes, self.external_ids()
            self._by_external_id = dict(zip(map(external.__getitem__, ops), map(nodes.__getitem__, ops)))
        return self._by_external_id


def _detached(signatures: list[tuple]) -> list[tuple]:
    """`signatures` holding their own copies of the export's argument lists (`msgspec.Raw` views of the whole
    export's bytes, which they would keep alive as long as the conversion is kept), one per distinct list."""
    copies: dict[bytes, msgspec.Raw] = {}

    def own(raw: Any) -> Any:
        if not isinstance(raw, msgspec.Raw):
            return raw
        key = bytes(raw)
        copy = copies.get(key)
        if copy is None:
            copy = copies[key] = raw.copy()
        return copy

    return [(category, name, tid, own(dims), own(types), own(concrete))
            for category, name, tid, dims, types, concrete in signatures]


def _pairs(pairs: list[tuple[int, int]]) -> np.ndarray:
    """Pairs of ints as an array of two columns (made column by column: faster than from the tuples)."""
    return np.array(list(zip(*pairs)), np.int64).T if pairs else np.zeros((0, 2), np.int64)


def _sequences(spans: list[KinetoEvent]) -> np.ndarray:
    """Each span's autograd sequence number (-1: none), in the export's order."""
    return np.array([e.args.sequence for e in spans], np.int64)


def _shifted(sequences: np.ndarray, recorded: np.ndarray) -> bool:
    """Whether a step's autograd sequence numbers are the recorded ones shifted by one amount (a backward op's
    scope is the forward op's of the same number), and missing (-1) where they were."""
    missing = recorded < 0
    if not np.array_equal(sequences < 0, missing):
        return False
    shift = sequences[~missing] - recorded[~missing]
    return not len(shift) or bool(np.all(shift == shift[0]))


class FitConversions:
    """The last `KEPT` conversions of a fit's steps of different ops (`kept`, newest first), where its steps are
    converted (an odd step, an epoch's last one say, leaves the usual one's kept for the next), and whether its
    steps are still worth recording: a fit whose steps were never converted again after `MISSES_MAX` tries in
    a row (ops that change from step to step), or whose steps cannot be (`stop`), records no more (recording
    costs a conversion about half again)."""

    __slots__ = ("kept", "_missed", "_matched", "off")
    KEPT = 2
    MISSES_MAX = 2

    def __init__(self) -> None:
        self.kept: list[Conversion] = []
        self._missed = 0
        self._matched = False
        self.off = False

    def replay(self, spans: list[KinetoEvent], signatures: list[tuple], base: int, host: DeviceStepStats
               ) -> Replayed | None:
        """`Conversion.replay` with the first of the fit's kept conversions that fits the step (None where none
        does), counted."""
        kept = list(self.kept)  # (another thread may convert one of the fit's steps meanwhile)
        for conversion in kept:
            replayed = conversion.replay(spans, signatures, base, host)
            if replayed is not None:
                self._matched, self._missed = True, 0
                if conversion is not kept[0]:
                    self.kept = [conversion, *(c for c in kept if c is not conversion)]
                return replayed
        if kept:
            self._missed += 1
            if self._missed >= self.MISSES_MAX and not self._matched:
                self.off, self.kept = True, []
        return None

    def keep(self, conversion: Conversion) -> None:
        """A step's conversion, replayed first for the fit's next step."""
        if not self.off:
            self.kept = [conversion, *self.kept[:self.KEPT - 1]]

    def stop(self) -> None:
        """The fit's steps cannot be converted again (a step with kernels or CUDA runtime calls, whose args are
        each step's own), or are too large to keep: none is recorded, nor compared, any more."""
        self.off, self.kept = True, []


# Where this process converts steps (the render worker, or a training process without one), what each fit's
# steps left (`FitConversions`), by the fit's token.
CONVERSIONS: ByFit[FitConversions] = ByFit("kineto conversions")
