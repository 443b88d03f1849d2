"""Plan lint: findings about a resolved plan that ``shard()`` reports before placing anything.

Errors raise ``PlanError`` (on every rank, before any collective); warnings go through
``warnings.warn`` as ``PlanWarning``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .errors import PlanError, PlanWarning

if TYPE_CHECKING:
    from .plan import Planned, ShardingPlan


@dataclass(frozen=True)
class Finding:
    """One lint result: ``level`` error or warning, the module/parameter it names, and why."""

    level: Literal["error", "warning"]
    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.level}: {self.where}: {self.message}"


def lint(model: nn.Module, plan: ShardingPlan, mesh: DeviceMesh, planned: list[Planned]) -> list[Finding]:
    """Findings about ``plan`` resolved against ``model`` (``planned``); reads, never mutates."""
    return []


def enforce(findings: list[Finding]) -> None:
    """Raise the errors (all of them, in one PlanError); warn about the rest."""
    errors = [f for f in findings if f.level == "error"]
    if errors:
        raise PlanError("; ".join(str(f) for f in errors))
    for f in findings:
        warnings.warn(str(f), PlanWarning, stacklevel=3)
