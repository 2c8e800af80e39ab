"""Put on PYTHONPATH by `tests.test_optional_deps.env_without`: the modules named in HOOKPROF_TEST_WITHOUT
(comma-separated), and their submodules, cannot be imported in this process, as if they were not installed."""

import importlib.abc
import os
import sys

_WITHOUT = tuple(m for m in os.environ.get("HOOKPROF_TEST_WITHOUT", "").split(",") if m)


class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == m or name.startswith(m + ".") for m in _WITHOUT):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NotInstalled())
