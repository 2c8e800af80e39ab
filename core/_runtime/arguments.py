"""Checks for the hooks' constructor arguments: each error names the argument and says what to pass."""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Mapping
from typing import Any


def check_int(owner: str, name: str, value: Any, minimum: int | None = None) -> int:
    """An int (Python's or numpy's, not a bool), at least `minimum` when one is given."""
    wanted = "an int" if minimum is None else f"an int >= {minimum}"
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"`{owner}({name}={value!r})`: `{name}` must be {wanted}.") from None
    if minimum is not None and number < minimum:
        raise ValueError(f"`{owner}({name}={value!r})`: `{name}` must be {wanted}.")
    return number


def check_positive_int(owner: str, name: str, value: Any) -> int:
    return check_int(owner, name, value, 1)


def check_seconds(owner: str, name: str, value: Any, zero: bool = False) -> float:
    """A finite number of seconds, > 0 (>= 0 with `zero`)."""
    bound = ">= 0" if zero else "> 0"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`{owner}({name}={value!r})`: `{name}` must be a number of seconds {bound}.")
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise ValueError(f"`{owner}({name}={value!r})`: `{name}` must be a number of seconds {bound}.")
    return value


def check_optional_cap(owner: str, name: str, value: Any) -> int | None:
    """None (no cap) or an int >= 1."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{owner}({name}={value!r})`: `{name}` must be an int >= 1, or None.")
    return value


def check_callable(owner: str, name: str, value: Any) -> Any:
    if not callable(value):
        raise TypeError(f"`{owner}({name}={value!r})`: `{name}` must be callable.")
    return value


def check_schedule(owner: str, save_steps: Any, save_secs: Any) -> None:
    """Exactly one of `save_steps` (int >= 1) and `save_secs` (number > 0) must be set."""
    if save_steps is None and save_secs is None:
        raise ValueError(
            f"`{owner}(save_steps=None, save_secs=None)`: exactly one of `save_steps` or `save_secs` must be "
            f"set, e.g. `{owner}(save_steps=100)` or `{owner}(save_secs=60)`."
        )
    if save_steps is not None and save_secs is not None:
        raise ValueError(
            f"`{owner}(save_steps={save_steps!r}, save_secs={save_secs!r})`: set only one of `save_steps` or "
            "`save_secs`, not both."
        )
    if save_steps is not None:
        check_positive_int(owner, "save_steps", save_steps)
    if save_secs is not None:
        check_seconds(owner, "save_secs", save_secs)


def check_bool(owner: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"`{owner}({name}={value!r})`: `{name}` must be True or False.")
    return value


def expand_dir(owner: str, name: str, value: Any) -> str:
    """Expand `~` and environment variables in a directory argument and check it could be written.

    The directory itself is created later (at `begin`), so constructing a hook has no side effect.
    """
    if isinstance(value, bytes) or not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"`{owner}({name}={value!r})`: `{name}` must be a path (str or os.PathLike).")
    path = os.path.abspath(os.path.expandvars(os.path.expanduser(os.fspath(value))))
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ValueError(
            f"`{owner}({name}={value!r})`: {probe!r} is a file, not a directory; pass a directory for `{name}`."
        )
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(
            f"`{owner}({name}={value!r})`: {probe!r} is not writable; pass a directory you can write to."
        )
    return path


def make_dir(owner: str, name: str, path: str) -> None:
    """Create the output directory now (before the first step) and prove a file can be written there."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".{owner.lower()}-write-test-{os.getpid()}")
        with open(probe, "wb"):
            pass
        os.unlink(probe)
    except OSError as err:
        raise ValueError(
            f"`{owner}({name}={path!r})`: cannot write there ({err.strerror or err}); "
            f"pass a directory you can write to."
        ) from err


def check_fetches(owner: str, name: str, value: Any) -> Any:
    """A fetch structure as `Session.run` takes it: names, callables, and dicts / lists / tuples of them."""

    def bad(item: Any) -> bool:
        if isinstance(item, str) or callable(item):
            return False
        if isinstance(item, Mapping):
            return any(bad(v) for v in item.values())
        if isinstance(item, (list, tuple)):
            return any(bad(v) for v in item)
        return True

    if bad(value):
        raise TypeError(f"`{owner}({name}={value!r})`: `{name}` must be a fetch: a name of a step output or logged "
                        "metric (\"loss\", \"global_step\"), a callable of the step (hookprof.StepState), or a "
                        "dict / list / tuple of those.")
    return value
