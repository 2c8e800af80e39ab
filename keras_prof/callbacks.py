"""The Keras callbacks: one per hookprof hook, made from the hook's own signature (any backend).

Each class takes exactly its hook's arguments (`hookprof.hooks.adapter.callback_class`; `help(ProfilerHook)`
lists them). What Keras adds is written here once: `output_dir=None` (the default) is `logs/train`, where a
default `keras.callbacks.TensorBoard()` writes; a `TensorBoard` callback is a `summary_writer`; checkpoints are
whole `.keras` models. One Keras process is one rank, so `ProfilerHook` has no `ranks`, and Keras hands its
callbacks no batch, so `FeedFnHook`'s values are read with `hookprof.step_feeds()` only (no `into_batch`).
`request_stop()` sets `model.stop_training`; a hook's error (`NanLossDuringTrainingError`) ends the fit's hooks
(any running trace stopped, files closed, no `end()`, the model's own train function put back) and fails `fit`.
`callbacks.pyi` shows type checkers the same signatures.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from hookprof import hooks
from hookprof._runtime.atomic_file import atomic_write
from hookprof._runtime.private_dir import claimed_directory
from hookprof.hooks.adapter import Adapter, callback_class
from keras_prof.hook_callback import HookCallback, event_sink

EXTENSION = ".keras"


def model_saver(session: Any) -> Callable[[str], str | None]:
    """The default checkpoint saver: the fit's model as a `.keras` archive (`model.save`'s format: configuration,
    weights and the optimizer's state, its `iterations` included) at `<path>.keras`, written under a temp name
    and renamed into place (a reader never sees half a file). The model is read from the session at each save:
    on the JAX backend that syncs this step's variables into it (they live outside the model during `fit`)."""

    def save(path: str) -> str:
        target = path + EXTENSION
        with atomic_write(target) as f:
            _save_model(session.model, f, os.path.dirname(target))
        return target

    return save


SAVE_DIR_PREFIX = ".keras-save-"  # an older Keras's scratch directory beside the checkpoint (`save_through_directory`)


def _save_model(model: Any, fileobj: Any, directory: str) -> None:
    try:
        from keras.src.saving import saving_lib
    except ImportError:  # a Keras that moved it: its public save takes a path only
        saving_lib = None
    if saving_lib is not None and hasattr(saving_lib, "save_model"):
        saving_lib.save_model(model, fileobj)  # (Keras' public `model.save` takes file objects only here)
    else:
        save_through_directory(model, fileobj, directory)


def save_through_directory(model: Any, fileobj: Any, directory: str) -> None:
    """`model.save` into a scratch directory in `directory`, copied into `fileobj` (a Keras whose save takes a
    path only)."""
    # beside the checkpoint, not in TMPDIR: a full TMPDIR (another filesystem) must not cost the checkpoint;
    # claimed by a lock while the save runs, so a save killed midway leaves nothing the next one keeps
    with claimed_directory(SAVE_DIR_PREFIX, directory) as tmp:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        with open(path, "rb") as src:
            while chunk := src.read(1 << 20):
                fileobj.write(chunk)


KERAS = Adapter(HookCallback, __name__, defaults={"output_dir": None}, convert={"summary_writer": event_sink},
                supply={"set_default_saver": model_saver})

ProfilerHook = callback_class(hooks.ProfilerHook, KERAS, """
    Writes a Chrome-trace timeline of one training step every `save_steps` steps or `save_secs` seconds.

    Arguments and semantics are `hookprof.ProfilerHook`'s (TF1's; `help(ProfilerHook.__init__)`), less `ranks`.
    `output_dir=None` (the default) writes into `logs/train`, where `SummarySaverHook` and Keras' own
    `TensorBoard()` callback write, so one `tensorboard --logdir logs` shows the step graphs beside the
    summaries. On the torch backend the timeline holds every op of the step, on JAX every XLA op of the jitted
    train step, on TensorFlow only the step's phases.

    Example::

        model.fit(x, y, epochs=2, callbacks=[ProfilerHook(save_secs=5, output_dir="runs/keras")])
    """, omit=("ranks",))

CheckpointSaverHook = callback_class(hooks.CheckpointSaverHook, KERAS, """
    Saves the model every `save_steps` steps (`optimizer.iterations`) or `save_secs` seconds, with TF1's rules.

    Arguments and rules are `hookprof.CheckpointSaverHook`'s (TF1's): a checkpoint of the state when training
    starts (`model.ckpt-0.keras` for a fresh fit), one after each step on which the schedule fires, and one at
    the end when the last step was not saved; listeners around each save. Files are
    `<checkpoint_dir>/<checkpoint_basename>-<global step>.keras`, whole models with their optimizer state, so
    `keras.models.load_model(path)` followed by `fit` resumes at that step (and this hook's step schedule goes
    on from it). `latest_checkpoint(checkpoint_dir)` names the newest. A failed save (a full disk, whatever the
    saver raises) is warned about once and counted in `hook.failed_saves`; training goes on (`strict=True`
    raises). `saver=` replaces the `.keras` save.

    Example::

        model.fit(x, y, callbacks=[CheckpointSaverHook("runs/ckpt", save_steps=500)])
        model = keras.models.load_model(latest_checkpoint("runs/ckpt"))  # and fit again to resume
    """)

