"""Plan lint: every finding code on a plan that has it, none on the correct plans, and shard()
raising the errors / warning about the rest.  In one process, on the fake process group."""

import warnings

import pytest
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import hp_functional as hpf
from hp_functional import PlanWarning, lint, simulate
from hp_functional.compile.lint import collapse
from tests.support.helpers import build_hf
from tests.support.models import MLP, PLANS, AttrAttention, attn_plan

L = "model.layers.*"


def hf(model, drop=(), **extra):
    """The model's HF plan without the entries ending in ``drop``, with ``extra`` added."""
    entries = {k: v for k, v in hpf.ShardingPlan.from_hf(model).entries.items() if not k.endswith(tuple(drop))}
    return hpf.ShardingPlan({**entries, **extra})


def correct_plans():
    out = [(f, build_hf(f, **cfg)) for f, cfg in [("llama", {}), ("qwen3", {}), ("phi3", {}), ("mistral", {}),
                                                 ("gemma", {"tie_word_embeddings": True})]]
    plans = [(name, m, hpf.ShardingPlan.from_hf(m, loss_parallel=lp)) for name, m in out for lp in (False, True)]
    llama = out[0][1]
    plans.append(("llama sp", llama, hpf.llama_sp_plan()))
    plans += [(f"mlp {k}", MLP(), hpf.ShardingPlan(p)) for k, p in PLANS.items()]
    plans.append(("attribute heads", AttrAttention(), attn_plan()))
    return plans


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.slow
def test_correct_plans_have_no_findings_and_shard_does_not_warn(world):
    def run(m):
        found = {}
        for name, model, plan in correct_plans():
            with warnings.catch_warnings():
                warnings.simplefilter("error", PlanWarning)
                hpf.build_program(model, plan, m)
            found[name] = [str(f) for f in lint(model, plan, m)]
        return found

    assert simulate(run, world_size=world) == {name: [] for name, _, _ in correct_plans()}


