"""Pass: place parameters — every parameter's storage placement on every mesh axis.

Decides, from the specs and the plan's special handlers: which FQNs are tied (one leaf under
the first FQN), each leaf's placements (tied parameters must agree), its local shape and
offset, and the blocks of packed parameters.  Raises ``ShapeError``/``PlanError`` naming the
parameter and the axis; communicates nothing.
"""

from __future__ import annotations

__all__ = ["Placed", "declared", "place_parameters"]

from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement

from ..core.errors import PlanError
from ..core.facets import SummedOver
from ..core.placement import (
    ShardInfo,
    fmt_placements,
    local_layout,
    mesh_placements,
    packed_layout,
    splits,
)
from ..core.style import ModuleSpec
from ..plan.plan import ShardingPlan


@dataclass(frozen=True)
class Owner:
    """Where a parameter FQN lives: the owning module's FQN and the attribute name."""

    module: str
    name: str


@dataclass(frozen=True)
class Placed:
    """The result of placing: per leaf its ``ShardInfo``; per FQN its leaf and its owner."""

    infos: dict[str, ShardInfo]
    leaf_of: dict[str, str]
    owners: dict[str, Owner]


@dataclass(frozen=True)
class _Choice:
    placements: tuple[Placement, ...]
    by: str  # the FQN whose module decided it (for the tied-conflict message)
    blocks: int | tuple[int, ...] | None
    summed: tuple[str, ...] = ()


def tied_leaves(model: nn.Module) -> tuple[dict[str, str], dict[str, Owner]]:
    """Every parameter FQN (tied aliases too) → its leaf key (the first FQN of its tensor), and
    → its owner."""
    first: dict[int, str] = {}
    leaf_of, owners = {}, {}
    for name, prm in model.named_parameters(remove_duplicate=False):
        leaf_of[name] = first.setdefault(id(prm), name)
        module, _, attr = name.rpartition(".")
        owners[name] = Owner(module, attr)
    return leaf_of, owners


def declared(name: str, owner: Owner, specs: Mapping[str, ModuleSpec]) -> tuple[ModuleSpec, str] | None:
    """The spec that declares parameter ``name`` and the name it uses: the owner's own spec, else
    the nearest planned ancestor naming it by its dotted path below it (a ``Local`` over a block
    declares ``"q_proj.weight"``).  None: no spec declares it (stored Replicate)."""
    module = owner.module
    while True:
        spec, rel = specs.get(module), name[len(module) + 1 :] if module else name
        if spec is not None and (rel in spec.params or rel in spec.param_dst):
            return spec, rel
        if not module:
            return None
        module = module.rpartition(".")[0]


def place_parameters(model: nn.Module, plan: ShardingPlan, mesh: DeviceMesh, specs: Mapping[str, ModuleSpec]) -> Placed:
    """Storage placements, local shapes and offsets of every leaf (see the module docstring)."""
    leaf_of, owners = tied_leaves(model)
    rules = plan.param_rules(model)
    chosen: dict[str, _Choice] = {}
    for name, leaf in leaf_of.items():
        found = declared(name, owners[name], specs)
        per_axis, blocks = (found[0].params.get(found[1], {}), found[0].param_blocks.get(found[1])) if found else ({}, None)
        summed = tuple(a for a in found[0].summed_axes if splits(per_axis.get(a))) if found else ()
        if name in rules:
            per_axis, blocks = {plan.axes[rules[name].axis_role]: rules[name].placement}, rules[name].blocks
        placements = mesh_placements(per_axis, mesh, f"parameter {name}")
        if leaf in chosen and chosen[leaf].placements != placements:
            raise PlanError(
                f"tied parameters {chosen[leaf].by} and {name} get conflicting placements "
                f"{fmt_placements(chosen[leaf].placements)} vs {fmt_placements(placements)}; give both modules the same layout"
            )
        chosen.setdefault(leaf, _Choice(placements, name, blocks, summed))
    aliases: dict[str, list[str]] = {}
    for name, leaf in leaf_of.items():
        if name != leaf:
            aliases.setdefault(leaf, []).append(name)
    infos = {}
    for leaf, choice in chosen.items():
        shape = model.get_parameter(leaf).shape
        local_shape, offset = local_layout(shape, choice.placements, mesh, f"parameter {leaf}")
        sizes = None
        if choice.blocks:
            sizes, offset = packed_layout(leaf, shape, choice.placements, local_shape, offset, choice.blocks,
                                          mesh.mesh_dim_names)
        infos[leaf] = ShardInfo(placements=choice.placements, mesh=mesh, global_shape=shape, local_shape=local_shape,
                                offset=offset, aliases=tuple(aliases.get(leaf, ())), blocks=sizes,
                                facets=(SummedOver(choice.summed),) if choice.summed else ())
    return Placed(infos, leaf_of, owners)
