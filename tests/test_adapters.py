"""The adapters' callbacks are made from the core hooks' signatures (`hookprof.hooks.adapter`, issue 27 item 5).

Each `lightning_prof` / `keras_prof` callback takes exactly its hook's arguments, less the few its framework
decides, plus the framework's own (`name=`); a keyword added to a hook appears in both; `help()`, jsonargparse
(what LightningCLI reads) and the generated `.pyi` stubs (what type checkers read) show the real parameters.
"""

from __future__ import annotations

import copy
import inspect
import pickle
import pydoc

import jsonargparse
import pytest

import keras_prof
import lightning_prof
from hookprof import hooks
from hookprof.hooks import adapter
from hookprof.hooks.adapter import callback_class, made_from, stub
from keras_prof import callbacks as keras_callbacks
from lightning_prof import callbacks as lightning_callbacks

ADAPTERS = [lightning_prof, keras_prof]
# what each framework decides itself (not in its callbacks' signatures), and the arguments of its own
OMITTED = {"lightning_prof": {}, "keras_prof": {"ProfilerHook": {"ranks"}, "FeedFnHook": {"into_batch"}}}
OWN = {"lightning_prof": ["name"], "keras_prof": []}
CORE_HOOKS = [getattr(hooks, name) for name in hooks.__all__
              if isinstance(getattr(hooks, name), type) and issubclass(getattr(hooks, name), hooks.SessionRunHook)
              and getattr(hooks, name) is not hooks.SessionRunHook]


def test_every_core_hook_has_a_callback_in_both_adapters():
    assert len(CORE_HOOKS) == 10
    for package in ADAPTERS:
        for hook_class in CORE_HOOKS:
            callback = getattr(package, hook_class.__name__)
            assert made_from(callback).hook_class is hook_class
            assert issubclass(callback, package.HookCallback)
            assert callback.__module__ == f"{package.__name__}.callbacks"


@pytest.mark.parametrize("package", ADAPTERS, ids=lambda p: p.__name__)
@pytest.mark.parametrize("hook_class", CORE_HOOKS, ids=lambda c: c.__name__)
def test_a_callback_takes_its_hook_s_arguments(package, hook_class):
    """Names, order, kinds, annotations and defaults are the hook's (the schedule's test `clock` and what the
    framework decides are left out; `output_dir` defaults to None: the framework picks the directory)."""
    core = inspect.signature(hook_class)
    mine = inspect.signature(getattr(package, hook_class.__name__))
    left_out = {"clock"} | OMITTED[package.__name__].get(hook_class.__name__, set())
    expected = [p.replace(default=None) if p.name == "output_dir" else p
                for p in core.parameters.values() if p.name not in left_out]
    params = list(mine.parameters.values())
    hints = {p.name: p.annotation for p in params}
    core_hints = {p.name: p.annotation for p in inspect.signature(hook_class, eval_str=True).parameters.values()}
    assert [p.name for p in params] == [p.name for p in expected] + OWN[package.__name__]
    assert [(p.kind, p.default) for p in params[:len(expected)]] == [(p.kind, p.default) for p in expected]
    assert all(hints[p.name] == core_hints[p.name] for p in expected)
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[len(expected):])


class WiderStopAtStepHook(hooks.StopAtStepHook):
    """A core hook that grew an argument (as a new release's might)."""

    def __init__(self, num_steps: int | None = None, last_step: int | None = None, grace: int = 0) -> None:
        super().__init__(num_steps, last_step)
        self.grace = grace


@pytest.mark.parametrize("framework", [lightning_callbacks.LIGHTNING, keras_callbacks.KERAS],
                         ids=["lightning", "keras"])
def test_a_new_keyword_on_a_core_hook_appears_in_both_adapters(framework):
    callback = callback_class(WiderStopAtStepHook, framework, "A StopAtStepHook with grace.")
    assert "grace" in inspect.signature(callback).parameters
    made = callback(last_step=5, grace=2)
    assert (made.hook.grace, made.hook.stop_at_step) == (2, 5)
    assert callback(None, 7, 3).hook.grace == 3  # positionally too, in the hook's order
    with pytest.raises(TypeError, match=r"^WiderStopAtStepHook\(\): .*'grace_steps'"):
        callback(last_step=5, grace_steps=2)


def test_help_and_the_signature_name_the_real_parameters():
    text = pydoc.render_doc(lightning_prof.ProfilerHook, renderer=pydoc.plaintext)
    assert "ProfilerHook(save_steps: int | None = None, save_secs: float | None = None" in text
    assert "*, name: str | None = None" in text
    assert "logger's run directory" in text  # the class docstring: what Lightning adds
    # __init__'s docstring: the hook's Args for the arguments taken (not `clock`) and the base's `name`, and Raises
    init = lightning_prof.ProfilerHook.__init__.__doc__
    assert "    save_steps: write a timeline every this many global steps." in init
    assert "    name: a word that tells this callback apart" in init
    assert "clock:" not in init and "ranks:" not in keras_prof.ProfilerHook.__init__.__doc__
    assert "Raises:\n    ValueError:" in init
    assert "saved_paths" in text  # the hook's properties are the callback's


