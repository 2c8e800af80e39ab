"""`advise()`: checkers that read the accumulated profile and say what slows training, with the evidence.

Each checker returns findings `{"severity": share of step time at stake (0-1), "report": text, "evidence":
{...}}`: one finding per cause (the same op at the same module and code line is one cause, however many
nodes it ran as), and none where the profile shows no problem, so a healthy model gets no report at all.
The result maps checker name -> {"reports": [texts, most severe first], "findings": [...]}, checkers ordered
by their most severe finding, and is printed to stdout as tfprof's advisor printed it (`\\n<checker>:\\n`,
then one line per report). Options select checkers like TF's `ALL_ADVICE`:
`advise({"HostSyncChecker": {}, "InputPipelineChecker": {}})`.

What each checker counts as a cause, and why:
- ExpensiveOperationChecker: a module (else code line, else op type) taking at least half of the step.
- AcceleratorUtilizationChecker: an accelerator (CUDA device) running kernels less than half of the step. A
  CPU-only run has no accelerator to keep busy (TF's checker, too, reported accelerators only).
- InputPipelineChecker: the wait before each step (fetching the batch, from the previous step's end to this
  one's start) at least 20% of the time and 10 ms in the median step; measured only on steps whose previous
  step was not traced, since the conversion of a traced step competes with the loop for the GIL, and over 3 of
  them at least (see `input_pipeline`).
- HostSyncChecker: a value read back from a device (`.item()`, `if t:`, `nonzero` ... whose op moved data on
  the accelerator), or, on the host, a tensor's value read into Python by the user's own code. A read of a
  CPU tensor inside a library (Adam's per-parameter step counters, `torch/optim/optimizer.py: _get_value`)
  waits for nothing and is not reported.
- OperationChecker: compute ops (not casts, copies or views) on float64 tensors of more than one element,
  per module, with the optimizer's updates of that module's float64 parameters; layout copies
  (`aten::contiguous`) of 4 MiB and more per step; per-tensor optimizer updates on an accelerator.
- JobChecker: the straggler of a distributed run: the rank the others wait for in collectives (gloo/nccl
  all-reduce, broadcast, barrier ...), the gap between their waits 20% of the step and more (or, without
  collectives, a rank 20% slower than the fastest); communication taking 20% of the step and more.
- MemoryGrowthChecker: an op (at its module and code line) whose data made in every traced step is still
  allocated at the step's end, 16 KiB a step and more, over 3 traced steps and more; gradients and optimizer
  state are kept by design. Where the allocator's totals show every free (CUDA), they must rise too; on the
  host torch's totals cannot show it (see `memory_growth`). Its severity: what the cause kept over the traced
  steps' span against one step's allocations.
"""

from __future__ import annotations

import os
import re
import statistics
from collections.abc import Callable, Iterable
from typing import Any

from hookprof.profiler.profile_data import (
    ACCEL,
    BYTES,
    COLLECTIVE,
    COUNT,
    CPU,
    MICROS,
    OUTPUT,
    RESIDUAL,
    NodeData,
    ProfileData,
)
from hookprof.profiler.views import format_memory, format_time

# --- thresholds: below them a figure is what a healthy step looks like ------------------------------------
EXPENSIVE_SHARE = 0.5  # one module/line/op type taking half of the step is where the time goes
ACCELERATOR_BUSY_SHARE = 0.5  # an accelerator running kernels less than this share of the step idles
INPUT_STALL_SHARE = 0.2  # TF's profiler calls a step input-bound from 20% of its time waiting for input
# Between two steps the framework runs its own loop, callbacks and logging, and the tracer starts: a few
# ms on any model, which on a tiny step is a large share. A wait under this is no evidence of a slow input.
INPUT_STALL_MIN_MICROS = 10_000.0
# One slow gap between two steps (the machine's load, a garbage collection) is no evidence that each step waits
# for its batch: the verdict needs this many steps that followed an untraced step, and reads their median.
INPUT_STALL_MIN_STEPS = 3
LARGE_COPY_BYTES = 4 << 20
UNFUSED_MIN_OPS = 8
STRAGGLER_SPREAD = 0.2
COMMUNICATION_SHARE = 0.2
MEMORY_GROWTH_MIN_STEPS = 3  # over fewer traced steps there is no trend (a first step makes state once)
MEMORY_GROWTH_MIN_BYTES = 16 << 10  # kept per step; below it (logged scalars, a loss) no run fills a device
# what outlives each step by design: gradients (backward) and the optimizer's state (see memory_growth)
_KEPT_BY_DESIGN = frozenset({"backward", "optimizer"})
_HOST_DEVICE = "/host:"  # the host's device names (/host:CPU), whose allocator totals cannot show growth

