"""The names of a timeline file, defined once for the writer, the reader, merge, summaries and the tracers.

A timeline is one traced step in Chrome's Trace Event Format (Perfetto, chrome://tracing and HTA read it):
`{"distributedInfo": {...}, "traceEvents": [...], "displayTimeUnit": "ms", "baseTimeNanoseconds": ...,
"metadata": {...}}`, where
- each device is a process named "<device> Compute" holding one thread per recorded thread, plus a
  "Step phases" thread for the step's phase spans (`train_step`, `data_wait`, ...);
- `X` events are ops ("Op"), module scopes ("Module"), host spans ("Span"), kernels ("Kernel") and runtime
  calls ("Runtime"), their `args` holding the node name, op, scope, phase and per-argument inputs;
- "DataFlow" arrows (`s`/`t`) join kernel launches to kernels and tensors' producers to their consumers;
- with memory, each device also has a "<device> Tensors" process: tensor objects ("Tensor": `N`/`O`/`D`)
  and an "Allocator" counter ("Memory");
- times are microseconds from the step's first event (`baseTimeNanoseconds` is that instant, in ns);
- in a distributed run the rank goes in `distributedInfo` and prefixes process names with "[rank N] ".
Chrome's own vocabulary (the `ph` letters, "traceEvents", the `process_name`/`thread_name`/..._sort_index
metadata events, `snapshot`) and a tensor's description (`dtype`, `shape`, `bytes`, as
`TensorDescription.to_json` writes it) are spelled where they are used; what hookprof names is here.
This module imports from hookprof only `step_stats` (the value types, below it), so anything above may import it.
"""

from __future__ import annotations

import re

from hookprof.step_stats import CAT_SPAN  # noqa: F401  (a host span: the step's phases; defined with the step's shape)

# --- top-level keys of the file ------------------------------------------------------------------------
BASE_TIME_NS = "baseTimeNanoseconds"  # the absolute time (ns) event times count from, as kineto writes it
DISTRIBUTED_INFO = "distributedInfo"  # kineto's rank/world_size/backend record, written first in the file
METADATA = "metadata"  # hookprof's record of the step (the keys below, plus the tracer's and the hook's)

# --- keys of `metadata` and `distributedInfo` -----------------------------------------------------------
STEP = "step"  # the global step the timeline traced
EVENTS = "events"  # how many events the file holds
TRUNCATED = "truncated"  # true when the event cap cut the step short
MAX_EVENTS = "max_events"  # the cap that cut it
PEAK_ALLOCATED_BYTES = "peak_allocated_bytes"  # per device peak bytes (also a Tensors process label's arg)
RANK = "rank"  # the distributed rank (distributedInfo; the metadata of a timeline read back or merged)
WORLD_SIZE = "world_size"  # the number of ranks (distributedInfo)
RANKS = "ranks"  # the ranks a merged trace holds (its distributedInfo)
MERGED_FROM = "merged_from"  # the files a merged trace was made of (its metadata)
STEPS = "steps"  # the steps of the files a merged trace was made of (its metadata)
TRIGGER = "trigger"  # why a triggered step was traced: {"kind", "step", "detail"} (hookprof.triggers)
TRIGGERS_ALSO = "also_fired"  # the other triggers that fired at the same step, each as `trigger`
DEVICE_PROPERTIES = "device_properties"  # kineto's GPUs: each one's id, name, numSms, totalGlobalMem, compute...
SKIPPED_TRACES = "skipped_traces"  # traced steps not written since the last file (pending writes were full)

# --- processes and threads -------------------------------------------------------------------------------
COMPUTE_SUFFIX = " Compute"  # a device's process of ops, spans and kernels: "<device> Compute"
TENSORS_SUFFIX = " Tensors"  # a device's process of tensor objects and the allocator counter
STEP_PHASES_THREAD = "Step phases"  # the host thread of the step's phase spans
RECENT_STEPS_THREAD = "Steps before the trigger"  # the host thread of a trigger's window of earlier steps

# --- event categories (`cat`) ---------------------------------------------------------------------------
CAT_OP = "Op"  # a framework op (aten::mm)
CAT_MODULE = "Module"  # a module call, named by its scope
CAT_RECENT_STEP = "RecentStep"  # a span of a step before a triggered trace: no node of the traced step
CAT_KERNEL = "Kernel"  # an accelerator kernel, memcpy or memset
CAT_RUNTIME = "Runtime"  # a runtime call that launched a kernel (cudaLaunchKernel)
CAT_DATAFLOW = "DataFlow"  # flow arrows: launch -> kernel, producer -> consumer
CAT_TENSOR = "Tensor"  # a tensor object's life: created, snapshot, destroyed
CAT_MEMORY = "Memory"  # the allocator counter
NODE_CATEGORIES = (CAT_OP, CAT_MODULE, CAT_SPAN, CAT_KERNEL, CAT_RUNTIME)  # the X events that are step nodes

