"""Forward+backward step time of a tensor-parallel HF Llama: hp_functional against DTensor,
HF transformers' own TP, the unsharded model, a hand-written Megatron loop, and HF's modules with
the loop's collectives patched in by hand.

    python benchmarks/tp_step.py                 # tiny + large Llama, world sizes 1, 2, 4 on CPU/gloo
    python benchmarks/tp_step.py --quick         # fewer steps (a smoke run)
    torchrun --nproc-per-node 8 benchmarks/tp_step.py --device cuda   # one world size, under torchrun

Each world size is one launch of ranks by torch's elastic launcher (``hp_functional.launch``).
Inside it every variant of a size steps the same weights and batch, the variants taking turns
within every step; the table gives each one's median (slowest rank per step), its loss against
the unsharded model, and from profiled steps (taking turns too) its collectives, host overhead and peak memory
(see ``bench_measure``).  World size 1 runs the unsharded floor (d) beside ``apply_fn`` on a
1-sized tp axis, whose ratio is the per-call overhead budget (<= 1.15x).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from bench_measure import (
    StepProfile,
    count_calls,
    median_ms,
    profile_interleaved,
    ratio,
    ratio_value,
    reset,
    run_and_report,
    slowest_rank,
    time_interleaved,
)
from bench_models import (
    SIZES,
    Size,
    Variant,
    apply_variant,
    batch,
    build_llama,
    dtensor_variant,
    hf_megatron_variant,
    hf_tp_variant,
    megatron_variant,
    model_variant,
)
from torch.distributed.device_mesh import init_device_mesh

import hp_functional as hpf
from hp_functional.cli.launch import under_torchrun

ORDER = ("d", "a", "a'", "a+", "b", "c", "e", "e'")


def compiled_variant(apply_fn, params, ids, backend: str, eager: Variant) -> tuple[Variant, dict]:
    """(a+): ``torch.compile(apply_fn)``; its first step (which compiles) is checked against eager
    (loss and every gradient) and Dynamo's graph and graph-break counts are read off."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    variant = apply_variant("a+", f"hp_functional + compile({backend})", torch.compile(apply_fn, backend=backend), params, ids)
    reset(eager)
    eager_loss = eager.step()
    eager_grads = [t.grad for t in eager.leaves]
    reset(variant)
    start = time.perf_counter()
    try:
        loss = variant.step()
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return Variant("a+", variant.label, error=f"{type(exc).__name__}: {exc}".splitlines()[0]), {}
    info = {
        "backend": backend,
        "seconds": time.perf_counter() - start,
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
        "loss_diff": (loss - eager_loss).abs().item(),
        "grad_diff": max((a - t.grad).abs().max().item() for a, t in zip(eager_grads, variant.leaves, strict=True)),
    }
    return variant, info


