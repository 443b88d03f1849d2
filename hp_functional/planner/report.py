"""``auto_plan``'s result: overrides merged into the generated entries, the entries written as
layer patterns, and the coverage report (every parameter planned or in the replicated list)."""

from __future__ import annotations

__all__ = ["AutoPlan", "collapse", "coverage", "merge_overrides"]

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import Replicate, Shard

from ..core.errors import PlanError
from ..core.paths import path_matches
from ..core.style import Style
from ..plan.plan import ShardingPlan, _as_style

_INDEX = re.compile(r"(?:(?<=\.)|^)\d+(?=\.|$)")


def merge_overrides(entries: dict[str, Style], roles: dict[str, str], overrides: Mapping[str, object] | None,
                    model: nn.Module) -> None:
    """Apply ``overrides`` (exact module paths or ``*`` patterns) to the per-module ``entries`` in
    place: a style (object, HF string, torch ``ParallelStyle``) wins over the generated one, ``None``
    clears it; modules no override names keep theirs.  A key that matches no module is a PlanError
    naming the closest paths."""
    paths = [p for p, _ in model.named_modules()]
    for key, value in (overrides or {}).items():
        hits = [p for p in paths if path_matches(key, p)]
        if not hits:
            close = difflib.get_close_matches(key, [p for p in paths if p], n=3, cutoff=0.5)
            raise PlanError(f"auto_plan: override {key!r} matches no module; closest paths: {close}")
        style = None if value is None else _as_style(value, f"override {key!r}")
        for p in hits:
            if style is None:
                entries.pop(p, None)
                roles[p] = "cleared by override"
            else:
                entries[p] = style
                roles[p] = "override"


def collapse(entries: Mapping[str, object], paths: list[str]) -> dict[str, object]:
    """``entries`` keyed by module path, rewritten with ``*`` for layer indices where every module
    such a pattern matches holds the same value (``model.layers.*.mlp.up_proj``)."""
    groups: dict[str, list[str]] = {}
    for path in entries:
        groups.setdefault(_INDEX.sub("*", path), []).append(path)
    out: dict[str, object] = {}
    for pattern, members in groups.items():
        first = entries[members[0]]
        matching = {p for p in paths if path_matches(pattern, p)}
        if matching == set(members) and all(entries[m] == first for m in members):
            out[pattern] = first
        else:
            out.update({m: entries[m] for m in members})
    return out


@dataclass(frozen=True)
class CoverageRow:
    """One parameter: the module that owns it, its role (the rule that decided it) and its
    placement on the tensor-parallel axis."""

    param: str
    module: str
    role: str
    placement: str
    sharded: bool


@dataclass(frozen=True)
class Coverage:
    """Every parameter of the model (tied names included), each either planned (sharded on the
    axis) or in the replicated list with the reason."""

    rows: tuple[CoverageRow, ...]

    @property
    def planned(self) -> dict[str, str]:
        """Sharded parameters: FQN → placement."""
        return {r.param: r.placement for r in self.rows if r.sharded}

    @property
    def replicated(self) -> dict[str, str]:
        """Replicated parameters: FQN → why (norm, rowwise bias, auxiliary embedding, ...)."""
        return {r.param: r.role for r in self.rows if not r.sharded}

    def __str__(self) -> str:
        width = max((len(r.param) for r in self.rows), default=5)
        lines = [f"{'parameter':<{width}}  {'placement':<22}  role"]
        lines += [f"{r.param:<{width}}  {r.placement:<22}  {r.role}" for r in self.rows]
        n = len(self.planned)
        lines.append(f"{n} planned, {len(self.rows) - n} replicated, {len(self.rows)} parameters")
        return "\n".join(lines)


def coverage(model: nn.Module, entries: Mapping[str, Style], roles: Mapping[str, str], special: Mapping[str, str],
             param_roles: Mapping[str, str], axis: str) -> Coverage:
    """The coverage rows of ``entries`` (per module path) and ``special`` (parameter FQN → handler)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    rows = []
    for fqn, _ in model.named_parameters(remove_duplicate=False):
        owner, _, name = fqn.rpartition(".")
        placement, role = Replicate(), param_roles.get(fqn) or _role(roles, owner)
        blocks = None
        if owner in entries:
            spec = entries[owner].spec(modules[owner], owner, axis)
            placement = spec.params.get(name, {}).get(axis, Replicate())
            blocks = spec.param_blocks.get(name)
            if name == "bias" and placement == Replicate() and role == "rowwise":
                role = "rowwise bias (replicated, added once)"
        if fqn in special:
            last = special[fqn] == "shard_last"
            placement = Shard(1 if last else 0)
            role = param_roles.get(fqn) or f"per-head parameter ({special[fqn]})"
        text = str(placement) if blocks is None else f"{placement} packed {blocks}"
        rows.append(CoverageRow(fqn, owner, role, text, isinstance(placement, Shard)))
    return Coverage(tuple(rows))


def _role(roles: Mapping[str, str], path: str) -> str:
    """The role of ``path`` or of its nearest ancestor with one (a MoE block's router)."""
    while path not in roles and path:
        path = path.rpartition(".")[0]
    return roles.get(path, "unplanned")


@dataclass(frozen=True, eq=False, init=False)
class AutoPlan(ShardingPlan):
    """The ``ShardingPlan`` ``auto_plan`` returns: a plan like any other, plus ``coverage`` (every
    parameter, planned or replicated, and why), ``notes`` (decisions worth reading: gathered
    blocks, uncovered modules) and ``example_inputs`` (the batch it was given, which ``shard()``
    traces and probes when it is given none)."""

    coverage: Coverage
    notes: tuple[str, ...] = ()
    example_inputs: object = None

    def __init__(self, entries: Mapping[str, Style], axes: Mapping[str, str] | None = None, *, coverage: Coverage,
                 notes: tuple[str, ...] = (), example_inputs: object = None, **rest: object) -> None:
        super().__init__(entries, axes, **rest)
        object.__setattr__(self, "coverage", coverage)
        object.__setattr__(self, "notes", tuple(notes))
        object.__setattr__(self, "example_inputs", example_inputs)

    def explain(self) -> str:
        """The plan's entries, the notes and the coverage table, as text."""
        lines = ["auto_plan entries:"]
        lines += [f"  {p or '<root>'}: {s}" for p, s in self.entries.items()]
        lines += [f"  special handler {p}: {h}" for p, h in self.special_handlers.items()]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join([*lines, "", str(self.coverage)])
