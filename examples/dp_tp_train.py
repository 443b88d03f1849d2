"""Data parallel x tensor parallel training of a tiny HF Llama with hp_functional, under torchrun.

    torchrun --standalone --nproc-per-node 4 examples/dp_tp_train.py --tp 2     # dp 2 x tp 2 on CPU/gloo

Each dp group steps on its own slice of the batch; TP is Megatron's f/g plan
(``hpf.megatron_plan``); gradients are averaged over ``dp`` with ``hpf.reduce_gradients``
(bucketed; ``shard()`` plans only what the plan names, so dp is the loop's), and
``torch.optim.AdamW`` steps the params pytree's local shards.  Every rank also trains the
unsharded model on the whole batch and the script exits non-zero if the losses or the gathered
parameters drift apart.  FSDP x TP with the functional optimizer: ``train_fsdp_tp.py``.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import hp_functional as hpf
from hp_functional.tools.models import build_model, tiny_config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    dist.init_process_group(dist.Backend.default_device_backend_map[args.device])
    torch.set_num_threads(1)
    world = dist.get_world_size()
    mesh = init_device_mesh(args.device, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"]

    model = build_model(tiny_config("llama"), device=args.device, seed=0)  # the same weights on every rank
    apply_fn, params, shard_info = hpf.shard(model, hpf.megatron_plan(model), mesh)
    opt = torch.optim.AdamW(params.values(), lr=1e-2)
    ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    ids = torch.randint(0, model.config.vocab_size, (2 * dp.size(), 16), generator=torch.Generator().manual_seed(1))
    ids = ids.to(args.device)
    local = ids.chunk(dp.size())[dp.get_local_rank()]  # this dp group's slice
    worst = 0.0
    for step in range(args.steps):
        opt.zero_grad()
        loss = apply_fn(params, input_ids=local, labels=local).loss
        loss.backward()
        # data parallel: the dp-mean of the gradients, one all-reduce per 25 MiB bucket
        reduced = hpf.reduce_gradients({k: p.grad for k, p in params.items()}, shard_info, mesh, "dp")
        for k, p in params.items():
            p.grad = reduced[k]
        opt.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, group=dp.get_group())
        mean_loss /= dp.size()

        ref_opt.zero_grad()
        ref = model(input_ids=ids, labels=ids).loss
        ref.backward()
        ref_opt.step()
        worst = max(worst, abs(mean_loss.item() - ref.item()))
        if dist.get_rank() == 0:
            print(f"step {step}: loss {mean_loss.item():.6f}  unsharded {ref.item():.6f}")
    full = hpf.unshard({k: p.detach() for k, p in params.items()}, shard_info)
    drift = max((full[k] - p.detach()).abs().max().item() for k, p in model.named_parameters())
    if dist.get_rank() == 0:
        print(f"dp {dp.size()} x tp {args.tp}: max |loss diff| {worst:.2e}, max |param diff| {drift:.2e}")
    dist.destroy_process_group()
    return 0 if worst < 1e-4 and drift < 1e-3 else 1  # Adam's normalised steps amplify fp32 rounding


if __name__ == "__main__":
    sys.exit(main())
