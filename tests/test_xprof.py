"""TensorBoard's Profile tab (the xprof plugin): every traced step of a real Lightning or Keras fit lands in
`<logdir>/plugins/profile/step_<N>/<host>.xplane.pb`, and xprof's own converters read from it the timeline's
figures: the trace viewer names the ops, framework op stats count them as the timeline does, the memory profile
peaks where the timeline does, and the overview splits the step into input (data wait) and compute.

The tests that run xprof skip where it is not installed (`pip install hookprof[xprof]`, or `make test`, whose
environment has it); the file layout, retention and no-rewrite rules are checked without it.
"""

import collections
import copy
import functools
import glob
import gzip
import json
import os
import random
import re
import urllib.parse
import urllib.request

import numpy as np
import pytest

from hookprof._runtime import wire
from hookprof.hooks import CaptureOptions
from hookprof.hooks.capture import remove_profile_run
from hookprof.trace import xplane
from hookprof.trace.reader import load_trace
from hookprof.tracing import xspace
from lightning_prof import ProfilerHook
from tests.lightning_models import TinyModel, loader, trainer
from tests.test_tensorboard_server import tensorboard_server

try:
    from xprof.convert import raw_to_tool_data
except ImportError:  # (any import failure of xprof's C API counts as "not installed here")
    raw_to_tool_data = None
needs_xprof = pytest.mark.skipif(raw_to_tool_data is None, reason="xprof is not installed (pip install "
                                 "'hookprof[xprof]'; `make test`'s environment has it)")


def get_json(url):
    """A JSON reply of the profile plugin's API, which answers gzipped."""
    with urllib.request.urlopen(url, timeout=60) as response:
        body = response.read()
    return json.loads(gzip.decompress(body) if body[:2] == b"\x1f\x8b" else body)


def profile_files(root):
    return sorted(glob.glob(os.path.join(root, "**", "plugins", "profile", "*", "*.xplane.pb"), recursive=True))


def lightning_fit(root, steps=3, **hook_args):
    hook = ProfilerHook(save_steps=2, output_dir=None, show_memory=True, **hook_args)
    fit = trainer(root, [hook], steps)
    fit.fit(TinyModel(), loader())
    return hook, fit


def tool(path, name, **params):
    data, _ = raw_to_tool_data.xspace_to_tool_data([path], name, params)
    return json.loads(data)


def rows(table):
    ids = [column["id"] for column in table["cols"]]
    return [dict(zip(ids, [cell.get("v") if cell else None for cell in row["c"]])) for row in table["rows"]]


def timeline_figures(path):
    """What the timeline says of its step: ops (by scope/op), the phase spans (µs), the peak bytes."""
    trace = load_trace(path)
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    ops = collections.Counter(f"{e['args']['scope']}/{e['name']}" if e["args"].get("scope") else e["name"]
                              for e in events if e["cat"] == "Op")
    spans = {e["name"]: e for e in events if e["cat"] == "Span"}
    return ops, spans, trace["metadata"]


def check_profile_matches_timeline(pb, timeline, step):
    """xprof's converters, run on the step's XSpace, give the timeline's figures."""
    ops, spans, metadata = timeline_figures(timeline)
    assert ops, "the timeline holds no op"

    viewer = tool(pb, "trace_viewer")["traceEvents"]
    named = collections.Counter(e["name"] for e in viewer if e.get("ph") == "X" and e["name"] in ops)
    assert named == ops  # every op, by its scoped name, on its thread track

    stats = rows(tool(pb, "framework_op_stats")[0])
    counted = {row["operation"]: int(row["occurrences"]) for row in stats if row["type"] != "IDLE"}
    assert counted == ops
    assert {row["host_or_device"] for row in stats} == {"Host"}
    assert all(row["eager"] == "Eager" for row in stats if row["type"] != "IDLE")

    wait, train = spans["data_wait"], spans[f"ProfilerStep#{step}"]
    for page in ("overview_page", "input_pipeline_analyzer"):  # each page's step-time graph
        (graph,) = [t for t in tool(pb, page) if any(c["id"] == "stepTimeMs" for c in t.get("cols", ()))]
        (row,) = rows(graph)
        assert row["stepnum"] == f"ProfilerStep#{step}"
        assert row["infeedTimeMs"] == pytest.approx(wait["dur"] / 1000, abs=1e-6)  # the data wait is input time
        assert row["hostComputeTimeMs"] == pytest.approx(train["dur"] / 1000, abs=1e-6)  # the phases: compute
        assert row["stepTimeMs"] == pytest.approx((train["ts"] + train["dur"] - wait["ts"]) / 1000, abs=1e-6)

    memory = tool(pb, "memory_profile")
    (profile,) = memory["memoryProfilePerAllocator"].values()
    assert int(profile["profileSummary"]["peakBytesUsageLifetime"]) == metadata["peak_allocated_bytes"]["/host:CPU"]
    assert profile["memoryProfileSnapshots"]  # the allocator's timeline
    return stats


