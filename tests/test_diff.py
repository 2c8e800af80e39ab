"""`Profiler.diff` and `hookprof diff` on a real Lightning fit whose forward calls an extra module on one step
only: that module ranks first, its ops are listed as present in one step only, and the command gives the
same ranking from the step's timelines as from the saved profile."""

import inspect
import re

import orjson
import pytest
import torch

from hookprof.profiler import ProfileOptionBuilder as B
from hookprof.profiler import Profiler
from hookprof.profiler.profile_data import BYTES, MICROS
from hookprof.profiler.views import format_memory, format_time
from lightning_prof import ProfilerHook
from tests.lightning_models import TinyModel, loader, trainer
from tests.test_cli import assert_fails_with, hookprof

EXTRA_AT = 3  # the global step (as forward sees it) whose forward calls `extra`
BATCH = 512


class Wide(torch.nn.Module):
    """16 features to 4096 and their mean, eight times over, all in its own scope: much to compute (tens of
    ms, well above a shared machine's hiccups inside the other modules), few parameters to update."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4096, 16) / 4)

    def forward(self, h):
        out = 0
        for i in range(8):  # (a loop in forward, so its ops' frames are forward's)
            out = out + torch.nn.functional.linear(h * (1 + i / 8), self.weight).mean(dim=1, keepdim=True)
        return out


class ExtraCall(TinyModel):
    """TinyModel whose forward also calls `extra`, on one step only."""

    def __init__(self):
        super().__init__()
        self.extra = Wide()

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.global_step == EXTRA_AT:
            h = h + self.extra(h)
        return self.fc2(h)


EXTRA_LINE = inspect.getsourcelines(Wide.forward)[1]  # torch's Python tracer names a frame by its function's line


def quiet(options=None):
    return {**(options or {}), "output": "none"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Every step of a 6-step fit traced into a Profiler (with stacks and memory, timelines written too);
    returns the Profiler, the folder, the step that ran `extra` and the steps before and after it."""
    out = tmp_path_factory.mktemp("diff")
    torch.manual_seed(0)
    model = ExtraCall()
    prof = Profiler(model)
    hook = ProfilerHook(save_steps=1, output_dir=str(out), profiler=prof, with_stack=True, show_memory=True,
                        tensorboard=False)
    trainer(str(out), [hook], 6).fit(model, loader(6 * BATCH, BATCH))
    (out / "run.prof").write_bytes(prof.serialize_to_string())
    ran = {s for n in prof.data.nodes.values() if n.scope == "ExtraCall/extra" for _, s in n.steps}  # (rank, step)
    [extra] = ran  # one traced step ran the extra module, and the steps around it were traced too
    assert {extra - 1, extra + 1} <= set(prof.data.step_numbers())
    return prof, out, extra


def test_the_module_called_in_one_step_only_ranks_first(run):
    prof, _, extra = run
    for order_by in ("micros", "bytes"):
        result = prof.diff(extra - 1, extra, quiet({"order_by": order_by}))
        top = result.modules[0]
        assert top.name == "ExtraCall/extra" and top.a is None and top.b[order_by] > 0, result.text
        # what that module did in the step: the sum of its ops' figures there
        ops = [n for n in prof.data.nodes.values() if n.scope == "ExtraCall/extra" and n.steps]
        assert top.b["micros"] == pytest.approx(sum(n.steps[(0, extra)][MICROS] for n in ops))
        assert top.b["bytes"] == sum(n.steps[(0, extra)][BYTES] for n in ops) >= BATCH * 4096 * 4  # its output at least
        # its code line is its forward's line (its backward ops count there too)
        assert re.fullmatch(rf"\S*test_diff\.py\({EXTRA_LINE}\): forward", result.code_lines[0].name), result.text
        assert abs(result.code_lines[0].change[order_by]) >= abs(top.change[order_by])
    # and back, by bytes: a step's time also moves with the machine (another step's file being written, a
    # scheduler hiccup inside fc1), its bytes do not
    back = prof.diff(extra, extra + 1, quiet({"order_by": "bytes"}))
    assert back.modules[0].name == "ExtraCall/extra" and back.modules[0].b is None
    assert back.modules[0].change["bytes"] == -back.modules[0].a["bytes"] < 0
    assert back.modules[0].change["micros"] == -back.modules[0].a["micros"] < 0


