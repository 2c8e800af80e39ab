"""tfprof's four views over the accumulated data, their option semantics, and their text.

- scope: the tree of name scopes (module paths); ops and parameters are leaves of their module.
- graph: ops linked by the tensors they consume; a node's children are its inputs' producers, depth = hops.
- code: the tree of Python call stacks (needs stacks recorded: `ProfilerHook(with_stack=True)`).
- op: one row per op type, with accumulated and own percentages.
The tree views return a `ViewNode` tree rooted at `_TFProfRoot` (TF's GraphNodeProto: self and total
figures, children); the op view returns `MultiGraphNode` rows (TF's MultiGraphNodeProto).

The text is TF's: the columns come in TF's fixed order whatever the order of `select` (tfprof_show.cc for
the scope and graph views, tfprof_show_multi.cc / tfprof_op.cc / tfprof_code.cc for the op and code views),
under TF's labels; `micros` shows total, accelerator and cpu execution time. A tree row is `name (self/total,
...)`, `--` in place of the self figure of a node that is not accounted; with `params`, a variable's row
starts with its shape (`fc1/weight (16x8, 128/128 params)`); input shapes are `position:shape` per tensor
argument (`0:16|1:8x8|2:8x16`), a 0-d tensor's shape being `1` as in TF.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from typing import Any

from hookprof.profiler.profile_data import (
    ACCEL,
    BYTES,
    COUNT,
    CPU,
    FLOPS,
    MICROS,
    OUTPUT,
    PEAK,
    RESIDUAL,
    NodeData,
    ProfileData,
    parse_frame,
)
from hookprof.step_stats import DTYPE_ITEMSIZE
from hookprof.units import format_memory, format_number, format_time

ROOT = "_TFProfRoot"
SCOPE_PARENT = "_kTFScopeParent"  # TF's op type of a scope that is no node itself (tfprof_constants.h)
GRAPH_PARENT = "_TFGraphParent"
FIGURES = {"micros": MICROS, "accelerator_micros": ACCEL, "cpu_micros": CPU, "bytes": BYTES, "peak_bytes": PEAK,
           "residual_bytes": RESIDUAL, "output_bytes": OUTPUT, "float_ops": FLOPS, "occurrence": COUNT}
# `definitions`: the nodes a figure covers (TF's definition_count: the `defined` of `op count (run|defined)`)
ATTRS = tuple(FIGURES) + ("params", "definitions")
_MIN_OPTIONS = {"min_micros": "micros", "min_accelerator_micros": "accelerator_micros", "min_cpu_micros": "cpu_micros",
                "min_bytes": "bytes", "min_peak_bytes": "peak_bytes", "min_residual_bytes": "residual_bytes",
                "min_output_bytes": "output_bytes", "min_params": "params", "min_float_ops": "float_ops",
                "min_occurrence": "occurrence"}
# TF's column order: the scope and graph views (tfprof_show.cc), the op and code views (tfprof_show_multi.cc)
TREE_COLUMNS = ("params", "float_ops", "bytes", "peak_bytes", "residual_bytes", "output_bytes", "micros",
                "accelerator_micros", "cpu_micros", "device", "op_types", "occurrence", "input_shapes")
MULTI_COLUMNS = ("bytes", "peak_bytes", "residual_bytes", "output_bytes", "micros", "accelerator_micros",
                 "cpu_micros", "params", "float_ops", "device", "op_types", "occurrence", "input_shapes")
HEADERS = {"micros": "total execution time", "accelerator_micros": "accelerator execution time",
           "cpu_micros": "cpu execution time", "bytes": "requested bytes", "peak_bytes": "peak bytes",
           "residual_bytes": "residual bytes", "output_bytes": "output bytes", "params": "# parameters",
           "float_ops": "# float_ops", "occurrence": "op count (run|defined)", "device": "assigned devices",
           "op_types": "op types", "input_shapes": "input shapes"}
MULTI_HEADERS = {**HEADERS, "occurrence": "op occurrence (run|defined)"}
_MEMORY = ("bytes", "peak_bytes", "residual_bytes", "output_bytes")
_TIMES = ("micros", "accelerator_micros", "cpu_micros")
_TF_NAMES = {"exec_micros": "micros", "accelerator_exec_micros": "accelerator_micros", "cpu_exec_micros": "cpu_micros",
             "requested_bytes": "bytes", "peak_bytes": "peak_bytes", "residual_bytes": "residual_bytes",
             "output_bytes": "output_bytes", "parameters": "params", "float_ops": "float_ops",
             "run_count": "occurrence", "definition_count": "definitions"}


# What a file's `Doc:` block says of each view and column (TF's file output explains them so, in this order)
VIEW_DOCS = {
    "scope": "scope: nodes are the step's ops, arranged by their module scopes (model/layer/op), as a file tree.",
    "graph": "graph: nodes are the step's ops, arranged by dataflow: each op's children are the ops it read from.",
    "python": "code: nodes are the Python code lines (file:line:function) that ran the ops, arranged by call "
              "stack (needs stacks recorded: ProfilerHook(with_stack=True)).",
    "operations": "op: nodes are op types (aten::addmm, aten::conv2d); the executions of one type are summed "
                  "into its row.",
}
COLUMN_DOCS = {
    "bytes": "requested bytes: the memory the op allocated, summed over its allocations.",
    "micros": "total execution time: cpu execution time plus accelerator execution time.\n"
              "cpu execution time: from the op's start to its end on the host, less the ops nested in it.\n"
              "accelerator execution time: the time the kernels the op launched ran on the device.",
    "params": "param: the number of parameters the module's weights hold.",
    "float_ops": "flops: floating point operations, counted from the op's input shapes.",
    "tensor_value": "tensor_value: not recorded.",
    "device": "device: where the op ran (/host:CPU, or the device its kernels ran on).",
    "op_types": "op_types: the op's type (aten::addmm).",
    "occurrence": "occurrence: how many times the op ran (run) and how many ops of the kind there are (defined).",
    "input_shapes": "input shape: the shapes of the op's input tensors.",
    "accelerator_micros": "accelerator execution time: the time the kernels the op launched ran on the device.",
    "cpu_micros": "cpu execution time: from the op's start to its end on the host, less the ops nested in it.",
    "peak_bytes": "peak bytes: the most memory the op's allocations held at once.",
    "residual_bytes": "residual bytes: the memory the op allocated that was still held when the step ended.",
    "output_bytes": "output bytes: the memory of the op's outputs (allocated by it or not).",
}
_DOC_ORDER = ("bytes", "micros", "params", "float_ops", "tensor_value", "device", "op_types", "occurrence",
              "input_shapes", "accelerator_micros", "cpu_micros", "peak_bytes", "residual_bytes", "output_bytes")


def doc_block(view: str, select: Iterable[str]) -> str:
    """The `Doc:` block TF's file output starts with: the view, then each selected column, one line each,
    in the columns' own order, before the `Profile:` that the view's text follows."""
    chosen = set(select)
    lines = [VIEW_DOCS[view]] + [COLUMN_DOCS[column] for column in _DOC_ORDER if column in chosen]
    return "\nDoc:\n" + "\n".join(lines) + "\n\nProfile:\n"


def columns(select: Iterable[str], order: tuple[str, ...] = TREE_COLUMNS) -> list[str]:
    """The columns TF shows for `select`, in TF's order; `micros` brings the accelerator and cpu times too."""
    chosen = set(select)
    if "micros" in chosen:
        chosen.update(("accelerator_micros", "cpu_micros"))
    return [column for column in order if column in chosen]


