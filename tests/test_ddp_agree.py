"""Under 2-rank gloo DDP the ranks make one decision: a stop one rank asks for stops both, a seconds schedule saves
and traces the same steps on both, a trigger on one rank opens a capture window on both; and the Profiler
names the rank the others wait for. Each fit runs in `tests/ddp_fit.py`, whose process group times out after a
few seconds: a rank left waiting in a collective fails the fit instead of hanging the test."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import load_trace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fit(scenario: str, out) -> list[dict]:
    """Run `scenario` as a 2-rank DDP fit; what each rank recorded, rank 0 first."""
    done = subprocess.run([sys.executable, os.path.join(REPO, "tests", "ddp_fit.py"), scenario, str(out)],
                          capture_output=True, text=True, timeout=240, cwd=str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def timeline_steps(directory) -> dict[int, list[int]]:
    steps: dict[int, list[int]] = {0: [], 1: []}
    for name in os.listdir(directory):
        match = re.fullmatch(r"timeline-(\d+)-rank(\d)\.json", name)
        if match:
            steps[int(match[2])].append(int(match[1]))
    return {rank: sorted(found) for rank, found in steps.items()}


def test_a_nan_on_one_rank_stops_both_at_that_step(tmp_path):
    ranks = fit("nan", tmp_path)  # NanTensorHook("loss", fail_on_nan_loss=False); NaN on rank 1 from step 3
    assert [r["global_step"] for r in ranks] == [3, 3]


def test_a_nan_on_one_rank_fails_both_at_that_step_with_the_same_error(tmp_path):
    ranks = fit("nan_fail", tmp_path)  # NanTensorHook("loss", fail_on_nan_loss=True); NaN on rank 1 from step 3
    assert [r["global_step"] for r in ranks] == [3, 3]
    assert ranks[0]["error"] == ("NanLossDuringTrainingError: NaN loss during training. Global step 3, rank 0: the "
                                 "loss was NaN on another rank; every rank fails at this step.")
    assert ranks[1]["error"] == ("NanLossDuringTrainingError: NaN loss during training. Global step 3, rank 1: the "
                                 "loss was NaN on this rank; every rank fails at this step.")


def test_a_user_hook_stopping_one_rank_stops_both(tmp_path):
    ranks = fit("user_stop", tmp_path)  # request_stop() on rank 1 at step 3
    assert [r["global_step"] for r in ranks] == [3, 3]


def test_where_the_default_group_cannot_carry_cpu_tensors_the_fit_agrees_on_a_gloo_group_of_its_own(tmp_path):
    """As under NCCL: the default group is torch's "fake" backend here (tests/test_cuda.py runs NCCL on a GPU)."""
    assert_agreed_on_a_gloo_group_of_the_fits_own(fit("agree_on_fake", tmp_path), "fake")


def assert_agreed_on_a_gloo_group_of_the_fits_own(ranks: list[dict], default_backend: str) -> None:
    """What tests/ddp_fit.py's `agree_on_*` scenarios recorded (a user hook stops rank 1 at step 3)."""
    assert [r.get("error") for r in ranks] == [None, None]
    assert [r["global_step"] for r in ranks] == [3, 3]  # the stop on rank 1 stopped both
    for rank in ranks:
        assert rank["default_backend"] == default_backend
        # one gloo group, made at step 1's agreement (after the recording hook ran), the same at each later
        # step, and destroyed once the fit ended
        assert rank["agreement_backends"] == [None, "gloo", "gloo"] and rank["agreement_groups"] == 1
        assert rank["agreement_group_left"] is False


def test_a_seconds_checkpoint_schedule_saves_the_same_steps_on_both_ranks(tmp_path):
    # rank 0 reads its clock 30 ms after rank 1 each step; every save is Lightning's collective save
    ranks = fit("checkpoint_secs", tmp_path)
    saves = ranks[0]["saves"]
    assert ranks[1]["saves"] == saves
    assert len(saves) >= 4 and saves[0] == 0 and saves[-1] == 24  # the first, some by the clock, the last
    files = sorted(int(n.split("-")[1].split(".")[0]) for n in os.listdir(tmp_path / "ckpt") if n.endswith(".ckpt"))
    assert files == saves


def test_seconds_schedules_and_triggers_trace_the_same_steps_on_both_ranks(tmp_path):
    fit("trace_secs", tmp_path)
    by_clock = timeline_steps(tmp_path / "secs")
    assert by_clock[0] == by_clock[1] and len(by_clock[0]) >= 2
    # NonFinite fires on rank 1 only, at step 3: both trace step 4, and rank 0's file says why it did
    assert timeline_steps(tmp_path / "trigger") == {0: [4], 1: [4]}
    why = {rank: load_trace(str(tmp_path / "trigger" / f"timeline-4-rank{rank}.json"))["metadata"]["trigger"]
           for rank in (0, 1)}
    assert why[1]["kind"] == "non_finite" and why[0] == {"kind": "other_rank", "step": 3,
                                                         "detail": "a trigger fired on another rank"}


@pytest.fixture(scope="module")
def straggler(tmp_path_factory):
    out = tmp_path_factory.mktemp("straggler")
    fit("straggler", out)  # rank 1 sleeps 50 ms in each training_step
    return out


def test_advise_names_the_rank_the_others_wait_for(straggler):
    from hookprof.profiler import Profiler

    prof = Profiler.load((straggler / "rank0.prof").read_bytes())
    prof.merge(Profiler.load((straggler / "rank1.prof").read_bytes()))
    assert sorted(prof.data.steps) == [(0, 2), (0, 4), (0, 6), (1, 2), (1, 4), (1, 6)]
    finding = prof.advise({"JobChecker": {}})["JobChecker"]["findings"][0]
    evidence = finding["evidence"]
    assert evidence["slow_rank"] == 1
    wait = evidence["collective_us_by_rank"]
    assert wait[0] > 40_000 > 10_000 > wait[1]  # rank 0 waits about the 50 ms rank 1 sleeps; rank 1 hardly
    calls = evidence["collective_waits_by_rank"]
    assert calls[0] == calls[1] >= 1  # the gradients' all-reduce each step (and DDP's first broadcast)
    assert finding["report"].startswith("Straggler: rank 1 ")


def test_the_advise_command_over_both_ranks_files_names_the_slow_rank(straggler):
    timelines = sorted(str(straggler / "timelines" / n) for n in os.listdir(straggler / "timelines"))
    profiles = [str(straggler / f"rank{rank}.prof") for rank in (0, 1)]
    for inputs in (timelines, profiles):
        done = subprocess.run([sys.executable, "-m", "hookprof.cli", "advise", "--checker", "JobChecker", *inputs],
                              capture_output=True, text=True, cwd=REPO, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("\nJobChecker:\nStraggler: rank 1 is slow: the other ranks wait for it in "
                                      "collectives every step (rank 0 "), done.stdout
    same = subprocess.run([sys.executable, "-m", "hookprof.cli", "advise", profiles[0], profiles[0]],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert same.returncode == 2 and f"{profiles[0]}: named twice (first as {profiles[0]})" in same.stderr
