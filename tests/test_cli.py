"""The installed `hookprof` command on good and bad inputs: on a bad one, one line on stderr and exit status 2.

Every test runs the real command in a subprocess, on timelines written by hookprof itself (a ProfilerHook
over a tiny torch model), and on broken copies of them.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import os
import re
import shutil
import subprocess
import sys
import zlib

import orjson
import pytest
import torch

from hookprof import HookedSession, ManualSession, ProfilerHook, SessionRunArgs, StepState
from hookprof.trace.reader import load_trace
from hookprof.trace.summary import summarize
from hookprof.tracing import StepTraceCoordinator
from hookprof.tracing.torch_tracer import TorchTracer

_SCRIPT = os.path.join(os.path.dirname(sys.executable), "hookprof")
COMMAND = [_SCRIPT] if os.access(_SCRIPT, os.X_OK) else [sys.executable, "-m", "hookprof.cli"]


def hookprof(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([*COMMAND, *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def assert_fails_with(done: subprocess.CompletedProcess, line: str | re.Pattern) -> None:
    """Exit status 2, no traceback, exactly one line on stderr: `line` (or a line matching it)."""
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    assert done.returncode == 2, (done.returncode, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and done.stderr.endswith("\n"), done.stderr
    if isinstance(line, re.Pattern):
        assert line.fullmatch(lines[0]), lines[0]
    else:
        assert lines[0] == line


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A folder holding timeline-2.json and timeline-3.json: steps 2 and 3 of a tiny model, traced by hookprof."""
    d = tmp_path_factory.mktemp("cli")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hook = ProfilerHook(save_steps=1, output_dir=str(d / "runs"), tensorboard=False)
    driver = HookedSession([hook], lambda: TorchTracer(model), StepTraceCoordinator())
    session = ManualSession()
    driver.begin()
    driver.after_create_session(session)
    for _ in range(3):
        driver.before_run(session, ("k", session.global_step), SessionRunArgs())
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        session.global_step += 1
        driver.after_run(lambda: StepState(session.global_step))
    driver.end(session)
    # step 1 only starts the count: steps 2 and 3 are traced
    assert sorted(os.path.basename(p) for p in hook.saved_paths) == ["timeline-2.json", "timeline-3.json"]
    return d


GOOD = ["runs/timeline-2.json", "runs/timeline-3.json"]


