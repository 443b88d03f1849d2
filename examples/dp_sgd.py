"""DP-SGD at FSDP x TP on a tiny HF Llama, under torchrun, checked against the same steps on one device.

    torchrun --standalone --nproc-per-node 4 examples/dp_sgd.py --tp 2   # dp 2 x tp 2 on CPU/gloo
    torchrun --standalone --nproc-per-node 2 examples/dp_sgd.py --tp 1   # FSDP alone
    torchrun --standalone --nproc-per-node 4 examples/dp_sgd.py --noise 0   # the check without noise

One step of DP-SGD (Abadi et al. 2016; Opacus' ``DPOptimizer``): each example's gradient clipped to
``--max-norm`` in the whole-model L2 norm and averaged over the global batch
(``hpf.clip_per_example``), Gaussian noise of std ``noise * max_norm / B`` added
(``hpf.gaussian_like``: every element depends only on the seed, the parameter's name and its global
index, so the sharded noise is the unsharded noise's slices bit for bit), then an SGD update.

Every rank also runs the same steps on the unsharded model: a plain loop over the examples,
``clip`` by hand, the same ``gaussian_like`` noise drawn for the whole tensors; the script prints
the largest difference of the gathered parameters and exits non-zero past 1e-5.  Privacy
accounting (epsilon) needs Poisson sampling of the batches and an accountant (Opacus'
``RDPAccountant``); this example uses fixed batches and stops at the mechanics.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import hp_functional as hpf
from hp_functional.tools.models import build_model, tiny_config


def loss_fn(apply_fn, params, ids):
    """The causal LM loss of ONE sequence (``ids``: [seq]); clip_per_example passes the apply_fn to call."""
    return apply_fn(params, input_ids=ids[None], labels=ids[None], use_cache=False).loss


def reference_step(model, ids, max_norm: float, std: float, seed: int, lr: float) -> torch.Tensor:
    """The same DP-SGD step on one device: per-example gradients by a loop; returns their norms."""
    named = dict(model.named_parameters())
    total = {k: torch.zeros_like(p) for k, p in named.items()}
    norms = []
    for x in ids:
        model.zero_grad()
        model(input_ids=x[None], labels=x[None], use_cache=False).loss.backward()
        norm = torch.sqrt(sum(p.grad.double().square().sum() for p in named.values()))
        coef = min(1.0, max_norm / (norm.item() + 1e-6))
        for k, p in named.items():
            total[k] += coef * p.grad
        norms.append(norm)
    noise = hpf.gaussian_like({k: p.detach() for k, p in named.items()}, None, std=std, seed=seed)
    with torch.no_grad():
        for k, p in named.items():
            p -= lr * (total[k] / len(ids) + noise[k])
    return torch.stack(norms)


def train(mesh, steps: int = 3, batch: int = 8, seq: int = 16, max_norm: float = 5.0, noise: float = 1.0,
          lr: float = 0.05, chunk_size: int | None = None, log=print) -> tuple[float, float]:
    """``steps`` DP-SGD steps at ``mesh`` (axes ``dp``, ``tp``) and the same steps on one device: the
    largest parameter difference after them and the largest per-example norm difference."""
    dp, tp = mesh["dp"], mesh["tp"].size()
    model = build_model(tiny_config("llama"), seed=0)  # the same weights on every rank
    plan = hpf.ShardingPlan.from_hf(model) if tp > 1 else hpf.ShardingPlan({})
    apply_fn, params, shard_info = hpf.fsdp(*hpf.shard(model, plan, mesh), mesh, "dp")
    params = {k: p.detach() for k, p in params.items()}
    std = noise * max_norm / batch  # Opacus: noise_multiplier * max_grad_norm, then / batch size

    data = torch.randint(0, model.config.vocab_size, (steps, batch, seq), generator=torch.Generator().manual_seed(1))
    worst_norm = 0.0
    for step in range(steps):
        ids = data[step]
        local = ids.chunk(dp.size())[dp.get_local_rank()]  # this dp rank's examples; tp ranks share them
        grads, norms = hpf.clip_per_example(loss_fn, apply_fn, params, shard_info, local, max_norm=max_norm,
                                            chunk_size=chunk_size)
        drawn = hpf.gaussian_like(params, shard_info, std=std, seed=step)  # local: no communication
        params = {k: p - lr * (grads[k] + drawn[k]) for k, p in params.items()}

        ref_norms = reference_step(model, ids, max_norm, std, step, lr)
        mine = ref_norms.chunk(dp.size())[dp.get_local_rank()]
        worst_norm = max(worst_norm, (norms.double() - mine).abs().max().item())
        clipped = int((ref_norms > max_norm).sum())
        log(f"step {step}: per-example norms {[round(n, 2) for n in ref_norms.tolist()]}, {clipped} of {batch} clipped")
    full = hpf.unshard(params, shard_info)
    return max((full[k] - p.detach()).abs().max().item() for k, p in model.named_parameters()), worst_norm


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences), split over dp")
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--max-norm", type=float, default=5.0, help="per-example clipping norm C")
    parser.add_argument("--noise", type=float, default=1.0, help="noise multiplier sigma (0: no noise)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--chunk-size", type=int, default=None, help="examples per block (None: the method's default)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    rank0 = dist.get_rank() == 0
    drift, worst_norm = train(mesh, args.steps, args.batch, args.seq, args.max_norm, args.noise, args.lr, args.chunk_size,
                              log=lambda line: print(line, flush=True) if rank0 else None)
    if rank0:
        print(f"DP-SGD dp {world // args.tp} x tp {args.tp}, noise {args.noise}: max |param diff| vs one device "
              f"{drift:.2e}, max |norm diff| {worst_norm:.2e}")
    dist.destroy_process_group()
    return 0 if drift < 1e-5 and worst_norm < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
