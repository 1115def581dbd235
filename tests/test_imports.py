"""How the packages import each other: no cycle among their modules, and a client that loads no server framework.

The cycle check reads the source, not ``sys.modules``: every ``import`` statement of every module, at module level
or inside a function (a lazy import closes a cycle as surely as an eager one, only later and less visibly),
relative ones resolved; ``if TYPE_CHECKING:`` blocks are left out, as they never run. ``from package import
name`` depends on the submodule ``package.name`` when there is one, else on the package's ``__init__``. A module
importing one of its parent packages' ``__init__`` counts too (the parent's ``__init__`` importing the module back
is a cycle Python resolves only by the order of first import). An import by a computed name
(``importlib.import_module(...)``, as ``art_core.gateway``'s lazy attributes do) is not seen.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import art_core
import art_plugins

PACKAGES = [Path(art_plugins.__file__).parent, Path(art_core.__file__).parent]


def module_files(package: Path) -> dict[str, tuple[Path, bool]]:
    """``{dotted module name: (file, is a package __init__)}`` for every module under ``package``."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: all of them but those under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(package: Path) -> dict[str, dict[str, int]]:
    """``{module: {module it imports: line}}`` among the modules of ``package``."""
    modules = module_files(package)

    def within(name: str) -> str | None:  # the module a dotted name lands in (a function or class: its module)
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for module, (path, is_package) in modules.items():
        edges: dict[str, int] = {}
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    source = ".".join([*base, node.module] if node.module else base)
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
            for target in targets:
                found = within(target)
                if found is not None and found != module:
                    edges.setdefault(found, node.lineno)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iteratively), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def describe(group: list[str], graph: dict[str, dict[str, int]]) -> str:
    edges = [f"  {a} -> {b} (line {graph[a][b]})" for a in group for b in sorted(graph[a]) if b in group]
    return f"cycle among {', '.join(group)}:\n" + "\n".join(edges)


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_no_import_cycle(package: Path):
    graph = import_graph(package)
    assert len(graph) > 5  # the walk found the package's modules
    found = cycles(graph)
    assert not found, "\n".join(describe(group, graph) for group in found)


def test_the_walk_finds_lazy_relative_and_package_cycles(tmp_path: Path):
    # A package shaped like the cycle this test was written against: a lazy import inside a function closing
    # the loop, relative imports at two levels, and a module importing its package's __init__; and a
    # TYPE_CHECKING import, which never runs, left out.
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from .a import A\n",
        "a.py": "from typing import TYPE_CHECKING\nfrom .sub import b\nif TYPE_CHECKING:\n    from . import c\nA = 1\n",
        "sub/__init__.py": "",
        "sub/b.py": "def late():\n    from ..c import C\n    return C\n",
        "c.py": "import pkg.a\nC = 2\n",
        "d.py": "from pkg import A\n",
        "e.py": "from . import d\n",
    }
    for name, text in files.items():
        (package / name).write_text(text)
    graph = import_graph(package)
    assert graph["pkg.a"] == {"pkg.sub.b": 2} and graph["pkg.sub.b"] == {"pkg.c": 2}
    assert sorted(map(tuple, cycles(graph))) == [("pkg.a", "pkg.c", "pkg.sub.b")]
    # The loop cut, a package's __init__ importing a module that imports the package back.
    (package / "a.py").write_text("A = 1\n")
    (package / "__init__.py").write_text("from .a import A\nfrom .d import D\n")
    (package / "d.py").write_text("from pkg import A\nD = 3\n")
    assert cycles(import_graph(package)) == [["pkg", "pkg.d"]]


def test_a_client_imports_no_server_framework():
    # What runs an agent against a remote server: the adapters' shared parts, the remote backend and the records
    # it fetches. A fresh interpreter, so that nothing another test imported counts.
    code = ("import sys, art_plugins, art_plugins._rollout, art_plugins._tracing, art_core.backends.remote, "
            "art_core.gateway.records; print(sorted({m.partition('.')[0] for m in sys.modules} & "
            "{'fastapi', 'starlette', 'uvicorn'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
