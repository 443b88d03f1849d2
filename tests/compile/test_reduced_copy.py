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


def _granite_encoder(layers: int = 2):
    """Granite Speech 5's CTC encoder (the sweep's tiny config; ``layers`` plain blocks past 2) and a
    batch: its forward runs the CTC head ``out`` (and ``out_mid`` on its softmax) after layer
    ``num_hidden_layers // 2``."""
    import torch
    from transformers import GraniteSpeech5Encoder

    from hp_functional.tools.sweep import build

    model, inputs, _, _ = build("granite_speech5_encoder", 2)
    if layers != 2:
        config = model.config
        config.num_hidden_layers, config.subsample_layers = layers, []
        torch.manual_seed(0)
        model = GraniteSpeech5Encoder(config).eval()
    return model, inputs


def test_a_forward_that_counts_its_layers_keeps_what_it_calls():
    """A one-block copy of Granite Speech's encoder has ``num_hidden_layers // 2 == 0`` and never
    runs its CTC head, so the probe and the dataflow pass saw nothing of ``out``/``out_mid`` and a
    plan splitting them went through unproved: given a batch, the reduction is checked on meta
    tensors and keeps two blocks of a kind where one does not call every module the model calls."""
    from hp_functional.analysis.copies import meta_copy
    from hp_functional.compile.reduced_copy import called_modules

    model, inputs = _granite_encoder(layers=4)
    whole = called_modules(meta_copy(model), ((), inputs))
    assert {"out", "out_mid"} <= whole, whole
    unchecked = reduced_copy(model)
    assert len(unchecked.model.layers) < len(model.layers) and "out" not in called_modules(unchecked.model, ((), inputs))
    checked = reduced_copy(model, inputs=((), inputs))
    assert 1 < len(checked.model.layers) < len(model.layers), len(checked.model.layers)
    assert {"out", "out_mid"} <= called_modules(checked.model, ((), inputs))
    assert len(model.layers) == model.config.num_hidden_layers  # the model is only read


def case_split_ctc_head():
    from tests.support.helpers import mesh, raised

    model, inputs = _granite_encoder()
    plan = hpf.ShardingPlan({"out": hpf.Colwise(gather_output=False), "out_mid": hpf.Rowwise()})
    return raised(hpf.shard, model, plan, mesh(), example_inputs=inputs)


def test_a_plan_splitting_a_head_the_copy_skipped_is_refused():
    """The CTC head's vocabulary split before a softmax over it: wrong (loss 3e-5 off, the head's
    gradients 100 % off); refused now that the probe's copy runs the head."""
    from tests.conftest import get_pool

    for got in get_pool(2).run(case_split_ctc_head):
        assert got is not None and got[0] == "PlanError" and "shard-time probe" in got[1], got
