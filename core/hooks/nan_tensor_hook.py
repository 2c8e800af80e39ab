"""`NanTensorHook`: TF1's `tf.train.NanTensorHook`, failing or stopping training when the loss is NaN."""

from __future__ import annotations

import logging
from typing import Any

from hookprof._runtime import arguments
from hookprof._runtime.values import is_nan
from hookprof._runtime.values import is_non_finite as is_non_finite
from hookprof.hooks.session import check_fetches
from hookprof.hooks.session_run_hook import SessionRunArgs, SessionRunHook

log = logging.getLogger(__name__)


class NanLossDuringTrainingError(RuntimeError):
    """Raised by `NanTensorHook(fail_on_nan_loss=True)` when the loss is NaN (TF's `tf.train` error); under DDP
    every rank raises it at the same step, its `detail` saying where the NaN was seen."""

    def __init__(self, detail: str = "") -> None:
        super().__init__(detail)
        self.detail = detail

    def __str__(self) -> str:
        return "NaN loss during training." + (f" {self.detail}" if self.detail else "")


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
            step and `end()` runs. Under DDP a NaN on one rank does either on every rank after that step (the
            ranks agree it: a rank failing alone would leave the others waiting in a collective); a failure
            is then raised after all of the step's hooks ran.

    Raises:
        TypeError: a `loss_tensor` that is not a fetch, a `fail_on_nan_loss` that is not a bool.
    """

    def __init__(self, loss_tensor: Any, fail_on_nan_loss: bool = True) -> None:
        owner = type(self).__name__
        self.loss_tensor = check_fetches(owner, "loss_tensor", loss_tensor)
        self.fail_on_nan_loss = arguments.check_bool(owner, "fail_on_nan_loss", fail_on_nan_loss)

    def may_request_stop(self) -> bool:
        return not self.fail_on_nan_loss  # a NaN on one rank stops every rank (fail_on_nan_loss: see `votes`)

    def votes(self) -> int:
        return int(self.fail_on_nan_loss)  # whether some rank's loss was NaN: every rank then fails

    def vote(self, global_step: int) -> tuple[bool, ...]:
        return (self._nan_seen,) if self.fail_on_nan_loss else ()

    def agreed(self, run_context, decisions: tuple[bool, ...]) -> None:
        if self.fail_on_nan_loss and decisions[0]:
            session = run_context.session
            where = "this rank" if self._nan_seen else "another rank"
            if not self._nan_seen:
                log.error("Model diverged with loss = NaN on another rank.")
            raise NanLossDuringTrainingError(f"Global step {session.global_step}, rank {session.rank}: the loss was "
                                             f"NaN on {where}; every rank fails at this step.")

    def begin(self) -> None:
        # (where the ranks agree) this rank's loss was NaN: every rank fails in `agreed`. Set here, not in
        # __init__: the checkpoint key an earlier hookprof computed reads the fields a new hook has
        self._nan_seen = False

    def before_run(self, run_context) -> SessionRunArgs:
        return SessionRunArgs(fetches=self.loss_tensor)

    def after_run(self, run_context, run_values) -> None:
        if is_nan(run_values.results):
            failure_message = "Model diverged with loss = NaN."
            if self.fail_on_nan_loss:
                log.error(failure_message)
                if getattr(run_context.session, "agreeing", False):
                    self._nan_seen = True  # every rank raises once the ranks agreed it (`agreed`)
                    return
                raise NanLossDuringTrainingError
            log.warning(failure_message)
            # We don't raise an error but we request stop without an exception.
            run_context.request_stop()
