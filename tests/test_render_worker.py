"""Traced steps leave the training process: kineto's own export, converted and rendered by the render worker.

The export must give the same step as torch's in-process events (timestamps to the nanosecond, shapes,
dtypes, and flops computed as torch computes them); the worker must never import torch, must end with the
training process, and a worker killed mid-render costs that timeline only."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import lightning as L
import orjson
import pytest
import torch

from hookprof._runtime import worker
from hookprof.hooks import CaptureOptions, profiler_hook
from hookprof.hooks.capture import CapturePipeline, render_step
from hookprof.trace import format as fmt
from hookprof.tracing.kineto_trace import KinetoExport, flops
from lightning_prof import HookCallback, ProfilerHook
from tests import worker_probe
from tests.conftest import NO_UNCLOSED_RESOURCES
from tests.lightning_models import TinyModel, loader, trainer

pytestmark = NO_UNCLOSED_RESOURCES  # (the worker's pipes, closed whenever it ends)

# The reference these tests compare with: torch's own per-event accessors, which hookprof does not read (torch
# 2.11 has none of `activity_type` / `external_id` and still traces in full)
torchs_event_accessors = pytest.mark.skipif(not hasattr(torch._C._autograd._KinetoEvent, "activity_type"),
                                            reason="this torch's profiler events have no activity_type accessor")

pytestmark = pytest.mark.skipif(not worker.AVAILABLE, reason="the render worker runs on POSIX systems")


def profiled_results(fn):
    from torch.autograd import profiler as autograd_profiler

    prof = autograd_profiler.profile(record_shapes=True, with_flops=True, use_kineto=True)
    with prof:
        fn()
    return prof.kineto_results


@torchs_event_accessors
def test_flops_from_the_export_equal_torchs_own_for_every_op_it_counts(tmp_path):
    x, w = torch.randn(2, 3, 17, 15), torch.nn.Conv2d(3, 8, (3, 5), stride=(2, 1), padding=(1, 2), dilation=(1, 2))
    grouped = torch.nn.Conv2d(4, 8, 3, groups=2)

    def step():
        w(x)
        grouped(torch.randn(1, 4, 9, 9))
        a, b = torch.randn(6, 7), torch.randn(7, 5)
        torch.mm(a, b)
        torch.addmm(torch.randn(5), a, b)
        p, q = torch.randn(3, 6, 7), torch.randn(3, 7, 4)
        torch.bmm(p, q)
        torch.baddbmm(torch.randn(3, 6, 4), p, q)
        a * b.sum()
        a * 2
        a + a
        torch.add(a, 1)
        torch.relu(a)

    results = profiled_results(step)
    path = str(tmp_path / "step.json")
    results.save(path)
    theirs = {e.external_id(): (e.name(), e.flops()) for e in results.events() if e.activity_type() == "cpu_op"}
    ours = {}
    with open(path, "rb") as f:
        events = orjson.loads(f.read())["traceEvents"]
    for event in events:
        if event.get("cat") == "cpu_op":
            args = event["args"]
            ours[args["External id"]] = (event["name"], flops(event["name"], args.get("Input Dims") or (),
                                                              args.get("Input type") or (),
                                                              args.get("Concrete Inputs") or ()))
    assert ours == theirs
    counted = {name for name, count in theirs.values() if count}
    assert counted >= {"aten::conv2d", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::mul",
                       "aten::add"}


@torchs_event_accessors
def test_the_export_gives_torchs_own_times_shapes_and_types_to_the_nanosecond(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    results = profiled_results(lambda: model(torch.randn(8, 16)).sum().backward())
    events = [e for e in results.events() if e.activity_type() in ("cpu_op", "user_annotation")]
    path = str(tmp_path / "step.json")
    results.save(path)
    from hookprof.hooks.session_run_hook import RunOptions, TraceLevel

    stats = KinetoExport(path, results.trace_start_ns(), RunOptions(trace_level=TraceLevel.FULL_TRACE),
                         torch.__version__).to_stats()
    nodes = sorted((n.start_ns, n.duration_ns, n.op, n.input_shapes or [], n.args and n.args.get("flops"))
                   for n in stats.all_nodes())
    expected = sorted((e.start_ns(), e.duration_ns(), e.name(), e.shapes() if e.activity_type() == "cpu_op" else [],
                       e.flops() or None) for e in events)
    assert len(nodes) == len(expected) > 20
    assert nodes == expected


class KillingPipeline(CapturePipeline):
    """Sends SIGKILL to the render worker 0.2 s after step `kill_at` went to it, idle (the steps before rendered
    and read), rendered after 5 s of sleep there: the worker surely runs that step when it is killed."""

    kill_at = None

    def post(self, job, exported):
        if job.step != self.kill_at:
            return super().post(job, exported)
        for render in list(self._renders):
            render.wait()
        ticket = worker.WORKER.post(worker_probe.slowly, 5.0, render_step, exported, self.writer, job.spec)
        threading.Timer(0.2, os.kill, (worker.WORKER._process.pid, signal.SIGKILL)).start()
        return ticket


class KillingHook(profiler_hook.ProfilerHook):
    pipeline_class = KillingPipeline

    def __init__(self, step, **kwargs):
        super().__init__(**kwargs)
        self.pipeline.kill_at = step


class HoldingPipeline(CapturePipeline):
    """Holds the render of step `hold` (until a later step is dropped for it), and times how long each traced
    step waited for its turn at the render worker, and whether it got it."""

    hold = None

    def save(self, job):
        self.saving = job.step  # (the background thread saves one step at a time)
        super().save(job)

    def render_elsewhere(self, job, exported):
        if job.step == self.hold:
            self.release.wait(60)
        return super().render_elsewhere(job, exported)

    def _render_turn(self, budget):
        start = time.monotonic()
        turn = super()._render_turn(budget)
        self.waits[self.saving] = (time.monotonic() - start, turn)
        if not turn:
            self.release.set()
        return turn


class HoldingHook(profiler_hook.ProfilerHook):
    pipeline_class = HoldingPipeline

    def __init__(self, hold, **kwargs):
        super().__init__(**kwargs)
        self.pipeline.hold, self.pipeline.release, self.pipeline.waits = hold, threading.Event(), {}


def test_a_traced_step_waits_the_floor_at_least_for_the_previous_steps_render_before_it_is_dropped(tmp_path,
                                                                                                   caplog):
    """A tiny model's traced step costs milliseconds; one whose turn comes while RENDERS_IN_FLIGHT earlier steps
    still wait for the worker (one rendering, held here, and one queued behind it) waits RENDER_WAIT_FLOOR_SECONDS
    at least (a loaded machine's scheduling delays are longer than its cost), not only its cost, and then is
    dropped: counted, said once. The step queued behind the held one waits for nothing, and is rendered."""
    import lightning as L

    from hookprof.hooks.capture import RENDER_WAIT_FLOOR_SECONDS, RENDERS_IN_FLIGHT

    class RenderedBy2(L.Callback):  # (after the hook: step 2 rendered, so the worker has started)
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                hook.flush()

    assert RENDERS_IN_FLIGHT == 2  # (the steps below: 3 held, 4 queued, 5 dropped)
    out = tmp_path / "prof"
    hook = HoldingHook(3, save_steps=1, output_dir=str(out))
    try:
        with caplog.at_level(logging.WARNING):
            trainer(str(tmp_path), [HookCallback([hook]), RenderedBy2()], max_steps=6).fit(TinyModel(), loader())
    finally:
        hook.pipeline.release.set()
    waited, turn = hook.pipeline.waits[5]  # (step 3's render held, step 4's queued behind it)
    assert not turn and RENDER_WAIT_FLOOR_SECONDS <= waited < RENDER_WAIT_FLOOR_SECONDS + 5
    waited, turn = hook.pipeline.waits[4]
    assert turn and waited < RENDER_WAIT_FLOOR_SECONDS  # (a place was free: it waited for no render)
    assert hook.pipeline.waits[3][1]  # (a place was free)
    written = {int(p.name.split("-")[1].split(".")[0]) for p in out.glob("timeline-*.json")}
    assert {2, 3, 4} <= written and 5 not in written and hook.dropped_outputs >= 1
    busy = [r.getMessage() for r in caplog.records if "was still rendering the previous" in r.getMessage()]
    assert len(busy) == 1 and "step 5 has no timeline" in busy[0]


class WideModel(TinyModel):
    """TinyModel with more layers: 300 make a step of some 15k events, whose rendering takes a few hundred ms."""

    def __init__(self, layers: int = 300):
        super().__init__()
        self.extra = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(layers)])

    def forward(self, x):
        return self.fc2(self.extra(torch.relu(self.fc1(x))))


def test_a_worker_killed_mid_render_costs_that_timeline_only(tmp_path, caplog):
    out = tmp_path / "prof"
    hook = KillingHook(3, save_steps=1, output_dir=str(out))
    fit = trainer(str(tmp_path), [HookCallback([hook])], max_steps=5)
    with caplog.at_level(logging.WARNING):
        fit.fit(WideModel(), loader(n=40))
    assert fit.global_step == 5
    written = sorted(p.name for p in out.iterdir() if p.name.startswith("timeline"))
    assert written == [f"timeline-{step}.json" for step in (2, 4, 5)]  # no partial file, no temp left
    assert hook.dropped_outputs == 1
    (warning,) = [r.getMessage() for r in caplog.records if "render worker" in r.getMessage()]
    assert "timeline-3.json" in warning and "killed by SIGKILL" in warning
    for name in written:  # the later files come from a new worker, whole
        trace = orjson.loads((out / name).read_bytes())
        assert any(e.get("name") == "aten::addmm" for e in trace["traceEvents"])


def test_fits_render_in_a_worker_that_never_imports_torch(tmp_path):
    out = tmp_path / "prof"
    fit = trainer(str(tmp_path), [ProfilerHook(save_steps=2, output_dir=str(out))], max_steps=4)
    fit.fit(TinyModel(), loader())
    assert sorted(p.name for p in out.glob("timeline-*")) == ["timeline-2.json", "timeline-4.json"]
    assert worker.WORKER.call(worker_probe.pid) not in (os.getpid(), None)
    assert worker.WORKER.call(worker_probe.torch_modules) == []
    # at a lower priority than the training, so that on shared cores the training runs first
    pid = worker.WORKER.call(worker_probe.pid)
    assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + worker.WORKER_NICE)


def test_what_the_worker_is_told_while_busy_runs_before_its_next_call():
    """A fit's end tells the worker to forget what it kept for that fit; a worker busy with another fit's step
    is not waited for, and runs the tell before its next call."""
    worker.WORKER.call(worker_probe.pid)  # (a worker that has answered)
    busy = threading.Thread(target=worker.WORKER.call, args=(worker_probe.burn, 0.5))
    busy.start()
    while not worker.WORKER._reading.locked():
        time.sleep(0.001)
    start = time.monotonic()
    worker.WORKER.tell(worker_probe.note, "fit 1 ended")
    assert time.monotonic() - start < 0.25  # (not waited for)
    busy.join()
    assert worker.WORKER.call(worker_probe.notes) == ["fit 1 ended"]


def test_the_worker_runs_the_next_call_sent_while_the_last_ones_reply_waits_to_be_read():
    """Calls sent before the last one's result is taken (`post`) run one after the other in the worker, each as
    soon as the one before has ended: a reply of megabytes, far over what the pipe or socket holds, waits there
    for the training process to read it (which waits for the GIL the training thread holds through torch's
    profiler stop) without holding up the next call. Results are taken in the order sent, whoever takes them."""
    own = worker.Worker()
    try:
        own.call(worker_probe.pid)  # (started)
        sent = time.monotonic()
        first = own.post(worker_probe.timed_bytes, 0.2, 16 << 20)
        second = own.post(worker_probe.timed_bytes, 0.2, 16 << 20)
        time.sleep(1.5)  # (nothing read meanwhile)
        read = time.monotonic()
        second_started, second_ended, data = own.take(second)  # (reads the first's reply on the way)
        first_started, first_ended, _ = own.take(first)
        assert sent < first_started < first_ended <= second_started < read
        assert second_started - first_ended < 0.5 and len(data) == 16 << 20
    finally:
        own.stop()


def test_a_worker_killed_mid_call_costs_that_call_and_the_ones_sent_after_it_go_to_a_new_worker():
    own = worker.Worker()
    try:
        killed = own.call(worker_probe.pid)
        running = own.post(worker_probe.timed_bytes, 30, 1)
        queued = [own.post(worker_probe.note, name) for name in ("first", "second")]
        time.sleep(0.5)
        os.kill(killed, signal.SIGKILL)
        with pytest.raises(worker.WorkerFailed, match="killed by SIGKILL"):
            own.take(running)
        later = own.post(worker_probe.note, "sent after the death")
        assert own.take(later, timeout=30) is None  # (it is taken first, yet the two sent before it ran first)
        assert [own.take(ticket) for ticket in queued] == [None, None]
        assert own.call(worker_probe.notes) == ["first", "second", "sent after the death"]
        assert own.call(worker_probe.pid) != killed
    finally:
        own.stop()


def test_sending_a_call_never_waits_for_a_busy_worker():
    """A request larger than what the worker's pipe takes at once (a walked step of many ops: 2 MiB here, the
    pipe 1 MiB) is not written by `post`, which runs on the training process's background thread (the next
    traced step waits for it), but by the thread that takes the result, which may wait."""
    own = worker.Worker()
    try:
        own.call(worker_probe.pid)
        busy = own.post(worker_probe.timed_bytes, 0.5, 1)
        start = time.monotonic()
        large = own.post(len, b"x" * (2 << 20))
        small = own.post(len, b"x" * 100)
        assert time.monotonic() - start < 0.1
        assert own.take(small) == 100 and own.take(large) == 2 << 20 and own.take(busy)[2] == b"x"
    finally:
        own.stop()


def test_where_the_pipes_size_is_unknown_the_takers_send_every_call_in_order():
    """macOS has no F_GETPIPE_SZ: no request is known to fit in the pipe at once, so `post` sends none and the
    thread that takes a result sends every call before it, in the order posted, whichever result it takes."""
    own = worker.Worker()
    try:
        own.call(worker_probe.pid)
        own._capacity = None  # (as there)
        posted = [own.post(worker_probe.note, name) for name in ("first", "second", "third")]
        assert all(ticket.process is None for ticket in posted)  # (none sent by `post`)
        assert [own.take(ticket) for ticket in reversed(posted)] == [None, None, None]
        assert own.call(worker_probe.notes) == ["first", "second", "third"]
    finally:
        own.stop()


def test_a_fit_where_the_pipes_size_is_unknown_renders_every_traced_step(tmp_path, monkeypatch):
    """The same in a fit (no `fcntl`, as on a platform without it): the renders' thread sends each step."""
    own = worker.Worker()
    monkeypatch.setattr(worker, "WORKER", own)
    monkeypatch.setattr(worker, "fcntl", None)
    out = tmp_path / "prof"
    hook = profiler_hook.ProfilerHook(save_steps=1, output_dir=str(out))
    try:
        trainer(str(tmp_path), [HookCallback([hook])], max_steps=6).fit(TinyModel(), loader())
    finally:
        own.stop()
    assert own._capacity is None
    assert sorted(int(p.name.split("-")[1].split(".")[0]) for p in out.glob("timeline-*.json")) == [2, 3, 4, 5, 6]
    assert hook.dropped_outputs == 0


