"""Optimizer masks and groups under the package's one pattern rule (``core.paths``): ``*`` is one
segment, ``**`` any number, and a leaf goes to the most specific pattern whatever the dict's order;
a tie and a leaf no pattern claims are errors naming them."""

import pytest
import torch

import hp_functional as hpf
from hp_functional.core.errors import PlanError
from hp_functional.train.optim_masks import PatternMask, mask_fn

NAMES = ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.weight",
         "model.layers.0.self_attn.q_proj.bias", "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight",
         "model.layers.1.self_attn.q_norm.weight", "model.norm.weight", "lm_head.weight", "bias"]


def params_and_grads(steps: int = 3):
    g = torch.Generator().manual_seed(0)
    params = {n: torch.randn(3, generator=g, dtype=torch.float64) for n in NAMES}
    return params, [{n: torch.randn(3, generator=g, dtype=torch.float64) for n in NAMES} for _ in range(steps)]


def run(opt, params, grads):
    state = opt.init(params)
    for g in grads:
        params, state = opt.update(g, state, params)
    return params, state


# group dicts and the leaves each pattern claims on NAMES (the rest go to "**")
GROUPS = [
    ({"**.*bias": "sgd", "**.*norm*.**": "adam0", "**": "adam"},
     {"**.*bias": {"model.layers.0.self_attn.q_proj.bias", "bias"},
      "**.*norm*.**": {"model.layers.0.input_layernorm.weight", "model.layers.1.self_attn.q_norm.weight",
                       "model.norm.weight"}}),
    ({"model.layers.**.weight": "sgd", "**": "adam"},
     {"model.layers.**.weight": {n for n in NAMES if n.startswith("model.layers.") and n.endswith(".weight")}}),
    ({"**.*embed_tokens*.**": "sgd", "lm_head.weight": "sgd2", "**": "adam"},
     {"**.*embed_tokens*.**": {"model.embed_tokens.weight"}, "lm_head.weight": {"lm_head.weight"}}),
]
OPTS = {"sgd": lambda: hpf.optim.sgd(1e-1, momentum=0.9), "sgd2": lambda: hpf.optim.sgd(1e-2, momentum=0.5),
        "adam0": lambda: hpf.optim.adamw(1e-3, weight_decay=0.0), "adam": lambda: hpf.optim.adamw(1e-2, weight_decay=0.1)}


def leaves_of(state) -> set[str]:
    return {k for field in state[1:] for k in field}


def test_groups_follow_the_one_rule_whatever_the_order():
    """Each group claims the leaves the one rule gives it, and the dict in reverse order gives
    exactly the same updates."""
    params, grads = params_and_grads()
    for groups, claimed in GROUPS:
        ours, state = run(hpf.optim.partition({p: OPTS[o]() for p, o in groups.items()}), params, grads)
        rest = set(NAMES) - set().union(*claimed.values())
        for pattern, sub in state.states.items():
            assert leaves_of(sub) == claimed.get(pattern, rest), pattern
        reverse, _ = run(hpf.optim.partition({p: OPTS[o]() for p, o in reversed(groups.items())}), params, grads)
        for k in NAMES:
            torch.testing.assert_close(reverse[k], ours[k], rtol=0, atol=0)


def test_masks_follow_the_one_rule():
    """``mask=`` patterns and ``decay_mask(exclude=...)`` (whose default is the one-rule spelling)
    equal the explicit list of the FQNs that decay."""
    params, grads = params_and_grads()
    no_decay = {n for n in NAMES if "norm" in n or n.endswith("bias")}
    decays = [n for n in NAMES if n not in no_decay]
    ref, _ = run(hpf.optim.adamw(1e-2, weight_decay=0.1, mask=decays), params, grads)
    for mask in (hpf.optim.decay_mask(), hpf.optim.decay_mask(["**.*bias", "**.*norm*.**"])):
        ours, _ = run(hpf.optim.adamw(1e-2, weight_decay=0.1, mask=mask), params, grads)
        for k in NAMES:
            torch.testing.assert_close(ours[k], ref[k], rtol=0, atol=0)
    layers = [n for n in NAMES if n.startswith("model.layers.") and n.endswith(".weight")]
    sgd_ref, _ = run(hpf.optim.sgd(1e-1, weight_decay=0.1, mask=layers), params, grads)
    sgd_ours, _ = run(hpf.optim.sgd(1e-1, weight_decay=0.1, mask=["model.layers.**.weight"]), params, grads)
    for k in NAMES:
        torch.testing.assert_close(sgd_ours[k], sgd_ref[k], rtol=0, atol=0)
    as_mask = mask_fn("model.layers.**.weight", "sgd")  # one pattern, a list of them, or a predicate
    assert isinstance(as_mask, PatternMask) and [n for n in NAMES if as_mask(n)] == layers
    assert mask_fn(None, "sgd")("bias") and not mask_fn(lambda fqn: fqn == "x", "sgd")("bias")
    one_segment, _ = run(hpf.optim.sgd(1e-1, weight_decay=0.1, mask=["model.layers.*.weight"]), params, grads)
    plain, _ = run(hpf.optim.sgd(1e-1, weight_decay=0.1, mask=[]), params, grads)
    for k in NAMES:  # `*` is one segment: no layer weight is three segments below model.layers
        torch.testing.assert_close(one_segment[k], plain[k], rtol=0, atol=0)


def test_the_most_specific_pattern_claims_a_leaf_and_ties_are_errors():
    """The most specific pattern wins whatever the order; two equally specific ones matching a
    leaf, and a leaf no pattern claims, are PlanErrors naming them."""
    params, grads = params_and_grads(1)
    opt = hpf.optim.partition({"**": hpf.optim.adamw(), "**.*bias": hpf.optim.sgd(momentum=0.9)})
    state = opt.init(params)
    biases = {"model.layers.0.self_attn.q_proj.bias", "bias"}
    assert leaves_of(state.states["**.*bias"]) == biases and set(state.states["**"].mu) == set(NAMES) - biases
    opt.update(grads[0], state, params)
    tie = hpf.optim.partition({"model.*.0.mlp.down_proj.weight": hpf.optim.sgd(),
                               "model.layers.*.mlp.down_proj.weight": hpf.optim.sgd(), "**": hpf.optim.sgd()})
    with pytest.raises(PlanError, match=r"'model\.layers\.0\.mlp\.down_proj\.weight' is matched by the equally "
                                        r"specific patterns 'model\.\*\.0\.mlp\.down_proj\.weight' and"):
        tie.init(params)
    with pytest.raises(PlanError, match=r"'lm_head\.weight' matches none of the patterns.*catch-all '\*\*'"):
        hpf.optim.partition({"model.**": hpf.optim.sgd()}).init(params)
