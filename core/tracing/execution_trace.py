"""torch's execution-trace observer for one step: each op's input and output tensors by identity.

The observer writes a JSON file of op nodes with their tensor arguments as
`[tensor_id, storage_id, offset, numel, itemsize, device]`, the thread (`tid`) and a record-function id
(`rf_id`) that grows by one at every op's entry. The profiler's own event ids follow another counter (they
agree only in a process's first session), so nodes are matched to profiler events by entry order: the k-th
`aten::addmm` the observer saw on a thread is the k-th the profiler saw there. Where the two disagree on how
many ops of a name ran on a thread, those ops are left out of the dataflow rather than guessed.
This module runs the observer around a traced step, reads the file back (orjson), and turns each node into
`core.dataflow.OpData` keyed by the storage range the tensor covers, so views and `.grad` aliases of the same
data are one datum. Whether an output is a view comes from the op's
schema: `Tensor(a)` aliases an input, `Tensor(a!)` writes it in place.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import tempfile
from typing import Any, Iterator

import orjson

from core.dataflow import OpData
from core.step_stats import DTYPE_ITEMSIZE, NodeExecStats, TensorDescription

log = logging.getLogger(__name__)

_ALIAS = re.compile(r"Tensor\((\w)(!?)\)")


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence the C++ "Enabling/Disabling Execution Trace Observer" lines (no runtime log-level switch)."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)


class ExecutionTrace:
    """Records one step's tensor arguments with `torch.profiler.ExecutionTraceObserver`."""

    def __init__(self) -> None:
        from torch.profiler import ExecutionTraceObserver

        fd, self.path = tempfile.mkstemp(prefix="hookprof-et-", suffix=".json")
        os.close(fd)
        self._observer = ExecutionTraceObserver()
        self._running = False

    def start(self) -> None:
        with quiet_stderr():
            self._observer.register_callback(self.path)
            self._observer.start()
        self._running = True

    def stop(self) -> None:
        if self._running:
            self._running = False
            with quiet_stderr():
                self._observer.stop()
                self._observer.unregister_callback()

    def read(self, nodes_in_order: dict[tuple[int, str], list[NodeExecStats]],
             dtype_names: dict[str, str]) -> list[OpData]:
        """The recorded ops matched to profiler events, as OpData; removes the file.

        `nodes_in_order` lists the profiler's op nodes per (thread, op name) in the order they started.
        """
        try:
            with open(self.path, "rb") as f:
                trace = orjson.loads(f.read())
        finally:
            self.discard()
        by_key: dict[tuple[int, str], list[tuple[int, dict]]] = {}
        for et_node in trace.get("nodes", ()):
            rf_id = _attr(et_node, "rf_id")
            if rf_id is not None:
                by_key.setdefault((_attr(et_node, "tid"), et_node.get("name")), []).append((rf_id, et_node))
        matched = []
        for key, entries in by_key.items():
            nodes = nodes_in_order.get(key, ())
            if len(nodes) != len(entries):
                log.debug("execution trace and profiler disagree on %s (%d vs %d): left out", key,
                          len(entries), len(nodes))
                continue
            entries.sort(key=lambda entry: entry[0])
            matched.extend(zip(nodes, (et_node for _, et_node in entries)))
        ops = []
        for node, et_node in matched:
            inputs = _tensors(et_node.get("inputs", {}), dtype_names)
            outputs = _tensors(et_node.get("outputs", {}), dtype_names)
            if not inputs and not outputs:
                continue
            views, mutations = _aliases(_attr(et_node, "op_schema") or "")
            # positions in the schema are argument positions; map them to positions in the tensor lists
            ops.append(OpData(node, [t[1:] for t in inputs], [t[1:] for t in outputs],
                              _tensor_positions(views, inputs, outputs),
                              frozenset(i for i, (pos, _, _) in enumerate(outputs) if pos in mutations)))
            node.outputs = [t[2] for t in outputs]
        return ops

    def discard(self) -> None:
        self.stop()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def _attr(et_node: dict, name: str) -> Any:
    for attr in et_node.get("attrs", ()):
        if attr.get("name") == name:
            return attr.get("value")
    return None


def _tensors(args: dict, dtype_names: dict[str, str]) -> list[tuple[int, tuple, TensorDescription]]:
    """(argument position, key, tensor) for every tensor argument, lists of tensors included."""
    found = []
    values, types, shapes = args.get("values", ()), args.get("types", ()), args.get("shapes", ())
    for pos, (value, kind) in enumerate(zip(values, types)):
        shape = shapes[pos] if pos < len(shapes) else []
        if kind.startswith("Tensor("):
            items = [(value, shape, kind[7:-1])]
        elif kind.startswith("GenericList[") and isinstance(value, list):
            inner = kind[12:-1].split(",")
            items = [(v, shape[i] if i < len(shape) else [], inner[i][7:-1] if i < len(inner) else "")
                     for i, v in enumerate(value)]
        else:
            continue
        for item, dims, raw_dtype in items:
            if not (isinstance(item, list) and len(item) == 6):
                continue
            _, storage, offset, numel, itemsize, device = item
            dtype = dtype_names.get(raw_dtype, raw_dtype)
            nbytes = numel * itemsize if dtype in DTYPE_ITEMSIZE else None
            found.append((pos, (storage, offset, numel, itemsize, device),
                          TensorDescription(dtype, tuple(dims), nbytes)))
    return found


@functools.lru_cache(maxsize=4096)
def _aliases(schema: str) -> tuple[dict[int, int], frozenset[int]]:
    """From an op schema: views (output position -> argument position, `Tensor(a)`) and the output
    positions written in place (`Tensor(a!)`)."""
    if "->" not in schema:
        return {}, frozenset()
    head, returns = schema.split("->", 1)
    args = head[head.find("(") + 1: head.rfind(")")]
    letters = {}
    for pos, arg in enumerate(_split_top_level(args)):
        match = _ALIAS.search(arg)
        if match:
            letters[match.group(1)] = pos
    views, mutations = {}, set()
    returns = returns.strip()
    if returns.startswith("(") and returns.endswith(")"):
        returns = returns[1:-1]
    for pos, ret in enumerate(_split_top_level(returns)):
        match = _ALIAS.search(ret)
        if not match:
            continue
        if match.group(2):
            mutations.add(pos)
        elif match.group(1) in letters:
            views[pos] = letters[match.group(1)]
    return views, frozenset(mutations)


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if text[start:].strip():
        parts.append(text[start:])
    return parts


def _tensor_positions(views: dict[int, int], inputs: list, outputs: list) -> dict[int, int]:
    """Translate argument positions of `views` into indexes of the flattened tensor lists."""
    if not views:
        return {}
    input_index = {pos: i for i, (pos, _, _) in enumerate(inputs)}
    mapped = {}
    for i, (pos, _, _) in enumerate(outputs):
        source = views.get(pos)
        if source is not None and source in input_index:
            mapped[i] = input_index[source]
    return mapped
