"""Context parallelism as a plug-in (``core.parallelism``): the ``cp`` role, the ``cp_layout`` and
``cp_inputs`` settings, the ring and all-gather strategies, and the root entry that shards the batch
over the sequence and computes the loss."""

from __future__ import annotations

__all__ = ["PARALLELISM"]

from dataclasses import replace
from functools import partial
from types import MappingProxyType

from ...core.errors import PlanError
from ...core.parallelism import LossLabels, Parallelism, PlanView, Resolution
from ...core.program import Planned
from ...core.style import Style
from .cp_layout import check_layout
from .ring_attention import STRATEGIES
from .styles import ContextParallel, check_context_entries, check_context_shadowed, context_parallel_root


class ContextParallelism(Parallelism):
    """``ContextParallel`` entries on the ``cp`` role, and the root that cuts the sequence."""

    name = "context"
    role = "cp"
    settings = MappingProxyType({"cp_layout": "zigzag", "cp_inputs": None})
    strategies = MappingProxyType({s: partial(ContextParallel, s) for s in STRATEGIES})

    def check_entries(self, entries: dict[str, Style], plan: PlanView) -> dict[str, Style]:
        try:
            layout = check_layout(plan.settings["cp_layout"])
        except ValueError as exc:
            raise PlanError(str(exc)) from None
        return check_context_entries(entries, plan.axes.get("cp"), layout)

    def check_mesh(self, plan: PlanView, names: tuple[str, ...]) -> None:
        axis = plan.axes.get("cp")
        if axis is not None and axis not in names:
            raise PlanError(f"cp_axis={axis!r} is not in the mesh (axes: {list(names)})")

    def resolve(self, plan: PlanView, resolution: Resolution) -> Resolution:
        check_context_shadowed(resolution.candidates, resolution.chosen)
        axis = plan.axes.get("cp")
        if axis is None:
            return resolution
        inputs = plan.settings["cp_inputs"]
        root = context_parallel_root if inputs is None else inputs.root
        style = root(axis, plan.settings["cp_layout"], resolution.vocab_axis)  # it computes the loss too
        return replace(resolution, root=Planned("", None, style, axis, "(context_parallel)"))

    def loss_labels(self, plan: PlanView) -> LossLabels | None:
        """``cp_inputs`` (a ``ContextInputs``) on a plan with a ``cp`` axis: its root takes the declared labels."""
        return plan.settings.get("cp_inputs") if plan.axes.get("cp") is not None else None


PARALLELISM = ContextParallelism()
