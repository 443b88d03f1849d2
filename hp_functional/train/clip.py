"""Gradient clipping by the norm of the *global* gradient, with one small collective for the whole pytree.

Each leaf's local shard contributes its p-th-power sum (its max for ``inf``) on the ranks that own it
(``_owns``) only, so ``total_norm`` equals ``torch.nn.utils.clip_grad_norm_`` on the unsharded model;
replicas are assumed equal, as they are after ``reduce_gradients``.  The same all-gather agrees on the
gradients' structure (``agree_structure``, which ``reduce_gradients`` shares).  See docs/training.md#clipping.
"""

from __future__ import annotations

__all__ = ["agree_structure", "check_grads", "clip_grad_norm", "gather_rows", "is_shard", "structure_words"]

import functools
import math
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement
from torch.utils._foreach_utils import _device_has_foreach_support

from ..compile.agree import digest
from ..core.collectives import AxisGroup
from ..core.errors import PlanError, ShapeError
from ..core.host_comm import all_gather_objects, mesh_groups
from ..core.placement import ShardInfo, fmt_placements, owns, splits
from ..core.raw_collectives import all_gather_rows, mesh_device


def is_shard(p: Placement) -> bool:
    """Whether ``p`` splits the tensor over its mesh axis (``Shard``, ``_StridedShard``, ``GroupedShard``)."""
    return splits(p)


def check_grads(
    grads: Mapping[str, Tensor | None], shard_info: Mapping[str, ShardInfo], where: str
) -> list[tuple[str, Tensor, ShardInfo]]:
    """(name, grad, info) of every non-None gradient, after the local checks every rank makes
    before any collective: the same keys as ``shard_info``, local shapes that match it, this rank
    in each leaf's mesh."""
    missing, extra = [k for k in shard_info if k not in grads], [k for k in grads if k not in shard_info]
    if missing or extra:
        raise PlanError(f"{where}: grads and shard_info have different keys: missing from grads {missing[:5]}, "
                        f"not in shard_info {extra[:5]}")
    leaves = []
    for name, g in grads.items():
        if g is None:
            continue
        info = shard_info[name]
        if info.mesh.get_coordinate() is None:
            raise PlanError(f"{where}: {name}: this rank is not in its mesh {info.mesh.mesh.tolist()}")
        if tuple(g.shape) != tuple(info.local_shape):
            raise ShapeError(f"{where}: grads[{name!r}] has shape {tuple(g.shape)} but its shard_info "
                             f"({fmt_placements(info.placements)}) expects the local shape {tuple(info.local_shape)}")
        leaves.append((name, g, info))
    return leaves


def _common_mesh(leaves: list[tuple[str, Tensor, ShardInfo]], where: str) -> DeviceMesh | None:
    """The one mesh every leaf lives on; a PlanError naming the first leaf on another."""
    if not leaves:
        return None
    first, _, info0 = leaves[0]
    mesh = info0.mesh
    for name, _, info in leaves[1:]:
        if info.mesh is not mesh and info.mesh != mesh:
            raise PlanError(
                f"{where}: all gradients must share one mesh, but {name} is on mesh {info.mesh.mesh.tolist()} "
                f"{info.mesh.mesh_dim_names} and {first} on {mesh.mesh.tolist()} {mesh.mesh_dim_names}"
            )
    return mesh


def _owns(info: ShardInfo, coord: list[int]) -> bool:
    """Whether this rank counts the leaf: coordinate 0 on every axis the leaf is replicated on,
    and the first rank of its group on an axis it is ``GroupedShard`` on.  Exact masking (no 1/n
    weights): each sharded piece and each replicated leaf is counted once, not once per replica."""
    return all(owns(p, c) for c, p in zip(coord, info.placements, strict=True))