def legend(select: Iterable[str], multi: bool = False) -> str:
    """TF's header line: `node name | ` and the labels of the columns shown."""
    labels = MULTI_HEADERS if multi else HEADERS
    return "node name | " + " | ".join(labels[c] for c in columns(select, MULTI_COLUMNS if multi else TREE_COLUMNS))


def tf_shape(shape: Any) -> list[int]:
    """A shape as TF lists it (ShapeProtoToVec): a 0-d tensor is `[1]`, an unknown shape `[]`."""
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) for d in shape):
        return []
    return list(shape) or [1]


def format_shape(shape: list[int]) -> str:
    return "x".join(str(d) for d in shape)


def format_input_shapes(shapes: Iterable[tuple[int, list[int]]], separator: str = "|") -> str:
    """`0:2x3|1:3x4`: each tensor argument's position and shape (`unknown` where none was recorded)."""
    return separator.join(f"{i}:{format_shape(s) if s else 'unknown'}" for i, s in shapes)


def _is_tensor(dtype: Any, shape: Any) -> bool:
    if dtype is None:  # no dtypes recorded: a shape with dimensions is a tensor's
        return isinstance(shape, (list, tuple)) and bool(shape) and all(isinstance(d, int) for d in shape)
    return isinstance(dtype, str) and (dtype in DTYPE_ITEMSIZE or dtype.startswith("c10::"))


