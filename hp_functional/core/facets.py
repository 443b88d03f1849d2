"""What one parallelism records of a parameter beyond its placements: the ``Facet`` types of
``ShardInfo.facets`` (FSDP's ``RowSplit``, EP's ``SummedOver``, the backward's ``ReducedOver``).
A new parallelism adds a facet type here, not a field to ``ShardInfo``
(docs/plan-language.md#what-shard-returns)."""

from __future__ import annotations

__all__ = ["AxesFacet", "F", "Facet", "ReducedOver", "RowSplit", "SummedOver", "flat_index"]

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from torch.distributed.device_mesh import DeviceMesh


class Facet:
    """What one parallelism records about a leaf beyond its placements and shapes: a frozen
    dataclass subclass, at most one of each type in ``ShardInfo.facets``.  A new parallelism
    adds a facet type of its own instead of a field of ``ShardInfo``."""


F = TypeVar("F", bound=Facet)


class Layout(Protocol):
    """What a facet reads of the layout it refines: a ``core.placement.ShardInfo`` (named
    structurally, since ``core.placement`` imports this module)."""

    local_shape: Sequence[int]


@dataclass(frozen=True)
class AxesFacet(Facet):
    """A facet that names mesh axes."""

    axes: tuple[str, ...]


@dataclass(frozen=True)
class SummedOver(AxesFacet):
    """Expert parallelism: sharded axes whose ranks each feed their own data through this leaf
    (experts when ``ep`` shares ranks with ``dp``), so its gradient arrives already summed over
    them; ``reduce_gradients`` skips them."""


@dataclass(frozen=True)
class ReducedOver(AxesFacet):
    """Replicated axes over which ``apply_fn``'s backward already sums this leaf's gradient (it
    is consumed by rank-varying compute there: TP regions, context parallelism);
    ``reduce_gradients`` over one of them is refused."""


@dataclass(frozen=True)
class RowSplit(Facet):
    """Dim 0 of a layout's local shard chunked further over one mesh axis, or over several
    flattened into one (``hpf.fsdp``), with ``torch.chunk``'s sizes: ``ceil(rows / n)`` rows per
    rank, the last ranks fewer or none.  ``inner`` is the layout before the split (its local
    shard holds ``rows`` rows)."""

    axis: str | tuple[str, ...]
    inner: Layout  # a ShardInfo

    def place(self, mesh: DeviceMesh) -> tuple[int, int]:
        """(ranks of ``mesh`` the rows are chunked over, this rank's index among them): ``flat_index``."""
        return flat_index(mesh, self.axis)

    @property
    def rows(self) -> int:
        return self.inner.local_shape[0]

    def chunk(self, size: int) -> int:
        """Rows per rank before the last ones (the padded size every rank gathers)."""
        return -(-self.rows // size)

    def span(self, size: int, index: int) -> tuple[int, int]:
        """(first row, row count) of rank ``index`` of ``size``."""
        c = self.chunk(size)
        start = min(index * c, self.rows)
        return start, min(c, self.rows - start)


def flat_index(mesh: DeviceMesh, axes: str | Sequence[str]) -> tuple[int, int]:
    """(size, this rank's index) of the ranks that share this rank's coordinates off ``axes``:
    one mesh axis, or several flattened, ranked by global rank (``torch.distributed.new_group``'s
    order, so the index is the rank in ``core.collectives.AxisGroup.flat``'s group)."""
    if isinstance(axes, str):
        return mesh.size(mesh.mesh_dim_names.index(axes)), mesh.get_local_rank(axes)
    names = mesh.mesh_dim_names
    coord = mesh.get_coordinate()
    index = tuple(slice(None) if n in axes else c for n, c in zip(names, coord, strict=True))
    ranks = sorted(mesh.mesh[index].reshape(-1).tolist())
    return len(ranks), ranks.index(mesh.get_rank())
