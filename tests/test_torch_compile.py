"""`torch.compile`d models in real Lightning fits under ProfilerHook: one warning a fit saying why module scopes are
missing and what gives them; scopes kept where hooks still run (a compiled submodule's own call); a module
compiled in place (`model.compile()`) traced without hookprof's forward hooks, so the traced steps run the same
compiled code as the others (with the hooks, dynamo recompiled it inside the first traced step).

The `eager` backend: dynamo's tracing and guards, which decide all of this, without inductor's C++ compile."""

from __future__ import annotations

import logging

import torch

from lightning_prof import ProfilerHook
from tests.conftest import load_trace
from tests.lightning_models import TinyModel, loader, trainer


class Unlogged(TinyModel):
    """TinyModel without `self.log`, which Lightning's own code cannot run inside a compiled training_step."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)


def traced_fit(tmp_path, caplog, model, fit_model=None) -> tuple[list[dict], list[str]]:
    """Fit `fit_model` (default `model`) 9 steps tracing steps 3, 6, 9: each timeline's complete events and
    hookprof's warnings about torch.compile."""
    hook = ProfilerHook(save_steps=3, output_dir=str(tmp_path / "prof"), tensorboard=False)
    with caplog.at_level(logging.WARNING, logger="hookprof"):
        trainer(str(tmp_path), [hook], max_steps=9).fit(model if fit_model is None else fit_model, loader(n=128))
    said = [r.getMessage() for r in caplog.records if "torch.compile made" in r.getMessage()]
    events = [[e for e in load_trace(path)["traceEvents"] if e.get("ph") == "X"] for path in hook.saved_paths]
    assert len(events) == 3
    return events, said


def scopes(events: list[dict]) -> set[str]:
    return {e["args"]["scope"] for e in events if "scope" in e.get("args", {})}


def test_a_model_compiled_in_place_is_traced_without_hooks_that_would_recompile_it(tmp_path, caplog):
    model = TinyModel()
    model.compile(backend="eager")
    timelines, said = traced_fit(tmp_path, caplog, model)
    assert said == ["The model runs code torch.compile made (TinyModel.compile()): hookprof adds no module scopes "
                    "in this fit: its forward hooks would make torch recompile a module compiled in place, with graph "
                    "breaks, inside each traced step. To see every module's scope, trace a run without torch.compile "
                    "(or with TORCHDYNAMO_DISABLE=1)."]
    for events in timelines:
        names = {e["name"] for e in events}
        assert "Torch-Compiled Region: 0/0" in names  # the compiled forward ran, traced
        assert not any("compile_inner" in name or "Region: 1/" in name for name in names)  # no recompile, no break
        assert scopes(events) == {"optimizer/SGD"}


def test_lightnings_compiled_training_step_says_why_it_has_no_module_scopes(tmp_path, caplog):
    model = Unlogged()
    timelines, said = traced_fit(tmp_path, caplog, model, torch.compile(model, backend="eager"))
    assert len(said) == 1 and said[0].startswith(
        "The model runs code torch.compile made (torch.compile(Unlogged.forward), torch.compile(Unlogged.training_step"
        "), torch.compile(Unlogged.validation_step) and 2 more): module calls inside compiled code call no forward "
        "hooks")
    assert all(scopes(events) == {"optimizer/SGD"} for events in timelines)


def test_a_compiled_submodule_keeps_its_scope_and_the_others_theirs(tmp_path, caplog):
    model = TinyModel()
    model.fc1 = torch.compile(model.fc1, backend="eager")
    timelines, said = traced_fit(tmp_path, caplog, model)
    assert len(said) == 1 and said[0].startswith("The model runs code torch.compile made (torch.compile(TinyModel.fc1"
                                                 ")): module calls inside compiled code")
    for events in timelines:
        assert scopes(events) == {"TinyModel", "TinyModel/fc1", "TinyModel/fc2", "optimizer/SGD"}
        fc1 = {e["name"] for e in events if e.get("args", {}).get("scope") == "TinyModel/fc1"}
        assert any(name.startswith("Torch-Compiled Region") for name in fc1)  # its compiled code, under its scope


def test_what_runs_compiled_is_found_once_a_fit_and_anew_in_the_next(tmp_path, caplog, monkeypatch):
    # a fit's traced steps share what its first found compiled (no walk of every module's attributes each
    # traced step); a model compiled in place after one fit is found in the next, which drops the hooks
    from hookprof.tracing import torch_tracer

    looked_at = []
    find = torch_tracer._compiled
    monkeypatch.setattr(torch_tracer, "_compiled", lambda path, module: looked_at.append(path) or find(path, module))
    model = TinyModel()
    timelines, said = traced_fit(tmp_path / "plain", caplog, model)
    assert said == [] and sorted(looked_at) == ["TinyModel", "TinyModel.fc1", "TinyModel.fc2"]  # (3 traced steps)
    assert all(scopes(events) == {"TinyModel", "TinyModel/fc1", "TinyModel/fc2", "optimizer/SGD"}
               for events in timelines)
    caplog.clear()
    model.compile(backend="eager")
    timelines, said = traced_fit(tmp_path / "compiled", caplog, model)
    assert len(said) == 1 and said[0].startswith("The model runs code torch.compile made (TinyModel.compile())")
    assert len(looked_at) == 6
    assert all(scopes(events) == {"optimizer/SGD"} for events in timelines)
