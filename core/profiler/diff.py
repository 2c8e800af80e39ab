"""`Profiler.diff`: what changed between two traced steps, as tfprof would lay it out.

Three tables, each one row per op type, module (the ops' own scope, not its submodules') or code line (the
user's innermost frame; a backward op counts at its module's forward line), ranked by the size of the change
in `order_by` (default: time), and two lists of the ops that ran in only one of the steps. Every row has the
figures of both steps and the change: `1.20ms -> 3.45ms (+2.25ms)`, `--` for a step an op did not run in.
The rows are the op view's (`views.group_rows`), so a diff's op-type figures are `profile_operations`' at
each step.

Options are the views' (`ProfileOptionBuilder`), with these meanings in a diff: `select` picks the figures
(default time and requested bytes; no more than it names), `order_by` the figure ranked by (or `name`),
`account_type_regexes` the ops counted, the name regexes and every `min_*` the rows shown (a `min_*` on
the size of the change), `output` where the text goes (`stdout`, `none`, `file:outfile=`). `step`,
`start_`/`trim_name_regexes` and `min_params` mean nothing in a diff and are refused; `max_depth` and
`account_displayed_op_only` shape a tree and change nothing in its flat tables (so the presets can be given).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from hookprof.profiler.advisor import op_code_lines
from hookprof.profiler.options import DEFAULTS, check_options
from hookprof.profiler.profile_data import NodeData, ProfileData
from hookprof.profiler.views import (
    FIGURES,
    MULTI_COLUMNS,
    MULTI_HEADERS,
    ViewNode,
    _accounted,
    _should_show,
    format_memory,
    format_number,
    format_time,
    group_rows,
)

DIFF_DEFAULTS = {"select": ["micros", "bytes"], "order_by": "micros"}
_NOT_IN_A_DIFF = ("step", "start_name_regexes", "trim_name_regexes", "min_params")
_NO_MODULE = "(no module)"
_NO_LINE = "(no code line)"
_ZERO = re.compile(r"0[^0-9.]*")  # the formats' zero: 0us, 0B, 0
SECTIONS = ("op_types", "modules", "code_lines")
_TITLES = {"op_types": "op types", "modules": "modules", "code_lines": "code lines"}


@dataclasses.dataclass
class DiffRow:
    """One op type, module, code line or op: its figures at step A and at step B (None where it did not run in
    that step), by the views' attribute names (`micros`, `bytes`, ...)."""

    name: str
    a: dict[str, float] | None
    b: dict[str, float] | None

    @property
    def change(self) -> dict[str, float]:
        """B's figures less A's (a step it did not run in counts as zero)."""
        a, b = self.a or {}, self.b or {}
        return {attr: b.get(attr, 0.0) - a.get(attr, 0.0) for attr in FIGURES}

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "a": self.a, "b": self.b, "change": self.change}


@dataclasses.dataclass
class DiffResult:
    """A diff of step A against step B: ranked rows per op type, module and code line (most changed first),
    the ops that ran only in A or only in B, the attribute ranked by, and the text."""

    step_a: int
    step_b: int
    order_by: str
    op_types: list[DiffRow]
    modules: list[DiffRow]
    code_lines: list[DiffRow]
    only_in_a: list[DiffRow]
    only_in_b: list[DiffRow]
    text: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"step_a": self.step_a, "step_b": self.step_b, "order_by": self.order_by,
                **{key: [r.to_dict() for r in getattr(self, key)]
                   for key in (*SECTIONS, "only_in_a", "only_in_b")}}


def check_diff_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """The views' option check, with a diff's defaults, and the options that mean nothing in a diff refused."""
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"diff: options must be a dict (use ProfileOptionBuilder), got {type(options).__name__}.")
    options = {**DIFF_DEFAULTS, **(options or {})}
    opts = check_options(options, "diff")
    for key in _NOT_IN_A_DIFF:
        if opts[key] != DEFAULTS[key]:
            raise ValueError(f"diff: option {key!r} does not apply to a diff (the steps are diff's arguments; "
                             "rows are shown by the name regexes and the min_* options); leave it out.")
    if opts["order_by"] not in (*FIGURES, "name"):
        raise ValueError(f"diff: option 'order_by' must be 'name' or a figure of a step {list(FIGURES)}, "
                         f"got {opts['order_by']!r}.")
    figures = [column for column in MULTI_COLUMNS if column in opts["select"] and column in FIGURES]
    if not figures:
        raise ValueError(f"diff: option 'select' must name a figure of a step {list(FIGURES)}, "
                         f"got {opts['select']!r}.")
    opts["_figures"] = figures
    if opts["_output"][0] not in ("stdout", "none", "file"):
        raise ValueError(f"diff: option 'output' {opts['output']!r}: a diff is text; use 'stdout', 'none' or "
                         "'file:outfile=PATH'.")
    return opts


