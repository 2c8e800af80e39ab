# Written by `python -m hookprof.hooks.adapter keras_prof.callbacks` from hookprof's hook signatures: do not edit.
# (tests/test_adapters.py fails when it is stale.)

import collections
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import hookprof.hooks.checkpoint_saver_hook
import hookprof.hooks.feed_fn_hook
import hookprof.hooks.final_ops_hook
import hookprof.hooks.global_step_waiter_hook
import hookprof.hooks.logging_tensor_hook
import hookprof.hooks.nan_tensor_hook
import hookprof.hooks.profiler_hook
import hookprof.hooks.step_counter_hook
import hookprof.hooks.stop_at_step_hook
import hookprof.hooks.summary_saver_hook
from hookprof.hooks.capture import CaptureOptions
from hookprof.hooks.checkpoint_saver_hook import CheckpointSaverListener
from hookprof.profiler.profiler import Profiler
from hookprof.summary import Scaffold
from hookprof.triggers import Trigger
from keras_prof.hook_callback import HookCallback

class CheckpointSaverHook(HookCallback):
    hook: hookprof.hooks.checkpoint_saver_hook.CheckpointSaverHook
    def __init__(
        self,
        checkpoint_dir: str | os.PathLike,
        save_secs: float | None = ...,
        save_steps: int | None = ...,
        saver: Any = ...,
        checkpoint_basename: str = ...,
        scaffold: Any = ...,
        listeners: Sequence[CheckpointSaverListener] | None = ...,
        strict: bool = ...,
    ) -> None: ...
    listeners: Final[list[CheckpointSaverListener]]
    save_path: Final[str]
    saved_paths: Final[list[str]]

class FeedFnHook(HookCallback):
    hook: hookprof.hooks.feed_fn_hook.FeedFnHook
    def __init__(self, feed_fn: Callable[[], Mapping[Any, Any]]) -> None: ...

class FinalOpsHook(HookCallback):
    hook: hookprof.hooks.final_ops_hook.FinalOpsHook
    def __init__(self, final_ops: Any, final_ops_feed_dict: Mapping[str, Any] | None = ...) -> None: ...
    final_ops_values: Final[Any]

class GlobalStepWaiterHook(HookCallback):
    hook: hookprof.hooks.global_step_waiter_hook.GlobalStepWaiterHook
    def __init__(
        self,
        wait_until_step: int,
        global_step_fn: Callable[[], int] | None = ...,
        sleep: Callable[[float], Any] | None = ...,
    ) -> None: ...
    worker_is_started: Final[bool]

class LoggingTensorHook(HookCallback):
    hook: hookprof.hooks.logging_tensor_hook.LoggingTensorHook
    def __init__(
        self,
        tensors: Mapping[str, Any] | list[str] | tuple[str, ...],
        every_n_iter: int | None = ...,
        every_n_secs: float | None = ...,
        at_end: bool = ...,
        formatter: Callable[[dict[str, Any]], str] | None = ...,
    ) -> None: ...

class NanTensorHook(HookCallback):
    hook: hookprof.hooks.nan_tensor_hook.NanTensorHook
    def __init__(self, loss_tensor: Any, fail_on_nan_loss: bool = ...) -> None: ...

class ProfilerHook(HookCallback):
    hook: hookprof.hooks.profiler_hook.ProfilerHook
    def __init__(
        self,
        save_steps: int | None = ...,
        save_secs: float | None = ...,
        output_dir: str | os.PathLike | None = ...,
        show_dataflow: bool = ...,
        show_memory: bool = ...,
        compress: bool = ...,
        max_events: int | None = ...,
        tensorboard: bool = ...,
        profiler: Profiler | None = ...,
        with_stack: bool = ...,
        triggers: Sequence[Trigger] | None = ...,
        capture_steps: int = ...,
        cooldown_steps: int = ...,
        keep_last: int | None = ...,
        capture: CaptureOptions | None = ...,
    ) -> None: ...
    fired: Final[collections.Counter[str]]
    removed_timelines: Final[int]
    saved_paths: Final[list[str]]
    skipped_traces: Final[int]

class StepCounterHook(HookCallback):
    hook: hookprof.hooks.step_counter_hook.StepCounterHook
    def __init__(
        self,
        every_n_steps: int | None = ...,
        every_n_secs: float | None = ...,
        output_dir: str | os.PathLike | None = ...,
        summary_writer: Any = ...,
        batch_size: int | None = ...,
    ) -> None: ...

class StopAtStepHook(HookCallback):
    hook: hookprof.hooks.stop_at_step_hook.StopAtStepHook
    def __init__(self, num_steps: int | None = ..., last_step: int | None = ...) -> None: ...
    stop_at_step: Final[int | None]

class SummarySaverHook(HookCallback):
    hook: hookprof.hooks.summary_saver_hook.SummarySaverHook
    def __init__(
        self,
        save_steps: int | None = ...,
        save_secs: float | None = ...,
        output_dir: str | os.PathLike | None = ...,
        summary_writer: Any = ...,
        scaffold: Scaffold | None = ...,
        summary_op: Any = ...,
        strict: bool = ...,
    ) -> None: ...

def model_saver(session: Any) -> Callable[[str], str | None]: ...

__all__ = [
    "CheckpointSaverHook",
    "FeedFnHook",
    "FinalOpsHook",
    "GlobalStepWaiterHook",
    "LoggingTensorHook",
    "NanTensorHook",
    "ProfilerHook",
    "StepCounterHook",
    "StopAtStepHook",
    "SummarySaverHook",
    "model_saver",
]
