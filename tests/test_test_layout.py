"""The tests mirror the package, and every module of it is tested.

* Every test file lies in the folder of the layer it tests (``tests/<layer>/``), in
  ``tests/models`` (whole models), or is one of the package-wide files at the top; ``tests/support``
  holds no tests.
* Every module of ``hp_functional`` is imported by name by at least one test module (parsed with
  ``ast``: ``import hp_functional.x.y``, ``from hp_functional.x import y``, ``from hp_functional.x.y
  import name``, or a public name of the root — ``hpf.shard`` — that ``_LAZY`` says the module
  defines), or is listed in ``THROUGH`` with the test file that covers it through its caller, or
  is a genuine exception (``EXCEPTIONS``).  A new module therefore comes with a test that imports it.
* No test name or docstring cites an issue number: it says what it checks.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import hp_functional as hpf
from tests.test_layers import LAYERS, _modules

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

#: test files at the top of tests/: they concern the whole package
TOP = {"test_layers.py", "test_test_layout.py", "test_no_hidden_state.py", "test_docs.py", "test_examples.py", "test_gpu.py",
       "test_fast_invariants.py", "test_mutation_list.py", "test_function_length.py"}
FOLDERS = {*LAYERS, "models"}

#: modules no test imports by name on purpose, and why
EXCEPTIONS = {
    "hp_functional.cli.__main__": "`python -m hp_functional.cli` only calls cli.main.main (tests/cli/test_cli.py runs it)",
}

#: modules tested through the module that calls them: module -> the test file that covers them
THROUGH = {
    "hp_functional.cli.demo": "tests/cli/test_cli.py",  # `hp-functional demo`
    "hp_functional.compile.kv_heads": "tests/compile/test_kv_heads.py",
    "hp_functional.compile.lint_heads": "tests/compile/test_lint_heads.py",
    "hp_functional.compile.lower": "tests/tools/test_explain.py",  # the lowered steps' communication, counted
    "hp_functional.core.checksum": "tests/runtime/test_reliability.py",
    "hp_functional.core.signature": "tests/runtime/test_run_agreement.py",
    "hp_functional.parallel.context.plugin": "tests/parallel/test_context_parallel_hf.py",
    "hp_functional.parallel.experts.plugin": "tests/parallel/test_experts.py",
    "hp_functional.parallel.tensor.plugin": "tests/parallel/test_mlp.py",
    "hp_functional.parallel.ulysses.plugin": "tests/parallel/test_ulysses.py",
    "hp_functional.planner.blocks": "tests/planner/test_auto_plan.py",
    "hp_functional.planner.heads": "tests/planner/test_auto_plan.py",
    "hp_functional.planner.report": "tests/planner/test_auto_plan.py",
    "hp_functional.planner.sp": "tests/planner/test_auto_plan.py",
    "hp_functional.runtime.initial_values": "tests/runtime/test_weights.py",
    "hp_functional.runtime.loss": "tests/parallel/test_loss_parallel.py",
    "hp_functional.runtime.rng_ops": "tests/runtime/test_rng.py",
    "hp_functional.runtime.weight_sums": "tests/train/test_checkpoint_security.py",
    "hp_functional.sources.torch_moe_styles": "tests/models/test_torchtitan.py",
    "hp_functional.sources.torch_styles": "tests/sources/test_torch_styles.py",
    "hp_functional.sources.torchtitan": "tests/models/test_torchtitan3.py",
    "hp_functional.tools.record": "tests/tools/test_explain.py",
    "hp_functional.train.ckpt_extra": "tests/train/test_dcp.py",
    "hp_functional.train.ckpt_files": "tests/train/test_checkpoint_security.py",
    "hp_functional.train.ckpt_integrity": "tests/train/test_checkpoint_security.py",
    "hp_functional.train.dcp_planners": "tests/train/test_dcp.py",  # save/load at other layouts
    "hp_functional.train.fsdp_bucket": "tests/train/test_fsdp.py",
    "hp_functional.train.optim_schedules": "tests/train/test_optim.py",  # through hpf.optim's re-exports
    "hp_functional.train.fsdp_forwards": "tests/train/test_fsdp.py",
    "hp_functional.train.pipeline_trace": "tests/train/test_pipeline_root_ops.py",
}


def _lazy() -> dict[str, str]:
    """The root's public name -> the module defining it (``hp_functional/__init__.py``'s export table)."""
    known = set(_modules())
    found = {}
    for name, (module, attribute) in hpf._EXPORTS.items():
        module = "hp_functional" + module
        found[name] = f"{module}.{attribute}" if f"{module}.{attribute}" in known else module
    return found


def imported_modules(path: Path, known: set[str], lazy: dict[str, str]) -> set[str]:
    """The package modules test module ``path`` imports by name (see the module docstring)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "hp_functional":
            if node.module in known:
                found.add(node.module)
            for a in node.names:
                if f"{node.module}.{a.name}" in known:
                    found.add(f"{node.module}.{a.name}")
                elif node.module == "hp_functional" and a.name in lazy:
                    found.add(lazy[a.name])
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "hpf" \
                and node.attr in lazy:
            found.add(lazy[node.attr])
    return found - {"hp_functional"}


