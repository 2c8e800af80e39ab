"""lightning_prof against real `Trainer.fit` on a tiny model: schedules, content, lifecycle, faults, resume."""

import os

import pytest
import torch

import hookprof
from hookprof import RunOptions, TraceLevel
from lightning_prof import HookCallback, ProfilerHook
from tests.conftest import NO_UNCLOSED_RESOURCES, FakeClock, RecordingHook, load_trace, op_events, timeline_steps
from tests.lightning_models import TinyModel, loader, trainer

pytestmark = NO_UNCLOSED_RESOURCES


def op_names(trace, phase=None):
    return [e["name"] for e in op_events(trace) if phase is None or e["args"].get("phase") == phase]


@pytest.mark.parametrize("save_steps,max_steps,expected", [(3, 10, [3, 6, 9]), (4, 8, [4, 8])])
def test_save_steps_writes_exactly_the_expected_timelines(tmp_dir, save_steps, max_steps, expected):
    hook = ProfilerHook(save_steps=save_steps, output_dir=tmp_dir)
    trainer(tmp_dir, [hook], max_steps).fit(TinyModel(), loader())
    assert timeline_steps(tmp_dir) == expected
    assert hook.saved_paths == [os.path.join(tmp_dir, f"timeline-{s}.json") for s in expected]


def test_timeline_holds_forward_backward_and_optimizer_of_exactly_one_step(tmp_dir):
    hook = ProfilerHook(save_steps=2, output_dir=tmp_dir)
    trainer(tmp_dir, [hook], 4).fit(TinyModel(), loader())
    assert timeline_steps(tmp_dir) == [2, 4]  # the loop below has both to read
    for path in hook.saved_paths:
        trace = load_trace(path)
        forward, backward, optimizer = (op_names(trace, p) for p in ("forward", "backward", "optimizer"))
        # one step of y = fc2(relu(fc1(x))): two addmm, one relu forward; their gradients; SGD's updates
        assert forward.count("aten::addmm") == 2 and forward.count("aten::relu") == 1
        assert backward.count("autograd::engine::evaluate_function: AddmmBackward0") == 2
        assert backward.count("autograd::engine::evaluate_function: ReluBackward0") == 1
        assert any(name.startswith("aten::add_") for name in optimizer)  # p.add_(grad, alpha=-lr)
        # scopes: forward ops under their module, and gradients under the module that made them
        addmm = [e for e in op_events(trace) if e["name"] == "aten::addmm"]
        assert sorted(e["args"]["scope"] for e in addmm) == ["TinyModel/fc1", "TinyModel/fc2"]
        grads = [e for e in op_events(trace) if e["name"] == "autograd::engine::evaluate_function: AddmmBackward0"]
        assert sorted(e["args"]["scope"] for e in grads) == ["TinyModel/fc1", "TinyModel/fc2"]
        fc1 = next(e for e in addmm if e["args"]["scope"] == "TinyModel/fc1")
        args = fc1["args"]  # addmm(bias, input, weight.t(), beta, alpha): one entry per argument
        assert args["input_shapes"][:3] == [[16], [8, 8], [8, 16]]
        assert args["input_dtypes"] == ["float32", "float32", "float32", "Scalar", "Scalar"]
        assert args["input_bytes"] == [64, 256, 512, None, None]
        # nothing from another step: every op lies inside this step's train_step span
        span = next(e for e in op_events(trace, "Span") if e["args"]["op"] == "train_step")
        assert span["name"] == f"ProfilerStep#{trace['metadata']['step']}"
        ops = op_events(trace)
        assert all(span["ts"] <= e["ts"] and e["ts"] + e["dur"] <= span["ts"] + span["dur"] + 1 for e in ops)
        assert trace["metadata"]["step"] == int(os.path.basename(path)[9:-5])


