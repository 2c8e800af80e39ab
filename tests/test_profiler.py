"""The multi-step Profiler on real Lightning fits: views, every option, advice on planted problems, files."""

import os
import re
import struct
import subprocess
import sys
import time
import zlib

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from hookprof.profiler import ProfileFormatError, Profiler, views
from hookprof.profiler import ProfileOptionBuilder as B
from hookprof.profiler.profile_data import BYTES, COUNT, MICROS, OUTPUT
from hookprof.profiler.serialize import MAGIC
from hookprof.trace.reader import load_trace
from lightning_prof import ProfilerHook
from tests.lightning_models import TinyModel, loader, trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def quiet(options):
    return {**options, "output": "none"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("prof"))
    model = TinyModel()
    prof = Profiler(model)
    hook = ProfilerHook(save_steps=2, output_dir=out, profiler=prof, with_stack=True, show_memory=True,
                        tensorboard=False)
    trainer(out, [hook], 6).fit(model, loader())
    return prof, hook.saved_paths


def names(root):
    return [n.name for n in root.walk()]


def test_scope_view_counts_parameters_per_module_exactly(run):
    prof, _ = run
    root = prof.profile_name_scope(quiet(B.trainable_variables_parameter()))
    totals = {n.name: n.total_parameters for n in root.walk()}
    assert totals == {"_TFProfRoot": 161, "TinyModel": 161, "TinyModel/fc1": 144, "TinyModel/fc1/bias": 16,
                      "TinyModel/fc1/weight": 128, "TinyModel/fc2": 17, "TinyModel/fc2/bias": 1,
                      "TinyModel/fc2/weight": 16}
    # TF's rows: a scope that is no variable is not accounted (`--`), a variable shows its shape first
    assert "  TinyModel (--/161 params)\n" in root.text and "TinyModel/fc1/weight (16x8, 128/128 params)" in root.text


def _exclusive_op_micros(path):
    """Independently of the Profiler: each Op event's duration less the Op events nested in it."""
    events = [e for e in load_trace(path)["traceEvents"] if e["ph"] == "X" and e["cat"] == "Op"]
    by_thread = {}
    for e in events:
        by_thread.setdefault((e["pid"], e["tid"]), []).append(e)
    for items in by_thread.values():
        items.sort(key=lambda e: (e["ts"], -e["dur"]))
    own = {id(e): e["dur"] for e in events}
    for items in by_thread.values():
        stack = []
        for e in items:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                own[id(stack[-1])] -= e["dur"]
            stack.append(e)
    return sum(max(0.0, v) for v in own.values())


def test_op_view_total_is_the_sum_of_the_steps_op_times(run):
    prof, paths = run
    assert len(paths) == 3  # steps 2, 4, 6
    for path in paths:
        step = int(os.path.basename(path)[9:-5])
        result = prof.profile_operations(quiet({"step": step, "select": ["micros"], "order_by": "micros"}))
        ours = sum(r.self_["micros"] for r in result.rows)
        assert ours == pytest.approx(_exclusive_op_micros(path), rel=1e-3)
        assert re.search(r"\(100\.00%, [\d.]+%\)", result.text.splitlines()[1])  # first row: 100% accumulated


def test_step_minus_one_is_the_mean_over_the_steps_a_node_ran_in(run):
    prof, _ = run
    node = prof.data.nodes["TinyModel/fc1/aten::addmm"]
    assert sorted(node.steps) == [(0, 2), (0, 4), (0, 6)]  # (rank, step)
    per_step = [prof.profile_operations(
                    quiet({"step": s, "account_type_regexes": ["aten::addmm"]})).rows[0].self_["micros"]
                for s in (2, 4, 6)]
    mean = prof.profile_operations(quiet({"step": -1, "account_type_regexes": ["aten::addmm"]})).rows[0].self_["micros"]
    assert mean == pytest.approx(sum(per_step) / 3)
    ran = [r for r in prof.profile_operations(quiet({"step": 3})).rows if r.self_["occurrence"]]
    assert ran == []  # step 3 was not traced: nothing ran in it (parameters, step-independent, remain)


SCOPE_TIME = {"select": ["micros", "bytes", "params", "occurrence", "float_ops"], "order_by": "name"}


def shown(prof, **options):
    return [n for n in prof.profile_name_scope(quiet({**SCOPE_TIME, **options})).walk() if n.name != "_TFProfRoot"]


@pytest.mark.parametrize("option,value,attr", [
    ("min_micros", 40, "micros"), ("min_cpu_micros", 40, "cpu_micros"), ("min_bytes", 100, "bytes"),
    ("min_peak_bytes", 100, "peak_bytes"), ("min_output_bytes", 100, "output_bytes"),
    ("min_residual_bytes", 1, "residual_bytes"), ("min_params", 20, "params"), ("min_float_ops", 100, "float_ops"),
    ("min_occurrence", 2, "occurrence"), ("min_accelerator_micros", 1, "accelerator_micros"),
])
def test_each_min_option_keeps_exactly_the_nodes_whose_totals_reach_it(run, option, value, attr):
    prof, _ = run
    every = shown(prof)
    kept = shown(prof, **{option: value})
    assert all(n.total[attr] >= value for n in kept)
    reaching = {n.name for n in every if n.total[attr] >= value}
    assert {n.name for n in kept} == reaching
    assert len(kept) < len(every)  # the option did something


def test_max_depth(run):
    prof, _ = run
    assert {n.depth for n in shown(prof, max_depth=1)} == {1}
    assert max(n.depth for n in shown(prof, max_depth=2)) == 2