def measure_size(size: Size, mesh, opts: argparse.Namespace, checkpoint_dir: str) -> dict:
    """Every variant of one size on this launch's ranks; rank 0's view of the results."""
    device, world = opts.device, dist.get_world_size()
    model = build_llama(size, device)
    ids = batch(size, device)
    reference = model(input_ids=ids, labels=ids).loss.item()
    apply_fn, params, _ = hpf.shard(model, hpf.ShardingPlan.from_hf(model), mesh)
    a = apply_variant("a", "hp_functional apply_fn", apply_fn, params, ids)
    variants, compile_info = [a, dtensor_variant(model, mesh, ids)], {}
    if world > 1:  # (a'): the same model with Megatron's f/g regions, one all-reduce per block each way
        fg_fn, fg_params, _ = hpf.shard(model, hpf.megatron_plan(model), mesh)
        variants.insert(1, apply_variant("a'", "hp_functional, Megatron f/g plan", fg_fn, fg_params, ids))
    if world == 1:  # the floor, and (a) and (b) with nothing to communicate: their dispatch cost alone
        variants.insert(0, model_variant("d", "unsharded model(...)", model, ids))
    else:
        variants += [hf_tp_variant(model, checkpoint_dir, ids), megatron_variant(params, ids, model.config, mesh),
                     hf_megatron_variant(model, params, ids, mesh)]
    if opts.compile != "none":  # at world size 1 too: compiled against model(...) (on a GPU, Inductor's kernels)
        compiled, compile_info = compiled_variant(apply_fn, params, ids, opts.compile, a)
        variants.insert(1 + (world == 1), compiled)
    runnable = [v for v in variants if v.step is not None]
    loss_delta = {v.key: abs(v.step().item() - reference) for v in runnable}
    warmup, steps = opts.warmup or (2 if size.name == "large" else 5), opts.steps or (12 if size.name == "large" else 30)
    if opts.quick:
        warmup, steps = 1, max(3, steps // 4)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, time_interleaved(runnable, warmup, steps, device))
    times = slowest_rank(per_rank)
    profiles = profile_interleaved(runnable, device, dist.get_backend())
    counts = {v.key: count_calls(v) for v in runnable}
    rows = {}
    for v in variants:
        row = {"label": v.label, "error": v.error, "note": v.note}
        if v.step is not None:
            row.update(ms=median_ms(times[v.key]), times=times[v.key], loss_delta=loss_delta[v.key], profile=profiles[v.key],
                       py_calls=counts[v.key][0], aten_ops=counts[v.key][1])
        rows[v.key] = row
    return {"rows": rows, "compile": compile_info, "steps": steps}


def rank_main(opts: argparse.Namespace) -> dict:
    """One launch: every requested size at this world size.  Rank 0 makes the directory that
    (c) loads its checkpoints from and tells the others its path."""
    mesh = init_device_mesh(opts.device, (dist.get_world_size(),), mesh_dim_names=("tp",))
    shared = [tempfile.mkdtemp(prefix="hpf-bench-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    try:
        return {name: measure_size(SIZES[name], mesh, opts, os.path.join(shared[0], name)) for name in opts.sizes}
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(shared[0], ignore_errors=True)


# ---------------------------------------------------------------- the report
def _per_call_counts(rows: dict) -> str:
    """Per step, (a)'s and (e')'s Python calls and aten ops (``bench_measure.count_calls``), and
    (a)'s extra: apply_fn's own per-call path, counted (the same on a busy machine)."""
    a, e = rows.get("a", {}), rows.get("e'", {})
    if "py_calls" not in a or "py_calls" not in e:
        return "per-step counts: (a) or (e') did not run"
    return (f"per-step counts: Python calls (a) {a['py_calls']}, (e') {e['py_calls']}, apply_fn's own "
            f"{a['py_calls'] - e['py_calls']:+d}; aten ops (a) {a['aten_ops']}, (e') {e['aten_ops']}, "
            f"{a['aten_ops'] - e['aten_ops']:+d}")



def _fmt_row(key: str, rows: dict) -> str:
    row = rows[key]
    head = f"({key:<2}) {row['label']:<34}"
    if row["error"]:
        return f"{head} not run: {row['error']}"
    p: StepProfile = row["profile"]
    r = ratio_value(rows, key, "a")
    ratio = f"{r:6.2f}x" if r is not None else "      -"
    return (f"{head} {row['ms']:9.2f} {ratio} {row['loss_delta']:9.1e} {p.host_ms:8.2f} {p.peak_mib:8.1f} "
            f"{sum(p.collectives.values()):5d} {p.bytes / 2**10:9.1f}  {p.describe_collectives()} {row['note']}")


def report(results: dict[int, dict], opts: argparse.Namespace) -> None:
    """The tables, per size and world size, and the ratios the issue asks for."""
    columns = (f"{'variant':<39} {'median ms':>9} {'vs (a)':>7} {'|dloss|':>9} {'host ms':>8} {'peak MiB':>8} "
               f"{'colls':>5} {'KiB/step':>9}  collectives per step")
    floor = {name: r["rows"] for name, r in results.get(1, {}).items()}
    for name in opts.sizes:
        for world in sorted(results):
            res = results[world][name]
            rows = dict(res["rows"])
            if world > 1 and name in floor:
                rows["d"] = {**floor[name]["d"], "label": "unsharded model(...), world size 1", "times": None}
            print(f"\n== {name}: {SIZES[name].describe()} | world size {world} | {opts.device} | "
                  f"median of {res['steps']} steps ==")
            print(columns)
            for key in ORDER:
                if key in rows:
                    print(_fmt_row(key, rows))
            c = res["compile"]
            compiled = (f"torch.compile(apply_fn, backend={c['backend']!r}): {c['graphs']} graph(s), {c['breaks']} graph "
                        f"break(s), first step {c['seconds']:.1f} s; vs eager |dloss| {c['loss_diff']:.1e}, max |dgrad| "
                        f"{c['grad_diff']:.1e}") if c else None
            if world == 1:
                print(f"overhead budget: apply_fn / model(...) at a 1-sized tp axis = {ratio(rows, 'a', 'd')} (budget <= 1.15)")
                print(f"dispatch only (no communication): hp_functional / DTensor = {ratio(rows, 'a', 'b')}")
                if compiled:
                    print(f"compiled apply_fn / model(...) = {ratio(rows, 'a+', 'd')}\n{compiled}")
                continue
            print(f"hp_functional / DTensor  = {ratio(rows, 'a', 'b')}")
            print(f"hp_functional / HF TP    = {ratio(rows, 'a', 'c')}")
            print(f"hp_functional / Megatron = {ratio(rows, 'a', 'e')}")
            by_hand = ratio(rows, "a", "e'")
            print(f"hp_functional / Megatron collectives in HF modules = {by_hand} (apply_fn's own cost)")
            print(_per_call_counts(rows))
            fg = ratio(rows, "a'", "b")
            print(f"hp_functional f/g plan / DTensor = {fg}")
            if compiled:
                print(compiled)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="mesh device type: cpu (gloo), cuda (nccl), ...")
    parser.add_argument("--sizes", default="tiny,large", help=f"comma-separated, of {sorted(SIZES)}")
    parser.add_argument("--worlds", default="1,2,4", help="world sizes to launch (1 = the unsharded floor)")
    parser.add_argument("--steps", type=int, default=0, help="timed steps (default: 30 tiny, 8 large)")
    parser.add_argument("--warmup", type=int, default=0, help="untimed steps first (default: 5 tiny, 2 large)")
    parser.add_argument("--compile", default="aot_eager", help="torch.compile backend for (a+): aot_eager, inductor or none")
    parser.add_argument("--quick", action="store_true", help="1 warm-up and a quarter of the steps")
    opts = parser.parse_args(argv)
    opts.sizes = opts.sizes.split(",")
    worlds = [int(os.environ["WORLD_SIZE"])] if under_torchrun() else [int(w) for w in opts.worlds.split(",")]
    return run_and_report(rank_main, report, opts, worlds)


if __name__ == "__main__":
    sys.exit(main())
