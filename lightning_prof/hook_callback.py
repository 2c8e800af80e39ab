"""`HookCallback`: runs TF1-style `SessionRunHook`s inside a Lightning `Trainer`.

Mapping: `begin` <- `setup("fit")`; `after_create_session` <- `on_train_start`; `before_run` <-
`on_train_batch_start`; `after_run` <- `on_train_batch_end`; `end` <- `on_train_end` (a clean finish or a
requested stop); `on_exception` stops any running trace and calls no `after_run`/`end`.
A TF step is one optimizer step (one global step): with gradient accumulation the step opens at the first
micro-batch of the window and closes at the batch whose optimizer step advances `trainer.global_step` (or at
the epoch's end), so schedules count global steps and a trace holds the whole window. A batch that starts but
never ends (`on_train_batch_start` returning -1) is aborted: no `after_run`, and its trace is stopped.
All hookprof callbacks of one Trainer share one driver (TF's one MonitoredSession): the first of them in
`trainer.callbacks` runs every hook of all of them, in the callbacks' order; the others return at once.
`run_context.session` is a `LightningSession`: `.trainer`, `.model` (the LightningModule), `.global_step`,
`.rank`, `.world_size`, and `.run(fetches)`. A fetch name looks up the training_step's output (`"loss"`)
or a logged metric (`trainer.callback_metrics`); `request_stop()` sets `trainer.should_stop`.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import logging
import os
import reprlib
import threading
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.profilers import PyTorchProfiler
from typing_extensions import override

from hookprof._runtime.fit_run import current_run, on_fit_end
from hookprof.hooks.adapter import fit_begins, send_home
from hookprof.hooks.hooked_session import HookedSession, check_hooks
from hookprof.hooks.identity import SCHEDULE_ATTRIBUTES, check_name, identity, schedule
from hookprof.hooks.session import Session, StepState, check_reduce
from hookprof.hooks.session_run_hook import SessionRunArgs, SessionRunHook
from hookprof.tensorboard.events import as_event_sink, use_for
from hookprof.trace.format import DATA_WAIT, VALIDATION
from hookprof.tracing import HostTracer

log = logging.getLogger(__name__)


class LightningSession(Session):
    """`run_context.session` under Lightning: the trainer and the LightningModule being fit."""

    framework = "lightning"

    def __init__(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().__init__(model=pl_module, rank=trainer.global_rank, world_size=trainer.world_size)
        self.trainer = trainer
        self.distributed_backend = getattr(trainer.strategy, "process_group_backend", None)
        self._step: int | None = None
        self._counter: Any = None  # Lightning's optimizer-step counter, found when training starts
        self._votes: RankVotes | None = None  # `agree`'s all-reduce, made at the first agreement

    @property
    def final_step(self) -> int | None:  # (see `Session.final_step`)
        """`max_steps`, or Lightning's estimate of the fit's steps from its epochs and batches
        (`estimated_stepping_batches`: optimizer steps, counted once a batch; a manual optimization that steps
        several optimizers a batch advances the global step by each, which `max_steps` bounds); None for a fit
        without end."""
        trainer = self.trainer
        try:
            steps = trainer.estimated_stepping_batches
        except Exception:  # (a callback's own argument checks, as GradientAccumulationScheduler's, may raise)
            return None
        if steps == float("inf") or steps < 0:
            return None
        if not getattr(self.model, "automatic_optimization", True):
            capped = trainer.max_steps not in (None, -1)
            if not (capped and steps == trainer.max_steps):  # (a count of batches, not of optimizer steps)
                steps *= len(getattr(trainer, "optimizers", None) or [None])  # (at most: each steps every batch)
            if capped:
                steps = min(steps, trainer.max_steps)
        return int(steps)

    def agree(self, decisions: Sequence[bool], reduce: str = "any") -> list[bool]:
        """The ranks' decisions made together, as the trainer's `strategy.reduce_boolean_decision` makes one (a
        SUM all-reduce of 0/1), all of a step's decisions in one collective. Where torch.distributed runs the
        strategy (DDP, FSDP, DeepSpeed) it is a `RankVotes` all-reduce on the CPU (the strategy's `reduce` puts
        a barrier before it, which costs 3x and adds nothing, and on NCCL it would sync the GPU each step)."""
        if self.world_size <= 1:
            return super().agree(decisions, reduce)
        check_reduce(reduce)
        import torch

        votes = self._rank_votes()
        if votes is not None:
            counts = votes.sum(decisions)
        else:
            strategy = self.trainer.strategy
            values = torch.tensor([int(bool(decision)) for decision in decisions], device=strategy.root_device)
            counts = strategy.reduce(values, reduce_op="sum").tolist()
        need = 1 if reduce == "any" else self.world_size
        return [count >= need for count in counts]

    def _rank_votes(self) -> RankVotes | None:
        """The fit's `RankVotes` where torch.distributed runs the strategy, made at the first agreement; None where
        it does not, or where its group is not gloo (NCCL) and no fit runs here to own the gloo group it would
        make (a session agreeing outside a fit: the strategy's `reduce` agrees then, and nothing is left behind)."""
        votes = self._votes
        if votes is None:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                return None
            if cpu_backend(str(dist.get_backend())) == "gloo":
                votes = RankVotes()
            elif current_run() is not None:  # (every rank decides alike: each runs its fit's hooks)
                votes = RankVotes(dist.new_group(backend="gloo", timeout=getattr(self.trainer.strategy, "_timeout",
                                                                                 None)))
                on_fit_end(("agreement group", id(votes)), self._drop_votes, votes)
            else:
                return None
            self._votes = votes
        return votes

    def _drop_votes(self, votes: RankVotes) -> None:
        """The fit ended: destroy the gloo group made for its agreements (a later one, outside a fit, agrees
        through the strategy)."""
        import torch.distributed as dist

        if self._votes is votes:
            self._votes = None
        dist.destroy_process_group(votes.group)

    def find_step_counter(self) -> None:
        """Training starts: find the counter behind `trainer.global_step` (see `optimizer_step_counter`)."""
        self._counter = optimizer_step_counter(self.trainer, self.model)

    @property
    def global_step(self) -> int:
        """`trainer.global_step`, read once at each batch boundary (it is a chain of Lightning properties
        that every hook would otherwise walk on every step); live outside of a step."""
        return self.trainer.global_step if self._step is None else self._step

    def refresh_step(self) -> int:
        counter = self._counter
        self._step = self.trainer.global_step if counter is None else counter.completed
        return self._step

    def unpin_step(self) -> None:
        """Outside a fit's batches the global step is read live again (and the next batch reads it afresh)."""
        self._step = None

    def batch_start_step(self) -> int:
        """The global step as a batch starts: the value read at the previous batch's end (nothing between a
        batch's end and the next one's start steps an optimizer, validation included), else a fresh read."""
        step = self._step
        return self.refresh_step() if step is None else step


class RankVotes:
    """The ranks' 0/1 votes summed: an all-reduce of a CPU tensor on a gloo group, into a buffer kept for each
    number of votes, so that a step's agreement allocates nothing and never touches a GPU.

    Args:
        group: the gloo group: None, the default one (where it runs gloo for CPU tensors); otherwise (NCCL) one
            of all ranks that `LightningSession` makes at the fit's first agreement (the same step on every
            rank, with the strategy's timeout) and destroys when that fit ends.
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self._buffers: dict[int, tuple[Any, Any]] = {}  # by length: (the tensor, a numpy view of it)

    def sum(self, votes: Sequence[bool]) -> list[int]:
        """How many ranks voted True, for each of `votes` (every rank calls this with as many votes)."""
        import torch

        buffer = self._buffers.get(len(votes))
        if buffer is None:
            tensor = torch.zeros(len(votes), dtype=torch.int32)
            buffer = self._buffers[len(votes)] = (tensor, tensor.numpy())
        tensor, counts = buffer
        counts[:] = [bool(vote) for vote in votes]
        torch.distributed.all_reduce(tensor, group=self.group)  # (SUM)
        return counts.tolist()


def cpu_backend(backend: str) -> str:
    """The backend a process group runs CPU tensors on, from torch's name for its backend: `"gloo"`, `"nccl"`,
    or per device, `"cpu:gloo,cuda:nccl"`."""
    if ":" not in backend:
        return backend
    devices = dict(item.split(":", 1) for item in backend.split(","))
    return devices.get("cpu", "")


def optimizer_step_counter(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
    """The progress record whose `completed` is `trainer.global_step`, or None.

    Lightning derives the global step from it through five properties on every read: about 1 us hot, several
    inside a fit, the largest part of an idle hook's cost. The record is made with the trainer's loops and
    updated in place (resets and checkpoint loads included), so it is found once per fit. None, and reads go
    through `trainer.global_step`, when this Lightning lays its loops out otherwise or the two disagree.
    """
    try:
        loop = trainer.fit_loop.epoch_loop
        if pl_module.automatic_optimization:
            counter = loop.automatic_optimization.optim_progress.optimizer.step.total
        else:
            counter = loop.manual_optimization.optim_step_progress.total
        if type(counter.completed) is int and counter.completed == trainer.global_step:
            return counter
    except AttributeError:
        pass
    return None


def _outputs(outputs: Any) -> dict[str, Any]:
    """training_step's return as a dict: a bare loss becomes `{"loss": loss}`."""
    if outputs is None:
        return {}
    if isinstance(outputs, dict):
        return outputs
    return {"loss": outputs}


def run_dir(trainer: pl.Trainer) -> str:
    """Where a run's files belong: the logger's run directory, else the trainer's root directory."""
    return trainer.log_dir or trainer.default_root_dir


class LoggerSink:
    """Lightning's `TensorBoardLogger` as an event stream: its `experiment` (a SummaryWriter) exists only when
    first used, and only on rank 0, so it is resolved at the first write; the logger owns and closes it. A
    failing disk costs hookprof's events, never the logger's writer (see `hookprof.tensorboard.events`)."""

    def __init__(self, logger: TensorBoardLogger) -> None:
        self._logger = logger
        self._sink: Any = None
        self._resolving = threading.Lock()  # the training thread and the background one may both write first

    def _resolve(self) -> Any:
        if self._sink is None:
            with self._resolving:
                if self._sink is None:
                    self._sink = as_event_sink(self._logger.experiment)
        return self._sink

    def add_event(self, event: Any) -> None:
        self._resolve().add_event(event)

    def flush(self) -> None:
        if self._sink is not None:
            self._sink.flush()

    def close(self) -> None:
        """Flush, and close the event file hookprof opened if the logger's writer failed (never the logger)."""
        if self._sink is not None:
            self._sink.close()

    def __reduce__(self) -> tuple:
        return LoggerSink, (self._logger,)  # (a lock does not pickle: ddp_spawn sends callbacks to its ranks)

    def __deepcopy__(self, memo: dict) -> LoggerSink:
        return LoggerSink(self._logger)  # a copy writes through the same logger, never a copy of it


def event_sink(writer: Any) -> Any:
    """A `summary_writer` as hookprof's hooks take it: Lightning's TensorBoardLogger becomes a `LoggerSink`."""
    return LoggerSink(writer) if isinstance(writer, TensorBoardLogger) else writer


class HookCallback(Callback):
    """Runs any `hookprof.SessionRunHook`s in a Lightning fit, in list order, with TF1's semantics.

    Args:
        hooks: the hooks to run, e.g. a TF1 hook ported by changing its imports to `hookprof`.
        name: a word that tells this callback apart from another one with the same hooks on the same schedule
            in one Trainer (two `ProfilerHook(save_steps=100)` writing to two directories): each keeps its own
            state in a checkpoint under its `state_key`, which is the class, the schedule and this name, e.g.
            `ProfilerHook(save_steps=100, name=fast)`. Two hookprof callbacks with one key fail before training.

    Example::

        class StopAtLoss(hookprof.SessionRunHook):
            def before_run(self, run_context):
                return hookprof.SessionRunArgs(fetches="loss")
            def after_run(self, run_context, run_values):
                if run_values.results < 0.1:
                    run_context.request_stop()

        trainer = Trainer(callbacks=[HookCallback(hooks=[StopAtLoss()])])
    """

    def __init__(self, hooks: Sequence[SessionRunHook], *, name: str | None = None) -> None:
        self._hooks = check_hooks(hooks)
        self.name = check_name(type(self).__name__, name)
        # the key an earlier hookprof saved this callback's state under, as it was computed (see `_previous_key`)
        self._previous_key = _previous_key(self)
        # The fit's driver, on the fit's first hookprof callback only (None on the others, which return at once)
        self._driver: HookedSession | None = None
        self._session: LightningSession | None = None
        self._open_at: int | None = None  # global step when the open TF step began (None: no step open)
        self._batch_running = False  # a batch started and has not ended

    @property
    def hooks(self) -> list[SessionRunHook]:
        return self._hooks

    @functools.cached_property
    def state_key(self) -> str:
        """Where a checkpoint keeps this callback's state: the class, its hooks' schedules and `name`, e.g.
        `ProfilerHook(save_steps=100)` or `HookCallback(StopAtLoss, ProfilerHook(save_steps=100), name=a)`.
        Short, without quotes or paths, the same in every process, directory and hookprof version."""
        # Lightning reads this on every hook call of every callback (to name its profiler span): computed
        # once, at its first use; cached_property stores it as a plain attribute, so later reads cost no call
        return self._identity(self.name)

    def _identity(self, name: str | None) -> str:
        return callback_identity(type(self).__name__, [(type(h).__name__, schedule(h)) for h in self.hooks],
                                 self._identity_settings(), name)

    def _identity_settings(self) -> dict[str, Any]:
        """What else tells two callbacks of this class and schedule apart (a subclass's choice of what to write)."""
        return {}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        fit_begins(self)
        members = [callback for callback in trainer.callbacks if isinstance(callback, HookCallback)]
        if members[0] is not self:
            self._driver = None  # the first one drives this fit's hooks, ours included
            return
        self._driver = None
        check_unique_keys(members)
        if trainer.fast_dev_run:
            # Lightning's smoke test writes no logs and no checkpoints and runs no early stopping: no hookprof
            # callback runs either (no timeline, summary, checkpoint or stop of a run that is not one)
            log.info("fast_dev_run: hookprof's callbacks do nothing in this fit (%s).",
                     ", ".join(member.state_key for member in members))
            return
        from hookprof.tracing.torch_tracer import TorchTracer

        hooks = [hook for member in members for hook in member.hooks]
        self._session = LightningSession(trainer, pl_module)
        tracer_factory: Any = functools.partial(TorchTracer, pl_module)
        if isinstance(trainer.profiler, PyTorchProfiler):
            # Lightning's profiler starts torch's own whenever its schedule says, also inside a step hookprof
            # traces, and a second start raises out of the user's training step: hookprof leaves torch's
            # profiler to it and traces the steps' phases only
            log.warning("Trainer(profiler=%s) holds torch's profiler in this fit: hookprof's timelines show each "
                        "traced step's phases (data wait, forward, backward, optimizer) but not its ops. Drop one "
                        "of the two profilers to have hookprof's ops.", type(trainer.profiler).__name__)
            tracer_factory = HostTracer
        self._driver = HookedSession(hooks, tracer_factory=tracer_factory)
        if any(hasattr(hook, "set_default_output_dir") for hook in hooks):
            default_dir = run_dir(trainer)
            for hook in hooks:
                if hasattr(hook, "set_default_output_dir"):
                    hook.set_default_output_dir(default_dir)
            logger = trainer.logger
            if trainer.global_rank == 0 and isinstance(logger, TensorBoardLogger) and logger.log_dir == default_dir:
                # one event stream per run directory: the hooks write into Lightning's own event file
                use_for(default_dir, LoggerSink(logger))
        self._driver.begin()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._driver is None:
            return
        self._open_at = None
        self._batch_running = False
        self._session.unpin_step()
        self._session.find_step_counter()
        self._driver.after_create_session(self._session)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._driver is None:
            return
        if self._batch_running:  # the previous batch never ended (skipped with -1): abort its step
            self._abort()
        self._batch_running = True
        if self._open_at is not None:  # inside a gradient-accumulation window: the TF step is already open
            self._driver.micro_batch()
            return
        step = self._open_at = self._session.batch_start_step()
        key = (id(trainer), step, batch_idx)
        self._driver.before_run(self._session, key,
                                lambda: SessionRunArgs(feed_dict={"batch": batch, "batch_idx": batch_idx}))

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        if self._driver is not None:
            self._driver.mark("backward")

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._driver is not None:
            self._driver.mark("after_backward")

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._driver is not None:
            self._driver.mark("optimizer")

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._driver is None:
            return
        self._batch_running = False
        if self._open_at is None:
            return
        step = self._session.refresh_step()
        if step != self._open_at:
            self._close(trainer, pl_module, outputs, batch, batch_idx, step)
        else:  # a micro-batch whose optimizer step has not come yet: the next micro-batch's data loads now
            self._driver.mark(DATA_WAIT)

    def _close(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
               batch_idx: int, step: int) -> None:
        session = self._session
        if self._open_at is not None and step > self._open_at:
            # what one step advances `trainer.global_step` by (2 for a manual step of two optimizers): the
            # schedules judge the next step by it (TF's steps_per_run)
            session.steps_per_run = step - self._open_at
        self._open_at = None
        stop = self._driver.after_run(
            lambda: StepState(step, _outputs(outputs), batch, batch_idx, pl_module, trainer.callback_metrics, session)
        )
        if stop:
            trainer.should_stop = True

    def _abort(self) -> None:
        self._open_at = None
        self._batch_running = False
        self._driver.abort_step()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._driver is None:
            return
        if self._batch_running:
            self._abort()
        elif self._open_at is not None:  # the epoch ended inside a window that never stepped the optimizer
            self._close(trainer, pl_module, None, None, None, self._session.refresh_step())

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._driver is not None and self._open_at is not None:
            self._driver.mark(VALIDATION)  # inside an accumulation window: its own span, not the step's work

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._driver is None:
            return
        if self._open_at is not None:
            self._driver.mark(DATA_WAIT)
        self._driver.restart_data_clock()  # validation time is not the next step's data wait

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._driver is None:
            return
        if self._batch_running or self._open_at is not None:
            self._abort()
        self._session.unpin_step()
        try:
            self._driver.end(self._session)
        finally:
            self._leave()

    def _leave(self) -> None:
        """The fit is over: let go of its trainer and model (a callback kept for its `saved_paths` holds neither).
        Under `ddp_spawn` the fit ran in copies of the callbacks: rank 0's send their hooks' properties to the
        callbacks the user holds in the process that started the ranks."""
        session = self._session
        self._driver = self._session = None
        if session is not None and session.rank == 0:
            for member in session.trainer.callbacks:
                if isinstance(member, HookCallback):
                    send_home(member)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._driver is None:
            return
        self._abort()
        try:
            self._driver.close()  # no end() (TF's rule), but files and writers are closed
        finally:
            self._leave()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"hooks": [h.state_dict() if hasattr(h, "state_dict") else None for h in self.hooks]}

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        # Lightning calls this before it loads each callback's state: a state an earlier hookprof saved under
        # its long key moves to `state_key`, where `load_state_dict` receives it
        states = checkpoint.get("callbacks")
        if isinstance(states, dict) and self.state_key not in states:
            members = [callback for callback in trainer.callbacks if isinstance(callback, HookCallback)]
            adopt_previous_state(self, members, states)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        states = state_dict.get("hooks") if isinstance(state_dict, dict) else None
        if not isinstance(states, list) or len(states) != len(self.hooks):
            log.warning("%s ignores its state in the checkpoint (%s): not one it writes (a list of %d hooks' "
                         "states under 'hooks'); its hooks schedule as a run resumed without one.",
                         self.state_key, reprlib.repr(state_dict), len(self.hooks))
            return
        for hook, state in zip(self.hooks, states):
            if state is not None and hasattr(hook, "load_state_dict"):
                hook.load_state_dict(state)


