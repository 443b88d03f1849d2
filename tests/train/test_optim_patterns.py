"""Optimizer masks and groups under the package's one pattern rule (``core.paths``): a pattern in
the earlier spelling (``fnmatch``: ``*`` crossing dots, the first match wins) keeps its result where
the rules differ, with a FutureWarning naming the pattern and its spelling under the one rule; the
new spelling gives the same updates without a warning."""

import warnings

import pytest
import torch

import hp_functional as hpf
from hp_functional.core.errors import PlanError
from hp_functional.train.optim_masks import _new_spelling

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


def quiet(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn(*args)


# (earlier spelling, one-rule spelling): the same groups on NAMES
GROUPS = [
    ({"*bias": "sgd", "*norm*": "adam0", "*": "adam"}, {"**.*bias": "sgd", "**.*norm*.**": "adam0", "**": "adam"}),
    ({"model.layers.*.weight": "sgd", "*": "adam"}, {"model.layers.**.weight": "sgd", "**": "adam"}),
    ({"*embed_tokens*": "sgd", "lm_head.weight": "sgd2", "*": "adam"},
     {"**.*embed_tokens*.**": "sgd", "lm_head.weight": "sgd2", "**": "adam"}),
]
OPTS = {"sgd": lambda: hpf.optim.sgd(1e-1, momentum=0.9), "sgd2": lambda: hpf.optim.sgd(1e-2),
        "adam0": lambda: hpf.optim.adamw(1e-3, weight_decay=0.0), "adam": lambda: hpf.optim.adamw(1e-2, weight_decay=0.1)}


def test_groups_under_both_spellings():
    """Each earlier-spelling group dict warns once per differing pattern (naming it and the
    spelling to use) and gives exactly the updates of the one-rule spelling, which is silent; the
    suggested spelling is the one written here."""
    params, grads = params_and_grads()
    for old, new in GROUPS:
        with pytest.warns(FutureWarning) as record:
            ours_old, state_old = run(hpf.optim.partition({p: OPTS[o]() for p, o in old.items()}), params, grads)
        messages = [str(w.message) for w in record if issubclass(w.category, FutureWarning)]
        for o, n in zip(old, new, strict=True):
            if o != n:
                assert any(f"pattern {o!r}" in m and f"write {n!r}" in m for m in messages), (o, messages)
                assert _new_spelling(o) == n
        assert len(messages) == len(set(messages)) and len(messages) <= len(old), messages
        ours_new, state_new = quiet(run, hpf.optim.partition({p: OPTS[o]() for p, o in new.items()}), params, grads)
        for (po, so), (pn, sn) in zip(state_old.states.items(), state_new.states.items(), strict=True):
            assert old[po] == new[pn] and optree_keys(so) == optree_keys(sn), (po, pn)
        for k in NAMES:
            torch.testing.assert_close(ours_old[k], ours_new[k], rtol=0, atol=0)


def optree_keys(state) -> set[str]:
    return {k for field in state[1:] for k in field}


def test_masks_under_both_spellings():
    """``mask=`` patterns and ``decay_mask(exclude=...)``: the earlier spelling warns and keeps its
    result; the one-rule spelling (and ``decay_mask()``'s default, which is it) is silent and equal."""
    params, grads = params_and_grads()
    no_decay = {n for n in NAMES if "norm" in n or n.endswith("bias")}
    decays = [n for n in NAMES if n not in no_decay]
    ref, _ = quiet(run, hpf.optim.adamw(1e-2, weight_decay=0.1, mask=decays), params, grads)
    for mask in (hpf.optim.decay_mask(), hpf.optim.decay_mask(["**.*bias", "**.*norm*.**"])):
        ours, _ = quiet(run, hpf.optim.adamw(1e-2, weight_decay=0.1, mask=mask), params, grads)
        for k in NAMES:
            torch.testing.assert_close(ours[k], ref[k], rtol=0, atol=0)
    with pytest.warns(FutureWarning) as record:
        ours, _ = run(hpf.optim.adamw(1e-2, weight_decay=0.1, mask=hpf.optim.decay_mask(["*bias", "*norm*"])), params, grads)
    messages = sorted(str(w.message) for w in record)
    assert len(messages) == 2 and "'*bias'" in messages[0] and "write '**.*bias'" in messages[0], messages
    assert "'*norm*'" in messages[1] and "write '**.*norm*.**'" in messages[1], messages
    for k in NAMES:
        torch.testing.assert_close(ours[k], ref[k], rtol=0, atol=0)
    sgd_ref, _ = quiet(run, hpf.optim.sgd(1e-1, weight_decay=0.1, mask=["model.layers.**.weight"]), params, grads)
    with pytest.warns(FutureWarning, match=r"sgd mask: pattern 'model\.layers\.\*\.weight'.*'model\.layers\.\*\*\.weight'"):
        sgd_old, _ = run(hpf.optim.sgd(1e-1, weight_decay=0.1, mask=["model.layers.*.weight"]), params, grads)
    for k in NAMES:
        torch.testing.assert_close(sgd_old[k], sgd_ref[k], rtol=0, atol=0)


def test_order_no_longer_decides():
    """Where the earlier rule let the dict's order pick a group and the one rule picks the most
    specific pattern, the order still decides for now, with a warning naming both patterns; a tie
    under the one rule and a leaf no pattern claims are named too."""
    params, grads = params_and_grads(1)
    opt = hpf.optim.partition({"**": hpf.optim.adamw(), "**.*bias": hpf.optim.sgd()})
    with pytest.warns(FutureWarning, match=r"pattern '\*\*' claims 'model\.layers\.0\.self_attn\.q_proj\.bias' \(and 1 "
                      r"more\).*the more specific '\*\*\.\*bias' claims it"):
        state = opt.init(params)
    assert set(state.states["**"].mu) == set(NAMES) and not state.states["**.*bias"].momentum
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per optimizer
        opt.update(grads[0], state, params)
    tie = hpf.optim.partition({"model.*.0.mlp.down_proj.weight": hpf.optim.sgd(),
                               "model.layers.*.mlp.down_proj.weight": hpf.optim.sgd(), "**": hpf.optim.sgd()})
    with pytest.warns(FutureWarning, match="equally specific"):
        tie.init(params)
    with pytest.raises(PlanError, match=r"'lm_head\.weight' matches none of the patterns.*catch-all '\*\*'"):
        hpf.optim.partition({"model.**": hpf.optim.sgd()}).init(params)