def test_order_by(run):
    prof, _ = run
    root = prof.profile_name_scope(quiet({**SCOPE_TIME, "order_by": "micros"}))
    for node in root.walk():
        micros = [c.total["micros"] for c in node.children]
        assert micros == sorted(micros, reverse=True)
    root = prof.profile_name_scope(quiet({**SCOPE_TIME, "order_by": "name"}))
    for node in root.walk():
        assert [c.name for c in node.children] == sorted(c.name for c in node.children)


def test_select_picks_the_columns(run):
    prof, _ = run
    text = prof.profile_name_scope(quiet({"select": ["occurrence", "bytes"]})).text
    assert text.splitlines()[0] == "node name | requested bytes | op count (run|defined)"  # TF's order and labels
    assert re.search(r"TinyModel/fc1/aten::addmm \(\d+B/\d+B, 1/1\|1/1\)", text)


def test_name_regex_options(run):
    prof, _ = run
    starts = prof.profile_name_scope(quiet({**SCOPE_TIME, "start_name_regexes": ["TinyModel/fc1"]}))
    assert [c.name for c in starts.children] == ["TinyModel/fc1"]
    trimmed = prof.profile_name_scope(quiet({**SCOPE_TIME, "trim_name_regexes": [".*fc2"]}))
    assert not any("fc2" in n for n in names(trimmed))
    show = shown(prof, show_name_regexes=[".*addmm.*"])
    assert show and all(re.fullmatch(".*addmm.*", n.name) for n in show)
    assert not any(re.fullmatch(".*addmm.*", n.name) for n in shown(prof, hide_name_regexes=[".*addmm.*"]))
    assert shown(prof, show_name_regexes=["addmm"]) == []  # full match: a bare substring does not match


def test_account_type_regexes_and_account_displayed_op_only(run):
    prof, _ = run
    rows = prof.profile_operations(quiet({"account_type_regexes": ["aten::(addmm|mm)"]})).rows
    assert sorted(r.name for r in rows) == ["aten::addmm", "aten::mm"]
    everything = prof.profile_name_scope(quiet({**SCOPE_TIME, "show_name_regexes": ["TinyModel/fc1.*"],
                                                "account_displayed_op_only": False}))
    displayed = prof.profile_name_scope(quiet({**SCOPE_TIME, "show_name_regexes": ["TinyModel/fc1.*"],
                                               "account_displayed_op_only": True}))
    # the root's total counts every op when not restricted, only fc1's ops when it is
    assert displayed.total_exec_micros < everything.total_exec_micros
    fc1 = sum(n.exec_micros for n in displayed.walk() if n.name.startswith("TinyModel/fc1"))
    assert displayed.total_exec_micros == pytest.approx(fc1)


def test_graph_view_children_are_the_producers_of_inputs(run):
    prof, _ = run
    root = prof.profile_graph(quiet({"select": ["micros"], "max_depth": 100}))
    relu = next(n for n in root.walk() if n.name == "TinyModel/aten::relu")
    assert "TinyModel/fc1/aten::addmm" in [c.name for c in relu.children]
    assert relu.depth + 1 == relu.children[0].depth  # depth = hops


def test_code_view_names_the_users_lines(run):
    prof, _ = run
    opts = B(B.time_and_memory(min_bytes=0)).with_node_names(show_name_regexes=[".*lightning_models.py.*"]).build()
    root = prof.profile_python(quiet(opts))
    lines = {n.name: n.total_exec_micros for n in root.walk() if n.name != "_TFProfRoot"}
    # TF's names: file:line:function
    assert any(re.fullmatch(r".*lightning_models\.py:\d+:forward", name) for name in lines)
    assert any(re.fullmatch(r".*lightning_models\.py:\d+:training_step", name) for name in lines)
    assert all(v > 0 for v in lines.values())


def test_outputs_file_timeline_none(run, tmp_path, capsys):
    prof, _ = run
    prof.profile_operations({"output": f"file:outfile={tmp_path / 'ops.txt'}"})
    # TF's file output: the Doc block (the view, then each selected column), then the profile
    doc, profile = open(tmp_path / "ops.txt").read().split("\n\nProfile:\n")
    assert doc.splitlines()[1:] == ["Doc:", views.VIEW_DOCS["operations"], *views.COLUMN_DOCS["micros"].splitlines()]
    assert profile.startswith("node name | total execution time")
    prof.profile_graph({**B.time_and_memory(), "step": 4, "output": f"timeline:outfile={tmp_path / 'g.json'}"})
    assert not os.path.exists(tmp_path / "g.json")  # TF's timeline output names the file after the step
    trace = load_trace(str(tmp_path / "g.json_4"))
    assert trace["metadata"]["step"] == 4 and any(e.get("name") == "aten::addmm" for e in trace["traceEvents"])
    prof.profile_operations({"output": "stdout"})
    assert capsys.readouterr().out.startswith("node name | total execution time")
    prof.profile_operations({"output": "none"})
    assert capsys.readouterr().out == ""


def test_pprof_output_of_the_code_view(run, tmp_path):
    import gzip

    from hookprof.profiler.pprof import _classes

    prof, _ = run
    path = tmp_path / "code.pb.gz"
    prof.profile_python({**B.time_and_memory(min_bytes=0), "output": f"pprof:outfile={path}"})
    profile = _classes()["Profile"].FromString(gzip.decompress(path.read_bytes()))
    strings = list(profile.string_table)
    assert strings[0] == "" and [strings[t.type] for t in profile.sample_type] == ["time", "requested_bytes"]
    functions = {f.id: strings[f.name] for f in profile.function}
    addmm = [s for s in profile.sample if functions[s.location_id[0]] == "aten::addmm"]
    assert addmm and all(s.value[0] >= 0 for s in addmm)
    callers = {functions[i] for s in addmm for i in s.location_id[1:]}
    assert {"forward", "training_step"} <= callers  # the user's frames are in the stacks
    with pytest.raises(ValueError, match="for the code view"):
        prof.profile_operations({"output": f"pprof:outfile={path}"})