def test_a_worker_killed_while_its_last_reply_was_on_the_way_costs_the_call_it_ran_then():
    """The worker had finished one call, whose reply of megabytes waited to be read, and ran the next when it
    was killed: the reply cut short is not the call it ran. That one is sent again (the next worker answers
    it); the one it ran fails."""
    own = worker.Worker()
    try:
        killed = own.call(worker_probe.pid)
        finished = own.post(worker_probe.timed_bytes, 0, 64 << 20)
        running = own.post(worker_probe.timed_bytes, 30, 1)
        time.sleep(1.0)  # (the first answered, its reply waiting for a reader; the second running)
        os.kill(killed, signal.SIGKILL)
        assert len(own.take(finished, timeout=30)[2]) == 64 << 20
        with pytest.raises(worker.WorkerFailed, match="killed by SIGKILL"):
            own.take(running)
        assert own.call(worker_probe.pid) != killed
    finally:
        own.stop()


def test_a_call_sent_to_a_worker_that_died_after_answering_goes_to_a_new_one():
    """The worker answered the call before and died before its reply was read; the next call, sent meanwhile,
    found no one to take it: it is no call the dead worker ran, so it goes to a new worker rather than fail."""
    own = worker.Worker()
    try:
        dead = own.call(worker_probe.pid)
        answered = own.post(worker_probe.pid)
        time.sleep(0.3)  # (answered: the reply waits to be read)
        os.kill(dead, signal.SIGKILL)
        while own._process.poll() is None:
            time.sleep(0.01)
        later = own.post(worker_probe.pid)
        assert own.take(answered) == dead
        assert own.take(later, timeout=30) not in (dead, None)
    finally:
        own.stop()


