"""`TorchTracer`: one training step under torch's profiler, converted straight into `StepStats`.

It reads the profiler's raw kineto results (`kineto_results.events()`), not `profile.events()`, which builds a
Python `FunctionEvent` tree and costs 40-80 ms per 2k events. Module scopes come from global forward hooks
that open a `record_function` span per module call during the traced step only; backward ops inherit the
scope of the forward op they differentiate (matched by autograd's sequence number), so a gradient op shows
under the module whose forward made it. Imported lazily: `hookprof` never imports torch at top level. The
private torch APIs it uses are found by feature detection (`hookprof.tracing.torch_private`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import logging
import os
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hookprof._runtime.fit_run import on_fit_end
from hookprof._runtime.gc_pause import paused_gc
from hookprof._runtime.private_dir import PROCESS_DIRECTORY
from hookprof.naming import root_label
from hookprof.run_options import RunOptions, TraceLevel
from hookprof.step_stats import StepStats
from hookprof.tracing.kineto_replay import CONVERSIONS
from hookprof.tracing.kineto_trace import BORROW, NO_TEMPLATE, RECORD, KinetoExport
from hookprof.tracing.step_identity import MODULE_PREFIX, release_fit
from hookprof.tracing.torch_dataflow import event_tree
from hookprof.tracing.torch_private import (
    export_only_config,
    profiler_enabled,
    record_function_class,
    unsupported_torch,
)
from hookprof.tracing.tracer import Tracer, TracerUnavailable

log = logging.getLogger(__name__)


def _module_label(module: Any, local_names: dict[int, str]) -> str:
    """The name a module call gets in scopes: its attribute name in the model, else its own `name`/class."""
    label = local_names.get(id(module))
    return root_label(module) if label is None else label


def _compiled(path: str, module: Any) -> list[str]:
    """What of `module` (at `path` in the model) runs code `torch.compile` made, as a user would have written it."""
    if getattr(module, "_compiled_call_impl", None) is not None:
        return [f"{path}.compile()"]
    if "_orig_mod" in getattr(module, "_modules", {}) and hasattr(module, "_torchdynamo_orig_callable"):
        return [f"torch.compile({path})"]  # an OptimizedModule: its own module calls run compiled
    # a method replaced by its compiled self (Lightning's `trainer.fit(torch.compile(model))`, a user's own)
    return [f"torch.compile({path}.{name})" for name, value in vars(module).items()
            if hasattr(value, "_torchdynamo_orig_callable")]


class _ModuleScopes:
    """Global forward hooks that wrap each module call in a `record_function` span while installed.

    Module calls inside code `torch.compile` made call no forward hooks: their ops get no scope (they show
    under torch's `Torch-Compiled Region` and `CompiledFunction` spans). `compiled` names that code. A module
    compiled in place (`module.compile()`) runs its hooks itself, and global hooks that come and go make dynamo
    recompile it, with graph breaks, inside the traced step: no hooks are installed then (`skips`).
    `compiled`: what an earlier traced step of the fit found compiled in `root` (None: found here)."""

    def __init__(self, root: Any, compiled: list[str] | None = None) -> None:
        self._local_names: dict[int, str] = {}
        self.compiled: list[str] = [] if compiled is None else compiled
        if root is not None:
            label = root_label(root)
            self._local_names[id(root)] = label
            for path, module in root.named_modules():
                if path:
                    self._local_names.setdefault(id(module), path.rsplit(".", 1)[-1])
                if compiled is None:
                    self.compiled += _compiled(f"{label}.{path}" if path else label, module)
        self.skips = any(name.endswith(".compile()") for name in self.compiled)
        self._open: list[Any] = []
        self._handles: list[Any] = []

    def say_compiled(self) -> None:
        """Say why a compiled model's timelines lack module scopes, and what gives them (once a fit: see
        `TorchTracer.start`)."""
        if self.skips:
            why = ("hookprof adds no module scopes in this fit: its forward hooks would make torch recompile a "
                   "module compiled in place, with graph breaks, inside each traced step")
        else:
            why = ("module calls inside compiled code call no forward hooks, so their ops have no module scopes of "
                   "their own (a compiled submodule's ops show under its own scope, torch's 'Torch-Compiled "
                   "Region' and 'CompiledFunction' spans under the scope that called them)")
        shown = ", ".join(self.compiled[:3]) + (f" and {len(self.compiled) - 3} more" if len(self.compiled) > 3 else "")
        log.warning("The model runs code torch.compile made (%s): %s. To see every module's scope, trace a run "
                    "without torch.compile (or with TORCHDYNAMO_DISABLE=1).", shown, why)

    def install(self) -> None:
        if self.skips:
            return
        from torch.nn.modules import module as nn_module

        record_function = record_function_class()
        local_names, open_spans = self._local_names, self._open

        def enter(module, args):
            span = record_function(MODULE_PREFIX + _module_label(module, local_names))
            span.__enter__()
            open_spans.append(span)

        def leave(module, args, output):
            if open_spans:
                open_spans.pop().__exit__(None, None, None)

        self._handles = [
            nn_module.register_module_forward_pre_hook(enter),
            nn_module.register_module_forward_hook(leave, always_call=True),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        while self._open:  # a forward that raised between the two hooks
            self._open.pop().__exit__(None, None, None)


@contextlib.contextmanager
def _quiet_kineto() -> Iterator[None]:
    """Kineto prints "profiler_start"/"profiler_stop" lines unless its log level is above USDT (5); it reads
    `KINETO_LOG_LEVEL` when the profiler starts and stops. Set only around ours, unless the user set it."""
    if "KINETO_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["KINETO_LOG_LEVEL"] = "6"
    try:
        yield
    finally:
        os.environ.pop("KINETO_LOG_LEVEL", None)


class _Identities:
    """A fit's tensor identities (`hookprof.tracing.step_identity`): the first traced step that records tensors
    walks torch's event tree and leaves its identities for the next ones, which record only kineto's export and
    borrow them. A step whose ops differ gets no arrows; one such step alone (under Lightning, an epoch's first
    step runs 11 ops more, copies and clones around the metric it logs) changes nothing for the next ones,
    while the first borrowing step after a walk, two in a row, or lone ones past one in `LONE_SHARE` make the
    next traced step walk the tree again. After `GIVE_UP` such walks (a model whose ops change from step to
    step) every step walks its own tree."""

    GIVE_UP = 3

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex
        # (made in the fit's context, at its first traced step: its template goes when the fit ends)
        on_fit_end(("tensor identities", self.token), release_fit, self.token)
        # (and its last converted step: `hookprof.tracing.kineto_replay`)
        on_fit_end(("kineto conversions", self.token), CONVERSIONS.release, self.token)
        self.recorded = False  # a step's identities were exported for the next ones
        self.mismatches = 0
        self.walks = 0  # the fit's walks whose identities were exported (a borrowing step's generation)
        self.borrows = 0  # the borrowing steps started since the fit's last walk, each one's number
        self._last_mismatch = -2  # the number of the last borrowing step (of this generation) whose ops differed
        self._lone = 0  # the borrowing steps since the last walk whose ops differed, each alone
        self._counted = -1  # the last walk (generation) whose borrowing steps counted toward GIVE_UP
        self._lock = threading.Lock()  # (mismatches are told from the render thread)

    def mode(self) -> str | None:
        with self._lock:
            if self.mismatches >= self.GIVE_UP:
                return None
            return BORROW if self.recorded else RECORD

    def next_borrow(self) -> tuple[int, int]:
        """A borrowing step starting now: the walk it borrows from (its generation) and its number since."""
        with self._lock:
            self.borrows += 1
            return self.walks, self.borrows

    def record(self) -> None:
        """A step's identities were exported: the next traced steps borrow them."""
        with self._lock:
            self.recorded, self.walks, self.borrows, self._last_mismatch, self._lone = True, self.walks + 1, 0, -2, 0

    def mismatch(self, borrow: tuple[int, int], reason: str) -> None:
        """Borrowing step `borrow` (`next_borrow`) could not borrow (`reason`). Where it is the first since its
        walk (the walked step may be the odd one: an optimizer making its state) or the borrowing step before it
        could not either, the next traced step walks its tree again, counted toward `GIVE_UP` once a walk (the
        steps that borrowed from it before its first report came, renders being queued, report too); where the step
        to borrow from was converted elsewhere (a restarted worker), it walks again at once, not counted. A
        report of a step that borrowed from an earlier walk than the last (told after the next walk was
        exported: reports come from the render thread) changes nothing."""
        generation, number = borrow
        with self._lock:
            if reason == NO_TEMPLATE:
                self.recorded = False
            elif generation != self.walks:
                return
            elif number == 1 or number == self._last_mismatch + 1 or self._too_many_alone(number):
                self.recorded = False
                if self._counted != generation:  # (once a walk: its later steps' reports come late, two deep)
                    self._counted = generation
                    self.mismatches += 1
            self._last_mismatch = number

    LONE_SHARE = 4  # (at most one borrowing step in this many differs alone, past the first few)

    def _too_many_alone(self, number: int) -> bool:
        """Whether the steps that differed alone since the walk, with this one, are too many for odd steps (an
        epoch's first is one in an epoch's traced steps): a model that alternates its ops (A, A, B, ...) would
        otherwise lose the arrows of its B steps for the whole fit instead of walking each step's tree."""
        self._lone += 1
        return self._lone >= 3 and self._lone * self.LONE_SHARE > number


