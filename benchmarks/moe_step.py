"""The MoE row: a Mixtral training step with experts sharded over ``ep`` against the unsharded model.

    python benchmarks/moe_step.py            # world 2 (ep 2) and world 4 (ep 2 x tp 2), CPU/gloo
    python benchmarks/moe_step.py --quick    # smoke run

Per variant, measured in the same run on every rank (``bench_measure``): the median step time
(forward + backward, the slowest rank per step), the collectives per step and their bytes (the
process group's own events), the step's peak memory above its start, and the parameter bytes
a rank holds: all of them and the routed experts' alone, which fall as ``1/ep`` (``1/(ep·tp)``
with TP inside the experts).  The
unsharded model runs on every rank beside the sharded one (the peer of the ratio).
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.distributed as dist
from bench_measure import machine, median_ms, profile_interleaved, ratio, slowest_rank, time_interleaved
from bench_models import apply_variant, model_variant
from torch.distributed.device_mesh import init_device_mesh

import hp_functional as hpf

MESHES = {2: ((2,), ("ep",)), 4: ((2, 2), ("ep", "tp"))}


def build(quick: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    size = 128 if quick else 512
    config = AutoConfig.for_model(
        "mixtral", vocab_size=1024, hidden_size=size, intermediate_size=2 * size, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=256, output_router_logits=True, router_aux_loss_coef=0.02)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def rank_main(opts) -> dict:
    torch.set_num_threads(1)
    shape, names = MESHES[dist.get_world_size()]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = build(opts.quick)
    apply_fn, params, _ = hpf.shard(model, hpf.ShardingPlan.from_hf(model, ep_axis="ep"), mesh)
    ids = torch.randint(0, 1024, (4, 64 if opts.quick else 256), generator=torch.Generator().manual_seed(0))
    variants = [model_variant("unsharded", "unsharded model", model, ids),
                apply_variant("ep", "+".join(f"{n} {s}" for n, s in zip(names, shape, strict=True)), apply_fn, params, ids)]
    times = time_interleaved(variants, warmup=1 if opts.quick else 2, steps=opts.steps, device="cpu")
    profiles = profile_interleaved(variants, "cpu", "gloo", repeat=1 if opts.quick else 3)
    experts = {"unsharded": _bytes(p for n, p in model.named_parameters() if ".experts." in n),
               "ep": _bytes(p for n, p in params.items() if ".experts." in n)}
    held = {"unsharded": _bytes(model.parameters()), "ep": _bytes(params.values())}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, times)
    return {v.key: dict(label=v.label, times=slowest_rank(everyone)[v.key], profile=profiles[v.key],
                        experts=experts[v.key], params=held[v.key]) for v in variants}


def report(world: int, rows: dict) -> None:
    mib = 2**20
    print(f"\nMixtral, 8 experts top-2, world {world} ({rows['ep']['label']}), gloo; median of the slowest rank per step")
    print(f"{'variant':>18} {'ms':>8} {'collectives':>12} {'MiB moved':>10} {'peak MiB':>9} {'params MiB':>11} "
          f"{'experts MiB':>12}")
    for r in rows.values():
        r["ms"] = median_ms(r["times"])
        p = r["profile"]
        print(f"{r['label']:>18} {r['ms']:8.1f} {sum(p.collectives.values()):12d} {p.bytes / mib:10.2f} "
              f"{p.peak_mib:9.1f} {r['params'] / mib:11.2f} {r['experts'] / mib:12.2f}")
    shape, names = MESHES[world]
    share = 1 / math.prod(shape)  # experts over ep, and inside each expert over tp
    print(f"step time ep/unsharded: {ratio(rows, 'ep', 'unsharded')}; expert bytes per rank "
          f"{rows['ep']['experts'] / rows['unsharded']['experts']:.3f} of the model's "
          f"(1/({'·'.join(names)}) = {share:.3f})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    opts = parser.parse_args()
    opts.steps = opts.steps or (2 if opts.quick else 8)
    from hp_functional.cli.launch import run_ranks

    print(machine())
    for world in opts.worlds:
        report(world, run_ranks(rank_main, world, opts)[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
