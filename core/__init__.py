"""hookprof: TensorFlow 1's session hooks, timer, tracers, timelines and tfprof Profiler, framework-neutral.

The `lightning_prof` and `keras_prof` packages turn these hooks into Lightning and Keras callbacks. This
package imports neither lightning nor keras, and torch only inside `hookprof.tracing.torch_tracer`.

    hooks/        the TF contract, the per-fit driver, timers and the TF hooks
    tracing/      tracers that record one step, and the one-trace-per-step coordinator
    trace/        the Chrome Trace Event files: writer, reader, merge, one-line summaries
    tensorboard/  event streams, summaries, step graphs
    profiler/     the multi-step Profiler (tfprof): views, options, advice, saved profiles
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hookprof._runtime.lazy import lazy_names

if TYPE_CHECKING:  # (type checkers read the names here; at run time each is imported where first used)
    from hookprof import summary
    from hookprof.hooks import (
        CaptureOptions,
        CheckpointSaverHook,
        CheckpointSaverListener,
        FeedFnHook,
        FinalOpsHook,
        GlobalStepWaiterHook,
        HookedSession,
        LoggingTensorHook,
        ManualSession,
        NanLossDuringTrainingError,
        NanTensorHook,
        NeverTriggerTimer,
        ProfilerHook,
        RunMetadata,
        RunOptions,
        SecondOrStepTimer,
        Session,
        SessionRunArgs,
        SessionRunContext,
        SessionRunHook,
        SessionRunValues,
        StepCounterHook,
        StepState,
        StopAtStepHook,
        SummarySaverHook,
        TraceLevel,
        latest_checkpoint,
        list_variables,
        load_variable,
        step_feeds,
    )
    from hookprof.profiler import ProfileOptionBuilder, Profiler
    from hookprof.step_stats import DeviceStepStats, NodeExecStats, StepStats, TensorDescription
    from hookprof.trace import ChromeTraceWriter
else:
    __getattr__, __dir__ = lazy_names(globals(), {
        "hookprof": ("summary",),
        "hookprof.hooks": ("CaptureOptions", "CheckpointSaverHook", "CheckpointSaverListener", "FeedFnHook",
            "FinalOpsHook", "GlobalStepWaiterHook", "HookedSession", "LoggingTensorHook", "ManualSession",
            "NanLossDuringTrainingError", "NanTensorHook", "NeverTriggerTimer", "ProfilerHook", "RunMetadata",
            "RunOptions", "SecondOrStepTimer", "Session", "SessionRunArgs", "SessionRunContext", "SessionRunHook",
            "SessionRunValues", "StepCounterHook", "StepState", "StopAtStepHook", "SummarySaverHook", "TraceLevel",
            "latest_checkpoint", "list_variables", "load_variable", "step_feeds"),
        "hookprof.profiler": ("ProfileOptionBuilder", "Profiler"),
        "hookprof.step_stats": ("DeviceStepStats", "NodeExecStats", "StepStats", "TensorDescription"),
        "hookprof.trace": ("ChromeTraceWriter",),
    })

__version__ = "0.1.0"  # said once: pyproject.toml reads it from here (`dynamic`)

__all__ = [
    "CaptureOptions", "CheckpointSaverHook", "CheckpointSaverListener", "ChromeTraceWriter", "DeviceStepStats",
    "FeedFnHook", "FinalOpsHook", "GlobalStepWaiterHook", "HookedSession", "latest_checkpoint", "list_variables",
    "load_variable", "LoggingTensorHook",
    "ManualSession", "NanLossDuringTrainingError", "NanTensorHook", "NeverTriggerTimer", "NodeExecStats",
    "ProfileOptionBuilder", "Profiler", "ProfilerHook", "RunMetadata", "RunOptions", "SecondOrStepTimer", "Session",
    "SessionRunArgs", "SessionRunContext", "SessionRunHook", "SessionRunValues", "step_feeds", "StepCounterHook",
    "StepState", "StepStats", "StopAtStepHook", "summary", "SummarySaverHook", "TensorDescription", "TraceLevel",
]
