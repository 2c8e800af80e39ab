"""TF1's StopAtStepHook, NanTensorHook and FinalOpsHook as Lightning callbacks.

Each is a thin `HookCallback` around the `hookprof` hook (`self.hook`), with TF's arguments and messages, and
`name=` for two of one class and schedule in one Trainer (see `HookCallback`).
`request_stop()` sets `trainer.should_stop`, so training ends after that step and `end()` runs; an exception
raised by a hook (`NanLossDuringTrainingError`) fails the fit, and Lightning's `on_exception` stops any running
trace and closes the hooks' files (no `end()`, TF's rule).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hookprof.hooks.final_ops_hook import FinalOpsHook as CoreFinalOpsHook
from hookprof.hooks.nan_tensor_hook import NanLossDuringTrainingError
from hookprof.hooks.nan_tensor_hook import NanTensorHook as CoreNanTensorHook
from hookprof.hooks.stop_at_step_hook import StopAtStepHook as CoreStopAtStepHook
from lightning_prof.hook_callback import HookCallback

__all__ = ["FinalOpsHook", "NanLossDuringTrainingError", "NanTensorHook", "StopAtStepHook"]


class StopAtStepHook(HookCallback):
    """Stops training after `num_steps` global steps, or once `trainer.global_step` reaches `last_step`.

    Arguments and rules are `hookprof.StopAtStepHook`'s (TF1's): exactly one of the two. `num_steps` counts
    from the global step when the fit starts (a resumed fit counts from its checkpoint's step).

    Example::

        trainer = Trainer(max_epochs=100, callbacks=[StopAtStepHook(last_step=1000)])
    """

    def __init__(self, num_steps: int | None = None, last_step: int | None = None, *,
                 name: str | None = None) -> None:
        self.hook = CoreStopAtStepHook(num_steps, last_step)
        super().__init__([self.hook], name=name)


class NanTensorHook(HookCallback):
    """Fails (`NanLossDuringTrainingError`) or stops training when the loss is NaN (TF1's NanTensorHook).

    `loss_tensor` is a fetch: `"loss"` (training_step's loss), a logged metric's name, or a callable of the
    finished step. With `fail_on_nan_loss=False` training ends cleanly after the NaN step, `end()` included.

    Example::

        trainer = Trainer(callbacks=[NanTensorHook("loss", fail_on_nan_loss=False)])
    """

    def __init__(self, loss_tensor: Any, fail_on_nan_loss: bool = True, *, name: str | None = None) -> None:
        self.hook = CoreNanTensorHook(loss_tensor, fail_on_nan_loss)
        super().__init__([self.hook], name=name)


class FinalOpsHook(HookCallback):
    """Evaluates `final_ops` when training ends (on the last finished step); read `final_ops_values` after fit.

    Example::

        final = FinalOpsHook({"loss": "loss", "step": "global_step", "w": lambda step: step.model.fc1.weight})
        trainer.fit(model)
        final.final_ops_values["loss"]
    """

    def __init__(self, final_ops: Any, final_ops_feed_dict: Mapping[str, Any] | None = None, *,
                 name: str | None = None) -> None:
        self.hook = CoreFinalOpsHook(final_ops, final_ops_feed_dict)
        super().__init__([self.hook], name=name)

    @property
    def final_ops_values(self) -> Any:
        return self.hook.final_ops_values