def test_each_traced_step_is_a_profile_run_beside_the_fits_tensorboard_data(tmp_dir):
    hook, fit = lightning_fit(tmp_dir, steps=5)
    files = profile_files(tmp_dir)
    runs = [os.path.relpath(f, fit.log_dir).split(os.sep) for f in files]
    host = os.uname().nodename
    assert runs == [["plugins", "profile", "step_0000000002", f"{host}.xplane.pb"],
                    ["plugins", "profile", "step_0000000004", f"{host}.xplane.pb"]]
    space = xspace.parse_xspace(open(files[0], "rb").read())
    assert [p.name for p in space.planes] == [xplane.HOST_PLANE, xplane.TASK_PLANE] and list(space.hostnames) == [host]
    assert xspace.profile_start_ns(space) > 1.7e18  # the step's epoch time; event offsets count from it
    rows = list(xspace.events(space, frozenset({xplane.GROUP_ID})))
    assert rows and all(row.stats[xplane.GROUP_ID] == 2 for row in rows)  # every event in the step, 0 or not


def traced_step():
    """A real traced step (forward and backward of a small model), with memory: step 0."""
    import torch

    from hookprof.run_options import RunOptions, TraceLevel
    from hookprof.tracing.torch_tracer import TorchTracer

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    tracer = TorchTracer(model)
    tracer.start(RunOptions(trace_level=TraceLevel.FULL_TRACE, record_dataflow=True, record_memory=True))
    model(torch.randn(4, 8)).sum().backward()
    stats = tracer.stop()
    stats.step = 0  # group_id 0 must be written (a oneof)
    return stats


def test_the_hand_encoded_xspace_is_what_protobuf_itself_writes_for_the_same_message():
    """`step_xspace` writes protobuf's wire format by hand: parsed by protobuf and written again by it (fields
    in number order), a real traced step with memory comes back byte for byte."""
    data = xplane.step_xspace(traced_step(), "host")
    space = xspace.parse_xspace(data)
    assert space.SerializeToString(deterministic=True) == data
    names = {entry.key: entry.value.name for entry in space.planes[0].event_metadata}
    kinds = collections.Counter(names[e.metadata_id] for line in space.planes[0].lines for e in line.events)
    assert kinds[xplane.MEMORY_ALLOCATION] > 0 and kinds["aten::addmm"] == 0  # ops carry their scope
    assert any(name.endswith("/aten::addmm") for name in kinds)
    values = (0, 1, 127, 128, 2**14 - 1, 2**14, 2**21, 2**28, 2**35, 2**42 - 1, 2**42, 2**49, 2**56, 2**63 - 1,
              -1, -2**63)
    together = wire.varints(values)  # (the event offsets' encoder: numpy, all at once)
    for value, encoded in zip(values, together):
        stat = xplane.message("XStat")(metadata_id=1, int64_value=value)
        assert stat.SerializeToString() == b"\x08\x01\x20" + wire.varint(value) == b"\x08\x01\x20" + encoded
    assert wire.varints([2**64 - 1, 2**70]) == [wire.varint(2**64 - 1), wire.varint(2**70)]  # (beyond int64)


