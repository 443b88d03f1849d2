"""The pipeline row: a Llama training step over 2 stages under torch's GPipe and 1F1B schedules.

    python benchmarks/pipeline_step.py            # world 2 (pp 2), CPU/gloo
    python benchmarks/pipeline_step.py --quick    # smoke run

Per schedule and micro-batch count, measured in the same run on both ranks: the median step
time (the slowest rank per step) and each stage's compute alone (forward + backward of one
micro-batch through ``apply_fn``, no communication, times the micro-batches).  The bubble
fraction is ``1 - compute of the slowest stage / step time``: the share of the step a stage
waits (fill, drain, p2p); the ideal schedule's is ``(p - 1) / (m + p - 1)`` for ``p`` stages
and ``m`` micro-batches.  The unsharded model's full-batch step runs on every rank beside it (the
peer of the ratio); on 2 cores the two stages run on one core each, so pipelining can show.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_measure import machine
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import hp_functional as hpf

SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}


def build(quick: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    size = 64 if quick else 256
    config = AutoConfig.for_model("llama", vocab_size=1024, hidden_size=size, intermediate_size=4 * size,
                                  num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                                  max_position_embeddings=512, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def loss_fn(logits, target):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), target[:, 1:].reshape(-1))


def _interleaved(fns: dict, steps: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per call of each function on this rank, the functions taking turns within every
    step (after a barrier each), so a change in machine load hits all of them alike."""
    out: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(warmup + steps):
        for k, fn in fns.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            if i >= warmup:
                out[k].append(time.perf_counter() - start)
    return out


def rank_main(opts) -> dict:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
    model = build(opts.quick)
    stage = hpf.pipeline_split(model, 2)[mesh.get_local_rank("pp")]
    apply_fn, params, _ = hpf.shard_stage(model, stage, {}, mesh)
    mod = hpf.stage_module(apply_fn, params, stage)
    batch, seq = 8, 64 if opts.quick else 128
    ids = torch.randint(0, 1024, (batch, seq), generator=torch.Generator().manual_seed(0))
    fns = {"unsharded": lambda: model(input_ids=ids, labels=ids).loss.backward()}
    for m in (4, 8):
        mb = batch // m
        x = ids[:mb] if stage.is_first else torch.randn(mb, seq, model.config.hidden_size, requires_grad=True)

        def compute(x=x, m=m, mb=mb):  # the stage's work of one step, without the pipeline
            for _ in range(m):
                out = mod(x)
                (loss_fn(out, ids[:mb]) if stage.is_last else out.sum()).backward()
            mod.zero_grad(set_to_none=True)

        fns[f"compute {m}"] = compute
        for name, cls in SCHEDULES.items():
            pipe = PipelineStage(mod, stage.index, 2, torch.device("cpu"), group=mesh.get_group("pp"))
            run = cls(pipe, n_microbatches=m, loss_fn=loss_fn)

            def step(run=run):
                run.step(ids) if stage.is_first else run.step(target=ids, losses=[])
                mod.zero_grad(set_to_none=True)

            fns[f"{name} {m}"] = step
    rows = _interleaved(fns, opts.steps, 1)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    slowest = {k: [max(r[k][i] for r in everyone) for i in range(opts.steps)] for k in rows}
    stages = {k: [statistics.median(r[k]) * 1e3 for r in everyone] for k in rows if k.startswith("compute")}
    return {"rows": slowest, "stages": stages, "shape": f"hidden {model.config.hidden_size}, batch {batch} x {seq} tokens"}


def report(result: dict) -> None:
    ms = {k: statistics.median(v) * 1e3 for k, v in result["rows"].items()}
    print(f"\nLlama 8 layers ({result['shape']}), 2 stages (pp 2), gloo; median of the slowest rank")
    print(f"{'schedule':>9} {'micro-batches':>14} {'step ms':>8} {'compute ms (stage 0/1)':>23} {'bubble':>7} "
          f"{'ideal':>6} {'vs unsharded':>13}")
    for m in (4, 8):
        for name in SCHEDULES:
            step, compute, per = ms[f"{name} {m}"], ms[f"compute {m}"], result["stages"][f"compute {m}"]
            print(f"{name:>9} {m:>14d} {step:8.1f} {per[0]:11.1f} / {per[1]:9.1f} {1 - compute / step:7.2f} "
                  f"{1 / (m + 1):6.2f} {ms['unsharded'] / step:12.2f}x")
    print(f"unsharded full-batch step: {ms['unsharded']:.1f} ms (one rank); 'vs unsharded' > 1 is faster")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    opts = parser.parse_args()
    opts.steps = opts.steps or (2 if opts.quick else 10)
    from hp_functional.cli.launch import run_ranks

    print(machine())
    report(run_ranks(rank_main, 2, opts)[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
