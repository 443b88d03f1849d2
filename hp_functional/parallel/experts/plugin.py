"""Expert parallelism as a plug-in (``core.parallelism``): ``Experts`` entries on the ``ep`` role."""

from __future__ import annotations

__all__ = ["PARALLELISM"]

from ...core.errors import PlanError
from ...core.parallelism import Parallelism, PlanView
from ...core.style import Style
from .styles import check_experts_entries


class ExpertParallelism(Parallelism):
    """Routed experts split over the ``ep`` role's axis."""

    name = "experts"
    role = "ep"

    def check_entries(self, entries: dict[str, Style], plan: PlanView) -> dict[str, Style]:
        check_experts_entries(entries, plan.axes.get("ep"))
        return entries

    def check_mesh(self, plan: PlanView, names: tuple[str, ...]) -> None:
        axis = plan.axes.get("ep")
        if axis is not None and axis not in names:
            raise PlanError(f"ep_axis={axis!r} is not in the mesh (axes: {list(names)})")


PARALLELISM = ExpertParallelism()
