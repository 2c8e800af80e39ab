"""hookprof for Keras 3: TF1's session hooks as `keras.callbacks.Callback`s (op-level traces on the torch and
JAX backends).

A Keras user imports everything from here: the callbacks, and hookprof's hook contract, summaries and
Profiler (the same objects as in `hookprof`).
"""

from hookprof import (
    CheckpointSaverListener,
    ProfileOptionBuilder,
    Profiler,
    RunOptions,
    SessionRunArgs,
    SessionRunContext,
    SessionRunHook,
    SessionRunValues,
    StepState,
    TraceLevel,
    step_feeds,
    summary,
)
from keras_prof.checkpoint_saver_hook import CheckpointSaverHook
from keras_prof.feed_hooks import FeedFnHook, GlobalStepWaiterHook
from keras_prof.hook_callback import HookCallback, KerasSession
from keras_prof.logging_tensor_hook import LoggingTensorHook
from keras_prof.profiler_hook import ProfilerHook
from keras_prof.step_counter_hook import StepCounterHook
from keras_prof.stop_hooks import FinalOpsHook, NanLossDuringTrainingError, NanTensorHook, StopAtStepHook
from keras_prof.summary_saver_hook import SummarySaverHook

__all__ = [
    "CheckpointSaverHook", "CheckpointSaverListener", "FeedFnHook", "FinalOpsHook", "GlobalStepWaiterHook",
    "HookCallback", "KerasSession", "LoggingTensorHook", "NanLossDuringTrainingError", "NanTensorHook",
    "ProfileOptionBuilder", "Profiler", "ProfilerHook", "RunOptions", "SessionRunArgs", "SessionRunContext",
    "SessionRunHook", "SessionRunValues", "step_feeds", "StepCounterHook", "StepState", "StopAtStepHook",
    "summary", "SummarySaverHook", "TraceLevel",
]
