"""A package's public names, imported where first used (PEP 562), so that importing one of its modules (the
render worker's, say) does not import every other one. The names and where each comes from are the package's
own `if TYPE_CHECKING:` imports, read from its source: type checkers and readers see them there, and there is
no second list to keep in step."""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable
from typing import Any


def lazy_names(namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of the package whose globals are `namespace`: each name its
    `if TYPE_CHECKING:` block imports is imported when first read, and kept."""
    package = namespace["__name__"]
    with open(namespace["__file__"], encoding="utf-8") as source:
        tree = ast.parse(source.read())
    where: dict[str, tuple[str, str]] = {}  # public name -> (module, its name there)
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for statement in node.body:
                if isinstance(statement, ast.ImportFrom) and statement.module:
                    for alias in statement.names:
                        where[alias.asname or alias.name] = (statement.module, alias.name)

    def __getattr__(name: str) -> Any:
        found = where.get(name)
        if found is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, attribute = found
        if module == package:  # (`from package import submodule`)
            value = importlib.import_module(f"{package}.{attribute}")
        else:
            value = getattr(importlib.import_module(module), attribute)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__