def input_shapes(data: NodeData) -> list[tuple[int, list[int]]]:
    """(argument position, TF shape) of the op's tensor arguments; scalars, lists and Nones left out."""
    if data.op == "Parameter":
        return []
    dtypes = list(data.input_dtypes) + [None] * (len(data.input_shapes) - len(data.input_dtypes))
    return [(i, tf_shape(shape)) for i, (shape, dtype) in enumerate(zip(data.input_shapes, dtypes))
            if _is_tensor(dtype, shape)]


def variable_shape(data: NodeData) -> list[int] | None:
    """A parameter's shape as TF shows it before its counts; None for an op (TF: only variables have one)."""
    if data.op != "Parameter" or not data.input_shapes:
        return None
    return tf_shape(data.input_shapes[0])


@dataclasses.dataclass(eq=False)
class ViewNode:
    """A node of a tree view (TF's GraphNodeProto): own (`self_`) and subtree (`total`) figures.

    `shape` is a parameter's shape (None for other nodes), `input_shapes` the (position, shape) of an op's
    tensor arguments; `accounted` says whether its own figures count (shown as `--` in the text if not)."""

    name: str
    depth: int = 0
    op_types: list[str] = dataclasses.field(default_factory=list)
    device: str = ""
    input_shapes: list = dataclasses.field(default_factory=list)
    self_: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(ATTRS, 0.0))
    total: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(ATTRS, 0.0))
    children: list[ViewNode] = dataclasses.field(default_factory=list)
    accounted: bool = False
    fixed_totals: bool = False  # the view computed totals itself (the graph view: over the input DAG)
    text: str = ""  # the whole view's text, on the root
    shape: list[int] | None = None
    view: str = ""  # on the root: "scope", "graph" or "code" (which of TF's text formats it takes)

    def __getattr__(self, name: str) -> float:  # TF's field names: exec_micros, total_exec_micros, parameters...
        total = name.startswith("total_")
        attr = _TF_NAMES.get(name[6:] if total else name)
        if attr is None:
            raise AttributeError(name)
        return (self.total if total else self.self_)[attr]

    def walk(self) -> Iterable[ViewNode]:
        yield self
        for child in self.children:
            yield from child.walk()

    def to_dict(self) -> dict[str, Any]:
        """Plain data for notebooks and JSON: what the text shows, and the children."""
        return {"name": self.name, "depth": self.depth, "op_types": self.op_types, "device": self.device,
                "shape": self.shape, "input_shapes": [[i, list(s)] for i, s in self.input_shapes],
                "accounted": self.accounted, "self": dict(self.self_), "total": dict(self.total),
                "children": [c.to_dict() for c in self.children]}


@dataclasses.dataclass
class MultiGraphNode:
    """A row of the op view (TF's MultiGraphNodeProto): one op type, summed over its nodes.

    `input_types` groups its nodes by input shapes, most runs first: (shapes, runs, nodes, micros), the
    lines TF printed under the row for `input_shapes`."""

    name: str
    self_: dict[str, float]
    nodes: list[str]
    defined: int
    op_types: list[str] = dataclasses.field(default_factory=list)
    devices: list[str] = dataclasses.field(default_factory=list)
    input_types: list[tuple[list, float, int, float]] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "self": dict(self.self_), "nodes": self.nodes, "defined": self.defined,
                "op_types": self.op_types, "devices": self.devices,
                "input_types": [{"input_shapes": [[i, list(s)] for i, s in shapes], "run_count": runs,
                                 "defined": defined, "exec_micros": micros}
                                for shapes, runs, defined, micros in self.input_types]}


@dataclasses.dataclass
class OpViewResult:
    """The op view: its rows (in display order) and text."""

    rows: list[MultiGraphNode]
    text: str

    def to_dict(self) -> dict[str, Any]:
        return {"rows": [r.to_dict() for r in self.rows]}


