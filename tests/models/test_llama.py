"""A tiny Hugging Face LlamaForCausalLM under TP: loss, logits and every gradient vs unsharded."""

import pytest
import torch
from torch.distributed.tensor import Replicate
from torch.func import grad_and_value

import hp_functional as hpf
from tests.support.helpers import assert_close, build_hf, make_hf_state, mesh
from tests.support.models import build_llama, make_llama_state


def case_llama(state, plan_kind: str, mesh_shape, cfg, family: str = "llama"):
    names = ("tp",) if len(mesh_shape) == 1 else ("dp", "tp")
    m = mesh(tuple(mesh_shape), names)
    model = build_hf(family, state, **cfg)
    plan = {
        "hf": lambda: hpf.ShardingPlan.from_hf(model),
        "hf_loss_parallel": lambda: hpf.ShardingPlan.from_hf(model, loss_parallel=True),
        "sp": hpf.llama_sp_plan,
        "regions": lambda: hpf.megatron_plan(model, partial_exit=False),
        "regions_partial_exit": lambda: hpf.megatron_plan(model, partial_exit=True),
        # a whole decoder layer as one region: residual adds and norms inside it
        "layer_regions": lambda: hpf.ShardingPlan({
            **hpf.ShardingPlan.from_hf(model).entries,
            "model.layers.*": hpf.PrepareInput({"hidden_states": (Replicate(), Replicate())}),
        }),
        "phi3_packed": lambda: hpf.ShardingPlan({
            **hpf.ShardingPlan.from_hf(model).entries,
            "model.layers.*.mlp.gate_up_proj": "packed_colwise",  # gate and up sliced separately
            "model.layers.*.mlp.down_proj": "rowwise",
        }),
    }[plan_kind]()
    apply_fn, params, info = hpf.shard(model, plan, m)

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, model.config.vocab_size, (2 * m.size(0), 8), generator=g)
    if len(mesh_shape) == 2:  # data parallel over dp: each dp group its own batch
        ids = ids.chunk(m.size(0))[m["dp"].get_local_rank()]

    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    ref_grads = {k: p.grad for k, p in model.named_parameters()}

    out = apply_fn(params, input_ids=ids, labels=ids)
    ref_logits = ref.logits.detach()
    if plan.settings["loss_parallel"]:  # logits stay vocab-sharded: compare this rank's slice
        tp = m["tp"]
        ref_logits = ref_logits.chunk(tp.size(), -1)[tp.get_local_rank()]
    assert_close(out.logits, ref_logits, "logits")
    assert_close(out.loss, ref.loss.detach(), "loss")
    out.loss.backward()
    grads_bw = {k: p.grad for k, p in params.items()}
    grads_fn, loss = grad_and_value(lambda p: apply_fn(p, input_ids=ids, labels=ids).loss)(params)
    assert_close(loss, ref.loss.detach(), "grad_and_value loss")
    for label, grads in (("backward", grads_bw), ("grad_and_value", grads_fn)):
        full = hpf.unshard(grads, info)
        assert set(full) == set(ref_grads), "every parameter has a gradient"
        for k in ref_grads:
            assert_close(full[k], ref_grads[k], f"{label} grad {k}")
    return {k: str(i.placements) for k, i in info.items()}


@pytest.mark.parametrize("plan_kind", ["hf", "sp", "regions", "regions_partial_exit", "layer_regions"])
@pytest.mark.slow
def test_llama_matches_unsharded(pool, plan_kind):
    placements = pool.run(case_llama, make_llama_state(), plan_kind, (pool.world,), {})[0]
    assert placements["model.embed_tokens.weight"] == "(Shard(dim=0),)"
    assert placements["model.layers.0.self_attn.o_proj.weight"] == "(Shard(dim=1),)"
    assert placements["model.norm.weight"] == "(Replicate(),)"


