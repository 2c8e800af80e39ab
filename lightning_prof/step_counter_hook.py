"""`lightning_prof.StepCounterHook`: TF1's StepCounterHook (global steps per second) as a Lightning callback."""

from __future__ import annotations

import os
from typing import Any

from hookprof.hooks.step_counter_hook import StepCounterHook as CoreStepCounterHook
from lightning_prof.hook_callback import HookCallback, event_sink


class StepCounterHook(HookCallback):
    """Logs `global_step/sec` and writes it as a TensorBoard scalar every `every_n_steps` optimizer steps (or
    `every_n_secs` seconds); the first step only starts the count, as in TF.

    Arguments and rules are `hookprof.StepCounterHook`'s (TF1's), TF's default `every_n_steps=100` included
    (pass `every_n_steps=None` with `every_n_secs`). With neither `output_dir` nor `summary_writer`, the scalar
    goes to the logger's run directory (`trainer.log_dir`), into Lightning's own event file when the logger is
    a `TensorBoardLogger`; `summary_writer` may be the Trainer's `TensorBoardLogger` itself. `batch_size`
    (not in TF) adds `examples/sec`. A global step is one optimizer step (gradient accumulation included).
    Two of these on one schedule in one Trainer need `name=` (see `HookCallback`).

    Example::

        trainer = Trainer(callbacks=[StepCounterHook(every_n_steps=50)])
    """

    def __init__(
        self,
        every_n_steps: int | None = 100,
        every_n_secs: float | None = None,
        output_dir: str | os.PathLike | None = None,
        summary_writer: Any = None,
        batch_size: int | None = None,
        *,
        name: str | None = None,
    ) -> None:
        self.hook = CoreStepCounterHook(every_n_steps, every_n_secs, output_dir, event_sink(summary_writer),
                                        batch_size)
        super().__init__([self.hook], name=name)
