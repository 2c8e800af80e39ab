"""Callbacks made from hooks: a framework's callback for a hookprof hook takes exactly the hook's arguments.

`lightning_prof.callbacks` and `keras_prof.callbacks` make each of their callbacks with `callback_class`. The
class's `__init__` has the hook's own signature (names, order, defaults, annotations, so `help()`,
`inspect.signature`, LightningCLI and jsonargparse see them), less the arguments the framework decides itself,
plus the framework's own keyword-only ones (Lightning's `name=`). It makes the hook (`callback.hook`) and hands it
to the framework's `HookCallback`, which runs it; the hook's public properties (`saved_paths`, ...) are the
callback's too (after a fit that ran in copies of the callback in other processes, Lightning's `ddp_spawn`,
they read what rank 0's copy ended with: `send_home`). An argument added to a hook thus appears in both adapters
without being written there again.

What a framework adds to every callback is an `Adapter`: its `HookCallback` class, the defaults it chooses
(`output_dir=None`: the framework's run directory), how its writers become what hooks take (a Lightning
`TensorBoardLogger` as an event sink) and what it supplies to hooks that ask (the default checkpoint saver).

Type checkers do not run code, so they cannot see a class made at run time: `stub(module)` writes the `.pyi` of
an adapter module from the same signatures (`python -m hookprof.hooks.adapter lightning_prof.callbacks
keras_prof.callbacks` rewrites them beside the modules; `tests/test_adapters.py` fails when one is stale). ruff,
the project's lint, lays them out (imports in isort's order, long signatures wrapped), so it must be installed
where they are written or checked (the `test` extra).
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import importlib
import inspect
import logging
import re
import subprocess
import sys
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from hookprof._runtime.sent_home import SentHome

log = logging.getLogger(__name__)

_EMPTY = inspect.Parameter.empty
_KEYWORD_ONLY = inspect.Parameter.KEYWORD_ONLY


@dataclasses.dataclass(frozen=True)
class Adapter:
    """What one framework adds to every callback it makes of a hook.

    Attributes:
        base: the framework's `HookCallback`, called as `base.__init__(callback, [hook], **own)`; its
            keyword-only arguments (Lightning's `name`) are every callback's own, after the hook's.
        module: the module the callbacks live in (their `__module__`: pickle, e.g. Lightning's ddp_spawn, finds
            them there by name).
        defaults: a hook argument's default where the framework chooses another (`{"output_dir": None}`: the
            adapter picks the directory when the fit starts).
        convert: a hook argument as the hook takes it, from what the framework's user passes
            (`{"summary_writer": event_sink}`).
        supply: what the framework gives a hook that has the method (`{"set_default_saver": trainer_saver}`).
        omit: hook arguments that no callback of this framework takes (`clock`: the schedule's test clock).
    """

    base: type
    module: str
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    convert: Mapping[str, Callable[[Any], Any]] = dataclasses.field(default_factory=dict)
    supply: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    omit: tuple[str, ...] = ("clock",)


@dataclasses.dataclass(frozen=True)
class Made:
    """How a callback class was made (`callback_class`), kept on it as `_made_from` for `stub`."""

    hook_class: type
    adapter: Adapter
    signature: inspect.Signature  # of `__init__`, self included, annotations resolved
    source: inspect.Signature  # the same parameters with their annotations as written (for the stub)
    properties: tuple[str, ...]  # the hook's public properties, read through the callback


def callback_class(hook_class: type, adapter: Adapter, doc: str, *, parent: type | None = None,
                   omit: tuple[str, ...] = (), fixed: Mapping[str, Any] | None = None) -> type:
    """The framework's callback class for `hook_class`, named as the hook, with `doc` as its docstring.

    Args:
        hook_class: the hookprof hook the callback runs.
        adapter: the framework's `Adapter`.
        doc: the class docstring: what the framework adds (its defaults, where files go). The hook's `Args:` and
            `Raises:` become `__init__`'s docstring.
        parent: the class the callback derives from: `adapter.base` (the default) or a subclass of it with this
            hook's framework specifics (more callback methods); it may define `_hook_arguments(arguments)`,
            which gets the hook's arguments as a dict before the hook is made and returns them (Lightning turns
            a collection key into the collection there). It adds no public names of its own: the stub shows
            the callback as a subclass of `adapter.base`.
        omit: more hook arguments that this callback does not take (beside `adapter.omit`).
        fixed: hook arguments this framework always passes (not in the callback's signature).

    Raises:
        TypeError: an argument to omit or fix that the hook has not, a required one omitted, an argument of the
            base's that the hook has too, a parent that is not a subclass of the base or that adds public names:
            a mistake in the adapter, found at import.
    """
    parent = adapter.base if parent is None else parent
    _check_parent(parent, adapter.base)
    fixed = dict(fixed or {})
    name = hook_class.__name__
    source = _signature(hook_class, adapter, (*omit, *fixed))
    signature = _resolved(source, hook_class, adapter.base)
    own = [p.name for p in _own_parameters(adapter.base)]
    prepare = getattr(parent, "_hook_arguments", None)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError as error:
            raise TypeError(f"{type(self).__name__}(): {error}") from None
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        del arguments["self"]
        extra = {key: arguments.pop(key) for key in own}
        arguments = {key: adapter.convert[key](value) if key in adapter.convert else value
                     for key, value in arguments.items()}
        if prepare is not None:
            arguments = self._hook_arguments(arguments)
        hook = self.hook = hook_class(**arguments, **fixed)
        self._home = SentHome()  # where a copy of this callback in another process sends its hook's properties
        for method, value in adapter.supply.items():
            if hasattr(hook, method):
                getattr(hook, method)(value)
        super(made, self).__init__([hook], **extra)

    __init__.__signature__ = signature  # type: ignore[attr-defined]
    __init__.__annotations__ = {p.name: p.annotation for p in signature.parameters.values()
                                if p.annotation is not _EMPTY} | {"return": None}
    __init__.__qualname__ = f"{name}.__init__"
    __init__.__doc__ = _init_doc(hook_class, adapter.base, signature)
    properties = tuple(key for key in dir(hook_class) if not key.startswith("_") and not hasattr(parent, key)
                       and isinstance(inspect.getattr_static(hook_class, key), property))
    namespace: dict[str, Any] = {"__module__": adapter.module, "__qualname__": name, "__doc__": inspect.cleandoc(doc),
                                 "__init__": __init__}
    for key in properties:
        namespace[key] = property(_read_through(key), doc=inspect.getattr_static(hook_class, key).__doc__)
    made = type(name, (parent,), namespace)
    made._made_from = Made(hook_class, adapter, signature, source, properties)  # type: ignore[attr-defined]
    return made


def _check_parent(parent: type, base: type) -> None:
    """A parent adds callback methods the base has (Lightning's `on_fit_start`), never a public name of its own:
    the stub shows the callback as a subclass of the base."""
    if not issubclass(parent, base):
        raise TypeError(f"{parent.__qualname__} is not a subclass of {base.__qualname__}.")
    for klass in parent.__mro__[:parent.__mro__.index(base)]:
        added = [key for key in vars(klass) if not key.startswith("_") and not hasattr(base, key)]
        if added:
            raise TypeError(f"{klass.__qualname__} adds {added}, which the stub would not show: give them to "
                            f"{base.__qualname__}, or keep them private.")


def _read_through(key: str) -> Callable[[Any], Any]:
    def read(self: Any) -> Any:
        sent = self._home.received()
        return sent[key] if key in sent else getattr(self.hook, key)

    read.__name__ = key
    return read


def send_home(callback: Any) -> None:
    """A fit ends in a copy of `callback` that another process made and pickled here (a rank that Lightning's
    `ddp_spawn` started): its hook's public properties (`saved_paths`, counters, ...) go to the callback there,
    whose properties then read them (`hookprof._runtime.sent_home`). Nothing for a callback in its own process."""
    made = getattr(type(callback), "_made_from", None)
    home = getattr(callback, "_home", None)
    if made is None or home is None or not home.away:
        return
    values = {}
    for key in made.properties:
        try:
            values[key] = getattr(callback.hook, key)
        except Exception as error:  # (a property that fails is not sent: the home reads its own)
            log.debug("%s.%s is not sent home: %s", type(callback).__name__, key, error)
    home.send(values)


def fit_begins(callback: Any) -> None:
    """A fit begins with `callback`: where this is its own process, its properties read its hook again, not what a
    copy in another process sent before."""
    home = getattr(callback, "_home", None)
    if home is not None:
        home.forget()


def _own_parameters(base: type) -> list[inspect.Parameter]:
    """The base's keyword-only arguments: every callback's own (Lightning's `name`)."""
    return [p for p in inspect.signature(base.__init__).parameters.values() if p.kind is _KEYWORD_ONLY]


def _signature(hook_class: type, adapter: Adapter, omit: tuple[str, ...]) -> inspect.Signature:
    """`__init__`'s signature as written (annotations as strings): the hook's parameters less `omit` and those of
    `adapter.omit` it has, with the adapter's defaults, then the base's keyword-only ones."""
    params = list(inspect.signature(hook_class.__init__).parameters.values())
    names = {p.name for p in params}
    own = _own_parameters(adapter.base)
    wrong = [key for key in omit if key not in names] + [p.name for p in own if p.name in names]
    if wrong:
        raise TypeError(f"{hook_class.__name__}: the adapter omits arguments the hook has not, or adds ones it has "
                        f"already: {wrong}.")
    kept = []
    for p in params:
        if p.name in omit or p.name in adapter.omit:
            if p.default is _EMPTY:
                raise TypeError(f"{hook_class.__name__}: `{p.name}` is required; it cannot be omitted.")
            continue
        if p.name in adapter.defaults and p.default is not _EMPTY:
            p = p.replace(default=adapter.defaults[p.name])
        kept.append(p)
    return inspect.Signature([*kept, *own], return_annotation=None)


def _resolved(source: inspect.Signature, hook_class: type, base: type) -> inspect.Signature:
    """`source` with its annotations evaluated where they were written (the hook's module, the base's)."""
    hints = {**typing.get_type_hints(base.__init__), **typing.get_type_hints(hook_class.__init__)}
    return source.replace(parameters=[p.replace(annotation=hints.get(p.name, p.annotation))
                                      for p in source.parameters.values()])


# --- docstrings -------------------------------------------------------------------------------------------------


def _sections(doc: str | None) -> dict[str, dict[str, str]]:
    """A Google-style docstring's `Args:` / `Raises:` / ... sections: {section: {entry name: its text}}."""
    found: dict[str, dict[str, str]] = {}
    entries: dict[str, str] | None = None
    entry = None
    for line in inspect.cleandoc(doc or "").splitlines():
        if re.fullmatch(r"[A-Z]\w*:", line):  # a section title, at the docstring's own indent
            entries = found.setdefault(line[:-1], {})
            continue
        if entries is None:
            continue
        if line and not line.startswith(" "):  # back at the docstring's indent: the section ended
            entries = None
            continue
        match = re.match(r" {4}(\w+):", line)
        if match:
            entry = match.group(1)
            entries[entry] = line
        elif entry is not None and line.strip():
            entries[entry] += "\n" + line
    return found


def _init_doc(hook_class: type, base: type, signature: inspect.Signature) -> str:
    """The hook's `Args:` (those the callback takes) and `Raises:`, and the base's own arguments."""
    hook = _sections(hook_class.__doc__)
    args = {**_sections(base.__doc__).get("Args", {}), **hook.get("Args", {})}
    text = [f"Makes `{hook_class.__module__}.{hook_class.__qualname__}` of these arguments, run by this callback."]
    kept = [args[key] for key in signature.parameters if key in args]
    if kept:
        text += ["", "Args:", *kept]
    raises = hook.get("Raises", {})
    if raises:
        text += ["", "Raises:", *raises.values()]
    return "\n".join(text)


# --- stubs ------------------------------------------------------------------------------------------------------

HEADER = ("# Written by `python -m hookprof.hooks.adapter {module}` from hookprof's hook signatures: do not edit.\n"
          "# (tests/test_adapters.py fails when it is stale.)")


def made_from(obj: Any) -> Made | None:
    """How a callback class was made, or None for anything `callback_class` did not make."""
    made = getattr(obj, "__dict__", {}).get("_made_from")
    return made if isinstance(made, Made) else None


def stub(module: ModuleType) -> str:
    """The `.pyi` text of an adapter module: the names of its `__all__`, each a callback class that
    `callback_class` made (its signature, `hook`, its properties), a function of the module's own, or a name it
    imports from where that is defined.

    Raises:
        TypeError: a name the stub cannot show (a value, a class written in the module), an annotation that is not
            a string (the module lacks `from __future__ import annotations`) or that names one of the module's
            own callbacks.
    """
    out = _Stub(module)
    for name in module.__all__:
        obj = getattr(module, name)
        made = made_from(obj)
        if made is not None:
            out.callback(name, made)
        elif inspect.isfunction(obj) and obj.__module__ == module.__name__:
            params = [(p, obj) for p in inspect.signature(obj).parameters.values()]
            out.body += ["", out.function(name, obj, params)]
        elif getattr(obj, "__module__", None) not in (None, module.__name__):
            out.imports.add(f"from {obj.__module__} import {name} as {name}")
        else:
            raise TypeError(f"{module.__name__}.{name}: a stub shows callbacks, functions and imported names only.")
    return out.text()


class _Stub:
    """A stub being written: its imports, gathered from the annotations it uses, and its body, laid out by ruff
    (`_ruff`): imports in isort's order, long signatures wrapped."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module
        self.exported = list(module.__all__)
        self.imports: set[str] = set()
        self.body: list[str] = []

    def text(self) -> str:
        names = ", ".join(f'"{name}"' for name in self.exported)
        raw = "\n".join([HEADER.format(module=self.module.__name__), "", *sorted(self.imports), *self.body, "",
                         f"__all__ = [{names}]", ""])
        return _ruff(raw, Path(self.module.__file__).with_suffix(".pyi"))

    def callback(self, name: str, made: Made) -> None:
        base, hook = made.adapter.base, made.hook_class
        self.imports.add(f"from {base.__module__} import {base.__name__}")
        self.imports.add(f"import {hook.__module__}")
        hook_params = inspect.signature(hook.__init__).parameters
        params = [(p, hook.__init__ if p.name in hook_params else base.__init__)
                  for p in made.source.parameters.values()]
        self.body += ["", f"class {name}({base.__name__}):", f"    hook: {hook.__module__}.{hook.__qualname__}",
                      self.function("__init__", hook.__init__, params, "    ")]
        if made.properties:  # read only (Final)
            self.imports.add("from typing import Final")
            self.body += [f"    {key}: Final[{self.annotation(inspect.getattr_static(hook, key).fget, 'return')}]"
                          for key in made.properties]

    def function(self, name: str, function: Any, params: list[tuple[inspect.Parameter, Any]], indent: str = "") -> str:
        """A `def` line from the parameters, each with the function its annotation was written in."""
        texts = []
        for p, owner in params:
            if p.kind is _KEYWORD_ONLY and "*" not in texts:
                texts.append("*")
            text = p.name if p.annotation is _EMPTY else f"{p.name}: {self.annotation(owner, p.name)}"
            texts.append(text if p.default is _EMPTY else f"{text} = ...")
        returns = self.annotation(function, "return") if name != "__init__" else "None"
        return f"{indent}def {name}({', '.join(texts)}) -> {returns}: ..."

    def annotation(self, function: Any, key: str) -> str:
        """`function`'s annotation of `key` as written, importing the names it uses from where they are defined."""
        text = function.__annotations__.get(key)
        if text is None:
            self.imports.add("from typing import Any")
            return "Any"
        if not isinstance(text, str):
            raise TypeError(f"{function.__qualname__}: annotation {text!r} is not a string: stubs are written from "
                            "modules with `from __future__ import annotations`.")
        scope = inspect.unwrap(function).__globals__
        for node in ast.walk(ast.parse(text, mode="eval")):
            if not isinstance(node, ast.Name) or node.id not in scope and hasattr(builtins, node.id):
                continue
            if node.id in self.exported:
                raise TypeError(f"{function.__qualname__}: annotation {text!r} names {node.id}, which the stub "
                                "defines as a callback.")
            value = scope[node.id]
            if isinstance(value, ModuleType):
                if value.__name__ != node.id:
                    raise TypeError(f"{function.__qualname__}: a stub imports modules by their own name, not "
                                    f"{value.__name__} as {node.id}.")
                self.imports.add(f"import {value.__name__}")
            else:
                self.imports.add(f"from {_defined_in(value, node.id, function.__module__)} import {node.id}")
        return text


def _defined_in(value: Any, name: str, fallback: str) -> str:
    """Where `name` is defined: its module when that module has it under this name, else `fallback`."""
    module = getattr(value, "__module__", None)
    if module and getattr(sys.modules.get(module), name, None) is value:
        return module
    return fallback


def _ruff(text: str, path: Path) -> str:
    """`text` as ruff lays out the file at `path` under the project's settings (found from `path`): its imports
    sorted and merged (`check --fix --select I`), then formatted. ruff is the project's lint, in its `test`
    extra; the stubs are written and checked where that is installed."""
    for command in (["check", "--fix", "--select", "I"], ["format"]):
        try:
            done = subprocess.run([sys.executable, "-m", "ruff", *command, "--quiet", "--stdin-filename", str(path),
                                   "-"], input=text, capture_output=True, text=True, check=False)
        except OSError as err:
            raise RuntimeError(f"Could not run ruff to lay out {path}: {err}") from None
        if done.returncode != 0:
            raise RuntimeError(f"`ruff {command[0]}` failed on the stub of {path} (stubs are laid out by ruff: "
                               f"pip install -e '.[test]'):\n{done.stderr.strip()}")
        text = done.stdout
    return text


def write_stubs(module_names: list[str], check: bool = False) -> list[str]:
    """Writes each module's stub beside it (`<module>.pyi`), or with `check` only compares; returns the stale."""
    stale = []
    for module_name in module_names:
        module = importlib.import_module(module_name)
        path = Path(module.__file__).with_suffix(".pyi")
        text = stub(module)
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            stale.append(str(path))
            if not check:
                path.write_text(text, encoding="utf-8")
    return stale


def main(argv: list[str] | None = None) -> int:
    """`python -m hookprof.hooks.adapter [--check] MODULE...`: rewrite (or check) the adapters' stubs."""
    args = sys.argv[1:] if argv is None else argv
    check = "--check" in args
    stale = write_stubs([a for a in args if a != "--check"], check=check)
    for path in stale:
        print(f"{'stale' if check else 'wrote'}: {path}")
    return 1 if check and stale else 0


if __name__ == "__main__":  # (run as a script this file is `__main__`; the callbacks were made by the module)
    sys.exit(importlib.import_module("hookprof.hooks.adapter").main())