# Ops that read a tensor's value into Python (`.item()`, `float(t)`, `if t:`); each read runs
# `_local_scalar_dense` once, nested in `item` (itself nested in `is_nonzero` for `if t:`).
READBACK_OPS = ("aten::is_nonzero", "aten::item", "aten::_local_scalar_dense")  # outermost first
# Ops whose output size depends on the data: on an accelerator the host must wait to learn the size.
DATA_DEPENDENT_OPS = frozenset({
    "aten::nonzero", "aten::masked_select", "aten::unique", "aten::_unique", "aten::_unique2",
    "aten::unique_dim", "aten::unique_consecutive", "aten::unique_dim_consecutive",
})
# aten ops that move, cast, view or allocate tensors but compute nothing on their values
NOT_COMPUTE = frozenset("aten::" + name for name in (
    "to", "_to_copy", "copy_", "clone", "contiguous", "detach", "detach_", "alias", "lift_fresh", "view",
    "_unsafe_view", "view_as", "reshape", "_reshape_alias", "flatten", "t", "transpose", "permute", "expand",
    "expand_as", "as_strided", "unsqueeze", "squeeze", "select", "slice", "narrow", "split", "split_with_sizes",
    "chunk", "unbind", "resolve_conj", "resolve_neg", "empty", "empty_like", "empty_strided", "new_empty",
    "new_empty_strided", "zeros", "zeros_like", "ones_like", "zero_", "fill_", "resize_", "set_", "numpy_T",
    "type_as", "broadcast_tensors", "item", "_local_scalar_dense", "is_nonzero",
))
_UPDATE_OPS = frozenset({"aten::add_", "aten::mul_", "aten::addcmul_", "aten::addcdiv_", "aten::lerp_",
                         "aten::sqrt", "aten::div_", "aten::sub_"})
_ITEMSIZE = {"float64": 8, "int64": 8, "complex64": 8, "complex128": 16, "float32": 4, "int32": 4,
             "uint32": 4, "float16": 2, "bfloat16": 2, "int16": 2, "uint16": 2}
