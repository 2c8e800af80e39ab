"""A package's public names, imported where first used (PEP 562), so that importing one of its modules (the
render worker's, say) does not import every other one. Each package lists its names twice: as imports under
`if TYPE_CHECKING:`, for type checkers and readers (which then see no module `__getattr__`, so a misspelled
name stays an error), and as the table given here, which `tests/test_layers.py` holds equal to them."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any


def lazy_names(namespace: dict[str, Any], modules: dict[str, tuple[str, ...]]
               ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of the package whose globals are `namespace`: each name of `modules` (a
    module -> the names it defines; the package itself -> its submodules named so) is imported when first read,
    and kept; any other submodule of the package is imported when read as an attribute too (as an eager
    package's imports would have made it one)."""
    package = namespace["__name__"]
    where = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None or module == package:  # (a submodule)
            if name.startswith("__") or importlib.util.find_spec(f"{package}.{name}") is None:
                raise AttributeError(f"module {package!r} has no attribute {name!r}")
            value = importlib.import_module(f"{package}.{name}")
        else:
            value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__
