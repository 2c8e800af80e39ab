"""The driver's TF1 semantics, with a plain Session (no framework): order, fetches, options, feeds, stop."""

import pytest

from hookprof import (
    HookedSession,
    ManualSession,
    RunOptions,
    SessionRunArgs,
    SessionRunHook,
    StepState,
    TraceLevel,
    step_feeds,
)
from hookprof.hooks.hooked_session import evaluate_fetches
from hookprof.tracing import HostTracer, StepTraceCoordinator
from tests.conftest import NoFastPath, RecordingHook


def run_steps(driver, session, n, outputs=None, on_step=None):
    stops = []
    for i in range(n):
        driver.before_run(session, ("k", session.global_step), SessionRunArgs(feed_dict={"batch_idx": i}))
        if on_step:
            on_step()
        session.global_step += 1
        stops.append(driver.after_run(
            lambda: StepState(session.global_step, outputs or {"loss": 0.5 * session.global_step})))
    return stops


class OrderHook(SessionRunHook):
    def __init__(self, name, log):
        self.name, self.log = name, log

    def before_run(self, run_context):
        self.log.append(("before", self.name))

    def after_run(self, run_context, run_values):
        self.log.append(("after", self.name, run_context.stop_requested))
        if self.name == "a":
            run_context.request_stop()


def test_hooks_run_in_list_order_and_stop_takes_effect_after_all_after_run():
    log = []
    driver = HookedSession([OrderHook("a", log), OrderHook("b", log)], HostTracer, StepTraceCoordinator())
    stops = run_steps(driver, ManualSession(), 1)
    # b's after_run still ran, and saw the stop a requested in the same step (one shared context)
    assert log == [("before", "a"), ("before", "b"), ("after", "a", False), ("after", "b", True)]
    assert stops == [True]


def test_each_hook_gets_exactly_the_structure_it_asked_for():
    h1 = RecordingHook(fetches={"loss": "loss", "both": ["global_step", lambda s: s.step * 10]})
    h2 = RecordingHook(fetches=("loss",))
    h3 = RecordingHook()
    driver = HookedSession([h1, h2, h3], HostTracer, StepTraceCoordinator())
    run_steps(driver, ManualSession(), 2)
    assert h1.results == [{"loss": 0.5, "both": [1, 10]}, {"loss": 1.0, "both": [2, 20]}]
    assert h2.results == [(0.5,), (1.0,)]
    assert h3.results == [None, None]


def test_unknown_fetch_name_lists_what_exists():
    with pytest.raises(KeyError, match=r"'lost'.*\['global_step', 'loss'\]"):
        evaluate_fetches("lost", StepState(1, {"loss": 1}))
    with pytest.raises(TypeError, match="A fetch must be"):
        evaluate_fetches(3, StepState(1))


class FeedHook(SessionRunHook):
    def __init__(self, feeds):
        self.feeds = feeds
        self.seen = None

    def before_run(self, run_context):
        return SessionRunArgs(feed_dict=self.feeds)


def test_feeds_are_published_for_the_step_and_conflicts_are_errors():
    seen = []
    driver = HookedSession([FeedHook({"lr_scale": 0.5}), FeedHook({"noise": 1})], HostTracer, StepTraceCoordinator())
    run_steps(driver, ManualSession(), 1, on_step=lambda: seen.append(dict(step_feeds())))
    assert seen == [{"lr_scale": 0.5, "noise": 1}]
    assert dict(step_feeds()) == {}  # only during the step

    clash = HookedSession([FeedHook({"x": 1}), FeedHook({"x": 2})], HostTracer, StepTraceCoordinator())
    with pytest.raises(RuntimeError, match=r"Same tensor is fed by two hooks: \['x'\]"):
        run_steps(clash, ManualSession(), 1)
    user_clash = HookedSession([FeedHook({"batch_idx": 3})], HostTracer, StepTraceCoordinator())
    with pytest.raises(RuntimeError, match=r"fed by a SessionRunHook and user: \['batch_idx'\]"):
        run_steps(user_clash, ManualSession(), 1)