def test_what_a_worker_was_told_goes_with_it_and_the_next_call_starts_a_new_one():
    """A fit's end tells the worker to forget the fit, and no one reads what it answers; the last fit's end then
    stops it (or it dies). The next fit's first call starts a new worker, which was told nothing."""
    own = worker.Worker()
    try:
        for end in ("stopped", "killed"):
            first = own.call(worker_probe.pid)
            own.tell(worker_probe.note, "fit ended")
            if end == "stopped":
                own.stop()
            else:
                time.sleep(0.2)  # (the tell has run)
                os.kill(first, signal.SIGKILL)
                while own._process.poll() is None:
                    time.sleep(0.01)
            own.start()  # (a new one, though no one read what the last one answered)
            assert own._process.pid != first
            assert own.call(worker_probe.notes, timeout=30) == []
    finally:
        own.stop()


@pytest.mark.parametrize("how", ["killed", "exits, a forked child holding the pipe"])
def test_the_worker_ends_with_the_training_process(tmp_path, how):
    code = textwrap.dedent("""
        import os, sys, time
        from hookprof._runtime.worker import WORKER
        WORKER.start()
        print(WORKER._process.pid, flush=True)
        if sys.argv[1] == "killed":
            time.sleep(60)
        elif os.fork() == 0:  # a DataLoader-like child, alive after the parent, with the pipe's ends
            time.sleep(30)
            os._exit(0)
    """)
    parent = subprocess.Popen([sys.executable, "-c", code, how.split(",")[0]], stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    assert os.path.exists(f"/proc/{pid}")
    if how == "killed":
        parent.kill()
    started = time.monotonic()
    parent.wait()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        try:  # (reaped by init, or by us when this test's process adopted it)
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.1)
    parent.stdout.close()
    state = "gone"
    if os.path.exists(f"/proc/{pid}"):
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().split()[2]
    assert state in ("gone", "Z")
    if how != "killed":  # told to quit at exit: at once, not after the 5 s a stuck worker is given
        assert time.monotonic() - started < 4


