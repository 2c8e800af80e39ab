"""What `lightning_prof` and `keras_prof` re-export beside their callbacks: hookprof's hook contract, summaries and
Profiler (the same objects as in `hookprof`), so a user imports from one package. Each adapter's `__init__` does
`from hookprof.adapter_exports import *`."""

from hookprof import summary
from hookprof.hooks import (
    CheckpointSaverListener,
    NanLossDuringTrainingError,
    RunOptions,
    SessionRunArgs,
    SessionRunContext,
    SessionRunHook,
    SessionRunValues,
    StepState,
    TraceLevel,
    latest_checkpoint,
    step_feeds,
)
from hookprof.profiler import ProfileOptionBuilder, Profiler

__all__ = ["CheckpointSaverListener", "latest_checkpoint", "NanLossDuringTrainingError", "ProfileOptionBuilder",
           "Profiler", "RunOptions", "SessionRunArgs", "SessionRunContext", "SessionRunHook", "SessionRunValues",
           "step_feeds", "StepState", "summary", "TraceLevel"]
