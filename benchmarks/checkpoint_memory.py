"""Activation memory of a tensor-parallel HF Llama with and without ``shard(..., remat=True)``.

    python benchmarks/checkpoint_memory.py            # world size 2 on CPU/gloo
    python benchmarks/checkpoint_memory.py --layers 8 --seq 512

Both variants shard the same weights with ``ShardingPlan.from_hf`` in one launch of 2 ranks
(``hp_functional.cli.launch.run_ranks``) and step the same batch; per variant, per rank:

* saved bytes — what autograd keeps for the backward during the forward, counted with
  ``torch.autograd.graph.saved_tensors_hooks`` (numel * element size of every packed tensor: a
  count, not a timing), in all and without the parameter shards (which live anyway);
* peak memory — the highest running total of the allocator's alloc/free events during one
  forward + backward (the profiler's memory events, as ``bench_measure`` reads them), above what
  was allocated when the step began;
* step time — median of interleaved steps (the recompute's cost).

The table shows the slowest/largest rank and the checkpointed/plain ratio of each.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.distributed as dist
from bench_measure import _peak_mib
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile

import hp_functional as hpf
from hp_functional.cli.launch import run_ranks
from hp_functional.tools.models import build_model, tiny_config


def _saved(step, param_storages: set[int]) -> tuple[int, int]:
    """(all bytes, bytes outside the parameters' storage) saved for the backward by ``step()``'s forward."""
    total = [0, 0]

    def pack(t):
        n = t.numel() * t.element_size()
        total[0] += n
        if t.untyped_storage().data_ptr() not in param_storages:
            total[1] += n
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    loss.backward()
    return total[0], total[1]


def _peak(step) -> float:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step().backward()
    return _peak_mib(prof, "cpu")


def measure(cfg: dict, batch: int, seq: int, steps: int) -> dict[str, dict[str, float]]:
    warnings.simplefilter("ignore")  # the dropped KV cache warning (use_cache defaults to True)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = build_model(tiny_config("llama", **cfg), seed=0)
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
    variants = {}
    for name, checkpoint in (("plain", False), ("checkpointed", True)):
        apply_fn, params, _ = hpf.shard(model, hpf.ShardingPlan.from_hf(model), mesh, remat=checkpoint)
        variants[name] = (lambda f=apply_fn, p=params: f(p, input_ids=ids, labels=ids).loss, params)
    out: dict[str, dict[str, float]] = {}
    for name, (step, params) in variants.items():
        storages = {p.untyped_storage().data_ptr() for p in params.values()}
        step().backward()  # warm up
        saved, activations = _saved(step, storages)
        for p in params.values():
            p.grad = None
        out[name] = {"saved_mib": saved / 2**20, "activation_mib": activations / 2**20, "peak_mib": _peak(step)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(steps):  # interleaved, so load hits both alike
        for name, (step, params) in variants.items():
            for p in params.values():
                p.grad = None
            dist.barrier()
            t0 = time.perf_counter()
            step().backward()
            times[name].append(time.perf_counter() - t0)
    for name in variants:
        out[name]["step_ms"] = 1e3 * statistics.median(times[name])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    cfg = dict(hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 32 * 32, num_hidden_layers=args.layers,
               num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8, vocab_size=1024,
               max_position_embeddings=max(64, args.seq))
    per_rank = run_ranks(measure, args.world, cfg, args.batch, args.seq, args.steps)
    print(f"Llama {args.layers} layers, hidden {args.hidden}, batch {args.batch} x seq {args.seq}, "
          f"ShardingPlan.from_hf, world size {args.world} (CPU/gloo); the largest rank's value")
    rows = (("saved for backward (MiB)", "saved_mib"), ("  of which not parameters (MiB)", "activation_mib"),
            ("peak memory, fwd+bwd (MiB)", "peak_mib"), ("step time (ms, median)", "step_ms"))
    print(f"{'':34} {'plain':>10} {'checkpointed':>13} {'ratio':>7}")
    for label, key in rows:
        plain = max(r["plain"][key] for r in per_rank.values())
        ck = max(r["checkpointed"][key] for r in per_rank.values())
        print(f"{label:34} {plain:10.2f} {ck:13.2f} {ck / plain:7.2f}x")


if __name__ == "__main__":
    main()