SummarySaverHook = callback_class(hooks.SummarySaverHook, KERAS, """
    Writes TensorBoard summaries every `save_steps` steps or `save_secs` seconds, on any Keras backend.

    Arguments and rules are `hookprof.SummarySaverHook`'s (TF1's). With neither `output_dir` nor
    `summary_writer`, events go to `logs/train`, where a default `keras.callbacks.TensorBoard()` writes, so
    `tensorboard --logdir logs` shows both; pass `summary_writer=tensorboard_callback` to follow a
    TensorBoard callback's `log_dir`. A summary callable receives the finished step: `step.outputs` (the
    step's logs: `loss` and metrics), `step.batch` (torch backend), `step.model`, `step.step`.

    Example::

        summary.histogram("dense/kernel", lambda step: step.model.layers[0].kernel)
        model.fit(x, y, callbacks=[SummarySaverHook(save_steps=50, summary_op=summary.merge_all())])
    """)

StepCounterHook = callback_class(hooks.StepCounterHook, KERAS, """
    Logs `global_step/sec` and writes it as a TensorBoard scalar every `every_n_steps` steps (or
    `every_n_secs` seconds), on any Keras backend; the first step only starts the count, as in TF.

    Arguments and rules are `hookprof.StepCounterHook`'s (TF1's), TF's default `every_n_steps=100` included
    (pass `every_n_steps=None` with `every_n_secs`). The global step is `optimizer.iterations`. With neither
    `output_dir` nor `summary_writer`, the scalar goes to `logs/train`, where a default
    `keras.callbacks.TensorBoard()` writes; pass `summary_writer=tensorboard_callback` to follow its `log_dir`.
    `batch_size` (not in TF) adds `examples/sec`.

    Example::

        model.fit(x, y, batch_size=32, callbacks=[StepCounterHook(every_n_steps=50, batch_size=32)])
    """)

LoggingTensorHook = callback_class(hooks.LoggingTensorHook, KERAS, """
    Logs step values every `every_n_iter` steps or `every_n_secs` seconds, and/or at the end of the fit.

    Arguments, rules and log format are `hookprof.LoggingTensorHook`'s (TF1's): `"loss = 0.25 (1.234 sec)"`
    at INFO on the logger `hookprof.hooks.logging_tensor_hook`, from the first step on. A fetch is the name of
    an entry of the step's logs (`"loss"` and the compiled metrics) or a callable of the finished step
    (`step.outputs`, `step.batch` on the torch backend, `step.model`, `step.step`).

    Example::

        model.fit(x, y, callbacks=[LoggingTensorHook(["loss"], every_n_iter=100)])
    """)

StopAtStepHook = callback_class(hooks.StopAtStepHook, KERAS, """
    Stops training after `num_steps` steps, or once `optimizer.iterations` reaches `last_step`.

    Arguments and rules are `hookprof.StopAtStepHook`'s (TF1's): exactly one of the two. `num_steps` counts
    from `optimizer.iterations` when the fit starts.

    Example::

        model.fit(x, y, epochs=100, callbacks=[StopAtStepHook(last_step=1000)])
    """)

NanTensorHook = callback_class(hooks.NanTensorHook, KERAS, """
    Fails (`NanLossDuringTrainingError`) or stops training when the loss is NaN (TF1's NanTensorHook).

    `loss_tensor` is a fetch: `"loss"` (the step's loss log), another log's name, or a callable of the finished
    step. With `fail_on_nan_loss=False` training ends cleanly after the NaN step, `end()` included.

    Example::

        model.fit(x, y, callbacks=[NanTensorHook("loss", fail_on_nan_loss=False)])
    """)

FinalOpsHook = callback_class(hooks.FinalOpsHook, KERAS, """
    Evaluates `final_ops` when training ends (on the last finished step); read `final_ops_values` after fit.

    Example::

        final = FinalOpsHook({"loss": "loss", "step": "global_step"})
        model.fit(x, y, callbacks=[final])
        final.final_ops_values["loss"]
    """)

FeedFnHook = callback_class(hooks.FeedFnHook, KERAS, """
    Feeds `feed_fn()`'s values into every training step (TF1's FeedFnHook).

    Keras hands its batch callbacks no batch, so the values are read inside the step with
    `hookprof.step_feeds()` (e.g. in a custom `train_step`, or a layer's `call` during training); they are
    never put into the batch. Runs on every step, as TF's did. A compiled train step (JAX with `jit_compile`,
    the default; TensorFlow) reads them once, when traced: the fit is refused before its first step with a
    `ValueError`; compile the model with `run_eagerly=True` (on JAX, or `jit_compile=False`) to feed each step.
    Any other hook whose `before_run` returns `SessionRunArgs(feed_dict=...)` fails the same way at the first
    step it feeds.

    Example::

        model.fit(x, y, callbacks=[FeedFnHook(lambda: {"noise": schedule.next()})])
        # in train_step: noise = hookprof.step_feeds()["noise"]
    """, fixed={"into_batch": False})

GlobalStepWaiterHook = callback_class(hooks.GlobalStepWaiterHook, KERAS, """
    Holds training back until the global step reaches `wait_until_step` (TF1's GlobalStepWaiterHook).

    The step waited on is `run_context.session.global_step` (this model's `optimizer.iterations`), which
    nothing advances while this process waits: pass `global_step_fn` reading a counter another process
    advances. Without one the hook passes at once when the fit starts (or resumes) at or past
    `wait_until_step`, and otherwise waits for ever, as a TF worker whose chief never came. `wait_until_step
    <= 0` never waits. Arguments, timing and log messages are `hookprof.GlobalStepWaiterHook`'s (TF's).
    """)

__all__ = ["CheckpointSaverHook", "FeedFnHook", "FinalOpsHook", "GlobalStepWaiterHook", "LoggingTensorHook",
           "NanTensorHook", "ProfilerHook", "StepCounterHook", "StopAtStepHook", "SummarySaverHook", "model_saver"]
