"""Models and plans shared by several test files (tests import this, never each other)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

import hp_functional as hpf
from tests.support.helpers import build_hf, make_hf_state


def make_llama_state(**cfg):
    return make_hf_state("llama", **cfg)


def build_llama(state, **cfg):
    return build_hf("llama", state, **cfg)


class MLP(nn.Module):
    def __init__(self, d: int = 16, h: int = 32):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(self.norm(x))))


def make_mlp_state():
    torch.manual_seed(0)
    m = MLP()
    with torch.no_grad():  # non-trivial norm parameters so their gradients are checked for real
        m.norm.weight.uniform_(0.5, 1.5)
        m.norm.bias.uniform_(-0.5, 0.5)
    return m.state_dict()


PLANS = {
    "tp": {"up": hpf.Colwise(), "down": hpf.Rowwise()},
    "sp": {
        "norm": hpf.SequenceParallel(),
        "up": hpf.Colwise(input_layout=Shard(1)),
        "down": hpf.Rowwise(output_layout=Shard(1)),
    },
    "gather": {"up": hpf.Colwise(gather_output=True)},
    "split_input": {"down": "rowwise_split_input"},
}


class AttrAttention(nn.Module):
    """Multi-head attention that uses self.num_heads / self.num_key_value_heads in view()."""

    def __init__(self, hidden: int = 32, heads: int = 8, kv_heads: int = 4):
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden)
        self.head_scale = nn.Parameter(torch.linspace(0.5, 1.5, heads))  # a per-head vector

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        q = q * self.head_scale.view(1, -1, 1, 1)
        k = self.k_proj(x).view(b, s, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        rep = self.num_heads // self.num_key_value_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


def attn_plan(handlers=None):
    entries = {"q_proj": hpf.Colwise(), "k_proj": hpf.Colwise(), "v_proj": hpf.Colwise(), "o_proj": hpf.Rowwise()}
    name = "shard_heads" if handlers is None else "mine"
    return hpf.ShardingPlan({"": hpf.Heads(), **entries}, special_handlers={"head_scale": name}, handlers=handlers)




class CountsSeen(nn.Module):
    """Counts what passes through into a buffer, in place (a router's token counts)."""

    def __init__(self, n: int):
        super().__init__()
        self.register_buffer("seen", torch.zeros(n))

    def forward(self, x):
        self.seen.add_(x.detach().abs().sum(0))
        return x


class BufferNet(nn.Module):
    """Colwise-able ``up`` → Rowwise-able ``down`` → BatchNorm1d (training: batch statistics, running
    ones updated) → a counter: a model whose forward updates buffers.  ``act``: the activation
    (``torch.tanh`` where second derivatives must not vanish)."""

    def __init__(self, act=torch.relu):
        super().__init__()
        self.act = act
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)
        self.norm, self.seen = nn.BatchNorm1d(8), CountsSeen(8)

    def forward(self, x):
        return self.seen(self.norm(self.down(self.act(self.up(x)))))
