"""A traced step's conversion and files run on the background thread: the training thread does not wait for
them, the next trace waits until they are done, readers (`saved_paths`, the Profiler) see every step traced
so far, failures there cost the file only, forks wait for it."""

import gc
import os
import sys
import threading

from hookprof import HookedSession, ManualSession, NodeExecStats, ProfilerHook, SessionRunArgs, StepState, StepStats
from hookprof._runtime.background import BACKGROUND, Background
from hookprof.profiler import Profiler
from hookprof.tracing import HOST_DEVICE, StepTraceCoordinator, Tracer
from tests.conftest import load_trace


class GatedTracer(Tracer):
    """Its conversion waits for `gate` and raises for the steps in `broken`; it logs what happens, in order."""

    name = "gated"

    def __init__(self, gate, log, broken=()):
        self.gate, self.log, self.broken = gate, log, broken
        self.number = 0

    def start(self, options):
        self.number = sum(1 for entry in self.log if entry[0] == "start") + 1
        self.log.append(("start", self.number))

    def stop(self):
        raise AssertionError("the coordinator must use stop_recording")

    def stop_recording(self):
        number = self.number

        def convert():
            self.gate.wait(10)
            self.log.append(("converted", number, threading.current_thread() is threading.main_thread()))
            if number in self.broken:
                raise RuntimeError("conversion bug")
            stats = StepStats()
            stats.device(HOST_DEVICE).node_stats.append(
                NodeExecStats("net/fc/aten::addmm", "aten::addmm", 1000, 500, 1, "net/fc"))
            return stats

        return convert

    def abort(self):
        pass


def drive(tmp_dir, gate, log, steps, broken=(), profiler=None, on_after_run=None):
    tracer = GatedTracer(gate, log, broken)
    hook = ProfilerHook(save_steps=1, output_dir=tmp_dir, tensorboard=False, profiler=profiler)
    driver = HookedSession([hook], lambda: tracer, StepTraceCoordinator())
    session = ManualSession()
    driver.begin()
    driver.after_create_session(session)
    for _ in range(steps):
        driver.before_run(session, ("k", session.global_step), SessionRunArgs())
        session.global_step += 1
        driver.after_run(lambda: StepState(session.global_step))
        if on_after_run:
            on_after_run(session.global_step)
    return hook, driver, session


def test_the_training_thread_does_not_wait_for_the_conversion_and_the_next_trace_waits_for_it(tmp_dir):
    gate, log = threading.Event(), []
    seen = []

    def after_run(step):  # the step is over for the training loop; its timeline cannot exist yet
        seen.append((step, os.path.exists(os.path.join(tmp_dir, f"timeline-{step}.json")), BACKGROUND.busy))
        if step == 2:
            threading.Timer(0.2, gate.set).start()  # released while the training thread asks for the next trace

    hook, driver, session = drive(tmp_dir, gate, log, 3, on_after_run=after_run)
    driver.end(session)
    # step 1 only starts the count; step 2 is traced and converted on the background thread while the
    # training thread went on to step 3, whose trace started only once step 2's conversion was done
    assert seen[1] == (2, False, True)
    assert log == [("start", 1), ("converted", 1, False), ("start", 2), ("converted", 2, False)]
    assert [os.path.basename(p) for p in hook.saved_paths] == ["timeline-2.json", "timeline-3.json"]
    assert not BACKGROUND.busy
    names = [e["name"] for e in load_trace(hook.saved_paths[0])["traceEvents"] if e.get("ph") == "X"]
    assert "aten::addmm" in names


def test_readers_wait_for_the_steps_traced_so_far(tmp_dir):
    gate, log = threading.Event(), []
    profiler = Profiler()
    hook, driver, session = drive(tmp_dir, gate, log, 2, profiler=profiler)
    assert log == [("start", 1)]  # converting: the job waits for the gate
    threading.Timer(0.2, gate.set).start()
    rows = profiler.profile_operations({"output": "none"}).rows  # waits for the job, then reports it
    assert [row.name for row in rows] == ["aten::addmm"]
    assert [os.path.basename(p) for p in hook.saved_paths] == ["timeline-2.json"]
    driver.end(session)


def test_a_failed_conversion_costs_its_timeline_only(tmp_dir, caplog):
    gate, log = threading.Event(), []
    gate.set()
    hook, driver, session = drive(tmp_dir, gate, log, 4, broken=(1,))
    driver.end(session)
    assert [os.path.basename(p) for p in hook.saved_paths] == ["timeline-3.json", "timeline-4.json"]
    assert sum("Collecting the traced step failed" in r.getMessage() for r in caplog.records) == 1
    assert session.global_step == 4