def test_dataloader_workers_forked_beside_the_render_worker_leave_it_alone(tmp_path, caplog):
    """Forked DataLoader workers (copies of the training process, its render worker's pipes included) neither
    end nor confuse the render worker: every traced step is written but those dropped because the worker was
    still busy with the ones before (millisecond steps traced every step on 2 shared cores: the policy, counted,
    one warning); none fails to render."""
    out = tmp_path / "prof"
    data = loader(n=96)
    data = torch.utils.data.DataLoader(data.dataset, batch_size=8, num_workers=2)
    hook = ProfilerHook(save_steps=1, output_dir=str(out))
    with caplog.at_level(logging.WARNING):
        trainer(str(tmp_path), [hook], max_steps=12).fit(TinyModel(), data)
    written = sorted(int(p.name.split("-")[1].split(".")[0]) for p in out.glob("timeline-*"))
    busy = [r for r in caplog.records if "was still rendering the previous" in r.getMessage()]
    assert len(written) + hook.hook.dropped_outputs == 11 and set(written) <= set(range(2, 13)) and len(written) >= 8
    assert hook.hook.dropped_outputs == 0 or busy  # (only ever dropped as busy)
    assert not [r.getMessage() for r in caplog.records if "render" in r.getMessage() and r not in busy]


def test_the_next_export_runs_while_the_worker_renders_the_previous_step(tmp_path):
    """The background thread exports step N+1 while the render worker still renders step N."""
    events = []

    class TimedPipeline(CapturePipeline):
        def save(self, job):
            events.append(("export", job.step, time.monotonic()))
            super().save(job)

        def render_elsewhere(self, job, exported):
            start = time.monotonic()
            rendered = super().render_elsewhere(job, exported)
            events.append(("render", job.step, start, time.monotonic()))
            return rendered

    class TimedHook(profiler_hook.ProfilerHook):
        pipeline_class = TimedPipeline

    hook = TimedHook(save_steps=1, output_dir=str(tmp_path / "prof"))
    trainer(str(tmp_path), [HookCallback([hook])], max_steps=6).fit(WideModel(), loader(n=48))
    renders = {step: (start, end) for kind, step, *times in events if kind == "render" for start, end in [times]}
    exports = {step: times[0] for kind, step, *times in events if kind == "export"}
    overlapped = [step for step in renders if step + 1 in exports and
                  renders[step][0] < exports[step + 1] < renders[step][1]]
    # a step whose turn came while the worker still rendered the previous one past the step's cost is dropped
    assert sorted(exports) == [2, 3, 4, 5, 6] and 2 in renders and hook.dropped_outputs == 5 - len(renders)
    assert overlapped  # (each render takes a few hundred ms, a training step far less)


