"""Context parallelism's three attentions side by side: ring, all-gather and Ulysses, one
forward+backward step of a small HF Llama with the sequence sharded over ``cp``.

    python benchmarks/context_parallel.py                  # cp 2 on CPU/gloo (about a minute on 2 cores)
    python benchmarks/context_parallel.py --worlds 2 4     # cp 2 and cp 4
    torchrun --nproc-per-node 8 benchmarks/context_parallel.py --device cuda --seq 8192

Every strategy shards the same model and batch; they take turns within every step, and a step's
time is its slowest rank's.  Each row gives the median step time and its ratio to ring measured in
the same run, the collectives one step issues and the bytes each rank receives through them: the
computed figure (docs/context-parallel.md#ring-all-gather-or-ulysses) and the one counted by
wrapping the step's ``_c10d_functional`` calls (input bytes times ``(cp − 1) / cp`` for the
all-to-alls, the received blocks for ring's point-to-point steps and all-gather's pair).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

import hp_functional as hpf
from hp_functional.tools.models import tiny_config

STRATEGIES = ("ring", "allgather", "ulysses")


class Received(TorchDispatchMode):
    """The collectives of a step and the bytes this rank receives through them."""

    def __init__(self, cp: int):
        super().__init__()
        self.cp, self.calls, self.bytes = cp, Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "_c10d_functional" and func.__name__.split(".")[0] != "wait_tensor":
            name = func.__name__.split(".")[0]
            self.calls[name] += 1
            size = out.numel() * out.element_size()
            if name == "all_to_all_single":  # the all-to-alls keep 1/cp of what they hand on
                n, pieces = self.cp, args[1]
                self.bytes += size - size // n if pieces is None or len(set(pieces)) == 1 else size
            elif name == "all_gather_into_tensor":
                self.bytes += size - size // self.cp
            elif name == "reduce_scatter_tensor":
                self.bytes += size * (self.cp - 1)
            elif name != "all_reduce":  # the gradients' sum over cp is alike for every strategy
                self.bytes += size
        return out


def computed_bytes(strategy: str, cp: int, batch: int, seq: int, heads: int, kv: int, dim: int, layers: int,
                   elem: int = 4) -> int:
    """Bytes each rank receives per step in attention (forward + backward), from the algorithms."""
    block = batch * (seq // cp) * dim * elem  # one head of this rank's positions
    if strategy == "ring":  # forward: cp − 1 K|V steps; backward: cp − 1 K|V|dK|dV steps, then dK|dV home
        per = (cp - 1) * 2 * kv + (cp - 1) * 4 * kv + 2 * kv
    elif strategy == "allgather":  # K|V gathered, their gradients reduce-scattered
        per = 2 * (cp - 1) * 2 * kv
    else:  # q|k|v in and the output back, forward and backward alike, (cp − 1)/cp of each kept elsewhere
        kv_sent = kv if kv % cp == 0 else cp
        return layers * 2 * (cp - 1) * block * (2 * heads + 2 * kv_sent) // cp
    return layers * per * block


def rank_main(opts) -> dict:
    torch.set_num_threads(1)
    cp, device = dist.get_world_size(), opts.device
    mesh = init_device_mesh(device, (cp,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    config = tiny_config("llama", hidden_size=opts.heads * opts.head_dim, num_attention_heads=opts.heads,
                         num_key_value_heads=opts.kv_heads, head_dim=opts.head_dim, intermediate_size=256,
                         num_hidden_layers=opts.layers, max_position_embeddings=opts.seq, vocab_size=512)
    with torch.device(device):
        model = __import__("transformers").AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 512, (opts.batch, opts.seq), generator=torch.Generator().manual_seed(1)).to(device)
    steps, losses, received = {}, {}, {}
    for s in STRATEGIES:
        plan = hpf.ShardingPlan.from_hf(model, cp_axis="cp", cp_strategy=s)
        apply_fn, params, _ = hpf.shard(model, plan, mesh, verify=False)

        def step(apply_fn=apply_fn, params=params):
            for p in params.values():
                p.grad = None
            loss = apply_fn(params, input_ids=ids, labels=ids).loss
            loss.backward()
            return loss.detach()

        steps[s], losses[s] = step, step()
        with Received(cp) as r:
            step()
        received[s] = (sum(r.calls.values()), r.bytes)
    times = {s: [] for s in STRATEGIES}
    for _ in range(opts.steps):
        for s in STRATEGIES:  # taking turns: a slow spell of the machine hits every strategy alike
            dist.barrier()
            start = time.perf_counter()
            steps[s]()
            if device != "cpu":
                torch.accelerator.synchronize()
            times[s].append(time.perf_counter() - start)
    per_rank = [None] * cp
    dist.all_gather_object(per_rank, times)
    slowest = {s: [max(r[s][i] for r in per_rank) for i in range(opts.steps)] for s in STRATEGIES}
    return {"ms": {s: 1e3 * statistics.median(t) for s, t in slowest.items()}, "received": received,
            "loss": {s: (losses[s] - losses["ring"]).abs().item() for s in STRATEGIES}}


def report(cp: int, result: dict, opts) -> None:
    print(f"\ncp {cp}: Llama {opts.layers} layers, {opts.heads} heads ({opts.kv_heads} KV) of {opts.head_dim}, "
          f"batch {opts.batch} x seq {opts.seq}, {opts.steps} steps, {opts.device}")
    print(f"{'strategy':<10} {'step ms':>9} {'vs ring':>8} {'collectives':>12} {'KiB recv (counted)':>19} "
          f"{'KiB recv (computed)':>20} {'|loss - ring|':>14}")
    ring = result["ms"]["ring"]
    for s in STRATEGIES:
        calls, counted = result["received"][s]
        computed = computed_bytes(s, cp, opts.batch, opts.seq, opts.heads, opts.kv_heads, opts.head_dim, opts.layers)
        print(f"{s:<10} {result['ms'][s]:>9.2f} {result['ms'][s] / ring:>8.2f} {calls:>12} {counted / 1024:>19.1f} "
              f"{computed / 1024:>20.1f} {result['loss'][s]:>14.1e}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    opts = parser.parse_args()
    from hp_functional.cli.launch import run_ranks

    start = time.time()
    for world in opts.worlds:
        result = run_ranks(rank_main, world, opts).get(0)
        if result is not None:
            report(world, result, opts)
    print(f"\n{time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
