"""`keras_prof.FeedFnHook` and `GlobalStepWaiterHook`: TF1's hooks as Keras callbacks (any backend)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hookprof.hooks.feed_fn_hook import FeedFnHook as CoreFeedFnHook
from hookprof.hooks.global_step_waiter_hook import GlobalStepWaiterHook as CoreGlobalStepWaiterHook
from keras_prof.hook_callback import HookCallback


class FeedFnHook(HookCallback):
    """Feeds `feed_fn()`'s values into every training step (TF1's FeedFnHook).

    Keras hands its batch callbacks no batch, so the values are read inside the step with
    `hookprof.step_feeds()` (e.g. in a custom `train_step`, or a layer's `call` during training); they are
    never put into the batch. Runs on every step, as TF's did.

    Example::

        model.fit(x, y, callbacks=[FeedFnHook(lambda: {"noise": schedule.next()})])
        # in train_step: noise = hookprof.step_feeds()["noise"]
    """

    def __init__(self, feed_fn: Callable[[], Mapping[Any, Any]]) -> None:
        self.hook = CoreFeedFnHook(feed_fn, into_batch=False)
        super().__init__([self.hook])


class GlobalStepWaiterHook(HookCallback):
    """Holds training back until the global step reaches `wait_until_step` (TF1's GlobalStepWaiterHook).

    The step waited on is `run_context.session.global_step` (this model's `optimizer.iterations`), which
    nothing advances while this process waits: pass `global_step_fn` reading a counter another process
    advances. Without one the hook passes at once when the fit starts (or resumes) at or past
    `wait_until_step`, and otherwise waits for ever, as a TF worker whose chief never came. `wait_until_step
    <= 0` never waits. Arguments, timing and log messages are hookprof's GlobalStepWaiterHook (TF's).
    """

    def __init__(self, wait_until_step: int, global_step_fn: Callable[[], int] | None = None,
                 sleep: Callable[[float], Any] | None = None) -> None:
        self.hook = CoreGlobalStepWaiterHook(wait_until_step, global_step_fn, sleep)
        super().__init__([self.hook])