def check_step(profile: ProfileData, step: Any, argument: str) -> None:
    """A ValueError naming `argument` unless `step` is a step the profile traced."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"diff({argument}={step!r}): a step is an int >= 0, one of the traced steps.")
    if step not in profile.step_numbers():
        traced = ", ".join(map(str, profile.step_numbers())) or "none"
        raise ValueError(f"diff({argument}={step}): step {step} was not traced (traced steps: {traced}).")


def diff(profile_a: ProfileData, step_a: int, profile_b: ProfileData, step_b: int, opts: dict[str, Any]
         ) -> DiffResult:
    """Step `step_a` of `profile_a` against step `step_b` of `profile_b` (often the same profile), with options
    checked by `check_diff_options`."""
    lines_a = op_code_lines(profile_a)
    lines_b = lines_a if profile_b is profile_a else op_code_lines(profile_b)
    sections = {}
    for section in SECTIONS:
        a = _rows(profile_a, step_a, section, opts, lines_a)
        b = _rows(profile_b, step_b, section, opts, lines_b)
        sections[section] = _ranked([DiffRow(name, a.get(name), b.get(name)) for name in set(a) | set(b)], opts)
    ops_a = _ops(profile_a, step_a, opts)
    ops_b = _ops(profile_b, step_b, opts)
    only_a = _ranked([DiffRow(name, data, None) for name, data in ops_a.items() if name not in ops_b], opts)
    only_b = _ranked([DiffRow(name, None, data) for name, data in ops_b.items() if name not in ops_a], opts)
    result = DiffResult(step_a, step_b, opts["order_by"], sections["op_types"], sections["modules"],
                        sections["code_lines"], only_a, only_b)
    result.text = diff_text(result, opts)
    return result


def _figures(row_figures: dict[str, float]) -> dict[str, float]:
    return {attr: row_figures[attr] for attr in FIGURES}


def _rows(profile: ProfileData, step: int, section: str, opts: dict[str, Any], lines: dict[str, str | None]
          ) -> dict[str, dict[str, float]]:
    """The op view's rows at `step`, grouped by op type, module or code line (`lines`: each op's): name ->
    figures."""
    at_step = {**opts, "step": step}
    if section == "op_types":
        def keys(data: NodeData) -> list[str]:
            return [t for t in data.op_types if _accounted([t], opts)]
    elif section == "modules":
        def keys(data: NodeData) -> list[str]:
            return [data.scope or _NO_MODULE] if data.steps else []
    else:
        def keys(data: NodeData) -> list[str]:
            return [lines.get(data.name) or _NO_LINE] if data.steps else []
    rows, _ = group_rows(profile, at_step, keys)
    return {name: _figures(row.self_) for name, row in rows.items() if row.self_["occurrence"]}


def _ops(profile: ProfileData, step: int, opts: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The accounted ops that ran at `step`: node name -> figures."""
    rows, _ = group_rows(profile, {**opts, "step": step}, lambda data: [data.name] if data.ran_at(step) else [])
    return {name: _figures(row.self_) for name, row in rows.items()}


def _ranked(rows: list[DiffRow], opts: dict[str, Any]) -> list[DiffRow]:
    """The rows shown (name regexes; each `min_*` on the size of the change), the largest change first."""
    order_by = opts["order_by"]
    shown = [row for row in rows if _should_show(ViewNode(row.name, total={
        **{attr: abs(value) for attr, value in row.change.items()}, "params": 0.0}), opts)]
    shown.sort(key=lambda row: row.name)
    if order_by != "name":
        shown.sort(key=lambda row: -abs(row.change[order_by]))
    return shown


_FORMATS = {"bytes": format_memory, "peak_bytes": format_memory, "residual_bytes": format_memory,
            "output_bytes": format_memory, "micros": format_time, "accelerator_micros": format_time,
            "cpu_micros": format_time, "float_ops": format_number, "occurrence": format_number}


def _signed(value: float, formatter) -> str:
    """`+2.25ms`, `-512B`; a change that shows as zero is `+0us`."""
    text = formatter(abs(value))
    return ("-" if value < 0 and not _ZERO.fullmatch(text) else "+") + text


def _cells(row: DiffRow, figures: list[str]) -> list[str]:
    """A row's figures as `A -> B (change)`, `--` for a step the row did not run in."""
    cells = []
    for attr in figures:
        fmt = _FORMATS[attr]
        a = fmt(row.a[attr]) if row.a is not None else "--"
        b = fmt(row.b[attr]) if row.b is not None else "--"
        cells.append(f"{a} -> {b} ({_signed(row.change[attr], fmt)})")
    return cells


def diff_text(result: DiffResult, opts: dict[str, Any]) -> str:
    """The legend (the op view's labels), then each table and list under its title. Rows are laid out as the
    op view's (the name in 25 columns, each figure right-aligned in 30), widened where a name or a figure is
    longer so that each table's columns stay aligned and apart."""
    figures = opts["_figures"]
    ranked = "name" if result.order_by == "name" else MULTI_HEADERS[result.order_by]
    tables = [(_TITLES[section], getattr(result, section)) for section in SECTIONS] + [
        (f"ops only in step {result.step_a}", result.only_in_a),
        (f"ops only in step {result.step_b}", result.only_in_b)]
    lines = [f"step {result.step_a} -> step {result.step_b}, ranked by the change in {ranked}\n",
             "node name | " + " | ".join(f"{MULTI_HEADERS[attr]} (A -> B)" for attr in figures) + "\n"]
    for title, rows in tables:
        lines.append(f"{title}:\n")
        cells = [_cells(row, figures) for row in rows]
        name_width = max([25] + [len(row.name) + 2 for row in rows])
        widths = [max([30] + [len(row_cells[i]) for row_cells in cells]) for i in range(len(figures))]
        lines.extend(f"{row.name:<{name_width}}" + ", ".join(map(str.rjust, row_cells, widths)) + "\n"
                     for row, row_cells in zip(rows, cells))
    return "".join(lines)