@pytest.mark.parametrize("options,pattern", [
    ({"min_micro": 1}, r"unknown option\(s\) \['min_micro'\]"),
    ({"show_name_regexes": ["(unclosed"]}, r"'show_name_regexes' has an invalid regex '\(unclosed'"),
    ({"order_by": "speed"}, r"'order_by' must be one of"),
    ({"select": ["micros", "nope"]}, r"'select' has unknown attribute\(s\) \['nope'\]"),
    ({"max_depth": -1}, r"'max_depth' must be an int >= 0"),
    ({"step": -2}, r"'step' must be -1"),
    ({"output": "file:out.txt"}, r"must look like 'file:outfile=PATH'"),
    ({"hide_name_regexes": ".*"}, r"'hide_name_regexes' must be a list of regexes"),
])
def test_bad_options_name_the_option(run, options, pattern):
    prof, _ = run
    with pytest.raises(ValueError, match=pattern):
        prof.profile_name_scope(options)


def test_builder_presets_and_setters():
    built = (B(B.time_and_memory(min_micros=5)).with_max_depth(3).with_min_memory(min_bytes=7)
             .with_node_names(show_name_regexes=["a.*"], hide_name_regexes=["b"]).order_by("bytes")
             .select(["bytes"]).with_step(2).account_displayed_op_only(False).with_file_output("x.txt").build())
    assert built["min_micros"] == 5 and built["min_bytes"] == 7  # each setter sets its own fields only
    assert (built["max_depth"], built["order_by"], built["select"], built["step"]) == (3, "bytes", ["bytes"], 2)
    assert built["show_name_regexes"] == ["a.*"] and built["output"] == "file:outfile=x.txt"
    assert B.trainable_variables_parameter()["account_type_regexes"] == ["_trainable_variables"]
    assert B.float_operation()["order_by"] == "float_ops"


# --- TF parity: output bytes, TF's columns and labels, shapes ---------------------------------------------

TF_TREE_LEGEND = ("node name | # parameters | # float_ops | requested bytes | peak bytes | residual bytes"
                  " | output bytes | total execution time | accelerator execution time | cpu execution time"
                  " | assigned devices | op types | op count (run|defined) | input shapes")
TF_MULTI_LEGEND = ("node name | requested bytes | peak bytes | residual bytes | output bytes | total execution time"
                   " | accelerator execution time | cpu execution time | # parameters | # float_ops"
                   " | assigned devices | op types | op occurrence (run|defined) | input shapes")
EVERY_COLUMN = ["input_shapes", "occurrence", "op_types", "device", "cpu_micros", "accelerator_micros", "micros",
                "output_bytes", "residual_bytes", "peak_bytes", "bytes", "float_ops", "params"]