class TorchTracer(Tracer):
    """Traces one step with torch's profiler (CPU ops, plus CUDA kernels when CUDA is available).

    Args:
        root: the model (`nn.Module`, a LightningModule or a keras Model on the torch backend) whose
            submodule names become the ops' scopes; None traces without module names.
    """

    name = "torch"

    def __init__(self, root: Any = None) -> None:
        self._root = root
        self._prof: Any = None
        self._scopes: _ModuleScopes | None = None
        self._options = RunOptions()
        self._identities: _Identities | None = None
        self._identity: tuple[str, str] | None = None
        self._borrow: tuple[int, int] | None = None  # (the running borrowing step's: `_Identities.next_borrow`)
        self._fit_state: dict[str, Any] = {}  # (see `bind_fit`)

    def bind_fit(self, state: dict[str, Any]) -> None:
        identities = state.get("torch_identities")
        if identities is None:  # (the fit's first traced step: a uuid and a lock made once, not every step)
            identities = state["torch_identities"] = _Identities()
        self._identities = identities
        self._fit_state = state

    def start(self, options: RunOptions) -> None:
        from torch.autograd import profiler as autograd_profiler

        unsupported = unsupported_torch()
        if unsupported is not None:
            raise TracerUnavailable(unsupported)
        if profiler_enabled():
            # Starting a second kineto session would silently take over the user's (their trace ends empty).
            raise TracerUnavailable(
                "another torch profiler is running (torch.profiler.profile, or Trainer(profiler='pytorch')); "
                "hookprof skips its traces while it runs"
            )
        self._options = options
        # CUDA activity where this process uses CUDA: a model trained on the CPU of a host with a GPU records none
        # (its steps would carry the CUDA runtime's per-step correlation ids, and take the CUDA paths below)
        use_cuda = torch.cuda.is_initialized() and options.trace_level >= TraceLevel.HARDWARE_TRACE
        full = options.trace_level >= TraceLevel.FULL_TRACE
        # A step that needs only kineto's export stops cheaper when torch builds nothing for Python (the event
        # tree is what dataflow and memory read; torch refuses the option with Python stacks). CUDA steps keep
        # the full stop until kernels in such an export are checked on a GPU.
        # A step that borrows its tensor identities from an earlier one needs only the export too (its memory
        # instants included). Steps with Python stacks walk their own tree.
        identities = self._identities if options.records_tensors and not options.with_stack else None
        mode = identities.mode() if identities is not None else None
        self._identity = None if mode is None else (mode, identities.token)
        self._borrow = identities.next_borrow() if mode == BORROW else None
        cheap = not options.records_tensors or mode == BORROW
        export_only = export_only_config() if cheap and not (options.with_stack or use_cuda) else None
        prof = autograd_profiler.profile(
            use_device="cuda" if use_cuda else None,
            record_shapes=full or options.record_dataflow,
            with_flops=full,
            # dataflow links tensors by the allocation they live in: see hookprof.tracing.torch_dataflow
            profile_memory=options.records_tensors,
            with_stack=options.with_stack,
            use_kineto=True,
            **({"experimental_config": export_only} if export_only is not None else {}),
        )
        # what runs compiled code is found (and said) at a fit's first traced step: a model is compiled, in place
        # or wrapped, before its fit; between fits it may be (by the root's id: the fit holds its model)
        found = self._fit_state.setdefault("torch_compiled", {})
        compiled = found.get(id(self._root))
        scopes = _ModuleScopes(self._root, compiled)
        if compiled is None:
            found[id(self._root)] = scopes.compiled
            if scopes.compiled:
                scopes.say_compiled()
        try:
            with _quiet_kineto():
                prof.__enter__()
            self._prof = prof
            scopes.install()
            self._scopes = scopes
        except BaseException:
            scopes.remove()
            self.abort()
            raise

    def _close(self) -> Any:
        prof, self._prof = self._prof, None
        scopes, self._scopes = self._scopes, None
        if scopes is not None:
            scopes.remove()
        if prof is None:
            return None
        with _quiet_kineto():
            prof.__exit__(None, None, None)
        return prof.kineto_results

    def abort(self) -> None:
        self._close()

    def stop(self) -> StepStats:
        return self.stop_recording()()

    def stop_recording(self) -> _Recording:
        """Stop torch's profiler now; the conversion of its events (the costly part) is left to the caller."""
        mismatch = None if self._borrow is None else functools.partial(self._identities.mismatch, self._borrow)
        return _Recording(self._close(), self._options, self._identity, self._identities, mismatch)