def _test_files() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def test_every_module_is_imported_by_a_test():
    known, lazy = set(_modules()), _lazy()
    covered = set().union(*(imported_modules(p, known, lazy) for p in TESTS.rglob("*.py")))
    packages = {m for m, f in _modules().items() if f.name == "__init__.py"}  # re-exports only
    untested = sorted(known - covered - packages - set(EXCEPTIONS) - set(THROUGH))
    assert not untested, "modules no test imports by name (write a test in tests/<layer>/ that does):\n" + "\n".join(untested)
    stale = sorted(m for m in {*THROUGH, *EXCEPTIONS} if m not in known)
    assert not stale, f"THROUGH/EXCEPTIONS name modules that no longer exist: {stale}"
    missing = sorted(f"{m}: {t}" for m, t in THROUGH.items() if not (ROOT / t).exists())
    assert not missing, "THROUGH names test files that do not exist:\n" + "\n".join(missing)
    direct = sorted(m for m in THROUGH if m in covered)
    assert not direct, f"imported by a test now: remove them from THROUGH: {direct}"


def test_the_import_check_sees_every_spelling(tmp_path):
    known = {"hp_functional", "hp_functional.core.a", "hp_functional.core.b", "hp_functional.core.c",
             "hp_functional.core.d", "hp_functional.core.e"}
    (tmp_path / "t.py").write_text(
        "import hp_functional as hpf\nimport hp_functional.core.a\nfrom hp_functional.core import b\n"
        "from hp_functional.core.c import name\nfrom hp_functional import thing\n\ndef f():\n    return hpf.other\n")
    got = imported_modules(tmp_path / "t.py", known, {"thing": "hp_functional.core.d", "other": "hp_functional.core.e"})
    assert got == known - {"hp_functional"}


def test_tests_lie_in_the_folder_of_what_they_test():
    stray = []
    for p in _test_files():
        rel = p.relative_to(TESTS)
        if len(rel.parts) == 1 and rel.name not in TOP:
            stray.append(f"{rel}: a module's tests go to tests/<layer>/, a whole model's to tests/models/")
        elif len(rel.parts) > 1 and rel.parts[0] not in FOLDERS:
            stray.append(f"{rel}: {rel.parts[0]} is neither a layer {LAYERS} nor models")
    assert not stray, "\n".join(stray)
    for folder in {p.parent for p in TESTS.rglob("*.py")} - {TESTS}:
        assert (folder / "__init__.py").exists(), f"{folder}: the tests import each other as packages"


CITATION = re.compile(r"\b(issue|task|finding)s?\s*#?\d+|(?<![\w/])#\d+", re.IGNORECASE)


def test_no_test_name_or_docstring_cites_an_issue():
    cited = []
    for p in TESTS.rglob("*.py"):
        tree = ast.parse(p.read_text())
        for node in [tree, *ast.walk(tree)]:
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                text = f"{getattr(node, 'name', '')} {ast.get_docstring(node) or ''}"
                if CITATION.search(text.replace("_", " ")):
                    cited.append(f"{p.relative_to(ROOT)}:{getattr(node, 'lineno', 1)} {getattr(node, 'name', '(module)')}")
    assert not cited, "say what is checked, not which issue asked for it:\n" + "\n".join(cited)
    assert CITATION.search("fixes issue 30") and CITATION.search("see #12") and not CITATION.search("pytorch/pytorch#1")
