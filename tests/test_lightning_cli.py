"""The LightningCLI recipe: summaries registered in code, selected from YAML by collection key.

The real CLI (`python -m examples.train_cli fit --config examples/cli_config.yaml`) runs in a subprocess, and its
TensorBoard events are read back with TensorBoard's own readers; a bad config ends in one short error line.
"""

import glob
import os
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.util import tensor_util

import hookprof
import lightning_prof
from hookprof import summary
from tests.conftest import load_trace, timeline_steps
from tests.lightning_models import TinyModel, loader, trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "cli_config.yaml")
MISSING_OP = "Exactly one of scaffold or summary_op must be provided."


@pytest.fixture(autouse=True)
def fresh_collections():
    for key in summary.collection_keys():
        summary.clear_collection(key)
    yield
    for key in summary.collection_keys():
        summary.clear_collection(key)


def run_cli(root, *extra):
    """`python -m examples.train_cli fit` on the example config, 4 steps, files under `root`."""
    command = [sys.executable, "-m", "examples.train_cli", "fit", f"--config={CONFIG}", *extra,
               "--trainer.max_steps=4", f"--trainer.default_root_dir={root}", "--trainer.enable_progress_bar=false"]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "KERAS_BACKEND": "torch"})


def write_config(directory, text):
    path = os.path.join(directory, "override.yaml")
    with open(path, "w") as f:
        f.write(text)
    return path


