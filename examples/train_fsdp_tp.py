"""FSDP x TP training of a tiny HF Llama with hp_functional's functional pieces, under torchrun.

    torchrun --standalone --nproc-per-node 4 examples/train_fsdp_tp.py --tp 2   # dp 2 x tp 2 on CPU/gloo
    torchrun --standalone --nproc-per-node 2 examples/train_fsdp_tp.py --tp 1   # FSDP alone

One step: ``torch.func.grad_and_value`` of the FSDP x TP ``apply_fn`` (``hpf.shard`` with HF's TP
plan, then ``hpf.fsdp`` over ``dp``) on this dp rank's slice of the batch; ``hpf.clip_grad_norm``
to a global norm of 1; the functional AdamW (``hpf.optim.adamw``) with a warmup + cosine schedule
and no weight decay on norms.  Every rank also trains the unsharded model on the whole batch with
``torch.optim.AdamW``, ``clip_grad_norm_`` and ``LambdaLR``, and the script exits non-zero if the
losses or the gathered parameters drift apart.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from tqdm import tqdm

import hp_functional as hpf
from hp_functional.tools.models import build_model, tiny_config


def reference(model: torch.nn.Module, schedule, peak: float, decays):
    """torch's own step on the unsharded model: AdamW in two groups (decay / none) and LambdaLR."""
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if decays(n)]},
              {"params": [p for n, p in named if not decays(n)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=peak, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda k: schedule(k) / peak)


def train(mesh, steps: int, batch: int, seq: int, device: str = "cpu") -> tuple[float, float]:
    """``steps`` FSDP x TP steps on ``mesh`` (``("dp", "tp")``) beside the unsharded model's; the
    largest loss-or-norm difference and the largest parameter difference at the end."""
    dp, tp, rank0 = mesh["dp"], mesh["tp"].size(), dist.get_rank() == 0
    model = build_model(tiny_config("llama"), device=device, seed=0)  # the same weights on every rank
    plan = hpf.ShardingPlan.from_hf(model) if tp > 1 else hpf.ShardingPlan({})
    apply_fn, params, shard_info = hpf.fsdp(*hpf.shard(model, plan, mesh), mesh, "dp")
    params = {k: p.detach() for k, p in params.items()}  # torch.func.grad needs no requires_grad

    peak, decays = 1e-2, hpf.optim.decay_mask()  # no weight decay on norms (and biases)
    schedule = hpf.optim.warmup_cosine(peak, warmup_steps=max(1, steps // 10), total_steps=steps)
    opt = hpf.optim.adamw(schedule, weight_decay=0.1, mask=decays)
    opt_state = opt.init(params)
    ref_opt, ref_sched = reference(model, schedule, peak, decays)

    def loss_fn(p, ids):
        return apply_fn(p, input_ids=ids, labels=ids, use_cache=False).loss

    step_of = torch.func.grad_and_value(loss_fn)
    gen = torch.Generator().manual_seed(1)  # a small fixed data set, cycled: the loss falls as it is learnt
    data = torch.randint(0, model.config.vocab_size, (4, batch, seq), generator=gen).to(device)
    worst, tokens = 0.0, batch * seq
    bar = tqdm(range(steps), disable=not rank0, desc=f"dp {dp.size()} x tp {tp}")
    for step in bar:
        ids = data[step % len(data)]
        local = ids.chunk(dp.size())[dp.get_local_rank()]  # this dp rank's slice; tp ranks share it
        start = time.perf_counter()
        grads, loss = step_of(params, local)
        grads, norm = hpf.clip_grad_norm(grads, shard_info, max_norm=1.0)
        with torch.no_grad():
            params, opt_state = opt.update(grads, opt_state, params)
        elapsed = time.perf_counter() - start
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, group=dp.get_group())
        mean_loss /= dp.size()

        ref_opt.zero_grad()
        ref = model(input_ids=ids, labels=ids, use_cache=False).loss
        ref.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        ref_opt.step()
        ref_sched.step()
        worst = max(worst, abs(mean_loss.item() - ref.item()), abs(norm.item() - ref_norm.item()))
        bar.set_postfix(loss=f"{mean_loss.item():.4f}", ref=f"{ref.item():.4f}", tok_s=f"{tokens / elapsed:,.0f}")
    full = hpf.unshard(params, shard_info)
    return worst, max((full[k] - p.detach()).abs().max().item() for k, p in model.named_parameters())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4, help="global batch (sequences), split over dp")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    dist.init_process_group(dist.Backend.default_device_backend_map[args.device])
    torch.set_num_threads(1)
    world = dist.get_world_size()
    mesh = init_device_mesh(args.device, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    worst, drift = train(mesh, args.steps, args.batch, args.seq, args.device)
    if dist.get_rank() == 0:
        print(f"dp {world // args.tp} x tp {args.tp}: max |loss or norm diff| {worst:.2e}, max |param diff| {drift:.2e}")
    dist.destroy_process_group()
    return 0 if worst < 1e-4 and drift < 1e-3 else 1  # Adam's normalised steps amplify fp32 rounding

if __name__ == "__main__":
    sys.exit(main())
