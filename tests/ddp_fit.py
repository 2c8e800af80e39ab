"""One 2-rank DDP `Trainer.fit`, for tests/test_ddp_agree.py, tests/test_step_identity.py and tests/test_cuda.py:
`python tests/ddp_fit.py SCENARIO OUT`. Gloo on CPU, except the `agree_on_*` scenarios (`DefaultGroupNotGloo`).

Each rank writes what it saw to `OUT/rank<r>.json` (its global step at the end, the steps it saved or traced).
The process group times out after `TIMEOUT` seconds, so a rank left waiting in a collective fails the fit
instead of hanging the test.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

from hookprof import SessionRunHook  # noqa: E402
from hookprof.profiler import Profiler  # noqa: E402
from hookprof.tracing.step_identity import DATAFLOW_MISSING  # noqa: E402
from hookprof.triggers import NonFinite  # noqa: E402
from lightning_prof import CheckpointSaverHook, CheckpointSaverListener, HookCallback, NanTensorHook, ProfilerHook  # noqa: E402
from lightning_prof.hook_callback import LightningSession  # noqa: E402
from tests.lightning_models import TinyModel, loader  # noqa: E402

TIMEOUT = 20  # seconds a rank waits in a collective before the fit fails


class Model(TinyModel):
    """TinyModel whose loss is NaN on rank `nan_rank` from step `nan_step`, and whose step sleeps `sleep` s on
    rank `slow_rank`."""

    def __init__(self, nan_rank=None, nan_step=None, slow_rank=None, sleep=0.0):
        super().__init__()
        self.nan_rank, self.nan_step, self.slow_rank, self.sleep = nan_rank, nan_step, slow_rank, sleep

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        rank = self.trainer.global_rank
        if rank == self.slow_rank:
            time.sleep(self.sleep)
        if rank == self.nan_rank and self.trainer.global_step + 1 >= self.nan_step:
            loss = loss * float("nan")
        return loss


class Lag(Callback):
    """Sleeps after each batch on one rank, before the hooks run: the ranks read their clocks apart."""

    def __init__(self, rank: int, seconds: float) -> None:
        self.rank, self.seconds = rank, seconds

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_rank == self.rank:
            time.sleep(self.seconds)


class StopOnRank(SessionRunHook):
    """A user hook that asks to stop on one rank only, once `step` is reached."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def after_run(self, run_context, run_values) -> None:
        session = run_context.session
        if session.rank == self.rank and session.global_step >= self.step:
            run_context.request_stop()


class Saves(CheckpointSaverListener):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def before_save(self, session, global_step_value) -> None:
        self.steps.append(global_step_value)


class AgreeCost(Callback):
    """Times the ways to agree once training is over (both ranks in step), in microseconds a call, the best of 3
    rounds of 300 calls: `session.agree` of 1 and of 3 decisions, torch's bare all_reduce (of one tensor, and of a
    new tensor each call), and Lightning's `strategy.reduce_boolean_decision` (a barrier, then the all_reduce)."""

    def __init__(self) -> None:
        self.micros: dict[str, float] = {}

    def on_train_end(self, trainer, pl_module) -> None:
        session = LightningSession(trainer, pl_module)
        votes = torch.zeros(1, dtype=torch.int)
        ways = {"agree_1": lambda: session.agree([False]), "agree_3": lambda: session.agree([False] * 3),
                "all_reduce": lambda: torch.distributed.all_reduce(votes),
                "all_reduce_new_tensor": lambda: torch.distributed.all_reduce(torch.zeros(1, dtype=torch.int)),
                "reduce_boolean_decision": lambda: trainer.strategy.reduce_boolean_decision(False, all=False)}
        for _ in range(3):
            for name, call in ways.items():
                start = time.perf_counter()
                for _ in range(300):
                    call()
                micros = (time.perf_counter() - start) / 300 * 1e6
                self.micros[name] = min(micros, self.micros.get(name, micros))


class DefaultGroupNotGloo(DDPStrategy):
    """DDP whose default process group runs `backend`, not gloo, as NCCL's does on a host with a GPU per rank: the
    strategy's own collectives (DDP's gradients, barrier, broadcast, reduce, all_gather) go through a gloo group
    of all ranks, so that hookprof's agreement meets a default group it cannot put CPU tensors on.

    `backend`: "nccl", two ranks on one GPU (NCCL refuses to share a device between ranks, so its communicator
    must never be made: no `device_id` at init, no collective on the default group); or "fake", torch's test
    backend whose collectives do nothing (the same code path on CPU)."""

    def __init__(self, backend: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.backend = backend
        self.gloo = None

    def setup_distributed(self) -> None:
        if self.backend == "fake":
            import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the backend)
        self.set_world_ranks()
        self._process_group_backend = self.backend
        env = self.cluster_environment  # (a store of our own: the fake backend would otherwise get one gloo cannot use)
        store = dist.TCPStore(env.main_address, env.main_port, env.world_size(), env.global_rank() == 0,
                              timeout=self._timeout)
        dist.init_process_group(self.backend, store=store, rank=env.global_rank(), world_size=env.world_size(),
                                timeout=self._timeout)
        self.gloo = dist.new_group(backend="gloo", timeout=self._timeout)
        self._ddp_kwargs["process_group"] = self.gloo

    def barrier(self, *args, **kwargs) -> None:
        dist.barrier(group=self.gloo)

    def broadcast(self, obj, src: int = 0):
        objects = [obj]
        dist.broadcast_object_list(objects, src, group=self.gloo)
        return objects[0]

    def reduce(self, tensor, group=None, reduce_op="mean"):
        return super().reduce(tensor, self.gloo if group is None else group, reduce_op)

    def all_gather(self, tensor, group=None, sync_grads=False):
        return super().all_gather(tensor, self.gloo if group is None else group, sync_grads)