def callback_identity(kind: str, hooks: list[tuple[str, dict[str, Any]]], settings: dict[str, Any],
                      name: str | None) -> str:
    """A callback's `state_key` from its class name, its hooks' class names and schedules, its other settings
    and its `name`: a callback around one hook of its own class name gives that hook's schedule
    (`ProfilerHook(save_steps=100)`), any other names its hooks (`HookCallback(StopAtLoss, ProfilerHook(...))`)."""
    if len(hooks) == 1 and hooks[0][0] == kind:
        items: list[tuple[str | None, Any]] = list(hooks[0][1].items())
    else:
        items = [(None, identity(hook_kind, hook_schedule)) for hook_kind, hook_schedule in hooks]
    return identity(kind, [*items, *settings.items(), ("name", name)])


def check_unique_keys(members: list[HookCallback]) -> None:
    """Two callbacks of one key would share one state in a checkpoint (Lightning refuses them when the Trainer is
    made; this catches those it does not check: `configure_callbacks`, a list extended later)."""
    seen: dict[str, HookCallback] = {}
    for member in members:
        first = seen.setdefault(member.state_key, member)
        if first is not member:
            kind = type(member).__name__
            raise ValueError(
                f"Two hookprof callbacks in this Trainer have the checkpoint key `{member.state_key}` (their class "
                f"and schedule), so a checkpoint would keep one state for both: give each its own `name=`, e.g. "
                f"{kind}(..., name=\"first\") and {kind}(..., name=\"second\").")


