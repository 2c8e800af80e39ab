"""Whether a step's value has NaN or infinite elements, for any framework's values: `NanTensorHook` and the
`NonFinite` trigger both ask (`hookprof.hooks.nan_tensor_hook` re-exports these)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def backend_value(value: Any) -> Any:
    """A Keras variable as its backend tensor (anything else as it is): on torch, `numpy.asarray` of the variable
    (and Keras' `convert_to_numpy`) calls torch's `__array__`, which takes no `copy` argument and so raises numpy
    2's DeprecationWarning in the user's fit."""
    if type(value).__module__.partition(".")[0] == "keras" and hasattr(value, "value"):
        return value.value
    return value


def is_nan(value: Any) -> bool:
    """Whether a loss value is NaN (any element, for a non-scalar). Python numbers are read as they are;
    a torch tensor (Keras' torch backend included) is checked where it lives and one bool comes to the host;
    numpy, JAX and TensorFlow values are read through numpy."""
    return _any_element(value, finite=False, owner="NanTensorHook", argument="loss_tensor")


def is_non_finite(value: Any, owner: str, argument: str) -> bool:
    """Whether any element of a value is NaN or infinite, read as `is_nan` reads it; a value that is not a
    number raises a TypeError naming `owner(argument=...)`."""
    return _any_element(value, finite=True, owner=owner, argument=argument)


def _any_element(value: Any, finite: bool, owner: str, argument: str) -> bool:
    """Whether any element is NaN (`finite=False`), or NaN or infinite (`finite=True`)."""
    value = backend_value(value)
    if isinstance(value, (bool, int)):
        return False
    if isinstance(value, float):
        return not math.isfinite(value) if finite else math.isnan(value)
    if type(value).__module__.partition(".")[0] == "torch":
        import torch

        if isinstance(value, torch.Tensor):
            if not (value.is_floating_point() or value.is_complex()):
                return False
            if value.numel() == 1 and not value.is_complex():  # a loss: one number to the host is cheapest
                return _any_element(value.item(), finite, owner, argument)
            value = value.detach()
            return bool((~torch.isfinite(value)).any() if finite else torch.isnan(value).any())
    try:
        array = np.asarray(value)
        return bool((~np.isfinite(array)).any() if finite else np.isnan(array).any())
    except (TypeError, ValueError):
        raise TypeError(f"{owner}: the {argument} value is a {type(value).__name__} ({value!r:.80}), not a number "
                        f"or tensor; pass a `{argument}` fetch that gives a number.") from None
