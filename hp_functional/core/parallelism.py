"""The plug-in contract of a parallelism: what one hands the plan language (docs/adding-a-parallelism.md).

``ShardingPlan`` knows no parallelism by name.  It holds entries, the mesh axis of each role
(``{"tp": "tp", "cp": "cp"}``) and settings; each parallelism in its ``parallelisms`` tuple
(``hp_functional.parallel.PARALLELISMS`` by default: one explicit line per parallelism) brings:

* ``role``: the axis role its styles act on (a style's ``axis_role``), ``settings`` it owns with
  their defaults, and ``legacy``: the earlier ``ShardingPlan`` keywords it answers for (they keep
  working with a ``FutureWarning``);
* ``strategies``: the names a plan source may ask it for (``from_hf(cp_strategy="ring")``), each a
  factory of its style;
* ``check_entries``: its rules on the plan's entries when a plan is made (pure; may normalise them);
* ``check_mesh``: its rules on the mesh, first thing when the plan is resolved;
* ``resolve``: its word once every module has its entry — rewrite a chosen style, check what lost,
  add the root entry (a later parallelism in the tuple sees, and may take over, an earlier root).

Its styles (``core.style``), facets (``core.facets``) and run-time pieces (the styles' local forwards
and their collectives in ``core.collectives``) need no registration: the compiler reaches them
through the styles the plan resolves to.
"""

from __future__ import annotations

__all__ = ["Parallelism", "PlanView", "Resolution"]

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

from torch import nn

if TYPE_CHECKING:
    from .paths import Candidate
    from .program import Planned
    from .style import Style


class PlanView(Protocol):
    """What a parallelism reads of a plan (``ShardingPlan`` is one)."""

    entries: Mapping[str, Style]
    axes: Mapping[str, str]
    settings: Mapping[str, object]

    def axis_of(self, style: Style, names: tuple[str, ...] = ()) -> str | None: ...


@dataclass(frozen=True)
class Resolution:
    """One resolution in progress, handed from parallelism to parallelism (``Parallelism.resolve``).

    ``chosen``: module path → (pattern, style) that plans it; ``candidates``: every entry matching
    each path; ``root``: the entry added on the root module (module and path filled in by the plan);
    ``vocab_axis``: the mesh axis the output head's logits stay sharded over (loss parallel), for
    the root that computes the loss."""

    model: nn.Module
    names: tuple[str, ...]
    candidates: Mapping[str, list[Candidate]]
    chosen: Mapping[str, tuple[str, Style]]
    root: Planned | None = None
    vocab_axis: str | None = None


class Parallelism:
    """Base class of the plug-ins: every hook defaults to "nothing to add"."""

    name: str = ""
    role: str | None = None
    settings: Mapping[str, object] = MappingProxyType({})
    #: earlier ``ShardingPlan`` keyword → ("axes", role) | ("settings", name) | ("optional", role)
    legacy: Mapping[str, tuple[str, str]] = MappingProxyType({})
    strategies: Mapping[str, Callable[[], Style]] = MappingProxyType({})

    def check_entries(self, entries: dict[str, Style], plan: PlanView) -> dict[str, Style]:
        """The plan's entries after this parallelism's rules (a ``PlanError`` for a broken one)."""
        return entries

    def check_mesh(self, plan: PlanView, names: tuple[str, ...]) -> None:
        """A ``PlanError`` when the mesh (axes ``names``) cannot carry this parallelism's part of ``plan``."""

    def resolve(self, plan: PlanView, resolution: Resolution) -> Resolution:
        """``resolution`` with this parallelism's rewrites, checks and root entry."""
        return resolution

    def __repr__(self) -> str:
        return f"<parallelism {self.name}>"
