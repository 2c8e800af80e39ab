"""The private torch APIs the torch tracer uses, each found by feature detection when first needed.

torch's profiler gives what the timelines' dataflow, memory tracks and fast module spans need only through
private names, which may move or go between releases (pyproject declares torch>=2.11; the README says which
versions were run). Where one is missing, the trace goes on without what it gave, and one warning per process
names what the trace loses; where a public fallback gives the same content, nothing is said:

| private API | used for | without it |
| --- | --- | --- |
| `torch._C._profiler._RecordFunctionFast` | module scope spans | `torch.autograd.profiler.record_function` (slower) |
| `torch._C._autograd._profiler_enabled` | not taking over a running profiler | assumed idle; one warning |
| `torch._C._profiler._EventType`, `experimental_event_tree()` | dataflow arrows, memory | neither; one warning |
| `torch._C._jit_get_schemas_for_operator` | in-place writes of ops | found by name only; one warning |
| `torch._C._profiler._ExperimentalConfig(trace_only=True)` | a cheaper stop for export-only steps | the full stop |

The conversion itself reads kineto's own JSON export of the step (`_ProfilerResult.save`) and the
profile's start (`_ProfilerResult.trace_start_ns`), which torch 2.3 lacks: on such a torch every step runs
untraced, with one warning saying so (`unsupported_torch`). Nothing reads kineto's per-event accessors
(`_KinetoEvent.activity_type`, `external_id`: torch 2.11 has neither, and traces fully).
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Any

from hookprof._runtime.warn_once import WarnOnce

log = logging.getLogger(__name__)
_warn_once = WarnOnce(log)  # once per process: the torch in use does not change


def private(module: str, name: str, loses: str | None = None) -> Any:
    """`module.name` if this torch has it, else None; then, if `loses` says what the trace loses without it,
    one warning naming the API and the loss."""
    try:
        found = getattr(importlib.import_module(module), name, None)
    except ImportError:
        found = None
    if found is None and loses:
        warn_missing(f"{module}.{name}", loses)
    return found


def warn_missing(api: str, loses: str) -> None:
    """One warning per process that this torch lacks `api`, and what the trace loses."""
    import torch

    _warn_once(api, "This torch (%s) has no %s: %s. Traces go on without it.", torch.__version__, api, loses)


def profiler_enabled() -> bool:
    """Whether a torch profiler is running in this process (False, with one warning, where torch cannot say)."""
    enabled = private("torch._C._autograd", "_profiler_enabled",
                      "hookprof cannot tell whether another torch profiler is running, and would end its session")
    return bool(enabled()) if enabled is not None else False


def record_function_class() -> Any:
    """The context manager that opens a named span in the trace: torch's C++ one (about 1.6 us a module call
    on this project's machine, against 19 us for `record_function`), else the public one."""
    fast = private("torch._C._profiler", "_RecordFunctionFast")
    if fast is not None:
        return fast
    from torch.autograd.profiler import record_function

    return record_function


def export_only_config() -> Any:
    """A new `_ExperimentalConfig(trace_only=True)` where this torch has that option, else None. With it, the
    profiler's stop builds nothing for Python (no `events()`, no event tree) and kineto's export writes the
    same events: measured on a 20k-event step, stop + export + freeing the results 253 -> 204 ms, most of it
    the free of Python-visible events nobody reads. Only for steps that need nothing but the export."""
    config = private("torch._C._profiler", "_ExperimentalConfig")
    if config is None:
        return None
    try:
        return config(trace_only=True)
    except TypeError:  # a torch before the option
        return None


OLDEST_TORCH_RUN = "2.11"  # the oldest torch the tracer has run on (pyproject's floor; the README says which failed)
_RESULT_ACCESSORS = ("save", "trace_start_ns")  # the export the conversion reads, and its time base


@functools.cache
def unsupported_torch() -> str | None:
    """Why this torch's profiler results cannot be converted (accessors the conversion reads are missing), or
    None. Checked once per process: the tracer then leaves every step untraced, with one warning."""
    import torch

    result = private("torch._C._autograd", "_ProfilerResult")
    missing = [f"_ProfilerResult.{name}" for name in _RESULT_ACCESSORS if not hasattr(result, name)]
    if not missing:
        return None
    return (f"this torch ({torch.__version__}) lacks what hookprof reads from its profiler ({', '.join(missing)}); "
            f"hookprof's tracer is tested on torch {OLDEST_TORCH_RUN} and needs it or later: pip install "
            f"'torch>={OLDEST_TORCH_RUN}'")