# hookprof's own frames: `hookprof/...` where installed; in a source checkout its folder's name (`core/...`)
_OWN_PACKAGE = os.path.basename(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_LIBRARY_FRAME = re.compile(r"^(torch|lightning|pytorch_lightning|lightning_fabric|keras|hookprof|lightning_prof|"
                            r"keras_prof|typing|contextlib|threading|functools|" + re.escape(_OWN_PACKAGE) +
                            r")/|site-packages|^<built-in|^<frozen")
# a Python source frame, `file.py(23): func`; torch's Python tracer also records module calls
# (`nn.Module: Linear_0`) and C functions (`<built-in method item of Tensor object>`), which are no code line
_SOURCE_FRAME = re.compile(r"^[^<].*\(\d+\): ")


def user_code_line(stack: list[str]) -> str | None:
    """The innermost frame of the user's own code in a recorded stack (`model.py(23): forward`); a script's
    top level (`<module>`, the `trainer.fit(...)` line) is no evidence and is skipped."""
    for frame in reversed(stack):
        if _SOURCE_FRAME.match(frame) and not _LIBRARY_FRAME.search(frame) and not frame.endswith(": <module>"):
            return frame
    return None


def caller_frame(stack: list[str]) -> str | None:
    """The innermost Python source frame of a recorded stack: the code that called the op (a built-in
    method's own frame, `<built-in method item ...>`, is the op's entry, not its caller)."""
    for frame in reversed(stack):
        if _SOURCE_FRAME.match(frame):
            return frame
    return None


def _is_user_frame(frame: str) -> bool:
    return not _LIBRARY_FRAME.search(frame)


def _step_micros(profile: ProfileData) -> float:
    values = [s.step_micros for s in profile.steps.values() if s.step_micros]
    return statistics.mean(values) if values else 0.0


def _mean_micros(node: NodeData, index: int = MICROS) -> float:
    return node.figures(-1)[index] if node.steps else 0.0


def _where(scope: str, line: str | None) -> str:
    return (scope or "(no module)") + (f" at {line}" if line else "")


def _numel(shape: Any) -> int:
    """Elements of one argument's shape (`[8, 16]`); a tensor list's shapes add up; 0 for a non-tensor."""
    if not isinstance(shape, (list, tuple)):
        return 0
    if all(isinstance(dim, int) for dim in shape):
        count = 1
        for dim in shape:
            count *= dim
        return count
    return sum(_numel(part) for part in shape)


def _inputs(node: NodeData, dtype: str | None = None) -> Iterable[tuple[list, str]]:
    """(shape, dtype) of the node's tensor arguments, those of `dtype` only if given."""
    for shape, kind in zip(node.input_shapes, node.input_dtypes):
        if dtype is None or kind == dtype:
            yield shape, kind


def _is_float64_compute(node: NodeData) -> bool:
    """Arithmetic on a real float64 tensor: not a cast, copy or view, and not a 0-d (or one-element) float64
    argument, which is how torch passes Python floats (Adam's betas, lr, bias corrections)."""
    if not node.op.startswith("aten::") or node.op in NOT_COMPUTE:
        return False
    return any(_numel(shape) > 1 for shape, _ in _inputs(node, "float64"))


def _main_line(nodes: list[NodeData]) -> str | None:
    """The user's code line where most of these nodes' time was spent. A backward op's stack is the code
    that called `backward()`, not the module's own: backward ops count only when no other op has a line."""
    for group in ([node for node in nodes if node.phase != "backward"], nodes):
        by_line: dict[str, float] = {}
        for node in group:
            line = user_code_line(node.stack)
            if line:
                by_line[line] = by_line.get(line, 0.0) + _mean_micros(node)
        if by_line:
            return max(by_line, key=by_line.get)
    return None


def op_code_lines(profile: ProfileData) -> dict[str, str | None]:
    """Each op's code line, by node name: the innermost frame of the user's own code in its stack. A backward
    op's stack is the code that called `backward()`, so it takes the line of its module's forward (the line
    where most of the module's forward time was spent), where the module ran forward ops. Outside modules
    there is no forward to borrow: every op keeps its own stack's line (a time-weighted pick among the
    step's lines there would change with the machine's load)."""
    forward: dict[str, list[NodeData]] = {}
    for node in profile.nodes.values():
        if node.steps and node.phase != "backward" and node.scope:
            forward.setdefault(node.scope, []).append(node)
    lines = {scope: _main_line(nodes) for scope, nodes in forward.items()}
    return {node.name: (lines.get(node.scope) if node.phase == "backward" else None) or user_code_line(node.stack)
            for node in profile.nodes.values() if node.steps}


# --- the checkers -------------------------------------------------------------------------------------------

def expensive_operations(profile: ProfileData) -> list[dict[str, Any]]:
    """A cause (a module; outside modules, a code line; else an op type) taking half of the step or more."""
    step = _step_micros(profile) or 1.0
    causes: dict[tuple[str, str], list[NodeData]] = {}
    for node in profile.nodes.values():
        if not _mean_micros(node):
            continue
        line = user_code_line(node.stack)
        key = ("module", node.scope) if node.scope else ("code line", line) if line else ("op type", node.op)
        causes.setdefault(key, []).append(node)
    findings = []
    for (kind, name), nodes in causes.items():
        micros = sum(_mean_micros(n) for n in nodes)
        if micros / step < EXPENSIVE_SHARE:
            continue
        by_op: dict[str, float] = {}
        for node in nodes:
            by_op[node.op] = by_op.get(node.op, 0.0) + _mean_micros(node)
        top = max(by_op, key=by_op.get)
        line = _main_line(nodes) if kind == "module" else None
        findings.append({
            "severity": micros / step,
            "evidence": {kind: name, "micros_per_step": micros, "top_op": top, "code_line": line},
            "report": f"Expensive {kind}: {_where(name, line) if kind == 'module' else name} takes "
                      f"{format_time(micros)} per step ({100 * micros / step:.1f}% of the step), most of it in "
                      f"{top} ({format_time(by_op[top])}).",
        })
    return findings


def accelerator_utilization(profile: ProfileData) -> list[dict[str, Any]]:
    """An accelerator that runs kernels less than half of the step (a CPU-only run has none to keep busy)."""
    steps = [s for s in profile.steps.values() if s.step_micros]
    if not steps:
        return []
    host_busy = statistics.mean(s.busy_micros / s.step_micros for s in steps)
    gaps = sorted((g for s in steps for g in s.gaps), key=lambda g: -g[1])[:3]
    gap_text = ", ".join(f"{format_time(length)} at +{format_time(start)}" for start, length in gaps)
    findings = []
    for device in sorted({d for s in steps for d in s.accelerator_busy}):
        share = statistics.mean(s.accelerator_busy.get(device, 0.0) / s.step_micros for s in steps)
        if share >= ACCELERATOR_BUSY_SHARE:
            continue
        findings.append({
            "severity": 1.0 - share,
            "evidence": {"device": device, "busy_share": share, "host_busy_share": host_busy,
                         "largest_gaps_us": gaps},
            "report": f"{device} runs kernels {100 * share:.1f}% of the step and idles the rest, waiting for the "
                      f"host (ops keep the host thread busy {100 * host_busy:.1f}% of the step"
                      + (f"; largest gaps between ops: {gap_text})" if gaps else ")")
                      + ". Larger batches, fewer host syncs, or CUDA graphs keep it busier.",
        })
    return findings


def input_pipeline(profile: ProfileData) -> list[dict[str, Any]]:
    """Steps that wait for their batch: the time from the previous step's end (its hooks done) to this
    step's start (before hookprof's own tracer start).

    Only steps whose wait hookprof's own workers did not share are evidence: while an earlier traced step is
    converted, rendered or written, those threads compete for the GIL and the CPU with everything the training
    loop does between steps (tens of ms on a small model, more on a loaded machine: hookprof's own cost, not the
    input pipeline's). So are no steps right after a traced step (a profile from before the shared waits were
    marked). A profile's first step after `fit` starts has no wait. The verdict reads the median of at least
    `INPUT_STALL_MIN_STEPS` such steps.
    """
    clean = [s for s in profile.steps.values()
             if s.step_micros and s.data_wait_micros and not s.data_wait_shared
             and (s.rank, s.step - 1) not in profile.steps]
    if len(clean) < INPUT_STALL_MIN_STEPS:
        return []
    wait = statistics.median(s.data_wait_micros for s in clean)
    share = statistics.median(s.data_wait_micros / (s.data_wait_micros + s.step_micros) for s in clean)
    if share < INPUT_STALL_SHARE or wait < INPUT_STALL_MIN_MICROS:
        return []
    return [{
        "severity": share,
        "evidence": {"data_wait_share": share, "data_wait_us": wait, "steps": sorted(s.step for s in clean)},
        "report": f"Input stall: each step waits {format_time(wait)} before it starts ({100 * share:.1f}% of the "
                  f"time, over {len(clean)} step(s) whose wait hookprof's own work did not share), fetching its "
                  "batch and running the callbacks between steps. Raise the DataLoader's num_workers, use pin_memory / "
                  "persistent_workers, or move preprocessing out of __getitem__.",
    }]


def host_syncs(profile: ProfileData) -> list[dict[str, Any]]:
    """Reads of a tensor's value into Python, and data-dependent shapes, that make the host wait.

    A read is a sync when its op moved data on an accelerator (its kernels/copies have accelerator time);
    on the host it only costs a wait when the user's own code reads a computed value (on a GPU the same
    line would wait for all queued work). Reads of CPU tensors inside libraries (Adam's step counters,
    read with `.item()` once per parameter and kept on the CPU precisely so that this waits for nothing)
    are neither, and so are data-dependent ops on the host.
    """
    step = _step_micros(profile) or 1.0
    groups: dict[tuple, list[NodeData]] = {}
    for node in profile.nodes.values():
        if not node.steps or (node.op not in READBACK_OPS and node.op not in DATA_DEPENDENT_OPS):
            continue
        kind = "readback" if node.op in READBACK_OPS else "data-dependent"
        caller = caller_frame(node.stack)
        line = user_code_line(node.stack) or caller
        user_read = _is_user_frame(caller) if caller else not (
            node.phase == "optimizer" or node.scope.startswith("optimizer"))  # no stack: judge by phase
        groups.setdefault((kind, node.scope, line, user_read), []).append(node)
    findings = []
    for (kind, scope, line, user_read), nodes in groups.items():
        on_device = any(_mean_micros(n, ACCEL) > 0 for n in nodes)
        if not on_device and (kind == "data-dependent" or not user_read):
            continue
        counts: dict[str, float] = {}
        for node in nodes:
            counts[node.op] = counts.get(node.op, 0.0) + node.figures(-1)[COUNT]
        per_step = max(counts.values())  # nested ops (item > _local_scalar_dense) are one read
        micros = sum(_mean_micros(n) for n in nodes)
        if kind == "readback":
            op = next(o for o in READBACK_OPS if o in counts)
            what = {"aten::is_nonzero": "`if tensor:` (bool of a tensor)", "aten::item": ".item()"}.get(
                op, "a scalar read (float(t), int(t))")
        else:
            op = max(counts, key=lambda o: sum(_mean_micros(n) for n in nodes if n.op == o))
            what = op
        where = _where(scope, line)
        if kind == "data-dependent":
            text = (f"Host-device sync: {what} in {where} has a data-dependent output size: the host waits for "
                    f"the device to learn it, {per_step:g}x per step ({format_time(micros)}). Use a fixed-size "
                    "form (torch.where, a mask multiply) or move it out of the step.")
        elif on_device:
            text = (f"Host-device sync: {what} in {where} copies a tensor's value from the device and waits for "
                    f"all work queued there, {per_step:g}x per step ({format_time(micros)}). Keep values on the "
                    "device (log tensors, not .item()) or move the check out of the step.")
        else:
            text = (f"Host sync: {what} in {where} reads a tensor's value into Python, {per_step:g}x per step "
                    f"({format_time(micros)}); on a GPU the host waits there for all queued work. Keep values "
                    "as tensors (log tensors, not .item()) or move the check out of the step.")
        findings.append({
            "severity": micros / step,
            "evidence": {"op": op, "ops": sorted(counts), "scope": scope, "code_line": user_code_line(nodes[0].stack),
                         "caller": caller_frame(nodes[0].stack), "on_device": on_device, "per_step": per_step,
                         "micros": micros},
            "report": text,
        })
    return findings


def _float64_owners(profile: ProfileData) -> dict[tuple, list[str]]:
    """Shape -> the modules holding a float64 parameter of that shape (known when the model was given)."""
    owners: dict[tuple, list[str]] = {}
    for node in profile.nodes.values():
        if node.op == "Parameter" and node.input_dtypes[:1] == ["float64"] and node.input_shapes:
            owners.setdefault(tuple(node.input_shapes[0]), []).append(node.scope)
    return owners


def float64_compute(profile: ProfileData) -> list[dict[str, Any]]:
    """Per module, compute on float64 tensors, with the optimizer's updates of its float64 parameters."""
    step = _step_micros(profile) or 1.0
    modules: dict[str, list[NodeData]] = {}
    optimizer: dict[str, list[NodeData]] = {}
    for node in profile.nodes.values():
        if node.steps and _is_float64_compute(node):
            in_optimizer = node.phase == "optimizer" or node.scope.startswith("optimizer")
            key = node.scope or user_code_line(node.stack) or node.op
            (optimizer if in_optimizer else modules).setdefault(key, []).append(node)
    updates: dict[str, float] = {}  # module -> optimizer time updating its float64 parameters
    unowned: dict[str, list[NodeData]] = {}
    owners = _float64_owners(profile)
    for scope, nodes in optimizer.items():
        for node in nodes:
            shapes = [tuple(shape) for shape, _ in _inputs(node, "float64") if _numel(shape) > 1]
            found = next((owners[s] for s in shapes if s in owners), None)
            if found is None and len(modules) == 1:  # no parameter list (no model given): the one module
                found = list(modules)
            if found is None:
                unowned.setdefault(scope, []).append(node)
                continue
            for module in found:
                updates[module] = updates.get(module, 0.0) + _mean_micros(node) / len(found)
    findings = []
    for module in sorted(set(modules) | set(updates)):
        compute = sum(_mean_micros(n) for n in modules.get(module, ()))
        update = updates.get(module, 0.0)
        line = _main_line(modules.get(module, []))
        micros = compute + update
        detail = f", {format_time(update)} of it the optimizer updating its float64 parameters" if update else ""
        findings.append({
            "severity": micros / step,
            "evidence": {"scope": module, "dtype": "float64", "code_line": line, "micros": micros,
                         "optimizer_micros": update,
                         "ops": sorted({n.op for n in modules.get(module, ())})},
            "report": f"float64 compute in {_where(module, line)} ({format_time(micros)} per step{detail}): "
                      "double precision is 2x the memory and far slower on GPUs; use float32 (drop the "
                      ".double() / dtype=torch.float64, or model.float()).",
        })
    for scope, nodes in unowned.items():
        micros = sum(_mean_micros(n) for n in nodes)
        findings.append({
            "severity": micros / step,
            "evidence": {"scope": scope, "dtype": "float64", "micros": micros, "ops": sorted({n.op for n in nodes})},
            "report": f"float64 compute in {scope} ({format_time(micros)} per step): the optimizer updates float64 "
                      "parameters or state; keep parameters in float32 (model.float()).",
        })
    return findings


def _input_bytes(node: NodeData) -> float:
    shape, dtype = next(iter(_inputs(node)), (None, ""))
    return float(_numel(shape) * _ITEMSIZE.get(dtype, 4))


def operation_checks(profile: ProfileData) -> list[dict[str, Any]]:
    step = _step_micros(profile) or 1.0
    findings = float64_compute(profile)
    copies: dict[tuple[str, str | None], list[NodeData]] = {}
    for node in profile.nodes.values():
        # aten::contiguous runs only when a tensor is not contiguous: each one is a layout copy. (copy_ and
        # clone are not counted: batches moved to the device and deliberate copies are no layout problem.)
        if node.op == "aten::contiguous" and node.steps:
            copies.setdefault((node.scope, user_code_line(node.stack)), []).append(node)
    for (scope, line), nodes in copies.items():
        nbytes = sum(max(n.figures(-1)[OUTPUT], n.figures(-1)[BYTES], _input_bytes(n) * n.figures(-1)[COUNT])
                     for n in nodes)
        if nbytes < LARGE_COPY_BYTES:
            continue
        micros = sum(_mean_micros(n) for n in nodes)
        findings.append({"severity": micros / step,
                         "evidence": {"op": "aten::contiguous", "scope": scope, "code_line": line, "bytes": nbytes,
                                      "micros": micros},
                         "report": f"Large copy: aten::contiguous in {_where(scope, line)} copies "
                                   f"{format_memory(nbytes)} per step ({format_time(micros)}): a non-contiguous "
                                   "tensor (a transpose, permute or slice) made contiguous; keep the layout the "
                                   "consumer wants."})
    updates = [n for n in profile.nodes.values() if n.phase == "optimizer" and n.steps and n.op in _UPDATE_OPS]
    fused = any("_foreach_" in n.op or "_fused_" in n.op for n in profile.nodes.values())
    # On the CPU, foreach/fused updates are no faster (torch picks the per-tensor loop there by default):
    # only per-tensor updates that launch accelerator kernels are worth fusing.
    on_device = sum(_mean_micros(n, ACCEL) for n in updates) > 0
    if len(updates) >= UNFUSED_MIN_OPS and not fused and on_device:
        micros = sum(_mean_micros(n) for n in updates)
        findings.append({"severity": micros / step, "evidence": {"per_tensor_ops": len(updates), "micros": micros},
                         "report": f"Unfused optimizer: {len(updates)} per-tensor update ops per step "
                                   f"({format_time(micros)}) launch one kernel each; pass foreach=True (or "
                                   "fused=True) to the optimizer to update all parameters in a few kernels."})
    return findings


def job_checks(profile: ProfileData) -> list[dict[str, Any]]:
    """The ranks of a distributed run against each other, and communication.

    Under DDP the ranks' steps take the same time (each waits at the gradient all-reduce for the last to come),
    so a straggler shows as the others' wait in collectives: the rank that waits least is the slow one, and the
    gap between the ranks' waits (in each rank's median step) is what it costs them every step. Without
    collectives in the profile (a run that never syncs), a rank whose steps take 20% longer is named.
    Communication is what the least-waiting rank spends in collectives (the others' extra wait is the
    straggler's), against its step.
    """
    findings = []
    steps = [s for s in profile.steps.values() if s.step_micros]
    by_rank: dict[int, list[Any]] = {}
    for s in steps:
        by_rank.setdefault(s.rank, []).append(s)
    # each rank's typical step (the median): one step that the machine's load held up on one rank (the other
    # waited for it that once) must not turn "waits every step" around
    step_us = {rank: statistics.median(s.step_micros for s in own) for rank, own in by_rank.items()}
    wait = {rank: statistics.median(s.collective_micros for s in own) for rank, own in by_rank.items()}
    measured = any(s.collective_waits for s in steps)
    if len(by_rank) > 1 and measured:
        slow, waiting = min(wait, key=wait.get), max(wait, key=wait.get)
        share = (wait[waiting] - wait[slow]) / step_us[waiting] if step_us[waiting] else 0.0
        if share >= STRAGGLER_SPREAD:
            waits = {rank: statistics.mean(s.collective_waits for s in own) for rank, own in by_rank.items()}
            names = sorted({name for s in steps for name in s.collectives})
            others = ", ".join(f"rank {rank} {format_time(wait[rank])}" for rank in sorted(wait) if rank != slow)
            findings.append({
                "severity": share,
                "evidence": {"slow_rank": slow, "collective_us_by_rank": wait, "collective_waits_by_rank": waits,
                             "collectives": names, "step_us_by_rank": step_us},
                "report": f"Straggler: rank {slow} is slow: the other ranks wait for it in collectives every step "
                          f"({others}, rank {slow} itself {format_time(wait[slow])}; {waits[waiting]:.1f} collective "
                          f"calls a step: {', '.join(names)}), {100 * share:.0f}% of rank {waiting}'s step. Look for "
                          f"what rank {slow} does more: its data (a larger or slower shard), extra work on that "
                          "rank, or a slower device."})
    elif len(by_rank) > 1:
        slow, fast = max(step_us, key=step_us.get), min(step_us, key=step_us.get)
        spread = step_us[slow] / step_us[fast] - 1 if step_us[fast] else 0.0
        if spread >= STRAGGLER_SPREAD:
            findings.append({"severity": 1 - step_us[fast] / step_us[slow],
                             "evidence": {"slow_rank": slow, "step_us_by_rank": step_us},
                             "report": f"Straggler: rank {slow} takes {format_time(step_us[slow])} per step against "
                                       f"{format_time(step_us[fast])} on rank {fast} (+{100 * spread:.0f}%); every "
                                       "rank waits for it at each gradient sync."})
    step = _step_micros(profile) or 1.0
    if measured:
        comm = min(wait.values())
    else:
        comm = sum(_mean_micros(n, CPU) for n in profile.nodes.values() if COLLECTIVE.search(n.op))
    if comm / step >= COMMUNICATION_SHARE:
        findings.append({"severity": comm / step, "evidence": {"communication_us": comm},
                         "report": f"Communication takes {format_time(comm)} per step ({100 * comm / step:.1f}% of "
                                   "the step): overlap it with compute (DDP bucket sizes, gradient accumulation "
                                   "with no_sync) or communicate less often."})
    return findings


def memory_growth(profile: ProfileData) -> list[dict[str, Any]]:
    """Data made in every traced step that is still allocated at the step's end: per cause (the op, its module
    and code line), the bytes it keeps per step, and where the allocator's totals can show it, their rise.

    Gradients (made in backward, freed at the next zero_grad or accumulated into in place) and the optimizer's
    state (made once, then updated in place) outlive each step by design and are not counted. Growth needs
    `MEMORY_GROWTH_MIN_STEPS` traced steps recorded with memory (a Profiler attached does that), and the cause
    must keep its data in every one of them. On a device whose allocator totals include every free (CUDA's
    caching allocator), the bytes in use at the end of the traced steps must also rise, step after step, so
    data replaced each step (a cached activation, an RNN's carried state) is no growth there. torch's host
    allocator reports only the blocks made while a trace runs, and no later free of them: its totals rise by
    every traced step's survivors, leak or not (a healthy two-layer model: +652 B per traced step), so on the
    host the data a step keeps is the evidence (data a module replaces each step is named there too).
    """
    findings: dict[tuple[str, str, str, str | None], dict[str, Any]] = {}
    lines = op_code_lines(profile)
    for rank in sorted({s.rank for s in profile.steps.values()}):  # (each rank's steps apart; a cause once)
        for cause, finding in _memory_growth(profile, rank, lines).items():
            findings.setdefault(cause, finding)
    return list(findings.values())


def _memory_growth(profile: ProfileData, rank: int, lines: dict[str, str | None]
                   ) -> dict[tuple[str, str, str, str | None], dict[str, Any]]:
    steps = sorted(s.step for s in profile.steps.values() if s.allocated and s.rank == rank)
    if len(steps) < MEMORY_GROWTH_MIN_STEPS:
        return {}
    causes: dict[tuple[str, str, str, str | None], dict[int, float]] = {}
    for node in profile.nodes.values():
        if node.phase in _KEPT_BY_DESIGN:
            continue
        for step in steps:
            figures = node.steps.get((rank, step))
            kept = figures[RESIDUAL] if figures else 0.0
            if kept:
                where = (node.memory_device or node.device, node.scope, node.op, lines.get(node.name))
                per_step = causes.setdefault(where, {})
                per_step[step] = per_step.get(step, 0.0) + kept
    span = steps[-1] - steps[0]
    requested = statistics.mean(sum(n.steps[(rank, s)][BYTES] for n in profile.nodes.values()
                                    if (rank, s) in n.steps) for s in steps) or 1.0
    findings = {}
    for (device, scope, op, line), per_step in causes.items():
        kept = min(per_step.values())
        if len(per_step) < len(steps) or kept < MEMORY_GROWTH_MIN_BYTES:
            continue
        rise = _allocated_rise(profile, rank, steps, device)
        if rise is not None and rise < MEMORY_GROWTH_MIN_BYTES:
            continue  # the allocator's totals hold steady: the data is replaced, not accumulated
        measured = f"; bytes in use on {device} rose {format_memory(rise)} per step" if rise is not None else ""
        findings[(device, scope, op, line)] = {
            "severity": min(1.0, kept * span / requested),
            "evidence": {"scope": scope, "op": op, "code_line": line, "device": device, "bytes_per_step": kept,
                         "kept_bytes": per_step, "allocated_rise_per_step": rise, "steps": steps, "rank": rank},
            "report": f"Memory growth: {op} in {_where(scope, line)} makes {format_memory(kept)} per step that "
                      f"is still allocated at the step's end, in each of the {len(steps)} traced steps (steps "
                      f"{steps[0]}-{steps[-1]}): {format_memory(kept * span)} more held at step {steps[-1]} than "
                      f"at step {steps[0]}{measured}. Something keeps each step's tensors (a list or dict that "
                      "grows); keep .item() values, or drop what you keep.",
        }
    return findings


def _allocated_rise(profile: ProfileData, rank: int, steps: list[int], device: str) -> float | None:
    """The rise per step of the bytes in use on `device` at the end of the traced steps (0 unless they rise
    from each traced step to the next); None on the host, whose totals cannot show it (see memory_growth)."""
    if device.startswith(_HOST_DEVICE):
        return None
    ends = [profile.steps[(rank, step)].allocated.get(device) for step in steps]
    if None in ends or not all(later > earlier for earlier, later in zip(ends, ends[1:])):
        return 0.0
    return (ends[-1] - ends[0]) / (steps[-1] - steps[0])


CHECKERS: dict[str, Callable[[ProfileData], list[dict[str, Any]]]] = {
    "ExpensiveOperationChecker": expensive_operations,
    "AcceleratorUtilizationChecker": accelerator_utilization,
    "InputPipelineChecker": input_pipeline,
    "HostSyncChecker": host_syncs,
    "OperationChecker": operation_checks,
    "JobChecker": job_checks,
    "MemoryGrowthChecker": memory_growth,
}
ALL_ADVICE: dict[str, dict] = {name: {} for name in CHECKERS}


def report_text(result: dict[str, Any]) -> str:
    """The advice as tfprof's advisor printed it: per checker `\\n<name>:\\n`, then one line per report."""
    return "".join(f"\n{name}:\n" + "".join(f"{r}\n" for r in checker["reports"]) for name, checker in result.items())


def advise(profile: ProfileData, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the selected checkers and return their reports, the most severe checker first."""
    options = ALL_ADVICE if options is None else options
    if not isinstance(options, dict):
        raise TypeError("advise(options=...) must be a dict of checker name -> {} (like ALL_ADVICE).")
    unknown = sorted(set(options) - set(CHECKERS))
    if unknown:
        raise ValueError(f"advise: unknown checker(s) {unknown}; the checkers are {sorted(CHECKERS)}.")
    if not profile.steps and not profile.nodes:
        raise ValueError("advise: the profile is empty; add traced steps first (ProfilerHook(profiler=...)).")
    result = {}
    for name in options:
        findings = sorted(CHECKERS[name](profile), key=lambda f: -f["severity"])
        result[name] = {"reports": [f["report"] for f in findings], "findings": findings}
    result = dict(sorted(result.items(), key=lambda item: -max((f["severity"] for f in item[1]["findings"]),
                                                               default=0.0)))
    return result
