"""keras_prof on the JAX backend: a real `Model.fit` (in its own process, tests/keras_jax_fit.py) traced with JAX's
profiler. Timelines hold the train step's XLA ops, and only that step's; the TensorBoard graph, the Profiler's
op view and the summaries are read back with the project's and TensorBoard's own readers."""

import json
import os
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from hookprof.profiler import Profiler
from tests.conftest import load_trace, op_events

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def jax_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("keras_jax")
    env = {**os.environ, "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", "tests.keras_jax_fit", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out / "result.json") as f:
        result = json.load(f)
    assert result["backend"] == "jax"
    return out, result, done.stderr


def _hlo_ops(trace):
    return op_events(trace)


def test_timelines_at_the_scheduled_steps_hold_the_train_steps_xla_ops(jax_run):
    out, result, stderr = jax_run
    assert [os.path.basename(p) for p in result["paths"]] == ["timeline-2.json", "timeline-4.json", "timeline-6.json"]
    assert "the Keras backend is" not in stderr  # the JAX backend has its op-level tracer: no fallback warning
    per_step = []
    for path in result["paths"]:
        trace = load_trace(path)
        assert trace["metadata"]["tracer"] == "jax"
        ops = _hlo_ops(trace)
        assert ops and all(e["dur"] > 0 for e in ops)  # XLA's executions, each with its measured duration
        assert {e["args"]["hlo_module"] for e in ops} == {"jit_train_step"}  # Keras' jitted train step
        # the model's layers in the forward and the backward pass, the optimizer's update, as on the torch backend
        seen = {(e["args"].get("scope", ""), e["args"]["phase"]) for e in ops}
        assert {("tiny/fc1", "forward"), ("tiny/fc1", "backward"), ("optimizer/sgd", "optimizer")} <= seen, seen
        # one execution of the train step, inside the step's span: nothing from the steps before or after
        programs = op_events(trace, "Module")
        assert [e["name"] for e in programs] == ["jit_train_step"]
        step = next(e for e in op_events(trace, "Span") if e["args"]["op"] == "train_step")
        assert step["name"] == f"ProfilerStep#{trace['metadata']['step']}"
        for e in ops + programs:
            assert step["ts"] <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 1e-3, e
        # the phase spans come in the step's order, though XLA schedules a little optimizer work early
        phases = [e for e in op_events(trace, "Span") if e["args"]["op"] in ("forward", "backward", "optimizer")]
        assert [e["args"]["op"] for e in sorted(phases, key=lambda e: e["ts"])] == ["forward", "backward",
                                                                                    "optimizer"], phases
        optimizer = next(e for e in phases if e["args"]["op"] == "optimizer")
        backward_ends = [e["ts"] + e["dur"] for e in ops if e["args"]["phase"] == "backward"]
        assert optimizer["ts"] >= max(backward_ends) - 1e-3
        names = [e["args"]["name"] for e in ops]
        assert len(names) == len(set(names)) and not any(n.endswith("_1") for n in names)  # each HLO op once
        per_step.append(sorted(names))
        # full trace: each op's operands and output, as XLA compiled them
        dot = next(e for e in ops if e["args"].get("op_name", "").endswith("jvp(fc1)/dot_general"))
        assert [8, 8] in dot["args"]["input_shapes"] and dot["args"]["outputs"][0]["shape"] == [8, 16]
    assert per_step[0] == per_step[1] == per_step[2]  # the same program, the same ops, at every traced step


def test_dataflow_arrows_and_the_tensorboard_step_graph(jax_run):
    out, result, _ = jax_run
    trace = load_trace(result["paths"][0])
    ops = {e["args"]["name"]: e for e in _hlo_ops(trace)}
    flows = [e for e in trace["traceEvents"] if e.get("cat") == "DataFlow" and e["ph"] == "s"]
    assert flows
    for flow in flows:  # each arrow leaves a producer of this step after it ended, for a consumer of this step
        producer, consumer = ops[flow["args"]["producer"]], ops[flow["args"]["consumer"]]
        assert producer["ts"] + producer["dur"] <= consumer["ts"] + 1e-3
    acc = EventAccumulator(str(out / "timelines"), size_guidance={"run_metadata": 0})
    acc.Reload()
    assert sorted(acc.Tags()["run_metadata"]) == ["step_2", "step_4", "step_6"]
    nodes = {n.name: n for n in acc.Graph().node}
    assert {n.op for n in nodes.values()} == {e["name"] for e in _hlo_ops(load_trace(result["paths"][-1]))}
    assert any(n.input for n in nodes.values())
    for node in nodes.values():  # every input names a node of the graph
        assert all(source.split(":")[0] in nodes for source in node.input)
    stats = [s for dev in acc.RunMetadata("step_6").step_stats.dev_stats for s in dev.node_stats]
    assert {s.node_name for s in stats} == set(nodes) and all(s.all_end_rel_micros > 0 for s in stats)