def test_save_secs_triggers_on_time_not_steps(tmp_dir):
    clock = FakeClock()

    durations = {1: 4, 2: 4, 3: 4, 4: 4, 5: 1, 6: 1, 7: 1, 8: 1, 9: 1, 10: 1, 11: 12, 12: 1}

    class Tick(hookprof.SessionRunHook):  # step i takes durations[i] "seconds"
        def after_run(self, run_context, run_values):
            clock.now += durations[run_context.session.global_step]

    hook = hookprof.ProfilerHook(save_secs=10, output_dir=tmp_dir, clock=clock)
    trainer(tmp_dir, [HookCallback([Tick(), hook])], 12).fit(TinyModel(), loader())
    # The count starts when step 1 ends (t=4). A step is traced when, at its start, 10 s have passed since
    # the last fire: step 5 starts at t=16; the fire at its end (t=17) restarts the count; step 12 starts
    # at t=34 >= 27 after the 12 s step 11. Steps 6-11 are never traced, however many they are.
    assert timeline_steps(tmp_dir) == [5, 12]


def test_lifecycle_order_with_a_recording_hook(tmp_dir):
    hook = RecordingHook()
    trainer(tmp_dir, [HookCallback([hook])], 3).fit(TinyModel(), loader())
    assert hook.calls == [
        ("begin",), ("after_create_session",),
        ("before_run", 0), ("after_run", 1), ("before_run", 1), ("after_run", 2),
        ("before_run", 2), ("after_run", 3), ("end",),
    ]


def test_fetches_see_the_step_outputs_and_logged_metrics(tmp_dir):
    hook = RecordingHook(fetches={"loss": "loss", "logged": "train_loss", "step": lambda s: s.step})
    trainer(tmp_dir, [HookCallback([hook])], 3).fit(TinyModel(), loader())
    assert [r["step"] for r in hook.results] == [1, 2, 3]
    for r in hook.results:
        assert torch.is_tensor(r["loss"]) and float(r["loss"]) == pytest.approx(float(r["logged"]))


def test_request_stop_ends_training_after_that_step_and_calls_end(tmp_dir):
    hook = RecordingHook(stop_at=3)
    other = RecordingHook()
    t = trainer(tmp_dir, [HookCallback([hook, other])], 50)
    t.fit(TinyModel(), loader())
    assert t.global_step == 3
    assert other.calls[-2:] == [("after_run", 3), ("end",)]  # the second hook still saw step 3


def test_exception_in_a_step_no_after_run_no_end_profiler_stopped_and_next_fit_traces(tmp_dir):
    hook = RecordingHook(options=RunOptions(trace_level=TraceLevel.FULL_TRACE))
    prof_dir = os.path.join(tmp_dir, "prof")
    t = trainer(tmp_dir, [HookCallback([hook]), ProfilerHook(save_steps=1, output_dir=prof_dir)], 10)
    with pytest.raises(RuntimeError, match="boom at step 3"):
        t.fit(TinyModel(fail_at_step=3), loader())
    assert hook.names() == ["begin", "after_create_session"] + ["before_run", "after_run"] * 2 + ["before_run"]
    assert not torch._C._autograd._profiler_enabled()
    assert timeline_steps(prof_dir) == [2]  # step 3 was traced but failed: no file, no temp file
    assert not [n for n in os.listdir(prof_dir) if n.endswith(".tmp")]

    again = ProfilerHook(save_steps=1, output_dir=os.path.join(tmp_dir, "again"))
    trainer(tmp_dir, [again], 3).fit(TinyModel(), loader())
    assert timeline_steps(os.path.join(tmp_dir, "again")) == [2, 3]
    assert "aten::addmm" in op_names(load_trace(again.saved_paths[0]))


def test_two_callbacks_asking_for_a_trace_share_one_tracer(tmp_dir):
    first = RecordingHook(options=RunOptions(trace_level=TraceLevel.FULL_TRACE))
    second = RecordingHook(options=RunOptions(trace_level=TraceLevel.FULL_TRACE))
    bystander = RecordingHook()
    trainer(tmp_dir, [HookCallback([first]), HookCallback([second, bystander])], 3).fit(TinyModel(), loader())
    for a, b, c in zip(first.metadata, second.metadata, bystander.metadata):
        assert a is b is c and a.step_stats is not None
        # a second profiler started inside the first would record nothing; one tracer records the step
        assert sum(n.op == "aten::addmm" and n.phase == "forward" for n in a.step_stats.all_nodes()) == 2


