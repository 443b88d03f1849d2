"""Tensor-parallel attention written by hand with ``hpf.Local``, checked against the unsharded model.

    torchrun --standalone --nproc-per-node 2 examples/local_attention.py
    torchrun --standalone --nproc-per-node 4 examples/local_attention.py --reduce-inside

Every decoder layer's attention is one ``Local`` entry: its q/k/v projections hold this rank's
heads (rows, ``Shard(0)``) and o_proj the matching columns (``Shard(1)``), so ``fn`` computes
attention over its own heads and o_proj returns partial sums.  Declared ``Partial()``, they are
all-reduced once on the way out (backward: nothing), and the input's gradient once on the way in
— Megatron's f/g, as a plan entry.  ``--reduce-inside`` calls ``axes["tp"].all_reduce`` in
``fn`` instead and declares the output Replicate (exact too; one more all-reduce in the
backward).  The MLPs use the built-in Colwise/Rowwise.  The script compares the loss and every
gradient (``.backward()`` and ``torch.func.grad``) with the unsharded model and exits non-zero
if they differ by more than 1e-5.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import hp_functional as hpf
from hp_functional.tools.models import build_model, tiny_config


def tp_attention(module, axes, hidden_states, position_embeddings=None, attention_mask=None, *,
                 axis: str = "tp", reduce_inside: bool = False, **kwargs):
    """HF ``LlamaAttention.forward`` over this rank's heads (``module`` holds their weights)."""
    b, s, _ = hidden_states.shape

    def heads(t):  # (b, s, local heads * head_dim) -> (b, local heads, s, head_dim)
        return t.view(b, s, -1, module.head_dim).transpose(1, 2)

    q, k, v = (heads(proj(hidden_states)) for proj in (module.q_proj, module.k_proj, module.v_proj))
    q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
    mask = None if attention_mask is None else attention_mask[..., : k.shape[-2]]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=module.scaling,
                                         enable_gqa=True)
    partial_sums = module.o_proj(out.transpose(1, 2).reshape(b, s, -1))
    return (axes[axis].all_reduce(partial_sums) if reduce_inside else partial_sums), None


def attention_plan(axis: str = "tp", reduce_inside: bool = False) -> dict:
    """The plan: hand-written attention in every layer, the built-in styles for the MLPs."""
    attention = hpf.Local(
        partial(tp_attention, axis=axis, reduce_inside=reduce_inside),
        in_dst={"hidden_states": Replicate()},
        out_src={"output": Replicate() if reduce_inside else Partial()},
        out_dst={"output": Replicate()},
        params={"q_proj.weight": Shard(0), "k_proj.weight": Shard(0), "v_proj.weight": Shard(0),
                "o_proj.weight": Shard(1)},
        axis=axis,
    )
    mlp = "model.layers.*.mlp"
    return {"model.layers.*.self_attn": attention, f"{mlp}.gate_proj": hpf.Colwise(axis=axis),
            f"{mlp}.up_proj": hpf.Colwise(axis=axis), f"{mlp}.down_proj": hpf.Rowwise(axis=axis)}


def compare(mesh, *, reduce_inside: bool = False, batch: int = 2, seq: int = 16) -> float:
    """The largest difference of the loss and every gradient (``.backward()`` and
    ``torch.func.grad``) from the unsharded model, on every rank alike."""
    model = build_model(tiny_config("llama"), device=mesh.device_type, seed=0)  # the same weights on every rank
    apply_fn, params, shard_info = hpf.shard(model, attention_plan(reduce_inside=reduce_inside), mesh)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(mesh.device_type)
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    expected = {name: p.grad for name, p in model.named_parameters()}

    loss = apply_fn(params, input_ids=ids, labels=ids).loss
    loss.backward()
    eager = hpf.unshard({k: p.grad for k, p in params.items()}, shard_info)
    plain = {k: p.detach() for k, p in params.items()}
    func = hpf.unshard(torch.func.grad(lambda p: apply_fn(p, input_ids=ids, labels=ids).loss)(plain), shard_info)
    diffs = [(loss - ref.loss).abs().item()]
    diffs += [(got[k] - expected[k]).abs().max().item() for got in (eager, func) for k in expected]
    return max(diffs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reduce-inside", action="store_true", help="all_reduce inside fn, output declared Replicate")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    dist.init_process_group(dist.Backend.default_device_backend_map[args.device])
    torch.set_num_threads(1)
    mesh = init_device_mesh(args.device, (dist.get_world_size(),), mesh_dim_names=("tp",))
    worst = compare(mesh, reduce_inside=args.reduce_inside)
    if dist.get_rank() == 0:
        print(f"tp {dist.get_world_size()}: max |loss or gradient diff| vs unsharded = {worst:.2e}")
    dist.destroy_process_group()
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
