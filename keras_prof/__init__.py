"""hookprof for Keras 3: TF1 session hooks as `keras.callbacks.Callback`s (best with KERAS_BACKEND=torch)."""

from keras_prof.hook_callback import HookCallback, KerasSession
from keras_prof.profiler_hook import ProfilerHook
from keras_prof.summary_saver_hook import SummarySaverHook

__all__ = ["HookCallback", "KerasSession", "ProfilerHook", "SummarySaverHook"]
