"""What ``hpf.rng``'s counter-based randomness costs against torch's own, in the same run.

    python benchmarks/rng.py                 # CPU: one process, then a tp 2 launch (gloo)
    python benchmarks/rng.py --tp 0          # the one-process rows only
    python benchmarks/rng.py --device cuda   # a GPU

Each row is a ratio to torch measured in the same process on the same device, the variants taking
turns within every repeat (so a change in machine load hits both alike):

* ``F.dropout`` alone on 4M elements (the mask drawn by global index vs torch's generator);
* ``hpf.gaussian_like`` against ``torch.randn_like`` over the same parameter count;
* a train-mode forward + backward of a small Phi-3 (attention and residual dropout) under
  ``hpf.rng`` vs without, unsharded (the mode intercepts every torch function of the forward, so
  this row includes that dispatch overhead; the first call's layout table is excluded by warm-up);
* the same step at tp 2 (``shard(model, ShardingPlan.from_hf(model), mesh)``): ``apply_fn`` under
  ``hpf.rng`` (every rank draws its slice of the unsharded model's masks) vs ``apply_fn`` with
  torch's dropout (each rank draws from its own generator: not layout-independent).  The issue's
  goal: this ratio at most 1.3.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hp_functional as hpf
from hp_functional.tools.models import tiny_config


def timed_pair(ours, theirs, device: str, repeats: int) -> tuple[float, float]:
    """Median seconds of ``ours()`` and ``theirs()``, taking turns, after one warm-up call each."""
    ours(), theirs()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((ours, times[0]), (theirs, times[1])):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            out.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def phi3(device: str):
    """A small Phi-3 with attention and residual dropout, in train mode, and a batch of 8 x 128 tokens."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config("phi3", hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=8,
                         head_dim=32, num_hidden_layers=4, attention_dropout=0.1, resid_pdrop=0.1,
                         attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(config).to(device).train()
    return model, torch.randint(0, config.vocab_size, (8, 128), generator=torch.Generator().manual_seed(0)).to(device)


def step_under(call, under_rng: bool):
    """A step (``call()`` returns the loss; then backward) under ``hpf.rng(0)`` or not."""
    def run():
        if under_rng:
            with hpf.rng(0):
                loss = call()
        else:
            loss = call()
        loss.backward()
    return run


def local_rows(dev: str, numel: int, repeats: int) -> list[tuple[str, float, float]]:
    x = torch.randn(numel, device=dev)

    def ours():
        with hpf.rng(0):
            F.dropout(x, 0.1)
    rows = [(f"F.dropout, {numel} elements", *timed_pair(ours, lambda: F.dropout(x, 0.1), dev, repeats))]
    params = {"w": torch.empty(numel // 1024, 1024, device=dev)}
    rows.append(("gaussian_like vs randn_like", *timed_pair(lambda: hpf.gaussian_like(params, None, 1.0, 0),
                                                           lambda: torch.randn_like(params["w"]), dev, repeats)))
    model, ids = phi3(dev)

    def call():
        return model(input_ids=ids, labels=ids).loss
    rows.append(("phi3 (4 layers, 256 wide) fwd+bwd, batch 8 x 128", *timed_pair(step_under(call, True),
                                                                                  step_under(call, False), dev, repeats)))
    return rows


def tp_rank(opts: argparse.Namespace) -> tuple[float, float]:
    """One rank of the tp launch: the sharded step under hpf.rng and with torch's dropout."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(opts.device, (torch.distributed.get_world_size(),), mesh_dim_names=("tp",))
    model, ids = phi3(opts.device)
    apply_fn, params, _ = hpf.shard(model, hpf.ShardingPlan.from_hf(model), mesh)
    params = {k: p.requires_grad_() for k, p in params.items()}

    def call():
        return apply_fn(params, input_ids=ids, labels=ids).loss
    ours, theirs = step_under(call, True), step_under(call, False)

    def barriered(fn):
        def run():
            torch.distributed.barrier()
            fn()
        return run
    return timed_pair(barriered(ours), barriered(theirs), opts.device, opts.repeats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--numel", type=int, default=1 << 22)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--tp", type=int, default=2, help="ranks of the sharded step's launch (0: skip it)")
    a = parser.parse_args(argv)
    from bench_measure import machine

    print(f"machine {machine()}; device {a.device}")
    rows = local_rows(a.device, a.numel, a.repeats)
    if a.tp:
        from hp_functional.cli.launch import run_ranks

        rank0 = run_ranks(tp_rank, a.tp, a).get(0)
        rows.append((f"phi3 step at tp {a.tp} (apply_fn), rank 0", *rank0))
    print(f"{'case':<52} {'hpf.rng (ms)':>13} {'torch (ms)':>11} {'ratio':>7}")
    for name, mine, theirs in rows:
        print(f"{name:<52} {mine * 1e3:>13.2f} {theirs * 1e3:>11.2f} {mine / theirs:>6.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