def test_without_the_worker_the_same_files_come_from_the_background_thread(tmp_path):
    outputs = {}
    for render_worker in (True, False):
        out = tmp_path / f"worker-{render_worker}"
        hook = ProfilerHook(save_steps=2, output_dir=str(out), show_memory=True,
                            capture=CaptureOptions(render_worker=render_worker))
        fit = trainer(str(tmp_path), [hook], max_steps=4)
        fit.fit(TinyModel(), loader())
        trace = orjson.loads((out / "timeline-4.json").read_bytes())
        outputs[render_worker] = sorted((e.get("cat", ""), e.get("name", ""), e.get("ph", ""))
                                        for e in trace["traceEvents"] if e.get("ph") in ("X", "s", "t", "N", "O"))
    assert outputs[True] == outputs[False]
    kinds = {(category, ph) for category, _, ph in outputs[True]}
    assert {(fmt.CAT_DATAFLOW, "s"), (fmt.CAT_DATAFLOW, "t"), (fmt.CAT_OP, "X")} <= kinds  # arrows, ops
    assert any(ph == "N" for _, ph in kinds)  # memory objects


def test_exports_are_removed_once_rendered_and_a_dead_processs_are_removed_later(tmp_path, monkeypatch):
    import gc
    import tempfile

    import lightning as L

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    os.mkdir(tempfile.tempdir)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / "tmp" / f"hookprof-{dead.pid}-abcd1234"
    alive = tmp_path / "tmp" / f"hookprof-{os.getppid()}-abcd1234"  # (a live process's: not ours to remove)
    for directory in (stale, alive):
        directory.mkdir()
        (directory / "step-0.json").write_text("{}")
        os.utime(directory, (0, 0))  # made long ago, by a hookprof that claimed it by pid alone
    seen = []

    class Look(L.Callback):  # what this process's export directory holds at each step's end
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            mine = [p for p in (tmp_path / "tmp").iterdir() if p.name.startswith(f"hookprof-{os.getpid()}-")]
            seen.append([(oct(p.stat().st_mode & 0o777), sorted(c.name for c in p.iterdir())) for p in mine])

    hook = ProfilerHook(save_steps=2, output_dir=str(tmp_path / "prof"))
    trainer(str(tmp_path), [hook, Look()], max_steps=4).fit(TinyModel(), loader())
    assert not stale.exists() and (alive / "step-0.json").exists()
    # one private directory (0700: op names and code paths are not for other users), claimed by its lock file
    # from the first traced step on; exports come and go with their steps (step 4's stays while its
    # RunMetadata may still be read: the trace coordinator keeps the last traced step's until the next run)
    assert seen[0] == [] and {mode for entry in seen[1:] for mode, _ in entry} == {oct(0o700)}
    assert all(".owner" in names for entry in seen[1:] for _, names in entry)
    (mine,) = [p for p in (tmp_path / "tmp").iterdir() if p.name != alive.name]
    assert len([p for p in mine.iterdir() if p.name != ".owner"]) <= 1
    gc.collect()
    assert [p.name for p in mine.iterdir()] == [".owner"]
    assert [os.path.basename(p) for p in hook.saved_paths] == ["timeline-2.json", "timeline-4.json"]


def test_a_forked_child_starts_its_own_render_worker_and_leaves_the_parents_alone():
    """A process forked while the render worker runs (a DataLoader worker) holds none: a call there starts a
    worker of its own (the parent's pipes are never written from two processes), and the parent's answers on."""
    assert worker.WORKER.call(len, "ab") == 2
    parent_worker = worker.WORKER._process
    pid = os.fork()
    if pid == 0:
        try:
            fresh = worker.WORKER._process is None and not worker.WORKER._outstanding
            ok = fresh and worker.WORKER.call(len, "abc") == 3 and worker.WORKER._process is not parent_worker
            worker.WORKER.stop()
        finally:
            os._exit(0 if locals().get("ok") else 1)
    try:
        assert os.waitpid(pid, 0)[1] == 0
        assert worker.WORKER._process is parent_worker and worker.WORKER.call(len, "abcd") == 4
    finally:
        worker.WORKER.stop()


