"""Greedy decoding speed of a tensor-parallel HF Llama with transformers' own ``generate()``:
``hpf.generate`` against HF's own ``tp_plan`` model (DTensor) and the unsharded model.

    python benchmarks/decode.py                  # tiny + large Llama, batch 1 and 8, tp 2 on CPU/gloo (~5 min)
    python benchmarks/decode.py --quick          # tiny only, fewer calls and tokens (a smoke run)
    python benchmarks/decode.py --fake-pg        # one process, collectives free: the software's own cost
    torchrun --nproc-per-node 2 benchmarks/decode.py --device cuda      # under torchrun (tp = its world size)

One launch of ``--tp`` ranks (``hp_functional.launch``).  Per size, every variant decodes the same
prompts from the same weights: a prompt of ``--prompt`` random tokens per row (no padding), then
``--new-tokens`` tokens greedily (``do_sample=False``, ``min_new_tokens`` = ``max_new_tokens``, so
no variant stops early and each decodes the same count), the KV cache on, in eval mode:

(a ) ``hpf.generate(apply_fn, params, ids, ...)``, ``apply_fn`` from ``shard(model,
     ShardingPlan.from_hf(model), mesh)`` (HF's Llama plan: per step 2 all-reduces per decoder
     layer, 1 for the vocab-parallel embedding and 1 all-gather of the logits);
(a') the same without the plan's embedding and head entries (``decode_plan``): both replicated,
     so a step issues only the decoder layers' all-reduces, for 2 x vocab x hidden more parameters
     per rank: what fewer collectives per token buy where each costs milliseconds (gloo);
(b ) HF's own TP: ``from_pretrained(dir, distributed_config=DistributedConfig(tp_plan="auto"))``
     (DTensor parameters), ``.generate(...)``; the checkpoint is ``model``'s, written by rank 0
     (``bench_models.hf_tp_variant``);
(c ) the unsharded ``model.generate(...)``, on every rank at once with one thread each: what one
     process with one thread computes (each tp rank has one thread too, ``HPF_THREADS``).

The variants take turns within every round, after a barrier each (``bench_measure.time_interleaved``),
so a busy spell of the shared machine hits them alike.  A call's time is its slowest rank's.  The
table: tokens/s = batch x new tokens / the median call time (the prompt's forward included);
ms/step = the median call time / new tokens (one step decodes a token for every row), best = the
fastest call's (load from other processes only ever adds to it); "(a) x" = (a)'s tokens/s over
the row's, the median of per-round ratios (under the table: a/b, a/c and a'/b, and the same from
the best calls); from profiled calls (``bench_measure.profile_interleaved``, taking turns too) the
collectives per step ("colls": the backend's own events; (a)'s one agreement of the inputs goes
through the store) and the host ms per step outside aten ops and collectives (the profiler's cost
included: compare rows, not with ms/step).  The tokens of (a), (a') and (b) are compared with (c)'s
on every rank: "same", or WRONG TOKENS, repeated under the tables.

``--fake-pg`` runs the same variants in this one process on torch's fake process group, where a
collective costs nothing but its host dispatch, timed on the thread's CPU time (what other
processes take is not counted): the table is then the software's cost per step (the generate
loop, the modelling code, the boundaries or DTensor, the compute of one rank's shard), what
decides a step where collectives are cheap; its tokens are not the model's (not checked).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from bench_measure import (
    machine,
    median_ms,
    profile_interleaved,
    ratio_value,
    run_and_report,
    slowest_rank,
    time_interleaved,
)
from bench_models import SIZES, Size, Variant, build_llama, hf_tp_variant
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh

import hp_functional as hpf
from hp_functional.cli.launch import under_torchrun

ORDER = ("a", "a'", "b", "c")


def prompts(size: Size, batch: int, length: int, device: str) -> tuple[Tensor, Tensor]:
    """``batch`` rows of ``length`` random token ids (the same on every rank) and their all-ones mask."""
    ids = torch.randint(3, size.vocab, (batch, length), generator=torch.Generator().manual_seed(batch))
    return ids.to(device), torch.ones_like(ids, device=device)


def decode_variant(key: str, label: str, generate, ids: Tensor, mask: Tensor, new_tokens: int) -> Variant:
    """A ``Variant`` whose step is one greedy ``generate`` call of exactly ``new_tokens`` tokens."""
    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=0)

    def step() -> Tensor:
        with torch.no_grad():
            return generate(ids, **kwargs)

    return Variant(key, label, step)


def decode_plan(model) -> hpf.ShardingPlan:
    """(a')'s plan: HF's, less its entries for the input embedding and the output head (both then
    replicated: no all-reduce after the lookup, no all-gather of the logits)."""
    plan = hpf.ShardingPlan.from_hf(model)
    ends = (model.get_input_embeddings(), model.get_output_embeddings())
    paths = {p for p, m in model.named_modules() if any(m is e for e in ends)}
    return plan.with_entries({k: v for k, v in plan.entries.items() if k not in paths})


def hf_model(model, checkpoint_dir: str, device: str) -> Variant:
    """(b)'s model, loaded once per size by ``bench_models.hf_tp_variant`` (rank 0 writes ``model``'s
    checkpoint, every rank loads it with ``tp_plan="auto"``): its ``Variant`` with ``.model`` set to
    HF's module (read from the step's closure), or with ``error`` (accelerate missing, ...)."""
    probe = hf_tp_variant(model, checkpoint_dir, torch.zeros(1, 1, dtype=torch.long, device=device))
    if probe.step is not None:
        cells = dict(zip(probe.step.__code__.co_freevars, probe.step.__closure__ or (), strict=True))
        if "model" not in cells:
            return Variant("b", probe.label, error="bench_models.model_variant's step no longer holds the model")
        probe.model = cells["model"].cell_contents.eval()
    return probe


def variants_at(size: Size, batch: int, models: dict, opts: argparse.Namespace) -> list[Variant]:
    """(a), (a'), (b), (c) decoding the same ``batch`` prompts; a (b) that failed to load carries its error."""
    world = dist.get_world_size()
    ids, mask = prompts(size, batch, opts.prompt, opts.device)
    out = [decode_variant(key, label, functools.partial(hpf.generate, *models[key]), ids, mask, opts.new_tokens)
           for key, label in (("a", f"hpf.generate, tp {world}"), ("a'", "hpf.generate, embed+head replicated"))]
    hf = models["b"]
    if hf.step is None:
        out.append(Variant("b", f"HF tp_plan='auto', tp {world}", error=hf.error))
    else:
        at = next(hf.model.parameters()).device
        out.append(decode_variant("b", f"HF tp_plan='auto', tp {world}", hf.model.generate, ids.to(at), mask.to(at),
                                  opts.new_tokens))
        out[-1].note = hf.note
    out.append(decode_variant("c", "unsharded model.generate", models["c"].generate, ids, mask, opts.new_tokens))
    return out


def cpu_interleaved(variants: list[Variant], warmup: int, steps: int) -> dict[str, list[float]]:
    """``time_interleaved`` on this thread's CPU time (``--fake-pg``: one process, nothing to wait
    for, so what other processes on the machine take is not counted)."""
    times: dict[str, list[float]] = {v.key: [] for v in variants}
    for i in range(warmup + steps):
        for v in variants:
            start = time.thread_time()
            v.step()
            if i >= warmup:
                times[v.key].append(time.thread_time() - start)
    return times


def _everyone(value, fake: bool) -> list:
    """``value`` of every rank (this rank's alone on the fake process group, which carries nothing)."""
    if fake:
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def measure_batch(size: Size, batch: int, models: dict, opts: argparse.Namespace) -> dict:
    """Every variant at one batch size: tokens checked, timed, profiled; rank 0's view of the results."""
    variants = variants_at(size, batch, models, opts)
    runnable = [v for v in variants if v.step is not None]
    tokens = {v.key: v.step().to("cpu") for v in runnable}  # also the first warm-up call
    same = {k: None if opts.fake_pg or k == "c" else bool(torch.equal(t, tokens["c"])) for k, t in tokens.items()}
    same = {k: None if s is None else all(r[k] for r in _everyone(same, opts.fake_pg)) for k, s in same.items()}
    warmup, calls = (1, 3) if opts.quick else (opts.warmup, opts.calls)
    if opts.fake_pg:
        times = cpu_interleaved(runnable, warmup, calls)
    else:
        times = slowest_rank(_everyone(time_interleaved(runnable, warmup, calls, opts.device), fake=False))
    profiles = profile_interleaved(runnable, opts.device, dist.get_backend(), repeat=1 if opts.quick else 2)
    rows = {}
    for v in variants:
        row = {"label": v.label, "error": v.error, "note": v.note}
        if v.step is not None:
            row.update(ms=median_ms(times[v.key]), times=times[v.key], same=same[v.key], profile=profiles[v.key],
                       tokens=tokens[v.key][0, opts.prompt:opts.prompt + 4].tolist())
        rows[v.key] = row
    return {"rows": rows, "calls": calls}


def measure_size(size: Size, mesh, opts: argparse.Namespace, checkpoint_dir: str) -> dict:
    """Every batch size of one model size on this launch's ranks."""
    size = dataclasses.replace(size, seq=opts.prompt + opts.new_tokens)  # max_position_embeddings covers the decode
    model = build_llama(size, opts.device).eval()
    models = {key: hpf.shard(model, plan, mesh)[:2] for key, plan in (("a", hpf.ShardingPlan.from_hf(model)),
                                                                         ("a'", decode_plan(model)))}
    models.update(b=hf_model(model, checkpoint_dir, opts.device), c=model)
    return {"size": size, "batches": {b: measure_batch(size, b, models, opts) for b in opts.batches}}


def rank_main(opts: argparse.Namespace) -> dict:
    """One launch: every requested size.  Rank 0 makes the directory (b) loads its checkpoints from."""
    mesh = init_device_mesh(opts.device, (dist.get_world_size(),), mesh_dim_names=("tp",))
    shared = [tempfile.mkdtemp(prefix="hpf-decode-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    try:
        return {name: measure_size(SIZES[name], mesh, opts, os.path.join(shared[0], name)) for name in opts.sizes}
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(shared[0], ignore_errors=True)


def fake_main(opts: argparse.Namespace) -> int:
    """``--fake-pg``: ``rank_main`` as rank 0 of ``--tp`` on torch's fake process group, in this process."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # also registers the "fake" backend

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's start/stop lines
    torch.set_num_threads(int(os.environ.get("HPF_THREADS", "1")))
    print(f"machine {machine()}; one process, fake process group (collectives free), "
          f"{torch.get_num_threads()} thread(s)", flush=True)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=opts.tp)
    try:
        report({opts.tp: rank_main(opts)}, opts)
    finally:
        dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------- the report
def _fmt_row(batch: int, key: str, rows: dict, new_tokens: int, fake: bool) -> str:
    row = rows[key]
    head = f"{batch:>5}  ({key:<2}) {row['label']:<34}"
    if row["error"]:
        return f"{head} not run: {row['error']}"
    p = row["profile"]
    speed = batch * new_tokens / (1e-3 * row["ms"])
    r = ratio_value(rows, key, "a")  # this row's time over (a)'s: (a)'s tokens/s over this row's
    check = "-" if row["same"] is None else ("same" if row["same"] else "WRONG TOKENS")
    best = 1e3 * min(row["times"]) / new_tokens
    colls = "-" if fake else f"{sum(p.collectives.values()) / new_tokens:.2f}"  # the fake group records none
    return (f"{head} {speed:9.1f} {row['ms'] / new_tokens:8.2f} {best:7.2f} {r:6.2f}x "
            f"{colls:>6} {p.host_ms / new_tokens:7.2f}  {check:<5} "
            f"{row['tokens']} {row['note']}")


def _speedup(rows: dict, num: str, den: str) -> str:
    """``num``'s tokens/s over ``den``'s: paired per round (``den``'s time over ``num``'s), and from
    the best calls; or why there is none."""
    r = ratio_value(rows, den, num)
    if r is None:
        return "n/a (" + (rows[den].get("error") or rows[num].get("error") or "not measured") + ")"
    return f"{r:.2f}x (best calls {min(rows[den]['times']) / min(rows[num]['times']):.2f}x)"


def _summary(batch: int, rows: dict) -> str:
    fewer = "a'"
    return (f"batch {batch}: tokens/s of hpf.generate / HF tp_plan = {_speedup(rows, 'a', 'b')}; / unsharded = "
            f"{_speedup(rows, 'a', 'c')}; embed+head replicated (a') / HF tp_plan = {_speedup(rows, fewer, 'b')}")


def report(results: dict[int, dict], opts: argparse.Namespace) -> None:
    """Per size: tokens/s of every variant at every batch size, the ratios, and the token check."""
    (world, sizes), = results.items()
    columns = (f"{'batch':>5}  {'variant':<39} {'tokens/s':>9} {'ms/step':>8} {'best':>7} {'(a) x':>7} {'colls':>6} "
               f"{'host ms':>7}  vs (c) first new tokens, row 0")
    wrong, checked = [], set()
    for name in opts.sizes:
        res = sizes[name]
        size, calls = res["size"], next(iter(res["batches"].values()))["calls"]
        pg = "fake process group, thread CPU time" if opts.fake_pg else opts.device
        print(f"\n== {name}: hidden {size.hidden}, ffn {size.intermediate}, {size.layers} layers, heads "
              f"{size.heads}/{size.kv_heads} kv, vocab {size.vocab} | tp {world} | {pg} | prompt {opts.prompt} + "
              f"{opts.new_tokens} new tokens, greedy, KV cache | median of {calls} calls ==")
        print(columns)
        for batch, b in res["batches"].items():
            for key in ORDER:
                print(_fmt_row(batch, key, b["rows"], opts.new_tokens, opts.fake_pg))
                same = b["rows"][key].get("same")
                if same is False:
                    wrong.append(f"{name} batch {batch} ({key})")
                elif same:
                    checked.add(key)
        for batch, b in res["batches"].items():
            print(_summary(batch, b["rows"]))
    if opts.fake_pg:
        print("\ntokens: not checked (the fake process group's collectives carry no values)")
    elif wrong:
        print("\n!!! WRONG TOKENS: " + ", ".join(wrong) + " decoded other tokens than the unsharded model !!!")
    else:
        ran = ", ".join(f"({k})" for k in ORDER if k in checked)
        print(f"\ntokens: {ran} decode the unsharded model's tokens wherever they ran")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="mesh device type: cpu (gloo), cuda (nccl), ...")
    parser.add_argument("--sizes", default="tiny,large", help=f"comma-separated, of {sorted(SIZES)}")
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes (prompts per call)")
    parser.add_argument("--tp", type=int, default=2, help="ranks to launch (the tp size; under torchrun its world size)")
    parser.add_argument("--prompt", type=int, default=8, help="prompt tokens per row")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens decoded per row (min = max: no early stop)")
    parser.add_argument("--calls", type=int, default=6, help="timed generate calls per variant")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls first, after the one that checks tokens")
    parser.add_argument("--fake-pg", action="store_true", help="one process on torch's fake process group (CPU)")
    parser.add_argument("--quick", action="store_true", help="tiny only, 8 new tokens, 3 timed calls (a smoke run)")
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.sizes, opts.new_tokens = "tiny", 8
    opts.sizes = opts.sizes.split(",")
    opts.batches = [int(b) for b in opts.batches.split(",")]
    if opts.fake_pg:
        return fake_main(opts)
    worlds = [int(os.environ["WORLD_SIZE"])] if under_torchrun() else [opts.tp]
    return run_and_report(rank_main, report, opts, worlds)


if __name__ == "__main__":
    sys.exit(main())
