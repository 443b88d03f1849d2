"""The benchmark's Llama sizes and the ways it runs one training step (forward + backward) of them.

Every variant computes HF ``LlamaForCausalLM``'s causal-LM loss on the same weights and batch:

(a) ``hp_functional``: ``shard(model, ShardingPlan.from_hf(model), mesh)`` (the plan HF declares for
    Llama: vocab-parallel embedding, colwise q/k/v/gate/up, rowwise o/down, gathered logits), ``apply_fn``;
(b) DTensor: ``torch.distributed.tensor.parallel.parallelize_module`` with the same plan;
(c) HF transformers' own TP: ``from_pretrained(dir, distributed_config=DistributedConfig(tp_plan="auto"))``;
(d) the unsharded model (run at world size 1);
(e) a hand-written Megatron loop: plain ops over (a)'s local shards with the same collectives;
(e') HF's own modules over (a)'s local shards with the same collectives patched in by hand (what
    (a) does, written directly): (a) against (e') is ``apply_fn``'s own cost, while (a) against
    (e) also counts HF's modelling code (module calls, cache, masks, rotary module, loss wrapper).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate

from hp_functional import collectives as C


@dataclass(frozen=True)
class Size:
    """A Llama shape and the batch it is stepped on."""

    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    layers: int
    vocab: int
    seq: int
    batch: int

    def describe(self) -> str:
        return (f"hidden {self.hidden}, ffn {self.intermediate}, {self.layers} layers, heads {self.heads}/{self.kv_heads} kv, "
                f"vocab {self.vocab}, batch {self.batch} x seq {self.seq}")


SIZES = {
    "tiny": Size("tiny", hidden=64, intermediate=128, heads=8, kv_heads=4, layers=2, vocab=512, seq=32, batch=2),
    "large": Size("large", hidden=1024, intermediate=2816, heads=16, kv_heads=8, layers=2, vocab=4096, seq=64, batch=2),
}


def build_llama(size: Size, device: str):
    """A seeded random-weight ``LlamaForCausalLM`` (identical on every rank: CPU init, then moved)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
        num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
        max_position_embeddings=size.seq, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device)


def batch(size: Size, device: str) -> Tensor:
    """The token ids every variant steps on (labels are the same ids)."""
    return torch.randint(0, size.vocab, (size.batch, size.seq), generator=torch.Generator().manual_seed(1)).to(device)