def _accounted(types: Iterable[str], options: dict[str, Any]) -> bool:
    return any(p.fullmatch(t) for p in options["_account_type_regexes"] for t in types)


def _leaf(data: NodeData, name: str, options: dict[str, Any]) -> ViewNode:
    figures = data.figures(options["step"])
    node = ViewNode(name, op_types=list(data.op_types), device=data.device, input_shapes=input_shapes(data),
                    shape=variable_shape(data))
    for attr, index in FIGURES.items():
        node.self_[attr] = figures[index]
    node.self_["params"] = float(data.params)
    node.self_["definitions"] = 1.0
    node.accounted = _accounted(data.op_types, options)
    return node


def _included(data: NodeData, step: int) -> bool:
    return data.params > 0 or data.ran_at(step)


def scope_tree(profile: ProfileData, options: dict[str, Any]) -> ViewNode:
    """Module paths as a tree; a scope that is no node itself is, as in TF, a `_kTFScopeParent` node (accounted
    only where that type is, so with the default `.*` but not for `trainable_variables_parameter()`)."""
    root = ViewNode(ROOT, op_types=[SCOPE_PARENT], view="scope")
    index: dict[str, ViewNode] = {"": root}
    parent_accounted = _accounted([SCOPE_PARENT], options)
    for data in profile.nodes.values():
        if not _included(data, options["step"]):
            continue
        parts = data.name.split("/")
        parent = root
        for depth in range(1, len(parts)):
            path = "/".join(parts[:depth])
            node = index.get(path)
            if node is None:
                node = index[path] = ViewNode(path, op_types=[SCOPE_PARENT], accounted=parent_accounted)
                node.self_["definitions"] = 1.0
                parent.children.append(node)
            parent = node
        leaf = index.get(data.name)
        if leaf is None:  # an op whose name is also a scope keeps the scope's children
            leaf = index[data.name] = _leaf(data, data.name, options)
            parent.children.append(leaf)
        else:
            fresh = _leaf(data, data.name, options)
            leaf.self_, leaf.op_types, leaf.accounted = fresh.self_, fresh.op_types, fresh.accounted
            leaf.device, leaf.input_shapes, leaf.shape = fresh.device, fresh.input_shapes, fresh.shape
    return root


GRAPH_DEPTH_LIMIT = 200  # the graph view's tree stops here (a text tree deeper than this is unreadable)


def graph_tree(profile: ProfileData, options: dict[str, Any]) -> ViewNode:
    """Each op with the producers of its inputs as children, built breadth-first to the depth shown; a node
    reached again is shown, not expanded again (the graph is a DAG). Totals cover each node's whole input
    graph (every accounted ancestor once), however deep, and are fixed here."""
    step = options["step"]
    ops = {n.name: n for n in profile.nodes.values() if n.steps and _included(n, step)}
    consumed = {source for n in ops.values() for source in n.inputs if source in ops}
    limit = min(options["max_depth"], GRAPH_DEPTH_LIMIT)
    root = ViewNode(ROOT, op_types=[GRAPH_PARENT], view="graph")
    expanded: set[str] = set()
    queue = []
    for name in ops:
        if name not in consumed:
            node = _leaf(ops[name], name, options)
            root.children.append(node)
            queue.append((node, 1))
    while queue:
        node, depth = queue.pop()
        if node.name in expanded or depth >= limit:
            continue
        expanded.add(node.name)
        for source in ops[node.name].inputs:
            if source in ops:
                child = _leaf(ops[source], source, options)
                node.children.append(child)
                queue.append((child, depth + 1))
    leaves = {name: _leaf(data, name, options) for name, data in ops.items()}
    stack = [root]
    while stack:  # totals over the whole input graph, each accounted ancestor once
        node = stack.pop()
        stack.extend(node.children)
        seen, todo, total = set(), [node.name] if node is not root else list(ops), dict.fromkeys(ATTRS, 0.0)
        while todo:
            name = todo.pop()
            if name in seen or name not in ops:
                continue
            seen.add(name)
            if leaves[name].accounted:
                for attr in ATTRS:
                    total[attr] += leaves[name].self_[attr]
            todo.extend(ops[name].inputs)
        node.total = total
    root.fixed_totals = True
    return root


