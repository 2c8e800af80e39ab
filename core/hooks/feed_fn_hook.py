"""`FeedFnHook`: TF1's `tf.train.FeedFnHook`, feeding the values `feed_fn()` returns into every step."""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

from hookprof.hooks.session_run_hook import SessionRunArgs, SessionRunContext, SessionRunHook

_STEP_FEEDS_HINT = ("Read the fed values inside the step with `hookprof.step_feeds()` instead (e.g. "
                    "`hookprof.step_feeds()['name']`), or make the batch a dict (a DataLoader of dicts).")


class FeedFnHook(SessionRunHook):
    """Runs `feed_fn` before every step and feeds what it returns (TF1's hook).

    Args:
        feed_fn: a function of no arguments returning a dict of name -> value to feed into the step.
        into_batch: where else the values go besides `hookprof.step_feeds()` (this project's extension; a
            training step reads TF's placeholders' values there):
            - None (default): also into the step's batch when it is a dict (a mutable mapping), so
              `training_step(batch, ...)` finds them as `batch[name]`; other batches (a tuple, a tensor)
              are left alone.
            - True: the values must go into the batch; a batch that is not a mutable mapping, or a
              framework that hands hooks no batch (Keras), fails the step with a `TypeError` naming this
              hook and what to do instead.
            - False: only `hookprof.step_feeds()`.

    Raises:
        TypeError: a `feed_fn` that is not callable, an `into_batch` other than None, True or False.

    Timing and rules are TF's: `feed_fn` runs in every `before_run` (never skipped: the hook is never
    quiet) and returns `SessionRunArgs(fetches=None, feed_dict=feed_fn())`; the values are visible through
    `hookprof.step_feeds()` while that step runs. Feeding a name the step's own arguments carry (`"batch"`,
    `"batch_idx"`) is TF's `RuntimeError("Same tensor is fed by a SessionRunHook and user: ...")`, two hooks
    feeding one name is TF's "Same tensor is fed by two hooks", and so is feeding a key the batch dict
    already holds (a key this hook itself put into that same dict on an earlier step is no clash).

    The batch is `run_context.original_args.feed_dict["batch"]`, which Lightning's adapter passes (and
    Keras' does not). Under Lightning gradient accumulation the TF step opens at the window's first
    micro-batch; `lightning_prof.FeedFnHook` also puts the step's values into the window's later dict batches.
    """

    def __init__(self, feed_fn: Callable[[], Mapping[Any, Any]], into_batch: bool | None = None) -> None:
        if not callable(feed_fn):
            raise TypeError(f"`FeedFnHook(feed_fn={feed_fn!r})`: `feed_fn` must be a function of no arguments "
                            "returning a dict of name -> value to feed.")
        if into_batch not in (None, True, False):
            raise TypeError(f"`FeedFnHook(into_batch={into_batch!r})`: use None (dict batches only), True or False.")
        self.feed_fn = feed_fn
        self.into_batch = into_batch
        self._feeds: Mapping[Any, Any] | None = None  # the running step's feeds (None between steps)
        # the id of the last batch this hook put values into (not the batch: it would stay alive), and the keys
        self._fed_batch: int | None = None
        self._fed_keys: frozenset = frozenset()

    def begin(self) -> None:
        self._feeds, self._fed_batch, self._fed_keys = None, None, frozenset()

    def may_request_stop(self) -> bool:
        return False  # it only feeds

    def before_run(self, run_context: SessionRunContext) -> SessionRunArgs:
        feeds = self.feed_fn()
        self._feeds = feeds if isinstance(feeds, Mapping) else None
        if feeds and self.into_batch is not False and isinstance(feeds, Mapping):
            original = run_context.original_args.feed_dict if run_context.original_args is not None else None
            if isinstance(original, Mapping) and "batch" in original:
                self.put_into_batch(original["batch"])
            elif self.into_batch:
                raise TypeError(
                    f"{type(self).__name__}(into_batch=True): this step hands hooks no batch to feed into (Keras "
                    f"hands only `batch_idx`), so {sorted(map(str, feeds))} cannot go into it. {_STEP_FEEDS_HINT}")
        return SessionRunArgs(fetches=None, feed_dict=feeds)

    def after_run(self, run_context: SessionRunContext, run_values: Any) -> None:
        self._feeds = None

    def put_into_batch(self, batch: Any) -> None:
        """Put the running step's feeds into `batch` as `into_batch` says (a dict batch gets them; any other
        batch is an error with `into_batch=True` and left alone otherwise). No step running: nothing."""
        feeds = self._feeds
        if not feeds or self.into_batch is False:
            return
        if not isinstance(batch, MutableMapping):
            if self.into_batch:
                raise TypeError(
                    f"{type(self).__name__}(into_batch=True): the step's batch is a {type(batch).__name__}, which "
                    f"cannot take feeds {sorted(map(str, feeds))}: only a dict batch (a mutable mapping) can. "
                    f"{_STEP_FEEDS_HINT}")
            return
        own = self._fed_keys if id(batch) == self._fed_batch else frozenset()
        clash = (batch.keys() & feeds.keys()) - own
        if clash:
            raise RuntimeError(f"Same tensor is fed by a SessionRunHook and user: {sorted(map(str, clash))} (the "
                               f"batch dict already holds them; {type(self).__name__} feeds into the batch).")
        batch.update(feeds)
        self._fed_batch, self._fed_keys = id(batch), frozenset(feeds.keys())
