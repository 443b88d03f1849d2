"""peft's LoRA adapters through ``ShardingPlan.from_hf`` (``sources.peft``) and ``hpf.export_peft``.

``from_hf`` sees through ``PeftModel`` (HF's plan under ``base_model.model.``) and moves each entry
on a LoRA layer onto its ``base_layer`` and the adapter factor that meets the split (colwise:
``lora_B``; rowwise: ``lora_A``), ``modules_to_save`` copies take the entry, DoRA and a LoRA
embedding under vocabulary parallelism are refused by name.  On the rank pool: a Llama with LoRA on
every projection, two active adapters, ``lora_dropout`` under ``hpf.rng`` and a trained ``lm_head``
copy, at tp 2 and FSDP × TP (dp 2 × tp 2): the shard-time probe proves the plan, the loss and every
adapter gradient equal the unsharded peft model's, two ``hpf.optim.adamw`` steps on the adapters
alone equal ``torch.optim.AdamW`` on its trainable parameters with the base untouched, and
``export_peft`` writes what ``PeftModel.from_pretrained`` loads back (the trained adapters, the
sharded model's outputs).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

import hp_functional as hpf
from hp_functional.sources.peft import lora_entries, peft_model_prefix
from tests.conftest import get_pool
from tests.support.helpers import assert_close, build_hf, make_hf_state, mesh, raised
from tests.support.models import build_llama, make_llama_state
from tests.support.snapshot import assert_unchanged, snapshot

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
P = "base_model.model.model.layers.*."
SEED = 7


def build_peft(state, *, second: bool = False, cfg: dict | None = None, **lora):
    """The tiny Llama with LoRA (r 4) on every projection; ``init_lora_weights=False`` so lora_B is not
    zero and lora_A's gradient is not either.  ``second``: a second adapter (r 2 on q_proj and
    down_proj), active beside the first, dropout 0.1 on the first, and a trained ``lm_head`` copy."""
    model = build_llama(state, **(cfg or {}))
    torch.manual_seed(1)
    extra = dict(lora_dropout=0.1, modules_to_save=["lm_head"]) if second else {}
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=TARGETS, init_lora_weights=False,
                                                    task_type="CAUSAL_LM", **extra, **lora))
    if second:
        pm.add_adapter("other", peft.LoraConfig(r=2, target_modules=["q_proj", "down_proj"], init_lora_weights=False))
        pm.base_model.set_adapter(["default", "other"])
    return pm


def split(params):
    """(frozen, adapters): the trainable leaves are the ones peft left requiring grad."""
    return ({k: v for k, v in params.items() if not v.requires_grad},
            {k: v for k, v in params.items() if v.requires_grad})


def ids_of(rows: int, seed: int = 0):
    return torch.randint(0, 128, (rows, 8), generator=torch.Generator().manual_seed(seed))


# --- plans, in one process -------------------------------------------------------------------------


def test_from_hf_moves_entries_onto_base_layers_and_adapters():
    state = make_llama_state()
    pm = build_peft(state, second=True)
    entries = {k: type(v).__name__ for k, v in hpf.ShardingPlan.from_hf(pm).entries.items()}
    colwise = {f"{P}{s}.{n}": "Colwise" for s in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                   "mlp.gate_proj", "mlp.up_proj") for n in ("base_layer", "lora_B.*")}
    rowwise = {f"{P}{s}.{n}": "Rowwise" for s in ("self_attn.o_proj", "mlp.down_proj") for n in ("base_layer", "lora_A.*")}
    saved = {"base_model.model.lm_head.original_module": "Colwise", "base_model.model.lm_head.modules_to_save.*": "Colwise"}
    assert entries == {**colwise, **rowwise, **saved, "base_model.model.model.embed_tokens": "VocabEmbedding"}, entries
    assert hpf.ShardingPlan.from_hf(pm).entries["base_model.model.lm_head.original_module"].gather_output

    # LoRA on some layers only (layers_to_transform): the others keep the entry by their own paths
    few = peft.get_peft_model(build_llama(state), peft.LoraConfig(r=4, target_modules=["q_proj"], layers_to_transform=[1]))
    moved = hpf.ShardingPlan.from_hf(few).entries
    assert "base_model.model.model.layers.0.self_attn.q_proj" in moved and f"{P}self_attn.q_proj.lora_B.*" in moved
    assert f"{P}self_attn.q_proj" not in moved
    # LoRA injected without a PeftModel (transformers' add_adapter does the same): no prefix, the same moves
    injected = peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=["o_proj"]), build_llama(state))
    assert peft_model_prefix(injected) == ""
    plan = hpf.ShardingPlan.from_hf(injected).entries
    assert isinstance(plan["model.layers.*.self_attn.o_proj.lora_A.*"], hpf.Rowwise)
    assert "model.layers.*.self_attn.o_proj" not in plan
    # a plain model is planned as before
    plain = build_llama(state)
    assert lora_entries(plain, dict(plain._tp_plan), lambda v: v) == dict(plain._tp_plan)


def test_from_hf_refuses_what_it_cannot_shard_exactly():
    state = make_llama_state()
    cases = {
        "DoRA": (dict(target_modules=["o_proj"], use_dora=True), "self_attn.o_proj: DoRA"),
        "embedding": (dict(target_modules=["embed_tokens"]), "model.embed_tokens: LoRA on an embedding"),
    }
    for what, (lora, text) in cases.items():
        pm = peft.get_peft_model(build_llama(state), peft.LoraConfig(r=4, **lora))
        error = raised(hpf.ShardingPlan.from_hf, pm)
        assert error is not None and error[0] == "PlanError" and text in error[1], (what, error)
    ia3 = peft.get_peft_model(build_llama(state), peft.IA3Config(target_modules=["k_proj"], feedforward_modules=[]))
    error = raised(hpf.ShardingPlan.from_hf, ia3)
    assert error is not None and error[0] == "PlanError" and "LoRA adapters only" in error[1] and "IA3" in error[1], error


# --- tp 2: exact, trained, exported ----------------------------------------------------------------


def case_tp(state, out: str):
    pm = build_peft(state, second=True)
    pm.train()  # lora_dropout 0.1: the masks are the unsharded model's under hpf.rng
    before = snapshot(pm)
    apply_fn, params, info = hpf.shard(pm, hpf.ShardingPlan.from_hf(pm), mesh())
    assert_unchanged(before, snapshot(pm))
    assert apply_fn.runtime.checks["probe"] == "exact on the probe copy", apply_fn.runtime.checks
    layer = "base_model.model.model.layers.0."
    expected = {"self_attn.q_proj.lora_A.default": Replicate(), "self_attn.q_proj.lora_B.default": Shard(0),
                "self_attn.q_proj.lora_B.other": Shard(0), "self_attn.o_proj.lora_A.default": Shard(1),
                "self_attn.o_proj.lora_B.default": Replicate(), "mlp.down_proj.lora_A.other": Shard(1)}
    for name, placement in expected.items():
        assert info[f"{layer}{name}.weight"].placements == (placement,), (name, info[f"{layer}{name}.weight"])
    frozen, adapters = split(params)
    trainable = {n: p for n, p in pm.named_parameters() if p.requires_grad}
    assert set(adapters) == set(trainable) and "base_model.model.lm_head.modules_to_save.default.weight" in adapters

    def loss_of(a, x, seed):
        with hpf.rng(seed):
            return apply_fn({**frozen, **a}, input_ids=x, labels=x).loss

    # lr 1e-3: Adam's normalised step turns a 1e-7 gradient difference on a near-zero entry into a
    # step-sized one, so the parameter tolerance (1e-4) scales with lr (as tests/train/test_fsdp.py)
    ref_opt = torch.optim.AdamW(trainable.values(), lr=1e-3, weight_decay=0.01)
    opt = hpf.optim.adamw(1e-3, weight_decay=0.01)
    opt_state = opt.init(adapters)
    for step in range(2):
        x = ids_of(2, step)
        grads, loss = torch.func.grad_and_value(loss_of)(adapters, x, SEED + step)
        ref_opt.zero_grad()
        with hpf.rng(SEED + step):
            ref = pm(input_ids=x, labels=x).loss
        ref.backward()
        assert_close(loss, ref.detach(), f"loss at step {step}")
        full = hpf.unshard(grads, info)
        for k, p in trainable.items():
            assert p.grad.abs().max() > 0, f"{k}: a zero gradient would hide a wrong one"
            assert_close(full[k], p.grad, f"step {step} grad {k}", atol=1e-4 * p.grad.abs().max().item() + 1e-9,
                         rtol=1e-4)
        ref_opt.step()
        with torch.no_grad():
            adapters, opt_state = opt.update(grads, opt_state, adapters)
    trained = hpf.unshard(adapters, info)
    for k, p in trainable.items():
        assert_close(trained[k], p.detach(), f"after 2 AdamW steps: {k}", atol=1e-4, rtol=1e-4)
    assert all(frozen[k] is params[k] for k in frozen)
    base = hpf.unshard(frozen, info)
    assert all(torch.equal(base[k], pm.get_parameter(k)) for k in frozen), "the frozen base changed"
    ref_opt.zero_grad()
    # refused on every rank before any collective: params without the adapters, an adapter the model lacks
    assert "params lack" in raised(hpf.export_peft, frozen, info, pm, f"{out}/bad")[1]
    assert "no adapter 'nope'" in raised(hpf.export_peft, params, info, pm, f"{out}/bad", adapter_name="nope")[1]
    return _export_and_load(pm, state, {**frozen, **adapters}, info, apply_fn, out, trained)


def _export_and_load(pm, state, params, info, apply_fn, out: str, trained) -> list[str]:
    """Export both adapters, load them into a fresh base with peft, compare adapters and outputs."""
    config, before = pm.peft_config["default"].to_dict(), snapshot(pm)
    for name in pm.peft_config:
        hpf.export_peft(params, info, pm, f"{out}/{name}", adapter_name=name)
    assert pm.peft_config["default"].to_dict() == config, "the user's peft config changed"
    assert_unchanged(before, snapshot(pm))
    loaded = peft.PeftModel.from_pretrained(build_llama(state), f"{out}/default")  # the base: frozen, unchanged
    loaded.load_adapter(f"{out}/other", "other")
    loaded.base_model.set_adapter(["default", "other"])
    loaded.train()
    got = dict(loaded.named_parameters())
    for k, v in trained.items():
        assert_close(got[k].detach(), v, f"loaded adapter {k}", atol=0, rtol=0)
    x = ids_of(2, 9)
    with hpf.rng(SEED):
        logits = apply_fn(params, input_ids=x).logits
    with hpf.rng(SEED):
        ref = loaded(input_ids=x).logits
    assert_close(logits, ref.detach(), "logits of the loaded adapters vs the sharded model")
    return sorted(os.listdir(f"{out}/default"))


@pytest.mark.slow
def test_lora_tp2_exact_trained_and_exported(tmp_path):
    results = get_pool(2).run(case_tp, make_llama_state(), str(tmp_path / "adapters"))
    assert results[0] == ["adapter_config.json", "adapter_model.safetensors", "hpf_checksums.json"], results


def case_qwen3(state):
    """Qwen3 (per-head q_norm/k_norm planned replicated with their gradients reduced): loss and grads at tp 2."""
    model = build_hf("qwen3", state)
    torch.manual_seed(1)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=TARGETS, init_lora_weights=False))
    apply_fn, params, info = hpf.shard(pm, hpf.ShardingPlan.from_hf(pm), mesh())
    frozen, adapters = split(params)
    x = ids_of(2)
    grads, loss = torch.func.grad_and_value(lambda a: apply_fn({**frozen, **a}, x, labels=x).loss)(adapters)
    ref = pm(x, labels=x).loss
    ref.backward()
    assert_close(loss, ref.detach(), "qwen3 loss")
    full = hpf.unshard(grads, info)
    for k, g in full.items():
        p = pm.get_parameter(k)
        assert_close(g, p.grad, f"qwen3 grad {k}", atol=1e-4 * p.grad.abs().max().item() + 1e-9, rtol=1e-4)
    return apply_fn.runtime.checks["probe"]


@pytest.mark.slow
def test_lora_qwen3_tp2_exact():
    assert get_pool(2).run(case_qwen3, make_hf_state("qwen3")) == ["exact on the probe copy"] * 2


# --- FSDP × TP (dp 2 × tp 2) --------------------------------------------------------------------------


def case_fsdp_tp(state, out: str):
    pm = build_peft(state)
    m = mesh((2, 2), ("dp", "tp"))
    apply_fn, params, info = hpf.fsdp(*hpf.shard(pm, hpf.ShardingPlan.from_hf(pm), m), m, "dp")
    assert apply_fn.runtime.checks["probe"] == "exact on the probe copy", apply_fn.runtime.checks
    frozen, adapters = split(params)
    dp = m["dp"]
    x = ids_of(4)
    local = x.chunk(dp.size())[dp.get_local_rank()]
    grads, loss = torch.func.grad_and_value(
        lambda a: apply_fn({**frozen, **a}, input_ids=local, labels=local).loss)(adapters)
    ref = pm(input_ids=x, labels=x).loss
    ref.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=dp.get_group())
    assert_close(total / dp.size(), ref.detach(), "dp-mean loss")
    full = hpf.unshard(grads, info)
    for k, p in pm.named_parameters():
        if p.requires_grad:
            assert_close(full[k], p.grad, f"grad {k}", atol=1e-4 * p.grad.abs().max().item() + 1e-9,
                         rtol=1e-4)
    assert set(full) == {k for k, p in pm.named_parameters() if p.requires_grad}
    hpf.export_peft(params, info, pm, out)  # gathered from the fsdp rows of the tp shards
    loaded = peft.PeftModel.from_pretrained(build_llama(state), out)
    got = dict(loaded.named_parameters())
    for k in full:
        assert torch.equal(got[k].detach(), pm.get_parameter(k).detach()), f"exported {k}"
    bad = build_peft(make_llama_state(intermediate_size=6), cfg=dict(intermediate_size=6))  # 6 features over tp 4
    indivisible = raised(hpf.shard, bad, hpf.ShardingPlan.from_hf(bad), mesh((4,), ("tp",)))
    # 2 KV heads over tp 4: each KV head's base_layer and lora_B rows replicated over the 2 ranks that use it
    few = build_peft(make_llama_state(num_key_value_heads=2), cfg=dict(num_key_value_heads=2))
    f_apply, f_params, f_info = hpf.shard(few, hpf.ShardingPlan.from_hf(few), mesh((4,), ("tp",)))
    frozen, adapters = split(f_params)
    grads, loss = torch.func.grad_and_value(lambda a: f_apply({**frozen, **a}, input_ids=x, labels=x).loss)(adapters)
    few.zero_grad(set_to_none=True)
    ref = few(input_ids=x, labels=x).loss
    ref.backward()
    assert_close(loss, ref.detach(), "2 KV heads over tp 4: loss")
    full = hpf.unshard(grads, f_info)
    kv = max(assert_close(full[k], few.get_parameter(k).grad, f"2 KV heads over tp 4: grad {k}", atol=1e-6, rtol=1e-4)
             for k in full)
    return indivisible, kv


@pytest.mark.slow
def test_lora_fsdp_tp_exact_and_exported(tmp_path):
    results = get_pool(4).run(case_fsdp_tp, make_llama_state(), str(tmp_path / "adapter"))
    for indivisible, kv_heads in results:  # refused on every rank, naming the LoRA layer's piece
        assert indivisible is not None and indivisible[0] == "ShapeError", indivisible
        assert "mlp.gate_proj.base_layer" in indivisible[1], indivisible
        assert kv_heads < 1e-4, kv_heads