def code_name(frame: str) -> str:
    """A code line as TF's code view names it, `file:line:function` (`model.py:63:build`), from the frame as
    torch records it (`model.py(63): build`); a frame without a file keeps its name."""
    function, file, line = parse_frame(frame)
    return f"{file}:{line}:{function}" if file else function


def code_tree(profile: ProfileData, options: dict[str, Any]) -> ViewNode:
    root = ViewNode(ROOT, view="code")
    index: dict[tuple[str, ...], ViewNode] = {(): root}
    devices: dict[int, set[str]] = {}
    any_stack = False
    for data in profile.nodes.values():
        if not data.steps or not _included(data, options["step"]):
            continue
        frames = tuple(data.stack) or ("(no python stack)",)
        any_stack = any_stack or bool(data.stack)
        parent = root
        for depth in range(1, len(frames) + 1):
            key = frames[:depth]
            node = index.get(key)
            if node is None:
                node = index[key] = ViewNode(code_name(frames[depth - 1]))
                parent.children.append(node)
            parent = node
        leaf = _leaf(data, data.name, options)  # the op's figures count at its innermost code line
        for attr in ATTRS:
            parent.self_[attr] += leaf.self_[attr]
        parent.op_types = sorted(set(parent.op_types) | set(leaf.op_types))
        parent.accounted = parent.accounted or leaf.accounted
        if data.device:
            devices.setdefault(id(parent), set()).add(data.device)
    if not any_stack:
        raise ValueError("profile_python: no Python stacks were recorded. Trace with stacks: "
                         "ProfilerHook(..., with_stack=True) (it costs more per traced step).")
    for node in root.walk():
        node.device = "|".join(sorted(devices.get(id(node), ())))
    return root


def apply_options(root: ViewNode, options: dict[str, Any], lift_hidden: bool = False) -> ViewNode:
    """Trim, start, account, filter, order: the displayed tree (TF's semantics, see hookprof.profiler.options).

    `lift_hidden` (the code view): figures of hidden nodes count in their displayed ancestors even with
    `account_displayed_op_only`, since ops run in library frames below the user's code lines.
    """
    _set_depths(root, 0)
    _trim(root, options["_trim_name_regexes"])
    starts = options["_start_name_regexes"]
    if [p.pattern for p in starts] != [".*"]:
        root.children = list(_start_nodes(root, starts))
        _set_depths(root, 0)
    if not root.fixed_totals:
        _totals(root, lambda node: node.accounted)
    # a node with nothing accounted in its subtree is not shown (the parameter view lists no ops)
    shown = {id(n) for n in root.walk() if n is root or (_has_accounted(n) and _should_show(n, options))}
    if options["account_displayed_op_only"] and not lift_hidden and not root.fixed_totals:
        _totals(root, lambda node: node.accounted and id(node) in shown)
    root.children = _displayed(root.children, shown)
    _order(root, options["order_by"])
    return root


def _has_accounted(node: ViewNode) -> bool:
    cached = getattr(node, "_has_accounted_cache", None)
    if cached is None:
        cached = node.accounted or any(_has_accounted(c) for c in node.children)
        object.__setattr__(node, "_has_accounted_cache", cached)
    return cached


def _set_depths(node: ViewNode, depth: int) -> None:
    node.depth = depth
    for child in node.children:
        _set_depths(child, depth + 1)


def _trim(node: ViewNode, patterns: list[re.Pattern]) -> None:
    if patterns:
        node.children = [c for c in node.children if not any(p.fullmatch(c.name) for p in patterns)]
    for child in node.children:
        _trim(child, patterns)


def _start_nodes(node: ViewNode, patterns: list[re.Pattern]) -> Iterable[ViewNode]:
    for child in node.children:
        if any(p.fullmatch(child.name) for p in patterns):
            yield child
        else:
            yield from _start_nodes(child, patterns)


def _totals(node: ViewNode, counts) -> dict[str, float]:
    totals = dict(node.self_) if counts(node) else dict.fromkeys(ATTRS, 0.0)
    for child in node.children:
        for attr, value in _totals(child, counts).items():
            totals[attr] += value
    node.total = totals
    return totals