# --- the keys hookprof wrote before these, kept only to restore the checkpoints saved under them ---------------

_PLAIN = (int, float, str, bool, type(None), frozenset)
_COUNTERS = ("dropped_outputs", "summary_errors", "skipped_traces", "removed_timelines", "fired")  # change as it runs
_PARSE_ERRORS = (ValueError, TypeError, SyntaxError, AttributeError, KeyError, MemoryError, RecursionError)


def _previous_key(callback: HookCallback) -> str | None:
    """The key an earlier hookprof saved `callback`'s state under, computed as it was: the class, then the repr
    of each hook's fields, private ones included, and of the callback's other settings. It named absolute paths
    and hookprof's own source lines, so it is found only from the directory and version that wrote it;
    `adopt_previous_state` also finds a state by its class and schedule. None where it cannot be computed (it
    only ever serves to find an old state)."""
    try:
        return callback._generate_state_key(hooks=[_hook_key(h) for h in callback.hooks],
                                            **callback._identity_settings())
    except Exception:
        return None


def _setting(value: Any) -> Any:
    """A setting as the previous key held it: plain values as they are, a function or lambda by where it is
    defined and what it does (`module.qualname@file:line#digest of its code and constants`), nested lists and
    dicts item by item; None for anything else (a writer, a model)."""
    if isinstance(value, _PLAIN):
        return value
    code = getattr(value, "__code__", None)
    if code is not None:
        digest = hashlib.sha1(code.co_code + repr(code.co_consts).encode()).hexdigest()[:8]
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}@" \
               f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}#{digest}"
    settings = getattr(value, "settings", None)  # a hookprof trigger: its class and arguments
    if callable(settings) and getattr(type(value), "__module__", "").startswith("hookprof"):
        return type(value).__qualname__, _setting(settings())
    if isinstance(value, (list, tuple)):
        return tuple(_setting(item) for item in value)
    if isinstance(value, dict):
        return tuple(sorted((str(key), _setting(item)) for key, item in value.items()))
    return None


