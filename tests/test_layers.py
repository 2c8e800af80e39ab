"""hookprof's layers import downward only (issue 27, item 3).

Every module of `core/` (installed as `hookprof`) belongs to a part: a subpackage (`hooks`, `tracing`, ...) or a
top-level module (`step_stats`, `triggers`, ...). The parts stand in layers, the top one first; a part imports
only itself and the parts of the layers below its own:

    layer 5  adapter_exports, cli                              what the adapters re-export; the `hookprof` command line
    layer 4  hooks                                             the driver (HookedSession) and the TF hook family
    layer 3  profiler, summary, triggers                       what hooks are handed: tfprof, summaries, triggers
    layer 2  tensorboard, tracing                              event files and step graphs; the tracers
    layer 1  trace                                             the timeline files: format, writer, reader, merge
    layer 0  _runtime, naming, run_options, step_stats, units  value types and helpers every layer shares

(The test reads the layers from these lines: a new part gets a place here before anything may import it.)

Every import statement counts, wherever it stands: at module level, inside functions, and under
`if TYPE_CHECKING:` (nothing is excluded), plus `importlib.import_module` / `__import__` of a literal hookprof
name. Relative imports are resolved. `hookprof/__init__.py` is the package facade: it may import anything, and
nothing inside the package imports the facade itself (`import hookprof`, or `from hookprof import X` for an X
defined elsewhere); `from hookprof import summary` names the module `hookprof.summary`, which is fine. Core never
imports the adapters (`lightning_prof`, `keras_prof`) nor their frameworks (lightning, keras).

When this fails, move a small shared definition down, pass the dependency in as an argument, or split the
module whose halves belong to two layers; an import inside a function does not hide an upward edge.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections import defaultdict
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "core"
PACKAGE = "hookprof"
FORBIDDEN = ("lightning_prof", "keras_prof", "lightning", "pytorch_lightning", "keras")


@dataclasses.dataclass(frozen=True)
class Import:
    file: str  # core/hooks/profiler_hook.py
    line: int
    source: str  # the importing module, hookprof.hooks.profiler_hook
    target: str  # the imported module (or hookprof.<name> for `from hookprof import name`)
    text: str  # the statement

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.text}"


def module_name(path: Path) -> str:
    names = path.relative_to(CORE).with_suffix("").parts
    if names[-1] == "__init__":
        names = names[:-1]
    return ".".join((PACKAGE, *names))


def part_of(module: str) -> str | None:
    """`hooks` for hookprof.hooks.profiler_hook, `step_stats` for hookprof.step_stats; None for the facade."""
    names = module.split(".")
    return names[1] if len(names) > 1 else None


def core_files() -> list[Path]:
    return sorted(p for p in CORE.rglob("*.py") if "__pycache__" not in p.parts)


def core_modules() -> set[str]:
    return {module_name(p) for p in core_files()}


def imports_of(path: Path) -> list[Import]:
    """Every import in a file of core/."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    return imports_in(path.read_text(encoding="utf-8"), str(path.relative_to(CORE.parent)), module, package)


