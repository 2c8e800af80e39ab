"""`lightning_prof.FeedFnHook` and `GlobalStepWaiterHook`: TF1's hooks as Lightning callbacks (two of one class
and schedule in one Trainer need `name=`: see `HookCallback`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from hookprof.hooks.feed_fn_hook import FeedFnHook as CoreFeedFnHook
from hookprof.hooks.global_step_waiter_hook import GlobalStepWaiterHook as CoreGlobalStepWaiterHook
from lightning_prof.hook_callback import HookCallback


class FeedFnHook(HookCallback):
    """Feeds `feed_fn()`'s values into every training step (TF1's FeedFnHook).

    `training_step` reads them with `hookprof.step_feeds()` and, when the batch is a dict (a DataLoader of
    dicts), in the batch itself: `batch["lr_scale"]`. With `into_batch=True` a batch that is not a dict (a
    tuple, a tensor) fails the fit with a `TypeError` saying to read `hookprof.step_feeds()` instead; with
    `into_batch=False` only `step_feeds()` has them. Arguments and rules are `hookprof`'s FeedFnHook (TF's).

    With gradient accumulation a TF step is one optimizer step: `feed_fn` runs once per window, at its first
    micro-batch, and the window's later dict batches get the same values.

    Example::

        trainer = Trainer(callbacks=[FeedFnHook(lambda: {"dropout": schedule.next()})])
        # in training_step: p = batch["dropout"]  (dict batches)  or  hookprof.step_feeds()["dropout"]
    """

    def __init__(self, feed_fn: Callable[[], Mapping[Any, Any]], into_batch: bool | None = None, *,
                 name: str | None = None) -> None:
        self.hook = CoreFeedFnHook(feed_fn, into_batch)
        super().__init__([self.hook], name=name)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        # the fit's driver (the first hookprof callback, which runs before this one) has opened the step; a
        # later micro-batch of a gradient-accumulation window gets the values the window's step was fed
        self.hook.put_into_batch(batch)


class GlobalStepWaiterHook(HookCallback):
    """Holds training back until the global step reaches `wait_until_step` (TF1's GlobalStepWaiterHook).

    The step waited on is `run_context.session.global_step` (this process's `trainer.global_step`), which
    nothing advances while this rank waits: pass `global_step_fn` reading a counter that another process
    advances (e.g. a `torch.distributed.TCPStore` the chief updates). Without one the hook passes at once when
    the fit starts (or resumes) at or past `wait_until_step`, and otherwise waits for ever, as a TF worker
    whose chief never came. `wait_until_step <= 0` never waits. Arguments, timing and log messages are
    `hookprof.hooks.global_step_waiter_hook.GlobalStepWaiterHook`'s (TF's).
    """

    def __init__(self, wait_until_step: int, global_step_fn: Callable[[], int] | None = None,
                 sleep: Callable[[float], Any] | None = None, *, name: str | None = None) -> None:
        self.hook = CoreGlobalStepWaiterHook(wait_until_step, global_step_fn, sleep)
        super().__init__([self.hook], name=name)