def test_ops_present_in_only_one_step_are_listed_with_both_figures(run):
    prof, _, extra = run
    result = prof.diff(extra - 1, extra, quiet())
    assert result.only_in_a == []  # every op of the step before ran again
    only = {row.name: row for row in result.only_in_b}
    extra_ops = {n.name: n for n in prof.data.nodes.values() if n.scope == "ExtraCall/extra" and n.steps}
    assert set(extra_ops) <= set(only)
    assert all(set(prof.data.nodes[name].steps) == {(0, extra)} for name in only)
    mm = only["ExtraCall/extra/aten::mm"]
    figures = extra_ops["ExtraCall/extra/aten::mm"].steps[(0, extra)]
    assert mm.a is None and mm.b["micros"] == figures[MICROS] > 0 and mm.b["bytes"] == figures[BYTES] > 0
    # in the text: both steps' figures, `--` for the step it did not run in, as `A -> B (change)`
    bytes_text, time_text = format_memory(figures[BYTES]), format_time(figures[MICROS])
    row = next(line for line in result.text.splitlines() if line.startswith("ExtraCall/extra/aten::mm "))
    assert re.fullmatch(rf"ExtraCall/extra/aten::mm +-- -> {bytes_text} \(\+{bytes_text}\), +-- -> "
                        rf"{time_text} \(\+{time_text}\)", row), row
    reverse = prof.diff(extra, extra - 1, quiet())
    assert [r.name for r in reverse.only_in_a] == [r.name for r in result.only_in_b] and reverse.only_in_b == []


def test_the_text_is_the_structured_result_in_tfprofs_layout(run, capsys):
    prof, _, extra = run
    result = prof.diff(extra - 1, extra)  # printed, as the views are
    assert capsys.readouterr().out == result.text
    lines = result.text.splitlines()
    assert lines[0] == f"step {extra - 1} -> step {extra}, ranked by the change in total execution time"
    assert lines[1] == "node name | requested bytes (A -> B) | total execution time (A -> B)"  # TF's column order
    titles = ["op types:", "modules:", "code lines:", f"ops only in step {extra - 1}:", f"ops only in step {extra}:"]
    sections = [result.op_types, result.modules, result.code_lines, result.only_in_a, result.only_in_b]
    at = [lines.index(title) for title in titles] + [len(lines)]
    for i, rows in enumerate(sections):
        shown = lines[at[i] + 1:at[i + 1]]
        assert len(shown) == len(rows) and all(line.startswith(r.name + "  ") for line, r in zip(shown, rows))
        # the op view's columns (the name in 25, figures in 30), widened for longer names: each table aligned
        name_width = max([25] + [len(r.name) + 2 for r in rows])
        assert len({len(line) for line in shown}) <= 1 and all(line[name_width - 2] == " " for line in shown)
    assert max(len(r.name) for r in result.code_lines) > 25  # the code lines' names overflow the 25 columns
    for rows in sections[:3]:  # ranked by the size of the change in time
        changes = [abs(r.change["micros"]) for r in rows]
        assert changes == sorted(changes, reverse=True) and len(rows) > 0
    assert orjson.loads(orjson.dumps(result.to_dict()))["modules"][0]["name"] == "ExtraCall/extra"


def test_options_pick_figures_order_and_rows(run, tmp_path):
    prof, _, extra = run
    by_name = prof.diff(extra - 1, extra, quiet({"order_by": "name", "select": ["occurrence"]}))
    assert [r.name for r in by_name.op_types] == sorted(r.name for r in by_name.op_types)
    assert by_name.text.splitlines()[1] == "node name | op occurrence (run|defined) (A -> B)"
    big = prof.diff(extra - 1, extra, quiet({"order_by": "bytes", "min_bytes": 100_000}))
    assert big.modules and all(abs(r.change["bytes"]) >= 100_000 for r in big.modules + big.only_in_b)
    preset = prof.diff(extra - 1, extra, quiet(B.time_and_memory()))  # min_micros=1, min_bytes=1: on the change
    assert preset.modules[0].name == "ExtraCall/extra" and all(
        abs(r.change["micros"]) >= 1 and abs(r.change["bytes"]) >= 1 for r in preset.modules + preset.op_types)
    hidden = prof.diff(extra - 1, extra, quiet({"hide_name_regexes": ["ExtraCall/extra.*"]}))
    assert not any(r.name.startswith("ExtraCall/extra") for r in hidden.modules + hidden.only_in_b)
    path = tmp_path / "diff.txt"
    written = prof.diff(extra - 1, extra, {"output": f"file:outfile={path}"})
    assert path.read_text() == written.text
    other = Profiler.load((run[1] / "run.prof").read_bytes())  # another Profiler's step: the same figures
    assert prof.diff(extra - 1, extra, quiet(), other=other).text == written.text