def test_the_profilers_op_view_over_the_traced_steps(jax_run):
    out, result, _ = jax_run
    with open(out / "run.prof", "rb") as f:
        prof = Profiler.load(f.read())
    traces = {int(os.path.basename(p)[9:-5]): load_trace(p) for p in result["paths"]}
    assert prof.data.step_numbers() == sorted(traces) == [2, 4, 6]
    for step, trace in traces.items():
        rows = prof.profile_operations({"step": step, "select": ["micros", "occurrence"], "output": "none"}).rows
        counted = {r.name: r.self_["occurrence"] for r in rows if r.self_["occurrence"]}
        in_trace: dict[str, int] = {}
        for e in _hlo_ops(trace):
            in_trace[e["name"]] = in_trace.get(e["name"], 0) + 1
        assert counted == in_trace  # one row per XLA op kind, counting its executions in that step
        assert sum(r.self_["micros"] for r in rows) > 0
    scopes = prof.profile_name_scope({"step": -1, "output": "none", "max_depth": 2})
    assert "tiny" in {child.name for child in scopes.children}


def test_with_stack_each_op_has_the_python_stack_that_made_it(jax_run):
    out, result, _ = jax_run
    ops = _hlo_ops(load_trace(result["paths"][0]))
    dot = next(e for e in ops if e["args"].get("op_name", "").endswith("jvp(fc1)/dot_general"))
    stack = dot["args"]["stack"]  # outermost frame first: ... Dense.call, then the matmul it called, last
    dense = next(i for i, frame in enumerate(stack) if "layers/core/dense.py" in frame)
    assert "matmul" in stack[-1] and dense < len(stack) - 1, stack
    with open(out / "run.prof", "rb") as f:
        code = Profiler.load(f.read()).profile_python({"step": -1, "output": "none", "max_depth": 100})
    assert any("layers/core/dense.py" in node.name for node in code.walk())  # the code view, from the same stacks


def test_summaries_of_jax_values_read_back_with_tensorboard(jax_run):
    out, result, _ = jax_run
    assert result["fetched_jax_arrays"] == [True] * 6  # fetches hand back the JAX array itself, on the device
    acc = EventAccumulator(str(out / "logs"), size_guidance={"tensors": 0})
    acc.Reload()
    sums = acc.Tensors("kernel_sum")
    assert [e.step for e in sums] == [1, 3, 5]  # the first step, then every 2: only the saving steps convert
    for event in sums:
        written = float(tensor_util.make_ndarray(event.tensor_proto))
        assert written == pytest.approx(result["kernel_sums"][str(event.step)], rel=1e-5, abs=1e-6)
    histograms = acc.Tensors("fc1/kernel")
    assert [e.step for e in histograms] == [1, 3, 5]
    buckets = tensor_util.make_ndarray(histograms[0].tensor_proto)  # rows of (left edge, right edge, count)
    assert buckets[:, 2].sum() == result["kernel_size"]  # every weight of the JAX array counted


def test_a_users_own_jax_profiler_trace_wins_with_one_warning(jax_run):
    out, result, stderr = jax_run
    assert result["beside_user_trace"] == []  # hookprof stepped aside: no timeline of ours while it ran
    assert stderr.count("a jax.profiler trace is running") == 1
    user_files = [n for _, _, names in os.walk(out / "user_trace") for n in names]
    assert any(n.endswith(".xplane.pb") for n in user_files)  # the user's own trace was written whole


def test_checkpoint_saver_alone_saves_each_steps_weights_and_optimizer(jax_run):
    """On JAX the variables live outside the model during fit; with no hook fetching anything, the saver still
    saves this step's model (its first save after step 0 failed with Adam.get_config's TypeError)."""
    _, result, _ = jax_run
    assert result["checkpoint_steps"] == [0, 2, 4, 6] and result["checkpoint_dropped"] == 0
    assert result["latest_iterations"] == 6 and result["latest_equals_model"]


