"""The Muon row: one optimizer step of ``hpf.optim.muon`` on a Llama laid out FSDP x TP (dp 2 x tp 2),
against an AdamW step on the same layout and against the naive distributed Muon that gathers every
matrix whole on every rank (``hpf.unshard``), orthogonalises all of them everywhere and slices its
shard back.

    python benchmarks/muon_step.py            # world 4, CPU/gloo, a 4-layer Llama of hidden 256
    python benchmarks/muon_step.py --quick    # smoke run (hidden 64)

The three take turns within every step on the same params and gradients (random, fixed); per
variant: the median step time (the slowest rank per step), the collectives of one step (counted by
a dispatch mode), and the largest whole-matrix bytes a rank holds at once (the owner's bucket for
Muon, every matrix for the naive gather).  Only the optimizer step is timed (no forward/backward).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.distributed as dist
from bench_measure import machine
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

import hp_functional as hpf
from hp_functional.core.owner_gather import plan_owners
from hp_functional.train.optim_muon import is_matrix, orthogonalized

LR = 0.02


class Collectives(TorchDispatchMode):
    """Counts the collectives dispatched (c10d's and the functional ones)."""

    NAMES = ("alltoall", "all_gather", "allgather", "reduce_scatter", "all_reduce", "allreduce")

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if any(n in name for n in self.NAMES) and "wait" not in name:
            self.count += 1
        return func(*args, **(kwargs or {}))


def build(quick: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    h = 64 if quick else 256
    config = LlamaConfig(vocab_size=512 if quick else 2048, hidden_size=h, intermediate_size=int(2.75 * h),
                         num_hidden_layers=2 if quick else 4, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def naive_muon(info, bucket_bytes: int):
    """Muon by gathering every matrix on every rank: ``hpf.unshard`` of the updates, Newton–Schulz of
    every matrix on every rank, each rank's shard sliced back; AdamW on the rest (as ``muon``)."""
    rest = hpf.optim.adamw(LR, weight_decay=0.1)

    def step(grads, state, params):
        mat = [k for k in params if is_matrix(k, info[k].global_shape, None)]
        bufs = {k: torch.lerp(state[0][k], grads[k], 0.05) for k in mat}
        updates = {k: grads[k].lerp(bufs[k], 0.95).bfloat16() for k in mat}
        whole = hpf.unshard(updates, {k: info[k] for k in mat})
        ortho = orthogonalized(whole, None, {}, bucket_bytes, ((3.4445, -4.7750, 2.0315), 5, 1e-7))
        new = dict(params)
        for k in mat:
            scale = LR * math.sqrt(max(1, info[k].global_shape[0] / info[k].global_shape[1]))
            new[k] = params[k].mul(1 - LR * 0.1).add(hpf.slice_local(ortho[k], info[k]), alpha=-scale)
        others = [k for k in params if k not in bufs]
        rest_p, rest_s = rest.update({k: grads[k] for k in others}, state[1], {k: params[k] for k in others})
        return {**new, **rest_p}, (bufs, rest_s)

    def init(params):
        mat = [k for k in params if is_matrix(k, info[k].global_shape, None)]
        return ({k: torch.zeros_like(params[k]) for k in mat},
                rest.init({k: params[k] for k in params if k not in mat}))
    return init, step


def rank_main(opts) -> dict:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = build(opts.quick)
    _, params, info = hpf.fsdp(*hpf.shard(model, hpf.ShardingPlan.from_hf(model), mesh), mesh, "dp")
    g = torch.Generator().manual_seed(1)
    grads = {k: hpf.slice_local(torch.randn(i.global_shape, generator=g), i) for k, i in info.items()}
    muon = hpf.optim.muon(LR, shard_info=info, bucket_bytes=opts.bucket_mib * 2**20)
    adamw = hpf.optim.adamw(LR, weight_decay=0.1)
    naive_init, naive_step = naive_muon(info, opts.bucket_mib * 2**20)
    variants = {"adamw": (adamw.update, adamw.init(params)), "muon": (muon.update, muon.init(params)),
                "gather_all": (naive_step, naive_init(params))}
    check = {k: v[0](grads, v[1], params)[0] for k, v in variants.items()}  # warm-up; the owners decided
    diff = max((check["muon"][k] - check["gather_all"][k]).abs().max().item() for k in params)
    times: dict[str, list[float]] = {k: [] for k in variants}
    counts = {}
    for step in range(opts.steps):
        for key, (update, state) in variants.items():
            dist.barrier()
            start = time.perf_counter()
            if step == 0:
                with Collectives() as counted:
                    update(grads, state, params)
                counts[key] = counted.count
            else:
                update(grads, state, params)
            times[key].append(time.perf_counter() - start)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, times)
    slowest = {k: [max(r[k][i] for r in everyone) for i in range(1, opts.steps)] for k in variants}
    return {"ms": {k: 1e3 * sorted(v)[len(v) // 2] for k, v in slowest.items()}, "counts": counts, "diff": diff,
            "memory": _memory(info, opts.bucket_mib * 2**20), "size": sum(i.global_shape.numel() for i in info.values())}


def _memory(info, bucket_bytes: int) -> dict[str, int]:
    """The most whole-matrix bytes (bf16) a rank holds at once: Muon's largest owned bucket, the naive all."""
    keys = [k for k in info if is_matrix(k, info[k].global_shape, None)]
    plan = plan_owners(info, keys, lambda k: len(info[k].global_shape) == 3, bucket_bytes, "bench")
    owned = max(sum(2 * math.prod(plan.units[u].shape) for u in plan.owned(b)) for b in range(len(plan.buckets)))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, owned)
    return {"muon": max(everyone), "gather_all": sum(2 * info[k].global_shape.numel() for k in keys),
            "buckets": len(plan.buckets)}


def report(r: dict, opts) -> None:
    mib = 2**20
    print(f"\nLlama ({r['size'] / 1e6:.2f} M params), FSDP x TP dp 2 x tp 2, gloo; optimizer step only, median of "
          f"the slowest rank over {opts.steps - 1} steps; Muon buckets of {opts.bucket_mib} MiB ({r['memory']['buckets']})")
    print(f"{'variant':>12} {'ms':>9} {'collectives':>12} {'whole MiB':>10}")
    for key in ("adamw", "muon", "gather_all"):
        held = r["memory"].get(key, 0) / mib
        print(f"{key:>12} {r['ms'][key]:9.2f} {r['counts'][key]:12d} {held:10.2f}")
    ms = r["ms"]
    print(f"muon/adamw {ms['muon'] / ms['adamw']:.2f}x; gather_all/muon {ms['gather_all'] / ms['muon']:.2f}x; "
          f"muon vs gather_all max |diff| {r['diff']:.1e}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--bucket-mib", type=int, default=4)
    opts = parser.parse_args()
    opts.steps = opts.steps or (3 if opts.quick else 8)
    from hp_functional.cli.launch import run_ranks

    print(machine())
    report(run_ranks(rank_main, 4, opts)[0], opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
