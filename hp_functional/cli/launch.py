"""Run a function on N local ranks with torch's own elastic launcher (what ``torchrun`` uses).

Under ``torchrun`` (``LOCAL_RANK`` is set) the function simply runs in this process.
"""

from __future__ import annotations

__all__ = ["run_ranks"]

import os
import uuid
from collections.abc import Callable

import torch.distributed as dist


def under_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_ranks(fn: Callable, nproc: int, *args) -> dict[int, object]:
    """``fn(*args)`` on ``nproc`` spawned local ranks (process group initialised by ``fn``'s
    wrapper); returns each rank's result.  Runs in-process when already under torchrun."""
    if under_torchrun():
        return {int(os.environ["RANK"]): _entry(fn, *args)}
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"hpf-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, start_method="spawn",
    )
    return elastic_launch(config, _entry)(fn, *args)


def _entry(fn: Callable, *args):
    import torch

    torch.set_num_threads(int(os.environ.get("HPF_THREADS", "1")))
    backend = os.environ.get("HPF_BACKEND", "gloo")
    if not dist.is_initialized():
        dist.init_process_group(backend)
    try:
        return fn(*args)
    finally:
        dist.destroy_process_group()
