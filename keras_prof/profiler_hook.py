"""`keras_prof.ProfilerHook`: TF1's ProfilerHook as a Keras callback."""

from __future__ import annotations

import os
from typing import Any

from hookprof.hooks.capture import CaptureOptions
from hookprof.hooks.profiler_hook import DEFAULT_MAX_EVENTS
from hookprof.hooks.profiler_hook import ProfilerHook as CoreProfilerHook
from keras_prof.hook_callback import HookCallback


class ProfilerHook(HookCallback):
    """Writes a Chrome-trace timeline of one training step every `save_steps` steps or `save_secs` seconds.

    Arguments and semantics are `hookprof.ProfilerHook`'s (TF1's). `output_dir=None` (the default) writes into
    `logs/train`, where `SummarySaverHook` and Keras' own `TensorBoard()` callback write, so one
    `tensorboard --logdir logs` shows the step graphs beside the summaries. On the torch backend the timeline
    holds every op of the step, on JAX every XLA op of the jitted train step, on TensorFlow only the step's
    phases. `compress=True` writes `.json.gz`; `max_events` caps a timeline's size; `tensorboard=True` also
    writes each traced step's graph and `step_<N>` run metadata for TensorBoard. `triggers`
    (`hookprof.triggers`), `capture_steps` and `cooldown_steps` trace the steps after one that went wrong (a
    slow step, a NaN loss, a loss spike, a memory jump); `keep_last` keeps only the newest timelines of the run;
    `capture` (a `hookprof.CaptureOptions`) tunes how traced steps are rendered and written.

    Example::

        model.fit(x, y, epochs=2, callbacks=[ProfilerHook(save_secs=5, output_dir="runs/keras")])
    """

    def __init__(
        self,
        save_steps: int | None = None,
        save_secs: float | None = None,
        output_dir: str | os.PathLike | None = None,
        show_dataflow: bool = True,
        show_memory: bool = False,
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
    ) -> None:
        self.hook = CoreProfilerHook(save_steps, save_secs, output_dir, show_dataflow, show_memory,
                                     compress=compress, max_events=max_events, tensorboard=tensorboard,
                                     profiler=profiler, with_stack=with_stack, triggers=triggers,
                                     capture_steps=capture_steps, cooldown_steps=cooldown_steps,
                                     keep_last=keep_last, capture=capture)
        super().__init__([self.hook])

    @property
    def saved_paths(self) -> list[str]:
        """The timelines written so far and still kept (`keep_last`), in order."""
        return self.hook.saved_paths