def dtensor_plan(model) -> dict:
    """The plan HF declares for the model (``_tp_plan``, what ``ShardingPlan.from_hf`` reads) in
    ``torch.distributed.tensor.parallel`` styles."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {
        "colwise": ColwiseParallel(),
        "rowwise": RowwiseParallel(),
        "embedding_rowwise": RowwiseParallel(input_layouts=Replicate()),
        "colwise_gather_output": ColwiseParallel(output_layouts=Replicate()),
    }
    return {pattern: styles[style] for pattern, style in model._tp_plan.items()}


@dataclass
class Variant:
    """One way to run the step: ``step()`` runs forward + backward and returns the detached loss;
    ``leaves`` are the tensors whose ``.grad`` is cleared before each step.  ``error``: why it
    could not be built (printed in the table instead of numbers)."""

    key: str
    label: str
    step: Callable[[], Tensor] | None = None
    leaves: tuple[Tensor, ...] = ()
    error: str | None = None
    note: str = ""


def model_variant(key: str, label: str, model, ids: Tensor) -> Variant:
    """Step an ``nn.Module`` the ordinary way (unsharded, DTensor-parallelised or HF TP)."""

    def step() -> Tensor:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss  # a training step builds no KV cache
        loss.backward()
        return loss.detach()

    return Variant(key, label, step, tuple(model.parameters()))


def apply_variant(key: str, label: str, apply_fn: Callable, params: Mapping[str, Tensor], ids: Tensor) -> Variant:
    """Step ``apply_fn`` (or a compiled ``apply_fn``) over the params pytree."""

    def step() -> Tensor:
        loss = apply_fn(params, input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach()

    return Variant(key, label, step, tuple(params.values()))


def dtensor_variant(model, mesh: DeviceMesh, ids: Tensor) -> Variant:
    """(b): a deep copy of ``model`` parallelised in place by ``parallelize_module``."""
    from torch.distributed.tensor.parallel import parallelize_module

    dt = parallelize_module(copy.deepcopy(model), mesh, dtensor_plan(model))
    return model_variant("b", "DTensor parallelize_module", dt, ids)


def hf_tp_variant(model, checkpoint_dir: str, ids: Tensor) -> Variant:
    """(c): HF's own TP, loaded from a checkpoint of ``model`` that rank 0 writes; any failure
    (HF needs ``accelerate`` for ``tp_plan``, and picks its own accelerator) becomes ``error``."""
    try:
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        if dist.get_rank() == 0:
            model.save_pretrained(checkpoint_dir)
        dist.barrier()
        hf = AutoModelForCausalLM.from_pretrained(
            checkpoint_dir, distributed_config=DistributedConfig(tp_plan="auto", tp_size=dist.get_world_size()),
            dtype=torch.float32, attn_implementation="sdpa",
        )
    except Exception as exc:  # noqa: BLE001 - reported in the table, verbatim
        return Variant("c", "HF tp_plan='auto'", error=f"{type(exc).__name__}: {exc}".splitlines()[0])
    device = next(hf.parameters()).device
    variant = model_variant("c", "HF tp_plan='auto'", hf, ids.to(device))
    if device.type != ids.device.type:
        variant.note = f"HF chose device {device}"
    return variant


# ---------------------------------------------------------------- (e) the hand-written loop
def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope_tables(seq: int, dim: int, theta: float, like: Tensor) -> tuple[Tensor, Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=like.device) / dim))
    freqs = torch.arange(seq, device=like.device, dtype=torch.float)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos().to(like.dtype), emb.sin().to(like.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


def megatron_loss(params: Mapping[str, Tensor], layers: list[dict[str, Tensor]], ids: Tensor, config, g: C.AxisGroup) -> Tensor:
    """HF Llama's loss written out over the local shards with Megatron's collectives (those HF's
    plan lowers to): vocab-parallel embedding (all-reduce), one copy_to (identity / all-reduce)
    per block input — shared by q/k/v and by gate/up, Megatron's f — reduce_from (all-reduce /
    identity) out of every rowwise projection (g), and the head's logits all-gathered.
    ``layers[i]``: layer i's shards without the ``model.layers.{i}.`` prefix."""
    eps, head_dim = config.rms_norm_eps, config.hidden_size // config.num_attention_heads
    b, s = ids.shape
    table = params["model.embed_tokens.weight"]
    local = ids - g.rank * table.shape[0]
    keep = (local >= 0) & (local < table.shape[0])
    x = C.reduce_from(F.embedding(torch.where(keep, local, 0), table) * keep.unsqueeze(-1).to(table.dtype), g)
    cos, sin = _rope_tables(s, head_dim, config.rope_parameters["rope_theta"], x)
    for p in layers:
        h = C.copy_to(_rms_norm(x, p["input_layernorm.weight"], eps), g)
        q, k, v = (F.linear(h, p[f"self_attn.{n}_proj.weight"]).view(b, s, -1, head_dim).transpose(1, 2) for n in "qkv")
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2).reshape(b, s, -1)
        x = x + C.reduce_from(F.linear(a, p["self_attn.o_proj.weight"]), g)
        h = C.copy_to(_rms_norm(x, p["post_attention_layernorm.weight"], eps), g)
        mlp = F.silu(F.linear(h, p["mlp.gate_proj.weight"])) * F.linear(h, p["mlp.up_proj.weight"])
        x = x + C.reduce_from(F.linear(mlp, p["mlp.down_proj.weight"]), g)
    h = _rms_norm(x, params["model.norm.weight"], eps)
    logits = C.gather_from(F.linear(C.copy_to(h, g), params["lm_head.weight"]), -1, g)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def megatron_variant(params: Mapping[str, Tensor], ids: Tensor, config, mesh: DeviceMesh) -> Variant:
    """(e): ``megatron_loss`` over its own leaf copies of (a)'s local shards."""
    mine = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    g = C.AxisGroup.from_mesh(mesh, "tp")
    layers = [
        {k.removeprefix(f"model.layers.{i}."): v for k, v in mine.items() if k.startswith(f"model.layers.{i}.")}
        for i in range(config.num_hidden_layers)
    ]

    def step() -> Tensor:
        loss = megatron_loss(mine, layers, ids, config, g)
        loss.backward()
        return loss.detach()

    return Variant("e", "Megatron loop (same shards)", step, tuple(mine.values()))


# ---------------------------------------------------------------- (e') the loop's collectives in HF's modules
def hf_megatron_variant(model, params: Mapping[str, Tensor], ids: Tensor, mesh: DeviceMesh) -> Variant:
    """(e'): a deep copy of ``model`` holding (a)'s local shards, with ``megatron_loss``'s
    collectives patched into its modules' forwards by hand: the vocab-parallel embedding
    (all-reduce), ``copy_to`` on each norm's output (one per block input, shared by q/k/v and by
    gate/up), ``reduce_from`` on the rowwise projections' outputs and the logits all-gathered.
    Everything else is HF's own code, as in (a)."""
    g = C.AxisGroup.from_mesh(mesh, "tp")
    tp = copy.deepcopy(model)
    names = {n for n, _ in tp.named_parameters(remove_duplicate=False)}
    if names != set(params):  # tied or extra parameters: this hand-written copy does not cover them
        differ = sorted(names ^ set(params))[:3]
        return Variant("e'", "Megatron collectives in HF modules", error=f"parameters differ from (a)'s: {differ}")
    for key, shard in params.items():
        mod, _, name = key.rpartition(".")
        setattr(tp.get_submodule(mod), name, nn.Parameter(shard.detach().clone()))
    embed = tp.model.embed_tokens
    rows, start = embed.weight.shape[0], g.rank * embed.weight.shape[0]

    def vocab_parallel(ids: Tensor, f=embed.forward) -> Tensor:
        local = ids - start
        keep = (local >= 0) & (local < rows)
        return C.reduce_from(f(torch.where(keep, local, 0)) * keep.unsqueeze(-1).to(embed.weight.dtype), g)

    embed.forward = vocab_parallel
    for layer in tp.model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.forward = lambda x, f=norm.forward: C.copy_to(f(x), g)
        for rowwise in (layer.self_attn.o_proj, layer.mlp.down_proj):
            rowwise.forward = lambda x, f=rowwise.forward: C.reduce_from(f(x), g)
    tp.model.norm.forward = lambda x, f=tp.model.norm.forward: C.copy_to(f(x), g)
    tp.lm_head.forward = lambda x, f=tp.lm_head.forward: C.gather_from(f(x), -1, g)
    return model_variant("e'", "Megatron collectives in HF modules", tp, ids)
