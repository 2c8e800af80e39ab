"""hookprof for Keras 3: TF1's session hooks as `keras.callbacks.Callback`s (op-level traces on the torch and
JAX backends).

A Keras user imports everything from here: the callbacks (`keras_prof.callbacks`), `HookCallback` for hooks of
one's own, and hookprof's hook contract, summaries and Profiler (`hookprof.adapter_exports`: the same objects as
in `hookprof`).
"""

from hookprof import adapter_exports
from hookprof.adapter_exports import *  # noqa: F403
from keras_prof import callbacks
from keras_prof.callbacks import *  # noqa: F403
from keras_prof.hook_callback import HookCallback, KerasSession

__all__ = ["HookCallback", "KerasSession"]
__all__ += adapter_exports.__all__
__all__ += callbacks.__all__
