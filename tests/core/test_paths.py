"""The one path-pattern rule (``core.paths``): the matcher and the winner on their own, and that a
plan, recompute blocks, FSDP blocks and the optimizer resolve one pattern to the same modules."""


import pytest
import torch
from torch import nn

import hp_functional as hpf
from hp_functional.core.errors import PlanError
from hp_functional.core.paths import Candidate, most_specific, most_specific_patterns, path_matches, specificity
from hp_functional.runtime.remat import Remat, resolve_remat
from hp_functional.train.fsdp import _blocks


@pytest.mark.parametrize("pattern, path, hit", [
    ("model.layers.*.mlp", "model.layers.3.mlp", True),
    ("model.layers.*.mlp", "model.layers.3.attn", False),
    ("model.layers.*", "model.layers.3.mlp", False),  # `*` is exactly one segment
    ("*", "lm_head", True),
    ("*", "lm_head.weight", False),
    ("model.layers.*.*_proj", "model.layers.0.q_proj", True),  # fnmatch inside one segment
    ("model.layers.*.*_proj", "model.layers.0.attn.q_proj", False),  # ... never across a dot
    ("model.layers.?.mlp", "model.layers.7.mlp", True),
    ("model.layers.?.mlp", "model.layers.12.mlp", False),
    ("**.bias", "bias", True),  # `**`: any number of segments, none included
    ("**.bias", "model.layers.0.mlp.up.bias", True),
    ("**.bias", "model.layers.0.mlp.up.weight", False),
    ("**.*norm*.**", "model.norm.weight", True),
    ("**.*norm*.**", "model.layers.0.input_layernorm", True),
    ("**.*norm*.**", "model.layers.0.mlp.weight", False),
    ("model.**", "model", True),
    ("model.**.up", "model.layers.0.mlp.up", True),
    ("model.**.up", "head.up", False),
    ("a.**.b.**.c", "a.x.b.y.z.c", True),
    ("a.**.b.**.c", "a.x.y.c", False),
    ("a.**.**.c", "a.c", True),
    ("Model.norm", "model.norm", False),  # case-sensitive
    ("", "", True),  # the root: the empty pattern only
    ("**", "", False),
    ("*", "", False),
    ("", "model", False),
])
def test_path_matches(pattern, path, hit):
    assert path_matches(pattern, path) is hit


def test_the_most_specific_pattern_wins_whatever_the_order():
    """Names beat partial segments beat ``*`` beat ``**``; for names and ``*`` alone that is the
    fewest ``*``; equally specific patterns are all returned (a conflict for the caller)."""
    assert specificity("model.layers.*.mlp") == (3, 0, 0)
    assert specificity("**.*norm*.**") == (0, 1, -2)
    assert specificity("") == (0, 0, 0)
    fqn = "model.layers.0.mlp.up.bias"
    for patterns, best in [
        (["**", "**.bias"], ["**.bias"]),
        (["**.bias", "model.layers.*.mlp.*.bias"], ["model.layers.*.mlp.*.bias"]),
        (["model.layers.*.mlp.*.*", "model.layers.*.mlp.up.*"], ["model.layers.*.mlp.up.*"]),
        (["model.layers.*.mlp.*.*", "model.layers.*.mlp.*.*ias"], ["model.layers.*.mlp.*.*ias"]),
        (["*.layers.0.mlp.up.bias", "model.*.0.mlp.up.bias"], ["*.layers.0.mlp.up.bias", "model.*.0.mlp.up.bias"]),
        (["**.weight", "head.*"], []),
    ]:
        assert most_specific_patterns(fqn, patterns) == best
        assert most_specific_patterns(fqn, patterns[::-1]) == best[::-1]
    a, b = hpf.NoParallel(), hpf.Colwise()
    cands = [Candidate("**.mlp", a), Candidate("model.layers.*.mlp", b)]
    assert most_specific("model.layers.0.mlp", cands) == ("model.layers.*.mlp", b)
    with pytest.raises(PlanError, match="conflicting plan entries"):
        most_specific("model.layers.0.mlp", [Candidate("*.layers.0.mlp", a), Candidate("model.*.0.mlp", b)])


class Block(nn.Module):
    def __init__(self, d: int = 4):
        super().__init__()
        self.attn = nn.ModuleDict({"q_proj": nn.Linear(d, d), "o_proj": nn.Linear(d, d, bias=False)})
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.Linear(2 * d, d))
        self.norm = nn.LayerNorm(d)


class Net(nn.Module):
    def __init__(self, n: int = 3, d: int = 4):
        super().__init__()
        self.embed = nn.Embedding(8, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 8)


@pytest.mark.parametrize("pattern", ["layers.*", "layers.*.mlp", "**.mlp", "layers.*.attn.*_proj", "layers.1.*", "head"])
def test_plans_remat_fsdp_and_the_optimizer_resolve_a_pattern_alike(pattern):
    """The modules a plan entry plans, the blocks ``shard(remat=...)`` recomputes and ``hpf.fsdp``
    buckets, and (``pattern.**``) the parameters the optimizer's groups and masks claim: one set of
    modules, under the one rule."""
    model = Net()
    planned = set(hpf.ShardingPlan({pattern: hpf.NoParallel()}).candidates(model))
    assert planned, pattern
    remat = resolve_remat(model, Remat(blocks=(pattern,)))
    assert set(remat.blocks) == planned
    assert set(_blocks(model, [pattern])) == planned
    names = [n for n, _ in model.named_parameters()]
    inside = {n for n in names if any(n.startswith(m + ".") for m in planned)}
    params = {n: torch.zeros(()) for n in names}
    state = hpf.optim.partition({f"{pattern}.**": hpf.optim.adamw(), "**": hpf.optim.adamw()}).init(params)
    assert set(state.states[f"{pattern}.**"].mu) == inside
    decays = hpf.optim.decay_mask(exclude=[f"{pattern}.**"])
    assert {n for n in names if not decays(n)} == inside
