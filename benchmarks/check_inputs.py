"""What ``apply_fn``'s run-time input agreement costs, measured in the same run at world size 2 (tp 2, CPU/gloo).

    python benchmarks/check_inputs.py

* the default (shapes): a signature agreed before is only looked up — the per-call cost is the
  signature's computation, timed directly (``input_check.check`` on an agreed signature) and as a
  share of the forward;
* ``HPF_CHECK_INPUTS=1`` (``apply_fn.input_check.values = True``): every call checksums its tensor
  inputs and exchanges the digests through the store — the forward with it against without it,
  interleaved, median of ``REPEATS``.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import hp_functional as hpf
from hp_functional.cli.launch import run_ranks

REPEATS = 30
BATCHES = {"2x128": (2, 128), "8x512": (8, 512)}


def measure() -> dict[str, tuple[float, float, float]]:
    """Runs on every rank: per batch (median forward ms unchecked, ms with values, µs of the cached shape check)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                                         num_attention_heads=8, num_key_value_heads=4))
    apply_fn, params, _ = hpf.shard(model, hpf.ShardingPlan.from_hf(model), mesh)
    check = apply_fn.input_check
    out = {}
    for name, shape in BATCHES.items():
        ids = torch.randint(0, 4096, shape, generator=torch.Generator().manual_seed(1))
        times = {False: [], True: []}
        with torch.no_grad():
            apply_fn(params, input_ids=ids, labels=ids)  # agrees the signature once
            for _ in range(REPEATS):
                for values in (False, True):  # interleaved, so drift hits both alike
                    check.values = values
                    dist.barrier()
                    start = time.perf_counter()
                    apply_fn(params, input_ids=ids, labels=ids)
                    times[values].append(time.perf_counter() - start)
        check.values = False
        start = time.perf_counter()
        for _ in range(1000):
            check.check((), {"input_ids": ids, "labels": ids})
        lookup_us = (time.perf_counter() - start) * 1e3
        out[name] = (statistics.median(times[False]) * 1e3, statistics.median(times[True]) * 1e3, lookup_us)
    return out


def main() -> None:
    results = run_ranks(measure, 2)[0]
    print(f"apply_fn forward of a 2-layer Llama (hidden 256) at tp 2 (CPU/gloo), median of {REPEATS}, same run")
    print(f"{'batch':>7} {'shapes ms':>10} {'values ms':>10} {'ratio':>6} {'shape check µs':>15} {'share':>7}")
    for name, (off, on, lookup) in results.items():
        print(f"{name:>7} {off:10.2f} {on:10.2f} {on / off:6.2f}x {lookup:15.1f} {lookup / (off * 1e3):7.2%}")


if __name__ == "__main__":
    main()
