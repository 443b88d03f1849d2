"""``explain``'s per-rank memory estimate against the peak measured on real ranks, on the CPU.

    python benchmarks/memory_estimate.py          # about a minute on 2 cores

For each configuration (a tiny and a small HF Llama; tp 2, and dp 2 x tp 2 with ``hpf.fsdp``;
with and without ``remat``) it prints the estimate (``hpf.explain`` under ``hpf.simulate`` on a
meta model: one training step on fake tensors) beside what every rank of a real run holds
(``hpf.emulate``: real numbers, one thread per rank), and the ratio estimate / measured of the
peak and of the activations.

How the real peak is measured: the CPU allocator keeps no statistics, so the step runs under
``LiveBytes`` (tools/estimate.py), a dispatch mode that adds each new tensor storage's bytes when
an op creates it and subtracts them when its last tensor dies (``weakref.finalize`` on the
storage), the parameters, inputs and optimizer state registered first.  That is what
``torch.cuda.max_memory_allocated`` would count without the caching allocator's rounding.  The
step is the loop of docs/training.md, written out here: ``opt.init``, ``apply_fn(...).loss``,
``.backward()``, ``opt.update`` (hpf.optim.adamw).  The activations are measured independently
too: the bytes of the distinct storages autograd saves (``saved_tensors_hooks``) that are not
parameters, beside the estimate's activations (live bytes the forward leaves behind).
"""

from __future__ import annotations

import math
import time

import torch

import hp_functional as hpf
from hp_functional.tools.estimate import LiveBytes
from hp_functional.tools.models import tiny_config

MODELS = {"tiny": dict(), "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                       num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=2048,
                                       max_position_embeddings=256)}
CONFIGS = [("tiny", (2,), False, False), ("tiny", (2,), False, True), ("tiny", (2, 2), True, False),
           ("tiny", (2, 2), True, True), ("small", (2,), False, False), ("small", (2,), False, True),
           ("small", (2, 2), True, False), ("small", (2, 2), True, True)]
BATCH = {"tiny": (2, 64), "small": (2, 256)}  # batch, sequence of each rank's input_ids


def names(shape):
    return ("tp",) if len(shape) == 1 else ("dp", "tp")


def estimate(model_name: str, shape, fsdp: bool, remat: bool):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("llama", **MODELS[model_name]))
    b, s = BATCH[model_name]
    e = hpf.simulate(lambda m: hpf.explain(model, hpf.ShardingPlan.from_hf(model), m, batch=b, seq=s, fsdp=fsdp,
                                           remat=remat or None), world_size=math.prod(shape), mesh_shape=shape,
                     mesh_dim_names=names(shape))
    assert e.schedule_error is None, e.schedule_error
    return e.memory.step


def measure(model_name: str, shape, fsdp: bool, remat: bool):
    """Every rank's (peak, saved activations) of one real step (``hpf.emulate``)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", **MODELS[model_name]))
    b, s = BATCH[model_name]
    ids = torch.randint(0, model.config.vocab_size, (b, s), generator=torch.Generator().manual_seed(1))

    def step(mesh):
        apply_fn, params, info = hpf.shard(model, hpf.ShardingPlan.from_hf(model), mesh, remat=remat or None)
        if fsdp:
            apply_fn, params, info = hpf.fsdp(apply_fn, params, info, mesh, "dp")
        params = {k: v.detach().requires_grad_() for k, v in params.items()}
        opt = hpf.optim.adamw()
        live = LiveBytes()
        live.add((params, ids))
        with live, torch.no_grad():
            state = opt.init(params)
        keep = {p.untyped_storage()._cdata for p in params.values()}
        saved: dict[int, int] = {}

        def pack(t):
            st = t.untyped_storage()
            if st._cdata not in keep and torch._C._current_graph_task_id() == -1:
                saved[st._cdata] = st.nbytes()
            return t

        live.reset_peak()
        with live, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = apply_fn(params, input_ids=ids, labels=ids).loss
            loss.backward()
            del loss
        grads = {k: p.grad for k, p in params.items()}
        with live, torch.no_grad():
            opt.update(grads, state, params)
        return live.peak, sum(saved.values())

    return hpf.emulate(step, shape, names(shape))


def main() -> None:
    t0 = time.perf_counter()
    print(f"{'model':<6} {'mesh':<8} {'fsdp':<5} {'remat':<5} {'estimate':>10} {'measured':>10} {'ratio':>6}   "
          f"{'act. est':>9} {'saved':>9} {'ratio':>6}")
    worst = 0.0
    for model_name, shape, fsdp, remat in CONFIGS:
        est = estimate(model_name, shape, fsdp, remat)
        ranks = measure(model_name, shape, fsdp, remat)
        peak = max(p for p, _ in ranks)
        saved = max(a for _, a in ranks)
        ratio, act_ratio = est.peak / peak, est.activations / saved if saved else float("nan")
        worst = max(worst, abs(ratio - 1))
        mesh = "x".join(map(str, shape))
        print(f"{model_name:<6} {mesh:<8} {fsdp!s:<5} {remat!s:<5} {est.peak / 2**20:9.2f}M {peak / 2**20:9.2f}M "
              f"{ratio:6.3f}   {est.activations / 2**20:8.2f}M {saved / 2**20:8.2f}M {act_ratio:6.3f}")
    print(f"worst peak error {worst:.1%} (target 15%); {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
