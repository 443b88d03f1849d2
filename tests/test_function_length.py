"""No function in hp_functional is over 60 lines.

A function's length is counted from its ``def`` line to its last line (``end_lineno - lineno + 1``:
decorators left out, the docstring counted), for every ``def`` and ``async def``, methods and nested
functions included, in every module of the package (parsed with ``ast``, nothing imported).  A long
function is split into helpers that each do one thing; only a generated table may be exempted, by
qualified name, in ``EXEMPT`` (a table is data, not a function: expect it empty).
"""

from __future__ import annotations

import ast
import gc
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from tests.test_layers import PACKAGE, _modules, _tree

LIMIT = 60

#: ``path::qualname`` (path relative to hp_functional/) -> why it is a generated table, not a function
EXEMPT: dict[str, str] = {}


def _statements(node: ast.AST) -> Iterator[ast.stmt]:
    """The statements directly inside ``node``'s blocks (a ``def`` is a statement: no expression holds one)."""
    for field in ("body", "orelse", "finalbody"):
        yield from getattr(node, field, ())
    for block in (*getattr(node, "handlers", ()), *getattr(node, "cases", ())):  # try/except, match
        yield from block.body


def functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, int]]:
    """(qualified name, lines) of every function under ``tree``, as Python spells ``__qualname__``:
    ``Class.method``, ``outer.<locals>.inner``."""
    for node in _statements(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + node.name
            yield name, node.end_lineno - node.lineno + 1
            yield from functions(node, f"{name}.<locals>.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")
        else:  # the blocks of if/for/while/with/try/match, at any depth
            yield from functions(node, prefix)


def census(paths: Iterable[Path], root: Path) -> dict[str, int]:
    """``path::qualname`` (path relative to ``root``) -> lines, for every function of the modules ``paths``.
    The cyclic garbage collector is paused while the modules are parsed: the parse makes some 200,000 nodes,
    none of them garbage, and the collections it would set off over the test process' objects cost most of
    the time."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return {f"{path.relative_to(root).as_posix()}::{name}": n for path in sorted(paths)
                for name, n in functions(_tree(path))}
    finally:
        if enabled:
            gc.enable()


def too_long(counted: Mapping[str, int], limit: int = LIMIT) -> list[str]:
    """``path::qualname (N lines)`` for each function of ``counted`` over ``limit`` lines (``EXEMPT`` left out)."""
    return [f"{name} ({n} lines)" for name, n in counted.items() if n > limit and name not in EXEMPT]


def test_no_function_is_over_60_lines():
    counted = census(_modules().values(), PACKAGE)
    assert {"runtime/shard.py::shard", "runtime/shard.py::Runtime.build"} <= set(counted), "the count misses functions"
    long = too_long(counted)
    assert not long, (f"functions over {LIMIT} lines (def to last line, docstring included): split each into helpers "
                      "that do one thing each:\n" + "\n".join(long))
    stale = sorted(set(EXEMPT) - set(counted))
    assert not stale, f"EXEMPT names functions that no longer exist: {stale}"


def _function(name: str, lines: int, indent: str = "", kind: str = "def") -> str:
    """The source of a function of exactly ``lines`` lines: its ``def`` line, then statements."""
    return f"{indent}{kind} {name}():\n" + "".join(f"{indent}    x = {i}\n" for i in range(lines - 1))


def test_the_count_sees_every_kind_of_function(tmp_path):
    (tmp_path / "m.py").write_text(
        "import functools\n\n@functools.cache\n" + _function("at_limit", 60)  # the decorator is not counted
        + _function("over", 61, kind="async def")
        + "class C:\n" + _function("method", 61, "    ")
        + "def outer():\n" + _function("inner", 61, "    ") + "    return inner\n"
        + "if True:\n" + _function("hidden", 61, "    ")
        + "try:\n    pass\nexcept ImportError:\n" + _function("fallback", 61, "    ")
        + 'def documented():\n    """a docstring\n' + "    counts\n" * 58 + '    """\n')
    got = too_long(census([tmp_path / "m.py"], tmp_path))
    assert got == ["m.py::over (61 lines)", "m.py::C.method (61 lines)", "m.py::outer (63 lines)",
                   "m.py::outer.<locals>.inner (61 lines)", "m.py::hidden (61 lines)", "m.py::fallback (61 lines)",
                   "m.py::documented (61 lines)"], got
