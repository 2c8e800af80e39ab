"""`CheckpointSaverHook` and `CheckpointSaverListener`: checkpoints every N steps or seconds (TF1's hook).

The hook is framework-neutral: what a checkpoint holds and how it is written is the saver's business. The
adapters (`lightning_prof.callbacks`, `keras_prof.callbacks`) give it the framework's own checkpointing as its
default saver; here a saver is passed in (`saver=`) or set by whoever drives the hook (`set_default_saver`),
else the core's own (`session_saver`: the global step and the model's state as plain arrays, which
`load_variable` / `list_variables` read back, as TF's default Saver and `tf.train.load_variable`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hookprof._runtime import arguments
from hookprof._runtime.atomic_file import atomic_write, remove_stale_temps
from hookprof._runtime.background import count_dropped
from hookprof.hooks.periodic_hook import PeriodicHook
from hookprof.hooks.session import coming_step
from hookprof.hooks.timer import check_exactly_one
from hookprof.summary import to_numpy

log = logging.getLogger(__name__)

STATE_FILE = "checkpoint"  # TF's CheckpointState file: the latest checkpoint and the ones before it

SaveFunction = Callable[[str], "str | None"]


class CheckpointSaverListener:
    """Code run around each checkpoint save of a `CheckpointSaverHook` (TF's listener; subclass it).

    `begin()` once before training; `before_save` / `after_save` around every save, with the global step the
    checkpoint holds; `after_save` returning True asks training to stop after this step; `end()` once after
    the last save, at the end of training (a clean finish or a requested stop).
    """

    def begin(self) -> None:
        pass

    def before_save(self, session: Any, global_step_value: int) -> None:
        pass

    def after_save(self, session: Any, global_step_value: int) -> bool | None:
        pass

    def end(self, session: Any, global_step_value: int) -> None:
        pass


_LISTENER_METHODS = ("begin", "before_save", "after_save", "end")


class CheckpointSaverHook(PeriodicHook):
    """Saves checkpoints every N steps or seconds, with TF1's rules.

    A checkpoint is saved when training is ready to run (`after_create_session`: the state at the first global
    step, step 0 for a fresh run; not when a resumed run's schedule says that step was saved, see below), then after
    each step on which the schedule fires (the global step reached by that step), and at `end()` when the last
    step was not saved yet. Each save is named `<checkpoint_dir>/<checkpoint_basename>-<global step>` (the
    saver adds its file extension), logs "Saving checkpoints for <step> into <checkpoint_dir>/<basename>.", is
    surrounded by the listeners' `before_save` / `after_save`, and is recorded in `<checkpoint_dir>/checkpoint`
    (TF's state file: `latest_checkpoint(checkpoint_dir)` reads it). A save that fails, whatever the saver
    raises (an OSError, `torch.save`'s RuntimeError on a full disk, a model its framework cannot serialise),
    never ends training: it is counted in `failed_saves` and `dropped_outputs` and warned about once per reason,
    naming the checkpoint, the error and, when the checkpoint directory has room, the full directory the saver
    wrote to (TMPDIR); `strict=True` raises it instead (TF's rule). Every checkpoint is kept (TF's Saver kept 5
    by default): prune the directory yourself in long runs.

    A resumed run keeps the schedule: a Lightning checkpoint carries it; elsewhere a step schedule continues
    where an uninterrupted run was, the last multiple of `save_steps` (see `PeriodicHook`).

    Args:
        checkpoint_dir: the directory of the checkpoints; created if missing.
        save_secs: save every this many seconds. Exactly one of `save_secs` / `save_steps`.
        save_steps: save every this many global steps.
        saver: how a checkpoint is written: an object with TF's `save(session, save_path, global_step=step)`
            that returns the path it wrote (it names the file itself), or a callable `save(path)` given
            `<checkpoint_dir>/<basename>-<step>` that returns the file it wrote (or None: nothing written by
            this process). Default: the adapter's (the framework's own checkpoint); driven by hand,
            `session_saver` (the global step and the model's state as a `.npz` of plain arrays, read back with
            `load_variable`, as TF's default Saver and `tf.train.load_variable`).
        checkpoint_basename: the file name's prefix.
        scaffold: an object whose `saver` attribute is used as `saver` (TF's Scaffold). Not with `saver`.
        listeners: `CheckpointSaverListener`s called around every save.
        clock: the seconds clock of the schedule (default: `time.time()`, read at each call); for tests.
        strict: raise a failed save's error out of the callback (ending training) instead of warning.

    Raises:
        ValueError: neither or both of `save_secs` / `save_steps` (TF's messages), both `saver` and `scaffold`,
            a `checkpoint_basename` that is not a plain file name, a `checkpoint_dir` that is a file or not
            writable, a `save_steps` below 1 or `save_secs` not above 0.
        TypeError: a `checkpoint_dir` that is not a path, a `save_steps` that is not an int, a `saver` that is
            neither TF's saver nor a callable, `listeners` that are not `CheckpointSaverListener`s, a `strict`
            that is not a bool.
    """

    agreed_schedule = True  # (see PeriodicHook)

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike,
        save_secs: float | None = None,
        save_steps: int | None = None,
        saver: Any = None,
        checkpoint_basename: str = "model.ckpt",
        scaffold: Any = None,
        listeners: Sequence[CheckpointSaverListener] | None = None,
        clock: Callable[[], float] | None = None,
        strict: bool = False,
    ) -> None:
        owner = type(self).__name__
        log.info("Create CheckpointSaverHook.")
        if saver is not None and scaffold is not None:
            raise ValueError("You cannot provide both saver and scaffold.")
        check_exactly_one(save_secs, save_steps)  # TF's messages
        if checkpoint_dir is None:
            raise TypeError(f"`{owner}(checkpoint_dir=None)`: `checkpoint_dir` must be a path (str or os.PathLike).")
        # checked here, so that an error names this hook's argument (PeriodicHook's would say `output_dir`)
        checkpoint_dir = arguments.expand_dir(owner, "checkpoint_dir", checkpoint_dir)
        self.strict = arguments.check_bool(owner, "strict", strict)
        super().__init__(save_steps, save_secs, checkpoint_dir, clock)
        if saver is not None and not (callable(saver) or callable(getattr(saver, "save", None))):
            raise TypeError(f"`{owner}(saver={saver!r})`: `saver` must have TF's `save(session, save_path, "
                            "global_step=...)` method, or be a callable `save(path)`.")
        if not isinstance(checkpoint_basename, str) or not checkpoint_basename or os.sep in checkpoint_basename:
            raise ValueError(f"`{owner}(checkpoint_basename={checkpoint_basename!r})`: `checkpoint_basename` must "
                             "be a non-empty file name (no directory).")
        if listeners is None:
            listeners = []
        if not isinstance(listeners, (list, tuple)):
            raise TypeError(f"`{owner}(listeners=...)`: `listeners` must be a list of CheckpointSaverListener, got "
                            f"{type(listeners).__name__}.")
        for i, listener in enumerate(listeners):
            missing = [m for m in _LISTENER_METHODS if not callable(getattr(listener, m, None))]
            if missing:
                raise TypeError(f"`{owner}(listeners[{i}])` ({type(listener).__name__}) is not a "
                                f"CheckpointSaverListener: it lacks {missing}.")
        self.checkpoint_dir = self.output_dir
        self.checkpoint_basename = checkpoint_basename
        self._saver = saver
        self._scaffold = scaffold
        self._listeners = list(listeners)
        self._default_saver: Callable[[Any], SaveFunction] | None = None
        self._save_fn: Callable[[Any, int], str | None] | None = None
        self._saved: list[str] = []  # the files of this directory's checkpoint state, oldest first
        self.failed_saves = 0  # saves that raised (also counted in `dropped_outputs`)

    # --- where checkpoints go and how they are written -------------------------------------------------------

    @property
    def save_path(self) -> str:
        """TF's `_save_path`: `<checkpoint_dir>/<checkpoint_basename>`, which each save suffixes `-<step>`."""
        return os.path.join(self.checkpoint_dir, self.checkpoint_basename)

    @property
    def listeners(self) -> list[CheckpointSaverListener]:
        return self._listeners

    @property
    def saved_paths(self) -> list[str]:
        """The checkpoint files this directory's state file lists (this run's saves last)."""
        return list(self._saved)

    def set_default_saver(self, factory: Callable[[Any], SaveFunction] | None) -> None:
        """The saver used when neither `saver` nor a scaffold's saver was given: `factory(session)` returns a
        callable `save(path) -> written file or None`. The adapters set the framework's own checkpointing."""
        self._default_saver = factory

    def _get_saver(self, session: Any) -> Callable[[Any, int], str | None]:
        saver = self._saver
        if saver is None and self._scaffold is not None:
            saver = getattr(self._scaffold, "saver", None)
        if saver is not None:
            save_path = self.save_path
            if callable(getattr(saver, "save", None)):  # TF's Saver: it names the file from the global step
                return lambda sess, step: saver.save(sess, save_path, global_step=step)
            return lambda sess, step: saver(f"{save_path}-{step}")
        save = (self._default_saver or session_saver)(session)
        save_path = self.save_path
        return lambda sess, step: save(f"{save_path}-{step}")

    # --- the hook ------------------------------------------------------------------------------------------

    def begin(self) -> None:
        arguments.make_dir(type(self).__name__, "checkpoint_dir", self.checkpoint_dir)
        remove_stale_temps(self.checkpoint_dir)  # left by a run killed mid-save
        self._saved = _read_state(self.checkpoint_dir)
        self._save_fn = None
        super().begin()
        for listener in self._listeners:
            listener.begin()

    def after_create_session(self, session: Any, coord: Any) -> None:
        super().after_create_session(session, coord)
        self._save_fn = self._get_saver(session)
        step = _global_step(session)
        # The checkpoint saved here is the state at step `step` (TF). A resumed run whose schedule says this
        # step was saved already does not write it again.
        if self._timer.should_trigger_for_step(step):
            self._timer.update_last_triggered_step(step)
            self._save(session, step)  # (TF ignores a listener's stop request here)

    def quiet_on(self, global_step: int) -> bool:
        return not self._timer.should_trigger_for_step(coming_step(self._session, global_step))

    def after_run(self, run_context, run_values) -> None:
        # (where the ranks agree, the timer is due only inside `agreed`: the save happens there, on every rank)
        self._save_if(self._timer.should_trigger_for_step(run_context.session.global_step), run_context)

    def _save_if(self, due: bool, run_context) -> None:
        if due:
            session = run_context.session
            step = session.global_step
            self._timer.update_last_triggered_step(step)
            if self._save(session, step):
                run_context.request_stop()

    # Under DDP every rank saves at once (Lightning's save is collective): a seconds schedule, read on each
    # rank's clock, is agreed after each step (`PeriodicHook`), and the agreed save made at once, on every rank.

    def may_request_stop(self) -> bool:
        return bool(self._listeners)  # a listener's after_save may ask

    def agreed(self, run_context, decisions: tuple[bool, ...]) -> None:
        super().agreed(run_context, decisions)
        self._save_if(self._timer.should_trigger_for_step(run_context.session.global_step), run_context)

    def end(self, session: Any) -> None:
        last_step = _global_step(session)
        if last_step != self._timer.last_triggered_step():
            self._save(session, last_step)
        for listener in self._listeners:
            listener.end(session, last_step)
        self.close()

    def close(self) -> None:
        """Let go of this fit's saver (it holds the trainer or model; a pickled hook must not carry it)."""
        self._save_fn = None
        super().close()

    def _save(self, session: Any, step: int) -> bool:
        """Save the checkpoint of `step`; return whether a listener asked to stop (TF's `_save`)."""
        if self._listeners:
            log.info("Calling checkpoint listeners before saving checkpoint %d...", step)
        for listener in self._listeners:
            listener.before_save(session, step)
        log.info("Saving checkpoints for %d into %s.", step, self.save_path)
        save = self._save_fn
        if save is None:  # (a hook driven without after_create_session, as TF's unit tests drive it)
            save = self._save_fn = self._get_saver(session)
        try:
            path = save(session, step)
        except Exception as err:  # noqa: BLE001 - any saver's failure (a full disk is torch.save's RuntimeError)
            if self.strict:
                raise
            self.failed_saves += 1
            count_dropped(self)
            target = f"{self.save_path}-{step}"
            reason = _reason(err)
            cause = _full_disk_cause(err, self.checkpoint_dir)
            self._warn_once(f"save:{type(err).__name__}:{reason}", "Could not save the checkpoint for step %d "
                            "(%s) into %s: %s%s; training goes on without it (strict=True raises instead).",
                            step, target, self.checkpoint_dir, reason, cause)
            return False
        if path:
            self._record(os.fspath(path))
        if self._listeners:
            log.info("Calling checkpoint listeners after saving checkpoint %d...", step)
        should_stop = False
        for listener in self._listeners:
            if listener.after_save(session, step):
                log.info("A CheckpointSaverListener requested that training be stopped. listener: %s", listener)
                should_stop = True
        return should_stop

    def _record(self, path: str) -> None:
        """Add `path` to `<checkpoint_dir>/checkpoint` as the latest checkpoint (written atomically)."""
        path = os.path.abspath(path)
        self._saved = [p for p in self._saved if p != path] + [path]
        state = os.path.join(self.checkpoint_dir, STATE_FILE)
        try:
            with atomic_write(state) as f:
                f.write(_format_state(self.checkpoint_dir, self._saved).encode())
        except OSError as err:
            count_dropped(self)
            self._warn_once(f"state:{err.strerror}", "Could not write %s (%s); the checkpoints are saved but "
                            "latest_checkpoint() may not name the newest.", state, err.strerror or err)


def _reason(err: BaseException) -> str:
    """An error in a few words: an OSError's strerror, else `Type: message` (first line)."""
    if isinstance(err, OSError) and err.strerror:
        where = f" ({err.filename})" if err.filename else ""
        return f"{err.strerror}{where}"
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


_ROOM = 1 << 20  # a filesystem with less free space than this is called full


def _free(directory: str) -> int | None:
    with contextlib.suppress(OSError):
        return shutil.disk_usage(directory).free
    return None


def _full_disk_cause(err: BaseException, checkpoint_dir: str) -> str:
    """Which full filesystem a failed save met, if any (savers do not all say ENOSPC: `torch.save` raises a
    RuntimeError, "iostream error"): the checkpoint directory's, or, when that one has room, the one the error
    names or TMPDIR (a saver's temporary files, Keras' assets or a user's `tempfile`, go there)."""
    here = _free(checkpoint_dir)
    if here is not None and here < _ROOM:
        return f" ({checkpoint_dir} is full)"
    filename = getattr(err, "filename", None)
    if isinstance(filename, str) and not os.path.abspath(filename).startswith(checkpoint_dir + os.sep):
        room = _free(os.path.dirname(os.path.abspath(filename)))
        if room is not None and room < _ROOM:
            return f" (the checkpoint directory has room; {filename}, where the saver wrote, is on a full disk)"
    temp = tempfile.gettempdir()
    room = _free(temp)
    if room is not None and room < _ROOM:
        return f" (the checkpoint directory has room; the temporary directory {temp} (TMPDIR) is full)"
    return ""


def _global_step(session: Any) -> int:
    return int(getattr(session, "global_step", 0) or 0)


# --- TF's CheckpointState file ------------------------------------------------------------------------------

def _relative(directory: str, path: str) -> str:
    return os.path.relpath(path, directory) if os.path.dirname(path) == directory else path


def _format_state(directory: str, paths: list[str]) -> str:
    def quoted(path: str) -> str:
        return '"' + _relative(directory, path).replace("\\", "\\\\").replace('"', '\\"') + '"'

    lines = [f"model_checkpoint_path: {quoted(paths[-1])}"]
    lines += [f"all_model_checkpoint_paths: {quoted(p)}" for p in paths]
    return "\n".join(lines) + "\n"


_STATE_LINE = re.compile(r'^(model_checkpoint_path|all_model_checkpoint_paths):\s*"((?:[^"\\]|\\.)*)"\s*$')


def _read_state(directory: str) -> list[str]:
    """The existing checkpoints `<directory>/checkpoint` lists, oldest first; latest last."""
    latest, every = None, []
    with contextlib.suppress(OSError, UnicodeDecodeError):
        with open(os.path.join(directory, STATE_FILE), encoding="utf-8") as f:
            for line in f:
                match = _STATE_LINE.match(line.strip())
                if match:
                    value = re.sub(r"\\(.)", r"\1", match.group(2))
                    path = value if os.path.isabs(value) else os.path.join(directory, value)
                    if match.group(1) == "model_checkpoint_path":
                        latest = path
                    else:
                        every.append(path)
    return [p for p in every if p != latest] + ([latest] if latest else [])


# --- the core's own checkpoint: what the session holds, as plain arrays ----------------------------------------

CHECKPOINT_EXTENSION = ".npz"
GLOBAL_STEP = "global_step"


def session_saver(session: Any) -> SaveFunction:
    """The saver used where no framework's is (a `HookedSession` driven by hand, TF's default `Saver`): each
    save writes `<path>.npz`, a numpy archive of plain arrays (no pickle): `global_step`, and the model's state
    where the session has a model with a `state_dict()` (torch: each tensor under `model/<name>`) or
    `get_weights()` (Keras: `model/<i>`). Read values back with `load_variable`."""

    def save(path: str) -> str:
        target = path + CHECKPOINT_EXTENSION
        arrays = {GLOBAL_STEP: np.asarray(_global_step(session), dtype=np.int64)}
        arrays.update(_model_arrays(getattr(session, "model", None)))
        with atomic_write(target) as f:
            np.savez(f, **arrays)
        return target

    return save


def _model_arrays(model: Any) -> dict[str, np.ndarray]:
    state = getattr(model, "state_dict", None)
    if callable(state):
        values = state()
        return {f"model/{name}": to_numpy(value) for name, value in values.items()}  # (bf16 as float32)
    weights = getattr(model, "get_weights", None)
    if callable(weights):
        return {f"model/{i}": to_numpy(value) for i, value in enumerate(weights())}
    return {}


def _checkpoint_file(ckpt_dir_or_file: str | os.PathLike) -> str:
    path = os.fspath(ckpt_dir_or_file)
    if os.path.isdir(path):
        latest = latest_checkpoint(path)
        if latest is None:
            raise ValueError(f"No checkpoint in {path!r}: its `checkpoint` state file lists none.")
        path = latest
    if not os.path.exists(path) and os.path.exists(path + CHECKPOINT_EXTENSION):
        path += CHECKPOINT_EXTENSION
    return path


def load_variable(ckpt_dir_or_file: str | os.PathLike, name: str) -> np.ndarray:
    """The value saved under `name` (`"global_step"`, `"model/fc1.weight"`) in a checkpoint the core's default
    saver wrote: the newest in a directory, or the file given (TF's `tf.train.load_variable`).

    Raises ValueError for a directory with no checkpoint or a file that is not such an archive, KeyError
    (naming the names it has) for a name it does not hold."""
    path = _checkpoint_file(ckpt_dir_or_file)
    try:
        with np.load(path, allow_pickle=False) as archive:
            if name not in archive.files:
                raise KeyError(f"{name!r} is not in {path}; it holds {sorted(archive.files)}.")
            return archive[name]
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} is not a checkpoint hookprof's default saver wrote ({err}).") from None


def list_variables(ckpt_dir_or_file: str | os.PathLike) -> list[tuple[str, list[int]]]:
    """(name, shape) of every value in a checkpoint the core's default saver wrote (TF's
    `tf.train.list_variables`). Raises as `load_variable`."""
    path = _checkpoint_file(ckpt_dir_or_file)
    try:
        with np.load(path, allow_pickle=False) as archive:
            return [(name, list(archive[name].shape)) for name in sorted(archive.files)]
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} is not a checkpoint hookprof's default saver wrote ({err}).") from None


def latest_checkpoint(checkpoint_dir: str | os.PathLike) -> str | None:
    """The newest checkpoint file a `CheckpointSaverHook` recorded in `checkpoint_dir` (TF's
    `tf.train.latest_checkpoint`), or None when there is none."""
    paths = _read_state(os.path.abspath(os.fspath(checkpoint_dir)))
    return paths[-1] if paths else None


__all__ = ["CheckpointSaverHook", "CheckpointSaverListener", "latest_checkpoint", "list_variables", "load_variable",
           "session_saver"]
