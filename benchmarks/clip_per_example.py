"""Peak memory and time of ``hpf.clip_per_example`` against the plain step (the gradient of the mean loss).

    python benchmarks/clip_per_example.py                 # world size 2: tp 2, and fsdp over dp 2
    python benchmarks/clip_per_example.py --layers 4 --hidden 256 --batch 16 --chunks 1,4,16

In one launch of ``--world`` ranks (CPU/gloo), per layout (``tp``: ``shard()`` with
``ShardingPlan.from_hf`` on a tp mesh, every rank the whole batch; ``fsdp``: ``hpf.fsdp`` over a dp
mesh, each rank ``batch / world`` examples), per variant, per rank:

* peak memory: the highest running total of the allocator's events during one call (the profiler's
  memory events, as ``bench_measure`` reads them) above what was allocated when it began;
* time: the median of interleaved calls.

Variants: ``plain`` = ``torch.func.grad`` of the mean loss over the local batch (no clipping),
``clip cN`` = ``clip_per_example(..., chunk_size=N)``.  The table shows the largest rank's value
and each variant's ratio to ``plain`` measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist
from bench_measure import _peak_mib, machine
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile

import hp_functional as hpf
from hp_functional.cli.launch import run_ranks
from hp_functional.tools.models import build_model, tiny_config


def lm_loss(apply_fn, params, ids):
    return apply_fn(params, input_ids=ids[None], labels=ids[None], use_cache=False).loss


def _peak(fn) -> float:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return _peak_mib(prof, "cpu")


def measure(cfg: dict, layout: str, batch: int, seq: int, chunks: list[int], steps: int) -> dict:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    model = build_model(tiny_config("llama", **cfg), seed=0)
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
    if layout == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        apply_fn, params, info = hpf.shard(model, hpf.ShardingPlan.from_hf(model), mesh)
        local = ids
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        apply_fn, params, info = hpf.fsdp(*hpf.shard(model, {}, mesh), mesh, "dp")
        local = ids.chunk(world)[dist.get_rank()]
    params = {k: v.detach() for k, v in params.items()}
    variants = {"plain": lambda: torch.func.grad(
        lambda p: apply_fn(p, input_ids=local, labels=local, use_cache=False).loss)(params)}
    for c in chunks:
        variants[f"clip c{c}"] = lambda c=c: hpf.clip_per_example(lm_loss, apply_fn, params, info, local, max_norm=1.0,
                                                                   chunk_size=c)
    out = {}
    for name, fn in variants.items():
        fn()  # warm up
        out[name] = {"peak_mib": _peak(fn)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(steps):  # interleaved, so load hits every variant alike
        for name, fn in variants.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    for name in variants:
        out[name]["ms"] = 1e3 * statistics.median(times[name])
    out["params_mib"] = sum(p.numel() * p.element_size() for p in params.values()) / 2**20
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layouts", default="tp,fsdp")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--chunks", default="1,4")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    cfg = dict(hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 32 * 32, num_hidden_layers=args.layers,
               num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8, vocab_size=1024,
               max_position_embeddings=max(64, args.seq))
    chunks = [int(c) for c in args.chunks.split(",")]
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's start/stop lines
    print(f"machine {machine()}")
    print(f"Llama {args.layers} layers, hidden {args.hidden}, global batch {args.batch} x seq {args.seq}, world size "
          f"{args.world} (CPU/gloo); the largest rank's value; ratios against plain in the same run")
    for layout in args.layouts.split(","):
        per_rank = run_ranks(measure, args.world, cfg, layout, args.batch, args.seq, chunks, args.steps)
        rows = per_rank[0]
        print(f"\n{layout}: local params {rows['params_mib']:.2f} MiB per rank")
        print(f"{'':12} {'peak MiB':>10} {'ratio':>7} {'ms':>9} {'ratio':>7}")
        plain_peak = max(r["plain"]["peak_mib"] for r in per_rank.values())
        plain_ms = max(r["plain"]["ms"] for r in per_rank.values())
        for name in [k for k in rows if k != "params_mib"]:
            peak = max(r[name]["peak_mib"] for r in per_rank.values())
            ms = max(r[name]["ms"] for r in per_rank.values())
            print(f"{name:12} {peak:10.2f} {peak / plain_peak:6.2f}x {ms:9.1f} {ms / plain_ms:6.2f}x")


if __name__ == "__main__":
    main()
