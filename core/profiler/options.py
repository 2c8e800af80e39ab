"""tfprof's options: the dict every view takes, its defaults, validation, and `ProfileOptionBuilder`.

Keys, defaults and meaning are TF's (`tf.profiler.ProfileOptionBuilder`): a node is shown when its totals
reach every `min_*`, it lies within `max_depth`, and its name fully matches `show_name_regexes` and none of
`hide_name_regexes`; `start_name_regexes` start the display at matching nodes, `trim_name_regexes` cut a
matching node and everything below it; only nodes whose op types match `account_type_regexes` are
accounted, and with `account_displayed_op_only` only displayed ones; `step=-1` means the mean over the steps
a node ran in; `order_by` sorts siblings, `select` picks the columns, `output` picks where the text goes.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from hookprof._runtime import distribution

ORDER_BY = ("name", "depth", "bytes", "peak_bytes", "residual_bytes", "output_bytes", "micros",
            "accelerator_micros", "cpu_micros", "params", "float_ops", "occurrence")
SELECT = ("bytes", "peak_bytes", "residual_bytes", "output_bytes", "micros", "accelerator_micros",
          "cpu_micros", "params", "float_ops", "occurrence", "tensor_value", "device", "op_types",
          "input_shapes")
_INT_KEYS = ("max_depth", "min_bytes", "min_peak_bytes", "min_residual_bytes", "min_output_bytes", "min_micros",
             "min_accelerator_micros", "min_cpu_micros", "min_params", "min_float_ops", "min_occurrence")
_REGEX_KEYS = ("account_type_regexes", "start_name_regexes", "trim_name_regexes", "show_name_regexes",
               "hide_name_regexes")
_OUTPUTS = ("stdout", "none", "file", "timeline", "pprof")

DEFAULTS: dict[str, Any] = {
    "max_depth": 100, "min_bytes": 0, "min_peak_bytes": 0, "min_residual_bytes": 0, "min_output_bytes": 0,
    "min_micros": 0, "min_accelerator_micros": 0, "min_cpu_micros": 0, "min_params": 0, "min_float_ops": 0,
    "min_occurrence": 0, "step": -1, "order_by": "name", "account_type_regexes": [".*"],
    "start_name_regexes": [".*"], "trim_name_regexes": [], "show_name_regexes": [".*"],
    "hide_name_regexes": [], "account_displayed_op_only": False, "select": ["micros"], "output": "stdout",
}


def check_options(options: dict[str, Any] | None, view: str = "") -> dict[str, Any]:
    """Validate an option dict (unknown keys, types, values, regexes) and fill in TF's defaults."""
    where = f"profile_{view}" if view else "options"
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise TypeError(f"{where}: options must be a dict (use ProfileOptionBuilder), got {type(options).__name__}.")
    unknown = sorted(set(options) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"{where}: unknown option(s) {unknown}; the keys are {sorted(DEFAULTS)}.")
    merged = {**copy.deepcopy(DEFAULTS), **copy.deepcopy(options)}
    for key in _INT_KEYS:
        value = merged[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{where}: option {key!r} must be an int >= 0, got {value!r}.")
    step = merged["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < -1:
        raise ValueError(f"{where}: option 'step' must be -1 (mean over steps) or a step number, got {step!r}.")
    if merged["order_by"] not in ORDER_BY:
        raise ValueError(f"{where}: option 'order_by' must be one of {list(ORDER_BY)}, got {merged['order_by']!r}.")
    select = merged["select"]
    if isinstance(select, str) or not isinstance(select, (list, tuple)) or not select:
        raise ValueError(f"{where}: option 'select' must be a non-empty list from {list(SELECT)}, got {select!r}.")
    bad = [s for s in select if s not in SELECT]
    if bad:
        raise ValueError(f"{where}: option 'select' has unknown attribute(s) {bad}; choose from {list(SELECT)}.")
    merged["select"] = list(select)
    for key in _REGEX_KEYS:
        patterns = merged[key]
        if isinstance(patterns, str) or not isinstance(patterns, (list, tuple)):
            raise ValueError(f"{where}: option {key!r} must be a list of regexes, got {patterns!r}.")
        compiled = []
        for pattern in patterns:
            try:
                compiled.append(re.compile(pattern))
            except (re.error, TypeError) as err:
                raise ValueError(f"{where}: option {key!r} has an invalid regex {pattern!r} ({err}).") from None
        merged[key] = list(patterns)
        merged["_" + key] = compiled
    if not isinstance(merged["account_displayed_op_only"], bool):
        raise ValueError(f"{where}: option 'account_displayed_op_only' must be True or False.")
    merged["_output"] = parse_output(merged["output"], where)
    return merged


def parse_output(output: Any, where: str = "options") -> tuple[str, str | None]:
    """`stdout`, `none`, `file:outfile=PATH`, `timeline:outfile=PATH`, `pprof:outfile=PATH` -> (kind, path)."""
    if not isinstance(output, str):
        raise ValueError(f"{where}: option 'output' must be a string such as 'stdout' or 'file:outfile=out.txt'.")
    kind, _, rest = output.partition(":")
    if kind not in _OUTPUTS:
        raise ValueError(f"{where}: option 'output' kind {kind!r} is not one of {list(_OUTPUTS)}.")
    if kind in ("stdout", "none"):
        if rest:
            raise ValueError(f"{where}: option 'output' {output!r}: '{kind}' takes no arguments.")
        return kind, None
    key, _, path = rest.partition("=")
    if key != "outfile" or not path:
        raise ValueError(f"{where}: option 'output' {output!r} must look like '{kind}:outfile=PATH'.")
    if kind == "pprof":  # the profile is written with protobuf, checked before any view runs
        distribution.require("google.protobuf", "option 'output' 'pprof:outfile=...'")
    return kind, path


class ProfileOptionBuilder:
    """TF's option builder: start from a preset (or the defaults), chain setters, `build()` the dict."""

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self._options = copy.deepcopy(options) if options is not None else copy.deepcopy(DEFAULTS)

    @staticmethod
    def trainable_variables_parameter() -> dict[str, Any]:
        """Parameters per module (the scope view of `_trainable_variables`)."""
        return {**copy.deepcopy(DEFAULTS), "max_depth": 10000, "order_by": "name",
                "account_type_regexes": ["_trainable_variables"], "account_displayed_op_only": True,
                "select": ["params"]}

    @staticmethod
    def float_operation() -> dict[str, Any]:
        """Float operations per node (needs FLOPs recorded by the tracer)."""
        return {**copy.deepcopy(DEFAULTS), "max_depth": 10000, "min_float_ops": 1, "order_by": "float_ops",
                "account_displayed_op_only": True, "select": ["float_ops"]}

    @staticmethod
    def time_and_memory(min_micros: int = 1, min_bytes: int = 1, min_accelerator_micros: int = 0,
                        min_cpu_micros: int = 0, min_peak_bytes: int = 0, min_residual_bytes: int = 0,
                        min_output_bytes: int = 0) -> dict[str, Any]:
        """Time and memory of nodes that took at least `min_micros` and allocated at least `min_bytes`."""
        return {**copy.deepcopy(DEFAULTS), "max_depth": 10000, "min_bytes": min_bytes,
                "min_peak_bytes": min_peak_bytes, "min_residual_bytes": min_residual_bytes,
                "min_output_bytes": min_output_bytes, "min_micros": min_micros,
                "min_accelerator_micros": min_accelerator_micros, "min_cpu_micros": min_cpu_micros,
                "order_by": "micros", "account_displayed_op_only": True, "select": ["micros", "bytes"]}

    def build(self) -> dict[str, Any]:
        """The option dict (validated)."""
        check_options(self._options)
        return copy.deepcopy(self._options)

    def _set(self, **values: Any) -> ProfileOptionBuilder:
        self._options.update(values)
        return self

    def with_max_depth(self, max_depth: int) -> ProfileOptionBuilder:
        return self._set(max_depth=max_depth)

    def with_min_memory(self, min_bytes: int = 0, min_peak_bytes: int = 0, min_residual_bytes: int = 0,
                        min_output_bytes: int = 0) -> ProfileOptionBuilder:
        return self._set(min_bytes=min_bytes, min_peak_bytes=min_peak_bytes, min_residual_bytes=min_residual_bytes,
                         min_output_bytes=min_output_bytes)

    def with_min_execution_time(self, min_micros: int = 0, min_accelerator_micros: int = 0,
                                min_cpu_micros: int = 0) -> ProfileOptionBuilder:
        return self._set(min_micros=min_micros, min_accelerator_micros=min_accelerator_micros,
                         min_cpu_micros=min_cpu_micros)

    def with_min_parameters(self, min_params: int) -> ProfileOptionBuilder:
        return self._set(min_params=min_params)

    def with_min_occurrence(self, min_occurrence: int) -> ProfileOptionBuilder:
        return self._set(min_occurrence=min_occurrence)

    def with_min_float_operations(self, min_float_ops: int) -> ProfileOptionBuilder:
        return self._set(min_float_ops=min_float_ops)

    def with_accounted_types(self, account_type_regexes: list[str]) -> ProfileOptionBuilder:
        return self._set(account_type_regexes=list(account_type_regexes))

    def with_node_names(self, start_name_regexes: list[str] | None = None,
                        show_name_regexes: list[str] | None = None, hide_name_regexes: list[str] | None = None,
                        trim_name_regexes: list[str] | None = None) -> ProfileOptionBuilder:
        for key, value in (("start_name_regexes", start_name_regexes), ("show_name_regexes", show_name_regexes),
                           ("hide_name_regexes", hide_name_regexes), ("trim_name_regexes", trim_name_regexes)):
            if value is not None:
                self._options[key] = list(value)
        return self

    def account_displayed_op_only(self, is_true: bool) -> ProfileOptionBuilder:
        return self._set(account_displayed_op_only=is_true)

    def with_empty_output(self) -> ProfileOptionBuilder:
        return self._set(output="none")

    def with_stdout_output(self) -> ProfileOptionBuilder:
        return self._set(output="stdout")

    def with_file_output(self, outfile: str) -> ProfileOptionBuilder:
        return self._set(output=f"file:outfile={outfile}")

    def with_timeline_output(self, timeline_file: str) -> ProfileOptionBuilder:
        return self._set(output=f"timeline:outfile={timeline_file}")

    def with_pprof_output(self, pprof_file: str) -> ProfileOptionBuilder:
        return self._set(output=f"pprof:outfile={pprof_file}")

    def order_by(self, attribute: str) -> ProfileOptionBuilder:
        return self._set(order_by=attribute)

    def select(self, attributes: list[str]) -> ProfileOptionBuilder:
        return self._set(select=list(attributes))

    def with_step(self, step: int) -> ProfileOptionBuilder:
        return self._set(step=step)
