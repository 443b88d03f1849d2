"""Plain data parallel over the params pytree: bucketed all-reduce of the gradients over one mesh axis.

Buckets, not one collective per leaf: on slow-per-message backends (gloo: ~1-2 ms per collective
whatever its size) the number of collectives decides the step time.  Leaves sharded on ``dp_axis``
are ``hpf.fsdp``'s, except a ``SummedOver`` one.  See docs/training.md#data-parallel-without-fsdp.
"""

from __future__ import annotations

__all__ = ["reduce_gradients"]

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ..core.buckets import plan_buckets as buckets_by_rule
from ..core.collectives import AxisGroup
from ..core.errors import PlanError
from ..core.facets import ReducedOver, SummedOver
from ..core.placement import ShardInfo
from ..core.raw_collectives import mesh_device, start_all_reduce, wait
from .clip import agree_structure, check_grads, gather_rows, is_shard, structure_words

OPS = ("mean", "sum")


def plan_buckets(grads: Mapping[str, Tensor | None], bucket_bytes: int) -> list[list[str]]:
    """The buckets ``reduce_gradients`` all-reduces, as lists of names: the present leaves by
    (device, dtype) under ``core.buckets.plan_buckets``' one grouping rule."""
    items = ((name, (g.device, g.dtype), g.numel() * g.element_size()) for name, g in grads.items() if g is not None)
    return buckets_by_rule(items, bucket_bytes)


def reduce_gradients(
    grads: Mapping[str, Tensor | None], shard_info: Mapping[str, ShardInfo], mesh: DeviceMesh, dp_axis: str = "dp",
    op: str = "mean", *, bucket_bytes: int = 25 * 2**20,
) -> dict[str, Tensor | None]:
    """Every gradient all-reduced (``"mean"`` or ``"sum"``) over mesh axis ``dp_axis``: one collective
    per bucket of at most ``bucket_bytes`` per (device, dtype) (see ``plan_buckets``), all issued
    before the first wait, never one per parameter.  Pure.  Every check is made before the first
    collective, and the ranks of ``dp_axis`` agree on which keys have a gradient (``agree_structure``):
    a ``None`` on some ranks only raises on every rank.  A collective: call on every rank of ``mesh``.

    Args:
        grads: FQN -> this rank's local gradient or None, keyed like ``shard_info``.
        shard_info: each leaf's layout; a leaf sharded on ``dp_axis`` is ``hpf.fsdp``'s (``PlanError``) unless its
            gradient arrives summed over it (``SummedOver``: no collective, only divided for ``"mean"``).
        mesh: the mesh holding ``dp_axis``.
        dp_axis: the mesh axis whose ranks each saw their own slice of the batch.
        op: ``"mean"`` (the full-batch gradient) or ``"sum"``.
        bucket_bytes: the most bytes one all-reduce carries (a larger leaf is a bucket of its own).

    Returns:
        The reduced gradients: new tensors, same keys and order, ``None`` kept.

    >>> grads = torch.func.grad(loss_fn)(params, batch_slice)   # this dp rank's slice of the batch
    >>> grads = hpf.reduce_gradients(grads, shard_info, mesh)     # = the full-batch gradient
    """
    names = mesh.mesh_dim_names or ()
    if dp_axis not in names:
        raise PlanError(f"reduce_gradients: mesh axis {dp_axis!r} is not in the mesh (axes: {list(names)})")
    if op not in OPS:
        raise ValueError(f"reduce_gradients: op must be one of {list(OPS)}, got {op!r}")
    if not (isinstance(bucket_bytes, int) and bucket_bytes > 0):
        raise ValueError(f"reduce_gradients: bucket_bytes must be a positive int, got {bucket_bytes!r}")
    group = AxisGroup.from_mesh(mesh, dp_axis)
    error, leaves, summed = None, [], {}
    try:  # every local check before any collective; a failure is agreed with the other ranks, not raised alone
        leaves = check_grads(grads, shard_info, "reduce_gradients")
        summed = _summed(leaves, dp_axis, mesh)
    except PlanError as exc:
        error = exc
    if group.size > 1:
        device = leaves[0][1].device if leaves else mesh_device(mesh)
        row = torch.tensor(structure_words(grads, shard_info, error is not None), dtype=torch.float32, device=device)
        order = dist.get_process_group_ranks(mesh.get_group(dp_axis))
        agree_structure(gather_rows(row, [group], "reduce_gradients"), error, grads, shard_info, [group], order,
                        "reduce_gradients")
    elif error is not None:
        raise error
    present = {name: g for name, g, _ in leaves if name not in summed}
    out: dict[str, Tensor | None] = dict.fromkeys(grads)
    out.update({k: g / group.size if op == "mean" else g.clone() for k, g in summed.items()})
    if group.size == 1:
        out.update({k: g.clone() for k, g in present.items()})
    else:
        out.update(_all_reduced(present, group, op, bucket_bytes))
    return out


def _all_reduced(present: Mapping[str, Tensor], group: AxisGroup, op: str, bucket_bytes: int) -> dict[str, Tensor]:
    """``present``'s gradients all-reduced over ``group``, one collective per bucket, every bucket
    issued before the first wait (lets the backend overlap them); divided by the group's size for ``"mean"``."""
    pending, out = [], {}
    for bucket in plan_buckets(present, bucket_bytes):
        flat = [present[k].reshape(-1) for k in bucket]
        buf = flat[0].contiguous() if len(flat) == 1 else torch.cat(flat)
        pending.append((bucket, start_all_reduce(buf, group)))
    for bucket, work in pending:
        total = wait(work, "all_reduce", group, "reduce_gradients")
        if op == "mean":
            total = total / group.size
        for k, piece in zip(bucket, total.split([present[k].numel() for k in bucket]), strict=True):
            out[k] = piece.view(present[k].shape)
    return out


def _summed(leaves: list, axis: str, mesh) -> dict[str, Tensor]:
    """The leaves whose gradient already arrives summed over ``axis``; a PlanError for one sharded there otherwise,
    or for one whose gradient apply_fn's backward already sums over ``axis`` (its ``ReducedOver`` facet)."""
    owed = next((name for name, _, info in leaves if axis in info.axes_of(ReducedOver)), None)
    if owed is not None:
        raise PlanError(f"reduce_gradients: the gradient of {owed} is already summed over mesh axis {axis!r} inside "
                        f"apply_fn's backward (its ReducedOver facet); reducing it again over {axis!r} would count it "
                        f"{mesh.size(mesh.mesh_dim_names.index(axis))} times; drop this call (context parallelism "
                        "needs none)")
    summed = {}
    for name, g, info in leaves:
        p = info.axes.get(axis)
        if p is not None and is_shard(p) and axis in info.axes_of(SummedOver):
            summed[name] = g
        elif p is not None and is_shard(p):
            raise PlanError(f"reduce_gradients: params[{name!r}] is sharded on {axis!r} (FSDP): its gradients are "
                            "reduce-scattered by hpf.fsdp, not all-reduced; a leaf the plan shards there (TP, or experts "
                            f"whose ep ranks share their tokens) has no per-rank shares over {axis!r} to reduce")
    return summed
