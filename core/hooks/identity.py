"""What identifies a hook: its class and its schedule, written as a short key that every process agrees on.

`hook_identity(ProfilerHook(save_steps=100))` is `"ProfilerHook(save_steps=100)"`. Two hooks of one class
that a user runs side by side differ by their schedule (`save_steps`, `save_secs`, `every_n_steps`, ...) or,
where even that is the same, by a `name` the user gives. A key holds nothing else: no private field, no
path, no function, no quote; so it is the same in the process that saves a checkpoint and in the one that
resumes from it, from any working directory and with any hookprof version, and any tool can print it (a
profiler names its spans with it). The framework adapters build their checkpoint keys with `identity`.
"""

from __future__ import annotations

import hashlib
import numbers
import re
from collections.abc import Iterable, Mapping
from typing import Any

# The public attributes that hold a hook's schedule, in the order a key lists them
SCHEDULE_ATTRIBUTES = ("save_steps", "save_secs", "every_n_steps", "every_n_iter", "every_n_secs", "num_steps",
                       "last_step", "wait_until_step")
MAX_KEY = 100  # a longer key keeps its first characters and ends with a digest of the whole
MAX_NAME = 40
_WORD = re.compile(r"[A-Za-z0-9_.\-]+")


def check_name(owner: str, name: Any) -> str | None:
    """`name` as a key part: None, or 1 to `MAX_NAME` letters, digits, `_`, `-` or `.`."""
    if name is None:
        return None
    if not isinstance(name, str) or len(name) > MAX_NAME or not _WORD.fullmatch(name):
        error = ValueError if isinstance(name, str) else TypeError
        raise error(f"{owner}(name={name!r}): `name` must be a string of 1 to {MAX_NAME} letters, digits, '_', '-' "
                    f"or '.' (it is part of the callback's checkpoint key); e.g. name=\"fast\"")
    return name


def schedule(hook: Any) -> dict[str, Any]:
    """The hook's schedule: those of `SCHEDULE_ATTRIBUTES` that it has and that are set, in that order."""
    values = ((attribute, getattr(hook, attribute, None)) for attribute in SCHEDULE_ATTRIBUTES)
    return {attribute: value for attribute, value in values if value is not None}


def hook_identity(hook: Any) -> str:
    """`ClassName(schedule)`, or the class name alone for a hook without one: `StopAtStepHook(last_step=5)`."""
    return identity(type(hook).__name__, schedule(hook))


def identity(kind: str, settings: Mapping[str, Any] | Iterable[tuple[str | None, Any]] = ()) -> str:
    """`kind(name=value, ...)` of the settings that are not None (`kind` alone if none are); a setting without a
    name is an identity already (`HookCallback(StopAtLoss, ProfilerHook(save_steps=100))`). Numbers are written
    as Python writes them (a whole float as an int: `save_secs=30`), a string as it is when it is a plain word,
    else as the word characters of it and a digest of the whole (`summary_op=train_loss#3f2a9c01` for
    "train/loss"). At most `MAX_KEY` characters."""
    items = settings.items() if isinstance(settings, Mapping) else settings
    parts = [value if name is None else f"{name}={_value(value)}" for name, value in items if value is not None]
    key = f"{kind}({', '.join(parts)})" if parts else kind
    return key if len(key) <= MAX_KEY else f"{key[:MAX_KEY - 11]}#{_digest(key, 10)}"


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):  # 30.0 and 30 seconds are one schedule: one key
        number = float(value)
        return str(int(number)) if number.is_integer() and abs(number) < 1e15 else repr(number)
    text = str(value)
    if _WORD.fullmatch(text) and len(text) <= MAX_NAME:
        return text
    return "_".join(_WORD.findall(text))[:MAX_NAME - 9] + "#" + _digest(text, 8)


def _digest(text: str, size: int) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:size]
