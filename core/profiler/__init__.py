"""The multi-step Profiler (tfprof): four views, options, advice, and a portable file format.

    from core.profiler import Profiler, ProfileOptionBuilder as B
"""

from core.profiler.advisor import ALL_ADVICE
from core.profiler.options import ProfileOptionBuilder
from core.profiler.profiler import Profiler
from core.profiler.serialize import ProfileFormatError


def load(data: bytes, max_bytes: int | None = None) -> Profiler:
    """A Profiler from `serialize_to_string()` bytes (never runs code from them)."""
    return Profiler.load(data, max_bytes)


__all__ = ["ALL_ADVICE", "ProfileFormatError", "ProfileOptionBuilder", "Profiler", "load"]
