"""Optimizer state sharded over the data axis (ZeRO-1/2) for ``hpf.optim.zero`` (re-exported there):
params replicated over ``dp``, each rank's optimizer state and update over its rows of every leaf
(dim 0 of the local shard chunked over ``dp`` as ``hpf.fsdp`` chunks it, the ``RowSplit`` layout, so
``hpf.save``/``load``/``reshard`` carry the state), the updated rows all-gathered in buckets.
See docs/training.md#sharded-optimizer-state-zero-12."""

from __future__ import annotations

__all__ = ["gather_rows", "row_infos", "rows_of", "scatter_rows"]

import math
from collections.abc import Mapping

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate

from ..core.buckets import plan_buckets
from ..core.collectives import AxisGroup, all_gather, reduce_scatter
from ..core.errors import PlanError
from ..core.facets import RowSplit
from ..core.placement import ShardInfo
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


def _padded(t: Tensor, rows: int) -> Tensor:
    """``t`` (rows of a leaf) padded with zero rows to ``rows``, flat."""
    flat = t.reshape(-1)
    return torch.cat([flat, flat.new_zeros(rows * math.prod(t.shape[1:]) - flat.numel())])


def scatter_rows(grads: Mapping[str, Tensor | None], infos: Mapping[str, ShardInfo], group: AxisGroup,
                 bucket_bytes: int) -> dict[str, Tensor | None]:
    """ZeRO-2: the mean over ``group`` of every rank's full local gradient, this rank's rows of it:
    one reduce-scatter per bucket (a leaf's ``None`` must be so on every rank)."""
    out: dict[str, Tensor | None] = {k: None for k in grads}
    keys = [k for k, g in grads.items() if g is not None]
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


def gather_rows(rows: Mapping[str, Tensor], infos: Mapping[str, ShardInfo], keys: list[str], group: AxisGroup,
                bucket_bytes: int) -> dict[str, Tensor]:
    """The full local shards of ``keys`` from every rank's ``rows`` of them: one all-gather per bucket."""
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
