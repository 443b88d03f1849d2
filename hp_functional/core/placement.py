"""Placements per mesh axis, full → local slicing, ``ShardInfo``, and one tensor gathered back
(``to_full``; whole pytrees in buckets: ``core.gather``).

A parameter is *stored* as ``Shard(d)`` or ``Replicate()`` on each mesh dim, or as one of the
stored-only placements defined here (``GroupedShard``: KV heads over more ranks than heads;
``StackedShard``: stacked experts; torch's ``_StridedShard`` when read from DTensor); what a
parallelism records besides (``hpf.fsdp``'s flat rows, ``RowSplit``) is a facet (``core.facets``);
``Partial`` is a use-site placement only (see ``core.lowering``).  Slicing follows DTensor's
convention: mesh dims are applied in order, each ``Shard(d)`` narrowing the current chunk further, so
``to_dtensor`` can wrap our local shards without a copy.
"""

from __future__ import annotations

__all__ = [
    "AxisPlacements", "Box", "GroupedShard", "ShardInfo", "StackedShard", "boxes", "fmt_placements", "is_grouped",
    "is_placement", "local_layout", "mesh_placements", "owns", "packed_layout", "replica_group", "slice_local",
    "splits", "to_dtensor", "to_full"
]

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

try:  # a Placement of its own (not a Shard subclass) in torch 2.13; FSDP's interleaved dp sharding
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - older torch
    _StridedShard = Shard

from .collectives import AxisGroup, raw_all_gather, raw_all_reduce
from .errors import PlanError, ShapeError
from .facets import AxesFacet, F, Facet, RowSplit

AxisPlacements = Mapping[str, Placement]


@dataclass(frozen=True)
class GroupedShard:
    """``Shard(dim)`` over the axis's ranks taken ``replicas`` at a time: the axis's ``n`` ranks
    form ``n // replicas`` groups of consecutive ranks, group ``g`` holds chunk ``g`` and every
    rank of a group holds the same chunk (KV-head replication: TP 4 over 2 KV heads gives ranks
    0, 1 head 0 and ranks 2, 3 head 1, as Megatron's and vLLM's GQA).  A stored placement only;
    it has no DTensor counterpart.  Its use in rank-varying compute sums the gradients of a
    group's replicas (``lower``: ``copy_to_replicas``)."""

    dim: int
    replicas: int

    def chunks(self, n: int) -> int:
        """How many chunks ``n`` ranks hold."""
        return n // self.replicas


@dataclass(frozen=True)
class StackedShard:
    """Member ``index`` of ``count`` same-shaped tensors stacked along a new leading dim, the
    stack ``Shard(0)`` over the axis (the experts of an ``nn.ModuleList``/``ModuleDict`` over
    ``ep``, as HF's fused ``[num_experts, ...]`` tensors are ``Shard(0)``): the axis's rank
    ``index // (count // n)`` holds the tensor whole and every other rank an empty shard (0 rows),
    so every rank has the same leaves.  A stored placement only; it has no DTensor counterpart."""

    index: int
    count: int

    def owner(self, n: int) -> int:
        """The rank of an ``n``-rank axis holding the tensor."""
        return self.index // (self.count // n)


#: Placements only a stored parameter takes (no DTensor counterpart, no redistribution to them).
STORED_ONLY = (GroupedShard, StackedShard)


def is_placement(p: object) -> bool:
    """Whether ``p`` is a placement: torch's, or one of the stored-only ones defined here."""
    return isinstance(p, (Placement, *STORED_ONLY))


def replica_group(p: object) -> int:
    """How many consecutive ranks of its axis hold the same chunk of a value placed ``p``: a
    ``GroupedShard``'s ``replicas``, else 1.  With ``splits`` and ``owns`` the questions the rest
    of the package asks of a stored placement, so only this module switches on its type
    (``tests/test_layers.py`` checks it)."""
    return p.replicas if isinstance(p, GroupedShard) else 1


