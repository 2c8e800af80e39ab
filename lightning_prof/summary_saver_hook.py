"""`lightning_prof.SummarySaverHook`: TF1's SummarySaverHook as a Lightning callback."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from hookprof.hooks.summary_saver_hook import SummarySaverHook as CoreSummarySaverHook
from hookprof.summary import CollectionSummary, Scaffold
from lightning_prof.hook_callback import HookCallback, event_sink


class SummarySaverHook(HookCallback):
    """Writes TensorBoard summaries every `save_steps` steps or `save_secs` seconds (rank 0 only).

    Arguments and rules are `hookprof.SummarySaverHook`'s (TF1's), exactly one of `scaffold` / `summary_op`
    included. With neither `output_dir` nor `summary_writer`, events go to the logger's run directory
    (`trainer.log_dir`), so one `tensorboard --logdir lightning_logs` shows Lightning's scalars and these
    summaries together. `summary_writer` may be the Trainer's `TensorBoardLogger` itself. A summary callable
    receives the finished step: `step.outputs` (training_step's return, `{"loss": ...}` for a bare loss),
    `step.batch`, `step.model` (the LightningModule), `step.metrics` (`trainer.callback_metrics`), `step.step`.

    `summary_op` may also be a collection key (a string), which is what a `LightningCLI` config can give:
    `summary_op: summaries` writes `summary.merge_all("summaries")` as it is when each fit starts
    (`on_fit_start`), so the summaries may be registered in code before or after the callback is made: at a
    module's top level or in the LightningModule's `setup` (not `__init__`: a rank that ddp_spawn starts gets
    the model unpickled, without running it). A key with no summaries then fails
    that fit with one `hookprof.summary.EmptyCollectionError` naming the key and the keys that hold summaries.
    Two of these on one schedule and collection in one Trainer need `name=` (see `HookCallback`).

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
    """

    def __init__(
        self,
        save_steps: int | None = None,
        save_secs: float | None = None,
        output_dir: str | None = None,
        summary_writer: Any = None,
        scaffold: Scaffold | None = None,
        summary_op: Any = None,
        strict: bool = False,
        *,
        name: str | None = None,
    ) -> None:
        self._collection = CollectionSummary(summary_op) if isinstance(summary_op, str) else None
        self.hook = CoreSummarySaverHook(save_steps, save_secs, output_dir, event_sink(summary_writer), scaffold,
                                         summary_op if self._collection is None else self._collection, strict)
        super().__init__([self.hook], name=name)

    def _identity_settings(self) -> dict[str, Any]:
        # two hooks on one schedule that select two collections are two callbacks (to Lightning, and in checkpoints)
        return {} if self._collection is None else {"summary_op": self._collection.key}

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._collection is not None:
            self._collection.resolve()  # the collection as it is now, or one clear error before the first step
