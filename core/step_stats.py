"""The step-stats model: what one traced step did, framework-neutral (TF's `StepStats` proto, in Python).

A `StepStats` holds one `DeviceStepStats` per device; each holds the op executions (`NodeExecStats`) that ran
there, on which thread, when, and on which tensors. Times are integer nanoseconds since the Unix epoch, the
clock torch.profiler and `time.time_ns()` share, so host spans and op events line up.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import operator
from math import prod
from typing import Any

import numpy as np

# Bytes per element for the dtype names this project writes (canonical numpy-style names).
DTYPE_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "complex128": 16, "complex64": 8, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
    "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1,
}


@dataclasses.dataclass(slots=True)
class TensorDescription:
    """A tensor an op read or wrote: dtype name, shape, and size in bytes (None when not a dense tensor)."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "bytes": self.nbytes}


def tensor_description(shape: list | tuple, dtype: str) -> TensorDescription | None:
    """A TensorDescription for an argument given as (shape, canonical dtype name); None if not a tensor."""
    itemsize = DTYPE_ITEMSIZE.get(dtype)
    if itemsize is None:
        return None
    numel = 1
    for dim in shape:
        numel *= dim
    return TensorDescription(dtype, tuple(shape), numel * itemsize)


@dataclasses.dataclass(slots=True)
class NodeExecStats:
    """One op execution: `op` is the type (`aten::addmm`), `node_name` is unique within the step.

    `scope` is the module path it ran in (`encoder/fc1`; backward ops inherit the scope of the forward op
    they differentiate); `phase` is `data`, `forward`, `backward`, `optimizer` or a host span's name.
    The op's arguments are kept as recorded, one entry per argument position: `input_shapes` (a list of
    dims, `[]` for scalars) and `input_dtypes` (canonical names such as `float32` for tensors, the
    framework's word such as `Scalar` otherwise); `inputs` gives the tensor arguments as TensorDescriptions.
    """

    node_name: str
    op: str
    start_ns: int
    duration_ns: int
    thread_id: int
    scope: str = ""
    phase: str = ""
    input_shapes: list | None = None
    input_dtypes: list | None = None
    outputs: list[TensorDescription] | None = None
    category: str = "Op"  # "Op" framework ops, "Module" module calls, "Span" host spans, "Kernel", "Runtime"
    args: dict[str, Any] | None = None

    @property
    def inputs(self) -> list[TensorDescription]:
        """The tensor arguments (scalars and lists left out), with their sizes in bytes."""
        if not self.input_shapes:
            return []
        found = (tensor_description(s, d) for s, d in zip(self.input_shapes, self.input_dtypes or ()))
        return [t for t in found if t is not None]

    def input_bytes(self) -> list[int | None]:
        """Bytes per argument position (None for non-tensors), parallel to `input_shapes`."""
        sizes = _itemsizes(self.input_dtypes)
        return [None if size is None else size * prod(shape) for shape, size in zip(self.input_shapes or (), sizes)]


_ITEMSIZE_CACHE: dict[int, tuple[list[str], list[int | None]]] = {}


def _itemsizes(dtypes: list[str] | None) -> list[int | None]:
    """Item sizes per argument; memoised per dtype list object (tracers share one list per signature)."""
    if not dtypes:
        return []
    hit = _ITEMSIZE_CACHE.get(id(dtypes))
    if hit is not None and hit[0] is dtypes:
        return hit[1]
    sizes = [DTYPE_ITEMSIZE.get(d) for d in dtypes]
    if len(_ITEMSIZE_CACHE) > 4096:
        _ITEMSIZE_CACHE.clear()
    _ITEMSIZE_CACHE[id(dtypes)] = (dtypes, sizes)
    return sizes


