"""The rich tables of ``explain``'s results (the CLI prints them; ``str()`` renders them as text).
Imported only when a result is printed, so ``import hp_functional`` does not import rich."""

from __future__ import annotations

__all__ = ["human", "memory_table", "params_table", "schedule_table", "to_text", "totals_table"]

import io
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from ..compile.lint import layer_pattern

if TYPE_CHECKING:
    from ..core.program import Program
    from .record import ScheduleRow


def human(n: int) -> str:
    """Bytes as B/KiB/MiB/GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def to_text(renderable, width: int = 120) -> str:
    """A rich renderable as plain text."""
    buf = io.StringIO()
    Console(file=buf, width=width, no_color=True, highlight=False).print(renderable)
    return buf.getvalue()


def _label(module: str) -> str:
    return "(root)" if module == "" else module


def schedule_table(rows: Sequence[ScheduleRow]) -> Table:
    """One row per collective, in execution order (``Schedule.rows``)."""
    table = Table(title="communication schedule (one step)", title_justify="left")
    for col in ("#", "module", "pass", "collective", "axis", "bytes"):
        table.add_column(col, justify="right" if col in ("#", "bytes") else "left")
    for i, r in enumerate(rows):
        table.add_row(str(i), _label(r.module), r.direction, r.op, r.axis, human(r.bytes))
    return table


def totals_table(totals: Mapping[tuple[str, str, str], tuple[int, int]]) -> Table:
    """Count and bytes per (pass, collective, axis) (``Schedule.totals()``)."""
    table = Table(title="totals per step", title_justify="left")
    for col in ("pass", "collective", "axis", "count", "bytes"):
        table.add_column(col, justify="right" if col in ("count", "bytes") else "left")
    for (direction, op, axis), (n, b) in sorted(totals.items()):
        table.add_row(direction, op, axis, str(n), human(b))
    return table


def memory_table(rows: Sequence[tuple[str, int]], world: int) -> Table:
    """Per-rank memory: (label, bytes) rows (``Memory.rows()``: parameters, and with a measured step its
    gradients, optimizer state, activations and peak) of a mesh of ``world`` ranks."""
    table = Table(title=f"memory per rank ({world} ranks)", title_justify="left")
    table.add_column("")
    table.add_column("bytes", justify="right")
    for label, value in rows:
        table.add_row(label, human(value))
    return table


def _param_cells(info) -> tuple[str, ...]:
    return (str(tuple(info.global_shape)), *(str(p) for p in info.placements), str(tuple(info.local_shape)))


def collapsed_params(program: Program) -> list[tuple[str, int, tuple[str, ...]]]:
    """The per-parameter rows (global shape, placement per mesh axis, local shape), those that
    differ only in layer indices merged: [(pattern, count, cells)], in first-seen order.  Rows
    whose shapes or placements differ stay apart (a layer that is sharded differently shows)."""
    groups: dict[tuple[str, tuple[str, ...]], int] = {}
    for key, info in program.infos.items():
        name = key + (f" (= {', '.join(info.aliases)})" if info.aliases else "")
        k = (layer_pattern(name), _param_cells(info))
        groups[k] = groups.get(k, 0) + 1
    return [(pattern, n, cells) for (pattern, cells), n in groups.items()]


def params_table(program: Program, merge_layers: bool = False) -> Table:
    """Per parameter: global shape, placement on each mesh axis, local shape; ``merge_layers``:
    one row per layer pattern, with a count (``collapsed_params``)."""
    axes = list(program.mesh.mesh_dim_names)
    table = Table(title="parameters (layers merged)" if merge_layers else "parameters", title_justify="left")
    for col in ("parameter", *(("count",) if merge_layers else ()), "global shape", *axes, "local shape"):
        table.add_column(col, justify="right" if col == "count" else "left")
    if merge_layers:
        for pattern, n, cells in collapsed_params(program):
            table.add_row(pattern, str(n), *cells)
        return table
    for key, info in program.infos.items():
        aliases = f" (= {', '.join(info.aliases)})" if info.aliases else ""
        table.add_row(key + aliases, *_param_cells(info))
    return table
