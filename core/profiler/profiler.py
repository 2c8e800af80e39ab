"""`Profiler`: tfprof's multi-step profiler over the steps ProfilerHook traces.

    prof = Profiler(model)
    trainer = Trainer(callbacks=[ProfilerHook(save_steps=100, profiler=prof)])
    trainer.fit(model, loader)
    prof.profile_name_scope(ProfileOptionBuilder.trainable_variables_parameter())
    prof.profile_operations(ProfileOptionBuilder.time_and_memory())
    prof.diff(100, 200)
    prof.advise()
    open("run.prof", "wb").write(prof.serialize_to_string())
"""

from __future__ import annotations

import collections
import os
import sys
from typing import TYPE_CHECKING, Any

from hookprof._runtime.atomic_file import atomic_write
from hookprof._runtime.background import BackgroundJob
from hookprof._runtime.gc_pause import paused_gc
from hookprof.profiler import views
from hookprof.profiler.options import check_options
from hookprof.profiler.profile_data import ProfileData, StepKey, step_rank
from hookprof.step_stats import StepStats
from hookprof.trace import format as fmt

if TYPE_CHECKING:
    from hookprof.profiler.diff import DiffResult

KEEP_STEP_STATS = 3  # the last traced steps kept whole, for timeline output


class Profiler:
    """TF's `tf.compat.v1.profiler.Profiler(graph=None, op_log=None)`.

    Args:
        graph: the model (a torch `nn.Module`, a LightningModule, or a keras Model): its parameters become
            `_trainable_variables` nodes in the scope view, named like the ops' module scopes.
        op_log: extra op types per node name (TF's OpLogProto as a dict), e.g. `{"net/fc/weight": ["_special"]}`.
    """

    def __init__(self, graph: Any = None, op_log: dict[str, list[str]] | None = None) -> None:
        if op_log is not None and not (isinstance(op_log, dict) and all(
                isinstance(k, str) and isinstance(v, (list, tuple)) and all(isinstance(t, str) for t in v)
                for k, v in op_log.items())):
            raise TypeError("`Profiler(op_log=...)` must be a dict of node name -> list of op type names.")
        self._data = ProfileData()
        self._op_log = dict(op_log or {})
        self._recent: collections.OrderedDict[StepKey, StepStats] = collections.OrderedDict()
        self._pending: list[BackgroundJob] = []
        if graph is not None:
            self._data.add_model(graph, self._op_log)

    def wait_for(self, job: BackgroundJob) -> None:
        """Reports and `add_step` wait for `job` first: a ProfilerHook adds its traced steps on its background
        thread, and a report asked for after the step must include it."""
        self._pending = [pending for pending in self._pending if not pending.done] + [job]

    def _settle(self) -> None:
        for job in self._pending:
            job.wait()

    @property
    def data(self) -> ProfileData:
        """The accumulated nodes and steps (for tools; the views are the usual way in)."""
        self._settle()
        return self._data

    def add_step(self, step: int, run_meta: Any, rank: int | None = None) -> None:
        """Add one traced step's `RunMetadata` (the same step of the same rank added twice accumulates).
        `rank`: the distributed rank it ran on; default: the one its metadata names (a ProfilerHook's steps
        carry theirs), else 0. Steps are kept by (rank, step), never added across ranks."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"add_step(step={step!r}): `step` must be an int >= 0.")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
            raise ValueError(f"add_step(rank={rank!r}): `rank` must be an int >= 0, or None for the step's own.")
        self._settle()  # (at once on the background thread, where a ProfilerHook adds its steps)
        stats = getattr(run_meta, "step_stats", run_meta)
        if not isinstance(stats, StepStats):
            raise TypeError("add_step: `run_meta` must be a RunMetadata of a traced step, got "
                            f"{type(run_meta).__name__}.")
        key = (step_rank(stats) if rank is None else rank, step)
        with paused_gc():
            self._data.add_step(step, stats, self._op_log, rank=key[0])
        self._recent[key] = stats
        self._recent.move_to_end(key)
        while len(self._recent) > KEEP_STEP_STATS:
            self._recent.popitem(last=False)

    def merge(self, other: Profiler) -> None:
        """Add another Profiler's steps to this one's: the ranks of a distributed run, each profiled in its own
        process, in one profile (`Profiler.load` each rank's `serialize_to_string()`), whose `advise()` then
        compares the ranks. A step of a rank both hold adds up, as `add_step` of the same step twice does (a
        tfprof step groups the run metadata given for it). This profile gets its own copy of `other`'s."""
        if not isinstance(other, Profiler):
            raise TypeError(f"merge(other=...) must be a Profiler (another rank's), got {type(other).__name__}.")
        self._settle()
        other._settle()
        with paused_gc():
            self._data.merge(other._data)
        self._recent.update(other._recent)
        while len(self._recent) > KEEP_STEP_STATS:
            self._recent.popitem(last=False)

    # --- the four views -----------------------------------------------------------------------------------

    def profile_name_scope(self, options: dict[str, Any] | None = None) -> views.ViewNode:
        """The scope view: module paths as a tree, ops and parameters as leaves."""
        return self._tree("name_scope", views.scope_tree, options)

    def profile_graph(self, options: dict[str, Any] | None = None) -> views.ViewNode:
        """The graph view: each op with the producers of its inputs as children."""
        return self._tree("graph", views.graph_tree, options)

    def profile_python(self, options: dict[str, Any] | None = None) -> views.ViewNode:
        """The code view: Python call stacks as a tree, op figures at their code lines."""
        return self._tree("python", views.code_tree, options)

    def profile_operations(self, options: dict[str, Any] | None = None) -> views.OpViewResult:
        """The op view: one row per op type."""
        opts = check_options(options, "operations")
        self._settle()
        with paused_gc():
            result = views.op_view(self._data, opts)
        self._emit(result.text, opts, {n for r in result.rows for n in r.nodes}, "operations")
        return result

    def _tree(self, view: str, build, options: dict[str, Any] | None) -> views.ViewNode:
        opts = check_options(options, view)
        self._settle()
        with paused_gc():
            root = views.apply_options(build(self._data, opts), opts, lift_hidden=view == "python")
            root.text = views.tree_text(root, opts)
        self._emit(root.text, opts, {n.name for n in root.walk()}, view)
        return root

    def _emit(self, text: str, opts: dict[str, Any], shown: set[str], view: str) -> None:
        kind, path = opts["_output"]
        if kind == "stdout":
            sys.stdout.write(text)
        elif kind == "file":  # TF's views as TF wrote them: a Doc block explaining the view and its columns first
            doc = views.doc_block(view, opts["select"]) if view in views.VIEW_DOCS else ""
            with atomic_write(os.path.abspath(path)) as f:
                f.write((doc + text).encode())
        elif kind == "timeline":
            self._write_timeline(path, opts["step"], shown)
        elif kind == "pprof":
            if view != "python":
                raise ValueError("output 'pprof:outfile=...' is for the code view only (as TF's): use it with "
                                 "profile_python(), or `hookprof profile --view code`.")
            from hookprof.profiler.pprof import write_pprof

            write_pprof(os.path.abspath(path), self._data, opts["step"])

    def _write_timeline(self, path: str, step: int, shown: set[str]) -> None:
        """TF's timeline output: the chosen step (the last traced one for step -1), displayed ops only, into
        `<path>_<step>` as TF named it (`with_timeline_output("t.json")` at step 200 writes `t.json_200`)."""
        from hookprof.step_stats import DeviceStepStats
        from hookprof.trace.writer import ChromeTraceWriter

        if not self._recent:
            raise ValueError("timeline output needs a traced step; add_step has not been called.")
        chosen = next(reversed(self._recent))[1] if step < 0 else step
        stats = next((self._recent[key] for key in sorted(self._recent) if key[1] == chosen), None)  # (lowest rank)
        if stats is None:
            raise ValueError(f"timeline output: step {chosen} is not among the last {KEEP_STEP_STATS} traced steps "
                             f"{sorted({s for _, s in self._recent})}; pick one of them with with_step().")
        kept = StepStats(step=chosen, metadata=dict(stats.metadata), edges=[
            e for e in stats.edges if e.producer.node_name in shown and e.consumer.node_name in shown])
        for dev in stats.dev_stats:
            kept.dev_stats.append(DeviceStepStats(dev.device, [
                n for n in dev.node_stats if n.category != fmt.CAT_OP or n.node_name in shown], dict(dev.thread_names)))
        ChromeTraceWriter(show_dataflow=True).write(kept, os.path.abspath(f"{path}_{chosen}"))

    def diff(self, step_a: int, step_b: int, options: dict[str, Any] | None = None,
             other: Profiler | None = None) -> DiffResult:
        """What changed from traced step `step_a` to `step_b` (of `other`, another run's Profiler, if given):
        op types, modules and code lines ranked by the change in time (`order_by`), and the ops that ran in only
        one of the steps, each with both steps' figures. Prints the text (`output`) and returns the rows; the
        options are the views' (see hookprof.profiler.diff for what each means in a diff)."""
        from hookprof.profiler.diff import check_diff_options, check_step, diff

        opts = check_diff_options(options)
        if other is not None and not isinstance(other, Profiler):
            raise TypeError(f"diff(other=...) must be a Profiler (another run's), got {type(other).__name__}.")
        self._settle()
        against = self if other is None else other
        against._settle()
        check_step(self._data, step_a, "step_a")
        check_step(against._data, step_b, "step_b")
        with paused_gc():
            result = diff(self._data, step_a, against._data, step_b, opts)
        self._emit(result.text, opts, set(), "diff")
        return result

    # --- advice and persistence ---------------------------------------------------------------------------

    def advise(self, options: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run the checkers (default: all, as TF's ALL_ADVICE), print their reports as TF's advisor did
        (`<checker>:` then a line per report; nothing under a checker that found nothing) and return them."""
        from hookprof.profiler.advisor import advise, report_text

        self._settle()
        with paused_gc():
            result = advise(self._data, options)
        sys.stdout.write(report_text(result))
        sys.stdout.flush()
        return result

    def serialize_to_string(self) -> bytes:
        """The accumulated profile as bytes in hookprof's versioned format (see hookprof.profiler.serialize)."""
        from hookprof.profiler.serialize import dumps

        self._settle()
        with paused_gc():
            return dumps(self._data)

    @classmethod
    def load(cls, data: bytes, max_bytes: int | None = None) -> Profiler:
        """A Profiler from `serialize_to_string()` output; refuses foreign, truncated or oversized input."""
        from hookprof.profiler.serialize import DEFAULT_MAX_BYTES, loads

        profiler = cls()
        with paused_gc():
            profiler._data = loads(data, DEFAULT_MAX_BYTES if max_bytes is None else max_bytes)
        return profiler
