"""The plug-in contract of a parallelism: what one hands the plan language (docs/adding-a-parallelism.md).

``ShardingPlan`` knows no parallelism by name.  It holds entries, the mesh axis of each role
(``{"tp": "tp", "cp": "cp"}``) and settings; each parallelism in its ``parallelisms`` tuple
(``hp_functional.parallel.PARALLELISMS`` by default: one explicit line per parallelism) brings:

* ``role``: the axis role its styles act on (a style's ``axis_role``), ``settings`` it owns with
  their defaults;
* ``strategies``: the names a plan source may ask it for (``from_hf(cp_strategy="ring")``), each a
  factory of its style;
* ``check_entries``: its rules on the plan's entries when a plan is made (pure; may normalise them);
* ``check_mesh``: its rules on the mesh, first thing when the plan is resolved;
* ``resolve``: its word once every module has its entry — rewrite a chosen style, check what lost,
  add the root entry (a later parallelism in the tuple sees, and may take over, an earlier root);
* ``sharded_outputs``: the modules whose output it keeps sharded on purpose (loss parallel's output
  head), which lint does not flag;
* ``lint``: its own lint checks over the specs the compiler built (``Finding``s: sequence
  parallelism's entries need another that splits or gathers their sequence);
* ``loss_labels``: where its root computes the loss from labels the model's forward does not take
  (context parallelism's ``cp_inputs``), their keyword and the unsharded output's loss, which the
  shard-time probe compares with ``apply_fn``'s.

The compiler, the runtime and their analyses ask a parallelism these hooks and its styles their facts
(``core.style``); they never import a parallelism nor test a style's type (``tests/test_layers.py``).

Its styles (``core.style``), facets (``core.facets``) and run-time pieces (the styles' local forwards
and their collectives in ``core.collectives``) need no registration: the compiler reaches them
through the styles the plan resolves to.
"""

from __future__ import annotations

__all__ = ["LossLabels", "Parallelism", "PlanView", "Resolution"]

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

from torch import Tensor, nn

if TYPE_CHECKING:
    from .findings import Finding
    from .paths import Candidate
    from .program import Planned
    from .style import ModuleSpec, Style


class PlanView(Protocol):
    """What a parallelism reads of a plan (``ShardingPlan`` is one)."""

    entries: Mapping[str, Style]
    axes: Mapping[str, str]
    settings: Mapping[str, object]

    def axis_of(self, style: Style, names: tuple[str, ...] = ()) -> str | None: ...


class LossLabels(Protocol):
    """Labels a root entry computes the loss from, which the model's forward does not take
    (``parallel.context.inputs.ContextInputs``): ``apply_fn`` takes them as keyword ``labels`` and
    returns ``(output, loss)``; ``reference_loss`` is that loss from the unsharded model's output."""

    labels: str

    def reference_loss(self, output: object, labels: Tensor) -> Tensor: ...


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
    strategies: Mapping[str, Callable[[], Style]] = MappingProxyType({})

    def check_entries(self, entries: dict[str, Style], plan: PlanView) -> dict[str, Style]:
        """The plan's entries after this parallelism's rules (a ``PlanError`` for a broken one)."""
        return entries

    def check_mesh(self, plan: PlanView, names: tuple[str, ...]) -> None:
        """A ``PlanError`` when the mesh (axes ``names``) cannot carry this parallelism's part of ``plan``."""

    def resolve(self, plan: PlanView, resolution: Resolution) -> Resolution:
        """``resolution`` with this parallelism's rewrites, checks and root entry."""
        return resolution

    def sharded_outputs(self, plan: PlanView, model: nn.Module) -> tuple[str, ...]:
        """The modules of ``model`` whose output ``plan`` keeps sharded on purpose (lint does not flag them)."""
        return ()

    def lint(self, plan: PlanView, planned: Mapping[str, Planned], specs: Mapping[str, ModuleSpec]) -> list[Finding]:
        """Its own findings about ``planned`` (module path → ``Planned``) and the ``specs`` built for them."""
        return []

    def loss_labels(self, plan: PlanView) -> LossLabels | None:
        """The labels its root entry in ``plan`` computes the loss from, where the model's forward does not
        take them; None: ``apply_fn`` returns what the model returns."""
        return None

    def __repr__(self) -> str:
        return f"<parallelism {self.name}>"
