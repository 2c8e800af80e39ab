"""`keras_prof.CheckpointSaverHook`: TF1's CheckpointSaverHook as a Keras callback, saving whole `.keras` models
(weights and optimizer state: `keras.models.load_model` of one resumes training at its step)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from hookprof._runtime.atomic_file import atomic_write
from hookprof.hooks.checkpoint_saver_hook import CheckpointSaverHook as CoreCheckpointSaverHook
from hookprof.hooks.checkpoint_saver_hook import CheckpointSaverListener, latest_checkpoint
from keras_prof.hook_callback import HookCallback

EXTENSION = ".keras"


def model_saver(session: Any) -> Callable[[str], str | None]:
    """The default saver: the fit's model as a `.keras` archive (`model.save`'s format: configuration, weights
    and the optimizer's state, its `iterations` included) at `<path>.keras`, written under a temp name and
    renamed into place (a reader never sees half a file)."""
    model = session.model

    def save(path: str) -> str:
        target = path + EXTENSION
        with atomic_write(target) as f:
            _save_model(model, f, os.path.dirname(target))
        return target

    return save


def _save_model(model: Any, fileobj: Any, directory: str) -> None:
    try:
        from keras.src.saving import saving_lib
    except ImportError:  # a Keras that moved it: its public save takes a path only
        saving_lib = None
    if saving_lib is not None and hasattr(saving_lib, "save_model"):
        saving_lib.save_model(model, fileobj)  # (Keras' public `model.save` takes file objects only here)
        return
    import tempfile

    # beside the checkpoint, not in TMPDIR: a full TMPDIR (another filesystem) must not cost the checkpoint
    with tempfile.TemporaryDirectory(dir=directory, prefix=".keras-save-") as tmp:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        with open(path, "rb") as src:
            while chunk := src.read(1 << 20):
                fileobj.write(chunk)


class CheckpointSaverHook(HookCallback):
    """Saves the model every `save_steps` steps (`optimizer.iterations`) or `save_secs` seconds, with TF1's rules.

    Arguments and rules are `hookprof.hooks.checkpoint_saver_hook.CheckpointSaverHook`'s (TF1's): a checkpoint
    of the state when training starts (`model.ckpt-0.keras` for a fresh fit), one after each step on which the
    schedule fires, and one at the end when the last step was not saved; listeners around each save. Files are
    `<checkpoint_dir>/<checkpoint_basename>-<global step>.keras`, whole models with their optimizer state, so
    `keras.models.load_model(path)` followed by `fit` resumes at that step (and this hook's step schedule goes
    on from it). `latest_checkpoint(checkpoint_dir)` names the newest. A failed save (a full disk, whatever the saver
    raises) is warned about once and counted in `hook.failed_saves`; training goes on (`strict=True` raises).
    `saver=` replaces the `.keras` save.

    Example::

        model.fit(x, y, callbacks=[CheckpointSaverHook("runs/ckpt", save_steps=500)])
        model = keras.models.load_model(latest_checkpoint("runs/ckpt"))  # and fit again to resume
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
    ) -> None:
        self.hook = CoreCheckpointSaverHook(checkpoint_dir, save_secs, save_steps, saver, checkpoint_basename,
                                            scaffold, listeners, strict=strict)
        self.hook.set_default_saver(model_saver)
        super().__init__([self.hook])


__all__ = ["CheckpointSaverHook", "CheckpointSaverListener", "latest_checkpoint", "model_saver"]
