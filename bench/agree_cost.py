"""What a distributed fit's per-step agreement costs this process: `LightningSession.agree`'s all-reduce
(`RankVotes.sum`) against a bare all-reduce of one preallocated int and against the way it was done before
(a new tensor of the decisions each call, copied into a kept one, then `tolist`).

A one-rank gloo group, so that no other rank's lateness enters the numbers: what is left is each way's own
work on the calling thread (the other ranks' wait comes on top, the same for all three; `python
tests/ddp_fit.py agree_cost OUT` times them in a real 2-rank fit). Microseconds a call, median of 7 rounds of
3000 calls, for 1 and 3 decisions.
"""

import os
import statistics
import time

import torch
import torch.distributed as dist

from lightning_prof.hook_callback import RankVotes

CALLS = 3000


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        bare = torch.zeros(1, dtype=torch.int32)
        kept: dict[int, torch.Tensor] = {}

        def new_tensor_each_call(decisions):
            values = torch.tensor([int(bool(d)) for d in decisions])
            votes = kept.setdefault(len(values), torch.zeros_like(values))
            votes.copy_(values)
            dist.all_reduce(votes)
            return votes.tolist()

        ways = {"bare all_reduce": lambda decisions: dist.all_reduce(bare), "RankVotes.sum": RankVotes().sum,
                "new tensor each call": new_tensor_each_call}
        rounds: dict[tuple[str, int], list[float]] = {}
        for _ in range(7):
            for name, call in ways.items():
                for count in (1, 3):
                    decisions = [False] * count
                    start = time.perf_counter()
                    for _ in range(CALLS):
                        call(decisions)
                    rounds.setdefault((name, count), []).append((time.perf_counter() - start) / CALLS * 1e6)
        for (name, count), micros in rounds.items():
            print(f"{name:22} {count} decision(s): {statistics.median(micros):6.1f} us a call")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