def test_a_forked_child_leaves_the_parents_exports_alone(tmp_path):
    """A DataLoader worker forked while exports wait drops them as garbage there; the files are the parent's."""
    from hookprof.hooks.session_run_hook import RunOptions
    from hookprof.tracing.torch_tracer import _Recording

    results = profiled_results(lambda: torch.nn.Linear(4, 4)(torch.randn(2, 4)))
    recording = _Recording(results, RunOptions())
    exported = recording.export()
    pid = os.fork()
    if pid == 0:  # the child drops its copies and collects them
        del recording, exported
        import gc

        gc.collect()
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert os.path.exists(exported.path)


def test_a_worker_that_dies_before_answering_makes_the_hook_render_in_process(tmp_path, monkeypatch, caplog):
    broken = worker.Worker()
    monkeypatch.setattr(worker, "WORKER", broken)
    monkeypatch.setattr(sys, "executable", "/bin/false")  # (an interpreter that cannot run the worker)
    out = tmp_path / "prof"
    with caplog.at_level(logging.WARNING):
        fit = trainer(str(tmp_path), [ProfilerHook(save_steps=2, output_dir=str(out))], max_steps=6)
        fit.fit(TinyModel(), loader())
    assert sorted(p.name for p in out.glob("timeline-*")) == ["timeline-2.json", "timeline-4.json", "timeline-6.json"]
    (warning,) = [r.getMessage() for r in caplog.records if "render worker" in r.getMessage()]
    assert "could not start" in warning and "exited with status 1 before answering once" in warning
    assert broken._process is None  # one try, not one per traced step
    with pytest.raises(OSError, match="before answering once"):
        broken.call(len, "abc")
    with pytest.raises(OSError, match="before answering once"):  # (said before a step is pickled for nothing)
        broken.post(len, (x for x in "abc"))


def test_a_step_the_worker_cannot_take_costs_its_timeline_only(tmp_path, monkeypatch, caplog):
    post = worker.WORKER.post

    def refuse_step_4(fn, exported, writer, spec):
        if spec.step == 4:
            raise TypeError("cannot pickle 'generator' object")  # (what an unpicklable field would raise)
        return post(fn, exported, writer, spec)

    monkeypatch.setattr(worker.WORKER, "post", refuse_step_4)
    out = tmp_path / "prof"
    hook = profiler_hook.ProfilerHook(save_steps=2, output_dir=str(out))
    with caplog.at_level(logging.WARNING):
        trainer(str(tmp_path), [HookCallback([hook])], max_steps=6).fit(TinyModel(), loader())
    assert sorted(p.name for p in out.glob("timeline-*")) == ["timeline-2.json", "timeline-6.json"]
    assert hook.dropped_outputs == 1
    (warning,) = [r.getMessage() for r in caplog.records if "render worker" in r.getMessage()]
    assert "timeline-4.json" in warning


