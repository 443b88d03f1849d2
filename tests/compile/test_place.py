"""``compile.place``: every parameter's storage placement, local shape and offset on a tiny HF
Llama (tied embeddings) and Phi-3 (packed ``gate_up_proj``), tied FQNs under one leaf, and tied
parameters the plan lays out differently refused by name.  In one process, on the fake process group."""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import hp_functional as hpf
from hp_functional.compile.build import resolve_specs
from hp_functional.compile.place import place_parameters
from hp_functional.core.errors import PlanError
from tests.support.helpers import build_hf


def _place(model, plan, world=2, rank=0):
    def run(m):
        _, specs = resolve_specs(model, plan, m)
        return place_parameters(model, plan, m, specs)

    return hpf.simulate(run, world_size=world, rank=rank)


@pytest.mark.parametrize("rank", [0, 1])
def test_llama_placements_local_shapes_offsets_and_tied_leaf(rank):
    model = build_hf("llama", tie_word_embeddings=True)
    placed = _place(model, hpf.ShardingPlan.from_hf(model), rank=rank)
    q, o = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    for name, want in [(q, Shard(0)), (o, Shard(1)), ("model.norm.weight", Replicate()),
                       ("model.layers.0.input_layernorm.weight", Replicate())]:
        info, full = placed.infos[name], model.get_parameter(name)
        assert info.placements == (want,), name
        assert info.global_shape == full.shape
        if want == Replicate():
            assert info.local_shape == full.shape and info.offset == (0,) * full.dim()
        else:
            d = want.dim
            assert info.local_shape[d] == full.shape[d] // 2 and info.offset[d] == rank * full.shape[d] // 2, name
    # the tied head is the embedding's leaf: one ShardInfo, the alias recorded on it
    emb = "model.embed_tokens.weight"
    assert placed.leaf_of["lm_head.weight"] == emb and "lm_head.weight" not in placed.infos
    assert "lm_head.weight" in placed.infos[emb].aliases
    assert placed.owners["lm_head.weight"].module == "lm_head"
    assert set(placed.infos) == {n for n, _ in model.named_parameters()}  # every leaf, once


def test_packed_parameter_has_its_blocks():
    model = build_hf("phi3")
    plan = hpf.ShardingPlan({"model.layers.*.mlp.gate_up_proj": "packed_colwise", "model.layers.*.mlp.down_proj": "rowwise"})
    placed = _place(model, plan, rank=1)
    name = "model.layers.0.mlp.gate_up_proj.weight"
    info, full = placed.infos[name], model.get_parameter(name)
    half = full.shape[0] // 2  # gate | up
    assert info.placements == (Shard(0),) and info.blocks == (half, half)
    assert info.local_shape == torch.Size([half, full.shape[1]])  # this rank's slice of each block
    assert info.offset[0] == half // 2  # rank 1's slice of the first block


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.a(x))


def test_tied_parameters_with_conflicting_layouts_are_refused_by_name():
    with pytest.raises(PlanError, match=r"tied parameters a\.weight and b\.weight get conflicting placements"):
        _place(Tied(), hpf.ShardingPlan({"a": hpf.Colwise(), "b": hpf.Rowwise()}))
    placed = _place(Tied(), hpf.ShardingPlan({"a": hpf.Colwise(), "b": hpf.Colwise()}))
    assert placed.leaf_of == {"a.weight": "a.weight", "b.weight": "a.weight"}
    assert placed.infos["a.weight"].placements == (Shard(0),)
