"""What ``hpf.rng``'s counter-based dropout costs against torch's own, in the same run.

    python benchmarks/rng.py                 # CPU
    python benchmarks/rng.py --device cuda   # a GPU

Three rows, each a ratio to torch measured in the same process on the same device:
``F.dropout`` alone on 4M elements (the mask drawn by global index vs torch's Philox/MT
generator), ``hpf.gaussian_like`` against ``torch.randn_like`` over the same parameter count, and a
train-mode forward + backward of a small Llama (attention and residual dropout) under
``hpf.rng`` vs without (the mode intercepts every torch function of the forward, so this row
includes that dispatch overhead, and the first call's layout table is excluded by a warm-up).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import hp_functional as hpf
from hp_functional.tools.models import tiny_config


def timed(fn, device: str, repeats: int) -> float:
    """Median seconds of ``fn()`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--numel", type=int, default=1 << 22)
    parser.add_argument("--repeats", type=int, default=10)
    a = parser.parse_args()
    dev = a.device
    rows = []

    x = torch.randn(a.numel, device=dev)

    def ours():
        with hpf.rng(0):
            F.dropout(x, 0.1)
    rows.append((f"F.dropout, {a.numel} elements", timed(ours, dev, a.repeats),
                 timed(lambda: F.dropout(x, 0.1), dev, a.repeats)))

    params = {"w": torch.empty(a.numel // 1024, 1024, device=dev)}
    rows.append(("gaussian_like vs randn_like", timed(lambda: hpf.gaussian_like(params, None, 1.0, 0), dev, a.repeats),
                 timed(lambda: torch.randn_like(params["w"]), dev, a.repeats)))

    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config("phi3", hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=8,
                         head_dim=32, num_hidden_layers=4, attention_dropout=0.1, resid_pdrop=0.1,
                         attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(config).to(dev).train()
    ids = torch.randint(0, config.vocab_size, (8, 128), device=dev)

    def step(under_rng: bool):
        def run():
            if under_rng:
                with hpf.rng(0):
                    loss = model(input_ids=ids, labels=ids).loss
            else:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        return run
    rows.append(("phi3 (4 layers, 256 wide) fwd+bwd, batch 8 x 128", timed(step(True), dev, a.repeats),
                 timed(step(False), dev, a.repeats)))

    print(f"device: {dev}")
    print(f"{'case':<52} {'hpf.rng (ms)':>13} {'torch (ms)':>11} {'ratio':>7}")
    for name, mine, theirs in rows:
        print(f"{name:<52} {mine * 1e3:>13.2f} {theirs * 1e3:>11.2f} {mine / theirs:>6.2f}x")


if __name__ == "__main__":
    main()
