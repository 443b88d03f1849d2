"""What ``shard(..., verify_values=True)`` costs: the cross-rank checksum of every parameter and
buffer, against the same ``shard()`` with ``verify_values=False``, measured in the same run.

    python benchmarks/agree_values.py            # world size 2 on CPU/gloo, Llama of about 0.1 and 0.4 GB
    python benchmarks/agree_values.py --device cuda --world 1   # the checksum's device path, on one GPU

The checksum reads every byte of the model once (an integer view, summed plainly and weighted by
position, in chunks); it adds no collective (the digest rides in the one agreement all-gather).
Prints per size the median ``shard()`` time each way, the difference, and that difference per GB.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import hp_functional as hpf
from hp_functional.cli.launch import run_ranks

SIZES = {"0.1 GB": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=2),
         "0.4 GB": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=2)}


def measure(repeats: int, device: str = "cpu") -> dict[str, tuple[float, float, float]]:
    """Runs on every rank: per size (median ms with, without the value check; GB of parameters)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    mesh = init_device_mesh(device, (dist.get_world_size(),), mesh_dim_names=("tp",))
    out = {}
    for name, dims in SIZES.items():
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=4096, num_attention_heads=16, num_key_value_heads=8, **dims))
        model = model.to(device)  # the checksum runs where the values live (device_checksum off the CPU)
        gb = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())) / 2**30
        times = {True: [], False: []}
        for _ in range(repeats):
            for verify in (True, False):  # interleaved, so drift hits both alike
                dist.barrier()
                start = time.perf_counter()
                hpf.shard(model, hpf.ShardingPlan.from_hf(model), mesh, verify_values=verify)
                times[verify].append(time.perf_counter() - start)
        out[name] = (statistics.median(times[True]) * 1e3, statistics.median(times[False]) * 1e3, gb)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="mesh device type: cpu (gloo), cuda (nccl), ...")
    parser.add_argument("--world", type=int, default=2, help="ranks to launch (one GPU: 1)")
    opts = parser.parse_args()
    backend = dist.Backend.default_device_backend_map.get(opts.device, "gloo")
    os.environ.setdefault("HPF_BACKEND", backend)
    results = run_ranks(measure, opts.world, 5, opts.device)[0]
    print(f"shard() of HF Llama at world size {opts.world} ({opts.device}/{backend}), median of 5; value check on vs "
          "off, same run")
    print(f"{'model':>8} {'GiB':>6} {'verify ms':>10} {'skip ms':>9} {'cost ms':>8} {'ms/GiB':>7} {'ratio':>6}")
    for name, (on, off, gb) in results.items():
        print(f"{name:>8} {gb:6.2f} {on:10.1f} {off:9.1f} {on - off:8.1f} {(on - off) / gb:7.0f} {on / off:6.2f}x")


if __name__ == "__main__":
    main()
