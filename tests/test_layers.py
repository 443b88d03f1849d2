"""The package's layers import only downward, and nothing imports in a cycle.

Every ``import`` in ``hp_functional`` is parsed (module level and inside functions;
``if TYPE_CHECKING:`` blocks aside, they never run).  Layers, lowest first (docs/architecture.md):
core → plan → compile → runtime → train → tools → cli; a module may import its own layer and
the layers below, never above, and never the package root (the root only re-exports).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hp_functional"
LAYERS = ("core", "plan", "compile", "runtime", "train", "tools", "cli")


def _modules() -> dict[str, Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = list(f.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports (resolved to the longest known module)."""
    tree = ast.parse(path.read_text())
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for b in node.body for n in ast.walk(b)}
    targets: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            full = ".".join(x for x in (base, node.module or "") if x)
            targets.update(f"{full}.{a.name}" for a in node.names)
            targets.add(full)
    resolved = set()
    for t in targets:
        while t and t not in known:
            t = t.rpartition(".")[0]
        if t and t != name:
            resolved.add(t)
    return resolved


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {n: _imports(n, f, set(mods)) for n, f in mods.items()}


def test_every_module_belongs_to_a_layer():
    strays = [m for m in _modules() if m != "hp_functional" and _layer(m) is None]
    assert not strays, f"modules outside the layers {LAYERS}: {strays}"


def test_imports_go_only_downward():
    upward = []
    for module, deps in _graph().items():
        if module == "hp_functional":
            continue
        for dep in deps:
            if dep == "hp_functional" or (_layer(dep) is not None and _layer(dep) > _layer(module)):
                upward.append(f"{module} imports {dep}")
    assert not upward, "imports that go up a layer (a type lives in the wrong layer):\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    graph = _graph()
    color: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        color[node] = 1
        for dep in graph[node]:
            if color.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep] if dep in path else [node, dep])
            elif dep not in color:
                visit(dep, path + [dep])
        color[node] = 2

    for node in graph:
        if node not in color:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_checker_sees_function_level_and_relative_imports(tmp_path):
    """The parser would catch the cycles the old flat package hid in functions."""
    pkg = tmp_path / "hp_functional"
    (pkg / "core").mkdir(parents=True)
    (pkg / "plan").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "plan" / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("def f():\n    from ..plan.b import g\n")
    (pkg / "plan" / "b.py").write_text("from ..core import a\n")
    mods = {"hp_functional.core.a": pkg / "core" / "a.py", "hp_functional.plan.b": pkg / "plan" / "b.py"}
    assert _imports("hp_functional.core.a", mods["hp_functional.core.a"], set(mods)) == {"hp_functional.plan.b"}
    assert _imports("hp_functional.plan.b", mods["hp_functional.plan.b"], set(mods)) == {"hp_functional.core.a"}


def test_import_does_not_load_rich_or_tqdm():
    """``import hp_functional`` adds neither rich (CLI tables) nor tqdm (the demo) to what
    ``import torch`` loads (torch.hub imports tqdm by itself when it is installed)."""
    code = ("import sys, torch; before = set(sys.modules); import hp_functional; "
            "new = set(sys.modules) - before; "
            "print(sorted(m for m in new if m.split('.')[0] in ('rich', 'tqdm')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", out
