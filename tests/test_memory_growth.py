"""MemoryGrowthChecker on real Lightning fits: a module that keeps each step's activation in a list is named
(module, op, code line, bytes per step), from the live Profiler and from the saved profile; a healthy
300-step run traced every 50 steps, whose gradients outlive every step, gets nothing."""

import inspect
import re

import torch

from hookprof.profiler import Profiler
from hookprof.profiler.advisor import MEMORY_GROWTH_MIN_BYTES
from hookprof.profiler.profile_data import RESIDUAL
from hookprof.profiler.views import format_memory
from lightning_prof import ProfilerHook
from tests.lightning_models import TinyModel, loader, trainer
from tests.test_cli import hookprof

BATCH, WIDTH = 8, 1024


class KeepsActivations(TinyModel):
    """Appends each step's activation of `wide` to a list it never empties: the classic leak."""

    def __init__(self):
        super().__init__()
        self.wide = torch.nn.Linear(8, WIDTH)
        self.kept = []

    def forward(self, x):
        h = self.wide(x)
        self.kept.append(h.detach())  # for "later": every step's activation, forever
        return self.fc2(torch.relu(self.fc1(x))) + 0 * h.mean()


class AdamModel(TinyModel):
    """A healthy float32 model trained with Adam (its state is made once, then updated in place)."""

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def fit(model, tmp_path, steps, every):
    prof = Profiler(model)
    hook = ProfilerHook(save_steps=every, profiler=prof, output_dir=str(tmp_path), tensorboard=False,
                        with_stack=True)
    trainer(str(tmp_path), [hook], steps).fit(model, loader(steps * BATCH, BATCH))
    return prof


def test_a_module_that_keeps_each_steps_activation_is_named(tmp_path, capsys):
    model = KeepsActivations()
    prof = fit(model, tmp_path, 40, 10)
    capsys.readouterr()
    advice = prof.advise()
    printed = capsys.readouterr().out
    steps = prof.data.step_numbers()
    assert len(steps) >= 3 and all(prof.data.steps[(0, s)].allocated for s in steps)
    [line] = advice["MemoryGrowthChecker"]["reports"]
    kept = BATCH * WIDTH * 4  # one float32 activation of `wide` a step
    assert len(model.kept) == 40 and model.kept[0].nbytes == kept
    forward_line = inspect.getsourcelines(KeepsActivations.forward)[1]  # torch names a frame by its function's line
    where = rf"KeepsActivations/wide at \S*test_memory_growth\.py\({forward_line}\)"
    span = steps[-1] - steps[0]
    assert re.fullmatch(
        rf"Memory growth: aten::addmm in {where}: forward makes {re.escape(format_memory(kept))} per step that is "
        rf"still allocated at the step's end, in each of the {len(steps)} traced steps \(steps {steps[0]}-"
        rf"{steps[-1]}\): {re.escape(format_memory(kept * span))} more held at step {steps[-1]} than at step "
        rf"{steps[0]}\. Something keeps each step's tensors .*", line), line
    evidence = advice["MemoryGrowthChecker"]["findings"][0]["evidence"]
    assert evidence["bytes_per_step"] == kept and evidence["steps"] == steps and evidence["device"] == "/host:CPU"
    assert evidence["kept_bytes"] == dict.fromkeys(steps, float(kept))
    assert f"\nMemoryGrowthChecker:\n{line}\n" in printed
    # the saved profile keeps what the checker reads: `hookprof advise` names it the same way
    (tmp_path / "run.prof").write_bytes(prof.serialize_to_string())
    done = hookprof("advise", "run.prof", "--checker", "MemoryGrowthChecker", cwd=tmp_path)
    assert done.returncode == 0 and done.stdout == f"\nMemoryGrowthChecker:\n{line}\n", done.stderr


def test_a_healthy_300_step_run_traced_every_50_steps_grows_nothing(tmp_path, capsys):
    prof = fit(AdamModel(), tmp_path, 300, 50)
    capsys.readouterr()
    advice = prof.advise()
    steps = prof.data.step_numbers()
    assert steps == list(range(50, 301, 50)) and all(prof.data.steps[(0, s)].allocated for s in steps)
    # what outlives each step is there, and is what a training step keeps by design: the gradients
    kept = {}
    for node in prof.data.nodes.values():
        for (_, step), figures in node.steps.items():
            if figures[RESIDUAL]:
                kept.setdefault(node.phase, {}).setdefault(step, 0.0)
                kept[node.phase][step] += figures[RESIDUAL]
    grads = sum(p.numel() * 4 for p in AdamModel().parameters())
    assert kept["backward"] == dict.fromkeys(steps, float(grads))
    assert all(v < MEMORY_GROWTH_MIN_BYTES for phase, by_step in kept.items() if phase != "backward"
               for v in by_step.values())
    assert advice["MemoryGrowthChecker"] == {"reports": [], "findings": []}


def test_two_traced_steps_are_no_trend(tmp_path):
    prof = fit(KeepsActivations(), tmp_path, 40, 20)  # steps 20 and 40 only
    assert len(prof.data.steps) == 2
    assert prof.advise({"MemoryGrowthChecker": {}})["MemoryGrowthChecker"]["reports"] == []
