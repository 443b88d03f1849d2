"""The data types of a compiled plan: what ``build_program`` decides and ``apply_fn`` runs.

They live in the plan layer, beside the styles and specs they hold, so that every pass, the
runtime and every tool can read them without importing the driver that builds them.
"""

from __future__ import annotations

__all__ = ["Boundary", "ParamBucket", "Planned", "Program"]

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .collectives import AxisGroup
from .lowering import Step
from .placement import ShardInfo

if TYPE_CHECKING:
    from .style import ModuleSpec, Style


@dataclass(frozen=True)
class Planned:
    """One module the plan touches: its path, the module, the style, the mesh axis and the
    plan pattern that chose it."""

    fqn: str
    module: nn.Module
    style: Style
    axis: str
    pattern: str


@dataclass
class Boundary:
    """One planned module after lowering: its spec, the steps on its inputs and outputs, and
    the axes on which its compute differs per rank."""

    planned: Planned
    spec: ModuleSpec
    in_steps: dict[object, list[Step]] = field(default_factory=dict)
    out_steps: dict[object, list[Step]] = field(default_factory=dict)
    varying: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class ParamBucket:
    """Leaves whose only conversions are ``copy_to`` on ``axes`` (replicated parameters consumed by
    rank-varying compute), applied together by ``core.buckets.copy_to_many``: ``buckets`` are
    lists of indices into ``keys``, one all-reduce per bucket and axis in the backward.  With
    ``gather``: leaves whose only conversion is one gather of dim 0 on ``axes[0]`` (``ShardedParams``),
    all of the same collective, one all-gather of a bucket's flat concatenation (``core.buckets.gather_many``)."""

    keys: tuple[str, ...]
    axes: tuple[str, ...]
    buckets: tuple[tuple[int, ...], ...]
    gather: bool = False


@dataclass
class Program:
    """Everything ``build_program`` decided: placements, boundaries and parameter conversions."""

    mesh: DeviceMesh
    boundaries: list[Boundary]
    infos: dict[str, ShardInfo]  # leaf key → ShardInfo
    leaf_of: dict[str, str]  # every parameter FQN (tied aliases too) → its leaf key in the params pytree
    param_steps: dict[str, list[Step]]  # leaf key → conversions applied before the forward
    groups: dict[str, AxisGroup]
    dtypes: dict[str, torch.dtype]  # leaf key → dtype (for the cross-rank fingerprint)
    # how apply_fn runs the copy_to-only conversions of param_steps: bucketed (param_steps still lists them all)
    param_buckets: tuple[ParamBucket, ...] = ()
    # why compile.dataflow could not trace the model (None when it did): shard()'s probe then traces a real copy
    dataflow_skipped: str | None = None
    # module path → the model's own code that recomputes its forward in the backward (Reformer's
    # reversible layers): apply_fn refuses to run with a gradient (runtime.apply_fn)
    recomputed: dict[str, str] = field(default_factory=dict)
