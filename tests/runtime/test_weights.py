"""Weights in and out: ``from_pretrained`` / ``shard(weights=)`` read only local slices of
safetensors checkpoints written by ``save_pretrained`` (one file, and sharded into parts), a
meta model without weights is initialised per module, ``export_hf`` round-trips through HF's
``from_pretrained``, the per-rank peak memory of a load, and bad checkpoints."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import get_pool
from tests.support.helpers import assert_close, build_hf, make_hf_state, mesh, rank

#: tied (no lm_head in the file), untied with biases, packed gate_up with a vocab-parallel embedding
FAMILIES = {"llama": {"tie_word_embeddings": True}, "qwen2": {}, "phi3": {}}


def _plan(family: str, model):
    """from_pretrained's own plan (None), or for phi3 one with packed and vocab-parallel layouts."""
    import hp_functional as hpf

    if family != "phi3":
        return None
    return hpf.ShardingPlan({**hpf.ShardingPlan.from_hf(model).entries, "model.embed_tokens": hpf.VocabEmbedding(),
                             "model.layers.*.mlp.gate_up_proj": "packed_colwise", "model.layers.*.mlp.down_proj": "rowwise"})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (state, {"one": folder, "parts": folder}), written once by the test process."""
    out = {}
    for family, cfg in FAMILIES.items():
        state = make_hf_state(family, **cfg)
        model = build_hf(family, state, **cfg)
        folders = {"one": tmp_path_factory.mktemp(f"{family}_one"), "parts": tmp_path_factory.mktemp(f"{family}_parts")}
        model.save_pretrained(folders["one"])
        model.save_pretrained(folders["parts"], max_shard_size="40KB")
        out[family] = (state, {k: str(v) for k, v in folders.items()})
    return out


def _ids():
    return torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def _matches_full(folder: str, family: str, state, old_order: bool = False) -> float:
    import hp_functional as hpf
    from hp_functional.tools.models import build_model, tiny_config

    plan = _plan(family, build_model(tiny_config(family, **FAMILIES[family]), device="meta"))
    apply_fn, params, info, config = hpf.from_pretrained(folder, plan, mesh())
    assert config.model_type == family
    if old_order:  # the earlier argument order is a TypeError that says which is which
        with pytest.raises(TypeError, match=r"the order is shard's, pass mesh=mesh"):
            hpf.from_pretrained(folder, mesh(), plan)
    if family == "phi3":  # read as slices: the rank's half of gate and of up, its rows of the vocabulary
        assert info["model.layers.0.mlp.gate_up_proj.weight"].blocks and info["model.embed_tokens.weight"].is_sharded
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in params.values())
    ref = build_hf(family, state, **FAMILIES[family])
    ids = _ids()
    out = apply_fn(params, input_ids=ids, labels=ids)
    expected = ref(input_ids=ids, labels=ids)
    expected.loss.backward()
    grads = torch.func.grad(lambda p: apply_fn(p, input_ids=ids, labels=ids).loss)(params)
    worst = max(assert_close(out.logits, expected.logits.detach(), "logits"),
                assert_close(out.loss, expected.loss.detach(), "loss"))
    for k, g in grads.items():
        worst = max(worst, assert_close(g, hpf.slice_local(ref.get_parameter(k).grad, info[k]), f"grad {k}"))
    return worst


@pytest.mark.parametrize("pool,family", [(2, f) for f in FAMILIES] + [(4, "llama")], indirect=["pool"],
                         ids=[f"ws2-{f}" for f in FAMILIES] + ["ws4-llama"])
@pytest.mark.slow
def test_from_pretrained_matches_the_full_model(pool, saved, family):
    """Every family at world size 2 (the families differ in their files, not in how ranks slice them),
    Llama at 4 too."""
    state, folders = saved[family]
    for layout, folder in folders.items():
        worst = max(pool.run(_matches_full, folder, family, state, family == "llama" and layout == "one"))
        assert worst <= 1e-5, (layout, worst)


def _meta_init(family: str) -> dict:
    import hp_functional as hpf
    from hp_functional.runtime.meta_init import init_weights
    from hp_functional.tools.models import build_model, tiny_config

    config = tiny_config(family, **FAMILIES[family])
    plan = hpf.ShardingPlan.from_hf(build_model(config, device="meta"), tp_axis="tp")
    _, params, info = hpf.shard(build_model(config, device="meta"), plan, mesh(), seed=5)
    full = init_weights(build_model(config, device="meta"), seed=5)
    other = init_weights(build_model(config, device="meta"), seed=6)
    for k, p in params.items():
        assert torch.equal(p, hpf.slice_local(full[k], info[k])), k
    q = full["model.layers.0.self_attn.q_proj.weight"]
    return {"keys": sorted(params) == sorted(full), "norm_ones": bool((full["model.norm.weight"] == 1).all()),
            "std": q.std().item(), "seed_differs": not torch.equal(q, other["model.layers.0.self_attn.q_proj.weight"])}


def test_a_meta_model_without_weights_gets_the_full_size_init_per_shard(pool):
    for r in pool.run(_meta_init, "llama"):
        assert r["keys"] and r["norm_ones"] and r["seed_differs"], r
        assert 0.015 < r["std"] < 0.025, r  # HF's normal_(0, initializer_range=0.02)


def _export_round_trip(folder: str, family: str, out: str) -> bool:
    from transformers import AutoModelForCausalLM

    import hp_functional as hpf
    from hp_functional.tools.models import build_model, tiny_config

    apply_fn, params, info, config = hpf.from_pretrained(folder, mesh=mesh())
    ids = _ids()
    grads = torch.func.grad(lambda p: apply_fn(p, input_ids=ids, labels=ids).loss)(params)
    trained = {k: p - 0.5 * grads[k] for k, p in params.items()}  # not the file's values any more
    meta = build_model(tiny_config(family, **FAMILIES[family]), device="meta")
    hpf.export_hf(trained, info, meta, out, max_shard_size="30KB")
    full = hpf.unshard(trained, info)
    if rank() != 0:
        return True
    back = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    ref = build_hf(family, None, **FAMILIES[family])
    ref.load_state_dict(full, strict=False)  # strict=False: the tied lm_head is one leaf
    assert all(torch.equal(back.get_parameter(k), full[k]) for k in full)
    return torch.equal(back(input_ids=ids).logits, ref(input_ids=ids).logits)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_hf_round_trips_through_from_pretrained(pool, saved, family, tmp_path):
    assert all(pool.run(_export_round_trip, saved[family][1]["parts"], family, str(tmp_path / "export")))
    assert not (tmp_path / "export.hpf-partial").exists() and (tmp_path / "export" / "hpf_checksums.json").is_file()


# ---------------------------------------------------------------- peak memory
def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def _peak_load(folder: str) -> dict:
    import hp_functional as hpf
    from hp_functional.core.placement import boxes
    from hp_functional.tools.models import build_model, load_config

    model = build_model(load_config(folder), device="meta")
    plan = hpf.ShardingPlan.from_hf(model, tp_axis="tp")
    with open("/proc/self/clear_refs", "w") as f:  # reset the RSS high-water mark (VmHWM) of this process
        f.write("5")
    before = _vm("VmRSS")
    _, params, info = hpf.shard(model, plan, mesh(), weights=folder)
    peak = _vm("VmHWM") - before
    return {"peak": peak, "local": sum(p.numel() * p.element_size() for p in params.values()),
            "slice": max(b.size[0] * b.size[1] * 4 if len(b.size) == 2 else 0 for i in info.values() for b in boxes(i))}


@pytest.mark.parametrize("pool", [4], indirect=True)
@pytest.mark.slow
def test_peak_memory_of_a_load_is_the_local_shards_plus_one_slice(pool, tmp_path):
    from hp_functional.tools.models import build_model, tiny_config

    config = tiny_config("llama", vocab_size=8192, hidden_size=512, intermediate_size=2048, num_hidden_layers=12,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64)
    model = build_model(config)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(tmp_path, max_shard_size="20MB")
    del model
    rows = pool.run(_peak_load, str(tmp_path))
    mib = 2**20
    print(f"\nfull model {full / mib:.0f} MiB; per rank at tp 4: local shards, largest slice read, peak RSS increase")
    for r, row in enumerate(rows):
        print(f"  rank {r}: {row['local'] / mib:6.1f} MiB  {row['slice'] / mib:5.1f} MiB  {row['peak'] / mib:6.1f} MiB")
    block = (full - 2 * 8192 * 512 * 4) / 12  # one decoder layer's bytes (untied embedding and head aside)
    for row in rows:  # the shard-time probe runs before the load on a copy of one layer (and a 128-token vocabulary)
        assert row["peak"] < row["local"] + 2 * row["slice"] + 3 * block + 48 * mib, row
        assert full > 1.6 * row["peak"], (full, row)


# ---------------------------------------------------------------- bad checkpoints
def _bad(folder: str) -> str:
    import hp_functional as hpf
    from hp_functional.tools.models import build_model, tiny_config

    model = build_model(tiny_config("qwen2"), device="meta")
    try:
        hpf.shard(model, hpf.ShardingPlan.from_hf(model, tp_axis="tp"), mesh(), weights=folder)
    except hpf.PlanError as exc:
        return str(exc)
    return "no error"


def test_bad_checkpoints_raise_on_every_rank_naming_the_tensor(saved, tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    pool = get_pool(2)
    state = load_file(f"{saved['qwen2'][1]['one']}/model.safetensors")
    cases = {}
    save_file({k: v for k, v in state.items() if k != "model.norm.weight"}, tmp_path / "missing.safetensors")
    cases["missing.safetensors"] = "model.norm.weight"
    save_file(state | {"model.layers.1.mlp.up_proj.weight": torch.zeros(64, 64)}, tmp_path / "shape.safetensors")
    cases["shape.safetensors"] = "model.layers.1.mlp.up_proj.weight has shape (64, 64) in the checkpoint but the model's"
    data = (tmp_path / "shape.safetensors").read_bytes()
    (tmp_path / "truncated.safetensors").write_bytes(data[: len(data) // 2])
    cases["truncated.safetensors"] = "corrupt or partial"
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "part-1.safetensors"}}))
    cases["index"] = "part-1.safetensors"
    cases["nowhere"] = "no such file or folder"
    for name, expected in cases.items():
        messages = pool.run(_bad, str(tmp_path / name))
        assert all(expected in m for m in messages), (name, messages)


# ---------------------------------------------------------------- a plain nn.Module
def _plain_module(folder: str) -> float:
    """torch's reset_parameters as the init (no HF), and weights= from a plain save_file."""
    import hp_functional as hpf
    from tests.support.models import MLP

    plan = {"up": "colwise", "down": "rowwise"}
    with torch.device("meta"):
        meta = MLP()
    _, params, info = hpf.shard(meta, plan, mesh(), seed=2)
    full = hpf.init_weights(meta, seed=2)
    assert all(torch.equal(p, hpf.slice_local(full[k], info[k])) for k, p in params.items())
    assert bool((full["norm.weight"] == 1).all()) and full["up.weight"].abs().max() <= 16 ** -0.5  # kaiming-uniform bound
    ref = MLP()
    ref.load_state_dict(full)
    apply_fn, params, info = hpf.shard(meta, plan, mesh(), weights=folder)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    from safetensors.torch import load_file

    ref.load_state_dict(load_file(folder))
    return assert_close(apply_fn(params, x), ref(x).detach(), "plain MLP from a safetensors file")


def test_a_plain_module_loads_and_initialises_on_meta(pool, tmp_path):
    from safetensors.torch import save_file

    from tests.support.models import MLP, make_mlp_state

    model = MLP()
    model.load_state_dict(make_mlp_state())
    save_file(model.state_dict(), tmp_path / "mlp.safetensors")
    assert max(pool.run(_plain_module, str(tmp_path / "mlp.safetensors"))) <= 1e-5


def _bad_export(out: str) -> str:
    import hp_functional as hpf
    from hp_functional.tools.models import build_model, tiny_config

    meta = build_model(tiny_config("qwen2"), device="meta")
    _, params, info = hpf.shard(meta, hpf.ShardingPlan.from_hf(meta, tp_axis="tp"), mesh(), seed=0)
    params.pop("model.norm.weight")
    try:
        hpf.export_hf(params, info, meta, out)
    except hpf.PlanError as exc:
        return str(exc)
    return "no error"


def test_export_of_incomplete_params_raises_and_writes_nothing(tmp_path):
    messages = get_pool(2).run(_bad_export, str(tmp_path / "out"))
    assert all("model.norm.weight" in m for m in messages), messages
    assert not list(tmp_path.iterdir())
