"""`lightning_prof.LoggingTensorHook`: TF1's LoggingTensorHook as a Lightning callback."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hookprof.hooks.logging_tensor_hook import LoggingTensorHook as CoreLoggingTensorHook
from lightning_prof.hook_callback import HookCallback


class LoggingTensorHook(HookCallback):
    """Logs step values every `every_n_iter` steps or `every_n_secs` seconds, and/or at the end of the fit.

    Arguments, rules and log format are `hookprof.LoggingTensorHook`'s (TF1's): `"loss = 0.25, ... (1.234
    sec)"` at INFO on the logger `hookprof.hooks.logging_tensor_hook`, from the first step on. A fetch is the
    name of a training_step output (`"loss"`) or of a logged metric (`trainer.callback_metrics`), or a
    callable of the finished step (`step.outputs`, `step.batch`, `step.model`, `step.metrics`, `step.step`).
    Two of these on one schedule in one Trainer need `name=` (see `HookCallback`).

    Example::

        trainer = Trainer(callbacks=[LoggingTensorHook({"loss": "loss"}, every_n_iter=100)])
    """

    def __init__(
        self,
        tensors: Any,
        every_n_iter: int | None = None,
        every_n_secs: float | None = None,
        at_end: bool = False,
        formatter: Callable[[dict[str, Any]], str] | None = None,
        *,
        name: str | None = None,
    ) -> None:
        self.hook = CoreLoggingTensorHook(tensors, every_n_iter, every_n_secs, at_end, formatter)
        super().__init__([self.hook], name=name)