def test_a_repeated_fields_events_written_together_are_what_protobuf_reads_and_writes():
    """`wire.delimited_each` (a line's events at C's pace) against protobuf's own parser and serialiser: an
    empty payload, short ones and one past the precomputed lengths (2048 bytes)."""
    line = xplane.message("XLine")
    events = [xplane.message("XEvent")(metadata_id=i + 1, offset_ps=i * 1000, duration_ps=size)
              for i, size in enumerate((0, 5, 300, 2**40))]
    events[2].stats.add(metadata_id=3, str_value="x" * 3000)  # (a payload of more than 2048 bytes)
    payloads = [e.SerializeToString() for e in events] + [b""]
    field = wire.tag(4, wire.LENGTH_DELIMITED)  # XLine.events
    together = wire.delimited_each(field, payloads)
    assert together == b"".join(wire.delimited(field, p) for p in payloads)
    parsed = line.FromString(together)
    assert list(parsed.events) == events + [xplane.message("XEvent")()]
    assert parsed.SerializeToString() == together
    assert wire.delimited_each(field, payloads[:2]) == b"".join(wire.delimited(field, p) for p in payloads[:2])
    assert wire.joined([b"a", b"b"], [b"1", b""], [b"x", b"y"]) == [b"a1x", b"by"]


def test_a_steps_fields_encoded_together_are_each_as_encoded_alone():
    """`wire.int_fields` (a step's start times) and `wire.each_encoded` (its durations, each distinct one encoded
    once) give each value's own field: zero left out, negatives as protobuf writes them, past int64."""
    values = [0, 1, 127, 128, 2**42, -1, 0, 5, 2**63 - 1, 128, -2**63]
    field = wire.tag(3, wire.VARINT)
    alone = [wire.int_field(field, value) for value in values]
    assert wire.int_fields(field, values) == wire.int_fields(field, np.array(values)) == alone
    assert wire.int_fields(field, [2**64 - 1]) == [wire.int_field(field, 2**64 - 1)]
    assert list(wire.each_encoded(np.array(values), functools.partial(wire.int_fields, field))) == alone
    assert wire.int_fields(field, []) == [] and list(wire.each_encoded(np.array([], dtype=np.int64), list)) == []


def test_a_threads_events_are_written_in_time_order_the_outer_first_however_they_came():
    """xprof nests a line's events by their order: a thread's events that came out of order (shuffled, and one
    starting with another that outlasts it after it) are written by start, the longer first, each with its own
    metadata and stats."""
    ordered = traced_step()
    nodes = next(dev for dev in ordered.dev_stats if dev.device == xplane.HOST_PLANE).node_stats
    early, late = sorted((node for node in nodes if node.category == "Op"), key=lambda node: node.start_ns)[:2]
    assert nodes.index(early) < nodes.index(late)
    late.start_ns, late.duration_ns = early.start_ns, early.duration_ns + 1  # (written before it, as its parent)
    shuffled = copy.deepcopy(ordered)
    random.Random(0).shuffle(next(dev for dev in shuffled.dev_stats if dev.device == xplane.HOST_PLANE).node_stats)
    spaces = [xspace.parse_xspace(xplane.step_xspace(stats, "host")) for stats in (shuffled, ordered)]
    lines = [[line for line in space.planes[0].lines if line.id != xplane.MEMORY_LINE_ID] for space in spaces]
    for line in lines[0]:
        times = [(event.offset_ps, -event.duration_ps) for event in line.events]
        assert times == sorted(times) and len(set(times)) > 1
    # the same events as the step in order writes (by their bytes: their metadata and stats with their times)
    assert [sorted(e.SerializeToString() for e in line.events) for line in lines[0]] == \
        [sorted(e.SerializeToString() for e in line.events) for line in lines[1]]