class AgreementGroup(SessionRunHook):
    """What each step's agreement ran on: the default group's backend and the agreement group's (None: none yet)."""

    def __init__(self) -> None:
        self.backends: list = []
        self.default_backend = ""
        self.groups: set = set()

    def after_run(self, run_context, run_values) -> None:
        votes = run_context.session._votes
        self.default_backend = str(dist.get_backend())
        self.backends.append(None if votes is None else str(dist.get_backend(votes.group)))
        if votes is not None:
            self.groups.add(votes.group)


def nan_on_rank_1(state) -> float:
    """A value non-finite on rank 1 at step 3 only (a trigger's fetch)."""
    return float("nan") if state.session.rank == 1 and state.step == 3 else 1.0


def main(scenario: str, out: str) -> None:
    callbacks: list = []
    model = Model()
    max_steps = 8
    record: dict = {}
    if scenario in ("nan", "nan_fail"):
        model = Model(nan_rank=1, nan_step=3)
        callbacks = [NanTensorHook("loss", fail_on_nan_loss=scenario == "nan_fail")]
    elif scenario == "user_stop":
        callbacks = [HookCallback([StopOnRank(rank=1, step=3)])]
    elif scenario == "checkpoint_secs":
        saves = Saves()
        max_steps = 24
        callbacks = [Lag(0, 0.03), CheckpointSaverHook(os.path.join(out, "ckpt"), save_secs=0.1, listeners=[saves])]
        record["saves"] = saves.steps
    elif scenario == "trace_secs":
        max_steps = 16
        callbacks = [Lag(0, 0.03),
                     ProfilerHook(save_secs=0.15, output_dir=os.path.join(out, "secs"), tensorboard=False),
                     ProfilerHook(output_dir=os.path.join(out, "trigger"), triggers=[NonFinite(nan_on_rank_1)],
                                  tensorboard=False, name="trigger")]
    elif scenario == "straggler":
        model = Model(slow_rank=1, sleep=0.05)
        max_steps = 6
        profiler = Profiler(model)
        callbacks = [ProfilerHook(save_steps=2, output_dir=os.path.join(out, "timelines"), profiler=profiler,
                                  tensorboard=False)]
    elif scenario == "agree_cost":
        cost = AgreeCost()
        max_steps = 2
        callbacks = [cost, HookCallback([SessionRunHook()])]
        record["agree_us"] = cost.micros
    elif scenario == "identities_both_paths":  # (tests/test_step_identity.py: each step walked, and borrowing)
        from tests.test_step_identity import BothPaths

        paths = BothPaths()
        callbacks = [paths]
    elif scenario == "identities_every_step":
        from tests.test_step_identity import FitIdentities

        probe = FitIdentities()
        hook = ProfilerHook(save_steps=1, output_dir=os.path.join(out, "prof"))
        callbacks = [hook, probe]
    elif scenario in ("agree_on_fake", "agree_on_nccl"):
        seen = AgreementGroup()
        callbacks = [HookCallback([StopOnRank(rank=1, step=3), seen])]
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    timeout = datetime.timedelta(seconds=TIMEOUT)
    where = dict(devices=2, accelerator="cpu", strategy=DDPStrategy(timeout=timeout))
    if scenario.startswith("agree_on_"):
        where["strategy"] = DefaultGroupNotGloo(scenario.removeprefix("agree_on_"), timeout=timeout)
        if scenario == "agree_on_nccl":  # one GPU: two "nodes" of one device each, both started by the caller
            where.update(devices=1, num_nodes=2, accelerator="gpu")
    trainer = L.Trainer(**where, max_steps=max_steps, callbacks=callbacks, default_root_dir=out,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    try:
        trainer.fit(model, loader(n=256))
    except Exception as error:  # (what the scenario is about: each rank says what it raised)
        record["error"] = f"{type(error).__name__}: {error}"
    rank = trainer.global_rank
    record.update(rank=rank, global_step=trainer.global_step)
    if scenario.startswith("agree_on_"):
        live = set(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else set()
        record.update(default_backend=seen.default_backend, agreement_backends=seen.backends,
                      agreement_groups=len(seen.groups), agreement_group_left=bool(seen.groups & live))
    if scenario == "identities_both_paths":
        from tests.test_step_identity import edges, memory, outputs

        record["steps"] = [{"step": step, "missing": borrowed.metadata.get(DATAFLOW_MISSING),
                            "edges": len(walked.edges),
                            "same": [edges(borrowed) == edges(walked), memory(borrowed) == memory(walked),
                                     outputs(borrowed) == outputs(walked)]} for step, walked, borrowed in paths.steps]
    if scenario == "identities_every_step":
        record.update(paths=hook.saved_paths, walks=probe.identities.walks)
    if scenario == "straggler":
        with open(os.path.join(out, f"rank{rank}.prof"), "wb") as f:
            f.write(profiler.serialize_to_string())
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    for child in getattr(trainer.strategy.launcher, "procs", []):  # rank 0 ends after the ranks it started
        child.wait(timeout=TIMEOUT * 3)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
