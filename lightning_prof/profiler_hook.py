"""`lightning_prof.ProfilerHook`: TF1's ProfilerHook as a Lightning callback."""

from __future__ import annotations

from typing import Any

from hookprof.hooks.capture import CaptureOptions
from hookprof.hooks.profiler_hook import DEFAULT_MAX_EVENTS
from hookprof.hooks.profiler_hook import ProfilerHook as CoreProfilerHook
from lightning_prof.hook_callback import HookCallback


class ProfilerHook(HookCallback):
    """Writes a Chrome-trace timeline of one training step every `save_steps` steps or `save_secs` seconds.

    Arguments and semantics are `hookprof.ProfilerHook`'s (TF1's). `output_dir=None` (the default) puts the
    files in the logger's run directory (`trainer.log_dir`, e.g. `lightning_logs/version_0`), else in
    `default_root_dir`. Under DDP every rank writes its own `timeline-<step>-rank<r>.json` unless `ranks`
    picks some. Usable from `LightningCLI` configs (`trainer.callbacks`).

    Args:
        save_steps: a timeline every this many global steps; exactly one of `save_steps` / `save_secs`.
        save_secs: a timeline every this many seconds.
        output_dir: directory for the files (`~` and `$VARS` expanded); None: the logger's run directory.
        show_dataflow: flow arrows between producers and consumers.
        show_memory: record allocations and add memory tracks.
        ranks: the ranks that write: None for all, a rank, or a list of ranks.
        compress: write `.json.gz` files instead of `.json`.
        max_events: cap on events per timeline (None: no cap); a cut trace says so in its metadata.
        tensorboard: write each traced step's graph and `step_<N>` run metadata for TensorBoard's Graphs
            dashboard into `output_dir` (by default the logger's run directory, beside the scalars).
        profiler: a `hookprof.profiler.Profiler` that every traced step is added to.
        with_stack: record Python stacks (the Profiler's code view needs them).
        triggers: `hookprof.triggers` judged on every step (`SlowStep()`, `NonFinite("loss")`, `LossSpike()`,
            `MemoryJump(bytes)`): when one fires, the next `capture_steps` steps are traced, their metadata
            say why, and they hold the phases of the firing step and the steps before it. With triggers,
            `save_steps` and `save_secs` may both be None.
        capture_steps: steps traced after a trigger fires.
        cooldown_steps: steps after a fire during which no trigger fires again.
        keep_last: keep only this run's newest `keep_last` timelines (None: all).
        capture: a `hookprof.CaptureOptions`: how traced steps are rendered and written (None: the defaults).
        name: tells this callback from another on the same schedule in one Trainer (`HookCallback`'s `name`).

    Example::

        trainer = lightning.Trainer(max_steps=300, callbacks=[ProfilerHook(save_steps=100)])
        trainer.fit(model, loader)   # -> timeline-100.json, timeline-200.json, timeline-300.json
    """

    def __init__(
        self,
        save_steps: int | None = None,
        save_secs: float | None = None,
        output_dir: str | None = None,
        show_dataflow: bool = True,
        show_memory: bool = False,
        ranks: int | list[int] | None = None,
        compress: bool = False,
        max_events: int | None = DEFAULT_MAX_EVENTS,
        tensorboard: bool = True,
        profiler: Any = None,
        with_stack: bool = False,
        triggers: list[Any] | None = None,
        capture_steps: int = 1,
        cooldown_steps: int = 100,
        keep_last: int | None = None,
        capture: CaptureOptions | None = None,
        *,
        name: str | None = None,
    ) -> None:
        self.hook = CoreProfilerHook(save_steps, save_secs, output_dir, show_dataflow, show_memory, ranks,
                                     compress, max_events, tensorboard, profiler, with_stack, triggers=triggers,
                                     capture_steps=capture_steps, cooldown_steps=cooldown_steps,
                                     keep_last=keep_last, capture=capture)
        super().__init__([self.hook], name=name)

    @property
    def saved_paths(self) -> list[str]:
        """The timelines written so far and still kept (`keep_last`), in order."""
        return self.hook.saved_paths
