"""Property-based tests: every public constructor and option dict either accepts a value that its documented
rules allow, or refuses it before training with an error naming the argument; serialized profiles of any
bytes are loaded or refused cleanly, with memory bounded by the declared size."""

import math
import os
import struct
import tempfile
import zlib

from hypothesis import given, settings
from hypothesis import strategies as st

import hookprof
import keras_prof
import lightning_prof
from hookprof.profiler import ProfileFormatError, Profiler
from hookprof.profiler.options import DEFAULTS, check_options
from hookprof.profiler.serialize import MAGIC
from tests.conftest import NoFastPath

ANY = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**6), st.floats(allow_nan=True, allow_infinity=True),
                st.text(max_size=4), st.lists(st.integers(-2, 4), max_size=3), st.binary(max_size=3))
OUT = tempfile.mkdtemp()


def is_int(v, low=1):
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def is_secs(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def valid_profiler_args(a):
    schedule = (a["save_steps"] is None) != (a["save_secs"] is None) and (
        a["save_steps"] is None or is_int(a["save_steps"])) and (a["save_secs"] is None or is_secs(a["save_secs"]))
    ranks = a["ranks"]
    ranks_ok = ranks is None or is_int(ranks, 0) or (
        isinstance(ranks, list) and ranks and all(is_int(r, 0) for r in ranks))
    return (schedule and isinstance(a["show_dataflow"], bool) and isinstance(a["show_memory"], bool)
            and isinstance(a["compress"], bool) and (a["max_events"] is None or is_int(a["max_events"])) and ranks_ok)


@settings(max_examples=400, deadline=None)
@given(save_steps=ANY, save_secs=ANY, show_dataflow=ANY, show_memory=ANY, compress=ANY, max_events=ANY, ranks=ANY)
def test_profiler_hook_accepts_exactly_the_valid_arguments(**args):
    for cls in (hookprof.ProfilerHook, lightning_prof.ProfilerHook):
        try:
            hook = cls(output_dir=OUT, **args)
        except (TypeError, ValueError) as err:
            assert not valid_profiler_args(args), (args, err)
            assert "ProfilerHook(" in str(err) and any(f"`{name}`" in str(err) for name in args), str(err)
        else:
            assert valid_profiler_args(args), args
            inner = getattr(hook, "hook", hook)
            assert (inner.save_steps, inner.save_secs, inner.max_events) == (
                args["save_steps"], args["save_secs"], args["max_events"])


@settings(max_examples=300, deadline=None)
@given(save_steps=ANY, save_secs=ANY, strict=ANY)
def test_summary_saver_hook_accepts_exactly_the_valid_arguments(save_steps, save_secs, strict):
    op = hookprof.summary.scalar("x", 1.0, collections=[])
    ok = ((save_steps is None) != (save_secs is None) and (save_steps is None or is_int(save_steps))
          and (save_secs is None or is_secs(save_secs)) and isinstance(strict, bool))
    for cls in (hookprof.SummarySaverHook, keras_prof.SummarySaverHook):
        try:
            cls(save_steps=save_steps, save_secs=save_secs, strict=strict, output_dir=OUT, summary_op=op)
        except (TypeError, ValueError) as err:
            assert not ok, err
            assert any(f"`{name}`" in str(err) for name in ("save_steps", "save_secs", "strict")), str(err)
        else:
            assert ok


@settings(max_examples=300, deadline=None)
@given(every_steps=ANY, every_secs=ANY)
def test_timer_messages(every_steps, every_secs):
    try:
        hookprof.SecondOrStepTimer(every_secs=every_secs, every_steps=every_steps)
    except ValueError as err:
        if every_steps is None and every_secs is None:
            assert str(err) == "Either every_secs or every_steps should be provided."
        elif every_steps is not None and every_secs is not None:
            assert str(err) == "Can not provide both every_secs and every_steps."
        else:
            assert "`every_steps`" in str(err) or "`every_secs`" in str(err)
    except TypeError as err:
        assert "`every_steps`" in str(err) or "`every_secs`" in str(err)
    else:
        assert (every_steps is None) != (every_secs is None)
        assert every_steps is None or is_int(every_steps)
        assert every_secs is None or is_secs(every_secs)


OPTION_KEYS = st.sampled_from(sorted(DEFAULTS) + ["min_micro", "depth", "", "order"])


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(OPTION_KEYS, st.one_of(ANY, st.lists(st.sampled_from([".*", "(", "a+", "[x"]), max_size=3),
                                              st.sampled_from(["micros", "name", "stdout", "file:outfile=x"])),
                       max_size=4))