# --- event names ------------------------------------------------------------------------------------------
TRAIN_STEP = "train_step"  # the phase span of the whole step (written as "ProfilerStep#<step>")
DATA_WAIT = "data_wait"  # the phase span from the previous step's end to this step's start (and, under gradient
#   accumulation, between one micro-batch's end and the next's start)
VALIDATION = "validation"  # a validation loop Lightning runs inside a step's accumulation window
PROFILER_STEP_PREFIX = "ProfilerStep#"  # the step span's name, as torch.profiler names it (HTA finds it)
LAUNCH_FLOW = "launch"  # the arrow from a runtime launch to its kernel
ALLOCATOR_COUNTER = "Allocator"  # the counter of the allocator's bytes in use

# --- keys of `args` -----------------------------------------------------------------------------------------
ARG_NAME = "name"  # a node's unique name (an X event's own name is the op)
ARG_OP = "op"  # the op (for spans: the phase span name)
ARG_SCOPE = "scope"  # the module scope
ARG_PHASE = "phase"  # the step phase: forward, backward, optimizer, data
ARG_INPUT_SHAPES = "input_shapes"  # per argument position: the shape, or None for a non-tensor
ARG_INPUT_DTYPES = "input_dtypes"  # per argument position: the dtype
ARG_INPUT_BYTES = "input_bytes"  # per argument position: the bytes (written only, derived when read)
ARG_OUTPUTS = "outputs"  # the op's output tensors' descriptions
ARG_PRODUCER = "producer"  # a tensor's producing node (dataflow arrows, tensor snapshots)
ARG_CONSUMER = "consumer"  # a tensor's consuming node (dataflow arrows)
ARG_LAUNCHED_BY = "launched_by"  # a kernel's launching op (its node name): kernel dataflow, the graph's device
ARG_STREAM = "stream"  # a kernel's stream (as kineto names it; HTA finds device work by it)
ARG_DEVICE = "device"  # a kernel's device index
ARG_CORRELATION = "correlation"  # a kernel's and its runtime launch's CUDA correlation id
ARG_KERNEL_KIND = "kind"  # kineto's activity: "kernel", "gpu_memcpy", "gpu_memset"
# a kernel's launch configuration, as kineto exports it (xprof's kernel stats read them)
ARG_GRID, ARG_BLOCK = "grid", "block"  # [x, y, z]
ARG_REGISTERS = "registers per thread"
ARG_SHARED_MEMORY = "shared memory"  # bytes, static and dynamic together
ARG_OCCUPANCY = "est. achieved occupancy %"
ARG_BYTES = "bytes"  # a memcpy's or memset's bytes
ARG_ALLOCATED = "allocated"  # the allocator counter's bytes allocated
ARG_RESERVED = "reserved"  # the allocator counter's bytes reserved
# on the data wait before a step, or on the step's span: hookprof's own workers (an earlier step's conversion,
# render, files) had work during it, so its length is not the input pipeline's (the step's) alone
ARG_SHARED_WITH_HOOKPROF = "shared_with_hookprof"

_RANK_PREFIX = re.compile(r"^\[rank \d+\] ")


def rank_prefix(rank: int) -> str:
    """`"[rank 3] "`: what a rank's process names start with in a distributed or merged trace."""
    return f"[rank {rank}] "


def strip_rank_prefix(process_name: str) -> str:
    """`process_name` without its `rank_prefix`, if it has one."""
    return _RANK_PREFIX.sub("", process_name)


def compute_process_name(device: str, prefix: str = "") -> str:
    """The name of `device`'s process of ops, spans and kernels (`prefix`: a `rank_prefix` or "")."""
    return f"{prefix}{device}{COMPUTE_SUFFIX}"


def tensors_process_name(device: str, prefix: str = "") -> str:
    """The name of `device`'s process of tensor objects and allocator counter."""
    return f"{prefix}{device}{TENSORS_SUFFIX}"


def process_device(process_name: str) -> tuple[str, str] | None:
    """The inverse of `compute_process_name` and `tensors_process_name`: `(device, suffix)`, suffix being
    `COMPUTE_SUFFIX` or `TENSORS_SUFFIX`, rank prefix or not; None for any other process."""
    name = strip_rank_prefix(process_name)
    for suffix in (COMPUTE_SUFFIX, TENSORS_SUFFIX):
        if name.endswith(suffix):
            return name[: -len(suffix)], suffix
    return None