class _Recording:
    """A stopped step's kineto results: `export()` writes them out once (kineto's own C++ export, which a
    result allows once) for conversion anywhere, the render worker included; calling the recording converts
    them here. Safe to call from several threads: the export is made once, under a lock."""

    def __init__(self, results: Any, options: RunOptions, identity: tuple[str, str] | None = None,
                 identities: _Identities | None = None, mismatch: Callable[[str], None] | None = None) -> None:
        self._results = results
        self._options = options
        self._identity = identity
        self._identities = identities
        self._mismatch = mismatch  # (a borrowing step's: tells its fit's identities, with its number)
        self._exported: KinetoExport | None = None
        self._lock = threading.Lock()

    def export(self) -> KinetoExport | None:
        """The step in kineto's JSON export (a temporary file, removed once the returned export is garbage)
        and, for dataflow or memory, the compact event tree; None when there are no results. Raises OSError
        when the file cannot be written."""
        with self._lock:
            results = self._results
            if results is None:
                return self._exported
            options = self._options
            path = _export_path()
            try:
                results.save(path)
                if not os.path.isfile(path) or not os.path.getsize(path):
                    # (kineto logs "Failed to write to log file!" and returns: a full or read-only disk)
                    raise OSError(errno.EIO, "kineto could not write the step's export", path)
                with paused_gc():
                    # (None where this torch has no event tree)
                    walk = options.records_tensors and (self._identity is None or self._identity[0] == RECORD)
                    tree = event_tree(results) if walk else None
            except BaseException:
                _remove(path)
                _remove(path + ".tmp")  # (kineto writes there first, and leaves it when the disk fills)
                raise
            identity, identities = self._identity, self._identities
            if identity is not None and identity[0] == RECORD and tree is None:
                identity = None  # (this torch has no tree to record)
            exported = KinetoExport(path, results.trace_start_ns(), options, str(torch.__version__), tree, identity,
                                    self._mismatch if identity is not None and identity[0] == BORROW else None,
                                    None if identities is None else identities.token)
            if identity is not None and identity[0] == RECORD:
                identities.record()
            weakref.finalize(exported, _remove_own, path, os.getpid())
            self._exported, self._results = exported, None  # (kineto's copy is freed now)
            return exported

    def __call__(self) -> StepStats:
        exported = self.export()
        if exported is None:
            return StepStats(metadata={"torch_version": str(torch.__version__)})
        return exported.to_stats()


# kineto's exports go in this process's private directory (`PROCESS_DIRECTORY`), not one of the fit's: a step's
# RunMetadata converts from its export when first read, which a user's hook may do after `fit` returns; each
# export goes once its RunMetadata is garbage.
_exports_made = itertools.count()


def _export_path() -> str:
    """A fresh path for a step's export in this process's private export directory."""
    directory = PROCESS_DIRECTORY.path()
    return os.path.join(directory, f"step-{next(_exports_made)}.json")


def _remove_own(path: str, pid: int) -> None:
    """Remove `path` if this is the process that made it (a forked child drops the parent's exports as
    garbage: they are not its to remove)."""
    if os.getpid() == pid:
        _remove(path)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