class Block(nn.Module):
    """Two MLP-like children in registration (= dataflow) order, and a norm."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.gate = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        return self.down(self.up(self.norm(x)) * self.gate(x))


BAD = {  # name: (model, plan entries, expected codes (level, code, culprit))
    "unreduced": ("llama", lambda m: hf(m, drop=("o_proj",)),
                  [("error", "unreduced", "model.layers.0.self_attn.o_proj")]),
    "replicated": ("llama", lambda m: hf(m, drop=("gate_proj",)),
                   [("warning", "replicated", "model.layers.1.mlp.gate_proj"),
                    ("error", "shape", "model.layers.1.mlp")]),  # the shape audit: act(gate) * up cannot broadcast
    "sharded-output": ("block", lambda m: {"down": hpf.Colwise()}, [("warning", "sharded-output", "down")]),
    "unsharded-input": ("block", lambda m: {"down": "rowwise"}, [("warning", "unsharded-input", "down")]),
    "sequence-parallel": ("block", lambda m: {"norm": hpf.SequenceParallel()}, [("warning", "sequence-parallel", "norm")]),
    "shadowed": ("llama", lambda m: hf(m, **{f"model.layers.{i}.mlp.up_proj": hpf.Colwise() for i in range(2)}),
                 [("warning", "shadowed", f"{L}.mlp.up_proj")]),
    "argument": ("llama", lambda m: hf(m, **{f"{L}.mlp": hpf.PrepareInput({"hidden": (Replicate(), Replicate())})}),
                 [("error", "argument", "model.layers.0.mlp")]),
    "style": ("llama", lambda m: {"model.embed_tokens": hpf.Colwise()}, [("error", "style", "model.embed_tokens")]),
    "placement": ("llama", lambda m: {"model.embed_tokens": hpf.VocabEmbedding(), "lm_head": "rowwise"},
                  [("error", "placement", "plan"), ("warning", "unsharded-input", "lm_head")]),
    "entry+conflict": ("llama", lambda m: {f"{L}.self_atn.q_proj": "colwise", "lm_head": hpf.Colwise(axis="ep"),
                                           f"{L}.mlp.up_proj": "colwise", "model.*.0.mlp.up_proj": "rowwise",
                                           f"{L}.mlp.down_proj": "rowwise"},
                       [("error", "entry", f"{L}.self_atn.q_proj"), ("error", "entry", "lm_head"),
                        ("error", "conflict", "model.layers.0.mlp.up_proj")]),
}


def _model(kind: str):
    return {"llama": lambda: build_hf("llama", tie_word_embeddings=True), "block": Block}[kind]()


@pytest.mark.parametrize("name", sorted(BAD))
def test_each_finding(name):
    kind, make_plan, expected = BAD[name]

    def run(m):
        model = _model(kind)
        return [(f.level, f.code, f.where, str(f)) for f in lint(model, make_plan(model), m)]

    found = simulate(run, world_size=2)
    for level, code, where in expected:
        assert any(f[:3] == (level, code, where) for f in found), (name, found)
    assert {f[1] for f in found} <= {c for _, c, _ in expected}, found  # nothing else fires


def test_heads_split_by_too_many_ranks():
    """8 ranks and 4 heads of 8: q/k/v_proj would leave 4 features (half a head) per rank.  (Fewer
    KV heads than ranks alone are replicated, not cut: tests/compile/test_kv_heads.py.)"""

    def run(m):
        model = build_hf("llama", num_attention_heads=4, hidden_size=32)
        found = lint(model, hpf.ShardingPlan.from_hf(model), m)
        try:
            hpf.shard(model, hpf.ShardingPlan.from_hf(model), m)
        except hpf.PlanError as exc:
            return found, str(exc)
        return found, None

    found, raised = simulate(run, world_size=8)
    assert {(f.code, f.where.rsplit(".", 1)[1]) for f in found} == {("heads", n) for n in ("q_proj", "k_proj", "v_proj")}
    assert raised and "head_dim=8" in raised and "model.layers.*.self_attn.k_proj" in raised and "(2 modules)" in raised


def test_a_projection_of_one_value_per_head_splits_whole_heads():
    """LFM3's output gate ``g_proj`` (hidden -> one value per head) split over the ranks holds each
    rank's heads' gates: no "heads" finding, while a q/k/v cut inside a head still is one."""

    class GatedAttention(nn.Module):
        def __init__(self, heads: int = 4, head_dim: int = 16):
            super().__init__()
            self.head_dim = head_dim
            self.q_proj, self.o_proj = nn.Linear(64, heads * head_dim), nn.Linear(heads * head_dim, 64)
            self.g_proj = nn.Linear(64, heads)

        def forward(self, x):
            b, s, _ = x.shape
            q = self.q_proj(x).view(b, s, -1, self.head_dim)
            return self.o_proj((q * self.g_proj(x).sigmoid().unsqueeze(-1)).reshape(b, s, -1))

    def run(m):
        plan = {"q_proj": hpf.Colwise(), "g_proj": hpf.Colwise(), "o_proj": hpf.Rowwise()}
        return [f.code for f in lint(GatedAttention(), plan, m)]

    assert "heads" not in simulate(run, world_size=2)  # 2 whole heads (and their gates) a rank
    assert "heads" in simulate(run, world_size=8)  # half a head a rank: still refused


def test_shard_raises_every_error_and_warns_once_per_pattern():
    def run(m):
        model = build_hf("llama")
        try:
            hpf.shard(model, hf(model, drop=("o_proj", "down_proj")), m)
        except hpf.PlanError as exc:
            error = str(exc)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hpf.shard(model, hf(model, **{f"model.layers.{i}.mlp.up_proj": hpf.Colwise() for i in range(2)}), m)
        with pytest.raises(hpf.PlanError) as gate:  # a replicated gate_proj beside a sharded up_proj cannot run:
            hpf.shard(model, hf(model, drop=("gate_proj",)), m)  # the shape audit refuses it
        return error, [str(w.message) for w in caught if issubclass(w.category, PlanWarning)], str(gate.value)

    error, warned, gate = simulate(run, world_size=2)
    assert "model.layers.*.self_attn.o_proj" in error and "model.layers.*.mlp.down_proj" in error
    assert error.count("error: ") == 2 and error.count("(2 modules)") == 2  # one line per pattern
    assert len(warned) == 1 and "model.layers.*.mlp.up_proj" in warned[0]
    assert "model.layers.*.mlp: op mul" in gate and "(2 modules)" in gate


def test_replicate_entry_silences_and_collapse_merges_layers():
    def run(m):
        model = build_hf("llama")
        explicit = hf(model, drop=("gate_proj",), **{f"{L}.mlp.gate_proj": hpf.NoParallel()})
        return lint(model, explicit, m), lint(model, hf(model, drop=("gate_proj",)), m)

    silenced, found = simulate(run, world_size=2)
    found = [f for f in found if f.code == "replicated"]  # (both plans cannot run: the shape audit's errors)
    assert [f for f in silenced if f.code == "replicated"] == [] and len(found) == 2
    assert collapse(found) == [str(found[0]).replace("layers.0", "layers.*") + " (2 modules)"]


def test_lint_on_a_plain_mapping_with_an_unknown_style():
    found = simulate(lambda m: lint(MLP(), {"up": "grouped_gemm", "down": Shard(0)}, m), world_size=2)
    assert len(found) == 1 and found[0].code == "entry" and "grouped_gemm" in found[0].message