def is_grouped(p: object) -> bool:
    """Whether ``p`` is a ``GroupedShard`` (a chunk held by a group of ranks: no redistribution
    except its use as that rank's ``Shard`` slice, ``core.lowering``)."""
    return isinstance(p, GroupedShard)


def owns(p: object, coord: int) -> bool:
    """Whether the rank at ``coord`` on ``p``'s axis counts the value once in a sum over the
    mesh (a norm, a checksum): every rank of a split, the first of each ``GroupedShard``
    group, rank 0 of a replicated value."""
    if isinstance(p, GroupedShard):
        return coord % p.replicas == 0
    return splits(p) or coord == 0


def splits(p: object) -> bool:
    """Whether a stored placement splits the tensor over its axis (``Shard``, ``_StridedShard``,
    ``GroupedShard``, ``StackedShard``)."""
    return isinstance(p, (Shard, _StridedShard, GroupedShard, StackedShard))


@dataclass(frozen=True)
class ShardInfo:
    """Where this rank's local shard of one parameter sits in the global tensor."""

    placements: tuple[Placement, ...]  # one per mesh dim, DTensor order
    mesh: DeviceMesh
    global_shape: torch.Size
    local_shape: torch.Size
    offset: tuple[int, ...]  # global index of the local shard's first element, per tensor dim
    aliases: tuple[str, ...] = ()  # other FQNs tied to this leaf
    blocks: tuple[int, ...] | None = None  # packed: global sizes of the sub-blocks along the sharded dim,
    # each sharded separately (the local shard is the rank's slice of every block, concatenated;
    # ``offset`` then locates the slice of the first block)
    facets: tuple[Facet, ...] = ()  # what parallelisms record of it: RowSplit, SummedOver, ReducedOver

    @property
    def axes(self) -> dict[str, Placement]:
        """Placements keyed by mesh dim name."""
        return dict(zip(self.mesh.mesh_dim_names, self.placements, strict=True))

    @property
    def is_sharded(self) -> bool:
        return any(splits(p) for p in self.placements)

    def facet(self, kind: type[F]) -> F | None:
        """This leaf's facet of type ``kind``, or None: ``info.facet(hpf.RowSplit)``."""
        return next((f for f in self.facets if type(f) is kind), None)

    def with_facet(self, kind: type[Facet], facet: Facet | None) -> ShardInfo:
        """A copy whose facet of type ``kind`` is ``facet`` (None: without one).  Facets are kept
        sorted by type name, so equal records compare equal whatever order they were added in."""
        if facet is not None and type(facet) is not kind:
            raise TypeError(f"with_facet: {facet!r} is not a {kind.__name__}")
        kept = [f for f in self.facets if type(f) is not kind] + ([facet] if facet is not None else [])
        return dataclasses.replace(self, facets=tuple(sorted(kept, key=lambda f: type(f).__name__)))

    def axes_of(self, kind: type[AxesFacet]) -> tuple[str, ...]:
        """The axes of this leaf's ``kind`` facet (``SummedOver``, ``ReducedOver``); () without one."""
        found = self.facet(kind)
        return found.axes if found is not None else ()


def fmt_placements(placements) -> str:
    """``(Shard(dim=0), Replicate())`` as text, one placement per mesh dim."""
    return "(" + ", ".join(str(p) for p in placements) + ")"


def check_placement(p: object, where: str) -> Placement:
    """``p`` if it is a torch.distributed.tensor placement, else a PlanError naming ``where``."""
    if not isinstance(p, (Shard, Replicate, Partial, GroupedShard, StackedShard)):
        raise PlanError(
            f"{where}: {p!r} is not a placement; use torch.distributed.tensor.Shard(d), Replicate() or Partial()"
        )
    return p


