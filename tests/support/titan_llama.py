"""A torchtitan-style Llama written for the tests (module names and forward as torchtitan's
``models/llama3/model``: ``tok_embeddings``, ``layers.N.attention.wq…wo``, ``feed_forward.w1…w3``,
``attention_norm``, ``ffn_norm``, ``norm``, ``output``), and torchtitan's own tensor-parallel plan
for it (``models/llama3/infra/parallelize.py::apply_tp``) written with torch's styles."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

DIM, HEADS, KV_HEADS, LAYERS, VOCAB, MAX_SEQ = 32, 4, 4, 2, 64, 32


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x, freqs):
    """Rotate pairs of features by the angles of ``freqs`` = stacked (cos, sin), [2, seq, head_dim / 2]."""
    cos, sin = freqs[0][: x.shape[1]].unsqueeze(1), freqs[1][: x.shape[1]].unsqueeze(1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


class ScaledDotProductAttention(nn.Module):
    """torchtitan's ``inner_attention`` (``ScaledDotProductAttentionWrapper``): the SDPA call in a
    module of its own, where a ``ContextParallel`` entry goes beside the attention's TP entry."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = HEADS, KV_HEADS, DIM // HEADS
        self.n_rep = HEADS // KV_HEADS
        self.wq = nn.Linear(DIM, HEADS * self.head_dim, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.wv = nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.wo = nn.Linear(HEADS * self.head_dim, DIM, bias=False)
        self.inner_attention = ScaledDotProductAttention()

    def forward(self, x, freqs):
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)  # -1: torchtitan's form, so TP needs no head counts
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = rotary(xq, freqs), rotary(xk, freqs)
        xk, xv = xk.repeat_interleave(self.n_rep, 2), xv.repeat_interleave(self.n_rep, 2)
        out = self.inner_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2))
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, hidden: int = 64):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(DIM, hidden, bias=False), nn.Linear(hidden, DIM, bias=False), nn.Linear(
            DIM, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention, self.feed_forward = Attention(), FeedForward()
        self.attention_norm, self.ffn_norm = RMSNorm(DIM), RMSNorm(DIM)

    def forward(self, x, freqs):
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(TransformerBlock() for _ in range(LAYERS))
        self.norm, self.output = RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)
        angles = torch.outer(torch.arange(MAX_SEQ).float(), 1.0 / 10000 ** (torch.arange(0, DIM // HEADS, 2) / (DIM // HEADS)))
        self.register_buffer("freqs", torch.stack([angles.cos(), angles.sin()]), persistent=False)

    def forward(self, tokens, positions=None):
        """``positions`` ([1, seq]): the rotary angles' rows, as torchtitan's (context parallelism
        hands each rank's chunk its global positions)."""
        freqs = self.freqs if positions is None else self.freqs[:, positions[0]]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, freqs)
        return self.output(self.norm(h))


def make_titan_state():
    torch.manual_seed(0)
    model = Transformer()
    with torch.no_grad():  # non-trivial norm weights, so their gradients are checked for real
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.state_dict()


def titan_tp_plan(loss_parallel: bool = False) -> dict:
    """torchtitan's ``apply_tp`` plan as one dict, float8 off.  torchtitan calls
    ``parallelize_module`` once for the root entries and once per ``transformer_block`` for the
    rest; ``layers.*.`` says the same in one dict (to ``parallelize_module`` and to us).
    ``loss_parallel`` as torchtitan's: the head keeps its logits vocab-sharded (a DTensor in torch)
    for a loss under ``torch.distributed.tensor.parallel.loss_parallel()``.

    Two adaptations, both to this model's signature, none to a layout: the ``attention`` entry
    lists two positions, ``(x, freqs)`` — torchtitan's current ``Attention.forward(x, freqs_cis,
    attention_masks, positions)`` lists four, ``(Shard(1), None, None, None)``, and its earlier one
    ``(x, freqs_cis)`` these two; torchtitan's ``attention.q_norm``/``attention.k_norm`` entries
    (``SequenceParallel``, for variants with q/k norms) are left out: this Llama has none, and a
    pattern that matches nothing is an error here."""
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    block = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    return {**plan, **{f"layers.*.{k}": v for k, v in block.items()}}