def test_options_merge_highest_trace_level_and_every_extra_wins():
    h1 = RecordingHook(options=RunOptions(trace_level=TraceLevel.SOFTWARE_TRACE, record_memory=True))
    h2 = RecordingHook(options=RunOptions(trace_level=TraceLevel.FULL_TRACE))
    h3 = RecordingHook()
    driver = HookedSession([h1, h2, h3], HostTracer, StepTraceCoordinator())
    run_steps(driver, ManualSession(), 1)
    opts = driver._options
    assert opts.trace_level == TraceLevel.FULL_TRACE and opts.record_memory
    # one trace for the step, and every hook (even the one that asked nothing) gets the same metadata
    assert h1.metadata[0] is h2.metadata[0] is h3.metadata[0]
    spans = {n.op for n in h1.metadata[0].step_stats.all_nodes()}
    assert "train_step" in spans


def test_the_callers_options_merge_with_the_hooks_as_in_tf():
    # TF's _HookedSession.run merged the hooks' options into the caller's RunOptions
    hook = RecordingHook(options=RunOptions(trace_level=TraceLevel.SOFTWARE_TRACE))
    driver = HookedSession([hook], HostTracer, StepTraceCoordinator())
    session = ManualSession()
    caller = RunOptions(trace_level=TraceLevel.FULL_TRACE, with_stack=True)
    driver.before_run(session, "k", SessionRunArgs(options=caller))
    session.global_step += 1
    driver.after_run(lambda: StepState(session.global_step))
    assert driver._options.trace_level == TraceLevel.FULL_TRACE and driver._options.with_stack
    assert caller == RunOptions(trace_level=TraceLevel.FULL_TRACE, with_stack=True)  # the caller's are not changed
    assert hook.metadata[0].step_stats is not None  # traced, at the caller's level


def test_before_run_must_return_session_run_args():
    class Bad(SessionRunHook):
        def before_run(self, run_context):
            return {"fetches": "loss"}

    driver = HookedSession([Bad()], HostTracer, StepTraceCoordinator())
    with pytest.raises(TypeError, match=r"Bad.before_run returned dict; return None or hookprof.SessionRunArgs"):
        run_steps(driver, ManualSession(), 1)


def test_hooks_must_be_session_run_hooks():
    with pytest.raises(TypeError, match=r"`hooks\[1\]` \(int\) is not a SessionRunHook"):
        HookedSession([RecordingHook(), 3], HostTracer)
    with pytest.raises(TypeError, match=r"`hooks` must be a list of SessionRunHook"):
        HookedSession(RecordingHook(), HostTracer)


def test_a_failed_step_gets_no_after_run_and_stops_the_trace():
    traces = StepTraceCoordinator()
    hook = RecordingHook(options=RunOptions(trace_level=TraceLevel.FULL_TRACE))
    driver = HookedSession([hook], HostTracer, traces)
    session = ManualSession()
    driver.before_run(session, "s1", SessionRunArgs())
    assert traces.active
    driver.abort_step()
    assert not traces.active
    assert driver.after_run(lambda: StepState(1)) is False  # a stray after_run is ignored
    assert hook.names() == ["before_run"]


def test_session_run_evaluates_on_the_last_finished_step():
    session = ManualSession()
    with pytest.raises(RuntimeError, match="needs a finished step"):
        session.run("loss")
    driver = HookedSession([RecordingHook()], HostTracer, StepTraceCoordinator())
    run_steps(driver, session, 3)
    assert session.run({"l": "loss", "s": "global_step"}) == {"l": 1.5, "s": 3}


def test_a_second_request_for_more_detail_than_the_running_trace_is_warned(caplog):
    traces = StepTraceCoordinator()
    traces.start("s", HostTracer, RunOptions(trace_level=TraceLevel.FULL_TRACE))
    traces.start("s", HostTracer, RunOptions(trace_level=TraceLevel.FULL_TRACE))  # covered: silent
    assert not caplog.records
    traces.start("s", HostTracer, RunOptions(trace_level=TraceLevel.FULL_TRACE, record_dataflow=True))
    assert any("asked for more detail" in r.getMessage() for r in caplog.records)
    assert RunOptions(TraceLevel.FULL_TRACE, True, True, True).covers(RunOptions(TraceLevel.SOFTWARE_TRACE, True))
    assert not RunOptions(TraceLevel.FULL_TRACE).covers(RunOptions(TraceLevel.FULL_TRACE, with_stack=True))
    traces.abort()


class QuietHook(RecordingHook):
    """Declares itself quiet on every global step that is not a multiple of 3."""

    def quiet_on(self, global_step):
        return global_step % 3 != 0


