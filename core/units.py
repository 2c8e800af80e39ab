"""tfprof's units: times, bytes and counts as its reports print them (`1.50ms`, `12.29MB`, `3.20k`).

Shared by the Profiler's views and advice and by the triggers' messages; `hookprof.profiler.views` re-exports them.
"""

from __future__ import annotations


def _scaled(value: float, units: tuple[tuple[float, str], ...], plain: str) -> str:
    """tfprof's number formats: an integer below the first step, then two decimals in the largest unit.

    The value is first rounded to nine decimals, so that figures summed in another order (a timeline's events
    against the profile they came from) print alike: 12.499999999999998us and 12.5us are both `12us`."""
    value = round(value, 9)
    for size, unit in reversed(units):
        if value >= size:
            return f"{round(value / size, 9):.2f}{unit}"
    return f"{int(round(value))}{plain}"


def format_time(micros: float) -> str:
    return _scaled(micros, ((1000, "ms"), (1_000_000, "sec")), "us")


def format_memory(nbytes: float) -> str:
    return _scaled(nbytes, ((1000, "KB"), (1_000_000, "MB"), (1_000_000_000, "GB")), "B")


def format_number(n: float) -> str:
    return _scaled(n, ((1000, "k"), (1_000_000, "m"), (1_000_000_000, "b")), "")
