"""``ShardingPlan.from_hf`` on HF families that were once refused or crashed (loudly, but
blocking), each against the unsharded model at ws 2 and 4: loss and every gradient
(``.backward()`` and ``torch.func.grad``), and a rank holding well under 80 % of the
parameters where HF's plan shards more than the head.

* Qwen3-MoE with every layer sparse (Qwen3-30B-A3B): HF's dense-MLP entries match nothing and are
  dropped (``plan.explain()`` says so); its experts, and Mixtral's and OLMoE's, which HF's
  ``tp_plan`` leaves whole, get TP inside them on a mesh without ``ep``;
* GLM4-MoE and HunYuan-MoE at 2 KV heads: a shared expert whose projection has ``kv × head_dim``
  features was taken for a K/V projection (``mat1 and mat2`` crash, wrong gradients);
* Gemma 4: per-layer KV-head counts the global config refuses to give;
* Dory: an LM head (``nn.Linear`` subclass) scaling its logits by a per-vocabulary parameter;
* HF styles ``local_params`` (Granite-SWA's sinks), ``packed_rowwise`` + ``moe_tp_experts``
  (Llama 4), ``unit_colwise`` (MiniCPM5-MoE), ``mla_kv_a_proj`` (DeepSeek-V3, also at ep 2 and
  ep 2 × tp 2).
"""

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.func import grad_and_value

import hp_functional as hpf
from hp_functional.sources.hf import LocalParams, hf_entries
from tests.conftest import get_pool
from tests.support.helpers import assert_close, mesh

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=8,
            num_key_value_heads=4, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
#: 2 KV heads of 16 and an MLP of 2 × 16 features: at ws 4 the KV heads are replicated, and the
#: shared expert's projections have exactly the KV projection's width.
KV2 = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
DEEPSEEK = dict(MOE, n_routed_experts=4, first_k_dense_replace=0, n_group=1, topk_group=1, q_lora_rank=32,
                kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, head_dim=None,
                num_key_value_heads=8)
FAMILIES = {  # family: (model_type, config fields, whether a rank must hold < 80 % of the parameters)
    "qwen3_moe_all_sparse": ("qwen3_moe", dict(MOE, num_experts=4, mlp_only_layers=[], decoder_sparse_step=1), True),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2), True),
    "olmoe": ("olmoe", dict(num_experts=4, num_experts_per_tok=2, num_key_value_heads=8), True),
    "glm4_moe": ("glm4_moe", dict(MOE, **KV2, n_routed_experts=4, first_k_dense_replace=0, n_group=1, topk_group=1),
                 True),
    "hunyuan_v1_moe": ("hunyuan_v1_moe", dict(KV2, num_experts=4, moe_topk=2, intermediate_size=32), True),
    "gemma4_text": ("gemma4_text", dict(num_hidden_layers=2, global_head_dim=16, num_global_key_value_heads=2,
                                        attention_k_eq_v=True, layer_types=["sliding_attention", "full_attention"],
                                        hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
                                        sliding_window=4), True),
    "dory": ("dory", dict(use_cache=False), False),  # HF's plan shards the LM head only
    "granite_swa": ("granite_swa", dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                                        sliding_window=4), True),
    "llama4_text": ("llama4_text", dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=64,
                                        interleave_moe_layer_step=1, attention_chunk_size=8), True),
    "minicpm5_moe": ("minicpm5_moe", dict(num_key_value_heads=2, n_routed_experts=4, first_k_dense_replace=0, **MOE),
                     True),
    "deepseek_v3": ("deepseek_v3", DEEPSEEK, True),
}


