"""The module rules of DESIGN.md, checked over the installed package (``rlflow.dataflow``, ``rlflow.nodes``,
``rlflow.schedulers``, found through ``importlib``, not through this checkout's paths):

* no import circle between files: every import counts, at module level or inside a function, method or
  class (``from pkg import name`` where ``name`` is a submodule imports that submodule; relative imports
  are resolved; ``importlib.import_module("a.b")`` with a literal name counts), except those under
  ``if TYPE_CHECKING:``; importing a submodule does not count as importing its package's ``__init__``;
* no module over :data:`MAX_LINES` lines;
* no private name (``_x``, not a dunder) imported from another rlflow module, type-only imports included:
  a name shared between modules is public.

The checkers run on a synthetic package first, so each rule is seen to catch what it should.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import networkx as nx
import pytest

ROOTS = ("rlflow.dataflow", "rlflow.nodes", "rlflow.schedulers")
MAX_LINES = 600


@dataclass(frozen=True)
class Import:
    """One imported module of a source file: ``module`` (absolute), the ``names`` a ``from`` import takes
    from it (empty for ``import module``), its ``line``, and whether it sits under ``if TYPE_CHECKING:``."""

    module: str
    names: tuple[str, ...]
    line: int
    type_only: bool


def installed_roots(packages: tuple[str, ...] = ROOTS) -> dict[str, Path]:
    """The directory of each installed package in ``packages``, as the import system finds it."""
    roots = {}
    for name in packages:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.submodule_search_locations, f"{name} is not an installed package"
        roots[name] = Path(next(iter(spec.submodule_search_locations)))
    return roots


def module_files(roots: dict[str, Path]) -> dict[str, Path]:
    """Module name -> source file of every ``.py`` file under the package directories ``roots``
    (package name -> directory); a package is its ``__init__.py``."""
    files = {}
    for package, directory in roots.items():
        for path in sorted(directory.rglob("*.py")):
            parts = path.relative_to(directory).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join((package, *parts))] = path
    return files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module a ``from`` import names, relative levels resolved against ``module``."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join([*package, *([node.module] if node.module else [])])


def imports_of(tree: ast.Module, module: str, is_package: bool) -> list[Import]:
    """Every import in ``tree`` (the source of ``module``), at any depth, in source order."""
    found: list[Import] = []

    def visit(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_only)
            return
        if isinstance(node, ast.Import):
            found.extend(Import(alias.name, (), node.lineno, type_only) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names = tuple(alias.name for alias in node.names)
            found.append(Import(_absolute(node, module, is_package), names, node.lineno, type_only))
        elif (
            isinstance(node, ast.Call)
            and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and not node.args[0].value.startswith(".")
        ):
            found.append(Import(node.args[0].value, (), node.lineno, type_only))
        for child in ast.iter_child_nodes(node):
            visit(child, type_only)

    visit(tree, False)
    return found


def parsed_imports(files: dict[str, Path]) -> dict[str, list[Import]]:
    """:func:`imports_of` for every module of ``files``."""
    return {
        module: imports_of(ast.parse(path.read_text(), str(path)), module, path.name == "__init__.py")
        for module, path in files.items()
    }


def _known(name: str, files: dict[str, Path]) -> str | None:
    """The longest prefix of the dotted ``name`` that is a module of ``files`` (None: none is)."""
    while name and name not in files:
        name = name.rpartition(".")[0]
    return name or None


def targets(imp: Import, files: dict[str, Path]) -> set[str]:
    """The modules of ``files`` that ``imp`` imports: a name taken from a package that is one of its
    submodules is that submodule; any other name is the module itself."""
    if not imp.names:
        found = _known(imp.module, files)
        return {found} if found else set()
    out = set()
    for name in imp.names:
        sub = f"{imp.module}.{name}"
        found = sub if sub in files else _known(imp.module, files)
        if found:
            out.add(found)
    return out


def import_graph(files: dict[str, Path]) -> nx.DiGraph:
    """Module -> module for every import of ``files`` outside ``if TYPE_CHECKING:`` (no self-loops);
    each edge's ``lines`` attribute lists the importing lines."""
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for module, found in parsed_imports(files).items():
        for imp in found:
            if imp.type_only:
                continue
            for target in targets(imp, files) - {module}:
                if graph.has_edge(module, target):
                    graph[module][target]["lines"].append(imp.line)
                else:
                    graph.add_edge(module, target, lines=[imp.line])
    return graph


def import_circles(files: dict[str, Path]) -> list[list[str]]:
    """Each strongly connected component of more than one module of ``files``' import graph, sorted."""
    graph = import_graph(files)
    return sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)


