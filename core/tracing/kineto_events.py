"""kineto's exported step (`_ProfilerResult.save`: Chrome-trace JSON) decoded into typed records holding only the
fields hookprof reads (`msgspec`: the rest of each event is skipped while parsing, not built into dicts and freed;
the records are never changed, and hold no cycles: the cyclic collector does not track them).

At 20k ops an export is about 10 MB in 28k events: parsing it into dicts cost 55 ms and freeing them 18 ms
of the render worker's CPU a traced step; decoding it here 23 ms and 10 ms, and reading a field is an
attribute access instead of a dict lookup. The args' values keep the types the JSON gives (`Any`): one that
kineto writes otherwise than expected is read as with plain dicts; an event's own fields (`ph`, `name`, `ts`,
`dur`, `args`) are typed, and an export whose events do not fit them fails its step's conversion (said in the
step's render error, as any conversion failure). Torch-free: the render worker decodes.

An event's argument lists are `msgspec.Raw`: views of the whole export's bytes, which they keep alive. Nothing
of a decoded event may outlive its step's conversion (`decoded` gives copies).
"""

from __future__ import annotations

from typing import Any

import msgspec


class KinetoArgs(msgspec.Struct, frozen=True, gc=False):
    """An event's `args`, the fields read from them (`hookprof.tracing.kineto_trace`, `step_identity`)."""

    # ops; their argument lists as the JSON's own bytes (`NONE` where missing): a step repeats a few, which the
    # conversion decodes once each, by those bytes (`decoded`), where building them for every op cost more
    external_id: Any = msgspec.field(name="External id", default=None)
    dims: msgspec.Raw = msgspec.field(name="Input Dims", default=msgspec.Raw())
    types: msgspec.Raw = msgspec.field(name="Input type", default=msgspec.Raw())
    concrete: msgspec.Raw = msgspec.field(name="Concrete Inputs", default=msgspec.Raw())
    sequence: Any = msgspec.field(name="Sequence number", default=-1)
    # CUDA runtime calls and kernels (the correlation of a launch and its kernel); kernels, memcpys, memsets
    correlation: Any = 0
    device: Any = 0
    stream: Any = None
    grid: Any = None
    block: Any = None
    registers: Any = msgspec.field(name="registers per thread", default=None)
    shared_memory: Any = msgspec.field(name="shared memory", default=None)
    occupancy: Any = msgspec.field(name="est. achieved occupancy %", default=None)
    bytes: Any = None
    # `[memory]` instants: an allocation (Bytes > 0) or free, and the allocator's totals after it
    nbytes: Any = msgspec.field(name="Bytes", default=0)
    address: Any = msgspec.field(name="Addr", default=0)
    device_type: Any = msgspec.field(name="Device Type", default=0)
    device_id: Any = msgspec.field(name="Device Id", default=0)
    total_allocated: Any = msgspec.field(name="Total Allocated", default=0)
    total_reserved: Any = msgspec.field(name="Total Reserved", default=0)


NO_ARGS = KinetoArgs()  # an event's args where it has none (shared: never changed)


class KinetoEvent(msgspec.Struct, frozen=True, gc=False):
    """One event of the export: `ph` "X" a span (op, user span, Python frame, runtime call, kernel), "i" an
    instant (`[memory]`), others skipped by what reads them."""

    ph: str = ""
    cat: Any = None
    name: str = ""
    tid: Any = 0
    ts: float = 0.0
    dur: float = 0.0
    args: KinetoArgs = NO_ARGS


class KinetoTrace(msgspec.Struct, frozen=True, gc=False):
    """The exported file: its events, their times' base (nanoseconds) and, with CUDA, each GPU's properties."""

    traceEvents: list[KinetoEvent] = []  # noqa: N815 (the export's own key)
    baseTimeNanoseconds: int = 0  # noqa: N815
    deviceProperties: Any = None  # noqa: N815


decode_trace = msgspec.json.Decoder(KinetoTrace).decode
_decode = msgspec.json.decode


def decoded(raw: msgspec.Raw, cache: dict[bytes, Any]) -> Any:
    """An argument list (`KinetoArgs.dims`, `.types`, `.concrete`) as Python values, one object per distinct
    list in `cache` (by its JSON); None where the event has none."""
    if not raw:
        return None
    key = bytes(raw)
    value = cache.get(key)
    if value is None:
        value = cache[key] = _decode(key)
    return value
