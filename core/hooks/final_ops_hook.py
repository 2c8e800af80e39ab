"""`FinalOpsHook`: TF1's `tf.train.FinalOpsHook`, evaluating fetches when training ends."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from hookprof.hooks import hooked_session
from hookprof.hooks.session import Session, StepState, check_fetches, evaluate_fetches
from hookprof.hooks.session_run_hook import SessionRunHook

log = logging.getLogger(__name__)

_OUT_OF_RANGE_WARNING = (
    "An OutOfRangeError or StopIteration exception is raised by the "
    "code in FinalOpsHook. This typically means the Ops running by the "
    "FinalOpsHook have a dependency back to some input source, which "
    "should not happen. For example, for metrics in "
    "tf.estimator.Estimator, all metrics functions return two Ops: "
    "`value_op` and  `update_op`. Estimator.evaluate calls the "
    "`update_op` for each batch of the data in input source and, once "
    "it is exhausted, it call the `value_op` to get the metric values. "
    "The `value_op` here should have dependency back to variables "
    "reading only, rather than reading another batch from input. "
    "Otherwise, the `value_op`, executed by `FinalOpsHook`, triggers "
    "another data reading, which ends OutOfRangeError/StopIteration. "
    "Please fix that."
)


class FinalOpsHook(SessionRunHook):
    """Evaluates fetches at the end of training (`end()`); read them afterwards from `final_ops_values`.

    Args:
        final_ops: a single fetch, a list of fetches or a dict of names to fetches (a fetch: the name of a
            step output or logged metric, or a callable of the step, e.g. `lambda step: step.model.fc1.weight`);
            None evaluates nothing. They are evaluated by `session.run(final_ops)`, on the last finished step.
        final_ops_feed_dict: names to values that the fetches can read, while they are evaluated, through
            `hookprof.step_feeds()` (TF: the feed dict of the final `session.run`).

    Raises:
        TypeError: `final_ops` that are not fetches (names, callables, and dicts / lists of them), a
            `final_ops_feed_dict` that is not a dict.

    `end()` runs on a clean finish or a requested stop, not after a failure, so `final_ops_values` stays None
    when training fails. When no step finished before `end()` (a fit that ran none, a resume at its last step),
    TF still ran the final ops on the graph's current state: here they are evaluated on a state with no step
    outputs, whose `step` is the current global step and `model` the model, so "global_step" and callables
    reading the model give values; a fetch of a step output then fails with a KeyError, after a warning. A
    StopIteration raised by a fetch is logged with TF's warning and re-raised, as TF did.
    """

    def __init__(self, final_ops: Any, final_ops_feed_dict: Mapping[str, Any] | None = None) -> None:
        owner = type(self).__name__
        self._final_ops = None if final_ops is None else check_fetches(owner, "final_ops", final_ops)
        if final_ops_feed_dict is not None and not isinstance(final_ops_feed_dict, Mapping):
            raise TypeError(f"`{owner}(final_ops_feed_dict={final_ops_feed_dict!r})`: `final_ops_feed_dict` "
                            "must be a dict of name -> value, or None.")
        self._final_ops_feed_dict = final_ops_feed_dict
        self._final_ops_values: Any = None

    @property
    def final_ops_values(self) -> Any:
        return self._final_ops_values

    def quiet_on(self, global_step: int) -> bool:
        return True  # nothing happens on a step

    def may_request_stop(self) -> bool:
        return False  # it runs at the end

    def end(self, session: Any) -> None:
        if self._final_ops is not None:
            try:
                self._final_ops_values = self._run(session)
            except StopIteration as e:
                log.warning(_OUT_OF_RANGE_WARNING)
                raise e

    def _run(self, session: Any) -> Any:
        with hooked_session.feeding(self._final_ops_feed_dict or {}):
            if isinstance(session, Session) and session.last_step is None:
                state = StepState(session.global_step, model=session.model, session=session)
                try:
                    return evaluate_fetches(self._final_ops, state)
                except KeyError:
                    log.warning("FinalOpsHook: no training step finished before end(), so the final ops can read "
                                "only `global_step` and the model, not a step's outputs.")
                    raise
            return session.run(self._final_ops)
