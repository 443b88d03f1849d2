"""Fault-tolerant training of a tiny HF Llama on torchft: replica groups over a managed data-parallel
dimension, each one sharded inside by ``hpf.shard`` (TP) and, with ``--fsdp N``, ``hpf.fsdp``.

    torchft_lighthouse --min_replicas 1 --join_timeout_ms 1000 --heartbeat_timeout_ms 2000 &   # port 29510
    export TORCHFT_LIGHTHOUSE=http://localhost:29510
    REPLICA_GROUP_ID=0 torchrun --nproc-per-node 2 --master-port 29600 --max-restarts 3 examples/fault_tolerant.py &
    REPLICA_GROUP_ID=1 torchrun --nproc-per-node 2 --master-port 29601 --max-restarts 3 examples/fault_tolerant.py \\
        --crash-at 5 --fsdp 2

Each ``torchrun`` is one replica group (its own world, its own ``--master-port``); torchft's Lighthouse
keeps the quorum of groups.  ``--crash-at K`` makes the group's last rank SIGKILL itself at step K on
its first start, as a crash would: torchrun's agent restarts the group (``--max-restarts``), the
restarted group heals from the other over the network (no checkpoint read) while the other never
stops.  The groups may shard differently (``--fsdp 2`` in one, TP in the other): a group heals at its
own layout (``hpf.reshard`` inside it) and the groups average their gradients at a layout they
share.  Every group trains until ``--steps`` steps are committed and the last step had all
``--groups`` groups (or gives up at ``--max-steps``); rank 0 of each prints its step, loss and a
digest of the whole state (params and optimizer state), the same in every group.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import hp_functional as hpf
from hp_functional.tools.models import build_model, tiny_config
from hp_functional.train.fault_tolerance import FaultTolerant


def digest(ft: FaultTolerant, shard_info) -> str:
    """A digest of the group's whole state: full params and AdamW moments, gathered over the group."""
    state = ft.opt_state
    h = hashlib.sha256(str(int(state.step)).encode())
    for tree in (ft.params, state.mu, state.nu):
        for k, t in hpf.unshard(tree, shard_info).items():
            h.update(k.encode() + t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def train(mesh, group: int, args) -> tuple[FaultTolerant, dict, float]:
    """Train this replica group to the end (see the module doc); its FaultTolerant, shard_info and last loss."""
    model = build_model(tiny_config("llama"), device=args.device, seed=0)  # the same weights everywhere
    plan = hpf.ShardingPlan.from_hf(model) if mesh["tp"].size() > 1 else hpf.ShardingPlan({})
    apply_fn, params, shard_info = hpf.fsdp(*hpf.shard(model, plan, mesh), mesh, "dp_shard")
    params = {k: p.detach() for k, p in params.items()}
    opt = hpf.optim.adamw(1e-3, weight_decay=0.1)
    # every group builds the same weights (seed 0), so no step-0 sync is needed; groups at different layouts
    # (--fsdp differs) cannot take one: torchft syncs step 0 rank by rank
    ft = FaultTolerant(opt, params, opt.init(params), shard_info, replica_id=f"group_{group}",
                       timeout=timedelta(seconds=30), connect_timeout=timedelta(seconds=30), init_sync=False)

    def loss_fn(p, ids):
        return apply_fn(p, input_ids=ids, labels=ids, use_cache=False).loss

    first_start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    dp, loss, last_n = mesh["dp_shard"], float("nan"), 0
    while not (ft.step >= args.steps and last_n == args.groups):
        if ft.step >= args.max_steps:  # the same decision on every rank of the group (a step count, not a clock)
            raise SystemExit(f"group {group}: the {args.groups} groups did not come together by step {ft.step}")
        ft.start_step()
        step, n = ft.step, ft.participants
        gen = torch.Generator().manual_seed(1000 * step + group)  # this group's share of step `step`'s batch
        ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=gen).to(args.device)
        grads, value = torch.func.grad_and_value(loss_fn)(ft.params, ids.chunk(dp.size())[dp.get_local_rank()])
        if first_start and 0 <= args.crash_at <= step and dist.get_rank() == dist.get_world_size() - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash: torchrun restarts the whole group
        if ft.commit(grads):
            if dist.get_rank() == 0 and (n != last_n or step % 10 == 0):
                print(f"group {group} step {step}: loss {value.item():.4f} with {n} group(s)", flush=True)
            loss, last_n = value.item(), n
    return ft, shard_info, loss


def init_group(device: str) -> None:
    """torch.distributed's default group for this start of the replica group.  Under torchrun with a static
    ``--master-port`` and ``--max-restarts``, the agent's store outlives a restart with the dead start's
    addresses in it, and a rank that starts late reads them (gloo: "connectFullMesh failed ... Connection
    refused"): each start meets under a prefix of its own (torchrun's restart count)."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(dist.Backend.default_device_backend_map[device], store=dist.PrefixStore(
        f"fault_tolerant/start_{attempt}", store), rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fsdp", type=int, default=1, help="FSDP ranks inside a group (the rest is TP)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--groups", type=int, default=2, help="replica groups that take part in the last step")
    parser.add_argument("--max-steps", type=int, default=100_000, help="give up if they have not by this step")
    parser.add_argument("--crash-at", type=int, default=-1, help="the last rank dies at its first step >= this, once")
    parser.add_argument("--batch", type=int, default=4, help="sequences per group and step, split over --fsdp")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    init_group(args.device)
    torch.set_num_threads(1)
    group, world = int(os.environ.get("REPLICA_GROUP_ID", 0)), dist.get_world_size()
    mesh = init_device_mesh(args.device, (args.fsdp, world // args.fsdp), mesh_dim_names=("dp_shard", "tp"))
    ft, shard_info, loss = train(mesh, group, args)
    state = digest(ft, shard_info)
    if dist.get_rank() == 0:
        print(f"group {group} done: step {ft.step} loss {loss:.4f} state {state}")
    ft.shutdown()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