def test_a_wrong_argument_names_the_callback_and_the_argument():
    with pytest.raises(TypeError, match=r"^ProfilerHook\(\): got an unexpected keyword argument 'save_step'$"):
        lightning_prof.ProfilerHook(save_step=100)
    with pytest.raises(TypeError, match=r"'ranks'"):
        keras_prof.ProfilerHook(save_steps=100, ranks=0)  # one Keras process is one rank
    with pytest.raises(TypeError, match=r"'clock'"):
        lightning_prof.StopAtStepHook(last_step=3, clock=lambda: 0.0)
    with pytest.raises(ValueError, match=r"save_steps"):  # the hook's own checks, unchanged
        lightning_prof.ProfilerHook(save_steps=0)


def test_the_callbacks_read_the_hook_s_properties():
    callback = keras_prof.ProfilerHook(save_steps=3, keep_last=2)
    assert (callback.saved_paths, callback.removed_timelines, callback.skipped_traces) == ([], 0, 0)
    with pytest.raises(AttributeError):
        callback.saved_paths = []
    assert lightning_prof.StopAtStepHook(last_step=5).stop_at_step == 5
    final = lightning_prof.FinalOpsHook({"loss": "loss"})
    assert final.final_ops_values is None
    assert made_from(lightning_prof.CheckpointSaverHook).properties == ("listeners", "save_path", "saved_paths")


def test_a_callback_travels_to_another_process_and_copies():
    """ddp_spawn pickles the callbacks: a made class is found again by its module and name."""
    callback = lightning_prof.ProfilerHook(save_steps=7, name="fast")
    for copied in (pickle.loads(pickle.dumps(callback)), copy.deepcopy(callback)):
        assert type(copied) is lightning_prof.ProfilerHook
        assert (copied.hook.save_steps, copied.name, copied.state_key) == (7, "fast", callback.state_key)


def test_jsonargparse_reads_the_signature_as_lightning_cli_does(tmp_path):
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(lightning_prof.ProfilerHook, "profiler")
    config = parser.parse_args(["--profiler.save_steps=3", "--profiler.ranks=[0, 1]",
                                f"--profiler.output_dir={tmp_path}", "--profiler.name=fast"])
    callback = parser.instantiate(config).profiler
    assert type(callback) is lightning_prof.ProfilerHook
    assert (callback.hook.save_steps, callback.hook.ranks, callback.hook.output_dir, callback.name) == (
        3, frozenset({0, 1}), str(tmp_path), "fast")
    with pytest.raises(jsonargparse.ArgumentError, match="save_steps"):
        parser.parse_args(["--profiler.save_steps=often"])
    help_text = parser.format_help()
    assert "--profiler.keep_last" in help_text and "--profiler.clock" not in help_text
    assert "keep only the newest" in help_text  # the hook's Args, through __init__'s docstring


@pytest.mark.parametrize("module", [lightning_callbacks, keras_callbacks], ids=lambda m: m.__name__)
def test_the_stub_is_written_from_the_current_signatures(module):
    """`callbacks.pyi` is what type checkers read: regenerate it with
    `python -m hookprof.hooks.adapter lightning_prof.callbacks keras_prof.callbacks` when this fails."""
    path = module.__file__.replace(".py", ".pyi")
    with open(path, encoding="utf-8") as f:
        assert f.read() == stub(module), f"{path} is stale"


def test_the_stub_shows_what_the_module_exports():
    text = stub(keras_callbacks)
    assert "class ProfilerHook(HookCallback):" in text
    assert "    hook: hookprof.hooks.profiler_hook.ProfilerHook" in text
    assert "        save_steps: int | None = ...,\n        save_secs: float | None = ...,\n" in text
    assert "ranks" not in text and "clock" not in text and "name: str | None" not in text
    assert "    saved_paths: Final[list[str]]\n" in text
    assert "def model_saver(session: Any) -> Callable[[str], str | None]: ..." in text
    assert "        name: str | None = ...,\n    ) -> None: ..." in stub(lightning_callbacks)


def test_the_stub_is_laid_out_by_ruff():
    """ruff sorts the imports (the project's isort settings: hookprof and the adapters first party) and wraps
    what does not fit in 120 characters: the stub passes the project's lint as it is written."""
    text = stub(lightning_callbacks)
    imports = [line for line in text.splitlines() if line.startswith(("import ", "from "))]
    assert imports.index("import os") < imports.index("from typing import Any, Final") < \
        imports.index("import hookprof.hooks.profiler_hook") < \
        imports.index("from hookprof.profiler.profiler import Profiler") < \
        imports.index("from lightning_prof.hook_callback import HookCallback")
    assert max(len(line) for line in text.splitlines()) <= 120
    assert text.endswith('    "SummarySaverHook",\n    "trainer_saver",\n]\n')  # (__all__, one name a line)


def test_the_adapter_refuses_its_own_mistakes_at_import():
    with pytest.raises(TypeError, match=r"StopAtStepHook: .*\['last_stp'\]"):
        callback_class(hooks.StopAtStepHook, keras_callbacks.KERAS, "", omit=("last_stp",))
    with pytest.raises(TypeError, match=r"`feed_fn` is required"):
        callback_class(hooks.FeedFnHook, keras_callbacks.KERAS, "", omit=("feed_fn",))
    with pytest.raises(TypeError, match=r"_Extra adds \['flush'\], which the stub would not show"):
        callback_class(hooks.StopAtStepHook, keras_callbacks.KERAS, "", parent=_Extra)
    assert adapter.main(["--check", "lightning_prof.callbacks", "keras_prof.callbacks"]) == 0


class _Extra(keras_prof.HookCallback):
    def flush(self):  # a public name the base has not
        pass