def test_resume_from_checkpoint_continues_the_schedule(tmp_dir):
    out = os.path.join(tmp_dir, "timelines")
    first = trainer(tmp_dir, [ProfilerHook(save_steps=3, output_dir=out)], 5)
    first.fit(TinyModel(), loader())
    ckpt = os.path.join(tmp_dir, "mid.ckpt")
    first.save_checkpoint(ckpt)
    assert timeline_steps(out) == [3]

    resumed = ProfilerHook(save_steps=3, output_dir=out)
    trainer(tmp_dir, [resumed], 10).fit(TinyModel(), loader(), ckpt_path=ckpt)
    # no duplicate of 3, none missing: 6 and 9 (a fresh schedule would have written 8 instead)
    assert [os.path.basename(p) for p in resumed.saved_paths] == ["timeline-6.json", "timeline-9.json"]
    assert timeline_steps(out) == [3, 6, 9]


def test_default_output_dir_is_the_loggers_run_dir(tmp_dir):
    hook = ProfilerHook(save_steps=2)
    t = trainer(tmp_dir, [hook], 2)
    t.fit(TinyModel(), loader())
    assert t.log_dir.startswith(tmp_dir)
    assert hook.saved_paths == [os.path.join(t.log_dir, "timeline-2.json")]


def test_ranks_not_chosen_do_not_trace(tmp_dir):
    hook = ProfilerHook(save_steps=1, output_dir=tmp_dir, ranks=[1])
    trainer(tmp_dir, [hook], 3).fit(TinyModel(), loader())
    assert timeline_steps(tmp_dir) == []
    hook = hookprof.ProfilerHook(save_steps=1, output_dir=tmp_dir)
    assert hook.timeline_path(5, 1, 2).endswith("timeline-5-rank1.json")


def test_lightning_cli_builds_the_callback_from_config(tmp_dir):
    from lightning.pytorch.cli import LightningCLI

    cli = LightningCLI(
        TinyModel, run=False,
        args=["--trainer.callbacks=lightning_prof.ProfilerHook", "--trainer.callbacks.save_steps=2",
              f"--trainer.callbacks.output_dir={tmp_dir}", "--trainer.max_steps=2",
              "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_dir}"],
    )
    hooks = [c for c in cli.trainer.callbacks if isinstance(c, ProfilerHook)]
    assert len(hooks) == 1 and hooks[0].hook.save_steps == 2
    cli.trainer.fit(cli.model, loader())
    assert timeline_steps(tmp_dir) == [2]


def test_output_dir_that_cannot_be_created_fails_before_the_first_step(tmp_dir):
    hook = RecordingHook()
    bad = hookprof.ProfilerHook(save_steps=1, output_dir="/proc/hookprof-cannot-exist")
    with pytest.raises(ValueError, match=r"output_dir=.*cannot write there"):
        trainer(tmp_dir, [HookCallback([bad, hook])], 3).fit(TinyModel(), loader())
    assert "before_run" not in hook.names()


def test_a_users_own_torch_profiler_keeps_its_trace_and_we_skip_with_one_warning(tmp_dir, caplog):
    hook = ProfilerHook(save_steps=1, output_dir=tmp_dir)
    with torch.profiler.profile() as user_prof:
        trainer(tmp_dir, [hook], 4).fit(TinyModel(), loader())
    assert timeline_steps(tmp_dir) == []
    user_addmm = [e for e in user_prof.events() if e.name == "aten::addmm"]
    assert len(user_addmm) >= 4 * 2  # the user's trace saw every step's two linears
    warnings = [r for r in caplog.records if "another torch profiler is running" in r.getMessage()]
    assert len(warnings) == 1


def test_a_timeline_name_taken_by_something_else_goes_beside_it_and_training_goes_on(tmp_dir, caplog):
    os.mkdir(os.path.join(tmp_dir, "timeline-2.json"))  # a directory squats on the first timeline's name
    hook = ProfilerHook(save_steps=2, output_dir=tmp_dir)
    t = trainer(tmp_dir, [hook], 6)
    t.fit(TinyModel(), loader())
    assert t.global_step == 6 and hook.hook.dropped_outputs == 0
    assert [os.path.basename(p) for p in hook.saved_paths] == ["timeline-2.1.json", "timeline-4.json",
                                                               "timeline-6.json"]
    assert os.path.isdir(os.path.join(tmp_dir, "timeline-2.json"))  # (left alone)
    assert not [n for n in os.listdir(tmp_dir) if n.endswith(".tmp")]
    (said,) = [r.getMessage() for r in caplog.records if "exists" in r.getMessage()]
    assert "timeline-2.json" in said and "timeline-2.1.json" in said