def _should_show(node: ViewNode, options: dict[str, Any]) -> bool:
    for option, attr in _MIN_OPTIONS.items():
        if node.total[attr] < options[option]:
            return False
    if node.depth > options["max_depth"]:
        return False
    shows = options["_show_name_regexes"]
    if [p.pattern for p in shows] != [".*"] and not any(p.fullmatch(node.name) for p in shows):
        return False
    return not any(p.fullmatch(node.name) for p in options["_hide_name_regexes"])


def _displayed(nodes: list[ViewNode], shown: set[int]) -> list[ViewNode]:
    """The shown nodes among `nodes`; a hidden node's shown descendants take its place."""
    out = []
    for node in nodes:
        children = _displayed(node.children, shown)
        if id(node) in shown:
            node.children = children
            out.append(node)
        else:
            out.extend(children)
    return out


def _order(node: ViewNode, order_by: str) -> None:
    if order_by == "name":
        node.children.sort(key=lambda c: c.name)
    elif order_by != "depth":
        node.children.sort(key=lambda c: -c.total[order_by])
    for child in node.children:
        _order(child, order_by)


def tree_text(root: ViewNode, options: dict[str, Any]) -> str:
    """tfprof's rows, `name (self/total, ...)` indented by depth, under TF's legend of the selected columns.

    The scope and graph views take tfprof_show.cc's order and formats; the code view tfprof_code.cc's (memory
    and times first, and no single input signature for a code line: `input_shapes N/A in code view`)."""
    code = root.view == "code"
    shown = columns(options["select"], MULTI_COLUMNS if code else TREE_COLUMNS)
    lines = [legend(options["select"], multi=code)]

    def row(node: ViewNode, indent: int) -> None:
        parts = _tree_parts(node, shown, code)
        lines.append(f"{'  ' * indent}{node.name} ({', '.join(parts)})")
        for child in node.children:
            row(child, indent + 1)

    row(root, 0)
    return "\n".join(lines) + "\n"


def _tree_parts(node: ViewNode, shown: list[str], code: bool) -> list[str]:
    def pair(attr: str, formatter) -> str:
        own = formatter(node.self_[attr]) if node.accounted else "--"
        return f"{own}/{formatter(node.total[attr])}"

    parts = []
    for column in shown:
        if column == "params":
            if node.shape is not None and not code:
                parts.append(format_shape(node.shape))
            parts.append(pair("params", format_number) + " params")
        elif column == "float_ops":
            parts.append(pair("float_ops", format_number) + " flops")
        elif column in _MEMORY:
            parts.append(pair(column, format_memory))
        elif column in _TIMES:
            parts.append(pair(column, format_time))
        elif column == "device":
            if node.device:
                parts.append(node.device)
        elif column == "op_types":
            parts.append("|".join(sorted(node.op_types)))
        elif column == "occurrence":
            runs = pair("occurrence", format_number)
            own = (format_number(node.self_["definitions"]) if code else "1") if node.accounted else "--"
            parts.append(f"{runs}|{own}/{format_number(node.total['definitions'])}")
        elif column == "input_shapes":
            parts.append("input_shapes N/A in code view" if code else format_input_shapes(node.input_shapes))
    return parts


def op_view(profile: ProfileData, options: dict[str, Any]) -> OpViewResult:
    """One row per op type: `value (accumulated%, self%)` per selected column, TF's op view (tfprof_op.cc).

    Rows sort by `order_by`; a row's accumulated figure is its own plus the rows after it, over every accounted
    row (over the displayed ones only with `account_displayed_op_only`), its percentages are of the first's."""
    step = options["step"]
    rows, members = group_rows(profile, options, lambda data: [t for t in data.op_types if _accounted([t], options)])
    for name, row in rows.items():
        row.op_types = sorted({t for data in members[name] for t in data.op_types})
        row.devices = sorted({data.device for data in members[name] if data.device})
        row.input_types = _input_types(members[name], step)
    order_by = options["order_by"]
    ordered = sorted(rows.values(), key=lambda r: r.name)
    if order_by not in ("name", "depth"):
        ordered.sort(key=lambda r: -r.self_[order_by])
    shown = [r for r in ordered if _should_show(ViewNode(r.name, depth=1, total=r.self_), options)]
    basis = shown if options["account_displayed_op_only"] else ordered
    accumulated: dict[int, dict[str, float]] = {}
    running = dict.fromkeys(ATTRS, 0.0)
    for row in reversed(basis):
        running = {attr: running[attr] + row.self_[attr] for attr in ATTRS}
        accumulated[id(row)] = running
    root = accumulated[id(basis[0])] if basis else dict.fromkeys(ATTRS, 0.0)
    selected = columns(options["select"], MULTI_COLUMNS)
    lines = [legend(options["select"], multi=True) + "\n"]
    lines.extend(_op_row(row, accumulated[id(row)], root, selected) for row in shown)
    return OpViewResult(shown, "".join(lines))


