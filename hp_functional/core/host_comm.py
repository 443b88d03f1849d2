"""Communication outside the collectives table: Python objects (checks, error reports), process
groups of their own, and the staged gather of a whole mesh (one collective per mesh dim, or one
over the world).

Every module outside ``core/`` communicates through these or ``core.collectives`` /
``core.raw_collectives`` (``tests/test_layers.py`` enforces it), so timeouts, backends and
error reporting are decided in one layer.
"""

from __future__ import annotations

__all__ = [
    "all_gather_objects", "broadcast_", "broadcast_objects", "gather_flat", "gather_objects",
    "mesh_groups", "new_group"
]

from datetime import timedelta

import torch.distributed as dist
from torch import Tensor


def broadcast_(x: Tensor, src: int = 0, group=None) -> Tensor:
    """``x`` overwritten in place by global rank ``src``'s; returns ``x``."""
    dist.broadcast(x, src=src, group=group)
    return x


def broadcast_objects(objs: list, src: int = 0, group=None) -> list:
    """``objs`` (a list, changed in place) replaced by rank ``src``'s picklable objects."""
    dist.broadcast_object_list(objs, src=src, group=group)
    return objs


def new_group(ranks, backend: str | None = None):
    """A process group of ``ranks`` (a collective over the default group: every rank calls it, in
    the same order)."""
    return dist.new_group(list(ranks), backend=backend)


def all_gather_objects(value, group=None) -> list:
    """Every rank of ``group``'s picklable ``value``, in group rank order."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def mesh_groups(mesh) -> tuple[list, list[int]]:
    """The process groups to gather ``mesh`` over (the default group when the mesh spans the
    world, else one per mesh dim, last first) and the global rank order the gathered rows come in."""
    if mesh.size() == dist.get_world_size():
        return [None], list(range(dist.get_world_size()))
    return [mesh.get_group(d) for d in range(mesh.ndim)], mesh.mesh.permute(*reversed(range(mesh.ndim))).flatten().tolist()


def gather_objects(obj, mesh) -> list:
    """Every mesh rank's picklable ``obj``, in ``mesh_groups`` order."""
    value = [obj]
    for group in mesh_groups(mesh)[0]:
        value = [v for chunk in all_gather_objects(value, group) for v in chunk]
    return value


def gather_flat(x: Tensor, mesh, timeout: timedelta | None = None) -> Tensor:
    """``[world, n]``: every mesh rank's flat ``x`` (equal sizes), in ``mesh_groups`` order.
    ``timeout``: each stage waits at most that long (torch raises ``RuntimeError`` past it)."""
    x = x.contiguous().view(-1)
    for group in mesh_groups(mesh)[0]:
        out = x.new_empty((dist.get_world_size(group) * x.numel(),))
        work = dist.all_gather_single(out, x, group=group, async_op=True)
        # a finished work needs no timeout (hpf.emulate's threaded group finishes in the call and has none)
        work.wait() if timeout is None or work.is_completed() else work.wait(timeout=timeout)
        x = out
    return x.view(mesh.size(), -1)