def mesh_placements(per_axis: AxisPlacements, mesh: DeviceMesh, where: str) -> tuple[Placement, ...]:
    """Per-axis placements → one placement per mesh dim (unnamed axes are Replicate)."""
    names = mesh.mesh_dim_names or ()
    for axis, p in per_axis.items():
        if axis not in names:
            raise PlanError(f"{where}: mesh axis {axis!r} is not in the mesh (axes: {list(names)})")
        check_placement(p, where)
    return tuple(per_axis.get(n, Replicate()) for n in names)


def local_layout(
    global_shape: torch.Size, placements: tuple[Placement, ...], mesh: DeviceMesh, where: str
) -> tuple[torch.Size, tuple[int, ...]]:
    """This rank's local shape and offset; raises ShapeError naming ``where`` and the axis."""
    shape, offset = list(global_shape), [0] * len(global_shape)
    coords = mesh.get_coordinate() or [0] * mesh.ndim
    for mdim, p in enumerate(placements):
        if isinstance(p, Partial):
            raise PlanError(f"{where}: a parameter cannot be stored as Partial (mesh axis {mesh.mesh_dim_names[mdim]!r})")
        if not splits(p):
            continue
        n, axis, index = mesh.size(mdim), mesh.mesh_dim_names[mdim], coords[mdim]
        if isinstance(p, StackedShard):
            if not shape:
                raise PlanError(f"{where}: {p} on axis {axis!r} needs a tensor with dims, not a scalar")
            if p.count % n:
                raise ShapeError(f"{where}: {p.count} stacked tensors (one per expert) are not divisible by mesh axis "
                                 f"{axis!r} (size {n})")
            if p.owner(n) != index:
                shape[0] = 0
            continue
        if isinstance(p, GroupedShard):
            if p.replicas < 1 or n % p.replicas:
                raise PlanError(f"{where}: {p} on axis {axis!r}: {p.replicas} replicas do not divide its {n} ranks")
            n, index = p.chunks(n), index // p.replicas
        if not -len(shape) <= p.dim < len(shape):
            raise PlanError(f"{where}: Shard({p.dim}) on axis {axis!r} but the tensor has {len(shape)} dims")
        d = p.dim % len(shape)
        if shape[d] % n:
            raise ShapeError(f"{where}: dim {d} (size {shape[d]}) is not divisible by mesh axis {axis!r} (size {n})")
        shape[d] //= n
        offset[d] += index * shape[d]
    return torch.Size(shape), tuple(offset)


# ---------------------------------------------------------------- packed parameters
# A packed parameter (fused gate_up_proj / qkv_proj) is ``blocks`` sub-blocks along its
# innermost sharded dim, each sharded separately: the local shard is the rank's slice of every
# block, concatenated.  Other axes may shard outer dims whole (experts over ``ep``, their fused
# gate/up over ``tp``).  All of the block arithmetic lives here.
def packed_dim(placements: Sequence[Placement], ndim: int, where: str) -> int:
    """The tensor dim a packed parameter's blocks lie along: its innermost sharded dim, sharded
    by exactly one axis."""
    dims = [p.dim % ndim for p in placements if isinstance(p, Shard)]
    if not dims or dims.count(max(dims)) != 1:
        raise PlanError(f"{where}: packed blocks need one axis sharding their dim (the innermost sharded one), "
                        f"got {fmt_placements(placements)}")
    return max(dims)