def test_keep_last_removes_old_profile_runs_with_what_xprof_cached_and_a_refit_never_rewrites_one(tmp_dir):
    out = os.path.join(tmp_dir, "prof")
    hook = ProfilerHook(save_steps=1, output_dir=out, keep_last=1)
    trainer(tmp_dir, [hook], 4).fit(TinyModel(), loader())
    assert [os.path.basename(os.path.dirname(f)) for f in profile_files(out)] == ["step_0000000004"]
    assert sorted(os.listdir(os.path.join(out, "plugins", "profile"))) == ["step_0000000004"]  # dirs gone too

    first = profile_files(out)[0]
    before = open(first, "rb").read()
    hook = ProfilerHook(save_steps=1, output_dir=out)
    trainer(tmp_dir, [hook], 4).fit(TinyModel(), loader())  # a second fit, from step 0, into the same dir
    assert open(first, "rb").read() == before  # xprof caches beside it: never rewritten
    assert sorted(os.path.basename(os.path.dirname(f)) for f in profile_files(out)) == [
        "step_0000000002", "step_0000000003", "step_0000000004", "step_0000000004.1"]


def test_remove_profile_run_takes_xprofs_caches_but_not_another_hosts_file(tmp_dir):
    run = os.path.join(tmp_dir, "plugins", "profile", "step_0000000001")
    os.makedirs(run)
    for name in ("a.xplane.pb", "b.xplane.pb", "ALL_HOSTS.op_stats_v2.pb", "NO_MODULE.hlo_proto.pb"):
        open(os.path.join(run, name), "wb").close()
    os.makedirs(run + "_jax")  # JAX's own XSpace of the step, beside hookprof's run: it goes with it
    for name in ("a.xplane.pb", "b.xplane.pb", "a.op_stats_v2.pb"):
        open(os.path.join(run + "_jax", name), "wb").close()
    remove_profile_run(os.path.join(run, "a.xplane.pb"))
    assert os.listdir(run) == ["b.xplane.pb"]  # the other rank's file stays; the caches (of both) go
    assert os.listdir(run + "_jax") == ["b.xplane.pb"]
    remove_profile_run(os.path.join(run, "b.xplane.pb"))
    assert not os.path.exists(run) and not os.path.exists(run + "_jax")


@pytest.mark.parametrize("hook_args", [{"capture": CaptureOptions(profile_tab=False)}, {"tensorboard": False}],
                         ids=["profile_tab=False", "tensorboard=False"])
def test_no_profile_run_without_profile_tab_or_tensorboard(tmp_dir, hook_args):
    hook, _ = lightning_fit(tmp_dir, **hook_args)
    assert hook.saved_paths and not profile_files(tmp_dir)


def test_capture_options_profile_tab_must_be_a_bool():
    with pytest.raises(TypeError, match="profile_tab"):
        CaptureOptions(profile_tab="yes")


@needs_xprof
def test_xprof_reads_a_lightning_fits_traced_step_as_the_timeline_has_it(tmp_dir):
    hook, _ = lightning_fit(tmp_dir)
    (pb,) = profile_files(tmp_dir)
    stats = check_profile_matches_timeline(pb, hook.saved_paths[0], 2)
    names = {row["operation"] for row in stats}
    assert {"TinyModel/fc1/aten::addmm", "TinyModel/fc2/aten::addmm"} <= names  # module scope, then torch's op
    assert {row["type"] for row in stats if row["operation"] == "TinyModel/fc1/aten::addmm"} == {"aten::addmm"}