def test_one_conversion_serves_every_reader_and_carries_the_step():
    calls = []
    from hookprof.hooks.session_run_hook import RunMetadata

    def make():
        calls.append(threading.current_thread().name)
        return StepStats()

    metadata = RunMetadata(make_step_stats=make)
    metadata.step = 7
    assert not metadata.converted
    threads = [threading.Thread(target=lambda: metadata.step_stats) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and metadata.converted
    assert metadata.step_stats.step == 7


def test_jobs_run_in_order_and_a_failing_job_does_not_stop_the_next(caplog):
    worker, done, gate = Background("test-worker"), [], threading.Event()
    first = worker.submit(lambda: (gate.wait(10), done.append(1)))
    failing = worker.submit(lambda: 1 / 0)
    last = worker.submit(lambda: done.append(3))
    assert not first.done and worker.busy  # held at the gate
    gate.set()
    last.wait()  # the last handle done: every earlier job ran, the failing one too
    assert first.done and failing.done and done == [1, 3]
    worker.wait_idle()
    assert not worker.busy
    assert any("background job failed" in r.getMessage() for r in caplog.records)


def test_a_fork_waits_for_the_job_and_the_child_has_its_garbage_collector(tmp_dir):
    # DataLoader workers are forked, often right after a traced epoch-end step: a child forked mid-job would
    # inherit held locks and a paused collector
    gate, log = threading.Event(), []
    hook, driver, session = drive(tmp_dir, gate, log, 2)
    assert BACKGROUND.busy
    threading.Timer(0.2, gate.set).start()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it inherited, and leave at once
        os.write(write, f"{gc.isenabled()} {len(log)} {BACKGROUND.busy}".encode())
        os._exit(0)
    os.close(write)
    report = os.read(read, 100).decode()
    os.waitpid(pid, 0)
    os.close(read)
    assert report == "True 2 False"  # the conversion had finished before the fork
    driver.end(session)


def test_the_file_goes_where_the_step_was_traced_even_if_the_next_fit_moves_the_hook(tmp_dir):
    gate, log = threading.Event(), []
    first, second = os.path.join(tmp_dir, "first"), os.path.join(tmp_dir, "second")
    tracer = GatedTracer(gate, log)
    hook = ProfilerHook(save_steps=1, output_dir=None, tensorboard=False)
    hook.set_default_output_dir(first)
    driver = HookedSession([hook], lambda: tracer, StepTraceCoordinator())
    session = ManualSession()
    driver.begin()
    driver.after_create_session(session)
    for _ in range(2):
        driver.before_run(session, ("k", session.global_step), SessionRunArgs())
        session.global_step += 1
        driver.after_run(lambda: StepState(session.global_step))
    hook.set_default_output_dir(second)  # the next fit's directory, set while step 2 is still being written
    gate.set()
    hook.flush()
    assert os.listdir(first) == ["timeline-2.json"]
    driver.end(session)


def test_a_job_runs_on_the_training_thread_when_no_thread_can_start(monkeypatch, caplog):
    worker, ran_on = Background("test-worker"), []

    def refuse(thread):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    worker.submit(lambda: ran_on.append(threading.current_thread() is threading.main_thread()))
    assert ran_on == [True] and not worker.busy  # and so wait() cannot hang
    assert any("No background thread" in r.getMessage() for r in caplog.records)


def test_overlapping_gc_pauses_on_two_threads_restore_the_collector_once_both_end():
    from hookprof._runtime.gc_pause import paused_gc

    inside, leave = threading.Event(), threading.Event()

    def other():
        with paused_gc():
            inside.set()
            leave.wait(5)

    assert gc.isenabled()
    thread = threading.Thread(target=other)
    with paused_gc():
        thread.start()
        inside.wait(5)
    assert not gc.isenabled()  # the other thread's pause still runs
    leave.set()
    thread.join()
    assert gc.isenabled()


def test_dropped_outputs_counted_from_many_threads_lose_no_count():
    """The training thread and the background threads all count dropped outputs on the same hook."""
    from hookprof._runtime.background import count_dropped

    class Hook:
        """Its counter reads through a call, where CPython may switch threads (as 3.12+ and free-threaded
        builds may anywhere): an unguarded `+=` loses about two counts in three here."""

        def __init__(self):
            self._count = 0

        @property
        def dropped_outputs(self):
            return int(self._count)

        @dropped_outputs.setter
        def dropped_outputs(self, value):
            self._count = value

    hook = Hook()
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as CPython allows
    try:
        threads = [threading.Thread(target=lambda: [count_dropped(hook) for _ in range(20_000)]) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(switch)
    assert hook.dropped_outputs == 80_000