def _hook_key(hook: SessionRunHook) -> str:
    """A hook in the previous key: its class and its fields as the hook holds them when made."""
    settings = sorted((name, setting) for name, value in vars(hook).items()
                      if name not in _COUNTERS and (setting := _setting(value)) is not None)
    return f"{type(hook).__qualname__}{settings}"


def _parse_previous_key(key: Any) -> tuple[str, list[tuple[str, dict[str, Any]]], dict[str, Any]] | None:
    """What `callback_identity` needs of a key `_previous_key` wrote: the callback's class name, each hook's class
    name and schedule, the other settings; None for any other key."""
    if not isinstance(key, str) or "{'hooks': [" not in key:
        return None
    kind, brace, rest = key.partition("{")
    try:
        settings = ast.literal_eval(brace + rest)
        hooks = [_parse_hook_key(text) for text in settings.pop("hooks")]
    except _PARSE_ERRORS:
        return None
    return kind.rsplit(".", 1)[-1], hooks, settings


def _parse_hook_key(text: str) -> tuple[str, dict[str, Any]]:
    kind, bracket, rest = text.partition("[")
    values = {}
    for field in ast.parse(bracket + rest, mode="eval").body.elts:  # [(name, setting), ...]
        name, value = field.elts
        try:
            values[ast.literal_eval(name)] = ast.literal_eval(value)
        except ValueError:  # a frozenset, a nan: never a schedule
            pass
    return kind.rsplit(".", 1)[-1], {name: values[name] for name in SCHEDULE_ATTRIBUTES
                                     if values.get(name) is not None}