def group_rows(profile: ProfileData, options: dict[str, Any], keys: Callable[[NodeData], Iterable[str]]
               ) -> tuple[dict[str, MultiGraphNode], dict[str, list[NodeData]]]:
    """The accounted nodes at `options["step"]` summed into one row per key of `keys(node)` (the op view: a
    node counts in the row of each of its accounted op types), with the nodes of each row."""
    rows: dict[str, MultiGraphNode] = {}
    members: dict[str, list[NodeData]] = {}
    step = options["step"]
    for data in profile.nodes.values():
        if not _included(data, step) or not _accounted(data.op_types, options):
            continue
        figures = data.figures(step)
        for key in keys(data):
            row = rows.get(key)
            if row is None:
                row = rows[key] = MultiGraphNode(key, dict.fromkeys(ATTRS, 0.0), [], 0)
                members[key] = []
            for attr, index in FIGURES.items():
                row.self_[attr] += figures[index]
            row.self_["params"] += data.params
            row.self_["definitions"] += 1
            row.nodes.append(data.name)
            row.defined += 1
            members[key].append(data)
    return rows, members


def _input_types(nodes: list[NodeData], step: int) -> list[tuple[list, float, int, float]]:
    """TF's FormatInputShapes: the nodes grouped by their input shapes, (shapes, runs, nodes, micros), most
    runs first (ties in the order of the shapes' text)."""
    groups: dict[str, list] = {}
    for data in nodes:
        shapes = input_shapes(data)
        figures = data.figures(step)
        group = groups.setdefault(format_input_shapes(shapes, ",\t"), [shapes, 0.0, 0, 0.0])
        group[1] += figures[COUNT]
        group[2] += 1
        group[3] += figures[MICROS]
    ordered = [tuple(groups[key]) for key in sorted(groups)]
    ordered.sort(key=lambda g: -g[1])
    return ordered


def _op_row(row: MultiGraphNode, accumulated: dict[str, float], root: dict[str, float], selected: list[str]) -> str:
    """A row as tfprof_op.cc writes it: the name in 25 columns, each figure right-aligned in 30."""

    def percent(attr: str, formatted: str, only_if_own: bool = False) -> str:
        own, total, whole = row.self_[attr], accumulated[attr], root[attr]
        accu = pct = 0.0
        if (own if only_if_own else total) > 0 and whole > 0:
            accu, pct = 100.0 * total / whole, 100.0 * own / whole
        return f"{f'{formatted} ({accu:.2f}%, {pct:.2f}%)':>30}"

    attrs = []
    for column in selected:
        if column in _MEMORY:
            attrs.append(percent(column, format_memory(row.self_[column]), only_if_own=True))
        elif column in _TIMES:
            attrs.append(percent(column, format_time(row.self_[column])))
        elif column == "params":
            attrs.append(percent("params", format_number(row.self_["params"]) + " params"))
        elif column == "float_ops":
            attrs.append(percent("float_ops", format_number(row.self_["float_ops"]) + " float_ops"))
        elif column == "device":
            attrs.append("|".join(row.devices))
        elif column == "op_types":
            attrs.append("|".join(row.op_types))
        elif column == "occurrence":
            runs = f"{round(row.self_['occurrence'])}|{row.defined}"
            attrs.append(f"{runs:>10}")
    line = f"{row.name:<25}{', '.join(attrs)}\n"
    if "input_shapes" in selected and row.input_types:
        block = "\n".join(
            "input_type: " + format_input_shapes(shapes, ",\t")
            + f"\t(run*{round(runs)}|defined*{defined})\texec_time: {format_time(micros)}"
            for shapes, runs, defined, micros in row.input_types)
        line = f"{line}\n{block}\n\n"
    return line