def test_option_dicts_are_accepted_or_refused_naming_the_key(options):
    try:
        checked = check_options(options, "name_scope")
    except (TypeError, ValueError) as err:
        assert any(repr(key) in str(err) or key in str(err) for key in options), (options, err)
    else:
        assert set(options) <= set(DEFAULTS)
        assert {k: checked[k] for k in DEFAULTS}.keys() == DEFAULTS.keys()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_load_or_are_refused(blob):
    for data in (blob, MAGIC + blob):
        try:
            Profiler.load(data)
        except ProfileFormatError as err:
            assert "profile" in str(err)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**64 - 1), st.binary(max_size=64))
def test_declared_size_bounds_memory(declared, tail):
    blob = MAGIC + struct.pack("<IQ", 1, declared) + zlib.compress(b"x" * 10_000) + tail
    try:
        Profiler.load(blob, max_bytes=1 << 20)
    except ProfileFormatError as err:
        assert declared != 10_000 or "JSON" in str(err) or "truncated" in str(err) or "corrupt" in str(err)


def test_the_output_dir_is_created_expanded_or_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("HOOKPROF_PROP", str(tmp_path))
    hook = hookprof.ProfilerHook(save_steps=1, output_dir="$HOOKPROF_PROP/a/b")
    hook.begin()
    assert os.path.isdir(tmp_path / "a" / "b")


@settings(max_examples=40, deadline=None)
@given(every=st.integers(1, 5), secs=st.booleans(), first=st.integers(0, 7),
       jumps=st.lists(st.tuples(st.integers(1, 3), st.floats(0, 3)), min_size=1, max_size=14))
def test_the_quiet_step_fast_path_changes_nothing_a_hook_does(every, secs, first, jumps):
    """ProfilerHook and SummarySaverHook driven with their quiet_on fast path and without it fire on the same
    steps and write the same files, on step and seconds schedules, from any starting step."""
    from hookprof.tracing import HostTracer, StepTraceCoordinator

    results = []
    for fast in (True, False):
        now = [0.0]
        schedule = {"save_secs": every} if secs else {"save_steps": every}
        with tempfile.TemporaryDirectory() as out:
            prof = hookprof.ProfilerHook(output_dir=out, tensorboard=False, clock=lambda: now[0], **schedule)
            summ = hookprof.SummarySaverHook(output_dir=out,
                                             summary_op=hookprof.summary.scalar("x", 1.0, collections=[]),
                                         clock=lambda: now[0], **schedule)
            traces = StepTraceCoordinator()
            # one driver per hook, as each is its own callback
            drivers = [hookprof.HookedSession([hook if fast else NoFastPath(hook)], HostTracer, traces)
                       for hook in (prof, summ)]
            session = hookprof.ManualSession()
            session.global_step = first
            for driver in drivers:
                driver.begin()
                driver.after_create_session(session)
            fired = []
            for steps, seconds in jumps:
                for driver in drivers:
                    driver.before_run(session, session.global_step, hookprof.SessionRunArgs())
                session.global_step += steps
                now[0] += seconds
                for driver in drivers:
                    driver.after_run(lambda: hookprof.StepState(session.global_step, {}))
                # (each step's file on disk before the next: on a loaded machine a slow writer would otherwise
                # skip a trace, by design, in one run and not in the other)
                prof.flush()
                fired.append((prof._timer.last_triggered_step(), summ._timer.last_triggered_step()))
            for driver in drivers:
                driver.end(session)
            results.append((fired, [os.path.basename(p) for p in prof.saved_paths]))
    assert results[0] == results[1]