def _group_by_device_dtype(tensors: Iterable[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """Indices of ``tensors`` grouped by (device, dtype), in first-seen order (one foreach kernel each)."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return groups


def _use_foreach(device: torch.device, foreach: bool | None) -> bool:
    """torch's rule: foreach by default where the device has the kernels; ``True`` where it has not is an error."""
    supported = _device_has_foreach_support(device)
    if foreach and not supported:
        raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
    return supported if foreach is None else foreach


def _local_norms(tensors: list[Tensor], p: float, acc: torch.dtype, foreach: bool | None) -> list[Tensor]:
    """Each tensor's p-norm, computed in ``acc`` (empty tensors are skipped by the caller)."""
    norms: list[Tensor | None] = [None] * len(tensors)
    for (device, _), idx in _group_by_device_dtype(tensors).items():
        group = [tensors[i] for i in idx]
        if _use_foreach(device, foreach):
            out = torch._foreach_norm(group, p, dtype=acc)
        else:
            out = [torch.linalg.vector_norm(t, p, dtype=acc) for t in group]
        for i, n in zip(idx, out, strict=True):
            norms[i] = n
    return norms  # type: ignore[return-value]


def _axis_groups(mesh: DeviceMesh) -> list[AxisGroup]:
    """Process groups whose all-gathers cover the whole mesh: the default group when the mesh spans
    the world (one collective), else each mesh axis of size > 1 in turn."""
    if mesh.size() == 1:
        return []
    axes = ",".join(mesh.mesh_dim_names or ())
    if mesh.size() == dist.get_world_size():
        return [AxisGroup(axes, dist.group.WORLD.group_name, dist.get_world_size(), dist.get_rank())]
    return [AxisGroup.from_mesh(mesh, name) for d, name in enumerate(mesh.mesh_dim_names) if mesh.size(d) > 1]


def gather_rows(x: Tensor, groups: list[AxisGroup], where: str) -> Tensor:
    """[ranks, n]: every rank's 1-D ``x``, in ``host_comm.mesh_groups``' rank order (the same on every rank)."""
    n = x.numel()
    for g in groups:
        x = all_gather_rows(x, g, where)
    return x.view(-1, n)


def _structure(grads: Mapping, shard_info: Mapping[str, ShardInfo]) -> list[str]:
    """This rank's gradient structure: per ``shard_info`` key "grad", "None" or "missing", then the extra keys."""
    return [("missing" if k not in grads else "None" if grads[k] is None else "grad") for k in shard_info] + \
        sorted(f"extra {k}" for k in grads if k not in shard_info)


def structure_words(grads: Mapping, shard_info: Mapping[str, ShardInfo], failed: bool) -> list[float]:
    """[failed, digest of ``_structure`` in three 20-bit words]: exact in float32 and float64."""
    d = digest("\n".join(_structure(grads, shard_info)))
    return [float(failed), *(float((d >> s) & 0xFFFFF) for s in (0, 20, 40))]


def agree_structure(rows: Tensor, error: Exception | None, grads: Mapping, shard_info: Mapping[str, ShardInfo],
                    groups: list[AxisGroup], order: list[int], where: str) -> None:
    """Raise on every rank unless every rank passed its local checks (column 0 of ``rows``) and has
    the same gradient structure (columns 1-3): ``error`` itself on a rank that failed, a
    PlanError naming those ranks elsewhere; for differing structures, the first key and the
    ranks holding each variant (gathered only then)."""
    failed = [r for r, f in zip(order, rows[:, 0].tolist(), strict=True) if f]
    if error is not None:
        raise error
    if failed:
        raise PlanError(f"{where}: the gradients failed the local checks on ranks {failed} (see their error: keys or "
                        "shapes that differ from shard_info there); every rank stops here, before any other collective")
    if bool((rows[:, 1:] == rows[0, 1:]).all()):
        return
    mine = _structure(grads, shard_info)
    everyone = [mine]
    for g in groups:  # the slow path, only after a mismatch (every rank takes it)
        out = all_gather_objects(everyone, dist.distributed_c10d._resolve_process_group(g.group_name))
        everyone = [v for chunk in out for v in chunk]
    keys = list(shard_info)
    for i in range(max(len(s) for s in everyone)):
        variants: dict[str, list[int]] = {}
        for r, s in zip(order, everyone, strict=True):
            variants.setdefault(s[i] if i < len(s) else "absent", []).append(r)
        if len(variants) > 1:
            what = f"grads[{keys[i]!r}]" if i < len(keys) else "the keys beyond shard_info"
            seen = "; ".join(f"{v} on ranks {rs}" for v, rs in variants.items())
            raise PlanError(f"{where}: {what} differs across ranks: {seen}. Every rank must have a gradient for the same "
                            "keys (a None on some ranks only would make the global result differ per rank)")
    raise PlanError(f"{where}: the gradients' structure differs across ranks")


def global_norm(
    grads: Mapping[str, Tensor | None], shard_info: Mapping[str, ShardInfo], norm_type: float = 2.0,
    *, foreach: bool | None = None,
) -> Tensor:
    """The ``norm_type``-norm of the global gradient (all leaves together, each counted once), the
    same on every rank; one all-gather of a few numbers per rank (a collective: call on every rank)."""
    return _global_norm(grads, shard_info, norm_type, foreach, "global_norm")[0]


def _mesh_of(shard_info: Mapping[str, ShardInfo], where: str) -> DeviceMesh | None:
    """The mesh the collective runs over: the first leaf's (every rank has the same shard_info)."""
    info = next(iter(shard_info.values()), None)
    if info is None:
        return None
    if info.mesh.get_coordinate() is None:
        raise PlanError(f"{where}: this rank is not in the mesh {info.mesh.mesh.tolist()}")
    return info.mesh


def _global_norm(grads: Mapping[str, Tensor | None], shard_info: Mapping[str, ShardInfo], norm_type: float,
                 foreach: bool | None, where: str) -> tuple[Tensor, list[tuple[str, Tensor, ShardInfo]]]:
    """(the global norm, the checked leaves); the ranks agree on the structure first (``agree_structure``)."""
    p = float(norm_type)
    if not (p > 0 or p == math.inf):
        raise ValueError(f"{where}: norm_type must be positive or inf, got {norm_type!r}")
    mesh = _mesh_of(shard_info, where)
    error, leaves = None, []
    try:  # every local check before the collective; a failure is agreed there, not raised alone
        leaves = check_grads(grads, shard_info, where)
        _common_mesh(leaves, where)
    except (PlanError, ValueError) as exc:
        error = exc
    out_dtype = functools.reduce(torch.promote_types, [g.dtype for _, g, _ in leaves], torch.float32)
    if mesh is None:
        if error is not None:
            raise error
        return torch.zeros((), dtype=out_dtype), leaves
    first = leaves[0][1].device if leaves else mesh_device(mesh)
    device = first if first.type == mesh.device_type else mesh_device(mesh)
    acc = torch.float64 if device.type == "cpu" else torch.float32  # float64 keeps equality with torch's fp32 sums
    coord = mesh.get_coordinate()
    owned = [g for _, g, info in leaves if g.numel() and _owns(info, coord)]  # inf has no identity on empty tensors
    local = torch.zeros((), dtype=acc, device=device)
    if owned and error is None:
        norms = torch.stack([n.to(device) for n in _local_norms(owned, p, acc, foreach)])
        local = norms.max() if p == math.inf else norms.pow(p).sum()
    row = torch.cat([local.view(1), torch.tensor(structure_words(grads, shard_info, error is not None), dtype=acc,
                                                   device=device)])
    groups = _axis_groups(mesh)
    rows = gather_rows(row, groups, where)
    agree_structure(rows[:, 1:], error, grads, shard_info, groups, mesh_groups(mesh)[1], where)
    total = rows[:, 0].max() if p == math.inf else rows[:, 0].sum()
    return (total if p == math.inf else total.pow(1.0 / p)).to(out_dtype), leaves


def clip_grad_norm(
    grads: Mapping[str, Tensor | None], shard_info: Mapping[str, ShardInfo], max_norm: float, norm_type: float = 2.0,
    *, error_if_nonfinite: bool = False, foreach: bool | None = None,
) -> tuple[dict[str, Tensor | None], Tensor]:
    """``(clipped_grads, total_norm)``: every gradient scaled by ``min(1, max_norm / (total_norm + 1e-6))``,
    where ``total_norm`` is the norm of the global gradient — what ``torch.nn.utils.clip_grad_norm_``
    returns on the unsharded model.  Pure.  One all-gather of a few numbers per rank (a collective:
    call on every rank); a ``None`` or a missing key on some ranks only raises on every rank.

    Args:
        grads: FQN -> this rank's local gradient or None, keyed like ``shard_info``.
        shard_info: each leaf's layout (``shard()``'s or ``fsdp``'s); every leaf on one mesh.
        max_norm: the global norm to clip to (as torch's).
        norm_type: p of the p-norm: positive, or ``inf`` for the largest absolute value.
        error_if_nonfinite: raise ``RuntimeError`` (on every rank) when the total norm is NaN or inf, as torch does.
        foreach: use torch's ``_foreach`` kernels (None: where the device has them, as torch; True where it has not
            raises).

    Returns:
        ``(clipped_grads, total_norm)``: new tensors with the same keys and order (``None`` kept), and the 0-dim
        global norm, the same on every rank (in the gradients' promoted dtype, at least float32).

    >>> grads = torch.func.grad(loss_fn)(params)
    >>> grads, norm = hpf.clip_grad_norm(grads, shard_info, max_norm=1.0)
    """
    total, leaves = _global_norm(grads, shard_info, norm_type, foreach, "clip_grad_norm")
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):  # equal on every rank: all raise
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it cannot "
            "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    tensors = [g for _, g, _ in leaves]
    clipped: list[Tensor | None] = [None] * len(tensors)
    for (device, _), idx in _group_by_device_dtype(tensors).items():
        group, c = [tensors[i] for i in idx], coef.to(device)  # a 0-dim coef keeps each grad's dtype, as torch's
        out = torch._foreach_mul(group, c) if _use_foreach(device, foreach) else [t * c for t in group]
        for i, t in zip(idx, out, strict=True):
            clipped[i] = t
    by_name = {name: t for (name, _, _), t in zip(leaves, clipped, strict=True)}
    return {k: by_name.get(k) for k in grads}, total
