"""hookprof for Lightning: TF1's session hooks as `lightning.pytorch` callbacks.

A Lightning user imports everything from here: the callbacks (`lightning_prof.callbacks`), `HookCallback` for
hooks of one's own, and hookprof's hook contract, summaries and Profiler (`hookprof.adapter_exports`: the same
objects as in `hookprof`).
"""

from hookprof import adapter_exports
from hookprof.adapter_exports import *  # noqa: F403
from lightning_prof import callbacks
from lightning_prof.callbacks import *  # noqa: F403
from lightning_prof.hook_callback import HookCallback, LightningSession

__all__ = ["HookCallback", "LightningSession"]
__all__ += adapter_exports.__all__
__all__ += callbacks.__all__