def test_a_stopped_worker_whose_pipe_fills_is_stopped_at_the_calls_timeout():
    """A worker stopped with SIGSTOP reads nothing: a request larger than the pipe's buffer (a traced step's
    export is megabytes) fills it, and the call's write must give up at the timeout too, not wait for ever
    (it did: the training thread then waited for the render thread for good)."""
    own = worker.Worker()
    try:
        stopped = own.call(worker_probe.pid)
        os.kill(stopped, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(worker.WorkerFailed, match=r"took more than 1 s and was stopped"):
            own.call(len, b"x" * (8 << 20), timeout=1.0)  # 8 MiB: far over a pipe's 64 KiB
        assert time.monotonic() - start < 5
        assert own.call(worker_probe.pid, timeout=30) not in (stopped, None)  # a new worker answers
    finally:
        own.stop()


def test_a_worker_that_stops_answering_is_stopped_and_costs_that_call_only():
    """A hung worker (a stalled TMPDIR, say) must not hold up the fit's end: past the call's timeout it is
    stopped, the call fails, and the next call gets a new worker."""
    own = worker.Worker()
    try:
        hung = own.call(worker_probe.pid)
        start = time.monotonic()
        with pytest.raises(worker.WorkerFailed, match=r"took more than 0.5 s and was stopped"):
            own.call(time.sleep, 30, timeout=0.5)
        assert time.monotonic() - start < 5
        with pytest.raises(ProcessLookupError):  # (killed, and reaped by the call)
            for _ in range(50):
                os.kill(hung, 0)
                time.sleep(0.1)
        assert own.call(worker_probe.pid, timeout=30) not in (hung, None)
    finally:
        own.stop()


def test_a_step_the_worker_does_not_render_in_time_costs_its_timeline_only(tmp_path, caplog):
    out = tmp_path / "prof"
    hook = profiler_hook.ProfilerHook(save_steps=2, output_dir=str(out),
                                      capture=CaptureOptions(render_timeout_seconds=1e-6))  # (no worker is so fast)
    with caplog.at_level(logging.WARNING):
        fit = trainer(str(tmp_path), [HookCallback([hook])], max_steps=4)
        fit.fit(TinyModel(), loader())
    assert fit.global_step == 4 and not list(out.glob("timeline-*"))
    assert hook.dropped_outputs == 2
    (warning,) = [r.getMessage() for r in caplog.records if "render worker" in r.getMessage()]
    assert "timeline-2.json" in warning and "took more than 1e-06 s and was stopped" in warning


def test_the_workers_log_records_obey_the_training_processs_levels(caplog):
    own = worker.Worker()
    try:
        with caplog.at_level(logging.WARNING):
            own.call(worker_probe.warn, "said")
            logging.getLogger("hookprof.probe").setLevel(logging.ERROR)  # (the user quiets hookprof's warnings)
            own.call(worker_probe.warn, "quieted")
    finally:
        logging.getLogger("hookprof.probe").setLevel(logging.NOTSET)
        own.stop()
    assert [(r.name, r.getMessage()) for r in caplog.records] == [("hookprof.probe", "said")]


def test_a_worker_stopped_with_sigstop_never_holds_a_step_longer_than_its_cost_and_is_replaced(tmp_path, caplog):
    """A real SIGSTOP on the render worker in a fit: each traced step after it (but the one that waits in the
    queue behind the stopped render) waits for the worker about its own cost (RENDER_WAIT_FLOOR_SECONDS), then is
    dropped, measured as the training thread's time from one step's end
    to the next; the stopped worker is judged hung on the renders' thread after `render_stall_seconds` without
    CPU, killed, its step dropped and said once, and a new worker renders the steps after."""
    import lightning as L

    stopped, ends = [], []

    class StopTheWorker(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 3:
                hook.flush()  # (steps 1-3 rendered: the worker is idle, then stopped)
                stopped.append(worker.WORKER._process.pid)
                os.kill(stopped[0], signal.SIGSTOP)

    class TimeSteps(L.Callback):  # (last: after the hook has handed each step over)
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            ends.append((trainer.global_step, time.time()))
            replaced = stopped and worker.WORKER.answered and worker.WORKER._process.pid != stopped[0]
            if replaced and len(hook.saved_paths) >= 3 + 2:  # (two steps rendered by the new worker)
                trainer.should_stop = True

    out = tmp_path / "prof"
    hook = profiler_hook.ProfilerHook(save_steps=1, output_dir=str(out), capture=CaptureOptions(
        render_stall_seconds=5.0, render_timeout_seconds=120))
    fit = trainer(str(tmp_path), [HookCallback([hook]), StopTheWorker(), TimeSteps()], max_steps=5000)
    try:
        with caplog.at_level(logging.WARNING):
            fit.fit(TinyModel(), loader(n=64))
    finally:
        if stopped:
            with __import__("contextlib").suppress(ProcessLookupError):
                os.kill(stopped[0], signal.SIGKILL)
    messages = [r.getMessage() for r in caplog.records]
    (killed,) = [r for r in caplog.records if "used no CPU for 5 s" in r.getMessage()]
    assert "timeline-4.json" in killed.getMessage()  # (step 4 went to the stopped worker)
    assert sum("was still rendering the previous traced step" in m for m in messages) == 1
    # the training thread's waits while the worker was stopped: each step's end to the next one's
    hung = [(step, at) for step, at in ends if 4 <= step and at <= killed.created]
    waits = [later - earlier for (_, earlier), (_, later) in zip(hung, hung[1:])]
    assert len(waits) >= 3 and max(waits) < 1.5, waits  # (not the 5 s the worker took to be judged)
    assert killed.created - dict(ends)[4] >= 5  # judged after render_stall_seconds without CPU, no sooner
    written = sorted(int(p.name.split("-")[1].split(".")[0]) for p in out.glob("timeline-*.json"))
    assert written[:2] == [2, 3] and 4 not in written and len(written) >= 4  # steps after the kill rendered
    lost = set(range(2, fit.global_step + 1)) - set(written)
    # every lost step counted; lost: each step while the worker was stopped, but the one queued behind step 4
    from hookprof.hooks.capture import RENDERS_IN_FLIGHT

    assert hook.dropped_outputs + hook.skipped_traces == len(lost) >= len(waits) - (RENDERS_IN_FLIGHT - 1)
    assert worker.WORKER._process is None  # (the fit's end stopped the new one)
    assert not os.path.exists(f"/proc/{stopped[0]}")  # killed and reaped, not left stopped


def test_a_slow_worker_that_still_uses_cpu_is_not_judged_hung():
    """A worker starved of CPU (a loaded machine: really stopped 80% of the time) takes far longer than
    `stall` in wall time and is neither killed nor replaced; stopped for good, the same call kills it after
    `stall` seconds without CPU."""
    own = worker.Worker()
    running = threading.Event()
    running.set()

    def starve(pid):
        while running.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.4)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.1)

    try:
        pid = own.call(worker_probe.pid)  # (answered once: it is judged from now on)
        starver = threading.Thread(target=starve, args=(pid,))
        started = time.monotonic()
        starver.start()
        try:
            assert own.call(worker_probe.burn, 0.6, stall=1.0) == pid  # the same worker, not a new one
        finally:
            running.clear()
            starver.join()
            os.kill(pid, signal.SIGCONT)
        assert time.monotonic() - started > 2.0  # (0.6 s of CPU at a fifth of a core: well past the stall)
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(worker.WorkerFailed, match=r"used no CPU for 1 s .* and was killed"):
            own.call(worker_probe.burn, 0.6, stall=1.0)
        assert 1.0 <= time.monotonic() - started < 5
        assert own.call(worker_probe.pid) != pid  # a new worker
    finally:
        own.stop()