def describe_circle(circle: list[str], files: dict[str, Path]) -> str:
    """The modules of ``circle`` and, for each, the lines by which it imports the others in it."""
    graph = import_graph(files)
    edges = [
        f"    {files[a].name}:{','.join(map(str, graph[a][b]['lines']))} -> {b}"
        for a in circle
        for b in sorted(graph.successors(a))
        if b in circle
    ]
    return " <-> ".join(circle) + "\n" + "\n".join(edges)


def private_imports(files: dict[str, Path]) -> list[str]:
    """``module:line: from x import _y`` for each private (not dunder) name a module of ``files`` takes
    from another of them, type-only imports included; importing a submodule is not taking a name."""
    found = []
    for module, imports in parsed_imports(files).items():
        for imp in imports:
            source = _known(imp.module, files)
            if source is None or source == module:
                continue
            for name in imp.names:
                private = name.startswith("_") and not (name.startswith("__") and name.endswith("__"))
                if private and f"{imp.module}.{name}" not in files:
                    found.append(f"{module}:{imp.line}: from {imp.module} import {name}")
    return found


def long_modules(files: dict[str, Path], limit: int = MAX_LINES) -> list[str]:
    """``module: N lines`` for each module of ``files`` longer than ``limit`` lines."""
    counts = {module: len(path.read_text().splitlines()) for module, path in files.items()}
    return [f"{module}: {n} lines" for module, n in sorted(counts.items()) if n > limit]


# ---- the checkers on a synthetic package ---------------------------------------------------------------


@pytest.fixture
def toy(tmp_path: Path) -> dict[str, Path]:
    """A package ``toy`` with one circle through a function-level import (a, b), one through relative
    imports (rel.e, rel.f), a type-only one (c, d), a private import and a long module."""
    sources = {
        "__init__.py": "",
        "a.py": "from toy.b import g\n\n_hidden = 1\n",
        "b.py": "def g():\n    from toy import a\n\n    return a\n",
        "c.py": (
            "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from toy.d import D\nelse:\n"
            "    import json\n\nclass C: ...\n"
        ),
        "d.py": (
            "import typing\n\nfrom toy.c import C\n\n"
            "if typing.TYPE_CHECKING:\n    from toy.a import _hidden\n"
        ),
        "rel/__init__.py": "",
        "rel/e.py": "from . import f\n",
        "rel/f.py": "class F:\n    def m(self):\n        from .e import f\n",
        "long.py": "x = 1\n" * (MAX_LINES + 1),
        "ok.py": "import toy.a\nfrom toy import __doc__, rel\nfrom toy.rel import e\n"
        + "y = 2\n" * (MAX_LINES - 3),
    }
    for name, text in sources.items():
        path = tmp_path / "toy" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return module_files({"toy": tmp_path / "toy"})


def test_a_circle_through_a_function_level_import_is_found(toy: dict[str, Path]) -> None:
    assert import_circles(toy) == [["toy.a", "toy.b"], ["toy.rel.e", "toy.rel.f"]]
    graph = import_graph(toy)
    assert not graph.has_edge("toy.c", "toy.d")  # type-only
    assert graph.has_edge("toy.b", "toy.a") and graph["toy.b"]["toy.a"]["lines"] == [2]
    assert set(graph.successors("toy.ok")) == {"toy.a", "toy", "toy.rel", "toy.rel.e"}
    assert "b.py:2 -> toy.a" in describe_circle(["toy.a", "toy.b"], toy)


def test_a_private_name_from_another_module_is_found(toy: dict[str, Path]) -> None:
    assert private_imports(toy) == ["toy.d:6: from toy.a import _hidden"]


def test_a_long_module_is_found(toy: dict[str, Path]) -> None:
    assert long_modules(toy) == [f"toy.long: {MAX_LINES + 1} lines"]


# ---- the installed package ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def installed() -> dict[str, Path]:
    files = module_files(installed_roots())
    assert len(files) > 50 and all(any(m.startswith(r + ".") for m in files) for r in ROOTS), files
    return files


def test_no_import_circle_between_files(installed: dict[str, Path]) -> None:
    circles = import_circles(installed)
    assert not circles, f"{len(circles)} import circle(s):\n" + "\n".join(
        describe_circle(c, installed) for c in circles
    )


def test_no_module_is_over_the_line_limit(installed: dict[str, Path]) -> None:
    long = long_modules(installed)
    assert not long, f"modules over {MAX_LINES} lines:\n" + "\n".join(long)


def test_no_private_name_is_imported_across_modules(installed: dict[str, Path]) -> None:
    found = private_imports(installed)
    assert not found, "private names imported from another module (make them public):\n" + "\n".join(found)
