"""Tensor dataflow of a step: which op produced each datum another op read, found by tensor identity.

A tracer gives, per op execution, the data it read and wrote as keys and which outputs are views of an
input. A key `(storage, offset, numel, itemsize, ...)` is a byte range of one storage; any other key is
opaque (torch's tracer uses the allocation a tensor lives in: see `hookprof.tracing.torch_dataflow`).
`find_edges` sweeps the ops' starts and ends in time order:
- at an op's start it consumes each input from the op that last produced that datum, unless an enclosing op
  already consumed the same datum from the same producer (so `linear` reads `x`, not also its inner `addmm`);
- at an op's end it becomes the producer of its outputs, unless an op it encloses freshly created them
  (the innermost op that made a datum is its producer: `addmm`, not the `linear` around it); an inner op
  that only wrote into the datum in place (`copy_` of the bias into addmm's result buffer) is plumbing of
  the enclosing op, which takes over;
- a view (`t`, `view`, `detach`, `expand`) produces nothing new: its output inherits the producer of the
  datum it aliases, while an in-place op (`add_`) writes a new version and becomes the producer, also of
  every other datum of the same storage its bytes overlap (`h[:, :4].mul_(2)` is the new producer of `h`).
No edge is made whose producer ends after its consumer starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable

from hookprof.step_stats import DataEdge as DataEdge  # (defined with the step stats that hold the edges)
from hookprof.step_stats import NodeExecStats, TensorDescription


@dataclasses.dataclass(slots=True)
class OpData:
    """One op execution's data: `inputs`/`outputs` as (key, tensor) pairs; `views` maps an output's
    position to the input position it aliases; `mutations` are the output positions written in place."""

    node: NodeExecStats
    inputs: list[tuple[Hashable, TensorDescription]]
    outputs: list[tuple[Hashable, TensorDescription]]
    views: dict[int, int] = dataclasses.field(default_factory=dict)
    mutations: frozenset[int] = frozenset()


def _contains(outer: NodeExecStats, inner: NodeExecStats) -> bool:
    return (
        outer is not inner
        and outer.thread_id == inner.thread_id
        and outer.start_ns <= inner.start_ns
        and inner.start_ns + inner.duration_ns <= outer.start_ns + outer.duration_ns
    )


def _byte_range(key: Hashable) -> tuple[Hashable, int, int] | None:
    """(storage, first byte, end byte) for a storage-range key; None for an opaque key."""
    if isinstance(key, tuple) and len(key) >= 4 and all(isinstance(v, int) for v in key[1:4]):
        storage, offset, numel, itemsize = key[:4]
        return storage, offset * itemsize, (offset + numel) * itemsize
    return None


def find_edges(ops: Iterable[OpData]) -> list[DataEdge]:
    """Producer -> consumer edges for every datum one op wrote and a later op read (see the module doc)."""
    timeline = []
    for i, op in enumerate(ops):  # (the start of an op that reads nothing, the end of one that writes nothing: no-ops)
        node = op.node
        if op.inputs:
            timeline.append((node.start_ns, 1, -node.duration_ns, i, op))
        if op.outputs:
            timeline.append((node.start_ns + node.duration_ns, 0 if node.duration_ns > 0 else 2, 0, i, op))
    timeline.sort()  # (the first four items tell any two entries apart: the op itself is never compared)

    producer: dict[Hashable, tuple[NodeExecStats, str, bool]] = {}  # key -> (node, tensor name, fresh)
    by_storage: dict[Hashable, set[Hashable]] = {}  # storage -> keys of it that have a producer
    last_consumer: dict[tuple[Hashable, int], NodeExecStats] = {}  # (key, id(producer)) -> consumer
    edges: list[DataEdge] = []
    for _, kind, _, _, op in timeline:
        node = op.node
        if kind == 1:  # start: read the inputs
            start, end, thread = node.start_ns, node.start_ns + node.duration_ns, node.thread_id
            for key, tensor in op.inputs:
                made = producer.get(key)
                if made is None:
                    continue
                source, name, _ = made
                if source is node:
                    continue
                source_start = source.start_ns
                source_end = source_start + source.duration_ns
                if source.thread_id == thread and (start <= source_start and source_end <= end
                                                   or source_start <= start and end <= source_end):
                    continue  # one encloses the other (`_contains`, inlined: this runs for every read)
                if source_end > start:
                    continue  # still running elsewhere: no causal edge
                seen = (key, id(source))
                previous = last_consumer.get(seen)
                if previous is not None and _contains(previous, node):
                    continue  # an enclosing op already took this datum
                last_consumer[seen] = node
                edges.append(DataEdge(source, node, tensor, name))
            continue
        # end: publish the outputs
        for slot, (key, _) in enumerate(op.outputs):
            alias = op.views.get(slot)
            if alias is not None:
                source_key = op.inputs[alias][0] if alias < len(op.inputs) else None
                made = producer.get(source_key)
                if made is not None and key != source_key:
                    producer[key] = made
                continue
            current = producer.get(key)
            if current is not None and current[2] and _contains(node, current[0]):
                continue  # an inner op created it
            made = (node, f"{node.node_name}:{slot}", slot not in op.mutations)
            producer[key] = made
            span = _byte_range(key)
            if span is None:
                continue
            keys = by_storage.setdefault(span[0], set())
            if slot in op.mutations:  # an in-place write changes every datum whose bytes it overlaps
                for other in keys:
                    other_span = _byte_range(other)
                    if other != key and other_span[1] < span[2] and span[1] < other_span[2]:
                        producer[other] = made
            keys.add(key)
    return edges
