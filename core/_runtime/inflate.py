"""Inflating untrusted compressed bytes (a `.json.gz` timeline, a profile file) with bounds checked as it goes:
past a size limit, or inflating faster than a ratio once past the first 16 MiB, it is refused after a few MiB
of output, not after all of it (a decompression bomb)."""

from __future__ import annotations

import zlib
from collections.abc import Callable

CHUNK = 1 << 20
RATIO_FREE = 16 << 20  # output below this is never judged by its ratio (small files compress well)


class InflateRefused(ValueError):
    """Inflating stopped: `kind` "size" (more output than the limit) or "ratio" (a decompression bomb)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def inflate(read: Callable[[int], bytes | memoryview], *, gzip: bool, limit: int,
            max_ratio: float) -> tuple[bytes, bool]:
    """The bytes the compressed stream read by `read(n)` inflates to, and whether its end was reached (a gzip
    stream's members one after another; a zlib stream's one). Raises `InflateRefused` past `limit` bytes of
    output or `max_ratio` bytes out per byte in, `zlib.error` for corrupt data."""
    wbits = 16 + zlib.MAX_WBITS if gzip else zlib.MAX_WBITS
    inflater, out, total, read_in, pending = zlib.decompressobj(wbits), [], 0, 0, b""
    while True:
        if not pending:
            if inflater.eof:
                rest = inflater.unused_data.lstrip(b"\0") if gzip else b""
                if not rest:
                    return b"".join(out), True
                inflater, pending = zlib.decompressobj(wbits), rest
                continue
            pending = read(CHUNK)
            read_in += len(pending)
            if not pending:
                return b"".join(out), False
        chunk = inflater.decompress(pending, CHUNK)
        pending = inflater.unconsumed_tail
        total += len(chunk)
        out.append(chunk)
        if total > limit:
            raise InflateRefused("size", f"inflates to over {limit} bytes, the limit")
        consumed = read_in - len(pending)
        if total > RATIO_FREE and total > max_ratio * consumed:
            raise InflateRefused("ratio", f"a decompression bomb (inflates over {max_ratio:g}:1; {consumed} bytes "
                                          f"gave {total})")
