"""Gathering local shards back to full tensors, bucketed: a few collectives per call, not one per leaf.

Every rank sends its local shards of a bucket as one flat buffer (one all-gather per mesh dim)
and, once per call, the boxes (``placement.boxes``) that say where each of its shards sits; each
full tensor is then assembled from every rank's boxes.  One rule for every layout — plain,
packed, ``hpf.fsdp`` row splits, uneven chunks — because the boxes are the layout.
``unshard`` gathers everything at once; ``iter_full`` streams buckets of a bounded size (``plan_buckets``)
(``hpf.export_hf`` writes one file per bucket, so no rank holds the whole model).
"""

from __future__ import annotations

__all__ = ["check_gatherable", "iter_full", "plan_buckets", "unshard"]

import math
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import Tensor
from torch.distributed.tensor import Replicate

from .buckets import plan_buckets as buckets_by_rule
from .errors import PlanError, ShapeError
from .host_comm import gather_flat, gather_objects
from .placement import Box, ShardInfo, boxes, fmt_placements
from .raw_collectives import mesh_device


def check_gatherable(params: Mapping[str, Tensor], shard_info: Mapping[str, ShardInfo], what: str) -> None:
    """Every local check before a gather (so no rank hangs): an info per leaf, one mesh, this
    rank in it, local shapes as the infos say."""
    missing = sorted(set(params) - set(shard_info))
    if missing:
        raise PlanError(f"{what}: no shard_info for {missing[:5]}")
    meshes = {id(shard_info[k].mesh) for k in params}
    if len(meshes) > 1:
        raise PlanError(f"{what}: the parameters are on {len(meshes)} different meshes; gather each mesh's separately")
    for name, local in params.items():
        info = shard_info[name]
        if info.mesh.get_coordinate() is None:
            raise PlanError(f"{what}: {name}: this rank is not in its shard_info's mesh {info.mesh.mesh.tolist()}")
        if tuple(local.shape) != tuple(info.local_shape):
            dims = dict(zip(info.mesh.mesh_dim_names, info.mesh.shape, strict=True))
            raise ShapeError(
                f"{what}: {name} has local shape {tuple(local.shape)} but its shard_info (mesh {dims}, "
                f"{fmt_placements(info.placements)}) expects {tuple(info.local_shape)}: shard_info from another mesh or plan?"
            )


def _gather_bucket(keys: Sequence[str], params: Mapping[str, Tensor], shard_info: Mapping[str, ShardInfo],
                   layouts: list[tuple[tuple[int, ...], dict[str, tuple[tuple[int, ...], list[Box]]]]]) -> dict[str, Tensor]:
    """Full tensors of ``keys`` (one dtype) from every rank's local shards and ``layouts``."""
    mesh = shard_info[keys[0]].mesh
    numels = [sum(math.prod(r[k][0]) for k in keys) for _, r in layouts]
    mine = torch.cat([params[k].detach().reshape(-1) for k in keys]) if keys else torch.empty(0)
    flat = torch.cat([mine, mine.new_zeros(max(numels) - mine.numel())]).to(mesh_device(mesh))
    rows = gather_flat(flat, mesh)
    out = {k: rows.new_empty(shard_info[k].global_shape) for k in keys}
    me = tuple(mesh.get_coordinate())
    for row, (coord, layout) in zip(rows, layouts, strict=True):
        start = 0
        for k in keys:
            shape, bxs = layout[k]
            local = row[start:start + math.prod(shape)].view(shape)
            start += local.numel()
            if _same_replica(shard_info[k], coord, me):
                for box in bxs:
                    box.of_global(out[k]).copy_(box.of_local(local))
    return out


def _same_replica(info: ShardInfo, coord: tuple[int, ...], me: tuple[int, ...]) -> bool:
    """Whether the rank at ``coord`` holds part of this rank's replica of ``info``'s tensor (the
    same index on every mesh dim the tensor is not sharded on): a replicated value is taken
    from this rank's own group, as a per-rank gradient would be."""
    return all(c == m or not isinstance(p, Replicate) for p, c, m in zip(info.placements, coord, me, strict=True))


def plan_buckets(params: Mapping[str, Tensor], shard_info: Mapping[str, ShardInfo],
                 bucket_bytes: int = 1 << 30) -> list[list[str]]:
    """The keys of ``params`` in buckets of one dtype and at most ``bucket_bytes`` of full tensors
    (a tensor larger than that alone), in ``params`` order within a dtype (what ``iter_full``
    gathers): ``core.buckets.plan_buckets``' one rule, dtypes in name order."""
    ordered = sorted(params.items(), key=lambda kv: str(kv[1].dtype))  # stable: file order within a dtype
    items = ((k, t.dtype, math.prod(shard_info[k].global_shape) * t.element_size()) for k, t in ordered)
    return buckets_by_rule(items, bucket_bytes)


def iter_full(params: Mapping[str, Tensor], shard_info: Mapping[str, ShardInfo],
              buckets: Sequence[Sequence[str]], what: str = "gather") -> Iterator[dict[str, Tensor]]:
    """The full tensors of each bucket (``plan_buckets``) in turn, on every rank; a collective:
    every rank must consume every bucket.  Memory per rank: one bucket's shards from every rank.
    ``what`` names the caller in errors."""
    check_gatherable(params, shard_info, what)
    if not params:
        return
    mesh = next(iter(shard_info[k] for k in params)).mesh
    coord = tuple(mesh.get_coordinate())
    layouts = gather_objects((coord, {k: (tuple(shard_info[k].local_shape), boxes(shard_info[k])) for k in params}), mesh)
    for keys in buckets:
        yield _gather_bucket(keys, params, shard_info, layouts)


def unshard(params: Mapping[str, Tensor], shard_info: Mapping[str, ShardInfo]) -> dict[str, Tensor]:
    """Gather every local shard back to its full tensor on every rank (a collective: call on
    every rank; one all-gather per mesh dim and dtype, plus one for the layouts; inverse:
    ``slice_local``).  Peak memory: the whole model on every rank (``iter_full`` streams it).

    Args:
        params: this rank's local shards by key, all on one mesh (``shard()``'s ``params``, optimizer
            state, ``hpf.buffers``).
        shard_info: the ``ShardInfo`` of each key of ``params``.
    Returns:
        A dict of full (global-shape) tensors in ``params``' key order, on the mesh's device.
    """
    out: dict[str, Tensor] = {}
    for bucket in iter_full(params, shard_info, plan_buckets(params, shard_info, 1 << 62), "unshard"):
        out |= bucket
    return {k: out[k] for k in params}
