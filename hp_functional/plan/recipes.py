"""Ready plans as literal data (torchtitan's ``parallelize.py`` style): what a Llama-family model
needs beyond HF's own ``tp_plan``.  Each returns a new ``ShardingPlan``; nothing is registered.

* ``llama_sp_plan()`` — Megatron sequence parallelism for HF Llama-family models;
* ``megatron_plan(model)`` — HF's plan plus Megatron's f/g regions stated explicitly.
"""

from __future__ import annotations

__all__ = ["llama_sp_plan", "megatron_plan"]

from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from ..core.style import ModuleSpec
from ..parallel.tensor.styles import Colwise, PrepareInput, Rowwise, SequenceParallel
from ..parallel.tensor.vocab import VocabEmbedding
from .plan import ShardingPlan


def llama_sp_plan(tp_axis: str = "tp") -> ShardingPlan:
    """Megatron-SP for HF Llama (Mistral, Qwen2 alike): the residual stream is sequence-sharded
    between the norms; attention and the MLP are entered with one all-gather (backward: one
    reduce-scatter) and left with a reduce-scatter.  The split happens at ``model.layers.0``'s
    input rather than at the embedding because HF computes position ids and the causal mask from
    the embedding output's shape.

    Args:
        tp_axis: the mesh axis the plan shards over.
    Returns:
        a new ``ShardingPlan`` for the HF Llama module paths (``model.layers.*``, ``lm_head``)."""
    L = "model.layers.*"
    return ShardingPlan({
        "model.embed_tokens": VocabEmbedding(),
        "model.layers.0": PrepareInput({"hidden_states": (Replicate(), Shard(1))}),
        f"{L}.input_layernorm": SequenceParallel(),
        f"{L}.self_attn": PrepareInput({"hidden_states": (Shard(1), Replicate())}),
        f"{L}.self_attn.q_proj": Colwise(),
        f"{L}.self_attn.k_proj": Colwise(),
        f"{L}.self_attn.v_proj": Colwise(),
        f"{L}.self_attn.o_proj": Rowwise(output_layout=Shard(1)),
        f"{L}.post_attention_layernorm": SequenceParallel(),
        f"{L}.mlp": PrepareInput({"x": (Shard(1), Replicate())}),
        f"{L}.mlp.gate_proj": Colwise(),
        f"{L}.mlp.up_proj": Colwise(),
        f"{L}.mlp.down_proj": Rowwise(output_layout=Shard(1)),
        "model.norm": SequenceParallel(),
        "lm_head": Colwise(input_layout=Shard(1), gather_output=True),
    }, {"tp": tp_axis})


def megatron_plan(model: nn.Module, partial_exit: bool = True) -> ShardingPlan:
    """HF's plan for a Llama-family model (``self_attn`` with ``o_proj``, ``mlp`` with
    ``down_proj``) plus Megatron's f/g stated explicitly: attention and the MLP are rank-varying
    regions, so each block's input gradient is all-reduced once where it is entered.  (The plain
    HF plan reaches the same count through shared input conversions; this form also covers blocks
    whose projections take different tensors, and shows how regions are written.)

    Args:
        model: the HF Llama-family model whose ``from_hf`` plan is the base (only read).
        partial_exit: o_proj/down_proj keep their partial sums and the block's output is reduced where it
            leaves (all-reduce forward, identity backward) — one all-reduce per block each way; False: the block
            is only entered as a region (``PrepareInput``), leaves replicated, and its Rowwise all-reduces in
            the backward too.
    Returns:
        a new ``ShardingPlan`` on the base plan's ``tp`` axis."""
    base = ShardingPlan.from_hf(model)
    entries, axis = dict(base.entries), base.axes["tp"]
    for block, arg, out_proj in (("self_attn", "hidden_states", "o_proj"), ("mlp", "x", "down_proj")):
        if partial_exit:
            entries[f"model.layers.*.{block}"] = ModuleSpec(
                in_src={arg: {axis: Replicate()}}, in_dst={arg: {axis: Replicate()}},
                out_src={"output": {axis: Partial()}}, out_dst={"output": {axis: Replicate()}},
            )
            entries[f"model.layers.*.{block}.{out_proj}"] = Rowwise(output_layout=Partial())
        else:
            entries[f"model.layers.*.{block}"] = PrepareInput({arg: (Replicate(), Replicate())})
    return ShardingPlan(entries, {"tp": axis})
