"""The package's layers import only downward, and nothing imports in a cycle.

Every ``import`` in ``hp_functional`` is parsed (module level and inside functions; the
``if TYPE_CHECKING:`` blocks count for the layers, not for cycles: they never run).  Layers, lowest
first (docs/architecture.md): core → analysis → parallel → sources → plan → compile → planner →
runtime → train → tools → cli; a module may import its own layer and the layers below, never
above, and never the package root (the root only re-exports).
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "hp_functional"
LAYERS = ("core", "analysis", "parallel", "sources", "plan", "compile", "planner", "runtime", "train", "tools", "cli")


def _modules() -> dict[str, Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = list(f.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _tree(path: Path) -> ast.Module:
    """``path`` parsed, once per content (the tests here parse every module several times)."""
    return _parse(path.read_text())


@functools.cache
def _parse(source: str) -> ast.Module:
    return ast.parse(source)


def _imports(name: str, path: Path, known: set[str], types: bool = False) -> set[str]:
    """The package modules ``name`` imports (resolved to the longest known module); ``types``:
    with the imports under ``if TYPE_CHECKING:`` (they never run, but name a layer all the same)."""
    tree = _tree(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    skip = set() if types else {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                                and "TYPE_CHECKING" in ast.unparse(node.test) for b in node.body for n in ast.walk(b)}
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


def _graph(types: bool = False) -> dict[str, set[str]]:
    mods = _modules()
    return {n: _imports(n, f, set(mods), types) for n, f in mods.items()}


def test_every_module_belongs_to_a_layer():
    strays = [m for m in _modules() if m != "hp_functional" and _layer(m) is None]
    assert not strays, f"modules outside the layers {LAYERS}: {strays}"


def test_each_layers_docstring_names_its_number():
    """Each layer package's docstring starts ``Layer N:`` with N its place in ``LAYERS`` (from 1), as the
    root's docstring and docs/architecture.md count them."""
    wrong = {}
    for i, name in enumerate(LAYERS, start=1):
        doc = ast.get_docstring(_tree(PACKAGE / name / "__init__.py")) or ""
        if not doc.startswith(f"Layer {i}:"):
            wrong[name] = (i, doc[:20])
    assert not wrong, f"layer docstrings that disagree with LAYERS (package: (its number, its docstring)): {wrong}"


