"""The layering the architecture guide promises: imports point one way, without cycles."""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules(package: str) -> dict[str, str]:
    out = {}
    for d, _, files in os.walk(os.path.join(ROOT, package)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


def _runtime_imports(path: str, name: str, modules: dict[str, str]) -> set[str]:
    """Modules of `modules` that `name` imports when it runs (not under `if TYPE_CHECKING:`)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
               and getattr(node.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            found |= {c for c in [target] + [f"{target}.{a.name}" for a in node.names] if c in modules}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
    return found - {name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        state[v] = 2
        path.pop()
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_backend_has_no_import_cycle():
    modules = _modules("backend")
    graph = {name: _runtime_imports(path, name, modules) for name, path in modules.items()}
    # A package's __init__ importing its own submodules is not a cycle through them.
    for name in graph:
        graph[name] = {m for m in graph[name] if not name.startswith(m + ".")}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


ADAPTER = "backend.serving.model"  # the `tritium` Triton backend: the one module Triton imports


def test_imports_point_one_way():
    """The adapter -> backend -> kernels: only the adapter imports Triton's stub module, nothing
    imports the adapter, and the kernels import nothing of the engine."""
    modules = {**_modules("backend"), **_modules("kernels")}
    adapter = ast.parse(open(modules[ADAPTER], encoding="utf-8").read())
    assert any(a.name == "triton_python_backend_utils" for n in ast.walk(adapter)
               if isinstance(n, ast.Import) for a in n.names)
    for name, path in modules.items():
        if name == ADAPTER:
            continue
        tree = ast.parse(open(path, encoding="utf-8").read())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert "triton_python_backend_utils" not in imported, name
        assert ADAPTER not in imported and not any(
            n.module == "backend.serving" and any(a.name == "model" for a in n.names)
            for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)), name
        if name.startswith("kernels"):
            assert not any(m == "backend" or m.startswith("backend.") for m in imported), name


def test_model_py_is_an_adapter_and_modules_stay_small():
    with open(os.path.join(ROOT, "backend", "serving", "model.py"), encoding="utf-8") as f:
        assert len(f.readlines()) < 200
    for name, path in {**_modules("backend"), **_modules("kernels")}.items():
        with open(path, encoding="utf-8") as f:
            assert len(f.readlines()) <= 420, name
