"""hookprof core: TF1's session hooks, timer, step stats, tracers and timeline writer, framework-neutral.

Imports neither lightning nor keras; torch only inside `core.tracing.torch_tracer`.
"""

from core.hooked_session import HookedSession, ManualSession, Session, StepState, step_feeds
from core import summary
from core.profiler_hook import ProfilerHook
from core.session_run_hook import (
    RunMetadata,
    RunOptions,
    SessionRunArgs,
    SessionRunContext,
    SessionRunHook,
    SessionRunValues,
    TraceLevel,
)
from core.step_stats import DeviceStepStats, NodeExecStats, StepStats, TensorDescription
from core.summary_saver_hook import SummarySaverHook
from core.timeline import ChromeTraceWriter
from core.timer import NeverTriggerTimer, SecondOrStepTimer

__version__ = "0.1.0"

__all__ = [
    "ChromeTraceWriter", "DeviceStepStats", "HookedSession", "ManualSession", "NeverTriggerTimer", "NodeExecStats",
    "ProfilerHook", "RunMetadata", "RunOptions", "SecondOrStepTimer", "Session", "SessionRunArgs",
    "SessionRunContext", "SessionRunHook", "SessionRunValues", "StepState", "StepStats", "SummarySaverHook",
    "TensorDescription", "TraceLevel", "step_feeds", "summary",
]