def adopt_previous_state(callback: HookCallback, members: list[HookCallback], states: dict[Any, Any]) -> None:
    """Moves the state an earlier hookprof saved for `callback` to its `state_key`: the one under the previous
    key as computed now (same directory and version), else the one previous key of the callback's class and
    schedule, unless another callback of this fit with that class and schedule could be its owner (then none is
    restored, with one warning). Lightning has already warned about the previous key, which it does not know."""
    key = callback._previous_key
    if key not in states:
        mine = callback._identity(None)
        own = {member._previous_key for member in members}
        found = [other for other in states if other not in own and (parsed := _parse_previous_key(other)) is not None
                 and callback_identity(*parsed, None) == mine]
        if not found:
            return
        rivals = [member for member in members if member is not callback and member._identity(None) == mine
                  and member.state_key not in states and member._previous_key not in states]
        if len(found) > 1 or rivals:
            log.warning("%s: an earlier hookprof saved %d state(s) of this class and schedule in the checkpoint, "
                        "told apart by paths, and %d callback(s) of this fit could own them: which is whose is not "
                        "known, so none is restored and the schedule starts afresh (the next checkpoint keeps each "
                        "callback's state under its own key).", callback.state_key, len(found), len(rivals) + 1)
            return
        key = found[0]
    states[callback.state_key] = states.pop(key)
    log.info("%s: restored the state an earlier hookprof saved under a longer key (the one Lightning just warned "
             "about); checkpoints keep it under this key from now on.", callback.state_key)
