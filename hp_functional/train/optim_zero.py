"""Optimizer state sharded over the data axis (ZeRO-1/2) for ``hpf.optim.zero`` (re-exported there):
params replicated over ``dp``, each rank's optimizer state and update over its rows of every leaf
(dim 0 of the local shard chunked over ``dp`` as ``hpf.fsdp`` chunks it, the ``RowSplit`` layout, so
``hpf.save``/``load``/``reshard`` carry the state), the updated rows all-gathered in buckets.  Before
them, ``agree_stepped`` (one small all-gather a step) makes every rank of the axis agree which leaves
have a gradient, so the buckets are alike on every rank or the step is refused on all of them.
See docs/training.md#sharded-optimizer-state-zero-12."""

from __future__ import annotations

__all__ = ["agree_stepped", "gather_rows", "row_infos", "rows_of", "scatter_rows"]

import math
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate

from ..core.buckets import plan_buckets
from ..core.collectives import AxisGroup, all_gather, reduce_scatter
from ..core.errors import PlanError
from ..core.facets import RowSplit
from ..core.placement import ShardInfo
from ..core.raw_collectives import all_gather_rows, mesh_device
from .fsdp import split_info


def row_infos(shard_info: Mapping[str, ShardInfo], mesh: DeviceMesh, axis: str) -> dict[str, ShardInfo]:
    """Each leaf's layout with its local shard's rows chunked over ``axis`` (``hpf.fsdp``'s
    ``RowSplit``): where a ZeRO optimizer's per-leaf state sits.  A ``PlanError`` names the axis
    missing from ``mesh``, or a leaf that is not replicated over it (sharded there, ``hpf.fsdp``'s
    already) or has no rows (0-dim)."""
    names = mesh.mesh_dim_names or ()
    if axis not in names:
        raise PlanError(f"zero: mesh axis {axis!r} is not in the mesh (axes: {list(names)})")
    out = {}
    for k, info in shard_info.items():
        if info.mesh is not mesh and info.mesh != mesh:
            raise PlanError(f"zero: {k!r} is on another mesh than the one given")
        if not isinstance(info.axes.get(axis), Replicate) or info.facet(RowSplit) is not None:
            raise PlanError(f"zero: {k!r} is not replicated over {axis!r} ({info.axes.get(axis)}): its state is "
                            "already sharded there (hpf.fsdp's optimizer state is; use the plain optimizer)")
        if not info.local_shape:
            raise PlanError(f"zero: {k!r} is 0-dim (no rows to shard): give it a plain optimizer through "
                            "hpf.optim.partition")
        out[k] = split_info(info, mesh, (axis,))
    return out


def _span(info: ShardInfo) -> tuple[int, int, int]:
    """(first row, rows, rows per rank) of this rank's rows of ``info`` (a ``row_infos`` layout)."""
    split = info.facet(RowSplit)
    n, index = split.place(info.mesh)
    return (*split.span(n, index), split.chunk(n))


def rows_of(tensors: Mapping[str, Tensor | None], infos: Mapping[str, ShardInfo]) -> dict[str, Tensor | None]:
    """This rank's rows of each full local shard (``None`` kept); local, no communication."""
    out: dict[str, Tensor | None] = {}
    for k, t in tensors.items():
        start, rows, _ = _span(infos[k])
        out[k] = None if t is None else t[start:start + rows].clone()
    return out


def _buckets(keys: list[str], tensors: Mapping[str, Tensor], infos: Mapping[str, ShardInfo],
             bucket_bytes: int) -> list[list[str]]:
    """``keys`` in buckets by (device, dtype) and the bytes of their whole local shards (the same
    buckets for the reduce-scatter of the gradients and the all-gather of the params)."""
    return plan_buckets(((k, (tensors[k].device, tensors[k].dtype),
                          math.prod(infos[k].facet(RowSplit).inner.local_shape) * tensors[k].element_size())
                         for k in keys), bucket_bytes)


_STATES = ("a tensor", "None", "not given")  # a leaf's gradient on a rank, as ``agree_stepped`` sends it


