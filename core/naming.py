"""How a model's modules and parameters are named in scopes, shared by the tracers and the Profiler."""

from __future__ import annotations

from typing import Any


def root_label(model: Any) -> str:
    """The top scope of a model: a keras Model's `name`, else the class name (`TinyModel`)."""
    name = getattr(model, "name", None)
    return name if isinstance(name, str) and name else type(model).__name__


def parameter_scopes(model: Any) -> list[tuple[str, tuple[int, ...], str, bool]]:
    """(scope name, shape, dtype, trainable) for every parameter of a torch module or keras model, named
    like the ops' scopes: `TinyModel/fc1/weight`, `tiny/fc1/kernel`."""
    found = []
    if hasattr(model, "named_parameters") and not hasattr(model, "weights"):  # torch nn.Module
        root = root_label(model)
        for path, param in model.named_parameters():
            dtype = str(param.dtype).removeprefix("torch.")
            found.append((f"{root}/{path.replace('.', '/')}", tuple(param.shape), dtype, bool(param.requires_grad)))
    elif hasattr(model, "weights"):  # keras
        for weight in model.weights:
            path = getattr(weight, "path", None) or getattr(weight, "name", "weight")
            dtype = str(getattr(weight, "dtype", "float32")).removeprefix("torch.")
            found.append((path, tuple(int(d) for d in weight.shape), dtype, bool(getattr(weight, "trainable", True))))
    return found
