"""Raw bytes between any ranks of a set of meshes: one variable-split all-to-all (``hpf.reshard``'s
transfer) and one small all-gather (its agreement), over one process group that spans the meshes.

Bytes, so that one buffer carries tensors of every dtype bit for bit (each viewed as ``uint8``).
The group is the default one when the meshes span the world, else the group of a 1-D mesh over the
same ranks: choosing it is local and alike on every rank, and it creates no process group.
"""

from __future__ import annotations

__all__ = ["Exchange", "exchange_over"]

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .errors import PlanError
from .raw_collectives import mesh_device


def mesh_ranks(mesh) -> list[int]:
    """The global ranks of ``mesh``, sorted."""
    return sorted(mesh.mesh.reshape(-1).tolist())


@dataclass(frozen=True)
class Exchange:
    """A process group over a set of ranks: ``ranks[i]`` is the global rank of its group rank ``i``,
    ``index`` this rank's group rank, ``device`` where the buffers live (the meshes' device type)."""

    group: object  # a ProcessGroup, or None: the default group
    ranks: tuple[int, ...]
    index: int
    device: torch.device

    @property
    def size(self) -> int:
        return len(self.ranks)

    def all_to_all(self, send: Tensor, send_splits: Sequence[int], recv_splits: Sequence[int]) -> Tensor:
        """One variable-split all-to-all of flat ``uint8`` buffers: the first ``send_splits[0]``
        bytes of ``send`` go to group rank 0, the next ``send_splits[1]`` to rank 1, ...; returns
        the bytes received, ``recv_splits[k]`` from rank ``k``, in rank order.  Every rank of the
        group calls it with matching splits (rank ``k``'s ``send_splits[j]`` is rank ``j``'s
        ``recv_splits[k]``)."""
        if len(send_splits) != self.size or len(recv_splits) != self.size or send.numel() != sum(send_splits):
            raise ValueError(f"all_to_all over ranks {list(self.ranks)}: splits {list(send_splits)} / "
                             f"{list(recv_splits)} are not one per rank or do not cover the {send.numel()} bytes sent")
        out = torch.empty(sum(recv_splits), dtype=torch.uint8, device=self.device)
        dist.all_to_all_single(out, send.contiguous(), list(recv_splits), list(send_splits), group=self.group)
        return out

    def all_gather(self, x: Tensor) -> Tensor:
        """``[size, *x.shape]``: every group rank's ``x`` (equal shapes), in group rank order; one collective."""
        x = x.contiguous().to(self.device)
        out = x.new_empty((self.size, *x.shape))
        dist.all_gather_single(out.view(-1), x.view(-1), group=self.group)
        return out


def exchange_over(meshes: Sequence, what: str) -> Exchange:
    """The ``Exchange`` over the ranks of ``meshes`` (DeviceMeshes), decided locally: the default
    group when they span the world, else the group of one of them that is 1-D.  A ``PlanError``
    (alike on every rank of the meshes, before any collective) when the meshes hold different ranks
    or device types, this rank is not in them, or they cover part of the world and none is 1-D."""
    first = meshes[0]
    ranks = mesh_ranks(first)
    for m in meshes[1:]:
        if mesh_ranks(m) != ranks or m.device_type != first.device_type:
            raise PlanError(f"{what}: the meshes are over different ranks or devices ({first.device_type} ranks {ranks} "
                            f"vs {m.device_type} ranks {mesh_ranks(m)}): both layouts must cover the same ranks")
    me = dist.get_rank()
    if me not in ranks:
        raise PlanError(f"{what}: this rank ({me}) is not in the meshes (ranks {ranks})")
    device = mesh_device(first)
    if ranks == list(range(dist.get_world_size())):
        return Exchange(None, tuple(ranks), me, device)
    flat = next((m for m in meshes if m.ndim == 1), None)
    if flat is None:
        raise PlanError(f"{what}: the meshes cover ranks {ranks}, part of the world's {dist.get_world_size()}, and none "
                        "is 1-D: give one side as a 1-D mesh of those ranks (its process group carries the exchange)")
    group = flat.get_group(0)
    order = tuple(dist.get_global_rank(group, i) for i in range(dist.get_world_size(group)))
    return Exchange(group, order, order.index(me), device)