def test_the_profile_tab_has_hookprofs_step_and_jaxs_own_xspace_beside_it(jax_run):
    """Each traced step is two Profile-tab runs: hookprof's `step_N` (the step's phases and scopes, as the
    timeline has them) and `step_N_jax`, the XSpace JAX's profiler handed back, as Keras'
    `TensorBoard(profile_batch=)` writes it: XLA's ops by their HLO names in xprof's trace viewer (xprof's op
    tables count no framework ops in it on CPU: hookprof's run has those, by layer and phase)."""
    from hookprof.trace import xplane
    from hookprof.tracing import xspace
    from tests.test_xprof import raw_to_tool_data

    out, result, _ = jax_run
    profile = os.path.join(out, "timelines", "plugins", "profile")
    host = os.uname().nodename
    assert sorted(os.listdir(profile)) == [f"step_{n:010d}{suffix}" for n in (2, 4, 6) for suffix in ("", "_jax")]
    natives = []
    for step in (2, 4, 6):
        ours = xspace.parse_xspace(open(os.path.join(profile, f"step_{step:010d}", f"{host}.xplane.pb"), "rb").read())
        native_path = os.path.join(profile, f"step_{step:010d}_jax", f"{host}.xplane.pb")
        native = xspace.parse_xspace(open(native_path, "rb").read())
        assert [p.name for p in ours.planes] == [xplane.HOST_PLANE, xplane.TASK_PLANE]
        assert native != ours and len(native.planes) >= 1
        hlo_ops = {row.name for row in xspace.events(native, frozenset({"hlo_op"})) if "hlo_op" in row.stats}
        assert hlo_ops, [p.name for p in native.planes]  # XLA's executed ops, as JAX recorded them
        natives.append((native_path, hlo_ops))
    if raw_to_tool_data is None:
        pytest.skip("xprof is not installed: its trace viewer is not run on JAX's files")
    for native_path, hlo_ops in natives:  # xprof's trace viewer on JAX's file: XLA's ops, by their HLO names
        data, _ = raw_to_tool_data.xspace_to_tool_data([native_path], "trace_viewer", {})
        shown = {event.get("name") for event in json.loads(data)["traceEvents"]}
        assert hlo_ops <= shown, sorted(hlo_ops - shown)[:10]


@pytest.fixture(scope="module")
def jax_configs(tmp_path_factory):
    """tests/keras_jax_fit.py's `configs`: a slow generator, a train step without jit, FeedFnHook under jit."""
    out = tmp_path_factory.mktemp("keras_jax_configs")
    env = {**os.environ, "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", "tests.keras_jax_fit", str(out), "configs"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out / "result.json") as f:
        return json.load(f), done.stderr


def test_a_slow_input_pipeline_shows_as_data_wait_not_forward(jax_configs):
    """Keras on JAX fetches the batch inside the train function: a 40 ms generator showed as a 40 ms forward pass
    and no data wait. (Step 2's batch was read ahead by Keras, looking at the generator's first batches.)"""
    slow = jax_configs[0]["slow"]
    assert slow["paths"] == ["timeline-2.json", "timeline-4.json", "timeline-6.json"]
    assert all(wait >= 35_000 for wait in slow["data_wait_us"][1:]), slow
    assert all(0 < forward < 35_000 for forward in slow["forward_us"][1:]), slow


