"""Every bad argument fails at construction (before training) with a message naming the argument."""

import os

import pytest

import hookprof
import keras_prof
import lightning_prof

PROFILER_HOOKS = [hookprof.ProfilerHook, lightning_prof.ProfilerHook, keras_prof.ProfilerHook]


@pytest.mark.parametrize("cls", PROFILER_HOOKS)
@pytest.mark.parametrize("kwargs,error,pattern", [
    ({}, ValueError, r"set `save_steps` or `save_secs` .*or give `triggers`"),
    ({"save_steps": 5, "save_secs": 5}, ValueError, r"set only one of `save_steps` or `save_secs`"),
    ({"save_steps": 0}, ValueError, r"`save_steps` must be an int >= 1"),
    ({"save_steps": -3}, ValueError, r"`save_steps` must be an int >= 1"),
    ({"save_steps": 2.5}, TypeError, r"`save_steps` must be an int >= 1"),
    ({"save_steps": "100"}, TypeError, r"save_steps='100'.*`save_steps` must be an int"),
    ({"save_steps": True}, TypeError, r"`save_steps` must be an int >= 1"),
    ({"save_secs": 0}, ValueError, r"`save_secs` must be a number of seconds > 0"),
    ({"save_secs": -1.0}, ValueError, r"`save_secs` must be a number of seconds > 0"),
    ({"save_secs": float("nan")}, ValueError, r"`save_secs` must be a number of seconds > 0"),
    ({"save_secs": float("inf")}, ValueError, r"`save_secs` must be a number of seconds > 0"),
    ({"save_secs": "5"}, TypeError, r"`save_secs` must be a number of seconds"),
    ({"save_steps": 1, "show_dataflow": "yes"}, TypeError, r"`show_dataflow` must be True or False"),
    ({"save_steps": 1, "show_memory": 1}, TypeError, r"`show_memory` must be True or False"),
    ({"save_steps": 1, "output_dir": 3}, TypeError, r"`output_dir` must be a path"),
    ({"save_steps": 1, "output_dir": b"x"}, TypeError, r"`output_dir` must be a path"),
    ({"save_steps": 1, "compress": "gzip"}, TypeError, r"`compress` must be True or False"),
    ({"save_steps": 1, "max_events": 0}, ValueError, r"`max_events` must be an int >= 1, or None"),
    ({"save_steps": 1, "max_events": 1.5}, ValueError, r"`max_events` must be an int >= 1, or None"),
])
def test_bad_arguments_name_the_argument(cls, kwargs, error, pattern):
    with pytest.raises(error, match=pattern) as info:
        cls(**kwargs)
    assert "ProfilerHook(" in str(info.value)  # quotes the call the user wrote


@pytest.mark.parametrize("cls", PROFILER_HOOKS)
def test_output_dir_that_is_a_file_is_refused(cls, tmp_path):
    target = tmp_path / "afile"
    target.write_text("x")
    with pytest.raises(ValueError, match=r"output_dir=.*is a file, not a directory; pass a directory for `output_dir`"):
        cls(save_steps=1, output_dir=str(target))
    with pytest.raises(ValueError, match=r"is a file, not a directory"):  # a parent that is a file, too
        cls(save_steps=1, output_dir=str(target / "sub"))


@pytest.mark.parametrize("ranks", ["0", [0, -1], [True], 1.0, []])
def test_bad_ranks(ranks):
    with pytest.raises(TypeError, match=r"`ranks` must be None \(all ranks\), a rank number, or a non-empty list"):
        lightning_prof.ProfilerHook(save_steps=1, ranks=ranks)


def test_output_dir_expands_user_and_env_vars(tmp_path, monkeypatch):
    monkeypatch.setenv("HOOKPROF_TEST_DIR", str(tmp_path))
    hook = hookprof.ProfilerHook(save_steps=1, output_dir="$HOOKPROF_TEST_DIR/prof")
    assert hook.output_dir == os.path.join(str(tmp_path), "prof")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hookprof.ProfilerHook(save_steps=1, output_dir="~/x").output_dir == os.path.join(str(tmp_path), "x")
    assert not os.path.exists(os.path.join(str(tmp_path), "prof"))  # created at begin(), not at construction


@pytest.mark.parametrize("callback", [lightning_prof.HookCallback, keras_prof.HookCallback])
def test_hook_callbacks_refuse_non_hooks(callback):
    with pytest.raises(TypeError, match=r"`hooks\[0\]` \(str\) is not a SessionRunHook"):
        callback(hooks=["ProfilerHook"])