@dataclasses.dataclass(slots=True)
class DeviceStepStats:
    """Everything that ran on one device (`/host:CPU`, `/device:CUDA:0`), with its threads' names."""

    device: str
    node_stats: list[NodeExecStats] = dataclasses.field(default_factory=list)
    thread_names: dict[int, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(slots=True)
class TensorAllocation:
    """One allocation the step made: its bytes on `device`, when it was made and freed (None: outlived the
    step), the op that made it, and the tensor it held (dtype and shape, where an op read it)."""

    allocation_id: int
    device: str
    nbytes: int
    alloc_ns: int
    free_ns: int | None = None
    producer: NodeExecStats | None = None
    tensor: TensorDescription | None = None


@dataclasses.dataclass(slots=True)
class AllocatorSample:
    """The allocator's totals on `device` right after an allocation or free, as torch reported them."""

    device: str
    ts_ns: int
    total_allocated: int
    total_reserved: int


@dataclasses.dataclass(slots=True)
class DataEdge:
    """A tensor `producer` made and `consumer` read; `name` is TF's tensor name, `<producer node>:<slot>`."""

    producer: NodeExecStats
    consumer: NodeExecStats
    tensor: TensorDescription
    name: str


@dataclasses.dataclass(slots=True)
class StepStats:
    """One traced step: the devices, the global step it belongs to, where it came from, and its dataflow."""

    dev_stats: list[DeviceStepStats] = dataclasses.field(default_factory=list)
    step: int | None = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    edges: list[Any] = dataclasses.field(default_factory=list)  # DataEdge: producer -> consumer
    allocations: list[TensorAllocation] = dataclasses.field(default_factory=list)
    memory_samples: list[AllocatorSample] = dataclasses.field(default_factory=list)
    # the tracer's own XSpace of the step, serialized (JAX's profiler), for TensorBoard's Profile tab as it came
    native_xspace: bytes | None = dataclasses.field(default=None, repr=False)

    def peak_allocated(self) -> dict[str, int]:
        """The highest bytes in use per device during the step, from the allocator's samples."""
        peaks: dict[str, int] = {}
        for sample in self.memory_samples:
            if sample.total_allocated > peaks.get(sample.device, -1):
                peaks[sample.device] = sample.total_allocated
        return peaks

    def device(self, name: str) -> DeviceStepStats:
        """The stats of device `name`, created empty on first use."""
        for dev in self.dev_stats:
            if dev.device == name:
                return dev
        dev = DeviceStepStats(name)
        self.dev_stats.append(dev)
        return dev

    def launched_kernels(self) -> dict[str, list[tuple[int, NodeExecStats]]]:
        """The kernels (memcpys, memsets) each op launched, by the op's node name: (the kernel's device's index
        in `dev_stats`, the kernel), in start order. Empty for a step that ran nothing on an accelerator."""
        launched: dict[str, list[tuple[int, NodeExecStats]]] = {}
        for index, dev in enumerate(self.dev_stats):
            for node in dev.node_stats:
                launcher = node.args.get("launched_by") if node.category == "Kernel" and node.args else None
                if launcher is not None:
                    launched.setdefault(launcher, []).append((index, node))
        for kernels in launched.values():
            kernels.sort(key=lambda entry: entry[1].start_ns)
        return launched

    def all_nodes(self):
        """Every op execution of the step, device by device."""
        for dev in self.dev_stats:
            yield from dev.node_stats

    def start_ns(self) -> int | None:
        """The earliest start of any recorded execution (None for an empty step)."""
        return min((min(map(_START, dev.node_stats)) for dev in self.dev_stats if dev.node_stats), default=None)


# The category of a host span, the step's phases (`hookprof.trace.format.CAT_SPAN`): here, for `StepShape`
CAT_SPAN = "Span"

_CATEGORY = operator.attrgetter("category")

# Every field of a node but its start and duration, as a tuple (tests/test_step_shape.py holds it to the fields;
# `_shapes` reads the last two)
node_shape = operator.attrgetter("node_name", "op", "thread_id", "scope", "phase", "input_shapes", "input_dtypes",
                                 "outputs", "category", "args")


def _shapes(nodes: list[NodeExecStats]) -> list[tuple]:
    """The shapes of `nodes` (`node_shape`), but for the step's phase spans without their args: what those say
    is the step's own (whether hookprof's work ran beside the wait or the step), and the renderers that read
    args (the timeline's) make those spans anew for every step."""
    shapes = list(map(node_shape, nodes))
    categories = list(map(_CATEGORY, nodes))
    at = -1
    try:  # (a step has few spans among its thousands of ops: found by the list's own search)
        while True:
            at = categories.index(CAT_SPAN, at + 1)
            if shapes[at][-1] is not None:
                shapes[at] = shapes[at][:-1] + (None,)
    except ValueError:
        return shapes


class StepShape:
    """What a step's outputs hold besides its times and its step number: its devices (names, threads), every
    node's fields but its start and duration (`node_shape`; the phase spans' args are the step's own: see
    `_shapes`), device by device, and its edges, by their nodes' places. Two steps of one shape render to the
    same graph, the same XSpace metadata and the same timeline but for their times: a renderer keeps what a
    step's shape decides (`ShapedParts`) and makes only the timed fields for the next step of that shape (a
    fit's traced CPU steps repeat one; CUDA and JAX steps carry per-step ids in their args and do not). Taken
    once the stats are complete (their nodes' lists are held, not copied: nothing changes them after)."""

    __slots__ = ("devices", "nodes", "edges", "_same", "_other", "kept")

    def __init__(self, stats: StepStats, kept: KeptParts | None = None) -> None:
        self.kept = kept  # where the step's fit keeps its renderers' parts (None: nothing kept, nothing reused)
        self.devices = [(dev.device, dict(dev.thread_names)) for dev in stats.dev_stats]
        self.nodes = [_shapes(dev.node_stats) for dev in stats.dev_stats]
        place = dict(zip(map(id, itertools.chain.from_iterable(dev.node_stats for dev in stats.dev_stats)),
                         itertools.count()))  # a node's place in the step, its devices' nodes one after another
        # (an edge's node outside the step, which no tracer makes, is held as itself: compared with its times)
        self.edges = [(place.get(id(e.producer), e.producer), place.get(id(e.consumer), e.consumer), e.name, e.tensor)
                      for e in stats.edges]
        # the last shape found equal, and the last found not (each renderer asks of the same one)
        self._same: StepShape | None = None
        self._other: StepShape | None = None

    def __eq__(self, other: object) -> bool:
        if other is self._same or other is self:
            return True
        if other is self._other:
            return False
        same = (isinstance(other, StepShape) and self.devices == other.devices and self.edges == other.edges
                and self.nodes == other.nodes)
        if same:
            self._same = other
        elif isinstance(other, StepShape):
            self._other = other
        return same

    __hash__ = None  # type: ignore[assignment]

    def recall(self, renderer: str) -> Any:
        """What `renderer` ("timeline", its arrows "flows", "graph", "xspace") kept of its fit's last step, if that
        step had this shape; else None."""
        return None if self.kept is None else getattr(self.kept, renderer).parts(self)

    def keep(self, renderer: str, parts: Any) -> None:
        """`renderer`'s parts of this step, for its fit's next step of this shape."""
        if self.kept is not None:
            getattr(self.kept, renderer).keep(self, parts)


class ShapedParts:
    """The parts of one rendered step that its shape decided, for the next step of that shape: where steps
    are rendered (the render worker, or a training process without one), each renderer keeps its last step's
    (one step's worth: ~1 KB a node, the renderers' and the shape together, and about 0.5 KB an arrow for the
    timeline's; none of a step of more than `KEEP_NODES_MAX` nodes, whose fit takes no shape of it), until the
    fit ends (`KeptParts`, one per fit). `parts(shape)` gives them when the shapes match; `keep` replaces them
    (one reference: threads that render at once each see a whole pair, or none)."""

    __slots__ = ("_last",)
    KEEP_NODES_MAX = 65536

    def __init__(self) -> None:
        self._last: tuple[StepShape, Any] | None = None

    def parts(self, shape: StepShape | None) -> Any:
        last = self._last
        # (the new shape compared with the kept one, not the other way: what it remembers goes with it)
        if shape is None or last is None or shape != last[0]:
            return None
        return last[1]

    def keep(self, shape: StepShape | None, parts: Any) -> None:
        if shape is not None and sum(map(len, shape.nodes)) <= self.KEEP_NODES_MAX:
            self._last = (shape, parts)

    def clear(self) -> None:
        self._last = None


class KeptParts:
    """What each renderer keeps of one fit's last rendered step (`ShapedParts`), where its steps are rendered
    (the render worker, or the training process without one: `hookprof.hooks.capture.KEPT_PARTS`, by the fit's
    token, released when the fit ends). A `StepShape` made with them (`shape`) finds them (`recall`, `keep`).
    Also the step graph's names the fit's steps repeat (`hookprof.tensorboard.graph.GraphNames`, once it has a
    graph).

    A fit whose steps never repeat a shape takes none once that is seen (taking it, comparing it and keeping
    the parts cost a 20k-op step tens of milliseconds of nothing): a step with kernels (each launch's CUDA
    correlation id is in its args), or two steps in a row of another shape than the step before, none of
    the fit's steps having had its last one's (JAX's program spans: each run's id)."""

    __slots__ = ("timeline", "flows", "graph", "xspace", "graph_names", "_differed", "_matched", "_off")
    DIFFERED_MAX = 2

    def __init__(self) -> None:
        self.timeline, self.flows, self.graph, self.xspace = ShapedParts(), ShapedParts(), ShapedParts(), ShapedParts()
        self.graph_names: Any = None
        self._differed = 0  # the fit's steps in a row of another shape than the one before
        self._matched = False  # whether a step of the fit had its last one's shape
        self._off = False  # no more shapes taken for the fit

    def shape(self, stats: StepStats) -> StepShape | None:
        """`stats`' shape, made with these parts (a step of its fit's, complete); None once the fit is seen not
        to repeat one (see the class)."""
        if not self._off and _has_kernels(stats):
            self._off = True
        if self._off:
            self._clear()
            return None
        if sum(len(dev.node_stats) for dev in stats.dev_stats) > ShapedParts.KEEP_NODES_MAX:
            return None  # (nothing of it would be kept: its renderers make no parts to keep)
        shape = StepShape(stats, self)
        # (the graph's and the XSpace's are the step's own: a triggered step's timeline has the steps before it)
        last = next((parts._last[0] for parts in (self.graph, self.xspace, self.timeline) if parts._last), None)
        if last is None:
            return shape
        last._same = last._other = None  # (the kept shape lets go of the one before it: one step's worth held)
        if shape == last:  # (found so once, equal or not: the renderers' own comparisons are free)
            self._matched, self._differed = True, 0
            return shape
        self._differed += 1
        if self._differed >= self.DIFFERED_MAX and not self._matched:
            self._off = True
            self._clear()
            return None
        return shape

    def _clear(self) -> None:
        for parts in (self.timeline, self.flows, self.graph, self.xspace):
            parts.clear()


def _has_kernels(stats: StepStats) -> bool:
    """Whether an accelerator ran kernels in the step (they are on its device, never the host's)."""
    return any(node.category == "Kernel" for dev in stats.dev_stats if not dev.device.startswith("/host:")
               for node in dev.node_stats)


_START, _DURATION = operator.attrgetter("start_ns"), operator.attrgetter("duration_ns")


def node_times(nodes: list[NodeExecStats]) -> tuple[np.ndarray, np.ndarray]:
    """The nodes' starts and durations (ns) as arrays, read by C's iteration (the renderers' columns: a step has
    tens of thousands of nodes)."""
    count = len(nodes)
    return (np.fromiter(map(_START, nodes), np.int64, count), np.fromiter(map(_DURATION, nodes), np.int64, count))


def _node_end(node: NodeExecStats) -> int:
    return node.start_ns + node.duration_ns


class KernelsOf:
    """The kernels an op ran: those it launched itself, else those of the ops nested in it (`aten::linear`
    runs its gemm through `aten::addmm`), as (device index in `dev_stats`, kernel) in start order."""

    def __init__(self, stats: StepStats) -> None:
        self._launched = stats.launched_kernels()
        self._threads: dict[int, tuple[list[int], list[NodeExecStats]]] | None = None
        self._stats = stats

    def __call__(self, op: NodeExecStats) -> list[tuple[int, NodeExecStats]]:
        launched = self._launched
        if not launched:
            return []
        own = launched.get(op.node_name)
        if own is not None:
            return own
        if self._threads is None:
            by_thread: dict[int, list[NodeExecStats]] = {}
            for node in self._stats.all_nodes():
                if node.node_name in launched and node.category == "Op":
                    by_thread.setdefault(node.thread_id, []).append(node)
            self._threads = {}
            for thread, nodes in by_thread.items():
                nodes.sort(key=lambda n: n.start_ns)
                self._threads[thread] = ([n.start_ns for n in nodes], nodes)
        starts, nodes = self._threads.get(op.thread_id, ((), ()))
        nested = []
        for node in nodes[bisect.bisect_left(starts, op.start_ns):bisect.bisect_left(starts, _node_end(op))]:
            if _node_end(node) <= _node_end(op):
                nested.extend(launched[node.node_name])
        nested.sort(key=lambda entry: entry[1].start_ns)
        return nested