def build(model_type: str, fields: dict):
    """The tiny model, seeded, with visible expert and norm weights (built alike on every rank)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = {k: v for k, v in {**BASE, **fields}.items() if v is not None}
    config = AutoConfig.for_model(model_type, **kw)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "experts" in name:
                p.normal_(0, 0.1)
    return model


def case_family(family: str, shape: tuple | None = None, names: tuple = ("tp",), plan_kw: dict | None = None):
    model_type, fields, sharded = FAMILIES[family]
    model = build(model_type, fields)
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(7))
    model(input_ids=ids)  # HF's first-call hooks are not ours
    plan = hpf.ShardingPlan.from_hf(model, **(plan_kw or {}))
    apply_fn, params, info = hpf.shard(model, plan, mesh(shape, names))
    share = sum(p.numel() for p in params.values()) / sum(p.numel() for p in model.parameters())
    assert share < 0.8 or not sharded, f"{family}: a rank holds {share:.0%} of the parameters"
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    diffs = {"share": share}
    for functional in (False, True):
        if functional:
            grads, loss = grad_and_value(lambda p: apply_fn(p, input_ids=ids, labels=ids).loss)(params)
        else:
            loss = apply_fn(params, input_ids=ids, labels=ids).loss
            loss.backward()
            grads = {k: p.grad for k, p in params.items()}
        full = hpf.unshard(grads, info)
        diffs[f"loss {functional}"] = assert_close(loss.detach(), ref.loss.detach(), f"{family} loss")
        diffs[f"grads {functional}"] = max(assert_close(full[k], p.grad, f"{family} grad {k}")
                                           for k, p in model.named_parameters())
    return diffs, plan.explain()


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.slow
def test_family_matches_unsharded(pool, family):
    diffs, explained = pool.run(case_family, family)[0]
    print(f"{family} tp {pool.world}: {diffs}")
    if family == "qwen3_moe_all_sparse":  # HF's dense-MLP entries: dropped, and said so
        assert "not planned: model.layers.*.mlp.gate_proj" in explained and "matches no module" in explained


@pytest.mark.slow
def test_deepseek_v3_expert_parallel():
    """MLA with the routed experts over ep: ep 2, ep 2 × tp 2 (TP inside experts and attention), and
    ep 2 × cp 2 (MLA's values have another head dim than its queries and keys: the CP kernels
    carry K | V as one block)."""
    diffs = get_pool(2).run(case_family, "deepseek_v3", (2,), ("ep",), {"ep_axis": "ep"})[0]
    print(f"deepseek_v3 ep 2: {diffs[0]}")
    diffs = get_pool(4).run(case_family, "deepseek_v3", (2, 2), ("ep", "tp"), {"ep_axis": "ep"})[0]
    print(f"deepseek_v3 ep 2 x tp 2: {diffs[0]}")
    diffs = get_pool(4).run(case_family, "deepseek_v3", (2, 2), ("ep", "cp"), {"ep_axis": "ep", "cp_axis": "cp"})[0]
    print(f"deepseek_v3 ep 2 x cp 2: {diffs[0]}")


class _ScaledHead(nn.Linear):
    def __init__(self):
        super().__init__(4, 6)
        self.temperature = nn.Parameter(torch.ones(2))


def test_bad_input_is_refused_by_name():
    """A hand-written entry matching nothing still raises; HF parameter entries need an owner that
    runs on local shards; moe_tp_experts without sharded parameters; a Linear subclass's extra
    parameter that is not one value per output feature."""
    model = build("qwen3_moe", FAMILIES["qwen3_moe_all_sparse"][1])
    with pytest.raises(hpf.PlanError, match="'model.layers.*.mlp.gate_proj' matches no module"):
        names_only = SimpleNamespace(mesh_dim_names=("tp",))  # resolution reads the mesh's axis names only
        hpf.ShardingPlan({"model.layers.*.mlp.gate_proj": "colwise"}).resolve(model, names_only)
    raw = {"model.layers.*.mlp.experts.gate_up_proj": "packed_colwise"}
    with pytest.raises(hpf.PlanError, match="shard parameters of 'model.layers.\\*.mlp.experts'"):
        hf_entries(model, raw)
    experts = model.model.layers[0].mlp.experts
    with pytest.raises(hpf.PlanError, match="experts: moe_tp_experts sums every rank's output"):
        LocalParams(partial_output=True).spec(experts, "experts", "tp")
    with pytest.raises(hpf.PlanError, match=r"head: Colwise .*temperature \(2,\)"):
        hpf.Colwise().spec(_ScaledHead(), "head", "tp")