def test_steps_on_which_every_hook_is_quiet_skip_the_hook_calls_and_still_end():
    hook = QuietHook(fetches="loss")
    driver = HookedSession([hook], HostTracer, StepTraceCoordinator())
    session = ManualSession()
    made = []
    for _ in range(7):
        driver.before_run(session, session.global_step, lambda: made.append(1) or SessionRunArgs())
        session.global_step += 1
        driver.after_run(lambda: StepState(session.global_step, {"loss": session.global_step}))
    assert [c for c in hook.calls if c[0] == "before_run"] == [("before_run", 0), ("before_run", 3), ("before_run", 6)]
    assert hook.results == [1, 4, 7]
    assert len(made) == 3  # the framework's own step arguments are built only for steps a hook runs on
    assert session.run("loss") == 7  # a quiet last step is still the session's last finished step

    # one hook without quiet_on turns the fast path off: both hooks see every step, as in TF
    quiet, plain = QuietHook(), RecordingHook()
    driver = HookedSession([quiet, NoFastPath(plain)], HostTracer, StepTraceCoordinator())
    run_steps(driver, ManualSession(), 4)
    assert [c[1] for c in quiet.calls if c[0] == "before_run"] == [0, 1, 2, 3]
    assert [c[1] for c in plain.calls if c[0] == "before_run"] == [0, 1, 2, 3]


def test_the_data_wait_is_the_time_between_steps_not_the_hooks_own_work():
    import time

    class SlowAfterRun(SessionRunHook):  # traces every step, and spends 60 ms after each
        def before_run(self, run_context):
            return SessionRunArgs(options=RunOptions(trace_level=TraceLevel.FULL_TRACE))

        def after_run(self, run_context, run_values):
            self.metadata = run_values.run_metadata
            time.sleep(0.06)

    hook = SlowAfterRun()
    driver = HookedSession([hook], HostTracer, StepTraceCoordinator())
    session = ManualSession()
    driver.begin()
    for _ in range(2):
        time.sleep(0.02)  # the loader: 20 ms between steps
        driver.before_run(session, ("k", session.global_step), SessionRunArgs())
        session.global_step += 1
        driver.after_run(lambda: StepState(session.global_step))
    (wait,) = [n for n in hook.metadata.step_stats.all_nodes() if n.op == "data_wait"]
    assert 0.015 < wait.duration_ns / 1e9 < 0.05  # the 20 ms wait, without the previous step's 60 ms of hooks


def test_the_callers_trace_request_is_honoured_on_steps_every_hook_is_quiet():
    class Quiet(SessionRunHook):  # promises to do nothing on every step (as idle ProfilerHooks do)
        def quiet_on(self, global_step):
            return True

        def after_run(self, run_context, run_values):
            self.metadata = run_values.run_metadata

    driver = HookedSession([Quiet()], HostTracer, StepTraceCoordinator())
    session, traced = ManualSession(), []
    for _ in range(3):
        driver.before_run(session, ("k", session.global_step),
                          SessionRunArgs(options=RunOptions(trace_level=TraceLevel.FULL_TRACE)))
        session.global_step += 1
        driver.after_run(lambda: StepState(session.global_step))
        traced.append(driver.hooks[0].metadata.step_stats is not None)
    assert traced == [True, True, True]


def test_a_schedule_that_fired_but_could_not_trace_is_not_blamed(tmp_path, caplog):
    from hookprof import ProfilerHook
    from hookprof.tracing import Tracer, TracerUnavailable

    class Held(Tracer):  # another profiler holds torch's: every trace is refused
        name = "held"

        def start(self, options):
            raise TracerUnavailable("another profiler holds torch's profiler")

        def stop(self):
            raise AssertionError("never started")

        def abort(self):
            pass

    hook = ProfilerHook(save_steps=2, output_dir=str(tmp_path), tensorboard=False)
    driver = HookedSession([hook], Held, StepTraceCoordinator())
    session = ManualSession()
    driver.begin()
    driver.after_create_session(session)
    run_steps(driver, session, 6)
    driver.end(session)
    messages = [r.getMessage() for r in caplog.records]
    assert any("Step not traced: another profiler" in m for m in messages)
    assert not any("wrote no timeline" in m for m in messages)  # the schedule fired; the cause was said


# --- the ranks' agreement (a ManualSession of rank 0 of 2 whose `agree` stands for the other rank) -----------

