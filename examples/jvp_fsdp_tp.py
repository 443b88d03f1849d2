"""Forward-mode objectives through FSDP x TP, under torchrun, checked against one device.

    torchrun --standalone --nproc-per-node 4 examples/jvp_fsdp_tp.py          # dp 2 x tp 2 on CPU/gloo
    torchrun --standalone --nproc-per-node 2 examples/jvp_fsdp_tp.py --tp 1   # FSDP alone

Two things torch's own FSDP cannot run (pytorch#182641, #172543), on a tiny HF Llama sharded with
``hpf.shard`` (tensor parallel) and ``hpf.fsdp`` (ZeRO-3 over ``dp``):

1. **A jvp-based training objective** (MeanFlow-style): the loss penalises the directional
   derivative of the model's output along a direction ``u`` of its input embeddings,
   ``L = mean(f(x)^2) + lam * mean((J_x f . u)^2)``, where ``J_x f . u`` comes from
   ``torch.func.jvp`` *inside* the loss, and the gradient of ``L`` w.r.t. the parameters is taken
   through it (reverse over forward, through FSDP's gathers and TP's collectives).
2. **A Hessian-vector product** ``H v`` by forward over reverse, ``jvp(grad(loss))``, along a
   direction ``v`` drawn by ``hpf.gaussian_like`` (the same values at any layout).

Each dp rank holds its own half of the batch; FSDP's gradient is the dp mean, so the reference is
the same objectives on one device, averaged over the dp halves.  The script prints the largest
differences of the gathered results and exits non-zero past 1e-4 (relative).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.func import functional_call, grad, grad_and_value, jvp

import hp_functional as hpf
from hp_functional.tools.models import build_model, tiny_config

LAM = 0.5


def jvp_objective(forward, params, embeds, u):
    """``mean(f^2) + LAM * mean((J f . u)^2)`` with ``f = forward(params, embeds)`` (the logits)."""
    out, tangent = jvp(lambda e: forward(params, e), (embeds,), (u,))
    return out.square().mean() + LAM * tangent.square().mean()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def check(mesh, batch: int = 4, seq: int = 8) -> dict[str, float]:
    """Both objectives on ``mesh`` (axes ``dp``, ``tp``) against one device: the largest differences
    (the value absolute, the gradients and H v relative).  Called on every rank."""
    dp, tp = mesh["dp"], mesh["tp"]
    model = build_model(tiny_config("llama"), seed=0)  # the same weights on every rank
    plan = hpf.ShardingPlan.from_hf(model) if tp.size() > 1 else hpf.ShardingPlan({})
    apply_fn, params, shard_info = hpf.fsdp(*hpf.shard(model, plan, mesh), mesh, "dp")
    params = {k: p.detach() for k, p in params.items()}

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen)
    embeds = torch.randn(batch, seq, model.config.hidden_size, generator=gen)
    u = torch.randn(batch, seq, model.config.hidden_size, generator=gen)
    halves = [t.chunk(dp.size()) for t in (ids, embeds, u)]
    mine = [h[dp.get_local_rank()] for h in halves]  # this dp rank's examples; tp ranks share them

    # 1. the jvp objective and its gradient, sharded
    def sharded_logits(p, e):
        return apply_fn(p, inputs_embeds=e, use_cache=False).logits

    grads, value = grad_and_value(jvp_objective, argnums=1)(sharded_logits, params, mine[1], mine[2])
    full_grads = hpf.unshard(grads, shard_info)

    # 2. H v by forward over reverse, sharded; v is the same tensor at any layout
    v = hpf.gaussian_like(params, shard_info, std=1.0, seed=7)

    def sharded_loss(p):
        return apply_fn(p, input_ids=mine[0], labels=mine[0], use_cache=False).loss

    _, hv = jvp(grad(sharded_loss), (params,), (v,))
    full_hv = hpf.unshard(hv, shard_info)

    # the reference: the same objectives on one device, averaged over the dp halves
    named = {k: p.detach() for k, p in model.named_parameters()}

    def logits(p, e):
        return functional_call(model, p, (), {"inputs_embeds": e, "use_cache": False}).logits

    def loss(p, x):
        return functional_call(model, p, (), {"input_ids": x, "labels": x, "use_cache": False}).loss

    n = dp.size()
    ref_grads = [grad_and_value(jvp_objective, argnums=1)(logits, named, e, d) for e, d in zip(halves[1], halves[2],
                                                                                                strict=True)]
    ref_value = sum(val for _, val in ref_grads) / n
    ref_v = hpf.gaussian_like(named, None, std=1.0, seed=7)
    ref_hv = [jvp(grad(lambda p, x=x: loss(p, x)), (named,), (ref_v,))[1] for x in halves[0]]
    worst_grad = max(rel(full_grads[k], sum(g[k] for g, _ in ref_grads) / n) for k in named)
    worst_hv = max(rel(full_hv[k], sum(h[k] for h in ref_hv) / n) for k in named)
    value_all = value.detach().clone()
    dist.all_reduce(value_all, group=dp.get_group())
    worst_value = abs(value_all.item() / n - ref_value.item())  # the dp ranks' objectives, averaged
    return {"objective": ref_value.item(), "value": worst_value, "grad": worst_grad, "hvp": worst_hv}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="global batch (sequences), split over dp")
    parser.add_argument("--seq", type=int, default=8)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    d = check(mesh, args.batch, args.seq)
    if dist.get_rank() == 0:
        print(f"dp {world // args.tp} x tp {args.tp}: jvp objective {d['objective']:.6f}, |value diff| {d['value']:.2e}, "
              f"max rel |grad diff| {d['grad']:.2e}; Hessian-vector product max rel diff {d['hvp']:.2e}")
    dist.destroy_process_group()
    return 0 if max(d["grad"], d["hvp"]) < 1e-4 and d["value"] < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