def imports_in(source: str, file: str, module: str, package: str) -> list[Import]:
    """Every import in `source` (the module `module` of `package`), wherever it stands, relative ones resolved."""
    found = []

    def add(node: ast.AST, target: str) -> None:
        found.append(Import(file, node.lineno, module, target, " ".join(ast.unparse(node).split())))

    for node in ast.walk(ast.parse(source, file)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(node, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                assert node.level - 1 < len(base), f"{file}:{node.lineno}: a relative import above {PACKAGE}"
                target = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module
            if target == PACKAGE or not node.module:  # `from hookprof import x`, `from . import x`: the module
                for alias in node.names:  # x of that package, or a name its __init__ defines
                    add(node, f"{target}.{alias.name}")
            else:
                add(node, target)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__"):
                add(node, node.args[0].value)
    return found


def all_imports() -> list[Import]:
    return [i for path in core_files() for i in imports_of(path)]


def core_parts() -> set[str]:
    return {part_of(m) for m in core_modules()} - {None}


def part_edges(imports: list[Import]) -> dict[tuple[str, str], list[Import]]:
    """(importing part, imported part) -> the import statements, for imports between two different parts;
    the facade's own imports, and imports of names from the facade (see the facade test), are left out."""
    parts = core_parts()
    edges: dict[tuple[str, str], list[Import]] = defaultdict(list)
    for i in imports:
        if i.target.split(".")[0] != PACKAGE:
            continue
        source, target = part_of(i.source), part_of(i.target)
        if source is not None and target in parts and source != target:
            edges[source, target].append(i)
    return edges


def find_cycles(edges: dict[tuple[str, str], list]) -> list[list[str]]:
    """The elementary cycles of the graph, each as [a, b, ..., a] starting at its smallest node."""
    successors: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        successors[a].add(b)
    cycles = []

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(successors[node]):
            if nxt == start:
                cycles.append([*path, start])
            elif nxt > start and nxt not in path:
                walk(start, nxt, [*path, nxt])

    for start in sorted(successors):
        walk(start, start, [start])
    return cycles


def declared_layers() -> list[list[str]]:
    """The layers of the module docstring, bottom first."""
    layers = {}
    for line in __doc__.splitlines():
        match = re.match(r"\s+layer (\d+)  (\S.*?)(?:\s{2,}|$)", line)
        if match:
            layers[int(match[1])] = [name.strip() for name in match[2].split(",")]
    assert sorted(layers) == list(range(len(layers))), f"the docstring's layers are not numbered 0..n: {layers}"
    return [layers[n] for n in range(len(layers))]


def _report(edges: dict[tuple[str, str], list[Import]], pairs: list[tuple[str, str]]) -> str:
    return "\n".join(f"    {a} -> {b}:\n" + "\n".join(f"        {i}" for i in edges[a, b]) for a, b in pairs)


def test_core_never_imports_the_adapters_or_their_frameworks():
    bad = [i for i in all_imports() if i.target.split(".")[0] in FORBIDDEN]
    assert not bad, "core imports an adapter or its framework:\n" + "\n".join(f"    {i}" for i in bad)


def test_nothing_inside_imports_the_facade():
    modules = core_modules()
    bad = [i for i in all_imports() if part_of(i.source) is not None and len(i.target.split(".")) <= 2
           and i.target.split(".")[0] == PACKAGE and i.target not in modules]
    assert not bad, ("these import the facade `hookprof`; import the name from the module that defines it:\n"
                     + "\n".join(f"    {i}" for i in bad))


def test_the_parts_import_each_other_without_cycles():
    edges = part_edges(all_imports())
    cycles = find_cycles(edges)
    assert not cycles, "\n".join(
        f"import cycle {' -> '.join(cycle)}:\n" + _report(edges, list(zip(cycle, cycle[1:]))) for cycle in cycles)


def test_layers_import_downward_only():
    layers = declared_layers()
    layer_of = {part: n for n, names in enumerate(layers) for part in names}
    parts = core_parts()
    assert sum(map(len, layers)) == len(layer_of), f"a part is in two layers: {layers}"
    assert not parts - set(layer_of), f"give these parts a layer in the docstring: {sorted(parts - set(layer_of))}"
    assert not set(layer_of) - parts, f"these layers' parts are not in core/: {sorted(set(layer_of) - parts)}"
    edges = part_edges(all_imports())
    upward = sorted((a, b) for a, b in edges if layer_of[b] >= layer_of[a])
    assert not upward, "imports that do not go down a layer (see tests/test_layers.py's docstring):\n" + _report(
        edges, upward)


def test_the_checker_sees_imports_inside_functions_and_names_cycles():
    source = ("from __future__ import annotations\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
              "    from ..hooks import RunOptions\n\ndef f():\n    from . import coordinator\n"
              "    import importlib\n    importlib.import_module('hookprof.trace.format')\n")
    found = sorted((i.line, i.target) for i in imports_in(source, "t.py", "hookprof.tracing.tracer",
                                                          "hookprof.tracing"))
    assert found == [(1, "__future__"), (2, "typing"), (4, "hookprof.hooks"), (7, "hookprof.tracing.coordinator"),
                     (8, "importlib"), (9, "hookprof.trace.format")]
    assert find_cycles({("a", "b"): [], ("b", "c"): [], ("c", "a"): [], ("b", "a"): [], ("c", "d"): []}) == [
        ["a", "b", "a"], ["a", "b", "c", "a"]]


def test_names_moved_down_still_import_from_their_old_homes():
    from hookprof import RunMetadata, RunOptions, TraceLevel, run_options, step_stats, units
    from hookprof._runtime import arguments, values
    from hookprof.hooks import nan_tensor_hook, session, session_run_hook
    from hookprof.profiler import views
    from hookprof.tracing import dataflow

    assert (RunOptions, RunMetadata, TraceLevel) == (run_options.RunOptions, run_options.RunMetadata,
                                                     run_options.TraceLevel)
    assert (session_run_hook.RunOptions, session_run_hook.RunMetadata, session_run_hook.TraceLevel) == (
        RunOptions, RunMetadata, TraceLevel)
    assert dataflow.DataEdge is step_stats.DataEdge
    assert (nan_tensor_hook.is_nan, nan_tensor_hook.is_non_finite) == (values.is_nan, values.is_non_finite)
    assert session.check_fetches is arguments.check_fetches
    assert (views.format_memory, views.format_time, views.format_number) == (
        units.format_memory, units.format_time, units.format_number)


def test_the_packages_public_names_import_where_first_used():
    """`hookprof` and `hookprof.hooks` import a public name's module when it is first read: importing one module
    (the render worker's) imports no other hook; every name in `__all__` resolves to the object its module
    defines; the table each package gives `lazy_names` names what its `if TYPE_CHECKING:` imports do (what type
    checkers read); a subpackage is an attribute once read, as the eager package made it."""
    import subprocess
    import sys
    import types

    import pytest

    probe = ("import sys, hookprof.hooks.capture; "
             "print(sorted(m for m in sys.modules if m.startswith('hookprof.hooks.') and m.endswith('_hook')))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", loaded
    probe = "import hookprof; print(hookprof.tracing.HostTracer.__module__, hookprof.hooks.session.__name__)"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert loaded.split() == ["hookprof.tracing.host", "hookprof.hooks.session"], loaded
    import hookprof
    import hookprof.hooks

    for package in (hookprof, hookprof.hooks):
        tree = ast.parse(Path(package.__file__).read_text())
        checked = {(node.module, alias.name) for block in tree.body
                   if isinstance(block, ast.If) and getattr(block.test, "id", None) == "TYPE_CHECKING"
                   for node in block.body if isinstance(node, ast.ImportFrom) for alias in node.names}
        table = next(node for block in tree.body if isinstance(block, ast.If) for node in ast.walk(block)
                     if isinstance(node, ast.Dict))
        given = {(key.value, name.value) for key, names in zip(table.keys, table.values) for name in names.elts}
        assert given == checked and {name for _, name in given} == set(package.__all__), package.__name__
        assert set(package.__all__) <= set(dir(package))
        for name in package.__all__:
            value = getattr(package, name)
            if isinstance(value, types.ModuleType):
                assert value is sys.modules[f"hookprof.{name}"], name
            else:
                assert value is getattr(sys.modules[value.__module__], value.__name__), name
    from hookprof import ProfilerHook
    from hookprof.hooks.profiler_hook import ProfilerHook as defined

    assert ProfilerHook is defined
    with pytest.raises(AttributeError, match="no attribute 'NoSuchHook'"):
        hookprof.hooks.NoSuchHook  # noqa: B018