@pytest.fixture
def work(run_dir, tmp_path):
    """A fresh working folder with the good timelines under runs/ and every kind of bad input beside them."""
    shutil.copytree(run_dir / "runs", tmp_path / "runs")
    (tmp_path / "dir.json").mkdir()
    (tmp_path / "notjson.json").write_text("hello, not JSON\n")
    (tmp_path / "list.json").write_text("[]")
    whole = gzip.compress((tmp_path / GOOD[0]).read_bytes())
    (tmp_path / "whole.json.gz").write_bytes(whole)
    (tmp_path / "cut.json.gz").write_bytes(whole[: len(whole) // 2])
    return tmp_path


BAD_INPUTS = {
    "missing": ("missing.json", "no such file"),
    "directory": ("dir.json", "is a directory"),
    "non-JSON": ("notjson.json", re.compile(r"not JSON \(.+\)")),
    "JSON list": ("list.json", "not a timeline (a JSON list, expected an object with traceEvents)"),
    "truncated gzip": ("cut.json.gz", "truncated gzip file"),
}


@pytest.mark.parametrize("command", ["summary", "merge", "profile", "advise", "diff"])
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_a_bad_input_is_one_line_naming_the_file_and_the_problem(work, command, case):
    name, problem = BAD_INPUTS[case]
    args = ["-o", "merged.json", name] if command == "merge" else [name]
    done = hookprof(command, *args, cwd=work)
    prefix = f"hookprof {command}: {name}: "
    if isinstance(problem, re.Pattern):
        assert_fails_with(done, re.compile(re.escape(prefix) + problem.pattern))
    else:
        assert_fails_with(done, prefix + problem)
    assert done.stdout == ""
    assert not (work / "merged.json").exists()


@pytest.mark.parametrize("command", ["merge", "profile", "advise", "diff"])
def test_a_bad_input_among_good_ones_is_named(work, command):
    args = ["-o", "merged.json"] if command == "merge" else []
    done = hookprof(command, *args, GOOD[0], "cut.json.gz", cwd=work)
    assert_fails_with(done, f"hookprof {command}: cut.json.gz: truncated gzip file")
    assert not (work / "merged.json").exists()


@pytest.mark.parametrize("command", ["profile", "advise"])
def test_the_same_file_named_twice_is_refused_not_counted_twice(work, command):
    """A step added twice adds up (tfprof's step groups its run metadata): the same timeline or profile named
    twice, however spelled, would double its figures."""
    done = hookprof(command, GOOD[0], GOOD[1], f"./{GOOD[0]}", cwd=work)
    assert_fails_with(done, f"hookprof {command}: ./{GOOD[0]}: named twice (first as {GOOD[0]}); name each "
                      "profile or timeline once.")


def test_summary_reports_the_good_timelines_and_one_line_per_bad_one(work):
    done = hookprof("summary", GOOD[0], "missing.json", GOOD[1], cwd=work)
    assert_fails_with(done, "hookprof summary: missing.json: no such file")
    assert done.stdout.splitlines() == [f"{path}: {summarize(str(work / path))}" for path in GOOD]


def test_malformed_events_are_named_not_a_traceback(work):
    trace = load_trace(str(work / GOOD[0]))
    trace["traceEvents"].append(7)
    (work / "odd.json").write_bytes(orjson.dumps(trace))
    done = hookprof("summary", "odd.json", cwd=work)
    n = len(trace["traceEvents"]) - 1
    assert_fails_with(done, f"hookprof summary: odd.json: not a timeline (traceEvents[{n}] is a JSON number, "
                            "expected an object)")
    trace["traceEvents"][-1] = {"ph": "X", "cat": "Op", "name": "aten::mm", "pid": trace["traceEvents"][0]["pid"]}
    (work / "odd.json").write_bytes(orjson.dumps(trace))  # an op event without "ts"
    for command in ("profile", "advise"):
        assert_fails_with(hookprof(command, "odd.json", cwd=work),
                          re.compile(rf"hookprof {command}: odd\.json: malformed timeline \(KeyError: .+\)"))


# --- merge -o to a place that cannot be written ---------------------------------------------------------------


def assert_merge_cannot_write(work, output: str, err: int) -> None:
    done = hookprof("merge", "-o", output, GOOD[0], cwd=work)
    assert_fails_with(done, f"hookprof merge: cannot write {output}: {os.strerror(err)}")
    assert ".tmp" not in done.stderr  # the output is named, not the hidden temp file beside it
    assert done.stdout == ""


def test_merge_into_a_read_only_directory(work):
    ro = work / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        try:  # root (CAP_DAC_OVERRIDE) writes there anyway: the other two tests cover root
            (ro / "probe").write_text("")
        except PermissionError:
            pass
        else:
            pytest.skip("this user writes into a 0o555 directory (root)")
        assert_merge_cannot_write(work, "ro/merged.json", errno.EACCES)
        assert os.listdir(ro) == []  # and no temp file was left behind
    finally:
        ro.chmod(0o755)


def test_merge_into_a_path_whose_parent_is_a_file(work):
    (work / "afile").write_text("a regular file\n")
    assert_merge_cannot_write(work, "afile/merged.json", errno.ENOTDIR)  # ENOTDIR even for root


@contextlib.contextmanager
def read_only_tmpfs(path):
    mount = shutil.which("mount")
    if mount is None:
        pytest.skip("no mount command")
    path.mkdir()
    done = subprocess.run([mount, "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run([shutil.which("umount") or "umount", str(path)], capture_output=True, timeout=30)


def test_merge_into_a_read_only_file_system(work):
    with read_only_tmpfs(work / "rofs"):
        assert_merge_cannot_write(work, "rofs/merged.json", errno.EROFS)


# --- profile --step, and saved profiles ---------------------------------------------------------------------


def test_profile_of_a_step_that_was_not_traced_lists_the_traced_steps(work):
    done = hookprof("profile", "--step", "250", *GOOD, cwd=work)
    assert_fails_with(done, "hookprof profile: --step 250: step 250 was not traced (traced steps: 2, 3)")
    assert done.stdout == ""


@pytest.mark.parametrize("flag, value, message", [
    ("--order-by", "zzz", "hookprof profile: --order-by must be one of ["),
    ("--select", "micros,zz", "hookprof profile: --select has unknown attribute(s) ['zz']; choose from ["),
    ("--output", "tape:x", "hookprof profile: --output kind 'tape' is not one of ["),
])
def test_a_bad_view_option_is_named_as_its_flag(work, flag, value, message):
    done = hookprof("profile", flag, value, *GOOD, cwd=work)
    assert_fails_with(done, re.compile(re.escape(message) + r".*\.$"))
    assert "option '" not in done.stderr and "profile_name_scope" not in done.stderr


@pytest.fixture
def saved_profile(work):
    """runs/run.prof: the two timelines' profile, as Profiler.serialize_to_string() writes it."""
    from hookprof.profiler import Profiler
    from hookprof.trace.reader import read_timeline

    profiler = Profiler()
    for path in GOOD:
        stats = read_timeline(str(work / path))
        profiler.add_step(int(stats.step), stats)
    (work / "runs" / "run.prof").write_bytes(profiler.serialize_to_string())
    return "runs/run.prof"


def test_saved_profiles_missing_broken_and_an_untraced_step(work, saved_profile):
    assert_fails_with(hookprof("profile", "--step", "9", saved_profile, cwd=work),
                      "hookprof profile: --step 9: step 9 was not traced (traced steps: 2, 3)")
    assert_fails_with(hookprof("advise", "missing.prof", cwd=work), "hookprof advise: missing.prof: no such file")
    (work / "junk.prof").write_bytes(b"junk")
    assert_fails_with(hookprof("profile", "junk.prof", cwd=work), re.compile(
        r"hookprof profile: junk\.prof: not a hookprof profile \(.+\).*"))
    blob = (work / saved_profile).read_bytes()
    (work / "cut.prof").write_bytes(blob[: len(blob) // 2])
    assert_fails_with(hookprof("advise", "cut.prof", cwd=work), re.compile(
        r"hookprof advise: cut\.prof: the profile is truncated.*"))
    done = hookprof("profile", "--step", "3", saved_profile, cwd=work)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout == hookprof("profile", "--step", "3", *GOOD, cwd=work).stdout


def test_diff_of_a_saved_profile_names_a_missing_or_untraced_step(work, saved_profile):
    assert_fails_with(hookprof("diff", saved_profile, cwd=work), f"hookprof diff: {saved_profile}: holds traced "
                      "steps 2, 3; name the two to compare with --steps A B")
    assert_fails_with(hookprof("diff", saved_profile, "--steps", "2", "9", cwd=work),
                      f"hookprof diff: --steps 2 9: step 9 was not traced in {saved_profile} (traced steps: 2, 3)")
    assert_fails_with(hookprof("diff", *GOOD, GOOD[0], cwd=work),
                      "hookprof diff: give two timelines, or a saved profile and --steps A B (got 3 files)")
    assert_fails_with(hookprof("diff", *GOOD, "--order-by", "params", cwd=work), re.compile(
        r"hookprof diff: --order-by must be 'name' or a figure of a step \[.+\], got 'params'\."))
    done = hookprof("diff", saved_profile, "--steps", "2", "3", cwd=work)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout == hookprof("diff", *GOOD, cwd=work).stdout
    assert done.stdout.startswith("step 2 -> step 3, ranked by the change in total execution time\n")


def test_profile_output_to_an_unwritable_path_names_it(work):
    (work / "afile").write_text("")
    done = hookprof("profile", "--output", "file:outfile=afile/view.txt", *GOOD, cwd=work)
    assert_fails_with(done, f"hookprof profile: cannot write afile/view.txt: {os.strerror(errno.ENOTDIR)}")


# --- good inputs: today's output ------------------------------------------------------------------------------

SUMMARY_LINE = re.compile(r"(?P<path>\S+): (?P<ops>\d+) ops \((?P<phases>[^)]*)\), step \d+\.\d ms")


def test_summary(work):
    done = hookprof("summary", *GOOD, "whole.json.gz", cwd=work)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(": ")[0] for line in lines] == [*GOOD, "whole.json.gz"]
    for line in lines:
        match = SUMMARY_LINE.fullmatch(line)
        assert match, line
        phases = dict(part.split(" ") for part in match["phases"].split(", "))
        assert sorted(phases) == ["backward", "forward", "optimizer"]
        trace = load_trace(str(work / match["path"]))
        ops = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "Op"]
        assert int(match["ops"]) == sum(map(int, phases.values())) == len(ops) > 0
        assert line == f"{match['path']}: {summarize(str(work / match['path']))}"
    assert lines[0].split(": ", 1)[1] == lines[2].split(": ", 1)[1]  # the gzip copy reads the same


def test_merge(work):
    rank1 = load_trace(str(work / GOOD[1]))
    rank1["distributedInfo"]["rank"] = 1
    (work / "rank1.json").write_bytes(orjson.dumps(rank1))
    inputs = [GOOD[0], "rank1.json"]
    n = sum(len(load_trace(str(work / p))["traceEvents"]) for p in inputs)
    for output in ("merged.json", "merged.json.gz"):
        done = hookprof("merge", "-o", output, *inputs, cwd=work)
        assert done.returncode == 0 and done.stderr == "", done.stderr
        assert done.stdout == f"{output}: {n} events from 2 timelines\n"
        merged = load_trace(str(work / output))
        assert len(merged["traceEvents"]) == n
        assert merged["distributedInfo"]["ranks"] == [0, 1]
    assert not [name for name in os.listdir(work) if name.endswith(".tmp")]


def test_merge_refuses_two_timelines_of_one_rank(work):
    done = hookprof("merge", "-o", "merged.json", *GOOD, cwd=work)
    assert_fails_with(done, re.compile(r"hookprof merge: .*'runs/timeline-2\.json' and 'runs/timeline-3\.json' "
                                       r"are both rank 0.*"))
    assert not (work / "merged.json").exists()


def test_profile(work):
    done = hookprof("profile", *GOOD, cwd=work)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    lines = done.stdout.splitlines()
    # tfprof's columns, in TF's order whatever the order asked for (micros shows TF's three time columns)
    assert lines[0] == ("node name | requested bytes | total execution time | accelerator execution time | "
                        "cpu execution time")
    time = r"[\d.]+(?:us|ms|sec)"  # (tfprof's units: a step slowed by a loaded machine reads 1.05ms)
    assert re.fullmatch(rf"_TFProfRoot \(--/[\d.]+K?B, --/{time}, --/{time}, --/{time}\)", lines[1]), lines[1]
    times = f"{time}/{time}, {time}/{time}, {time}/{time}"
    assert any(re.fullmatch(rf"\s+Sequential/0/aten::addmm \(\d+B/\d+B, {times}\)", line) for line in lines)
    step = hookprof("profile", "--step", "2", "--view", "op", *GOOD, cwd=work)
    assert step.returncode == 0 and step.stderr == "" and "aten::addmm" in step.stdout


def test_pprof_output_is_for_the_code_view_only_as_tfs(work):
    """TF writes pprof for the code view only; other views are an error that says which view to use."""
    for view in ("op", "scope", "graph"):
        done = hookprof("profile", "--view", view, "--output", "pprof:outfile=out.pb.gz", *GOOD, cwd=work)
        assert_fails_with(done, re.compile(r"hookprof profile: .*is for the code view only.*--view code.*"))
    assert not (work / "out.pb.gz").exists()


def test_advise(work, monkeypatch):
    from hookprof.cli import load_profiler
    from hookprof.profiler.advisor import ALL_ADVICE, advise, report_text

    done = hookprof("advise", *GOOD, cwd=work)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    headers = [line[:-1] for line in done.stdout.splitlines() if re.fullmatch(r"\w+Checker:", line)]
    assert sorted(headers) == sorted(ALL_ADVICE)  # every checker, once
    # tfprof's layout, exactly what the Profiler's advice is for these files: printed once, not twice
    monkeypatch.chdir(work)
    assert done.stdout == report_text(advise(load_profiler(GOOD).data))


# --- hostile files (issue 29): bombs, huge files, malformed events, terminal escapes ------------------------

_RSS = ("import resource, sys\nfrom hookprof.cli import main\nrc = main(sys.argv[2:])\n"
        "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))\nsys.exit(rc)\n")
MARGIN_KIB = 96 << 10  # over a good input's peak (the process imports torch); the bombs below inflate to 1 GiB


@pytest.fixture(scope="module")
def peak_limit(run_dir):
    """The peak resident memory (KiB) a refused hostile input may cost: a good timeline's, plus MARGIN_KIB."""
    done, peak = hookprof_peak("summary", "runs/timeline-2.json", cwd=str(run_dir))
    assert done.returncode == 0 and peak > 0, done.stderr
    return peak + MARGIN_KIB


def hookprof_peak(*args: str, cwd) -> tuple[subprocess.CompletedProcess, int]:
    """The command run in a child that reports its peak resident memory (KiB) when it returns."""
    rss = os.path.join(cwd, "rss.txt")
    done = subprocess.run([sys.executable, "-c", _RSS, rss, *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)
    with open(rss) if os.path.exists(rss) else contextlib.nullcontext(None) as f:
        return done, int(f.read()) if f else -1


def _spaces(n: int, chunk: int = 1 << 20):
    for _ in range(n // chunk):
        yield b" " * chunk


def test_a_gzip_bomb_timeline_is_refused_while_inflating(work, peak_limit):
    with gzip.GzipFile(work / "bomb.json.gz", "wb", compresslevel=9) as f:
        for block in _spaces(1 << 30):  # 1 GiB of JSON whitespace in ~1 MiB
            f.write(block)
    for command in ("summary", "profile"):
        done, peak = hookprof_peak(command, "bomb.json.gz", cwd=work)
        assert_fails_with(done, re.compile(rf"hookprof {command}: bomb\.json\.gz: refused: a decompression bomb "
                                           r"\(inflates over 200:1; \d+ bytes gave \d+\)"))
        assert 0 < peak < peak_limit, (peak, peak_limit)


def test_a_profile_bomb_under_the_size_cap_is_refused_while_inflating(work, peak_limit):
    from hookprof.profiler import serialize

    size = 1 << 30  # declared honestly, under the 1 GiB cap: the ratio refuses it
    deflate = zlib.compressobj(9)
    with open(work / "bomb.prof", "wb") as f:
        f.write(serialize.MAGIC + serialize._HEADER.pack(serialize.VERSION, size))
        for block in _spaces(size):
            f.write(deflate.compress(block))
        f.write(deflate.flush())
    assert os.path.getsize(work / "bomb.prof") < 2 << 20
    done, peak = hookprof_peak("profile", "bomb.prof", cwd=work)
    assert_fails_with(done, "hookprof profile: bomb.prof: the profile's data inflates over 200:1 (a "
                            "decompression bomb; serialize.loads(max_ratio=) reads it anyway)")
    assert 0 < peak < peak_limit, (peak, peak_limit)


@pytest.mark.parametrize("name", ["huge.json", "huge.prof"])
def test_a_huge_input_is_refused_before_it_is_read(work, peak_limit, name):
    with open(work / name, "wb") as f:
        f.truncate(2 << 30)  # sparse: 2 GiB to read, none on disk
    done, peak = hookprof_peak("profile", name, cwd=work)
    assert_fails_with(done, f"hookprof profile: {name}: refused: {2 << 30} bytes, over the limit of {512 << 20}")
    assert 0 < peak < peak_limit, (peak, peak_limit)


MALFORMED = {
    "huge ts": (lambda e: e.update(ts=1e308), "'ts' is 1e+308, expected a finite number of microseconds"),
    "string dur": (lambda e: e.update(dur="12"), "'dur' is a JSON string, expected a finite number of microseconds"),
    "null name": (lambda e: e.update(name=None), "'name' is JSON null, expected a string"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
@pytest.mark.parametrize("command", ["summary", "profile"])
def test_malformed_event_fields_are_one_line_naming_the_event(work, command, case):
    change, problem = MALFORMED[case]
    trace = load_trace(str(work / GOOD[0]))
    i, event = next((i, e) for i, e in enumerate(trace["traceEvents"]) if e.get("ph") == "X" and e["cat"] == "Op")
    name = event["name"]
    change(event)
    (work / "odd.json").write_bytes(orjson.dumps(trace))
    shown = "" if case == "null name" else f" {name!r}"
    done = hookprof(command, "odd.json", cwd=work)
    assert_fails_with(done, re.compile(re.escape(f"hookprof {command}: odd.json: malformed timeline "
                                                 f"(traceEvents[{i}]{shown}: {problem}") + r".*\)"))


def test_a_null_thread_name_and_nan_are_one_line(work):
    trace = load_trace(str(work / GOOD[0]))
    i = next(i for i, e in enumerate(trace["traceEvents"]) if e.get("ph") == "M")
    trace["traceEvents"][i]["args"]["name"] = None
    (work / "odd.json").write_bytes(orjson.dumps(trace))
    assert_fails_with(hookprof("profile", "odd.json", cwd=work), re.compile(
        r"hookprof profile: odd\.json: malformed timeline \(traceEvents\[\d+\] '\w+': 'args\.name' is JSON null, "
        r"expected a string\)"))
    (work / "nan.json").write_text('{"traceEvents": [{"ph": "X", "ts": NaN, "name": "a"}]}')
    assert_fails_with(hookprof("summary", "nan.json", cwd=work),
                      re.compile(r"hookprof summary: nan\.json: not JSON \(.+\)"))


def test_terminal_escapes_in_op_names_are_not_printed(work):
    trace = load_trace(str(work / GOOD[0]))
    evil = "\x1b[31mevil\x1b]0;pwned\x07\x9b2J"
    for event in trace["traceEvents"]:
        if event.get("ph") == "X" and event.get("cat") == "Op":
            event["name"] = evil
            event.setdefault("args", {}).update(op=evil, name=evil)
    (work / "evil.json").write_bytes(orjson.dumps(trace))
    done = hookprof("profile", "--view", "op", "evil.json", cwd=work)
    assert done.returncode == 0, done.stderr
    assert "?[31mevil?]0;pwned??2J" in done.stdout
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f]", done.stdout + done.stderr)