@pytest.mark.parametrize("args,message", [
    ((99, 2), r"diff\(step_a=99\): step 99 was not traced \(traced steps: {traced}\)\."),
    ((2, -1), r"diff\(step_b=-1\): a step is an int >= 0, one of the traced steps\."),
    ((2, 3, {"step": 2}), r"diff: option 'step' does not apply to a diff .*"),
    ((2, 3, {"trim_name_regexes": ["x"]}), r"diff: option 'trim_name_regexes' does not apply to a diff .*"),
    ((2, 3, {"order_by": "params"}), r"diff: option 'order_by' must be 'name' or a figure of a step .*"),
    ((2, 3, {"select": ["device"]}), r"diff: option 'select' must name a figure of a step .*"),
    ((2, 3, {"output": "timeline:outfile=x.json"}), r"diff: option 'output' .* a diff is text.*"),
    ((2, 3, {"min_micros": -1}), r"diff: option 'min_micros' must be an int >= 0, got -1\."),
])
def test_bad_steps_and_options_name_the_argument(run, args, message):
    prof = run[0]
    with pytest.raises(ValueError, match=message.format(traced=", ".join(map(str, prof.data.step_numbers())))):
        prof.diff(*args)


def test_ops_outside_modules_keep_their_own_code_line_and_backward_ops_take_their_modules(run):
    """A backward op's stack is the code that called backward(): in a module it takes the module's forward
    line; outside modules there is none to take, and a pick weighted by time would change with the load."""
    from hookprof.profiler.advisor import op_code_lines, user_code_line

    prof, _, _ = run
    lines = op_code_lines(prof.data)
    outside = [n for n in prof.data.nodes.values() if n.steps and not n.scope]
    assert any(n.phase == "backward" for n in outside) and any(n.phase != "backward" for n in outside)
    assert all(lines[n.name] == user_code_line(n.stack) for n in outside)
    extra_backward = [n for n in prof.data.nodes.values() if n.steps and n.scope == "ExtraCall/extra"
                      and n.phase == "backward"]
    assert extra_backward and all(re.fullmatch(rf"\S*test_diff\.py\({EXTRA_LINE}\): forward", lines[n.name])
                                  for n in extra_backward)


def test_hookprof_diff_of_two_timelines_and_of_the_saved_profile_rank_alike(run):
    prof, out, extra = run
    timelines = hookprof("diff", f"timeline-{extra - 1}.json", f"timeline-{extra}.json", cwd=out)
    saved = hookprof("diff", "run.prof", "--steps", str(extra - 1), str(extra), cwd=out)
    for done in (timelines, saved):
        assert done.returncode == 0 and done.stderr == "", done.stderr
    assert timelines.stdout == saved.stdout == prof.diff(extra - 1, extra, quiet()).text
    modules = saved.stdout.split("\nmodules:\n")[1].splitlines()
    assert modules[0].startswith("ExtraCall/extra ")
    by_bytes = hookprof("diff", "run.prof", "--steps", str(extra - 1), str(extra), "--order-by", "bytes",
                        "--select", "bytes", cwd=out)
    assert by_bytes.stdout == prof.diff(extra - 1, extra, quiet({"order_by": "bytes", "select": ["bytes"]})).text


def test_hookprof_diff_bad_input_is_one_line(run):
    prof, out, extra = run
    assert_fails_with(hookprof("diff", "missing.json", f"timeline-{extra}.json", cwd=out),
                      "hookprof diff: missing.json: no such file")
    assert_fails_with(hookprof("diff", "run.prof", "--steps", str(extra), "77", cwd=out),
                      f"hookprof diff: --steps {extra} 77: step 77 was not traced in run.prof (traced steps: "
                      f"{', '.join(map(str, prof.data.step_numbers()))})")


def test_figures_summed_in_another_order_print_alike():
    """A timeline's events and the profile they came from sum one row's times in different orders; the sums
    differ in the last bit, which must not move a printed figure across a rounding edge."""
    parts = [0.1] * 10 + [1.5]  # 2.5 summed one way (prints 2us), 2.500000000000001 the other
    forward, backward = sum(parts), sum(reversed(parts))
    assert forward != backward
    assert format_time(forward) == format_time(backward)
    assert format_time(forward * 1000) == format_time(backward * 1000)
    assert format_memory(forward * 1e6) == format_memory(backward * 1e6)
    # and at a unit's edge: 1000 us summed one way (1.00ms), 999.9999999999999 us the other
    edge = [0.3, 0.3, 999.4]
    assert sum(edge) != sum(reversed(edge)) and format_time(sum(edge)) == format_time(sum(reversed(edge)))