def agree_stepped(grads: Mapping[str, Tensor | None], infos: Mapping[str, ShardInfo], group: AxisGroup,
                  where: str) -> list[str]:
    """The leaves of ``infos`` (in its order, alike on every rank) whose gradient in ``grads`` is a tensor,
    once every rank of ``group`` agrees: one all-gather of an int32 per leaf (0 a tensor, 1 ``None``, 2 not
    given) and this rank's global rank.  A leaf whose gradient differs between the ranks would give the
    ranks different buckets (a hang, or rows of one leaf reduced or gathered with another's), so it is a
    ``PlanError`` naming it and the ranks, raised alike on every rank before any of zero's data collectives.
    ``None`` on every rank is left out (its parameter and state are kept).  No leaves: no collective."""
    keys = list(infos)
    if not keys:
        return []
    mine = [dist.get_rank(), *(2 if k not in grads else int(grads[k] is None) for k in keys)]
    x = torch.tensor(mine, dtype=torch.int32, device=mesh_device(infos[keys[0]].mesh))
    every = all_gather_rows(x, group, where).view(group.size, -1).tolist()
    split = [i for i in range(len(keys)) if len({row[1 + i] for row in every}) > 1]
    if split:
        states = {s: [row[0] for row in every if row[1 + split[0]] == s] for s in range(len(_STATES))}
        said = ", ".join(f"{_STATES[s]} on rank(s) {states[s]}" for s in (1, 2, 0) if states[s])
        also = f" (likewise {[keys[i] for i in split[1:6]]})" if len(split) > 1 else ""
        raise PlanError(f"{where}: the gradient of {keys[split[0]]!r} is {said} (the ranks of axis {group.axis!r}: "
                        f"{[row[0] for row in every]}){also}; zero reduces and gathers every leaf's rows in buckets alike "
                        "on each rank, so a gradient must be None on every rank of the axis or on none (give it a zero "
                        "gradient where it is unused)")
    return [k for k, state in zip(keys, mine[1:], strict=True) if state == 0]


def _padded(t: Tensor, rows: int) -> Tensor:
    """``t`` (rows of a leaf) padded with zero rows to ``rows``, flat."""
    flat = t.reshape(-1)
    return torch.cat([flat, flat.new_zeros(rows * math.prod(t.shape[1:]) - flat.numel())])


def scatter_rows(grads: Mapping[str, Tensor | None], infos: Mapping[str, ShardInfo], keys: Sequence[str],
                 group: AxisGroup, bucket_bytes: int) -> dict[str, Tensor | None]:
    """ZeRO-2: the mean over ``group`` of every rank's full local gradient of ``keys`` (``agree_stepped``'s,
    alike on every rank), this rank's rows of it: one reduce-scatter per bucket; the other leaves ``None``."""
    out: dict[str, Tensor | None] = {k: None for k in grads}
    for bucket in _buckets(keys, grads, infos, bucket_bytes):
        per_rank = []
        for r in range(group.size):
            parts = []
            for k in bucket:
                split, chunk = infos[k].facet(RowSplit), _span(infos[k])[2]
                start, rows = split.span(group.size, r)
                parts.append(_padded(grads[k][start:start + rows], chunk))
            per_rank.append(torch.cat(parts))
        mine = reduce_scatter(torch.stack(per_rank), 0, group)[0] / group.size
        offset = 0
        for k in bucket:
            _, rows, chunk = _span(infos[k])
            size = chunk * math.prod(grads[k].shape[1:])
            out[k] = mine[offset:offset + size].reshape(chunk, *grads[k].shape[1:])[:rows].clone()
            offset += size
    return out


def gather_rows(rows: Mapping[str, Tensor], infos: Mapping[str, ShardInfo], keys: Sequence[str], group: AxisGroup,
                bucket_bytes: int) -> dict[str, Tensor]:
    """The full local shards of ``keys`` (alike on every rank: ``agree_stepped``'s) from every rank's ``rows``
    of them: one all-gather per bucket."""
    out: dict[str, Tensor] = {}
    for bucket in _buckets(keys, rows, infos, bucket_bytes):
        chunks = [_span(infos[k])[2] for k in bucket]
        flat = torch.cat([_padded(rows[k], c) for k, c in zip(bucket, chunks, strict=True)])
        every = all_gather(flat.unsqueeze(0), 0, group)
        offset = 0
        for k, chunk in zip(bucket, chunks, strict=True):
            split, inner = infos[k].facet(RowSplit), infos[k].facet(RowSplit).inner.local_shape
            size = chunk * math.prod(inner[1:])
            pieces = [every[r, offset:offset + split.span(group.size, r)[1] * math.prod(inner[1:])] for r in range(group.size)]
            out[k] = torch.cat(pieces).reshape(inner)
            offset += size
    return out
