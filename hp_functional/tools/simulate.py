"""``simulate``: look at a plan at a world size this machine cannot host (8, 64, ...) in one process.

``simulate(fn, world_size=64, mesh_shape=(8, 8))`` runs ``fn(mesh)`` on torch's *fake* process
group (this process plays one rank; every collective "succeeds" without communicating and returns
garbage): plans, shapes, lint, the schedule and memory of a meta model work, real numbers do not.
See docs/tools.md#simulate.
"""

from __future__ import annotations

__all__ = ["simulate"]

import math
import sys
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

T = TypeVar("T")

_DEFAULT_NAMES = {1: ("tp",), 2: ("dp", "tp"), 3: ("dp", "cp", "tp")}


def simulate(
    fn: Callable[[DeviceMesh], T],
    *,
    world_size: int,
    mesh_shape: tuple[int, ...] | None = None,
    mesh_dim_names: tuple[str, ...] | None = None,
    rank: int = 0,
    local_tensors: bool = False,
    device_type: str = "cpu",
) -> T:
    """``fn(mesh)`` on a mesh of a fake ``world_size`` process group, as rank ``rank``; the group is
    destroyed afterwards.  Refuses to run when a process group is already initialised (it would be
    replaced).

    Args:
        fn: called once with the mesh.
        world_size: the simulated number of ranks.
        mesh_shape: the mesh's shape, whose product must be ``world_size``; None: ``(world_size,)``.
        mesh_dim_names: its dim names; None: ``("tp",)``, ``("dp", "tp")`` or ``("dp", "cp", "tp")`` by its rank
            (required for 4 or more dims).
        rank: which rank this process plays.
        local_tensors: also run ``fn`` under ``LocalTensorMode(world_size)`` (real per-rank values for some
            collectives only: docs/tools.md#simulate).
        device_type: the mesh's device type.
    Returns:
        what ``fn`` returns."""
    if dist.is_initialized():
        raise RuntimeError("simulate() needs no process group initialised: it starts (and destroys) a fake one; "
                           "call it outside torchrun/spawned ranks or after destroy_process_group()")
    shape = tuple(mesh_shape or (world_size,))
    if math.prod(shape) != world_size:
        raise ValueError(f"mesh_shape {shape} has {math.prod(shape)} ranks, world_size is {world_size}")
    names = tuple(mesh_dim_names or _DEFAULT_NAMES.get(len(shape), ()))
    if len(names) != len(shape):
        raise ValueError(f"mesh_dim_names {names} does not name every dim of mesh_shape {shape}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # also registers the "fake" backend

    hook = sys.excepthook  # init_process_group prefixes tracebacks with "[rank0]:" and never undoes it
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        if not local_tensors:
            return fn(mesh)
        # Under LocalTensorMode a LocalTensor holds one value per simulated rank, and the collectives whose forward
        # and backward are both rank-independent (all_reduce, all_gather, reduce_scatter, all_to_all, copy_to,
        # reduce_from; gather_from forward only) give real results on any axis of an N-D mesh, under .backward()
        # and torch.func.grad (tests/tools/test_simulate.py).  split_to, partial_from and leave_region (so
        # Rowwise(input_layout=Replicate()), Rowwise biases, PrepareInput Replicate → Shard) take the fake group's
        # rank as a Python int and give every simulated rank that rank's slice; so do shard()'s parameter slicing
        # and VocabEmbedding's vocabulary range.  A whole sharded model gives no real numbers here: use real ranks.
        from torch.distributed._local_tensor import LocalTensorMode

        with LocalTensorMode(world_size):
            return fn(mesh)
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook
