"""What pip installed: hookprof's version (`hookprof --version`), and its optional dependencies (the extras),
checked where the user asks for what needs them (a hook's constructor, the `hookprof` command's options), so a
missing one fails before training with the extra that installs it.

Each optional module is found with `importlib.util.find_spec`, which imports nothing (tensorboard's import costs
the constructor nothing until it is used).
"""

from __future__ import annotations

import importlib.util
from importlib import metadata

# module -> (the package pip installs, the hookprof extra that brings it)
_EXTRA = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "google.protobuf": ("protobuf", "pprof"),
}


class MissingExtraError(ModuleNotFoundError):
    """An optional dependency is not installed; the message names the extra to install."""


def installed(module: str) -> bool:
    """Whether `module` (a name of `_EXTRA`) can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a missing parent (`google` of `google.protobuf`), or an import hook that refuses it
        return False


def install_hint(module: str) -> str:
    """`pip install 'hookprof[<extra>]'` for what brings `module`."""
    return f"pip install 'hookprof[{_EXTRA[module][1]}]'"


def require(module: str, needed_by: str) -> None:
    """Raise `MissingExtraError` naming `needed_by`, the package and the extra to install, when `module` cannot
    be imported."""
    if not installed(module):
        package = _EXTRA[module][0]
        raise MissingExtraError(f"{needed_by} needs the {package} package, which is not installed: "
                                f"{install_hint(module)}", name=module)


def installed_version() -> str:
    """The version pip installed (its metadata, read when asked: scanning the path costs an import of hookprof,
    the render worker's included, tens of milliseconds); `0+unknown` for a source tree never installed."""
    try:
        return metadata.version("hookprof")
    except metadata.PackageNotFoundError:
        return "0+unknown"