@needs_xprof
def test_the_profile_tabs_step_starts_at_the_wait_before_it_when_it_waits_inside_too(tmp_dir):
    """Under gradient accumulation a step also waits for its later batches, inside it: xprof's step starts at
    the wait before the step, not at the last one inside it."""
    hook = ProfilerHook(save_steps=2, output_dir=None)
    trainer(tmp_dir, [hook], 3, accumulate_grad_batches=2).fit(TinyModel(), loader())
    (pb,) = profile_files(tmp_dir)
    spans = [e for e in load_trace(hook.saved_paths[0])["traceEvents"] if e.get("ph") == "X" and e["cat"] == "Span"]
    train = next(e for e in spans if e["name"] == "ProfilerStep#2")
    waits = sorted((e for e in spans if e["name"] == "data_wait"), key=lambda e: e["ts"])
    assert waits[0]["ts"] < train["ts"] < waits[-1]["ts"]  # (one before the step, one inside it)
    (graph,) = [t for t in tool(pb, "overview_page") if any(c["id"] == "stepTimeMs" for c in t.get("cols", ()))]
    (row,) = rows(graph)
    assert row["stepTimeMs"] == pytest.approx((train["ts"] + train["dur"] - waits[0]["ts"]) / 1000, abs=1e-6)


@needs_xprof
def test_xprof_reads_a_keras_fits_traced_step_as_the_timeline_has_it(tmp_dir):
    from keras_prof import ProfilerHook as KerasProfilerHook
    from tests.test_keras_prof import fit, model

    out = os.path.join(tmp_dir, "logs")
    hook = KerasProfilerHook(save_steps=3, output_dir=out, show_memory=True)
    fit(model(), [hook], epochs=1, n=32)
    (pb,) = profile_files(out)
    stats = check_profile_matches_timeline(pb, hook.saved_paths[0], 3)
    assert any(row["operation"].startswith("tiny/fc1/") for row in stats)


@needs_xprof
def test_tensorboard_serves_the_profile_runs_and_their_tools(tmp_dir):
    lightning_fit(tmp_dir, steps=5)
    found = []

    def listed(base):
        found[:] = get_json(base + "/data/plugin/profile/runs")
        return len(found) == 2

    with tensorboard_server(tmp_dir, listed) as base:
        base, runs = base + "/data/plugin/profile", found
        # each traced step a run, the newest first (xprof sorts the run names, which sort as the steps do)
        assert [run.rsplit("/", 1)[-1] for run in runs] == ["step_0000000004", "step_0000000002"]
        query = urllib.parse.quote(runs[0])
        tools = get_json(f"{base}/run_tools?run={query}")
        assert {"trace_viewer@", "overview_page", "framework_op_stats", "memory_profile"} <= set(tools)
        host = os.uname().nodename
        table = get_json(f"{base}/data?run={query}&tag=framework_op_stats&host={host}")[0]
        assert "TinyModel/fc1/aten::addmm" in {row["operation"] for row in rows(table)}


@needs_xprof
def test_the_profile_tab_shows_the_traced_step_in_chromium(tmp_dir):
    dashboard = pytest.importorskip("tests.test_tensorboard_dashboard")
    if dashboard.CHROMIUM is None:
        pytest.skip("no Chromium installed (apt-get install chromium)")
    hook, _ = lightning_fit(tmp_dir, steps=3)
    _, spans, _ = timeline_figures(hook.saved_paths[0])
    ready = lambda base: get_json(base + "/data/plugin/profile/runs")  # noqa: E731
    frame_text = dashboard.DEEP + ("(() => { const f = deep(document, 'iframe'); const d = f && f.contentDocument; "
                                   "return d && d.body ? d.body.innerText : ''; })()")
    with tensorboard_server(tmp_dir, ready) as base, dashboard.chromium_page() as page:
        page.call("Page.navigate", url=f"{base}/#profile")  # the plugin's page is an iframe of TensorBoard's
        page.wait_for(frame_text[len(dashboard.DEEP):] + ".includes('Host Compute Time')", 120)
        text = " ".join(page.js(frame_text).split())
        dashboard.screenshot(page, os.path.join(tmp_dir, "profile-overview.png"))
    assert "step_0000000002" in text and "Overview Page" in text
    shown = {name: float(ms) for name, ms in re.findall(r"(Input|Host Compute) Time \(σ = [^)]*\) ([\d.]+) ms", text)}
    assert shown == {"Input": round(spans["data_wait"]["dur"] / 1000, 1),
                     "Host Compute": round(spans["ProfilerStep#2"]["dur"] / 1000, 1)}
