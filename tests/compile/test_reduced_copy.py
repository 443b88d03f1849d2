"""``compile.reduced_copy``: the private meta copy whose stacks of blocks keep one block of each
kind (renumbered in order, each standing for the originals it replaces), the plan restated for
it, and the user's model left as it was."""

import hp_functional as hpf
from hp_functional.compile.reduced_copy import reduced_copy, reduced_plan
from tests.support.helpers import build_hf


def test_identical_blocks_reduce_to_one():
    model = build_hf("llama", num_hidden_layers=4)
    red = reduced_copy(model)
    assert len(red.model.model.layers) == 1 and len(model.model.layers) == 4  # the model is only read
    assert all(p.is_meta for p in red.model.parameters())
    q = "model.layers.0.self_attn.q_proj.weight"
    assert red.names[q] == [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(4)]
    assert red.names["model.norm.weight"] == ["model.norm.weight"]
    assert red.original("model.layers.0.mlp") == "model.layers.0.mlp"


def test_blocks_the_plan_treats_differently_are_kept_and_renumbered():
    model = build_hf("llama", num_hidden_layers=4)
    marks = {"model.layers.2.mlp.down_proj": "NoParallel"}  # layer 2 planned apart
    red = reduced_copy(model, marks)
    assert len(red.model.model.layers) == 2
    assert red.names["model.layers.0.mlp.up_proj.weight"] == [f"model.layers.{i}.mlp.up_proj.weight" for i in (0, 1, 3)]
    assert red.names["model.layers.1.mlp.up_proj.weight"] == ["model.layers.2.mlp.up_proj.weight"]
    assert red.original("model.layers.1.mlp.down_proj") == "model.layers.2.mlp.down_proj"
    assert red.original("model.layers.0.self_attn") == "model.layers.0.self_attn"

    plan = hpf.ShardingPlan({**hpf.ShardingPlan.from_hf(model).entries,
                             "model.layers.2.mlp.down_proj": hpf.NoParallel()})
    small = reduced_plan(plan, model, red, ["tp"])
    assert isinstance(small.entries["model.layers.1.mlp.down_proj"], hpf.NoParallel)  # layer 2's style, renumbered
    kept = small.entries["model.layers.0.mlp.down_proj"]
    assert isinstance(kept, hpf.Rowwise), kept
    assert not any(k.startswith(("model.layers.2", "model.layers.3")) for k in small.entries), "no entry for a dropped block"

    assert small.axes == plan.axes and small.settings == plan.settings  # the plan's settings kept


def test_the_config_stays_in_step_with_the_blocks_kept():
    """Ergo's forward zips ``config.layer_types`` with its layers and a VLM resolves hidden-state
    indices by ``num_hidden_layers``: the copy's block count, per-layer lists and the kept blocks'
    own indices follow the blocks it keeps; the user's config is untouched."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kinds = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    config = AutoConfig.for_model("gemma3_text", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, layer_types=kinds,
                                  sliding_window=4, max_position_embeddings=32)
    model = AutoModelForCausalLM.from_config(config)
    red = reduced_copy(model)
    layers = red.model.model.layers
    assert len(layers) == 2, len(layers)  # one sliding, one full
    copied = red.model.config
    assert copied.num_hidden_layers == 2 and copied.layer_types == ["sliding_attention", "full_attention"], copied
    assert [layer.self_attn.layer_idx for layer in layers] == [0, 1]
    assert [layer.self_attn.layer_type for layer in layers] == copied.layer_types
    assert model.config.num_hidden_layers == 4 and model.config.layer_types == kinds  # the model's own
