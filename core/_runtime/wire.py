"""Protobuf's wire format, written by hand where a step's thousands of events make building one message
object per field too slow (the TensorBoard step graph, the Profile tab's XSpace): a field is its tag
(`number << 3 | wire type`) then a varint, or a length and bytes. Callers encode what many events share once.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

SMALL = [bytes((i,)) for i in range(128)]
CONTINUED = [bytes((i | 0x80,)) for i in range(128)]  # a varint's low 7 bits, more to come


def varint(value: int) -> bytes:
    """`value` as a base-128 varint; a negative int64 as protobuf writes it (ten bytes, two's complement).
    Unrolled to 6 bytes (42 bits: 4.4 s in picoseconds), which covers almost every offset and duration."""
    if value < 0x4000:
        if value >= 0x80:
            return bytes((value & 0x7F | 0x80, value >> 7))
        if value >= 0:
            return SMALL[value]
        value += 1 << 64
    if value < 0x200000:
        return bytes((value & 0x7F | 0x80, value >> 7 & 0x7F | 0x80, value >> 14))
    if value < 0x10000000:
        return bytes((value & 0x7F | 0x80, value >> 7 & 0x7F | 0x80, value >> 14 & 0x7F | 0x80, value >> 21))
    if value < 0x800000000:
        return bytes((value & 0x7F | 0x80, value >> 7 & 0x7F | 0x80, value >> 14 & 0x7F | 0x80,
                      value >> 21 & 0x7F | 0x80, value >> 28))
    if value < 0x40000000000:
        return bytes((value & 0x7F | 0x80, value >> 7 & 0x7F | 0x80, value >> 14 & 0x7F | 0x80,
                      value >> 21 & 0x7F | 0x80, value >> 28 & 0x7F | 0x80, value >> 35))
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


SIZES = [varint(size) for size in range(2048)]  # the lengths of most encoded events and nodes


def varints(values: Any) -> list[bytes]:
    """`varint` of each of `values`, encoded together (numpy): a step's tens of thousands of event offsets cost
    a tenth of one `varint` call each. Values outside int64 are encoded one at a time."""
    try:
        array = np.asarray(values, dtype=np.int64).view(np.uint64)  # (a negative one: its two's complement)
    except OverflowError:
        return [varint(value) for value in values]
    count = len(array)
    if not count:
        return []
    groups = np.empty((count, 10), dtype=np.uint8)  # each value's 7-bit groups, lowest first
    lengths = np.ones(count, dtype=np.int64)
    rest = array.copy()
    for i in range(10):
        groups[:, i] = rest & np.uint64(0x7F)
        rest >>= np.uint64(7)
        if i < 9:
            lengths += rest > 0
    groups[np.arange(10) < lengths[:, None] - 1] |= 0x80  # every group but a value's last: more to come
    raw = groups.tobytes()
    firsts = range(0, 10 * count, 10)
    return [raw[first:first + length] for first, length in zip(firsts, lengths.tolist())]

VARINT, FIXED64, LENGTH_DELIMITED = 0, 1, 2  # wire types


def tag(number: int, wire_type: int) -> bytes:
    """A field's tag."""
    return varint(number << 3 | wire_type)


def delimited(field_tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field (string, bytes, message) with its payload."""
    return field_tag + varint(len(payload)) + payload


def delimited_each(field_tag: bytes, payloads: list[bytes]) -> bytes:
    """`delimited(field_tag, payload)` of each of `payloads` (a repeated message field: a step's events or
    nodes), joined. Iterated by C (`map`, `zip`, `join`): no Python call per payload, where a step has tens of
    thousands."""
    sizes = list(map(len, payloads))
    size_fields = map(SIZES.__getitem__, sizes) if max(sizes, default=0) < len(SIZES) else varints(sizes)
    return b"".join(itertools.chain.from_iterable(zip(itertools.repeat(field_tag), size_fields, payloads)))


def joined(*columns: Iterable[bytes]) -> list[bytes]:
    """Row by row, the pieces of `columns` (one from each) joined into one bytes (a step's events from what
    their shape decides and their times); iterated by C, as `delimited_each`."""
    return list(map(b"".join, zip(*columns)))


def int_field(field_tag: bytes, value: int) -> bytes:
    """A varint field; proto3 leaves out zero (a field of a `oneof` is written by the caller even then)."""
    return field_tag + varint(value) if value else b""


def int_fields(field_tag: bytes, values: list[int] | np.ndarray) -> list[bytes]:
    """`int_field(field_tag, value)` of each of `values` (a step's start times), encoded together (`varints`)."""
    fields = list(map(field_tag.__add__, varints(values)))
    if 0 in values:  # (rare: proto3 leaves zero out, and bytes times False is empty)
        fields = list(map(operator.mul, fields, map(bool, values)))
    return fields


def each_encoded(values: np.ndarray, encode: Callable[[np.ndarray], list[bytes]]) -> Iterator[bytes]:
    """What `encode` makes (one field each) of each of `values`, made once per distinct value: a step's tens
    of thousands of durations repeat a few thousand."""
    distinct, each = np.unique(values, return_inverse=True)
    return map(encode(distinct).__getitem__, each.tolist())


def str_field(field_tag: bytes, text: str) -> bytes:
    """A string field; proto3 leaves out the empty string."""
    return delimited(field_tag, text.encode()) if text else b""
