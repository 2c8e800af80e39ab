"""A real 2-process Lightning DDP fit on CPU (gloo): per-rank timelines, rank choice, and the merge."""

import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import load_trace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {repo!r})
    import lightning as L
    from hookprof import summary
    from lightning_prof import ProfilerHook, SummarySaverHook
    from tests.lightning_models import TinyModel, loader
    out = sys.argv[1]
    loss = summary.scalar("loss", lambda step: step.outputs["loss"])
    hooks = [ProfilerHook(save_steps=2, output_dir=os.path.join(out, "all")),
             ProfilerHook(save_steps=2, output_dir=os.path.join(out, "rank0"), ranks=0, name="rank0"),
             SummarySaverHook(save_steps=2, output_dir=os.path.join(out, "summaries"), summary_op=loss)]
    trainer = L.Trainer(strategy="ddp", devices=2, accelerator="cpu", max_steps=4, callbacks=hooks,
                        default_root_dir=out, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(TinyModel(), loader())
""")


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    script = out / "fit.py"
    script.write_text(SCRIPT.format(repo=REPO))
    done = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=300,
                          cwd=str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_each_rank_writes_its_own_files(ddp_run):
    names = sorted(n for n in os.listdir(ddp_run / "all") if n.startswith("timeline-"))
    assert names == ["timeline-2-rank0.json", "timeline-2-rank1.json", "timeline-4-rank0.json",
                     "timeline-4-rank1.json"]
    for rank in (0, 1):
        trace = load_trace(str(ddp_run / "all" / f"timeline-2-rank{rank}.json"))
        assert trace["distributedInfo"] == {"rank": rank, "world_size": 2, "backend": "gloo"}
        process_names = [e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"]
        assert process_names and all(n.startswith(f"[rank {rank}] ") for n in process_names)
        assert any(e["name"] == "aten::addmm" for e in trace["traceEvents"] if e["ph"] == "X")
    timelines = sorted(n for n in os.listdir(ddp_run / "rank0") if n.startswith("timeline-"))
    assert timelines == ["timeline-2-rank0.json", "timeline-4-rank0.json"]


def test_ranks_tag_their_tensorboard_run_metadata_apart(ddp_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(ddp_run / "all"), size_guidance={"run_metadata": 0})
    acc.Reload()
    assert sorted(acc.Tags()["run_metadata"]) == ["step_2_rank0", "step_2_rank1", "step_4_rank0", "step_4_rank1"]


def test_summaries_come_from_rank_0_only(ddp_run):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    files = [n for n in os.listdir(ddp_run / "summaries") if n.startswith("events.out.tfevents")]
    assert len(files) == 1  # rank 1 opened no event file
    events = list(EventFileLoader(str(ddp_run / "summaries" / files[0])).Load())
    steps = [e.step for e in events if e.HasField("summary")]
    assert steps == [1, 3]  # once per saving step, not once per rank


def test_merge_command_holds_both_ranks(ddp_run, tmp_path):
    merged = str(tmp_path / "merged.json.gz")
    inputs = [str(ddp_run / "all" / f"timeline-2-rank{r}.json") for r in (1, 0)]
    done = subprocess.run([sys.executable, "-m", "hookprof.cli", "merge", "-o", merged, *inputs],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    trace = load_trace(merged)
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert sorted(set(n.split("]")[0] + "]" for n in names.values())) == ["[rank 0]", "[rank 1]"]
    ops = [e for e in events if e["ph"] == "X" and e["name"] == "aten::addmm"]
    assert {e["pid"] // 1000 for e in ops} == {0, 1}
    parts = [load_trace(p) for p in inputs]
    assert len(events) == sum(len(p["traceEvents"]) for p in parts)
    # flows stay within their rank: every id's two ends are in the same rank's processes
    ends = {}
    for e in events:
        if e["ph"] in "st":
            ends.setdefault(e["id"], set()).add(e["pid"] // 1000)
    assert ends and all(len(r) == 1 for r in ends.values())
    # clocks aligned on the earliest base: each rank's step starts where its own base says
    base = trace["baseTimeNanoseconds"]
    assert base == min(p["baseTimeNanoseconds"] for p in parts)


def test_merge_refuses_two_files_of_the_same_rank(ddp_run, tmp_path):
    same = [str(ddp_run / "all" / "timeline-2-rank0.json"), str(ddp_run / "all" / "timeline-4-rank0.json")]
    done = subprocess.run([sys.executable, "-m", "hookprof.cli", "merge", "-o", str(tmp_path / "m.json"), *same],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 2 and "are both rank 0" in done.stderr
    assert not os.path.exists(tmp_path / "m.json")
