"""The `hookprof` command: work with the files the hooks wrote, from a shell."""

from __future__ import annotations

import argparse
import sys

from core.trace_merge import merge_timelines
from core.trace_summary import summarize


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hookprof", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    merge = commands.add_parser("merge", help="merge per-rank timelines into one trace (a process group per rank)")
    merge.add_argument("timelines", nargs="+", help="timeline-<step>-rank<r>.json[.gz] files, one per rank")
    merge.add_argument("-o", "--output", required=True, help="the merged trace (.json, or .json.gz to gzip)")

    summary = commands.add_parser("summary", help="one line per timeline: ops per phase and step time")
    summary.add_argument("timelines", nargs="+")

    args = parser.parse_args(argv)
    if args.command == "merge":
        try:
            result = merge_timelines(args.timelines, args.output)
        except ValueError as err:
            parser.exit(2, f"hookprof merge: {err}\n")
        print(f"{args.output}: {result.events} events from {len(args.timelines)} timelines")
    elif args.command == "summary":
        for path in args.timelines:
            print(f"{path}: {summarize(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
