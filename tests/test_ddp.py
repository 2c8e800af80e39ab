"""A real 2-process Lightning DDP fit on CPU (gloo): per-rank timelines, rank choice, and the merge."""

import json
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


SPAWN_SCRIPT = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {repo!r})
    import lightning as L
    from lightning_prof import CheckpointSaverHook, FinalOpsHook, ProfilerHook
    from tests.lightning_models import TinyModel, loader

    def rank(step):
        return step.session.rank

    def main(out):
        prof = ProfilerHook(save_steps=2, output_dir=os.path.join(out, "prof"), tensorboard=False)
        ckpt = CheckpointSaverHook(os.path.join(out, "ckpt"), save_steps=2)
        final = FinalOpsHook({{"step": "global_step", "rank": rank}})
        trainer = L.Trainer(strategy="ddp_spawn", devices=2, accelerator="cpu", max_steps=4,
                            callbacks=[prof, ckpt, final], default_root_dir=out, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        before = list(prof.saved_paths)
        trainer.fit(TinyModel(), loader())
        result = {{"before": before, "prof": prof.saved_paths, "again": prof.saved_paths, "ckpt": ckpt.saved_paths,
                   "final": {{key: int(value) for key, value in final.final_ops_values.items()}},
                   "parent_hook_ran": prof.hook.saved_paths}}
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f)

    if __name__ == "__main__":  # (spawn runs this file again in each rank)
        main(sys.argv[1])
""")


def run_in_own_tmpdir(tmp_path, template):
    """Run the script `template` in a process of its own whose TMPDIR is a fresh `tmp_path/tmp`: the result.json it
    writes into `tmp_path` (with the end of what it logged, as `log`), and that TMPDIR."""
    script = tmp_path / "script.py"
    script.write_text(template.format(repo=REPO))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300,
                          cwd=str(tmp_path), env={**os.environ, "TMPDIR": str(scratch)})
    assert done.returncode == 0, done.stderr[-3000:]
    return {**json.loads((tmp_path / "result.json").read_text()), "log": done.stderr[-3000:]}, scratch


def test_ddp_spawn_parent_callbacks_read_what_rank_0_wrote(tmp_path):
    """Under ddp_spawn the ranks run copies of the callbacks; the callbacks the user holds in the parent report what
    rank 0's copies ended with (they reported nothing), and the channel leaves nothing in the temp directory."""
    result, scratch = run_in_own_tmpdir(tmp_path, SPAWN_SCRIPT)
    assert result["before"] == [] and result["parent_hook_ran"] == []  # the parent's own hooks never ran
    written = sorted(n for n in os.listdir(tmp_path / "prof") if n.startswith("timeline-"))
    assert written == ["timeline-2-rank0.json", "timeline-2-rank1.json", "timeline-4-rank0.json",
                       "timeline-4-rank1.json"], result["log"]  # (what the ranks said, where one is missing)
    assert result["prof"] == result["again"] == [str(tmp_path / "prof" / f"timeline-{s}-rank0.json") for s in (2, 4)]
    assert result["ckpt"] == [str(tmp_path / "ckpt" / f"model.ckpt-{s}.ckpt") for s in (0, 2, 4)]
    assert all(os.path.exists(p) for p in result["prof"] + result["ckpt"])
    assert result["final"] == {"step": 4, "rank": 0}
    assert not list(scratch.glob("hookprof-*/*.pickle"))  # (what rank 0 sent was taken)


COPIES_SCRIPT = textwrap.dedent("""
    import copy, json, multiprocessing, os, pickle, sys
    sys.path.insert(0, {repo!r})
    from lightning_prof import ProfilerHook

    def report(callback, path):  # (in the spawned process: what its copy knows)
        with open(path, "w") as f:
            json.dump({{"away": callback._home.away, "directory": callback._home._directory}}, f)

    def names(callback):
        return [[twin._home.away, twin._home._name != callback._home._name, twin._home._directory]
                for twin in (copy.deepcopy(callback), pickle.loads(pickle.dumps(callback)))]

    if __name__ == "__main__":  # (spawn runs this file again in the child)
        out = sys.argv[1]
        callback = ProfilerHook(save_steps=2, output_dir=out)
        before = names(callback)
        claimed = [n for n in os.listdir(os.environ["TMPDIR"]) if n.startswith("hookprof-")]
        child = multiprocessing.get_context("spawn").Process(target=report, args=(callback, out + "/child.json"))
        child.start()
        child.join()
        with open(out + "/result.json", "w") as f:
            json.dump({{"before": before, "claimed": claimed, "directory": callback._home._directory,
                       "after": names(callback)}}, f)
""")


def test_a_callback_copied_in_its_own_process_claims_nothing_and_sends_nothing_into_the_originals_file(tmp_path):
    """A copy made in the callback's own process (`copy.deepcopy`, a pickle round trip) is no rank's copy: no
    directory is claimed for it (the process's own stays unmade), and it has a results file of its own, so
    neither takes the other's rank-0 results; a copy pickled for a process multiprocessing spawns carries the
    claimed directory."""
    result, scratch = run_in_own_tmpdir(tmp_path, COPIES_SCRIPT)
    assert result["claimed"] == [] and result["before"] == [[False, True, None]] * 2
    directory = result["directory"]
    assert os.path.dirname(directory) == str(scratch) and os.path.basename(directory).startswith("hookprof-")
    assert json.loads((tmp_path / "child.json").read_text()) == {"away": True, "directory": directory}
    assert result["after"] == [[False, True, directory]] * 2
