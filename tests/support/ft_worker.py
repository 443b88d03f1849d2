"""One rank of one replica group under torchft, for tests/train/test_fault_tolerance.py.

``run_rank`` is forked (from the rank pool's forkserver) once per rank and per attempt of a replica
group: it joins its group's own gloo world of ``tp`` ranks, shards the test MLP at the group's layout
(``cfg["layouts"][replica]``: ``"tp"``, the default, or ``"fsdp"``), and trains
with ``FaultTolerant`` until ``steps`` steps are committed and the last one had ``want``
participants.  Rank 0 appends every committed step to ``progress_<replica>`` and writes the final
full state to ``replica<replica>.pt``.  ``cfg["kill"]`` makes a rank SIGKILL itself, as a crash
would: ``{(replica, attempt): (rank, step)}`` after the backward of that step, before its commit;
``(rank, "recv")`` when its group starts receiving a peer's state (torchft's recovery transfer).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import hp_functional as hpf
from hp_functional.train.fault_tolerance import FaultTolerant
from tests.support.models import MLP, PLANS, make_mlp_state

LR = 1e-2


def batch(step: int, replica: int) -> torch.Tensor:
    """Replica ``replica``'s slice of step ``step``'s batch (the same on every rank of the group)."""
    return torch.randn(4, 3, 16, generator=torch.Generator().manual_seed(1000 * step + replica))


def loss_fn(apply_fn, params, x):
    return apply_fn(params, x).pow(2).mean()


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _transport(timeout: timedelta, dies: bool):
    """torchft's HTTPTransport; one that dies as it starts receiving when ``dies``."""
    from torchft.checkpointing import HTTPTransport

    class DiesReceiving(HTTPTransport):
        def recv_checkpoint(self, *args, **kwargs):
            _die()

    return (DiesReceiving if dies else HTTPTransport)(timeout=timeout, num_chunks=0)


def _setup(cfg: dict, replica: int, attempt: int, rank: int, port: int):
    out = os.path.join(cfg["out"], f"log_{replica}_{attempt}_{rank}")
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(cfg["tp"]))
    timeout = timedelta(seconds=cfg["timeout"])
    dist.init_process_group("gloo", timeout=timeout)
    apply_fn, params, info = sharded(cfg["layouts"].get(replica, "tp"), cfg["tp"])
    opt = hpf.optim.adamw(LR)
    kill = cfg["kill"].get((replica, attempt))
    transport = _transport(timeout, kill is not None and kill[0] == rank and kill[1] == "recv")
    ft = FaultTolerant(opt, params, opt.init(params), info, replica_id=f"replica_{replica}", lighthouse=cfg["lighthouse"],
                       hostname="127.0.0.1", timeout=timeout, quorum_timeout=timedelta(seconds=cfg["quorum_timeout"]),
                       connect_timeout=timedelta(seconds=10), checkpoint_transport=transport,
                       init_sync=cfg.get("init_sync", True))
    if attempt == 0:  # the first starts wait for each other, so that the first quorum has every group
        _barrier(cfg, f"ready_{replica}_{rank}", cfg["groups"] * cfg["tp"])
    return apply_fn, info, ft, kill


def sharded(layout: str, ranks: int) -> tuple:
    """The test MLP over the group's ``ranks``: ``"tp"`` (colwise/rowwise over a ``tp`` mesh) or ``"fsdp"``
    (``hpf.fsdp`` over a ``dp`` mesh: every leaf's rows chunked over the ranks, each rank feeding the whole batch)."""
    model = MLP()
    model.load_state_dict(make_mlp_state())
    if layout == "tp":
        return hpf.shard(model, PLANS["tp"], init_device_mesh("cpu", (ranks,), mesh_dim_names=("tp",)))
    mesh = init_device_mesh("cpu", (ranks,), mesh_dim_names=("dp",))
    apply_fn, params, info = hpf.fsdp(*hpf.shard(model, {}, mesh), mesh, "dp")
    return apply_fn, {k: p.detach() for k, p in params.items()}, info


def _barrier(cfg: dict, name: str, count: int) -> None:
    """Wait (up to ``cfg["timeout"]``) until ``count`` processes have written their ``ready_*`` file."""
    open(os.path.join(cfg["out"], name), "w").close()
    end = time.monotonic() + cfg["timeout"]
    while sum(f.startswith("ready_") for f in os.listdir(cfg["out"])) < count:
        if time.monotonic() > end:
            raise TimeoutError("the replica groups' first starts did not all come up")
        time.sleep(0.02)


def run_rank(cfg: dict, replica: int, attempt: int, rank: int, port: int) -> None:
    """Train one rank of replica group ``replica`` (its ``attempt``-th start) to the end; see the module doc."""
    apply_fn, info, ft, kill = _setup(cfg, replica, attempt, rank, port)
    log: list[tuple[int, int, float]] = []  # committed steps: (step, participants, loss)
    progress = os.path.join(cfg["out"], f"progress_{replica}")
    for _ in range(cfg["max_tries"]):
        if ft.step >= cfg["steps"] and log and log[-1][1] == cfg["want"]:
            break
        ft.start_step()
        step, n = ft.step, ft.participants
        loss, grads = torch.func.grad_and_value(lambda p, x: loss_fn(apply_fn, p, x))(ft.params, batch(step, replica))[::-1]
        if kill is not None and kill == (rank, step):
            _die()
        if ft.commit(grads):
            log.append((step, n, loss.item()))
            if rank == 0:
                with open(progress, "a") as f:
                    f.write(f"{step} {n}\n")
        time.sleep(cfg["pause"])  # leaves the 2 cores to the groups that restart
    else:
        raise RuntimeError(f"replica {replica}: not done after {cfg['max_tries']} tries; committed {log}")
    full = hpf.unshard(ft.params, info)
    state = ft.opt_state
    mu, nu = hpf.unshard(state.mu, info), hpf.unshard(state.nu, info)
    if rank == 0:
        torch.save({"params": full, "mu": mu, "nu": nu, "opt_step": state.step, "step": ft.step, "log": log,
                    "pid": os.getpid()}, os.path.join(cfg["out"], f"replica{replica}.pt"))
    ft.shutdown()
    dist.destroy_process_group()
