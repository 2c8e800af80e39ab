"""`NanTensorHook`: TF1's `tf.train.NanTensorHook`, failing or stopping training when the loss is NaN."""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from hookprof._runtime import arguments
from hookprof.hooks.session import check_fetches
from hookprof.hooks.session_run_hook import SessionRunArgs, SessionRunHook

log = logging.getLogger(__name__)


class NanLossDuringTrainingError(RuntimeError):
    """Raised by `NanTensorHook(fail_on_nan_loss=True)` when the loss is NaN (TF's `tf.train` error)."""

    def __str__(self) -> str:
        return "NaN loss during training."


def is_nan(value: Any) -> bool:
    """Whether a loss value is NaN (any element, for a non-scalar). Python numbers are read as they are;
    a torch tensor (Keras' torch backend included) is checked where it lives and one bool comes to the host;
    numpy, JAX and TensorFlow values are read through numpy."""
    return _any_element(value, finite=False, owner="NanTensorHook", argument="loss_tensor")


def is_non_finite(value: Any, owner: str, argument: str) -> bool:
    """Whether any element of a value is NaN or infinite, read as `is_nan` reads it; a value that is not a
    number raises a TypeError naming `owner(argument=...)`."""
    return _any_element(value, finite=True, owner=owner, argument=argument)


def _any_element(value: Any, finite: bool, owner: str, argument: str) -> bool:
    """Whether any element is NaN (`finite=False`), or NaN or infinite (`finite=True`)."""
    if isinstance(value, (bool, int)):
        return False
    if isinstance(value, float):
        return not math.isfinite(value) if finite else math.isnan(value)
    if type(value).__module__.partition(".")[0] == "torch":
        import torch

        if isinstance(value, torch.Tensor):
            if not (value.is_floating_point() or value.is_complex()):
                return False
            if value.numel() == 1 and not value.is_complex():  # a loss: one number to the host is cheapest
                return _any_element(value.item(), finite, owner, argument)
            value = value.detach()
            return bool((~torch.isfinite(value)).any() if finite else torch.isnan(value).any())
    try:
        array = np.asarray(value)
        return bool((~np.isfinite(array)).any() if finite else np.isnan(array).any())
    except (TypeError, ValueError):
        raise TypeError(f"{owner}: the {argument} value is a {type(value).__name__} ({value!r:.80}), not a number "
                        f"or tensor; pass a `{argument}` fetch that gives a number.") from None


class NanTensorHook(SessionRunHook):
    """Monitors the loss and stops training if it is NaN; can either fail with an exception or just stop.

    Args:
        loss_tensor: the loss, as a fetch: the name of a step output or logged metric (`"loss"`: Lightning's
            training_step loss, Keras' `loss` log), or a callable of the finished step (`hookprof.StepState`).
            Its value may be a Python number, numpy value, torch tensor or Keras tensor; it is fetched on every
            step, as in TF.
        fail_on_nan_loss: True: log "Model diverged with loss = NaN." at ERROR and raise
            `NanLossDuringTrainingError` ("NaN loss during training."), which fails the fit (no `end()`).
            False: log the same message as a WARNING and request a stop, so training ends cleanly after that
            step and `end()` runs.
    """

    def __init__(self, loss_tensor: Any, fail_on_nan_loss: bool = True) -> None:
        owner = type(self).__name__
        self.loss_tensor = check_fetches(owner, "loss_tensor", loss_tensor)
        self.fail_on_nan_loss = arguments.check_bool(owner, "fail_on_nan_loss", fail_on_nan_loss)

    def before_run(self, run_context) -> SessionRunArgs:
        return SessionRunArgs(fetches=self.loss_tensor)

    def after_run(self, run_context, run_values) -> None:
        if is_nan(run_values.results):
            failure_message = "Model diverged with loss = NaN."
            if self.fail_on_nan_loss:
                log.error(failure_message)
                raise NanLossDuringTrainingError
            log.warning(failure_message)
            # We don't raise an error but we request stop without an exception.
            run_context.request_stop()
