"""What hooks see of the training loop: `Session` (TF's `run_context.session`), `StepState` (a finished step)
and how fetches are evaluated against it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hookprof._runtime.arguments import check_fetches as check_fetches


class Session:
    """What `run_context.session` is: a view of the training loop for hooks (TF's `tf.Session`).

    The adapters subclass it: `lightning_prof` exposes `trainer` and `model` (the LightningModule), `keras_prof`
    exposes `model` (the keras Model). `run(fetches)` evaluates fetch items against the last finished step.
    """

    framework = "unknown"
    distributed_backend: str | None = None  # e.g. "gloo" or "nccl" when training is distributed
    # How many global steps one step (one before_run/after_run) advances, TF's `steps_per_run`: Keras'
    # `steps_per_execution`; 2 for a Lightning step that runs two optimizers. Schedules judge the step a run
    # will reach as `global_step + steps_per_run`; the adapters set it.
    steps_per_run = 1
    # The layout of image batches in this framework ("NHWC", "NCHW"), where it has one (Keras:
    # `image_data_format()`, channels_last by default, also on its torch backend); None: guess by array type.
    image_format: str | None = None
    # Whether the ranks of this fit make the hooks' decisions together (`hookprof.hooks.agreement.Ballot`): set
    # by the driver before the hooks' `after_create_session`. Then a hook that `votes` acts on what `agreed`
    # says, never on what its own rank sees alone; False in one process.
    agreeing = False
    # Why values fed into a step (`SessionRunArgs(feed_dict=...)`) would not reach it, and the fix, as the words
    # after a hook's name ("feeds each step ..., but ..."); None where they do. Keras with a compiled train step
    # sets it: a hook that feeds then fails at the first step it does, instead of feeding nothing silently.
    feeds_unread: str | None = None
    # The global step the fit is planned to end at, as the framework estimates it (Lightning's `max_steps` or its
    # estimate from epochs and batches, Keras' epochs times batches); None where unknown. `ProfilerHook` starts
    # its render worker at a run's first step where its next timeline falls before it.
    final_step: int | None = None

    def __init__(self, model: Any = None, rank: int = 0, world_size: int = 1) -> None:
        self.model = model
        self.rank = rank
        self.world_size = world_size
        self._last_step: StepState | Callable[[], StepState] | None = None

    @property
    def last_step(self) -> StepState | None:
        """The last finished step's state, built on first use (most steps never need it)."""
        last = self._last_step
        if last is not None and not isinstance(last, StepState):
            last = self._last_step = last()
        return last

    @last_step.setter
    def last_step(self, value: StepState | Callable[[], StepState] | None) -> None:
        self._last_step = value

    @property
    def global_step(self) -> int:
        """The number of optimizer steps taken so far (TF's global step)."""
        raise NotImplementedError

    def agree(self, decisions: Sequence[bool], reduce: str = "any") -> list[bool]:
        """`decisions` made together by every rank of a distributed fit, in one collective: each True when any
        rank's is (`reduce="any"`) or when every rank's is (`"all"`). The same list on every rank, so every rank
        must call it at the same point of the same step. In one process (Keras, a single-device Lightning fit)
        it is `decisions` as they are; the Lightning adapter agrees through the trainer's strategy."""
        check_reduce(reduce)
        return [bool(decision) for decision in decisions]

    def run(self, fetches: Any) -> Any:
        """Evaluate `fetches` (names or callables, nested) on the last finished step, like `session.run`."""
        if self.last_step is None:
            raise RuntimeError("session.run(fetches) needs a finished step: call it from after_run or later.")
        return evaluate_fetches(fetches, self.last_step)


REDUCES = ("any", "all")


def check_reduce(reduce: str) -> None:
    if reduce not in REDUCES:
        raise ValueError(f"agree(reduce={reduce!r}): `reduce` is 'any' (True when any rank's decision is) or 'all'.")


class ManualSession(Session):
    """A Session for training loops you write yourself: set `global_step` as your loop advances.

        session = ManualSession(model)
        driver = HookedSession([ProfilerHook(save_steps=100)], tracer_factory=lambda: TorchTracer(model))
        driver.begin(); driver.after_create_session(session)
        for batch in loader:
            driver.before_run(session, session.global_step, SessionRunArgs())
            loss = step(batch); session.global_step += 1
            if driver.after_run(lambda: StepState(session.global_step, {"loss": loss}, batch)):
                break
        driver.end(session)

    A loop of several ranks passes `rank`, `world_size` and `agree`: a callable `agree(decisions, reduce)` that
    reduces a list of bools over the ranks (`reduce` "any" or "all") and returns the list every rank gets,
    e.g. with torch.distributed: an all_reduce (SUM) of `torch.tensor(decisions, dtype=torch.int)`, then
    `count >= 1` for "any", `count == world_size` for "all". Without it each rank decides alone.
    """

    framework = "manual"

    def __init__(self, model: Any = None, global_step: int = 0, rank: int = 0, world_size: int = 1,
                 agree: Callable[[list[bool], str], Sequence[bool]] | None = None) -> None:
        super().__init__(model=model, rank=rank, world_size=world_size)
        self._global_step = global_step
        if agree is not None and not callable(agree):
            raise TypeError(f"`ManualSession(agree={agree!r})`: `agree` must be a callable agree(decisions, reduce) "
                            "that reduces a list of bools over the ranks, or None.")
        self._agree = agree

    def agree(self, decisions: Sequence[bool], reduce: str = "any") -> list[bool]:
        if self._agree is None:
            return super().agree(decisions, reduce)
        check_reduce(reduce)
        return [bool(decision) for decision in self._agree([bool(d) for d in decisions], reduce)]

    @property
    def global_step(self) -> int:
        return self._global_step

    @global_step.setter
    def global_step(self, value: int) -> None:
        self._global_step = value


class StepState:
    """A finished step as fetches and summaries see it: `step` (global step after it), `outputs` (what the
    step returned: `{'loss': ...}` or the step's dict; Keras: its logs), `batch`, `batch_idx`, `model`,
    `metrics` (logged metrics), `session`."""

    __slots__ = ("step", "outputs", "batch", "batch_idx", "model", "metrics", "session")

    def __init__(
        self,
        step: int,
        outputs: Mapping[str, Any] | None = None,
        batch: Any = None,
        batch_idx: int | None = None,
        model: Any = None,
        metrics: Mapping[str, Any] | None = None,
        session: Session | None = None,
    ) -> None:
        self.step = step
        self.outputs = outputs or {}
        self.batch = batch
        self.batch_idx = batch_idx
        self.model = model
        self.metrics = metrics or {}
        self.session = session

    def lookup(self, name: str) -> Any:
        """A step output or logged metric by name; `global_step` is the step number."""
        if name == "global_step":
            return self.step
        if name in self.outputs:
            return self.outputs[name]
        if name in self.metrics:
            return self.metrics[name]
        known = sorted({"global_step", *self.outputs, *self.metrics})
        raise KeyError(f"Fetch {name!r} is neither a step output nor a logged metric; this step has {known}.")


def evaluate_fetches(fetches: Any, state: StepState) -> Any:
    """Evaluate a nested structure of fetch items (names, callables of the StepState), keeping its shape."""
    if isinstance(fetches, str):
        return state.lookup(fetches)
    if callable(fetches):
        return fetches(state)
    if isinstance(fetches, Mapping):
        return {key: evaluate_fetches(value, state) for key, value in fetches.items()}
    if isinstance(fetches, (list, tuple)):
        values = [evaluate_fetches(value, state) for value in fetches]
        return type(fetches)(values) if not hasattr(fetches, "_fields") else type(fetches)(*values)
    raise TypeError(
        f"A fetch must be a name (str), a callable of the step state, or a dict/list/tuple of those; "
        f"got {type(fetches).__name__}."
    )


def steps_per_run(session: Any) -> int:
    """The global steps a step of `session` advances (1 for a session that does not say, or none yet)."""
    return getattr(session, "steps_per_run", 1)


def coming_step(session: Any, global_step: int) -> int:
    """The global step that a step of `session` starting at `global_step` reaches (TF's `global_step +
    steps_per_run`): what a schedule or a stop judges the coming step by. The hooks' `quiet_on` run it on every
    step: one attribute read inside (the call itself costs ~25 ns more than the read inline, measured 82 ns
    against 57)."""
    return global_step + getattr(session, "steps_per_run", 1)
