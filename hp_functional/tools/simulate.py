"""``simulate``: look at a plan at a world size this machine cannot host (8, 64, ...) in one process.

``simulate(fn, world_size=64, mesh_shape=(8, 8))`` starts torch's *fake* process group (every
collective "succeeds" without communicating; this process plays rank ``rank``), builds the
mesh, calls ``fn(mesh)`` and tears the process group down again.  What that supports:

* **plans, shapes and memory**: ``build_program``/``shard``/``lint`` run unchanged (they only
  read the mesh), on a model built on the meta device (``with torch.device("meta"):``) so a
  7B-shaped model allocates nothing;
* **the communication schedule**: ``explain(model, plan, mesh, batch=, seq=)`` runs one forward
  and backward on fake tensors and records every collective (see ``explain``);
* **not real numbers**: with the fake process group every collective returns garbage.

``local_tensors=True`` additionally runs ``fn`` under ``torch.distributed._local_tensor.
LocalTensorMode(world_size)``, where a ``LocalTensor`` holds one value per simulated rank and
collectives compute the real result across them.  What works under it (tested in
``tests/test_simulate.py``): this package's collectives whose forward and backward are both
rank-independent — ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``,
``copy_to``, ``reduce_from`` — on any mesh axis of an N-D mesh, forward, ``.backward()`` and
``torch.func.grad``, with real numbers; ``gather_from`` forward only (its backward is a split).
What does not: ``split_to``, ``partial_from`` and ``leave_region`` (and so
``Rowwise(input_layout=Replicate())``, ``Rowwise`` biases, ``PrepareInput`` Replicate → Shard)
take the rank as a Python int (the fake group's ``rank``) and give every simulated rank that
rank's slice; likewise ``shard()`` slices parameters and ``VocabEmbedding`` picks its vocabulary
range for one rank.  So a whole sharded model does **not** produce real numbers under
LocalTensorMode; numerics need real ranks (``hp-functional check``, the test pools).
"""

from __future__ import annotations

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
    """``fn(mesh)`` on a ``mesh_shape`` mesh (default ``(world_size,)``) of a fake ``world_size``
    process group, as rank ``rank``; returns what ``fn`` returns.  Mesh dims are named
    ``mesh_dim_names`` (default ``("tp",)``, ``("dp", "tp")``, ``("dp", "cp", "tp")``).
    Refuses to run when a real process group is already initialised (it would be replaced)."""
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
        from torch.distributed._local_tensor import LocalTensorMode

        with LocalTensorMode(world_size):
            return fn(mesh)
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook
