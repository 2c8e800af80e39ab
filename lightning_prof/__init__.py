"""hookprof for Lightning: TF1 session hooks as `lightning.pytorch` callbacks."""

from lightning_prof.hook_callback import HookCallback, LightningSession
from lightning_prof.profiler_hook import ProfilerHook
from lightning_prof.summary_saver_hook import SummarySaverHook

__all__ = ["HookCallback", "LightningSession", "ProfilerHook", "SummarySaverHook"]
