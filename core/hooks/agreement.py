"""`Ballot`: the decisions the ranks of a distributed fit make together after each step.

A decision that changes what a step does must be the same on every rank, or a rank waits in a collective for
one that went another way: a stop (one rank leaves, the other waits in the next all-reduce), a collective
checkpoint save, a trace window (merged traces that do not line up). Decisions that follow from the global
step are the same everywhere already and cost nothing. The others are agreed here, after each step's hooks:
the stop requests (while any hook `may_request_stop`) and every hook's `vote`s go into one `session.agree`
call, one small collective a step, made on every step of every rank (quiet ones too) so that the ranks call
it equally often. One process has no ballot: nothing is agreed, nothing is called.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hookprof.hooks.session_run_hook import SessionRunArgs, SessionRunContext


def may_request_stop(hook: Any) -> bool:
    """Whether `hook` may request a stop on what its rank alone sees (True for a hook that does not say)."""
    says = getattr(hook, "may_request_stop", None)
    return bool(says()) if callable(says) else True


def vote_count(hook: Any) -> int:
    """How many decisions `hook` votes on after each step (0 for a hook that does not say)."""
    says = getattr(hook, "votes", None)
    count = says() if callable(says) else 0
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise TypeError(f"{type(hook).__name__}.votes() returned {count!r}; return the number of decisions (an int "
                        ">= 0) it votes on after each step.")
    return count


class Ballot:
    """One fit's decisions agreed after each step: the stop (`stops`), then each voter's `votes()` decisions."""

    def __init__(self, agree: Callable[[list[bool]], list[bool]], stops: bool,
                 voters: Sequence[tuple[Any, int]]) -> None:
        self._agree = agree
        self.stops = stops
        self.voters = list(voters)

    @classmethod
    def for_fit(cls, session: Any, hooks: Sequence[Any]) -> Ballot | None:
        """The ballot of a fit of `hooks` in `session`; None in one process, or when nothing needs agreeing."""
        if getattr(session, "world_size", 1) <= 1:
            return None
        voters = [(hook, count) for hook in hooks if (count := vote_count(hook))]
        stops = any(may_request_stop(hook) for hook in hooks)
        if not voters and not stops:
            return None
        return cls(session.agree, stops, voters)

    def decide(self, session: Any, context: SessionRunContext | None, step: int) -> bool:
        """Agree the step that reached `step` (`context` None: a step no hook took part in); call each voter's
        `agreed`; return whether every rank stops after it."""
        proposals = [context is not None and context.stop_requested]
        for hook, count in self.voters:
            votes = tuple(hook.vote(step))
            if len(votes) != count:
                raise TypeError(f"{type(hook).__name__}.vote() returned {len(votes)} votes; its votes() says {count}.")
            proposals.extend(votes)
        agreed = self._agree(proposals)
        stop, decided = agreed[0], agreed[1:]
        if not any(decided):
            return stop
        if context is None:
            context = SessionRunContext(SessionRunArgs(), session)
        for hook, count in self.voters:
            hook.agreed(context, tuple(decided[:count]))
            decided = decided[count:]
        if self.stops:  # what the agreed actions asked (a checkpoint listener's stop): agreed too. Every rank
            # gets here on the same steps (the decisions are agreed), so this second round is safe.
            stop = self._agree([stop or context.stop_requested])[0]
        return stop
