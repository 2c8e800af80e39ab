"""The TF1 hook contract (`SessionRunHook` and its value types), the per-fit driver (`HookedSession`), the
shared `SecondOrStepTimer`, and the hooks themselves (with `CaptureOptions`, ProfilerHook's `capture=`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hookprof._runtime.lazy import lazy_names

if TYPE_CHECKING:  # (type checkers read the names here; at run time each is imported where first used)
    from hookprof.hooks.capture import CaptureOptions
    from hookprof.hooks.checkpoint_saver_hook import (
        CheckpointSaverHook,
        CheckpointSaverListener,
        latest_checkpoint,
        list_variables,
        load_variable,
    )
    from hookprof.hooks.feed_fn_hook import FeedFnHook
    from hookprof.hooks.final_ops_hook import FinalOpsHook
    from hookprof.hooks.global_step_waiter_hook import GlobalStepWaiterHook
    from hookprof.hooks.hooked_session import HookedSession, step_feeds
    from hookprof.hooks.logging_tensor_hook import LoggingTensorHook
    from hookprof.hooks.nan_tensor_hook import NanLossDuringTrainingError, NanTensorHook
    from hookprof.hooks.profiler_hook import ProfilerHook
    from hookprof.hooks.session import ManualSession, Session, StepState
    from hookprof.hooks.session_run_hook import SessionRunArgs, SessionRunContext, SessionRunHook, SessionRunValues
    from hookprof.hooks.step_counter_hook import StepCounterHook
    from hookprof.hooks.stop_at_step_hook import StopAtStepHook
    from hookprof.hooks.summary_saver_hook import SummarySaverHook
    from hookprof.hooks.timer import NeverTriggerTimer, SecondOrStepTimer
    from hookprof.run_options import RunMetadata, RunOptions, TraceLevel
else:
    __getattr__, __dir__ = lazy_names(globals(), {
        "hookprof.hooks.capture": ("CaptureOptions",),
        "hookprof.hooks.checkpoint_saver_hook": ("CheckpointSaverHook", "CheckpointSaverListener",
            "latest_checkpoint", "list_variables", "load_variable"),
        "hookprof.hooks.feed_fn_hook": ("FeedFnHook",),
        "hookprof.hooks.final_ops_hook": ("FinalOpsHook",),
        "hookprof.hooks.global_step_waiter_hook": ("GlobalStepWaiterHook",),
        "hookprof.hooks.hooked_session": ("HookedSession", "step_feeds"),
        "hookprof.hooks.logging_tensor_hook": ("LoggingTensorHook",),
        "hookprof.hooks.nan_tensor_hook": ("NanLossDuringTrainingError", "NanTensorHook"),
        "hookprof.hooks.profiler_hook": ("ProfilerHook",),
        "hookprof.hooks.session": ("ManualSession", "Session", "StepState"),
        "hookprof.hooks.session_run_hook": ("SessionRunArgs", "SessionRunContext", "SessionRunHook",
            "SessionRunValues"),
        "hookprof.hooks.step_counter_hook": ("StepCounterHook",),
        "hookprof.hooks.stop_at_step_hook": ("StopAtStepHook",),
        "hookprof.hooks.summary_saver_hook": ("SummarySaverHook",),
        "hookprof.hooks.timer": ("NeverTriggerTimer", "SecondOrStepTimer"),
        "hookprof.run_options": ("RunMetadata", "RunOptions", "TraceLevel"),
    })

__all__ = [
    "CaptureOptions", "CheckpointSaverHook", "CheckpointSaverListener", "FeedFnHook", "FinalOpsHook",
    "GlobalStepWaiterHook", "HookedSession", "latest_checkpoint", "list_variables", "load_variable",
    "LoggingTensorHook", "ManualSession",
    "NanLossDuringTrainingError", "NanTensorHook", "NeverTriggerTimer", "ProfilerHook", "RunMetadata", "RunOptions",
    "SecondOrStepTimer", "Session", "SessionRunArgs", "SessionRunContext", "SessionRunHook", "SessionRunValues",
    "step_feeds", "StepCounterHook", "StepState", "StopAtStepHook", "SummarySaverHook", "TraceLevel",
]
