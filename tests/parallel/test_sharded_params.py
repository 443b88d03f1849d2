"""``ShardedParams``: a module computed whole on parameters each rank stores split on dim 0 (an LSTM, a
grouped convolution, a position table read whole by its parent, a module the batch never reaches), as
``auto_plan``'s rule 8 plans it: loss and every gradient equal the unsharded model's, a rank stores
under 65 % of the parameters, and the gathers are one all-gather per bucket."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hp_functional as hpf
from tests.support.helpers import assert_close, mesh


class ConvNeXtBlock(nn.Module):
    """A grouped convolution, a norm, then a pair (ConvNeXt's layer): the block's ops around its pair see the
    convolution's whole output (the shape audit takes its weight as gathered, not as stored)."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.dw, self.norm = nn.Conv1d(dim, dim, 3, padding=1, groups=4), nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, h):
        x = self.norm(self.dw(h.transpose(1, 2)).transpose(1, 2))
        return h + self.down(F.gelu(self.up(x)))


class Streams(nn.Module):
    """What TP cannot split, each worth splitting by size, around a splittable MLP."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.embed, self.pos = nn.Embedding(32, dim), nn.Embedding(8, dim)
        self.lstm, self.norm = nn.LSTM(dim, dim, batch_first=True), nn.LayerNorm(dim)  # the norm: replicated
        self.block, self.head = ConvNeXtBlock(dim), nn.Linear(dim, 32)
        self.table = nn.Embedding(8, dim)  # read whole by this forward, never called (a ViT's interpolated positions)
        self.unused = nn.Linear(dim, 2 * dim)  # never reached (a tower the batch does not feed)

    def forward(self, ids):
        h = self.embed(ids) + self.pos(torch.arange(self.pos.num_embeddings))  # its size shapes a tensor (Whisper)
        h = h + self.table.weight[: ids.shape[1]].flip(0)
        return self.head(self.block(self.norm(self.lstm(h)[0])))


class Wrapped(nn.Module):
    """A planned parent around a ShardedParams module and a replicated norm."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.lstm, self.norm = nn.LSTM(dim, dim, batch_first=True), nn.LayerNorm(dim)

    def forward(self, h):
        return self.norm(self.lstm(h)[0])


class WithParent(nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.embed, self.block, self.head = nn.Embedding(32, dim), Wrapped(dim), nn.Linear(dim, 32)

    def forward(self, ids):
        return self.head(self.block(self.embed(ids)))


#: a parent planned around it (its own entry): the parent computes no rank-varying value either
PARENT_PLAN = {"block": hpf.PrepareInput(), "block.lstm": hpf.ShardedParams(), "head": hpf.Colwise(gather_output=True)}


def case_streams(parent: bool = False):
    torch.manual_seed(0)
    model, m = (WithParent() if parent else Streams()), mesh((2,), ("tp",))
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    plan = hpf.ShardingPlan(PARENT_PLAN) if parent else hpf.auto_plan(model, m, example_inputs=ids)
    apply_fn, params, info = hpf.shard(model, plan, m, example_inputs=ids)
    labels = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(2))
    ref = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten())
    ref.backward()
    params = {k: v.requires_grad_() for k, v in params.items()}
    loss = F.cross_entropy(apply_fn(params, ids).flatten(0, 1), labels.flatten())
    loss.backward()
    assert_close(loss, ref.detach(), "loss", atol=1e-6)
    full = hpf.unshard({k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in params.items()}, info)
    for k, p in model.named_parameters():
        if p.grad is None:  # never used: no gradient either way
            assert params[k].grad is None or not params[k].grad.any(), k
            continue
        assert_close(full[k], p.grad, f"grad {k}", atol=1e-6, rtol=1e-5)
    held = sum(p.numel() for p in params.values()) / sum(p.numel() for p in model.parameters())
    gathers = [b for b in apply_fn.program.param_buckets if b.gather]
    return ({k: type(v).__name__ for k, v in plan.entries.items()}, held,
            [(b.keys, len(b.buckets)) for b in gathers])


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_what_tp_cannot_split_is_stored_split_and_exact(pool):
    for entries, held, gathers in pool.run(case_streams):
        split = ("pos", "lstm", "block.dw", "table", "unused")
        assert {k: entries.get(k) for k in split} == dict.fromkeys(split, "ShardedParams"), entries
        assert entries["block.up"] == "Colwise" and entries["block.down"] == "Rowwise", entries
        assert held < 0.65, held
        assert len(gathers) == 1 and gathers[0][1] == 1, gathers  # one all-gather for them all
        assert {"lstm.weight_ih_l0", "lstm.weight_hh_l0", "block.dw.weight", "pos.weight"} <= set(gathers[0][0]), gathers


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_a_planned_parent_of_sharded_params_computes_whole(pool):
    for entries, _held, gathers in pool.run(case_streams, True):
        assert entries["block.lstm"] == "ShardedParams" and len(gathers) == 1, (entries, gathers)
