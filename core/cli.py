"""The `hookprof` command: work with the files the hooks wrote, from a shell."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys

from hookprof._runtime.distribution import MissingExtraError, installed_version
from hookprof.trace.merge import merge_timelines
from hookprof.trace.reader import TimelineError
from hookprof.trace.summary import summarize


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hookprof", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {installed_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    merge = commands.add_parser("merge", help="merge per-rank timelines into one trace (a process group per rank)")
    merge.add_argument("timelines", nargs="+", help="timeline-<step>-rank<r>.json[.gz] files, one per rank")
    merge.add_argument("-o", "--output", required=True, help="the merged trace (.json, or .json.gz to gzip)")

    summary = commands.add_parser("summary", help="one line per timeline: ops per phase and step time")
    summary.add_argument("timelines", nargs="+")

    profile = commands.add_parser("profile", help="tfprof's views of a saved profile or of timelines")
    profile.add_argument("inputs", nargs="+", help="a .prof file (Profiler.serialize_to_string) or timelines")
    profile.add_argument("--view", choices=sorted(VIEWS), default="scope")
    profile.add_argument("--max-depth", type=int, default=None)
    profile.add_argument("--step", type=int, default=None, help="one step; default: the mean over steps")
    _add_view_options(profile, "name, micros, bytes, params, occurrence, ...", "comma-separated columns, e.g. "
                      "micros,bytes", "stdout, file:outfile=PATH, timeline:outfile=PATH")

    diff = commands.add_parser("diff", help="what changed between two traced steps: op types, modules and code "
                               "lines ranked by the change, and the ops that ran in only one")
    diff.add_argument("inputs", nargs="+", help="two timelines (a step each), or a .prof file and --steps A B "
                      "(two .prof files: A of the first, B of the second)")
    diff.add_argument("--steps", nargs=2, type=int, default=None, metavar=("A", "B"), help="the steps to compare")
    _add_view_options(diff, "the figure ranked by: micros (default), bytes, cpu_micros, ..., or name",
                      "comma-separated figures (default micros,bytes)", "stdout, file:outfile=PATH")

    advise = commands.add_parser("advise", help="the advisor's ranked reports for a saved profile or timelines")
    advise.add_argument("inputs", nargs="+")
    advise.add_argument("--checker", action="append", default=None, help="run only these checkers (repeatable)")

    args = parser.parse_args(argv)
    # what the commands print comes from files (op names, paths): a terminal escape in one is shown, not obeyed
    with _printable(sys, "stdout"), _printable(sys, "stderr"):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        return _COMMANDS[args.command](args)
    except CommandError as err:
        _complain(args.command, err)
        return 2
    except MissingExtraError as err:  # an option whose package is not installed: the message names the extra
        _complain(args.command, CommandError(str(err)))
        return 2
    except BrokenPipeError:  # `hookprof profile ... | head`: the reader left, which is no error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _add_view_options(parser: argparse.ArgumentParser, order_by: str, select: str, output: str) -> None:
    """The view options `profile` and `diff` share (ProfileOptionBuilder's, as flags); see `_view_options`."""
    parser.add_argument("--order-by", default=None, help=order_by)
    parser.add_argument("--select", default=None, help=select)
    parser.add_argument("--min-micros", type=int, default=None)
    parser.add_argument("--min-bytes", type=int, default=None)
    parser.add_argument("--show", action="append", default=None, help="show only names matching (repeatable)")
    parser.add_argument("--hide", action="append", default=None, help="hide names matching (repeatable)")
    parser.add_argument("--account-types", action="append", default=None, help="account only these op types")
    parser.add_argument("--output", default=None, help=output)


def _view_options(args: argparse.Namespace) -> dict:
    """The option dict of the flags given (those left out take the view's defaults)."""
    return {key: value for key, value in (
        ("order_by", args.order_by), ("max_depth", getattr(args, "max_depth", None)),
        ("step", getattr(args, "step", None)), ("min_micros", args.min_micros), ("min_bytes", args.min_bytes),
        ("show_name_regexes", args.show), ("hide_name_regexes", args.hide),
        ("account_type_regexes", args.account_types), ("output", args.output),
        ("select", args.select.split(",") if args.select else None)) if value is not None}


_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 (but tab and newline), DEL, C1 (ESC included)


def printable(text: str) -> str:
    """`text` with terminal control characters (ESC, CSI, BEL, ...) replaced by `?`."""
    return _CONTROL.sub("?", text)


class _Printable:
    """A text stream that writes `printable(text)` to the stream it wraps (and is that stream otherwise)."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(printable(text))
        return len(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextlib.contextmanager
def _printable(module, name: str):
    stream = getattr(module, name)
    setattr(module, name, _Printable(stream))
    try:
        yield
    finally:
        setattr(module, name, stream)


class CommandError(Exception):
    """A bad input or argument: the one line (naming the file or argument and the problem) to print."""


def _complain(command: str, err: CommandError) -> None:
    with contextlib.suppress(OSError):
        sys.stdout.flush()  # the lines before it come first on a terminal
    print(f"hookprof {command}: {err}", file=sys.stderr)


def _merge(args: argparse.Namespace) -> int:
    try:
        result = merge_timelines(args.timelines, args.output)
    except OSError as err:  # reading problems are TimelineErrors (ValueErrors): an OSError is the write
        raise CommandError(f"cannot write {args.output}: {err.strerror or err}") from None
    except ValueError as err:
        raise CommandError(str(err)) from None
    print(f"{args.output}: {result.events} events from {len(args.timelines)} timelines")
    return 0


def _summary(args: argparse.Namespace) -> int:
    """One line per timeline; a bad one gets its line on stderr, the others are still summarized."""
    status = 0
    for path in args.timelines:
        try:
            line = _reading(path, summarize)
        except CommandError as err:
            _complain("summary", err)
            status = 2
        else:
            print(f"{path}: {line}")
    return status


def _profile_or_advise(args: argparse.Namespace) -> int:
    profiler = load_profiler(args.inputs)
    try:
        if args.command == "profile":
            steps = profiler.data.step_numbers()
            if args.step is not None and args.step >= 0 and args.step not in steps:
                raise CommandError(f"--step {args.step}: step {args.step} was not traced (traced steps: "
                                   f"{_traced(profiler)})")
            options = _view_options(args)
            if "select" not in options:
                untimed_scopes = args.view == "scope" and not steps
                options["select"] = ["params"] if untimed_scopes else ["micros", "bytes"]
            getattr(profiler, VIEWS[args.view])(options)
        else:
            profiler.advise({name: {} for name in args.checker} if args.checker else None)  # prints them
    except BrokenPipeError:
        raise
    except OSError as err:  # the inputs are read: an OSError is writing --output's file
        raise _write_error(args, err) from None
    except (ValueError, TypeError) as err:
        raise _option_error(err) from None
    return 0


def _write_error(args: argparse.Namespace, err: OSError) -> CommandError:
    from hookprof.profiler.options import parse_output

    target = parse_output(args.output)[1] if args.output else None
    return CommandError(f"cannot write {target or 'stdout'}: {err.strerror or err}")


def _diff(args: argparse.Namespace) -> int:
    """Step A of the first input against step B of the last: two timelines (their steps), or one saved profile
    and --steps A B."""
    if len(args.inputs) > 2:
        raise CommandError(f"give two timelines, or a saved profile and --steps A B (got {len(args.inputs)} files)")
    profilers = [load_profiler([path]) for path in args.inputs]
    ends = ((profilers[0], args.inputs[0]), (profilers[-1], args.inputs[-1]))
    if args.steps is not None:
        for (profiler, path), step in zip(ends, args.steps):
            if step not in profiler.data.step_numbers():
                raise CommandError(f"--steps {args.steps[0]} {args.steps[1]}: step {step} was not traced in {path} "
                                   f"(traced steps: {_traced(profiler)})")
        step_a, step_b = args.steps
    else:
        for profiler, path in ends:
            if len(profiler.data.step_numbers()) != 1 or len(args.inputs) == 1:
                raise CommandError(f"{path}: holds traced steps {_traced(profiler)}; name the two to compare with "
                                   "--steps A B")
        step_a, step_b = (profiler.data.step_numbers()[0] for profiler, _ in ends)
    try:
        profilers[0].diff(step_a, step_b, _view_options(args), other=profilers[-1])
    except BrokenPipeError:
        raise
    except OSError as err:
        raise _write_error(args, err) from None
    except (ValueError, TypeError) as err:
        raise _option_error(err) from None
    return 0


def _option_error(err: Exception) -> CommandError:
    """A view's option error as the command line spells it: `profile_diff: option 'order_by' ...` (the
    Python API's words) becomes `--order-by ...`."""
    return CommandError(re.sub(r"^\w+: option '(\w+)'", lambda m: "--" + m[1].replace("_", "-"), str(err)))


def _traced(profiler) -> str:
    return ", ".join(str(step) for step in profiler.data.step_numbers()) or "none"


_COMMANDS = {"merge": _merge, "summary": _summary, "profile": _profile_or_advise, "advise": _profile_or_advise,
             "diff": _diff}
VIEWS = {"scope": "profile_name_scope", "graph": "profile_graph", "op": "profile_operations", "code": "profile_python"}


def load_profiler(inputs: list[str]):
    """A Profiler from saved profiles and timelines (each timeline added as its step of its rank): one run's
    profile, or the ranks' of a distributed run, merged.

    Raises `CommandError` naming the input and its problem when one cannot be read.
    """
    from hookprof.profiler import Profiler
    from hookprof.trace.reader import read_timeline

    named: dict[str, str] = {}
    for path in inputs:  # (a step added twice adds up: the same file twice would double its figures)
        real = os.path.realpath(path)
        if real in named:
            raise CommandError(f"{path}: named twice (first as {named[real]}); name each profile or timeline once.")
        named[real] = path
    profiler = Profiler()
    for i, path in enumerate(inputs):
        if path.endswith((".json", ".json.gz")):
            def add(path: str, i: int = i) -> None:
                stats = read_timeline(path)
                profiler.add_step(int(stats.step) if stats.step is not None else i, stats)

            _reading(path, add)
        else:
            saved = _load_profile(path)
            if len(inputs) == 1:
                return saved
            profiler.merge(saved)
    return profiler


def _load_profile(path: str):
    from hookprof.profiler import Profiler
    from hookprof.trace.reader import InputTooLarge, os_problem, read_bounded

    try:
        with open(path, "rb") as f:
            blob = read_bounded(f, path)  # (a profile's declared size is checked again while inflating)
    except InputTooLarge as err:
        raise CommandError(f"{path}: refused: {err}") from None
    except OSError as err:
        raise CommandError(f"{path}: {os_problem(err)}") from None
    try:
        return Profiler.load(blob)
    except ValueError as err:  # serialize.ProfileFormatError
        raise CommandError(f"{path}: {str(err).rstrip('.')}") from None


def _reading(path: str, read):
    """`read(path)`, its failures as one CommandError naming `path`: load_trace's TimelineError for a file that
    is no timeline, and a malformed timeline's KeyError or TypeError from the code that walks its events."""
    try:
        return read(path)
    except TimelineError as err:
        raise CommandError(str(err)) from None
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, IndexError) as err:
        raise CommandError(f"{path}: malformed timeline ({type(err).__name__}: {err})") from None


if __name__ == "__main__":
    sys.exit(main())
