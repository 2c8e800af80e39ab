"""`lightning_prof.CheckpointSaverHook`: TF1's CheckpointSaverHook as a Lightning callback, saving Lightning's
own checkpoints (what `Trainer.fit(ckpt_path=...)` resumes from)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import Any

from hookprof._runtime import atomic_file
from hookprof.hooks.checkpoint_saver_hook import CheckpointSaverHook as CoreCheckpointSaverHook
from hookprof.hooks.checkpoint_saver_hook import CheckpointSaverListener, latest_checkpoint
from lightning_prof.hook_callback import HookCallback

EXTENSION = ".ckpt"


def trainer_saver(session: Any) -> Callable[[str], str | None]:
    """The default saver: `trainer.save_checkpoint` of the fit's trainer, into `<path>.ckpt`, written under a
    temp name and renamed into place (a reader never sees half a checkpoint). Every rank calls it (Lightning's
    save is collective); rank 0 writes the file, the others return None."""
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


class CheckpointSaverHook(HookCallback):
    """Saves a Lightning checkpoint every `save_steps` optimizer steps or `save_secs` seconds, with TF1's rules.

    Arguments and rules are `hookprof.hooks.checkpoint_saver_hook.CheckpointSaverHook`'s (TF1's): a checkpoint
    of the state when training starts (`model.ckpt-0.ckpt` for a fresh fit), one after each step on which the
    schedule fires, and one at the end when the last step was not saved; listeners around each save. Files are
    `<checkpoint_dir>/<checkpoint_basename>-<global step>.ckpt`, written by `trainer.save_checkpoint` (model,
    optimizers, loops, callbacks: this hook's schedule included), so `Trainer.fit(model, ckpt_path=path)`
    resumes at that global step and the schedule goes on without saving that step again.
    `latest_checkpoint(checkpoint_dir)` names the newest. A failed save (a full disk, whatever the saver raises)
    is warned about once and counted in `hook.failed_saves`; training goes on (`strict=True` raises).
    `saver=` replaces Lightning's checkpointing. Two of these on one schedule in one Trainer need `name=`
    (see `HookCallback`).

    Example::

        trainer = Trainer(callbacks=[CheckpointSaverHook("runs/ckpt", save_steps=500)])
    """

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike,
        save_secs: float | None = None,
        save_steps: int | None = None,
        saver: Any = None,
        checkpoint_basename: str = "model.ckpt",
        scaffold: Any = None,
        listeners: Sequence[CheckpointSaverListener] | None = None,
        strict: bool = False,
        *,
        name: str | None = None,
    ) -> None:
        self.hook = CoreCheckpointSaverHook(checkpoint_dir, save_secs, save_steps, saver, checkpoint_basename,
                                            scaffold, listeners, strict=strict)
        self.hook.set_default_saver(trainer_saver)
        super().__init__([self.hook], name=name)


__all__ = ["CheckpointSaverHook", "CheckpointSaverListener", "latest_checkpoint", "trainer_saver"]