def packed_layout(
    name: str, global_shape: torch.Size, placements: tuple[Placement, ...], local_shape: torch.Size,
    offset: tuple[int, ...], blocks: int | tuple[int, ...], axes: Sequence[str],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global block sizes, offset of the rank's slice of the first block) of a packed parameter;
    a ShapeError naming the parameter and the axes when a block does not split evenly."""
    d = packed_dim(placements, len(global_shape), f"parameter {name}")
    sizes = (global_shape[d] // blocks,) * blocks if isinstance(blocks, int) else tuple(blocks)
    n = global_shape[d] // local_shape[d]
    if sum(sizes) != global_shape[d] or any(b % n for b in sizes):
        sharding = [a for a, p in zip(axes, placements, strict=True) if isinstance(p, Shard)]
        raise ShapeError(f"parameter {name}: packed blocks {sizes} along dim {d} (size {global_shape[d]}) do not each "
                         f"split {n} ways over mesh axes {sharding}")
    return sizes, (*offset[:d], offset[d] // local_shape[d] * (sizes[0] // n), *offset[d + 1 :])


def _packed_split(info: ShardInfo) -> tuple[int, int, int]:
    """(sharded dim, number of shards, this rank's shard index) of a packed parameter."""
    d = packed_dim(info.placements, len(info.global_shape), "packed parameter")
    n = info.global_shape[d] // info.local_shape[d]
    return d, n, info.offset[d] // (info.blocks[0] // n)


class Box(NamedTuple):
    """One box of a local shard: ``size`` elements per dim starting at ``start`` in the global
    tensor and at ``local`` in the local shard.  A plain layout is one box; a packed one is a box
    per block; an ``hpf.fsdp`` row split keeps the rows of its inner boxes that this rank holds."""

    start: tuple[int, ...]
    local: tuple[int, ...]
    size: tuple[int, ...]

    def of_global(self, full: Tensor) -> Tensor:
        """This box's view of the global tensor (``full`` or anything indexed like it)."""
        return full[tuple(slice(s, s + n) for s, n in zip(self.start, self.size, strict=True))]

    def of_local(self, local: Tensor) -> Tensor:
        """This box's view of the local shard."""
        return local[tuple(slice(s, s + n) for s, n in zip(self.local, self.size, strict=True))]


def boxes(info: ShardInfo) -> list[Box]:
    """The boxes that make up this rank's local shard, in local order, none empty (the one map
    from local shards to global indices: slicing, weight reading and checkpoints use it)."""
    split = info.facet(RowSplit)
    if split:
        first, rows = split.span(*split.place(info.mesh))
        out = []
        for b in boxes(split.inner):
            lo, hi = max(b.local[0], first), min(b.local[0] + b.size[0], first + rows)
            if lo < hi:
                out.append(Box((b.start[0] + lo - b.local[0], *b.start[1:]), (lo - first, *b.local[1:]),
                               (hi - lo, *b.size[1:])))
        return out
    if info.blocks:
        d, n, r = _packed_split(info)
        out, block_start, local_start = [], 0, 0
        for size in info.blocks:
            c = size // n
            out.append(Box((*info.offset[:d], block_start + r * c, *info.offset[d + 1:]),
                           (*(0,) * d, local_start, *(0,) * (len(info.offset) - d - 1)),
                           (*info.local_shape[:d], c, *info.local_shape[d + 1:])))
            block_start, local_start = block_start + size, local_start + c
        return out
    if 0 in info.local_shape and info.local_shape:
        return []
    return [Box(tuple(info.offset), (0,) * len(info.offset), tuple(info.local_shape))]


def slice_local(full: Tensor, info: ShardInfo) -> Tensor:
    """The local shard of ``full`` as a new tensor that owns its storage (inverse: ``gather.unshard``).
    Local: no communication.

    Args:
        full: the global tensor (``info.global_shape``), alike on every rank.
        info: the ``ShardInfo`` saying which boxes of ``full`` this rank holds.
    Returns:
        A new tensor of ``info.local_shape`` (``full``'s dtype and device), this rank's shard.
    """
    local = full.new_empty(info.local_shape)
    with torch.no_grad():
        for box in boxes(info):
            box.of_local(local).copy_(box.of_global(full))
    return local


def to_full(local: Tensor, placements: Sequence[Placement], groups: Sequence[AxisGroup]) -> Tensor:
    """The full value of a tensor placed ``placements`` (one per mesh dim, ``groups`` alike):
    Shard (and GroupedShard) all-gathered, Partial all-reduced, Replicate kept, mesh dims last to
    first (DTensor's order); any other placement (``StackedShard``, ``_StridedShard``) is a
    ``PlanError`` rather than a local shard passed off as the full value.  Not differentiable:
    for reading results (``validate``)."""
    odd = [p for p, g in zip(placements, groups, strict=True) if not isinstance(p, (Shard, GroupedShard, Partial, Replicate))]
    if odd:
        raise PlanError(f"to_full: no full value for placements {odd} (read such leaves with unshard)")
    t = local.detach()
    for p, g in reversed(list(zip(placements, groups, strict=True))):
        if g.size == 1:
            continue
        if isinstance(p, Shard):
            t = raw_all_gather(t, p.dim % t.dim(), g)
        elif isinstance(p, GroupedShard):  # one copy of each group's chunk
            d = p.dim % t.dim()
            t = torch.cat(raw_all_gather(t, d, g).chunk(g.size, d)[:: p.replicas], d)
        elif isinstance(p, Partial):
            t = raw_all_reduce(t, g) / (g.size if p.reduce_op == "avg" else 1)
    return t


def to_dtensor(params: Mapping[str, Tensor], shard_info: Mapping[str, ShardInfo]) -> dict[str, DTensor]:
    """Wrap the local shards as DTensors (no copy, no communication).  Layouts DTensor cannot
    express raise ``PlanError`` (use ``unshard``): packed parameters, ``GroupedShard``,
    ``StackedShard``, and some ``hpf.fsdp`` row splits over flattened axes.

    Args:
        params: this rank's local shards by key (``shard()``'s ``params``).
        shard_info: the ``ShardInfo`` of each key.
    Returns:
        A dict of ``DTensor``s by key, each over its info's mesh and placements, sharing storage with ``params``.
    """
    packed = [k for k in params if is_packed(shard_info[k])]
    if packed:
        raise PlanError(f"to_dtensor: packed parameters {packed[:3]} have no DTensor layout; use unshard()")
    grouped = [k for k in params if any(isinstance(p, GroupedShard) for p in shard_info[k].placements)]
    if grouped:
        raise PlanError(f"to_dtensor: {grouped[:3]} are replicated over groups of ranks (KV-head replication, "
                        "GroupedShard), which DTensor cannot express; use unshard()")
    stacked = [k for k in params if any(isinstance(p, StackedShard) for p in shard_info[k].placements)]
    if stacked:
        raise PlanError(f"to_dtensor: {stacked[:3]} are held whole by one rank of a stack (StackedShard: per-module "
                        "experts), which DTensor cannot express; use unshard()")
    flat = [k for k in params if _flat_and_uneven(shard_info[k])]
    if flat:
        raise PlanError(f"to_dtensor: {flat[:3]} are chunked over several mesh axes flattened (hpf.fsdp over "
                        f"{shard_info[flat[0]].facet(RowSplit).axis}) unevenly or under a TP row split, which DTensor's "
                        "nested Shard(0) does not express; use unshard()")
    return {
        name: DTensor.from_local(
            local, shard_info[name].mesh, shard_info[name].placements, run_check=False,
            shape=shard_info[name].global_shape, stride=_contiguous_stride(shard_info[name].global_shape),
        )
        for name, local in params.items()
    }


def _flat_and_uneven(info: ShardInfo) -> bool:
    """Whether ``info`` is row-split over several axes flattened, unevenly or under a TP row split."""
    split = info.facet(RowSplit)
    return (split is not None and not isinstance(split.axis, str)
            and bool(split.rows % split.place(info.mesh)[0] or any(type(p) is not Shard and splits(p)
                                                                  for p in info.placements)))


def is_packed(info: ShardInfo) -> bool:
    """Whether ``info`` (or the layout it splits further) is a packed parameter."""
    split = info.facet(RowSplit)
    return bool(info.blocks) or (split is not None and is_packed(split.inner))


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))