def test_a_worker_hung_while_starting_is_judged_by_its_cpu_and_none_is_started_again():
    """A worker whose start hangs (stopped before its first answer: its imports stuck on a stalled disk) is
    judged after `stall` seconds without CPU like a running one; a new one would hang the same way, so the
    calls after say no worker can run here (the capture pipeline then renders in the training process)."""
    own = worker.Worker()
    try:
        own.start(())
        pid = own._process.pid
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(OSError, match=r"no CPU for 1 s before answering once"):
            own.call(worker_probe.pid, stall=1.0)
        assert 1.0 <= time.monotonic() - started < 5
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
        assert not own.starting
        with pytest.raises(OSError, match="before answering once"):
            own.call(worker_probe.pid, stall=1.0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        own.stop()


class WorkerSeen(L.Callback):
    """Whether a render worker process runs at each batch's start (before the hooks of that batch run), and the
    fit's planned end as hookprof's session reads it."""

    def __init__(self):
        self.running: list[bool] = []
        self.final_step = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from lightning_prof.hook_callback import LightningSession

        process = worker.WORKER._process
        self.running.append(process is not None and process.poll() is None)
        if batch_idx == 0:
            self.final_step = LightningSession(trainer, pl_module).final_step


@pytest.mark.parametrize("max_steps, started", [(12, True), (9, False)])
def test_a_fit_whose_schedule_traces_starts_the_worker_with_its_first_step(tmp_path, max_steps, started):
    """Its interpreter starts as training starts, beside the steps before the first traced one (step 10), not
    with it; a fit that ends before its first timeline starts none (max_steps 9, or an epoch of 8 batches:
    both Lightning's `estimated_stepping_batches`)."""
    seen = WorkerSeen()
    hook = ProfilerHook(save_steps=10, output_dir=str(tmp_path), tensorboard=False)
    trainer(str(tmp_path), [seen, hook], max_steps=max_steps, max_epochs=2).fit(TinyModel(), loader(n=48))
    # the worker from the first batch on (Lightning's `on_train_start`), or never
    assert seen.running[:9] == [started] * 9
    assert len(hook.saved_paths) == int(started)
    assert worker.WORKER._process is None  # (stopped with the fit)


def test_a_manual_optimization_fit_counts_each_optimizers_steps_toward_its_end(tmp_path):
    """Two optimizers stepped every batch advance the global step twice a batch: 8 batches end at step 16, so
    `save_steps=10` traces in this fit and the worker starts with its first step."""
    from tests.test_step_clock import TwoOptimizers

    seen = WorkerSeen()
    hook = ProfilerHook(save_steps=10, output_dir=str(tmp_path), tensorboard=False)
    fit = trainer(str(tmp_path), [seen, hook], max_steps=-1, max_epochs=1, logger=False)
    fit.fit(TwoOptimizers(), loader())
    assert fit.global_step == 16 and seen.final_step == 16
    assert seen.running[0] and len(hook.saved_paths) == 1


@pytest.mark.parametrize("epochs, started", [(4, True), (3, False)])
def test_an_accumulating_fit_counts_its_optimizer_steps_toward_its_end(tmp_path, epochs, started):
    """Gradients accumulated over 2 batches: an epoch of 6 batches is 3 optimizer steps, so 4 epochs end at
    step 12 (`save_steps=10` traces step 10: the worker from the first batch on) and 3 at step 9 (none)."""
    seen = WorkerSeen()
    hook = ProfilerHook(save_steps=10, output_dir=str(tmp_path), tensorboard=False)
    fit = trainer(str(tmp_path), [seen, hook], max_steps=-1, max_epochs=epochs, accumulate_grad_batches=2,
                  logger=False)
    fit.fit(TinyModel(), loader(n=48))
    assert fit.global_step == seen.final_step == 3 * epochs
    assert len(seen.running) == 6 * epochs and all(r is started for r in seen.running[:19])
    assert [os.path.basename(p) for p in hook.saved_paths] == (["timeline-10.json"] if started else [])


@pytest.mark.parametrize("max_steps, started", [(30, True), (29, False)])
def test_a_resumed_fit_starts_the_worker_from_its_restored_schedule(tmp_path, max_steps, started):
    """A fit resumed from step 25 of a `save_steps=10` schedule (its last timeline at 20) traces step 30: the
    worker starts as training starts where the fit reaches 30, and not where it ends at 29."""
    first = trainer(str(tmp_path), [ProfilerHook(save_steps=10, output_dir=str(tmp_path / "a"), tensorboard=False)],
                    max_steps=25, logger=False)
    first.fit(TinyModel(), loader())
    checkpoint = str(tmp_path / "at-25.ckpt")
    first.save_checkpoint(checkpoint)
    seen = WorkerSeen()
    hook = ProfilerHook(save_steps=10, output_dir=str(tmp_path / "b"), tensorboard=False)
    trainer(str(tmp_path), [seen, hook], max_steps=max_steps, logger=False).fit(TinyModel(), loader(),
                                                                              ckpt_path=checkpoint)
    assert seen.running[0] is started and all(r is started for r in seen.running[:4])
    assert [os.path.basename(p) for p in hook.saved_paths] == (["timeline-30.json"] if started else [])