def test_llama_2d_mesh_dp_tp(pool):
    pool.run(case_llama, make_llama_state(), "sp", (pool.world // 2, 2), {})


def test_llama_tied_embeddings(pool):
    cfg = {"tie_word_embeddings": True}
    placements = pool.run(case_llama, make_llama_state(**cfg), "hf", (pool.world,), cfg)[0]
    assert "lm_head.weight" not in placements  # one leaf under the first FQN


@pytest.mark.parametrize("family", ["qwen3", "phi3"])
@pytest.mark.slow
def test_hf_families_from_hf_plan(pool, family):
    """Qwen3: per-head q_norm/k_norm as replicated_with_grad_allreduce; Phi3: fused qkv/gate_up
    projections as colwise_gather_output + rowwise_split_input."""
    placements = pool.run(case_llama, make_hf_state(family), "hf", (pool.world,), {}, family)[0]
    assert any("Shard(dim=1)" in p for k, p in placements.items() if k.endswith("o_proj.weight"))


def case_explain_and_dtensor(state):
    model = build_llama(state)
    m = mesh()
    text = str(hpf.explain(model, hpf.llama_sp_plan(), m))
    apply_fn, params, info = hpf.shard(model, hpf.llama_sp_plan(), m)
    dt = hpf.to_dtensor(params, info)
    for k, p in model.named_parameters():
        torch.testing.assert_close(dt[k].full_tensor(), p.detach(), msg=k)
        assert dt[k].to_local().data_ptr() == params[k].data_ptr(), "to_dtensor must not copy"
    return text


def test_explain_lists_the_lowered_collectives(pool):
    text = pool.run(case_explain_and_dtensor, make_llama_state())[0]
    attn = text.split("model.layers.0.self_attn  ")[1].split("\n")[1]
    assert "all_gather(1)" in attn and "reduce_scatter(1)" in attn, attn
    assert "fwd reduce_scatter(1), bwd all_gather(1)" in text  # o_proj / down_proj leaving to Shard(1)
    assert "param weight     (S(0))" in text


@pytest.mark.parametrize(
    "family,cfg",
    [("qwen2", {}), ("mistral", {}), ("gemma", {"tie_word_embeddings": True})],  # gemma: tied, scaled embedding
)
@pytest.mark.slow
def test_more_hf_families(pool, family, cfg):
    pool.run(case_llama, make_hf_state(family, **cfg), "hf", (pool.world,), cfg, family)


def case_training(state, steps: int):
    """AdamW over the params pytree vs AdamW over the unsharded model, step for step."""
    model = build_llama(state)
    apply_fn, params, info = hpf.shard(model, hpf.ShardingPlan.from_hf(model, loss_parallel=True), mesh())
    opt = torch.optim.AdamW(params.values(), lr=1e-2)
    ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 128, (2, 16), generator=g) for _ in range(4)]
    deltas = []
    for step in range(steps):
        ids = batches[step % len(batches)]
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = apply_fn(params, input_ids=ids, labels=ids).loss
        loss.backward()
        ref = model(input_ids=ids, labels=ids).loss
        ref.backward()
        opt.step()
        ref_opt.step()
        deltas.append(abs(loss.item() - ref.item()))
    full = hpf.unshard(params, info)
    for k, p in model.named_parameters():
        assert_close(full[k], p.detach(), f"param {k} after {steps} steps", atol=1e-4, rtol=1e-4)
    assert max(deltas) < 1e-4, deltas
    return max(deltas), deltas


@pytest.mark.slow
def test_training_curve_matches_unsharded(pool):
    worst, deltas = pool.run(case_training, make_llama_state(), 20)[0]
    print(f"world {pool.world}: max |Δloss| over 20 AdamW steps = {worst:.2e}")


def test_phi3_packed_gate_up(pool):
    placements = pool.run(case_llama, make_hf_state("phi3"), "phi3_packed", (pool.world,), {}, "phi3")[0]
    assert placements["model.layers.0.mlp.gate_up_proj.weight"] == "(Shard(dim=0),)"


@pytest.mark.parametrize("tied", [False, True])
def test_llama_loss_parallel(pool, tied):
    cfg = {"tie_word_embeddings": tied}
    pool.run(case_llama, make_llama_state(**cfg), "hf_loss_parallel", (pool.world,), cfg)
