"""Peak memory and time of ``hpf.clip_per_example`` against the plain step (the gradient of the mean loss),
and against Opacus 1.6 on one device.

    python benchmarks/clip_per_example.py                 # one device (world 1), then tp 2
    python benchmarks/clip_per_example.py --layouts single,tp,fsdp --batch 16 --chunks 1,4,16

In one launch of the layout's ranks (CPU/gloo), per layout (``single``: ``shard()`` on a one-rank
mesh, with Opacus beside it; ``tp``: ``shard()`` with ``ShardingPlan.from_hf`` on a tp mesh of
``--world`` ranks, every rank the whole batch; ``fsdp``: ``hpf.fsdp`` over a dp mesh, each rank
``batch / world`` examples), per variant, per rank:

* peak memory: the highest running total of the allocator's events during one call (the profiler's
  memory events, as ``bench_measure`` reads them) above what was allocated when it began;
* time: the median of interleaved calls, wall clock (``ms``) and this process's CPU time (``cpu ms``,
  steadier than the wall clock on a shared machine; a rank waiting in a collective does not count).

Variants: ``plain`` = ``torch.autograd.grad`` of the mean loss over the local batch (no clipping;
``torch.func.grad`` of it measured slower here, so this is the stricter baseline);
``ghost`` = ``clip_per_example(..., method="ghost")`` (the whole batch in one block); ``vmap cN`` =
``clip_per_example(..., method="vmap", chunk_size=N)``; on ``single`` also ``opacus gsm`` (Opacus'
``GradSampleModule`` + ``DPOptimizer.pre_step``, noise 0: per-sample gradients, clipped) and ``opacus
ghost`` (``GradSampleModuleFastGradientClipping`` with ghost clipping, its two backwards through
``DPLossFastGradientClipping``, then ``pre_step``), each on its own copy of the unsharded model.  The
table shows the largest rank's value and each variant's ratio to ``plain`` measured in the same run.
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


def _opacus(model, ids, max_norm: float) -> dict:
    """Opacus 1.6's two ways, noise 0, mean reduction, each on its own copy of the unsharded model."""
    import copy

    from opacus import GradSampleModule
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    batch, seq = ids.shape
    gsm = GradSampleModule(copy.deepcopy(model), loss_reduction="mean", strict=False)
    opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=max_norm,
                      expected_batch_size=batch, loss_reduction="mean")

    def per_sample():
        opt.zero_grad(set_to_none=True)
        gsm(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.pre_step()

    fgc = GradSampleModuleFastGradientClipping(copy.deepcopy(model), max_grad_norm=max_norm, use_ghost_clipping=True,
                                               loss_reduction="mean", strict=False)
    gopt = DPOptimizerFastGradientClipping(torch.optim.SGD(fgc.parameters(), lr=0.0), noise_multiplier=0.0,
                                           max_grad_norm=max_norm, expected_batch_size=batch, loss_reduction="mean")
    criterion = DPLossFastGradientClipping(fgc, gopt, torch.nn.CrossEntropyLoss(), loss_reduction="mean")

    def ghost():
        gopt.zero_grad(set_to_none=True)
        logits = fgc(input_ids=ids, use_cache=False).logits[:, :-1]
        loss = criterion(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), shape=(batch, seq - 1))
        loss.backward()
        gopt.pre_step()

    return {"opacus gsm": per_sample, "opacus ghost": ghost}


def measure(cfg: dict, layout: str, batch: int, seq: int, chunks: list[int], steps: int) -> dict:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    model = build_model(tiny_config("llama", **cfg), seed=0)
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        apply_fn, params, info = hpf.fsdp(*hpf.shard(model, {}, mesh), mesh, "dp")
        local = ids.chunk(world)[dist.get_rank()]
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        apply_fn, params, info = hpf.shard(model, hpf.ShardingPlan.from_hf(model) if world > 1 else {}, mesh)
        local = ids
    params = {k: v.detach() for k, v in params.items()}
    leaves = {k: v.requires_grad_() for k, v in params.items()}

    def plain():
        loss = apply_fn(leaves, input_ids=local, labels=local, use_cache=False).loss
        return torch.autograd.grad(loss, list(leaves.values()))

    variants = {"plain": plain}
    variants["ghost"] = lambda: hpf.clip_per_example(lm_loss, apply_fn, params, info, local, max_norm=1.0,
                                                      method="ghost")
    for c in chunks:
        variants[f"vmap c{c}"] = lambda c=c: hpf.clip_per_example(lm_loss, apply_fn, params, info, local, max_norm=1.0,
                                                                   chunk_size=c, method="vmap")
    if layout == "single":
        variants.update(_opacus(model, ids, 1.0))
    out = {}
    for name, fn in variants.items():
        fn()  # warm up
        out[name] = {"peak_mib": _peak(fn)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(steps):  # interleaved, so load hits every variant alike
        for name, fn in variants.items():
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    for name in variants:
        out[name]["ms"] = 1e3 * statistics.median(times[name])
        out[name]["cpu_ms"] = 1e3 * statistics.median(cpu[name])
    out["params_mib"] = sum(p.numel() * p.element_size() for p in params.values()) / 2**20
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layouts", default="single,tp")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--chunks", default="8,1")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    cfg = dict(hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 32 * 32, num_hidden_layers=args.layers,
               num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8, vocab_size=1024,
               max_position_embeddings=max(64, args.seq))
    chunks = [int(c) for c in args.chunks.split(",")]
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's start/stop lines
    print(f"machine {machine()}")
    print(f"Llama {args.layers} layers, hidden {args.hidden}, global batch {args.batch} x seq {args.seq}, world size "
          f"{args.world} for tp/fsdp, 1 for single (CPU/gloo); the largest rank's value; ratios against plain in the "
          f"same run; median of {args.steps} interleaved steps")
    for layout in args.layouts.split(","):
        world = 1 if layout == "single" else args.world
        per_rank = run_ranks(measure, world, cfg, layout, args.batch, args.seq, chunks, args.steps)
        rows = per_rank[0]
        print(f"\n{layout} (world {world}): local params {rows['params_mib']:.2f} MiB per rank")
        print(f"{'':12} {'peak MiB':>10} {'ratio':>7} {'ms':>9} {'ratio':>7} {'cpu ms':>9} {'ratio':>7}")
        plain = {c: max(r["plain"][c] for r in per_rank.values()) for c in ("peak_mib", "ms", "cpu_ms")}
        for name in [k for k in rows if k != "params_mib"]:
            cells = []
            for c, fmt in (("peak_mib", "10.2f"), ("ms", "9.1f"), ("cpu_ms", "9.1f")):
                v = max(r[name][c] for r in per_rank.values())
                cells.append(f"{v:{fmt}} {v / plain[c]:6.2f}x")
            print(f"{name:12} " + " ".join(cells))


if __name__ == "__main__":
    main()
