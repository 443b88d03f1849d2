"""FSDP x TP training of torchtitan's own Llama 3 with torchtitan's own TP plan, through hp_functional.

    pip install -e '.[titan]'                                                     # torchtitan 0.2.2
    torchrun --standalone --nproc-per-node 4 examples/torchtitan_llama.py --tp 2   # dp 2 x tp 2 on CPU/gloo

The model is ``torchtitan.models.llama3.Transformer`` from tiny ``TransformerModelArgs``; the plan
is the dict torchtitan's ``apply_tp`` hands to ``parallelize_module`` — recorded here instead of
applied (``parallelize_module`` is swapped for a recorder around the call) and given to
``hpf.ShardingPlan.from_torch``: the one-line migration (docs/torchtitan.md).  Then ``hpf.fsdp``
shards every leaf over ``dp`` as well, and each step is ``torch.func.grad_and_value`` of the
cross-entropy of ``apply_fn`` on this dp rank's slice of the batch, followed by the functional
AdamW.  Every rank also trains the unsharded model on the whole batch with ``torch.optim.AdamW``,
and the script exits non-zero if the losses or the gathered parameters drift apart.
"""

from __future__ import annotations

import argparse
import importlib
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import hp_functional as hpf


def torchtitan_tp_plan(model: torch.nn.Module) -> dict:
    """The ``{module path: style}`` entries torchtitan's ``apply_tp`` hands to ``parallelize_module``."""
    from torchtitan.models.llama3.infra.parallelize import apply_tp

    home = importlib.import_module(apply_tp.__module__)
    paths = {id(m): n for n, m in model.named_modules()}
    plan: dict = {}

    def record(module, device_mesh=None, parallelize_plan=None, **_):
        prefix = paths[id(module)]
        plan.update({".".join(p for p in (prefix, k) if p): v for k, v in parallelize_plan.items()})
        return module

    real, home.parallelize_module = home.parallelize_module, record
    try:
        apply_tp(model, None, False, False)  # (model, tp_mesh, loss_parallel, enable_float8_tensorwise_tp)
    finally:
        home.parallelize_module = real
    return plan


def main() -> int:
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4, help="global batch (sequences), split over dp")
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    dist.init_process_group(dist.Backend.default_device_backend_map[args.device])
    torch.set_num_threads(1)
    world = dist.get_world_size()
    mesh = init_device_mesh(args.device, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp, rank0 = mesh["dp"], dist.get_rank() == 0

    torch.manual_seed(0)  # the same weights on every rank
    margs = TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32,
                                 max_seq_len=args.seq)
    model = Transformer(margs).to(args.device)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device(args.device))

    plan = hpf.ShardingPlan.from_torch(torchtitan_tp_plan(model))  # torchtitan's plan, as it stands
    apply_fn, params, shard_info = hpf.fsdp(*hpf.shard(model, plan, mesh), mesh, "dp")
    params = {k: p.detach() for k, p in params.items()}  # torch.func.grad needs no requires_grad
    opt = hpf.optim.adamw(1e-2, weight_decay=0.0)
    opt_state = opt.init(params)
    ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)

    def loss_fn(p, ids):
        logits = apply_fn(p, ids[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

    step_of = torch.func.grad_and_value(loss_fn)
    gen = torch.Generator().manual_seed(1)  # a small fixed data set, cycled: the loss falls as it is learnt
    data = torch.randint(0, margs.vocab_size, (4, args.batch, args.seq + 1), generator=gen).to(args.device)
    worst, losses = 0.0, []
    for step in range(args.steps):
        ids = data[step % len(data)]
        local = ids.chunk(dp.size())[dp.get_local_rank()]  # this dp rank's slice; tp ranks share it
        grads, loss = step_of(params, local)
        with torch.no_grad():
            params, opt_state = opt.update(grads, opt_state, params)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, group=dp.get_group())
        mean_loss /= dp.size()

        ref_opt.zero_grad()
        ref = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        ref.backward()
        ref_opt.step()
        worst = max(worst, abs(mean_loss.item() - ref.item()))
        losses.append(mean_loss.item())
    full = hpf.unshard(params, shard_info)
    drift = max((full[k] - p.detach()).abs().max().item() for k, p in model.named_parameters())
    if rank0:
        print(f"torchtitan llama3 dp {dp.size()} x tp {args.tp}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
              f"max |loss diff| {worst:.2e}, max |param diff| {drift:.2e}")
    dist.destroy_process_group()
    return 0 if worst < 1e-4 and drift < 1e-3 else 1  # Adam's normalised steps amplify fp32 rounding


if __name__ == "__main__":
    sys.exit(main())