class KeepsAnUnreadTensor(TinyModel):
    """A scalar parameter (TF's `ScalarW`) and an op whose output no op of the step reads (kept for later)."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        h = torch.relu(self.fc1(x)) * self.scale
        self.kept = torch.exp(h)  # 8x16 float32 = 512 bytes made in the step, read by none of its ops
        return self.fc2(h)


def planted_fit(out, show_dataflow=True):
    model = KeepsAnUnreadTensor()
    prof = Profiler(model)
    hook = ProfilerHook(save_steps=2, output_dir=out, profiler=prof, show_dataflow=show_dataflow, show_memory=True,
                        tensorboard=False)
    trainer(out, [hook], 4).fit(model, loader())
    return prof, hook.saved_paths


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    return planted_fit(str(tmp_path_factory.mktemp("planted")))


EXP = "KeepsAnUnreadTensor/aten::exp"


def test_output_bytes_count_what_an_op_made_even_if_no_op_reads_it(planted):
    """TF summed every output of the node's executions in the step (ExecStep::AddMemoryStats), consumed or
    not (model_analyzer_test's testTrackPersistentBytes: the fetched `mul` has output bytes, the same each step)."""
    prof, paths = planted
    assert not any(EXP in n.inputs for n in prof.data.nodes.values())  # nothing in the step reads exp's output
    for step in (2, 4):
        root = prof.profile_name_scope(quiet({"step": step, "select": ["output_bytes"]}))
        exp = next(n for n in root.walk() if n.name == EXP)
        assert exp.output_bytes == exp.total_output_bytes == 8 * 16 * 4
        assert f"  {EXP} (512B/512B)\n" in root.text
        row = prof.profile_operations(quiet({"step": step, "account_type_regexes": ["aten::exp"],
                                             "select": ["output_bytes"]})).rows[0]
        assert row.self_["output_bytes"] == 512
    assert prof.data.nodes[EXP].figures(-1)[OUTPUT] == 512  # the mean over the steps it ran in
    # consumed outputs count as before: fc1's addmm makes the 8x16 activations
    assert prof.data.nodes["KeepsAnUnreadTensor/fc1/aten::addmm"].figures(2)[OUTPUT] == 512
    from hookprof.cli import load_profiler

    offline = load_profiler(paths)  # the same from the timelines alone
    assert [offline.data.nodes[EXP].figures(s)[OUTPUT] for s in (2, 4)] == [512, 512]


def test_output_bytes_without_dataflow_come_from_the_allocations(tmp_path):
    prof, _ = planted_fit(str(tmp_path), show_dataflow=False)
    outputs = {name: prof.data.nodes[name].figures(2)[OUTPUT] for name in (
        EXP, "KeepsAnUnreadTensor/fc1/aten::addmm", "KeepsAnUnreadTensor/fc1/aten::linear",
        "KeepsAnUnreadTensor/aten::relu", "KeepsAnUnreadTensor/fc2/aten::addmm")}
    # an op's own data, and what the op inside it made (linear returns its addmm's): 8x16 and 8x1 float32
    assert outputs == {EXP: 512, "KeepsAnUnreadTensor/fc1/aten::addmm": 512,
                       "KeepsAnUnreadTensor/fc1/aten::linear": 512, "KeepsAnUnreadTensor/aten::relu": 512,
                       "KeepsAnUnreadTensor/fc2/aten::addmm": 32}


@pytest.mark.parametrize("view", ["profile_name_scope", "profile_graph"])
def test_tree_views_take_tfs_column_order_and_labels_whatever_the_select_order(run, view):
    prof, _ = run
    text = getattr(prof, view)(quiet({"step": 2, "select": EVERY_COLUMN})).text
    assert text.splitlines()[0] == TF_TREE_LEGEND
    assert text == getattr(prof, view)(quiet({"step": 2, "select": EVERY_COLUMN[::-1]})).text


@pytest.mark.parametrize("view", ["profile_operations", "profile_python"])
def test_op_and_code_views_take_tfs_multi_column_order_and_labels(run, view):
    prof, _ = run
    text = getattr(prof, view)(quiet({"step": 2, "select": EVERY_COLUMN})).text
    assert text.splitlines()[0] == TF_MULTI_LEGEND
    assert text == getattr(prof, view)(quiet({"step": 2, "select": EVERY_COLUMN[::-1]})).text


def test_scope_view_rows_as_tfs_select_everything_detail(run):
    """model_analyzer_test.testSelectEverythingDetail: its legend, and a Conv2D row's ten comma-separated fields."""
    prof, _ = run
    opts = B(B.trainable_variables_parameter()).with_accounted_types([".*"]).with_step(2).select(
        ["micros", "bytes", "params", "float_ops", "occurrence", "device", "op_types", "input_shapes"]).build()
    text = prof.profile_name_scope(quiet(opts)).text
    assert text.splitlines()[0] == ("node name | # parameters | # float_ops | requested bytes | total execution time"
                                    " | accelerator execution time | cpu execution time | assigned devices | op types"
                                    " | op count (run|defined) | input shapes")
    row = next(line for line in text.splitlines() if line.strip().startswith("TinyModel/fc1/aten::addmm ("))
    metrics = row[row.find("(") + 1: row.rfind(")")].split(",")
    assert metrics[0].strip() == "0/0 params"  # an op has no shape of its own; only variables do
    assert re.fullmatch(r"(.*)k/(.*)k flops", metrics[1].strip())  # 2*8*8*16 = 2.05k
    assert re.fullmatch(r"\d+B/\d+B", metrics[2].strip())
    for i in (3, 5):  # total and cpu time (no accelerator on this machine)
        own, total = re.fullmatch(r"(.*)(?:us|ms|sec)/(.*)(?:us|ms|sec)", metrics[i].strip()).groups()
        assert float(own) > 0 and float(total) > 0
    assert "CPU" in metrics[6] and metrics[7].strip() == "aten::addmm"
    assert metrics[8].strip() == "1/1|1/1"
    assert metrics[9].strip() == "0:16|1:8x8|2:8x16"  # TF: '0:2x6x6x3|1:3x3x3x6'


def test_select_option_as_tfs_test(run):
    """model_analyzer_test.testSelectOption: `micros` brings all three times; `bytes` only requested bytes."""
    prof, _ = run
    text = prof.profile_name_scope(quiet({**B.time_and_memory(), "select": ["micros"]})).text
    assert "total execution time" in text and "accelerator execution time" in text and "bytes" not in text
    text = prof.profile_name_scope(quiet({**B.time_and_memory(), "select": ["bytes"]})).text
    assert "requested bytes" in text and not any(s in text for s in ("peak bytes", "residual bytes", "output bytes"))
    text = prof.profile_name_scope(quiet({**B.time_and_memory(), "select": ["peak_bytes", "residual_bytes",
                                                                             "output_bytes"]})).text
    assert all(s in text for s in ("peak bytes", "residual bytes", "output bytes")) and "requested" not in text
    only_cpu = prof.profile_name_scope(quiet({"select": ["cpu_micros"]})).text
    assert only_cpu.startswith("node name | cpu execution time\n")


def test_op_view_legend_and_input_shapes_as_tfs_op_view_test(run):
    """model_analyzer_test.testOpView pins the legend (blanks and tabs removed); under a row, its nodes grouped
    by input shapes, most runs first, as TF's FormatInputShapes wrote them."""
    prof, _ = run
    opts = (B(B.trainable_variables_parameter()).with_accounted_types([".*"]).with_step(2).order_by("occurrence")
            .select(["params", "micros", "bytes", "peak_bytes", "residual_bytes", "output_bytes", "occurrence",
                     "input_shapes"]).build())
    result = prof.profile_operations(quiet(opts))
    assert result.text.replace("\t", "").replace(" ", "")[0:170] == (
        "nodename|requestedbytes|peakbytes|residualbytes|outputbytes|totalexecutiontime|acceleratorexecutiontime"
        "|cpuexecutiontime|#parameters|opoccurrence(run|defined)|inputshapes")
    addmm = next(r for r in result.rows if r.name == "aten::addmm")
    assert [(shapes, runs, defined) for shapes, runs, defined, _ in addmm.input_types] == [
        ([(0, [1]), (1, [8, 16]), (2, [16, 1])], 1, 1), ([(0, [16]), (1, [8, 8]), (2, [8, 16])], 1, 1)]
    assert re.search(r"\naten::addmm {14}.*, +2\|2\n\n"
                     r"input_type: 0:1,\t1:8x16,\t2:16x1\t\(run\*1\|defined\*1\)\texec_time: \d+us\n"
                     r"input_type: 0:16,\t1:8x8,\t2:8x16\t\(run\*1\|defined\*1\)\texec_time: \d+us\n\n", result.text)
    as_dict = addmm.to_dict()["input_types"][1]
    assert as_dict["input_shapes"] == [[0, [16]], [1, [8, 8]], [2, [8, 16]]] and as_dict["run_count"] == 1


def test_op_view_rows_are_tfs_fixed_width_figures(run):
    prof, _ = run
    text = prof.profile_operations(quiet({"step": 2, "select": ["float_ops", "occurrence", "bytes"],
                                          "account_type_regexes": ["aten::mm"]})).text
    # the name in 25 columns, then each figure right-aligned in (at least) 30, the counts in 10; bytes come first
    bytes_, flops, counts = re.fullmatch(r"aten::mm {17}( *[\d.]+K?B \(100\.00%, 100\.00%\)), "
                                         r"( *[\d.]+k float_ops \(100\.00%, 100\.00%\)), (.*)",
                                         text.splitlines()[1]).groups()
    assert len(bytes_) == 30 and counts == "       3|3"
    assert len(flops) == max(30, len(flops.strip()))


def test_op_view_percentages_are_of_every_accounted_row_unless_displayed_only(run):
    """tfprof_op.cc: a row's accumulated figure adds the rows after it among all accounted rows; with
    account_displayed_op_only among the displayed ones only."""
    prof, _ = run
    every = prof.profile_operations(quiet({"step": 2, "order_by": "micros"})).rows
    whole = sum(r.self_["micros"] for r in every)
    # a row below the top one, whatever the timings order, so that its accumulated figure is under 100%
    mm = every[len(every) // 2]
    after = sum(r.self_["micros"] for r in every[every.index(mm):])
    opts = {"step": 2, "order_by": "micros", "show_name_regexes": [re.escape(mm.name)]}
    line = prof.profile_operations(quiet(opts)).text.splitlines()[1]
    accu, own = map(float, re.search(r"\(([\d.]+)%, ([\d.]+)%\)", line).groups())
    assert accu == pytest.approx(100 * after / whole, abs=0.01) and accu < 100
    assert own == pytest.approx(100 * mm.self_["micros"] / whole, abs=0.01)
    line = prof.profile_operations(quiet({**opts, "account_displayed_op_only": True})).text.splitlines()[1]
    assert "(100.00%, 100.00%)" in line


def test_parameter_view_shows_each_variables_shape_as_tf(run, planted):
    """model_analyzer_test.testDumpToFile: `DW (3x3x3x6, 162/162 params)`, `ScalarW (1, 1/1 params)`."""
    prof, _ = run
    assert prof.profile_name_scope(quiet(B.trainable_variables_parameter())).text == (
        "node name | # parameters\n"
        "_TFProfRoot (--/161 params)\n"
        "  TinyModel (--/161 params)\n"
        "    TinyModel/fc1 (--/144 params)\n"
        "      TinyModel/fc1/bias (16, 16/16 params)\n"
        "      TinyModel/fc1/weight (16x8, 128/128 params)\n"
        "    TinyModel/fc2 (--/17 params)\n"
        "      TinyModel/fc2/bias (1, 1/1 params)\n"
        "      TinyModel/fc2/weight (1x16, 16/16 params)\n")
    scalar = planted[0].profile_name_scope(quiet(B.trainable_variables_parameter()))
    assert "\n    KeepsAnUnreadTensor/scale (1, 1/1 params)\n" in scalar.text  # a 0-d parameter, as TF's ScalarW
    node = next(n for n in scalar.walk() if n.name == "KeepsAnUnreadTensor/scale")
    assert node.to_dict()["shape"] == [1] and node.input_shapes == [] and node.accounted


def test_tree_text_agrees_with_the_structured_nodes(run):
    prof, _ = run
    root = prof.profile_name_scope(quiet({"step": 2, "select": ["params", "occurrence", "input_shapes"]}))
    lines = root.text.splitlines()[1:]
    nodes = list(root.walk())
    assert len(lines) == len(nodes)
    for line, node in zip(lines, nodes):
        as_dict = node.to_dict()
        assert line == "  " * node.depth + line.strip() and line.strip().startswith(node.name + " (")
        fields = line[len("  " * node.depth) + len(node.name) + 2:-1].split(", ")
        if as_dict["shape"] is not None:
            assert fields.pop(0) == "x".join(map(str, as_dict["shape"]))
        own = "--" if not as_dict["accounted"] else None
        params, occurrence, shapes = fields
        assert params == f"{own or int(as_dict['self']['params'])}/{int(as_dict['total']['params'])} params"
        assert occurrence == (f"{own or int(as_dict['self']['occurrence'])}/{int(as_dict['total']['occurrence'])}"
                              f"|{own or 1}/{int(as_dict['total']['definitions'])}")
        assert shapes == "|".join(f"{i}:{'x'.join(map(str, s))}" for i, s in as_dict["input_shapes"])
    mse = next(n for n in nodes if n.name == "aten::mse_loss_backward")
    assert mse.input_shapes == [(0, [1]), (1, [8, 1]), (2, [8, 1])]  # a 0-d tensor's shape is TF's `1`
    assert "  aten::mse_loss_backward (0/0 params, 1/1|1/1, 0:1|1:8x1|2:8x1)\n" in root.text


def test_code_view_columns_as_tfs_code_view_tests(run):
    """testSimpleCodeView / testComplexCodeView: the code view's legend is the op view's (memory first)."""
    prof, _ = run
    opts = B(B.trainable_variables_parameter()).with_accounted_types([".*"]).account_displayed_op_only(False)
    text = prof.profile_python(quiet(opts.with_node_names(show_name_regexes=[".*lightning_models.*"]).select(
        ["bytes", "params", "float_ops", "device", "input_shapes"]).build())).text
    assert text[0:80] == "node name | requested bytes | # parameters | # float_ops | assigned devices | in"
    assert "input_shapes N/A in code view" in text.splitlines()[1]
    text = prof.profile_python(quiet(opts.select(["float_ops", "params"]).build())).text
    assert text.startswith("node name | # parameters | # float_ops\n")


# --- advice on planted problems -------------------------------------------------------------------------

class ItemInForward(TinyModel):
    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if h.mean().item() > 1e9:  # a host sync planted in forward
            h = h * 0
        return self.fc2(h)


class Float64Head(TinyModel):
    def __init__(self):
        super().__init__()
        self.head64 = torch.nn.Linear(1, 1).double()

    def forward(self, x):
        return self.head64(self.fc2(torch.relu(self.fc1(x))).double()).float()


class SleepyData(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(0.003)  # 8 items a batch: ~24 ms of loading per step
        return torch.randn(8), torch.randn(1)


def advice_for(model, tmp_dir, data=None):
    prof = Profiler(model)
    hook = ProfilerHook(save_steps=4, output_dir=tmp_dir, profiler=prof, with_stack=True, tensorboard=False)
    trainer(tmp_dir, [hook], 16).fit(model, data or loader())  # (steps 4, 8, 12, 16: each after untraced ones)
    return prof.advise()


def test_advisor_names_a_host_sync_in_forward_with_its_module_and_line(tmp_dir):
    advice = advice_for(ItemInForward(), tmp_dir)
    syncs = advice["HostSyncChecker"]["findings"]
    item = next(f for f in syncs if f["evidence"]["op"] in ("aten::item", "aten::_local_scalar_dense"))
    assert item["evidence"]["scope"] == "ItemInForward"
    assert re.search(r"test_profiler\.py\(\d+\): forward", item["evidence"]["code_line"])
    assert "ItemInForward at " in item["report"] and ".item()" in item["report"]


def test_advisor_finds_float64_compute_in_the_module(tmp_dir):
    advice = advice_for(Float64Head(), tmp_dir)
    reports = advice["OperationChecker"]["reports"]
    assert any(r.startswith("float64 compute in Float64Head/head64") for r in reports), reports


def test_advisor_finds_an_input_bound_loop(tmp_dir):
    advice = advice_for(TinyModel(), tmp_dir, DataLoader(SleepyData(), batch_size=8))
    finding = advice["InputPipelineChecker"]["findings"][0]
    assert finding["evidence"]["data_wait_share"] > 0.5  # most of the time goes to loading
    assert list(advice)[0] == "InputPipelineChecker"  # the most severe checker comes first


def test_advise_selects_checkers_and_names_unknown_ones(run):
    prof, _ = run
    assert list(prof.advise({"HostSyncChecker": {}})) == ["HostSyncChecker"]
    with pytest.raises(ValueError, match=r"unknown checker\(s\) \['GPUChecker'\]"):
        prof.advise({"GPUChecker": {}})


# --- serialized profiles ----------------------------------------------------------------------------------

def test_serialize_load_in_a_fresh_process_gives_identical_reports(run, tmp_path):
    prof, _ = run
    path = tmp_path / "run.prof"
    path.write_bytes(prof.serialize_to_string())
    expected_ops = prof.profile_operations(quiet({"order_by": "micros", "select": ["micros", "bytes"]})).text
    expected_scope = prof.profile_name_scope(quiet({"select": ["micros", "bytes"]})).text
    for view, expected in (("op", expected_ops), ("scope", expected_scope)):
        done = subprocess.run([sys.executable, "-m", "hookprof.cli", "profile", str(path), "--view", view,
                               "--order-by", "micros" if view == "op" else "name", "--select", "micros,bytes"],
                              capture_output=True, text=True, cwd=REPO, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout == expected
    loaded = Profiler.load(path.read_bytes())
    assert loaded.advise() == prof.advise()
    assert loaded.serialize_to_string() == prof.serialize_to_string()


def test_reports_from_timelines_match_the_live_profile(run):
    prof, paths = run
    from hookprof.cli import load_profiler

    offline = load_profiler(paths)  # no model: the parameter rows are the live profile's only extra
    opts = quiet({"order_by": "micros", "select": ["micros", "bytes", "occurrence"],
                  "hide_name_regexes": ["Parameter", "_trainable_variables"]})
    assert offline.profile_operations(opts).text == prof.profile_operations(opts).text


def test_malformed_and_hostile_files_are_refused(run):
    prof, _ = run
    good = prof.serialize_to_string()
    header = len(MAGIC) + 12
    cases = {
        "truncated": good[: len(good) // 2],
        "header only": good[:header - 3],
        "random bytes": os.urandom(4096),
        "foreign": b'{"traceEvents": []}',
        "wrong version": MAGIC + struct.pack("<IQ", 99, 10) + zlib.compress(b"{}"),
        "huge declared": MAGIC + struct.pack("<IQ", 1, 1 << 40) + zlib.compress(b"0" * 1000),
        "bomb": MAGIC + struct.pack("<IQ", 1, 100) + zlib.compress(b" " * (50 << 20)),
        "not json": MAGIC + struct.pack("<IQ", 1, 5) + zlib.compress(b"hello"),
        "wrong types": MAGIC + struct.pack("<IQ", 1, 70) + zlib.compress(
            b'{"format":"hookprof.profile","version":1,"nodes":[{"name":3}],"steps":[]}'.ljust(70)),
        "pickle": b"\x80\x04\x95" + os.urandom(100),
    }
    for label, blob in cases.items():
        with pytest.raises(ProfileFormatError) as info:
            Profiler.load(blob)
        assert "profile" in str(info.value), label
    with pytest.raises(ProfileFormatError, match="over the limit"):
        Profiler.load(good, max_bytes=10)


def test_bytes_in_use_at_each_steps_end_are_saved_and_older_files_load_without_them(run):
    import orjson

    prof, paths = run
    allocated = {step: summary.allocated for (_, step), summary in prof.data.steps.items()}
    # what the allocator reported last in each traced step (the hook wrote it to the timeline too)
    assert len(paths) == 3  # steps 2, 4, 6
    for path in paths:
        trace = load_trace(path)
        counters = [e for e in trace["traceEvents"] if e.get("ph") == "C" and e.get("cat") == "Memory"]
        last = [e for e in counters if e["ts"] == max(c["ts"] for c in counters)][-1]
        assert allocated[trace["metadata"]["step"]] == {"/host:CPU": float(last["args"]["allocated"])}
    assert Profiler.load(prof.serialize_to_string()).data.steps[(0, 4)].allocated == allocated[4]

    # an op runs on the host; the memory it allocated is where its tensors live (here the host too)
    made = [n for n in prof.data.nodes.values() if any(f[BYTES] for f in n.steps.values())]
    assert made and {n.memory_device for n in made} == {"/host:CPU"}

    def repacked(edit, part="steps"):
        blob = prof.serialize_to_string()
        doc = orjson.loads(zlib.decompress(blob[len(MAGIC) + 12:]))
        for entry in doc[part]:
            edit(entry)
        payload = orjson.dumps(doc)
        return MAGIC + struct.pack("<IQ", 1, len(payload)) + zlib.compress(payload)

    older = Profiler.load(repacked(lambda step: step.pop("allocated")))
    assert all(summary.allocated == {} for summary in older.data.steps.values())
    assert older.advise({"MemoryGrowthChecker": {}})["MemoryGrowthChecker"]["reports"] == []
    older = Profiler.load(repacked(lambda node: node.pop("memory_device"), "nodes"))
    assert {n.memory_device for n in older.data.nodes.values()} == {""}
    with pytest.raises(ProfileFormatError, match="'allocated' must map devices to numbers"):
        Profiler.load(repacked(lambda step: step.update(allocated={"/host:CPU": "lots"})))
    with pytest.raises(ProfileFormatError, match="'memory_device' must be a string"):
        Profiler.load(repacked(lambda node: node.update(memory_device=7), "nodes"))


def test_adding_the_same_step_twice_accumulates_and_op_log_adds_types():
    from hookprof.step_stats import NodeExecStats, StepStats

    def stats():
        s = StepStats()
        s.device("/host:CPU").node_stats.append(NodeExecStats("net/fc/aten::mm", "aten::mm", 0, 5_000, 1, "net/fc"))
        return s

    model = torch.nn.Linear(2, 2)
    prof = Profiler(model, op_log={"Linear/weight": ["_special"]})
    prof.add_step(1, stats())
    prof.add_step(1, stats())
    row = prof.profile_operations(quiet({"step": 1, "account_type_regexes": ["aten::mm"]})).rows[0]
    assert row.self_["micros"] == 10.0 and row.self_["occurrence"] == 2
    special = prof.profile_name_scope(quiet({"account_type_regexes": ["_special"], "select": ["params"]}))
    assert [n.name for n in special.walk()][-1] == "Linear/weight" and special.total_parameters == 4
    with pytest.raises(ValueError, match="op_log names 'nope'"):
        Profiler(model, op_log={"nope": ["x"]})
    with pytest.raises(ValueError, match=r"add_step\(step=-1\)"):
        prof.add_step(-1, stats())


def one_step(micros=5, train_micros=9):
    """A step of one op (`net/fc/aten::mm`) inside its train_step span."""
    from hookprof.step_stats import NodeExecStats, StepStats
    from hookprof.trace import format as fmt

    s = StepStats()
    nodes = s.device("/host:CPU").node_stats
    nodes.append(NodeExecStats(fmt.TRAIN_STEP, fmt.TRAIN_STEP, 0, train_micros * 1000, 1, category=fmt.CAT_SPAN))
    nodes.append(NodeExecStats("net/fc/aten::mm", "aten::mm", 1000, micros * 1000, 1, "net/fc"))
    return s


def test_a_merged_profile_is_a_copy_and_a_step_both_hold_adds_up_as_add_step_does():
    """merge and add_step agree (a tfprof step groups the run metadata given for it: the same (rank, step) adds
    up), and what a merge took in is its own: a step added to either profile afterwards changes only that one."""
    mine, theirs, together = Profiler(), Profiler(), Profiler()
    mine.add_step(1, one_step(5))
    theirs.add_step(1, one_step(7))
    theirs.add_step(2, one_step(3))
    for step, micros in ((1, 5), (1, 7), (2, 3)):
        together.add_step(step, one_step(micros))
    mine.merge(theirs)
    op = "net/fc/aten::mm"
    assert mine.data.nodes[op].steps == together.data.nodes[op].steps
    assert mine.data.steps == together.data.steps
    assert mine.data.nodes[op].steps[(0, 1)][COUNT] == 2 and mine.data.steps[(0, 1)].step_micros == 18
    theirs.add_step(2, one_step(3))
    mine.add_step(1, one_step(5))
    assert mine.data.nodes[op].steps[(0, 2)][COUNT] == 1 and mine.data.steps[(0, 2)].step_micros == 9
    assert theirs.data.nodes[op].steps[(0, 1)][COUNT] == 1 and theirs.data.steps[(0, 1)].step_micros == 9
    assert theirs.data.nodes[op].steps[(0, 2)][COUNT] == 2 and mine.data.steps[(0, 1)].step_micros == 27


def test_a_nodes_figures_at_a_step_see_the_ranks_and_steps_added_after_the_last_read():
    """`figures(step)` and `ran_at(step)` read an index of the node's steps: one added since (another rank's
    of the same step, a new step) is in the next read."""
    prof = Profiler()
    prof.add_step(1, one_step(4), rank=0)
    node = prof.data.nodes["net/fc/aten::mm"]
    assert node.figures(1)[MICROS] == 4 and node.ran_at(1) and not node.ran_at(2)
    prof.add_step(1, one_step(8), rank=1)
    prof.add_step(2, one_step(6), rank=1)
    assert node.figures(1)[MICROS] == 6  # the mean over the ranks
    assert node.ran_at(2) and node.figures(2)[MICROS] == 6 and node.figures(-1)[MICROS] == 6


def test_a_profile_saved_loaded_and_merged_reads_as_the_same_steps_added_to_one_profile():
    """Steps of two ranks added (read between the adds), saved, loaded and merged with later steps (one of them
    a step the loaded profile holds for the other rank only): each step's views, figures and diffs read as one
    profile given every step by add_step. A node's steps change only through `add` (serialize's loads too),
    which keeps their index by global step."""
    from hookprof.step_stats import NodeExecStats

    def step(micros, extra=False):
        stats = one_step(micros)
        if extra:  # an op the other steps lack (the diff's "only in" rows)
            stats.device("/host:CPU").node_stats.append(NodeExecStats("net/out/aten::add", "aten::add", 7000,
                                                                      2000, 1, "net/out"))
        return stats

    def profile(steps):
        prof = Profiler()
        for number, micros, rank in steps:
            prof.add_step(number, step(micros, extra=number == 3), rank=rank)
            assert prof.data.nodes["net/fc/aten::mm"].ran_at(number)  # (read between the adds)
        return prof

    early = [(1, 4, 0), (1, 8, 1), (2, 6, 1)]
    late = [(2, 10, 0), (3, 5, 0), (3, 7, 1), (1, 2, 1)]  # (rank 0's step 2, rank 1's step 1 again)
    whole, saved = profile(early + late), profile(early)
    loaded = Profiler.load(saved.serialize_to_string())
    loaded.merge(profile(late))
    for number in (-1, 1, 2, 3):
        for view in ("profile_operations", "profile_name_scope"):
            opts = quiet({"step": number, "select": ["micros", "occurrence"]})
            assert getattr(loaded, view)(opts).text == getattr(whole, view)(opts).text, (view, number)
        for name, node in whole.data.nodes.items():
            mine = loaded.data.nodes[name]
            assert (mine.figures(number), mine.ran_at(number)) == (node.figures(number), node.ran_at(number))
    for a, b in ((1, 2), (2, 3), (1, 3)):
        assert loaded.diff(a, b, quiet({})).text == whole.diff(a, b, quiet({})).text
    assert loaded.serialize_to_string() == whole.serialize_to_string()
    node = loaded.data.nodes["net/fc/aten::mm"]
    assert node.figures(2)[MICROS] == 8  # the mean of rank 0's 10 (merged in) and rank 1's 6 (loaded)
    with pytest.raises(TypeError):
        node.steps[(0, 4)] = [1.0] * 9  # (only `add` adds a step)


def test_a_profile_file_naming_a_nodes_step_twice_is_refused():
    """`N` and `N@0` are the same step of rank 0: a file giving both is malformed (loading took the last one)."""
    import orjson

    prof = Profiler()
    prof.add_step(1, one_step(4))
    blob = prof.serialize_to_string()
    doc = orjson.loads(zlib.decompress(blob[len(MAGIC) + 12:]))
    steps = doc["nodes"][0]["steps"]
    steps["1@0"] = steps["1"]
    payload = orjson.dumps(doc)
    with pytest.raises(ProfileFormatError, match="step '1@0' is given twice"):
        Profiler.load(MAGIC + struct.pack("<IQ", 1, len(payload)) + zlib.compress(payload))


class KeepsATensor(TinyModel):
    """Each step allocates a tensor it keeps past the step's end (an initialiser's randn kept as a weight) and
    one it frees within the step."""

    def training_step(self, batch, batch_idx):
        self.kept = torch.randn(1000)  # 4000 bytes alive at the step's end
        scratch = torch.randn(500)  # 2000 bytes, freed in the step
        return super().training_step(batch, batch_idx) + 0 * scratch.sum()


def test_a_tensor_alive_at_the_steps_end_is_residual_and_a_freed_one_is_not(tmp_dir):
    """TF's residual bytes: what a node allocated in the step and is still allocated at its end."""
    from hookprof.profiler.profile_data import PEAK, RESIDUAL

    prof = Profiler()
    hook = ProfilerHook(save_steps=2, output_dir=tmp_dir, profiler=prof, show_memory=True, tensorboard=False)
    trainer(tmp_dir, [hook], 4).fit(KeepsATensor(), loader())
    kept, scratch = prof.data.nodes["aten::randn"], prof.data.nodes["aten::randn_1"]
    for step in (2, 4):
        assert kept.steps[(0, step)][BYTES] == kept.steps[(0, step)][RESIDUAL] == 4000
        assert scratch.steps[(0, step)][PEAK] == 2000 and scratch.steps[(0, step)][RESIDUAL] == 0
    text = prof.profile_operations(B(B.time_and_memory()).with_node_names(show_name_regexes=[".*randn.*"]).build())
    assert text.rows and any(row.self_["residual_bytes"] == 4000 for row in text.rows)