def test_compressed_timelines_and_the_cap_warning_once(tmp_dir, caplog):
    import gzip
    import json

    hook = ProfilerHook(save_steps=2, output_dir=tmp_dir, compress=True, max_events=50)
    trainer(tmp_dir, [hook], 6).fit(TinyModel(), loader())
    assert [os.path.basename(p) for p in hook.saved_paths] == ["timeline-2.json.gz", "timeline-4.json.gz",
                                                               "timeline-6.json.gz"]
    for path in hook.saved_paths:
        with gzip.open(path, "rb") as f:
            trace = json.load(f)
        assert len(trace["traceEvents"]) == 50 and trace["metadata"]["truncated"] is True
        assert trace["distributedInfo"] == {"rank": 0, "world_size": 1}
    assert len([r for r in caplog.records if "was cut at max_events=50" in r.getMessage()]) == 1


def test_fast_dev_run_writes_nothing_and_says_so_once(tmp_dir, caplog):
    """Lightning's smoke test writes no logs or checkpoints: hookprof's callbacks write nothing either."""
    import logging

    import lightning as L

    from lightning_prof import CheckpointSaverHook, StopAtStepHook, SummarySaverHook

    out = os.path.join(tmp_dir, "out")
    callbacks = [ProfilerHook(save_steps=1, output_dir=out),
                 SummarySaverHook(save_steps=1, output_dir=out,
                                  summary_op=hookprof.summary.scalar("loss", lambda s: s.outputs["loss"])),
                 CheckpointSaverHook(os.path.join(out, "ckpt"), save_steps=1), StopAtStepHook(last_step=2)]
    fit = L.Trainer(fast_dev_run=4, callbacks=callbacks, default_root_dir=tmp_dir, accelerator="cpu",
                    enable_progress_bar=False, enable_model_summary=False)
    with caplog.at_level(logging.INFO, logger="lightning_prof"):
        fit.fit(TinyModel(), loader())
    assert fit.global_step == 4  # (StopAtStepHook(last_step=2) did not stop the smoke test either)
    assert not os.path.exists(out) or os.listdir(out) == []
    assert callbacks[0].saved_paths == []
    (message,) = [r.getMessage() for r in caplog.records if r.name.startswith("lightning_prof")]
    assert "fast_dev_run" in message and all(key in message for key in ("ProfilerHook(save_steps=1)",
                                                                        "StopAtStepHook(last_step=2)"))


def test_beside_lightnings_pytorch_profiler_both_write_valid_output_and_the_fit_goes_on(tmp_dir, caplog):
    """Lightning's PyTorchProfiler starts torch's profiler inside steps hookprof traces (its schedule is its
    own): a second start raised out of the training step and ended the fit. hookprof now leaves torch's
    profiler to it, traces the steps' phases, and says so once."""
    import glob
    import json
    import logging

    hook = ProfilerHook(save_steps=2, output_dir=os.path.join(tmp_dir, "timelines"))
    fit = trainer(tmp_dir, [hook], max_steps=12, profiler="pytorch")
    with caplog.at_level(logging.WARNING):
        fit.fit(TinyModel(), loader(n=200))
    assert fit.global_step == 12
    assert timeline_steps(os.path.join(tmp_dir, "timelines")) == [2, 4, 6, 8, 10, 12]
    for path in hook.saved_paths:
        trace = load_trace(path)
        assert trace["metadata"]["tracer"] == "host" and not op_events(trace)
        assert {"forward", "backward", "optimizer"} <= {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    (lightnings,) = glob.glob(os.path.join(tmp_dir, "**", "*.pt.trace.json"), recursive=True)
    with open(lightnings) as f:
        assert any(e.get("name") == "aten::addmm" for e in json.load(f)["traceEvents"])
    (warning,) = [r.getMessage() for r in caplog.records if "holds torch's profiler" in r.getMessage()]
    assert "PyTorchProfiler" in warning
