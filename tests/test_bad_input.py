"""Bad plans raise a clear PlanError naming the culprit, on every rank, with the model untouched."""

import pytest
from torch import nn

import hp_functional as hpf
from tests.helpers import mesh
from tests.snapshot import assert_unchanged, snapshot
from tests.test_llama import build_llama, make_llama_state


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(8, 16)
        self.proj = nn.Linear(16, 7)  # 7 divides by neither 2 nor 4


BAD = {
    "no_match": ({"model.layers.*.self_atn.q_proj": "colwise"}, "matches no module", "self_attn.q_proj"),
    "indivisible": ({"proj": hpf.Colwise()}, "not divisible by mesh axis 'tp'", "proj.weight"),
    "missing_axis": ({"proj": hpf.Colwise(axis="ep")}, "mesh axis 'ep' is not in the mesh", "proj"),
    "wrong_module": ({"emb": hpf.Colwise()}, "Colwise needs a Linear, got Embedding", "emb"),
    "hf_unsupported": ({"proj": "grouped_gemm"}, "style 'grouped_gemm' is not supported", "proj"),
    "tied_conflict": ({"model.embed_tokens": "embedding_rowwise", "lm_head": "rowwise"},
                      "conflicting placements", "lm_head.weight"),
    "spec_bad_param": ({"proj": hpf.ModuleSpec(params={"kernel": {"tp": hpf.Replicate()}})}, "parameter 'kernel'", "proj"),
    "bad_placement": ({"proj": hpf.ModuleSpec(params={"weight": {"tp": hpf.Replicate()}})}, "is not a placement", "proj"),
}


def case_bad(state, kind: str):
    plan, *_ = BAD[kind]
    if kind in ("no_match", "tied_conflict"):
        model = build_llama(state, tie_word_embeddings=kind == "tied_conflict")
    else:
        model = Odd()
    before = snapshot(model)
    try:
        hpf.shard(model, hpf.ShardingPlan(plan), mesh())
    except hpf.PlanError as exc:
        message = str(exc)
    else:
        message = None
    assert_unchanged(before, snapshot(model))
    return message


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_input_raises_on_every_rank(pool, kind):
    state = make_llama_state(tie_word_embeddings=kind == "tied_conflict")
    messages = pool.run(case_bad, state, kind)
    _, needle, culprit = BAD[kind]
    for msg in messages:
        assert msg is not None, "no error raised"
        assert needle in msg and culprit in msg, msg
