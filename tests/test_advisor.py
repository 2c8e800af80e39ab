"""The advisor on real traced Lightning fits: nothing on a healthy float32 Adam model, exactly one line per
planted problem (a float64 layer, an `.item()` in forward, a slow DataLoader), and its report on stdout."""

import re
import time

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from hookprof.profiler import ALL_ADVICE, Profiler
from hookprof.profiler.advisor import report_text
from lightning_prof import ProfilerHook
from tests.lightning_models import TinyModel, loader, trainer

HERE = r"test_advisor\.py\(\d+\): forward"


class AdamModel(TinyModel):
    """A healthy float32 model trained with torch.optim.Adam (its defaults: per-tensor updates on the CPU)."""

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Float64Head(AdamModel):
    def __init__(self):
        super().__init__()
        self.head64 = torch.nn.Linear(16, 16).double()

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.fc2(self.head64(h.double()).float())  # a float64 layer between casts


class ItemInForward(AdamModel):
    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if h.mean().item() > 1e9:  # a value read into Python in forward
            h = h * 0
        return self.fc2(h)


class SleepyData(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(0.004)  # 8 items a batch: ~32 ms of loading before each step
        return torch.randn(8), torch.randn(1)


class ConvertedBeforeTheNextStep(L.Callback):
    """Waits at the end of each traced step until the hook has converted it (into the Profiler: on its background
    thread, holding the GIL most of the time). Steps of milliseconds left it running three steps later, inside
    the data waits the input checker reads: on a loaded machine its GIL turns stretched those waits."""

    def __init__(self, hook, every):
        self.hook, self.every = hook, every

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step % self.every == 0:
            assert self.hook.saved_paths  # (waits for the traced step to be converted and written)


def fit_and_advise(model, tmp_path, capsys, data=None):
    """Trace every 4th step of a 16-step fit into a Profiler; return it, its advice, and what advise() printed.

    Each traced step follows untraced ones, after the last traced step's conversion: the input checker's
    evidence (it needs 3 such steps), which reads the wall time from one step's end to the next one's start. So
    nothing but the batch and the loop runs there: no conversion (`ConvertedBeforeTheNextStep`) and no logger
    writing every step's metrics (`log_every_n_steps=1`). With them, a healthy model's steps waited 10-60 ms
    each on a loaded machine (load 7-9 on 2 cores; about 0.5 ms idle) and were reported as an input stall: 3 fits
    of 3 at load 7; at load 9, with the conversion waited for, 5 of this file's 12 tests in two runs; with
    neither, none in four runs."""
    prof = Profiler(model)
    hook = ProfilerHook(save_steps=4, profiler=prof, output_dir=str(tmp_path), tensorboard=False, with_stack=True)
    settled = ConvertedBeforeTheNextStep(hook, 4)
    trainer(str(tmp_path), [hook, settled], 16, logger=False).fit(model, data or loader())
    capsys.readouterr()  # drop the fit's own output
    advice = prof.advise()
    printed = capsys.readouterr().out
    print({name: checker["reports"] for name, checker in advice.items()})  # shown with -s, and on failure
    return prof, advice, printed


def all_reports(advice):
    return [(name, line) for name, checker in advice.items() for line in checker["reports"]]


def test_a_healthy_float32_adam_model_gets_no_advice(tmp_path, capsys):
    prof, advice, printed = fit_and_advise(AdamModel(), tmp_path, capsys)
    # what the old checkers took for problems is in the profile: Adam reads its 0-d float32 CPU step counter
    # with .item() once per parameter, and torch passes its Python-float betas/lr as 0-d float64 tensors
    nodes = list(prof.data.nodes.values())
    counters = [n for n in nodes if n.op == "aten::item" and n.scope == "optimizer/Adam"]
    assert len(counters) == 4 and all(n.input_shapes == [[]] and n.input_dtypes == ["float32"] for n in counters)
    scalars = [n for n in nodes if n.phase == "optimizer" and "float64" in n.input_dtypes]
    assert scalars and all(s == [] for n in scalars for s, d in zip(n.input_shapes, n.input_dtypes) if d == "float64")
    assert set(advice) == set(ALL_ADVICE)
    assert all_reports(advice) == []
    assert all(checker["findings"] == [] for checker in advice.values())
    # printed as tfprof's advisor printed it: every checker run, each with its (here: no) reports
    assert printed == "".join(f"\n{name}:\n" for name in advice)


def test_a_float64_layer_is_named_once_with_its_module_and_line(tmp_path, capsys):
    _, advice, printed = fit_and_advise(Float64Head(), tmp_path, capsys)
    [(checker, line)] = all_reports(advice)
    assert checker == "OperationChecker"
    assert re.match(rf"float64 compute in Float64Head/head64 at \S*{HERE} \(", line), line
    finding = advice["OperationChecker"]["findings"][0]
    # the layer's forward and backward compute, and Adam updating its float64 weight, in one finding
    assert {"aten::addmm", "aten::mm"} <= set(finding["evidence"]["ops"])
    assert 0 < finding["evidence"]["optimizer_micros"] < finding["evidence"]["micros"]
    assert printed == report_text(advice) and f"\nOperationChecker:\n{line}\n" in printed


def test_an_item_in_forward_is_named_once_as_a_host_sync(tmp_path, capsys):
    _, advice, printed = fit_and_advise(ItemInForward(), tmp_path, capsys)
    [(checker, line)] = all_reports(advice)
    assert checker == "HostSyncChecker"
    assert re.match(rf"Host sync: \.item\(\) in ItemInForward at \S*{HERE} reads a tensor's value into Python, "
                    r"1x per step", line), line
    evidence = advice["HostSyncChecker"]["findings"][0]["evidence"]
    assert evidence["op"] == "aten::item" and evidence["ops"] == ["aten::_local_scalar_dense", "aten::item"]
    assert evidence["on_device"] is False and evidence["per_step"] == 1
    assert f"\nHostSyncChecker:\n{line}\n" in printed


def test_a_slow_dataloader_is_named_once_as_an_input_stall(tmp_path, capsys):
    _, advice, printed = fit_and_advise(AdamModel(), tmp_path, capsys, DataLoader(SleepyData(), batch_size=8))
    [(checker, line)] = all_reports(advice)
    assert checker == "InputPipelineChecker" and line.startswith("Input stall: each step waits "), line
    evidence = advice["InputPipelineChecker"]["findings"][0]["evidence"]
    assert evidence["data_wait_us"] >= 8 * 4000  # the sleeps, at least
    assert evidence["steps"] == [4, 8, 12, 16]  # (each after an untraced step: a traced one's wait holds its work)
    assert list(advice)[0] == "InputPipelineChecker"
    assert printed.startswith(f"\nInputPipelineChecker:\n{line}\n")


class SlowToConvert(Profiler):
    """A Profiler whose steps take 0.5 s to add (on hookprof's background thread): much longer than the few ms
    of the untraced step between two traced ones, so each traced step's data wait shares the process with the
    conversion of the one before."""

    def add_step(self, *args, **kwargs):
        time.sleep(0.5)
        return super().add_step(*args, **kwargs)


def test_a_wait_that_hookprofs_own_work_shared_is_marked_and_no_evidence_of_an_input_stall(tmp_path, capsys):
    model = AdamModel()
    prof = SlowToConvert(model)
    hook = ProfilerHook(save_steps=2, profiler=prof, output_dir=str(tmp_path), tensorboard=False)
    trainer(str(tmp_path), [hook], 12, logger=False).fit(model, DataLoader(SleepyData(), batch_size=8))
    traced = sorted(prof.data.steps)
    assert [step for _, step in traced] == [2, 4, 6, 8, 10, 12]
    # the first traced step's wait had no earlier conversion beside it; every later one had
    shared = {step: prof.data.steps[(0, step)].data_wait_shared for _, step in traced}
    assert shared == {2: False, 4: True, 6: True, 8: True, 10: True, 12: True}
    # the timeline's wait span says so
    from hookprof.trace.reader import read_timeline

    waits = {step: [n for dev in read_timeline(str(tmp_path / f"timeline-{step}.json")).dev_stats
                    for n in dev.node_stats if n.op == "data_wait"] for step in (2, 4)}
    assert [bool(n.args and n.args.get("shared_with_hookprof")) for n in waits[2] + waits[4]] == [False, True]
    # the loader's 32 ms waits are real, but every step that would show them shared its wait: no finding
    # (the evidence needs three steps), where the rule of the untraced step before would have taken 4 to 12
    capsys.readouterr()
    advice = prof.advise()
    assert advice["InputPipelineChecker"]["findings"] == []
    assert all(prof.data.steps[(0, step)].data_wait_micros >= 8 * 4000 for step in (4, 6, 8))
    # a saved profile keeps the marks
    loaded = Profiler.load(prof.serialize_to_string())
    assert {step: loaded.data.steps[(0, step)].data_wait_shared for _, step in traced} == shared


def test_a_step_that_hookprofs_own_work_ran_beside_is_marked(tmp_path):
    """A traced step's own span says when hookprof's workers had work during it (its ops' times may be
    stretched): here a job of 0.1 s on the disk's thread, handed over inside step 4; step 2, the fit's first
    traced step, had nothing beside it."""
    from hookprof._runtime.background import WRITES
    from hookprof.trace.reader import read_timeline

    class BusyDisk(L.Callback):  # (after the hook: the step's trace runs already)
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 3:  # (the batch that makes step 4)
                WRITES.submit(lambda: time.sleep(0.1))

    hook = ProfilerHook(save_steps=2, output_dir=str(tmp_path), tensorboard=False)
    trainer(str(tmp_path), [hook, BusyDisk()], 4, logger=False).fit(AdamModel(), loader())
    marked = {}
    for step in (2, 4):
        (span,) = [n for dev in read_timeline(str(tmp_path / f"timeline-{step}.json")).dev_stats
                   for n in dev.node_stats if n.op == "train_step"]
        marked[step] = bool(span.args and span.args.get("shared_with_hookprof"))
    assert marked == {2: False, 4: True}


@pytest.mark.parametrize("frames,line,caller", [
    (["train.py(9): <module>", "model.py(23): forward", "nn.Module: Linear_0", "torch/nn/modules/linear.py(125): "
      "forward", "<built-in function linear>"], "model.py(23): forward", "torch/nn/modules/linear.py(125): forward"),
    (["torch/optim/adam.py(347): _single_tensor_adam", "torch/optim/optimizer.py(90): _get_value",
      "<built-in method item of Tensor object>"], None, "torch/optim/optimizer.py(90): _get_value"),
])
def test_code_lines_are_source_frames_not_module_calls_or_builtins(frames, line, caller):
    from hookprof.profiler.advisor import caller_frame, user_code_line

    assert user_code_line(frames) == line
    assert caller_frame(frames) == caller