def test_steps_per_execution_waits_for_each_batch_in_a_data_wait_of_its_own(jax_configs):
    """With steps_per_execution=4 Keras fetches a call's later three batches inside the call, between its jitted
    steps, with no callback: each fetch of the 40 ms generator is a data wait inside the traced call (it was
    counted as the step's compute), and the Profiler counts all four waits as data wait, not as step time."""
    grouped = jax_configs[0]["grouped"]
    phased = 0  # batches whose program ran before the next fetch (or the step's end)
    assert grouped["paths"] == ["timeline-8.json", "timeline-12.json"]  # (the calls that end at steps 8 and 12)
    for spans in grouped["spans"]:
        names = [name for name, _, _ in spans]
        waits = [dur for name, _, dur in spans if name == "data_wait"]
        assert len(waits) == 4 and all(wait >= 35_000 for wait in waits), spans  # before the call, then 3 inside
        train = next((start, dur) for name, start, dur in spans if name.startswith("ProfilerStep#"))
        inside = [start for name, start, _ in spans if name == "data_wait" and start >= train[0]]
        assert len(inside) == 3 and all(start < train[0] + train[1] for start in inside)
        # each batch is a forward pass of its own, then the backward pass and optimizer its ops show before the next
        # fetch (JAX dispatches a batch's program and may run it during that fetch: its ops, not its phase spans)
        batches = " ".join(names[names.index("forward"):]).split(" data_wait ")
        assert len(batches) == 4 and all(batch in ("forward", "forward backward optimizer") for batch in batches)
        phased += batches.count("forward backward optimizer")
    assert phased >= 1, grouped["spans"]
    for step in ("8", "12"):
        wait, step_us = grouped["profile"][step]
        assert wait >= 4 * 35_000 and step_us < 35_000, grouped["profile"]


def test_a_call_cut_short_by_its_epochs_end_counts_the_batches_it_ran(jax_configs):
    """steps_per_execution=4 over a generator of 10 batches: the last call runs 2 and finds the generator empty
    at its third fetch. The step clock counts 2 (it counted the call as full: 12, against the optimizer's 10),
    the call's timeline is named for step 10, and the fetch that found nothing leaves no data wait at its end."""
    uneven = jax_configs[0]["uneven"]
    assert uneven["steps"] == [4, 8, 10] and uneven["iterations"] == 10
    assert uneven["paths"] == ["timeline-8.json", "timeline-10.json"]
    names = [name for name, _, _ in uneven["spans"][-1]]
    assert names[-3:] == ["forward", "backward", "optimizer"] and names.count("data_wait") == 2, names


def test_a_generator_running_out_ends_the_epoch_and_the_hooks_end(jax_configs):
    """The step that finds the generator empty raises StopIteration inside the train function: Keras ends the epoch
    there, and the fit goes on to its end; the hooks' `end()` ran (it did not: the fit was closed as failed)."""
    slow = jax_configs[0]["slow"]
    assert slow["steps"] == [1, 2, 3, 4, 5, 6] and slow["ended"]


def test_a_train_step_without_jit_says_once_why_its_ops_have_no_scopes(jax_configs):
    result, stderr = jax_configs
    assert result["unjitted_paths"] == 6  # 2 epochs of 6 steps, every second traced
    assert stderr.count("keras_prof: this model's train step runs without jit (jit_compile=False), so JAX runs each "
                        "op as its own small program: traced steps show the ops without scopes, all as 'forward'") == 1


def test_feed_fn_hook_is_refused_under_jit_and_feeds_every_step_eagerly(jax_configs):
    result = jax_configs[0]
    assert result["feed_under_jit"] == (
        "FeedFnHook feeds each step through hookprof.step_feeds(), but Keras on jax compiles the train step (traced "
        "once, then replayed): it would read the first step's values on every step. Compile the model with "
        "run_eagerly=True (model.compile(..., run_eagerly=True)) or jit_compile=False to feed each step.")
    assert result["feed_under_jit_iterations"] == 0  # refused before the first step
    assert result["fed_eagerly"][-6:] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # (Keras' build reads it once before)


def test_a_user_hooks_feed_dict_fails_under_jit_at_its_first_feeding_step_and_feeds_without_jit(jax_configs):
    """A user hook returning SessionRunArgs(feed_dict=...) under jit fed nothing, silently: now the fit fails at the
    first step the hook feeds, naming the hook and the fix; with jit_compile=False each step reads its feed."""
    result = jax_configs[0]
    assert result["user_feed_under_jit"] == (
        "FeedsFromStep feeds each step through hookprof.step_feeds(), but Keras on jax compiles the train step "
        "(traced once, then replayed): it would read the first step's values on every step. Compile the model with "
        "run_eagerly=True (model.compile(..., run_eagerly=True)) or jit_compile=False to feed each step.")
    assert result["user_feed_under_jit_iterations"] == 1  # step 1 fed nothing and ran; step 2's feed failed
    assert result["user_fed_unjitted"][-5:] == [2.0, 3.0, 4.0, 5.0, 6.0]  # step 1: no feed, scale 1 (default)
