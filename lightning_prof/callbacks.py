"""The Lightning callbacks: one per hookprof hook, made from the hook's own signature.

Each class takes exactly its hook's arguments (`hookprof.hooks.adapter.callback_class`; `help(ProfilerHook)`
lists them) plus `name=`, which tells two callbacks of one class and schedule in one Trainer apart (see
`HookCallback`). What Lightning adds is written here once: `output_dir=None` (the default) is the logger's run
directory, a `TensorBoardLogger` is a `summary_writer`, checkpoints are `trainer.save_checkpoint`'s, and a
`FeedFnHook`'s values go into dict batches. `callbacks.pyi` shows type checkers the same signatures.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from hookprof import hooks
from hookprof._runtime import atomic_file
from hookprof.hooks.adapter import Adapter, callback_class
from hookprof.summary import CollectionSummary
from lightning_prof.hook_callback import HookCallback, event_sink

EXTENSION = ".ckpt"


def trainer_saver(session: Any) -> Callable[[str], str | None]:
    """The default checkpoint saver: `trainer.save_checkpoint` of the fit's trainer, into `<path>.ckpt`, written
    under a temp name and renamed into place (a reader never sees half a checkpoint). Every rank calls it
    (Lightning's save is collective); rank 0 writes the file, the others return None."""
    trainer = session.trainer

    def save(path: str) -> str | None:
        target = path + EXTENSION
        tmp = atomic_file.temp_path_for(target)
        try:
            try:
                trainer.save_checkpoint(tmp)
            except BaseException:
                if trainer.world_size > 1:  # rank 0 failed before the save's barrier: meet the other ranks there
                    with contextlib.suppress(Exception):
                        trainer.strategy.barrier("Trainer.save_checkpoint")
                raise
            if not trainer.is_global_zero:
                return None
            atomic_file.FILE_LAYER.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return target

    return save


LIGHTNING = Adapter(HookCallback, __name__, defaults={"output_dir": None}, convert={"summary_writer": event_sink},
                    supply={"set_default_saver": trainer_saver})


class _IntoBatch(HookCallback):
    """FeedFnHook's values also go into the window's later micro-batches (gradient accumulation)."""

    hook: hooks.FeedFnHook

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        # the fit's driver (the first hookprof callback, which runs before this one) has opened the step; a
        # later micro-batch of a gradient-accumulation window gets the values the window's step was fed
        self.hook.put_into_batch(batch)


class _CollectionKey(HookCallback):
    """SummarySaverHook's `summary_op` may also be a collection key, which is what a LightningCLI config can give:
    `summary.merge_all(key)` as it is when each fit starts."""

    _collection: CollectionSummary | None = None

    def _hook_arguments(self, arguments: dict[str, Any]) -> dict[str, Any]:
        if isinstance(arguments["summary_op"], str):
            self._collection = arguments["summary_op"] = CollectionSummary(arguments["summary_op"])
        return arguments

    def _identity_settings(self) -> dict[str, Any]:
        # two hooks on one schedule that select two collections are two callbacks (to Lightning, and in checkpoints)
        return {} if self._collection is None else {"summary_op": self._collection.key}

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._collection is not None:
            self._collection.resolve()  # the collection as it is now, or one clear error before the first step


ProfilerHook = callback_class(hooks.ProfilerHook, LIGHTNING, """
    Writes a Chrome-trace timeline of one training step every `save_steps` steps or `save_secs` seconds.

    Arguments and semantics are `hookprof.ProfilerHook`'s (TF1's; `help(ProfilerHook.__init__)`), plus `name`.
    `output_dir=None` (the default) puts the files in the logger's run directory (`trainer.log_dir`, e.g.
    `lightning_logs/version_0`), else in `default_root_dir`. Under DDP every rank writes its own
    `timeline-<step>-rank<r>.json` unless `ranks` picks some. Usable from `LightningCLI` configs
    (`trainer.callbacks`).

    Example::

        trainer = lightning.Trainer(max_steps=300, callbacks=[ProfilerHook(save_steps=100)])
        trainer.fit(model, loader)   # -> timeline-100.json, timeline-200.json, timeline-300.json
    """)

CheckpointSaverHook = callback_class(hooks.CheckpointSaverHook, LIGHTNING, """
    Saves a Lightning checkpoint every `save_steps` optimizer steps or `save_secs` seconds, with TF1's rules.

    Arguments and rules are `hookprof.CheckpointSaverHook`'s (TF1's), plus `name`: a checkpoint of the state when
    training starts (`model.ckpt-0.ckpt` for a fresh fit), one after each step on which the schedule fires, and
    one at the end when the last step was not saved; listeners around each save. Files are
    `<checkpoint_dir>/<checkpoint_basename>-<global step>.ckpt`, written by `trainer.save_checkpoint` (model,
    optimizers, loops, callbacks: this hook's schedule included), so `Trainer.fit(model, ckpt_path=path)`
    resumes at that global step and the schedule goes on without saving that step again.
    `latest_checkpoint(checkpoint_dir)` names the newest. A failed save (a full disk, whatever the saver raises)
    is warned about once and counted in `hook.failed_saves`; training goes on (`strict=True` raises).
    `saver=` replaces Lightning's checkpointing.

    Example::

        trainer = Trainer(callbacks=[CheckpointSaverHook("runs/ckpt", save_steps=500)])
    """)

SummarySaverHook = callback_class(hooks.SummarySaverHook, LIGHTNING, """
    Writes TensorBoard summaries every `save_steps` steps or `save_secs` seconds (rank 0 only).

    Arguments and rules are `hookprof.SummarySaverHook`'s (TF1's), exactly one of `scaffold` / `summary_op`
    included, plus `name`. With neither `output_dir` nor `summary_writer`, events go to the logger's run directory
    (`trainer.log_dir`), so one `tensorboard --logdir lightning_logs` shows Lightning's scalars and these
    summaries together. `summary_writer` may be the Trainer's `TensorBoardLogger` itself. A summary callable
    receives the finished step: `step.outputs` (training_step's return, `{"loss": ...}` for a bare loss),
    `step.batch`, `step.model` (the LightningModule), `step.metrics` (`trainer.callback_metrics`), `step.step`.

    `summary_op` may also be a collection key (a string), which is what a `LightningCLI` config can give:
    `summary_op: summaries` writes `summary.merge_all("summaries")` as it is when each fit starts
    (`on_fit_start`), so the summaries may be registered in code before or after the callback is made: at a
    module's top level or in the LightningModule's `setup` (not `__init__`: a rank that ddp_spawn starts gets
    the model unpickled, without running it). A key with no summaries then fails that fit with one
    `hookprof.summary.EmptyCollectionError` naming the key and the keys that hold summaries. Two of these on one
    schedule that select two collections are two callbacks.

    Example::

        from hookprof import summary
        summary.scalar("loss", lambda step: step.outputs["loss"])
        summary.histogram("fc1/weight", lambda step: step.model.fc1.weight)
        trainer = Trainer(callbacks=[SummarySaverHook(save_steps=50, summary_op=summary.merge_all())])

    From a LightningCLI config (`examples/cli_config.yaml`)::

        trainer:
          callbacks:
            - class_path: lightning_prof.SummarySaverHook
              init_args: {save_steps: 50, summary_op: summaries}
    """, parent=_CollectionKey)

StepCounterHook = callback_class(hooks.StepCounterHook, LIGHTNING, """
    Logs `global_step/sec` and writes it as a TensorBoard scalar every `every_n_steps` optimizer steps (or
    `every_n_secs` seconds); the first step only starts the count, as in TF.

    Arguments and rules are `hookprof.StepCounterHook`'s (TF1's), TF's default `every_n_steps=100` included
    (pass `every_n_steps=None` with `every_n_secs`), plus `name`. With neither `output_dir` nor `summary_writer`,
    the scalar goes to the logger's run directory (`trainer.log_dir`), into Lightning's own event file when the
    logger is a `TensorBoardLogger`; `summary_writer` may be the Trainer's `TensorBoardLogger` itself.
    `batch_size` (not in TF) adds `examples/sec`. A global step is one optimizer step (gradient accumulation
    included).

    Example::

        trainer = Trainer(callbacks=[StepCounterHook(every_n_steps=50)])
    """)

LoggingTensorHook = callback_class(hooks.LoggingTensorHook, LIGHTNING, """
    Logs step values every `every_n_iter` steps or `every_n_secs` seconds, and/or at the end of the fit.

    Arguments, rules and log format are `hookprof.LoggingTensorHook`'s (TF1's), plus `name`: `"loss = 0.25, ...
    (1.234 sec)"` at INFO on the logger `hookprof.hooks.logging_tensor_hook`, from the first step on. A fetch is
    the name of a training_step output (`"loss"`) or of a logged metric (`trainer.callback_metrics`), or a
    callable of the finished step (`step.outputs`, `step.batch`, `step.model`, `step.metrics`, `step.step`).

    Example::

        trainer = Trainer(callbacks=[LoggingTensorHook({"loss": "loss"}, every_n_iter=100)])
    """)

StopAtStepHook = callback_class(hooks.StopAtStepHook, LIGHTNING, """
    Stops training after `num_steps` global steps, or once `trainer.global_step` reaches `last_step`.

    Arguments and rules are `hookprof.StopAtStepHook`'s (TF1's): exactly one of the two, plus `name`.
    `num_steps` counts from the global step when the fit starts (a resumed fit counts from its checkpoint's
    step). The stop sets `trainer.should_stop`: training ends after that step and `end()` runs.

    Example::

        trainer = Trainer(max_epochs=100, callbacks=[StopAtStepHook(last_step=1000)])
    """)

NanTensorHook = callback_class(hooks.NanTensorHook, LIGHTNING, """
    Fails (`NanLossDuringTrainingError`) or stops training when the loss is NaN (TF1's NanTensorHook).

    `loss_tensor` is a fetch: `"loss"` (training_step's loss), a logged metric's name, or a callable of the
    finished step. With `fail_on_nan_loss=False` training ends cleanly after the NaN step, `end()` included;
    the error fails the fit, and Lightning's `on_exception` stops any running trace and closes the hooks'
    files (no `end()`, TF's rule).

    Example::

        trainer = Trainer(callbacks=[NanTensorHook("loss", fail_on_nan_loss=False)])
    """)

FinalOpsHook = callback_class(hooks.FinalOpsHook, LIGHTNING, """
    Evaluates `final_ops` when training ends (on the last finished step); read `final_ops_values` after fit.

    Example::

        final = FinalOpsHook({"loss": "loss", "step": "global_step", "w": lambda step: step.model.fc1.weight})
        trainer.fit(model)
        final.final_ops_values["loss"]
    """)

FeedFnHook = callback_class(hooks.FeedFnHook, LIGHTNING, """
    Feeds `feed_fn()`'s values into every training step (TF1's FeedFnHook).

    `training_step` reads them with `hookprof.step_feeds()` and, when the batch is a dict (a DataLoader of
    dicts), in the batch itself: `batch["lr_scale"]`. With `into_batch=True` a batch that is not a dict (a
    tuple, a tensor) fails the fit with a `TypeError` saying to read `hookprof.step_feeds()` instead; with
    `into_batch=False` only `step_feeds()` has them. Arguments and rules are `hookprof.FeedFnHook`'s (TF's).

    With gradient accumulation a TF step is one optimizer step: `feed_fn` runs once per window, at its first
    micro-batch, and the window's later dict batches get the same values.

    Example::

        trainer = Trainer(callbacks=[FeedFnHook(lambda: {"dropout": schedule.next()})])
        # in training_step: p = batch["dropout"]  (dict batches)  or  hookprof.step_feeds()["dropout"]
    """, parent=_IntoBatch)

GlobalStepWaiterHook = callback_class(hooks.GlobalStepWaiterHook, LIGHTNING, """
    Holds training back until the global step reaches `wait_until_step` (TF1's GlobalStepWaiterHook).

    The step waited on is `run_context.session.global_step` (this process's `trainer.global_step`), which
    nothing advances while this rank waits: pass `global_step_fn` reading a counter that another process
    advances (e.g. a `torch.distributed.TCPStore` the chief updates). Without one the hook passes at once when
    the fit starts (or resumes) at or past `wait_until_step`, and otherwise waits for ever, as a TF worker
    whose chief never came. `wait_until_step <= 0` never waits. Arguments, timing and log messages are
    `hookprof.GlobalStepWaiterHook`'s (TF's).
    """)

__all__ = ["CheckpointSaverHook", "FeedFnHook", "FinalOpsHook", "GlobalStepWaiterHook", "LoggingTensorHook",
           "NanTensorHook", "ProfilerHook", "StepCounterHook", "StopAtStepHook", "SummarySaverHook", "trainer_saver"]