def assert_one_line_error(result, *needles):
    """Exit status 2 (a parser error), no traceback, and a last stderr line `error: ...` holding the needles."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert len(lines) <= 12, result.stderr  # a usage line, a tip, the error (and Lightning's few info lines)
    assert lines[-1].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[-1], result.stderr
    return lines[-1]


def test_the_example_config_writes_the_selected_collections_and_the_timelines(tmp_dir):
    result = run_cli(tmp_dir)
    assert result.returncode == 0, result.stderr
    (run,) = glob.glob(os.path.join(tmp_dir, "lightning_logs", "version_*"))

    acc = EventAccumulator(run, size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    steps = {tag: [e.step for e in acc.Tensors(tag)] for tag in acc.Tags()["tensors"]}
    # summary_op: summaries (every step): the module-level scalars; summary_op: weights (every 2 steps): the
    # histograms the model's __init__ registered; nothing else
    assert steps == {"loss": [1, 2, 3, 4], "accuracy": [1, 2, 3, 4], "fc1/weight": [1, 3], "fc2/weight": [1, 3],
                     "head/weight": [1, 3]}
    plugins = {value.tag: value.metadata.plugin_data.plugin_name
               for path in glob.glob(os.path.join(run, "events.out.tfevents.*"))
               for event in EventFileLoader(path).Load() for value in event.summary.value}
    assert plugins == {"loss": "scalars", "accuracy": "scalars", "fc1/weight": "histograms",
                       "fc2/weight": "histograms", "head/weight": "histograms",
                       "train_loss": "scalars", "epoch": "scalars",  # Lightning's (log_every_n_steps: 1)
                       # the ProfilerHook's graph and traced steps, for TensorBoard's Graphs dashboard
                       "__run_graph__": "graphs", "step_2": "graph_tagged_run_metadata",
                       "step_4": "graph_tagged_run_metadata"}
    # the same run's event file holds Lightning's own train_loss (logged at global_step - 1: the step before)
    loss = [float(tensor_util.make_ndarray(e.tensor_proto)) for e in acc.Tensors("loss")]
    assert loss == pytest.approx([e.value for e in acc.Scalars("train_loss")], rel=1e-6)
    accuracy = [float(tensor_util.make_ndarray(e.tensor_proto)) for e in acc.Tensors("accuracy")]
    assert all(0.0 <= a <= 1.0 for a in accuracy)
    for event in acc.Tensors("fc1/weight"):  # [buckets, (left, right, count)] over fc1's 64 x 2 weights
        buckets = tensor_util.make_ndarray(event.tensor_proto)
        assert buckets.shape[1] == 3 and buckets[:, 2].sum() == 64 * 2

    assert timeline_steps(run) == [2, 4]  # ProfilerHook from the same YAML, into the logger's run directory
    for step in (2, 4):
        assert load_trace(os.path.join(run, f"timeline-{step}.json"))["traceEvents"]


def test_a_config_without_summary_op_fails_with_tf_s_one_line_message(tmp_dir):
    override = write_config(tmp_dir, "trainer:\n  callbacks:\n    - class_path: lightning_prof.SummarySaverHook\n"
                                     "      init_args:\n        save_steps: 1\n")
    result = run_cli(tmp_dir, f"--config={override}")
    assert assert_one_line_error(result) == f"error: {MISSING_OP}"
    assert not glob.glob(os.path.join(tmp_dir, "lightning_logs", "*", "events.out.tfevents.*"))


def test_a_collection_key_with_no_summaries_names_it_and_the_keys_that_exist(tmp_dir):
    override = write_config(tmp_dir, "trainer:\n  callbacks:\n    - class_path: lightning_prof.SummarySaverHook\n"
                                     "      init_args:\n        save_steps: 1\n        summary_op: sumaries\n")
    result = run_cli(tmp_dir, f"--config={override}")
    line = assert_one_line_error(result, "summary_op='sumaries'", "collection 'sumaries'", "'summaries', 'weights'")
    assert "GPU available" in result.stderr  # it failed as the fit started (the model had registered `weights`)
    assert not glob.glob(os.path.join(tmp_dir, "lightning_logs", "*", "timeline-*"))
    assert len(line) < 300


def test_a_collection_key_is_resolved_when_the_fit_starts_not_when_the_hook_is_made(tmp_dir):
    hook = lightning_prof.SummarySaverHook(save_steps=2, summary_op="late")
    assert repr(summary.CollectionSummary("late")) == "<summary.merge_all('late'), not resolved yet>"
    summary.scalar("early", 1.0)  # the default collection: not selected
    summary.scalar("x", lambda step: step.step, collections=["late"])  # registered after the hook was made
    t = trainer(tmp_dir, [hook], 4)
    t.fit(TinyModel(), loader())
    acc = EventAccumulator(t.log_dir, size_guidance={"tensors": 0})
    acc.Reload()
    assert acc.Tags()["tensors"] == ["x"]
    assert [e.step for e in acc.Tensors("x")] == [1, 3]


def test_an_empty_collection_fails_the_fit_before_its_first_step(tmp_dir):
    summary.scalar("x", 1.0, collections=["b", "a"])
    hook = lightning_prof.SummarySaverHook(save_steps=1, summary_op="c")
    with pytest.raises(summary.EmptyCollectionError) as err:
        trainer(tmp_dir, [hook], 2).fit(TinyModel(), loader())
    assert str(err.value).startswith("summary_op='c': no summaries are registered in collection 'c'; the "
                                     "collections with summaries are: 'a', 'b'.")
    summary.clear_collection("a")
    summary.clear_collection("b")
    with pytest.raises(summary.EmptyCollectionError, match=r"the collections with summaries are: none\."):
        summary.CollectionSummary("c").resolve()
    assert issubclass(summary.EmptyCollectionError, ValueError)


def test_tf_s_rule_and_the_argument_checks_hold_for_keys():
    with pytest.raises(ValueError, match=rf"^{MISSING_OP}$"):
        lightning_prof.SummarySaverHook(save_steps=1)
    with pytest.raises(ValueError, match=rf"^{MISSING_OP}$"):
        lightning_prof.SummarySaverHook(save_steps=1, summary_op="summaries", scaffold=summary.Scaffold())
    with pytest.raises(TypeError, match=r"a collection key must be a non-empty string"):
        lightning_prof.SummarySaverHook(save_steps=1, summary_op="")
    with pytest.raises(TypeError, match=r"pass summary.CollectionSummary\('loss'\)"):
        hookprof.SummarySaverHook(save_steps=1, summary_op="loss")  # the core hook takes ops, not keys


def test_two_hooks_on_one_schedule_selecting_two_collections_are_two_callbacks(tmp_dir):
    summary.scalar("a", 1.0, collections=["a"])
    summary.scalar("b", 2.0, collections=["b"])
    first = lightning_prof.SummarySaverHook(save_steps=1, summary_op="a")
    second = lightning_prof.SummarySaverHook(save_steps=1, summary_op="b")
    assert first.state_key != second.state_key
    plain = lightning_prof.SummarySaverHook(save_steps=1, summary_op=summary.merge_all("a"))
    assert (first.state_key, plain.state_key) == ("SummarySaverHook(save_steps=1, summary_op=a)",
                                                  "SummarySaverHook(save_steps=1)")
    t = trainer(tmp_dir, [first, second], 2)
    t.fit(TinyModel(), loader())
    acc = EventAccumulator(t.log_dir, size_guidance={"tensors": 0})
    acc.Reload()
    assert sorted(acc.Tags()["tensors"]) == ["a", "b"]


def test_a_collection_key_travels_to_another_process_as_its_key():
    import pickle

    from hookprof import summary

    summary.scalar("x", 1.0, collections=["travel"])
    try:
        selected = summary.CollectionSummary("travel")
        assert [op.name for op in selected.resolve()] == ["x"]
        copy = pickle.loads(pickle.dumps(selected))  # ddp_spawn: the ops (callables) are not sent
        assert copy.key == "travel" and copy._ops is None and [op.name for op in copy.ops] == ["x"]
    finally:
        summary.clear_collection("travel")