class OtherRank:
    """`agree` for rank 0 of 2: each call is recorded, and the other rank's decisions are `theirs(call)`."""

    def __init__(self, theirs=lambda call: None):
        self.calls, self.theirs = [], theirs

    def __call__(self, decisions, reduce):
        self.calls.append(list(decisions))
        other = self.theirs(len(self.calls)) or [False] * len(decisions)
        return [mine or their for mine, their in zip(decisions, other)]


def test_step_schedules_and_hooks_that_never_stop_agree_nothing(tmp_path):
    from hookprof import ProfilerHook, StepCounterHook, StopAtStepHook

    agree = OtherRank()
    hooks = [ProfilerHook(save_steps=2, output_dir=str(tmp_path), tensorboard=False), StepCounterHook(every_n_steps=1),
             StopAtStepHook(last_step=3)]
    session = ManualSession(rank=0, world_size=2, agree=agree)
    driver = HookedSession(hooks, HostTracer, StepTraceCoordinator())
    driver.begin()
    driver.after_create_session(session)
    assert run_steps(driver, session, 3) == [False, False, True] and agree.calls == []  # no collective at all
    driver.end(session)
    assert [p.name for p in tmp_path.iterdir()] == ["timeline-2-rank0.json"]


def test_a_stop_on_either_rank_stops_this_one_and_quiet_steps_agree_too():
    agree = OtherRank(lambda call: [True] if call == 3 else None)  # the other rank asks to stop after step 3
    session = ManualSession(rank=0, world_size=2, agree=agree)
    driver = HookedSession([SessionRunHook()], HostTracer, StepTraceCoordinator())  # may stop: agreed each step
    driver.begin()
    driver.after_create_session(session)
    assert run_steps(driver, session, 4) == [False, False, True, False]
    assert agree.calls == [[False]] * 4  # one call a step, this rank proposing nothing, every step quiet or not


def test_a_seconds_checkpoint_saves_on_every_rank_when_any_is_due(tmp_path):
    from hookprof import CheckpointSaverHook
    from tests.conftest import FakeClock

    saved = []
    clock = FakeClock()
    hook = CheckpointSaverHook(str(tmp_path), save_secs=10, saver=lambda path: saved.append(path),
                               clock=clock)
    agree = OtherRank(lambda call: [False, True] if call == 2 else None)  # the other rank's clock says step 2
    session = ManualSession(rank=0, world_size=2, agree=agree)
    driver = HookedSession([hook], HostTracer, StepTraceCoordinator())
    driver.begin()
    driver.after_create_session(session)  # saves step 0
    run_steps(driver, session, 3)
    assert [p.rsplit("-", 1)[1] for p in saved] == ["0", "2"]  # this rank's clock never moved
    assert agree.calls == [[False, False]] * 3


def test_a_seconds_trace_the_other_rank_asks_for_traces_that_one_step_only(tmp_path):
    """The ranks agree to trace the step after the other rank's clock fired: one timeline, then the schedule
    goes on (the agreed flag stayed set and every later step was traced)."""
    from hookprof import ProfilerHook
    from tests.conftest import FakeClock

    hook = ProfilerHook(save_secs=1000, output_dir=str(tmp_path), tensorboard=False, clock=FakeClock())
    agree = OtherRank(lambda call: [False, True] if call == 2 else None)  # the other rank's clock: call 2
    session = ManualSession(rank=0, world_size=2, agree=agree)
    driver = HookedSession([hook], HostTracer, StepTraceCoordinator())
    driver.begin()
    driver.after_create_session(session)
    run_steps(driver, session, 8)
    driver.end(session)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["timeline-3-rank0.json"]


class TraceEveryStep(SessionRunHook):
    def before_run(self, run_context):
        return SessionRunArgs(options=RunOptions(trace_level=TraceLevel.SOFTWARE_TRACE))


def test_a_step_that_never_ran_drops_its_deferred_trace():
    """Keras' data running out ends a step before its train function runs: the trace deferred to the step's
    start (`defer_trace`) must not be started later, under the next step's key, by a step that asked for none."""
    driver = HookedSession([TraceEveryStep()], HostTracer, StepTraceCoordinator(), defer_trace=True)
    session = ManualSession()
    driver.begin()
    driver.before_run(session, ("k", 0), SessionRunArgs())
    assert driver.trace_pending
    driver.abort_step()
    assert not driver.trace_pending
    driver.start_trace()  # (what the next step's start would do)
    assert not driver._traces.active
    driver.end(session)
