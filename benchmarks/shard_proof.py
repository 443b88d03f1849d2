"""The cost of ``shard()``'s shard-time proof (the dataflow pass and the numeric probe on a reduced
private copy), against ``shard(..., verify=False)`` in the same run, at two model sizes.

    python benchmarks/shard_proof.py                 # world size 2 on CPU/gloo, a small and a larger Llama
    python benchmarks/shard_proof.py --world 4 --repeat 5

Per size: the median wall time of ``shard()`` without the probe, with it (its remembered verdict
forgotten first, on every rank alike) and with it remembered (the same model sharded again), the peak
memory the call allocates (the allocator's events during one call, as ``bench_measure`` reads
them; the probe's copy is one decoder layer of each kind with a 128-token vocabulary, random values), the
model's own parameter bytes, and the ratios.  The dataflow pass runs in both variants (it is
part of compiling); ``--no-dataflow`` is not offered: it decides the gradients.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_measure import _peak_mib
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile

import hp_functional as hpf
from hp_functional.cli.launch import run_ranks
from hp_functional.runtime.probe import ProbeCache
from hp_functional.tools.models import build_model, tiny_config

SIZES = {
    "small": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=8, vocab_size=128),
    "larger": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=64, vocab_size=8192),
}


def measure(size: str, repeat: int) -> dict[str, float]:
    model = build_model(tiny_config("llama", **SIZES[size]))
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    plan = hpf.ShardingPlan.from_hf(model)
    hpf.shard(model, plan, mesh)  # warm-up (imports, first-call costs)
    variants = {"plain": False, "probed": True, "remembered": True}
    cache = ProbeCache()  # the caller's: "remembered" shards again with the verdict "probed" recorded
    times: dict[str, list[float]] = {v: [] for v in variants}
    peaks = {}
    for i in range(repeat + 1):
        for name, verify in variants.items():
            if name == "probed":  # every rank forgets alike: the probe runs (its verdict is remembered after)
                cache = ProbeCache()
            if i < repeat:
                start = time.perf_counter()
                hpf.shard(model, plan, mesh, verify=verify, probe_cache=cache)
                times[name].append(time.perf_counter() - start)
            else:
                with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                    hpf.shard(model, plan, mesh, verify=verify, probe_cache=cache)
                peaks[name] = _peak_mib(prof, "cpu")
    model_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    return {**{f"{v} s": statistics.median(t) for v, t in times.items()},
            **{f"{v} MiB": m for v, m in peaks.items()}, "model MiB": model_mib}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    args = ap.parse_args()
    print(f"shard() with and without the shard-time probe, tp {args.world} on CPU/gloo (torch {torch.__version__})")
    print(f"{'size':>8} {'model MiB':>10} {'shard s':>9} {'+probe s':>9} {'time x':>7} {'again s':>8} "
          f"{'peak MiB':>9} {'+probe MiB':>11} {'probe peak / model':>19}")
    for size in args.sizes:
        per_rank = run_ranks(measure, args.world, size, args.repeat)
        worst = {k: max(r[k] for r in per_rank.values()) for k in per_rank[0]}
        print(f"{size:>8} {worst['model MiB']:10.1f} {worst['plain s']:9.3f} {worst['probed s']:9.3f} "
              f"{worst['probed s'] / worst['plain s']:7.2f} {worst['remembered s']:8.3f} {worst['plain MiB']:9.1f} "
              f"{worst['probed MiB']:11.1f} {worst['probed MiB'] / worst['model MiB']:19.2f}")


if __name__ == "__main__":
    main()
