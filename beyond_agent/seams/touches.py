"""Every touch of upstream surface in our code, found by walking its syntax trees: the other half of `SEAMS`.

`SEAMS` lists the places we lean on upstream surface that is not public API; `touches()` finds them in the code
itself, so that a touch the registry does not list fails a test (tests/foundation/test_verl_seams_on_cpu.py):

- OVERRIDE: a method `_x` of a class of ours whose upstream base class (imported and looked up, through its whole
  MRO) has `_x`, whether or not ours calls `super()`;
- READ: an attribute `_x` read or called that none of our code defines (`obj._x`, or `self._x` inherited from an
  upstream class), a private name imported from an upstream module, and a method of an upstream class called on
  our own instance (`Base.method(self, ...)`: it skips whatever overrides the method in between);
- PATCH: an attribute `_x` set on something not ours, and any attribute set on an upstream module or class (a name
  imported from a package that is neither ours nor the standard library, or a module got from
  `importlib.import_module`), with `=`, `del`, `setattr` or our `patch`.

"Upstream" is every package that is neither ours nor the standard library (verl, vLLM, uvicorn, urllib3, torch, the
env libraries); the standard library's own underscored names (`os._exit`) are its documented API. A name both
upstream and our code define is taken as ours when read (the override rule still catches a clash of methods).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from beyond_agent.seams import KINDS, OVERRIDE, PATCH, READ, SEAMS, Seam

OUR_PACKAGES = ("beyond_agent", "recipe", "verl_cpu", "envservice", "sandbox", "launch", "dev_tools")
"""The packages of this repository whose touches of upstream surface the registry must list."""


@dataclass(frozen=True)
class Touch:
    """One place our code touches upstream surface."""

    module: str
    """Our module, dotted (`beyond_agent.weights.vllm_extension`)."""
    line: int
    kind: str
    """OVERRIDE, READ or PATCH."""
    name: str
    """The attribute touched (its last part)."""
    code: str
    """The code that touches it, as written."""

    def __str__(self) -> str:
        return f"{self.module}:{self.line} {self.kind} {self.name}: {self.code}"


def our_sources(root: Path, packages: Iterable[str] = OUR_PACKAGES) -> list[tuple[str, ast.Module]]:
    """(dotted module name, syntax tree) of every Python file of `packages` under `root`."""
    sources = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            sources.append((name, ast.parse(path.read_text(), str(path))))
    return sources


def touches(sources: list[tuple[str, ast.Module]], packages: Iterable[str] = OUR_PACKAGES) -> list[Touch]:
    """Every touch of upstream surface in `sources` (see the module docstring for what counts)."""
    packages = tuple(packages)
    ours = names_we_define(sources)
    found: list[Touch] = []
    for module, tree in sources:
        found += _ModuleWalk(module, tree, ours, packages).touches()
    return found


def unlisted(found: Iterable[Touch], seams: Iterable[Seam] = SEAMS) -> list[Touch]:
    """The touches no seam lists: same module of ours, same attribute, same kind (a READ is also listed by a seam
    that overrides or patches the attribute in that module)."""
    listed = {(seam.ours.partition(":")[0], seam.name.rpartition(".")[2], seam.kind) for seam in seams}
    return [touch for touch in found if (touch.module, touch.name, touch.kind) not in listed
            and not (touch.kind == READ and any((touch.module, touch.name, kind) in listed for kind in KINDS))]


def names_we_define(sources: list[tuple[str, ast.Module]]) -> set[str]:
    """Every name our code defines: functions, classes, names assigned in a class body or at module level, and
    attributes assigned on `self` or `cls`."""
    names: set[str] = set()
    for _, tree in sources:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            for target in _assigned(node):
                if isinstance(target, ast.Name):
                    names.add(target.id)
                elif isinstance(target, ast.Attribute) and _root_name(target) in ("self", "cls") \
                        and isinstance(target.value, ast.Name):
                    names.add(target.attr)
    return names


class _ModuleWalk:
    """The touches of one module of ours."""

    def __init__(self, module: str, tree: ast.Module, ours: set[str], packages: tuple[str, ...]) -> None:
        self.module, self.tree, self.ours, self.packages = module, tree, ours, packages
        self.imported = _imports(tree, module)
        """alias -> the dotted path it names (`verl.workers.engine.base.BaseEngine`); `importlib` for a module got
        from importlib.import_module."""

    def touches(self) -> list[Touch]:
        found = []
        for node in ast.walk(self.tree):
            found += self._of(node)
        return found

    def _of(self, node: ast.AST) -> list[Touch]:
        if isinstance(node, ast.ClassDef):
            return list(self._overrides(node))
        if isinstance(node, ast.ImportFrom) and node.level == 0 and self._upstream(node.module or ""):
            return [self._touch(node, READ, alias.name) for alias in node.names if _private(alias.name)]
        if isinstance(node, ast.Call):
            return list(self._calls(node))
        found = []
        for target in _assigned(node, including_deletes=True):
            if isinstance(target, ast.Attribute) and (self._foreign_private(target) or self._on_upstream(target)):
                found.append(self._touch(node, PATCH, target.attr))
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and self._foreign_private(node):
            found.append(self._touch(node, READ, node.attr))
        return found

    def _overrides(self, cls: ast.ClassDef) -> Iterator[Touch]:
        upstream = [klass for base in cls.bases for klass in self._upstream_classes(base)]
        for item in cls.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(item.name) \
                    and any(item.name in vars(klass) for klass in upstream):
                yield self._touch(item, OVERRIDE, item.name)

    def _calls(self, call: ast.Call) -> Iterator[Touch]:
        function = call.func
        if isinstance(function, ast.Name) and function.id in ("setattr", "patch") and len(call.args) >= 2 \
                and isinstance(call.args[1], ast.Constant) and isinstance(call.args[1].value, str):
            name, owner = call.args[1].value, call.args[0]
            # Our `patch` always replaces upstream surface; setattr does when its owner is upstream's.
            if function.id == "patch" or _private(name) or self._is_upstream_expression(owner):
                yield self._touch(call, PATCH, name)
        elif isinstance(function, ast.Attribute) and call.args and isinstance(call.args[0], ast.Name) \
                and call.args[0].id == "self" and self._is_upstream_class(function.value):
            yield self._touch(call, READ, function.attr)  # Base.method(self, ...): past every override between

    def _foreign_private(self, node: ast.Attribute) -> bool:
        """`x._y` where `_y` is none of ours and `x` is not a standard-library module."""
        return _private(node.attr) and node.attr not in self.ours and not self._stdlib(_root_name(node))

    def _on_upstream(self, node: ast.Attribute) -> bool:
        """`module.name` or `Class.name` of an upstream package (what assigning it replaces for everyone)."""
        return self._is_upstream_expression(node.value)

    def _is_upstream_expression(self, node: ast.AST) -> bool:
        root = _root_name(node) if isinstance(node, (ast.Attribute, ast.Name)) else None
        path = self.imported.get(root or "")
        return path == "importlib" or (path is not None and self._upstream(path))

    def _is_upstream_class(self, node: ast.AST) -> bool:
        resolved = self._resolve(node)
        return inspect.isclass(resolved) and self._upstream(resolved.__module__)

    def _upstream_classes(self, base: ast.expr) -> list[type]:
        """The upstream classes in the MRO of a base class expression (ours resolved by importing them)."""
        resolved = self._resolve(base)
        if not inspect.isclass(resolved):
            return []
        return [klass for klass in resolved.__mro__ if self._upstream(klass.__module__)]

    def _resolve(self, node: ast.AST) -> Any:
        """The object a dotted name expression names, imported (None when it cannot be)."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.insert(0, node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        path = self.imported.get(node.id)
        try:
            if path is None or path == "importlib":  # a name of this module itself
                found: Any = importlib.import_module(self.module)
                parts.insert(0, node.id)
            else:
                found = _import_path(path)
            for part in parts:
                found = getattr(found, part)
        except Exception:  # noqa: BLE001 - a name that cannot be imported here is not upstream's class
            return None
        return found

    def _upstream(self, dotted: str) -> bool:
        top = dotted.split(".")[0]
        return bool(top) and top not in self.packages and top not in sys.stdlib_module_names and top != "builtins"

    def _stdlib(self, root: str | None) -> bool:
        path = self.imported.get(root or "")
        return path is not None and path != "importlib" and path.split(".")[0] in sys.stdlib_module_names

    def _touch(self, node: ast.AST, kind: str, name: str) -> Touch:
        return Touch(self.module, getattr(node, "lineno", 0), kind, name, ast.unparse(node).splitlines()[0][:160])


def _imports(tree: ast.Module, module: str) -> dict[str, str]:
    """alias -> dotted path for every import in the module (relative ones made absolute), and "importlib" for
    names assigned from `importlib.import_module(...)`."""
    imported: dict[str, str] = {}
    package = module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                imported[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else \
                    alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                imported[alias.asname or alias.name] = f"{base}.{alias.name}"
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                and ast.unparse(node.value.func) == "importlib.import_module":
            imported.update({target.id: "importlib" for target in node.targets if isinstance(target, ast.Name)})
    return imported


def _import_path(path: str) -> Any:
    """The module or attribute a dotted import path names."""
    try:
        return importlib.import_module(path)
    except ImportError:
        module, _, attribute = path.rpartition(".")
        return getattr(importlib.import_module(module), attribute)


def _assigned(node: ast.AST, including_deletes: bool = False) -> Iterator[ast.expr]:
    """The targets `node` assigns (tuples unpacked)."""
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif including_deletes and isinstance(node, ast.Delete):
        targets = list(node.targets)
    while targets:
        target = targets.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            targets += target.elts
        else:
            yield target


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")