def test_imports_go_only_downward():
    upward = []
    for module, deps in _graph(types=True).items():  # a type-only import names a layer too
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
    (pkg / "core" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..plan.b import g\n")
    assert _imports("hp_functional.core.a", mods["hp_functional.core.a"], set(mods)) == set()  # no cycle: never runs
    assert _imports("hp_functional.core.a", mods["hp_functional.core.a"], set(mods), types=True) == {"hp_functional.plan.b"}


#: the layers that reach a parallelism only through its contracts (``core.style``'s facts of a style,
#: ``core.parallelism``'s hooks), never by importing it: a new parallelism is a package plus one line
PLUGIN_BLIND = ("core", "analysis", "compile", "runtime")


def parallel_imports(graph: dict[str, set[str]]) -> list[str]:
    """``module imports dep`` for every import of ``hp_functional.parallel`` (the package or any
    module in it) by a module of the ``PLUGIN_BLIND`` layers in ``graph``."""
    return sorted(f"{m} imports {d}" for m, deps in graph.items()
                  if _layer(m) is not None and LAYERS[_layer(m)] in PLUGIN_BLIND
                  for d in deps if d == "hp_functional.parallel" or d.startswith("hp_functional.parallel."))


def test_compile_runtime_analysis_and_core_import_no_parallelism():
    """What these layers need of a parallelism they ask its styles (``Style.own_forward``,
    ``splits_sequence``, ``sequence_split``, ``local_buffer_shapes``) or its plug-in
    (``Parallelism.sharded_outputs``, ``lint``, ``loss_labels``): no import of ``parallel``, at
    module level, inside a function or under ``TYPE_CHECKING`` (docs/adding-a-parallelism.md)."""
    found = parallel_imports(_graph(types=True))
    assert not found, ("a layer below the plug-ins' users imports a parallelism (ask a style's fact or a "
                       "Parallelism hook, core/style.py, core/parallelism.py):\n" + "\n".join(found))


def test_the_parallel_import_check_sees_every_spelling(tmp_path):
    pkg = tmp_path / "hp_functional"
    for folder in ("core", "runtime", "parallel", "parallel/tensor", "plan"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "parallel" / "tensor" / "styles.py").write_text("class Colwise: ...\n")
    sources = {
        "runtime/a.py": "def f():\n    from ..parallel.tensor.styles import Colwise\n",
        "runtime/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..parallel import PARALLELISMS\n",
        "core/c.py": "import hp_functional.parallel.tensor.styles\n",
        "core/d.py": "from hp_functional.parallel.tensor import styles\n",
        "plan/e.py": "from ..parallel.tensor.styles import Colwise\n",  # the plan layer may
    }
    for rel, source in sources.items():
        (pkg / rel).write_text(source)
    mods = {"hp_functional.parallel": pkg / "parallel" / "__init__.py",
            "hp_functional.parallel.tensor": pkg / "parallel" / "tensor" / "__init__.py",
            "hp_functional.parallel.tensor.styles": pkg / "parallel" / "tensor" / "styles.py",
            **{"hp_functional." + rel[:-3].replace("/", "."): pkg / rel for rel in sources}}
    graph = {n: _imports(n, f, set(mods), types=True) for n, f in mods.items()}
    found = parallel_imports(graph)
    assert {line.split(" imports ")[0] for line in found} == {
        "hp_functional.core.c", "hp_functional.core.d", "hp_functional.runtime.a", "hp_functional.runtime.b"}, found
    assert "hp_functional.runtime.b imports hp_functional.parallel" in found, found


@pytest.mark.slow
def test_import_does_not_load_rich_or_tqdm():
    """``import hp_functional`` adds neither rich (CLI tables) nor tqdm (the demo) to what
    ``import torch`` loads (torch.hub imports tqdm by itself when it is installed)."""
    code = ("import sys, torch; before = set(sys.modules); import hp_functional; "
            "new = set(sys.modules) - before; "
            "print(sorted(m for m in new if m.split('.')[0] in ('rich', 'tqdm')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", out


# torch.distributed's communication functions (process-group setup and queries are not communication)
COMMUNICATION = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object", "all_to_all",
    "all_to_all_single", "broadcast", "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "gather", "gather_object", "scatter", "scatter_object_list", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "barrier", "monitored_barrier", "new_group", "new_subgroups", "send_object_list",
    "recv_object_list",
}


def communication_calls(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """``file:line call`` for every call of torch.distributed communication (``dist.<fn>``,
    ``torch.distributed.<fn>``) or of a ``_c10d_functional`` op (``_funcol.<op>``) in ``path``."""
    found = []
    for node in ast.walk(_tree(path)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner, name = ast.unparse(node.func.value), node.func.attr
        if (owner in ("dist", "torch.distributed") and name in COMMUNICATION) or "_c10d_functional" in owner \
                or owner == "_funcol":
            found.append(f"{path.relative_to(root)}:{node.lineno} {owner}.{name}")
    return found


def test_communication_lives_in_core():
    """Every collective, point-to-point transfer and process group is issued in ``core/``
    (``core.collectives``, ``core.raw_collectives``, ``core.host_comm``), where timeouts, backends
    and errors are decided once; the rest of the package calls those."""
    outside = [c for name, path in _modules().items() if _layer(name) != 0 for c in communication_calls(path)]
    assert not outside, "communication outside core/ (call core.host_comm or core.raw_collectives):\n" + "\n".join(outside)


def test_the_communication_check_sees_direct_calls(tmp_path):
    code = ("import torch.distributed as dist\nimport torch\n_funcol = torch.ops._c10d_functional\n"
            "def f(x, g):\n    dist.all_reduce(x)\n    torch.distributed.send(x, 1)\n    _funcol.all_reduce(x, 'sum', g)\n"
            "    torch.ops._c10d_functional.wait_tensor(x)\n    dist.get_rank()\n")
    (tmp_path / "m.py").write_text(code)
    calls = communication_calls(tmp_path / "m.py", tmp_path)
    assert [c.split(" ")[1] for c in calls] == ["dist.all_reduce", "torch.distributed.send", "_funcol.all_reduce",
                                                "torch.ops._c10d_functional.wait_tensor"]


STORED = {"GroupedShard", "StackedShard", "RowSplit", "STORED_ONLY"}


def stored_type_switches(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """``file:line`` of every ``isinstance(x, ...)`` naming a stored-only placement in ``path``."""
    tree = _tree(path)
    return [f"{path.relative_to(root)}:{n.lineno}" for n in ast.walk(tree)
            if isinstance(n, ast.Call) and ast.unparse(n.func) == "isinstance" and len(n.args) == 2
            and STORED & {x.id if isinstance(x, ast.Name) else getattr(x, "attr", "") for x in ast.walk(n.args[1])}]


def test_stored_placements_are_switched_on_only_in_their_module():
    """The rest of the package asks ``core.placement``'s questions (``splits``, ``owns``,
    ``replica_group``, ``is_grouped``, ``is_placement``, ``boxes``) instead of testing the type of a
    stored placement, so a new one is added in one module."""
    home = PACKAGE / "core" / "placement.py"
    outside = [hit for path in _modules().values() if path != home for hit in stored_type_switches(path)]
    assert not outside, "isinstance on a stored placement outside core/placement.py:\n" + "\n".join(outside)


def test_the_type_switch_check_sees_them(tmp_path):
    (tmp_path / "m.py").write_text("def f(p):\n    return isinstance(p, (Shard, GroupedShard)) or isinstance(p, pl.RowSplit)"
                                   " or isinstance(p, Shard)\n")
    assert stored_type_switches(tmp_path / "m.py", tmp_path) == ["m.py:2", "m.py:2"]


# ---------------------------------------------------------------- each module's interface: __all__
ENTRY_POINTS = {"hp_functional.cli.main": {"main"}}  # pyproject's console script


def imported_names(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Per package module, the names the package's other modules take from it: ``from m import
    name``, ``alias.name`` after ``from pkg import m as alias`` / ``import m as alias``, and the root's
    lazy exports (``_LAZY``); submodules are not names."""
    known = set(modules)
    used: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        tree = _tree(path)
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        aliases: dict[str, str] = {}
        attributes = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                attributes.append(node)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in known and a.asname:
                        aliases[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
                full = ".".join(x for x in (base, node.module or "") if x)
                for a in node.names:
                    if f"{full}.{a.name}" in known:
                        aliases[a.asname or a.name] = f"{full}.{a.name}"
                    elif full in known and full != name:
                        used[full].add(a.name)
            elif isinstance(node, ast.Assign) and name == "hp_functional" and ast.unparse(node.targets[0]) == "_LAZY":
                for key, value in zip(node.value.keys, node.value.values, strict=True):
                    used["hp_functional" + value.value].add(key.value)
        for node in attributes:
            if node.value.id in aliases:
                target = aliases[node.value.id]
                if target != name and f"{target}.{node.attr}" not in known:
                    used[target].add(node.attr)
    for module, names in ENTRY_POINTS.items():
        if module in used:
            used[module] |= names
    return used


def declared_all(path: Path) -> list[str] | None:
    """The module's literal ``__all__``, or None."""
    for node in _tree(path).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if ast.unparse(target) == "__all__":
                return list(ast.literal_eval(node.value))
    return None


#: the public submodules (``hpf.collectives``, ``hpf.optim``): their ``__all__`` is their public API, a superset
PUBLIC_MODULES = {"hp_functional.core.collectives", "hp_functional.train.optim"}


def public_definitions(path: Path) -> set[str]:
    """The names a module defines at top level (not imports) without a leading underscore."""
    out = set()
    for node in _tree(path).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return {n for n in out if not n.startswith("_")}


def reexports(path: Path) -> set[str]:
    """The names a module imports from the package's own modules (``from .x import y``): a public
    submodule may list them as its API (``hpf.optim`` re-exports its schedules and masks)."""
    return {a.asname or a.name for node in _tree(path).body if isinstance(node, ast.ImportFrom) and node.level
            for a in node.names}


def test_every_module_declares_its_interface():
    """Each module's ``__all__`` is exactly what the package's other modules import from it (and
    the root re-exports): a name outside it is the module's own, whatever its spelling.  Importing
    a new name across modules means adding it here; a name nobody imports any more leaves.  A
    public submodule's ``__all__`` is its public API: what is imported from it and what it defines."""
    modules = {m: p for m, p in _modules().items() if m != "hp_functional"}
    used = imported_names(_modules())
    for module in PUBLIC_MODULES:
        used[module] |= public_definitions(modules[module])
    wrong = {}
    for module, path in sorted(modules.items()):
        declared = declared_all(path)
        if module in PUBLIC_MODULES and declared is not None:  # re-exported API may be listed, never required
            used[module] |= set(declared) & reexports(path)
        if declared is None or set(declared) != used[module] or declared != sorted(declared):
            wrong[module] = {"missing": sorted(used[module] - set(declared or ())),
                             "not imported elsewhere": sorted(set(declared or ()) - used[module]),
                             **({"declared": "none"} if declared is None else {}),
                             **({"order": "not sorted"} if declared and declared != sorted(declared) else {})}
    assert not wrong, "modules whose __all__ is not what the package imports from them:\n" + "\n".join(
        f"{m}: {w}" for m, w in wrong.items())


def test_the_interface_check_sees_attribute_and_lazy_imports(tmp_path):
    pkg = tmp_path / "hp_functional"
    (pkg / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text('_LAZY = {"f": ".core.a"}\n')
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("def f(): ...\ndef g(): ...\ndef h(): ...\n")
    (pkg / "core" / "b.py").write_text("from . import a as A\nfrom .a import g\n\ndef k():\n    return A.h\n")
    mods = {"hp_functional": pkg / "__init__.py", "hp_functional.core": pkg / "core" / "__init__.py",
            "hp_functional.core.a": pkg / "core" / "a.py", "hp_functional.core.b": pkg / "core" / "b.py"}
    assert imported_names(mods)["hp_functional.core.a"] == {"f", "g", "h"}
