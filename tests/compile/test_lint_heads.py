"""Lint ``head-attr``: a Colwise output reshaped with a head count the skeleton leaves global is
found by tracing on meta tensors — naming the module and the attribute — instead of torch's raw
shape error at the first call (or, with a ``-1``, every head silently cut in two)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hp_functional as hpf
from tests.support.helpers import assert_close, build_hf, mesh


class Attn(nn.Module):
    """Non-HF attention: ``self.n_heads`` in its views (``minus``: ``view(b, s, n_heads, -1)``)."""

    def __init__(self, minus: bool = False):
        super().__init__()
        self.n_heads, self.head_dim, self.minus = 4, 8, minus
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(32, 32) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        shape = (b, s, self.n_heads, -1) if self.minus else (b, s, self.n_heads, self.head_dim)
        q, k, v = (f(x).view(shape).transpose(1, 2) for f in (self.wq, self.wk, self.wv))
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))


class Net(nn.Module):
    def __init__(self, minus: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"attn": Attn(minus)}) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer["attn"](x)
        return x


def _plan(heads: bool) -> dict:
    A = "layers.*.attn"
    return {**({A: hpf.Heads(attrs=("n_heads",))} if heads else {}),
            **{f"{A}.w{n}": hpf.Colwise() for n in "qkv"}, f"{A}.wo": hpf.Rowwise()}


def case_head_attr(minus: bool):
    torch.manual_seed(0)
    model = Net(minus)
    found = [f for f in hpf.lint(model, _plan(False), mesh()) if f.code == "head-attr"]
    assert [f.where for f in found] == ["layers.0.attn", "layers.1.attn"], found
    with pytest.raises(hpf.PlanError) as exc:
        hpf.shard(model, _plan(False), mesh())  # before any collective: the same error on every rank
    assert not [f for f in hpf.lint(model, _plan(True), mesh()) if f.level == "error"]
    apply_fn, params, info = hpf.shard(model, _plan(True), mesh())  # with the fix: matches the model
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    ref = model(x)
    ref.square().mean().backward()
    apply_fn(params, x).square().mean().backward()
    full = hpf.unshard({k: p.grad for k, p in params.items()}, info)
    for k, p in model.named_parameters():
        assert_close(full[k], p.grad, f"grad {k}")
    return str(found[0]), str(exc.value)


@pytest.mark.parametrize("minus", [False, True], ids=["raw-shape-error", "silent-cut"])
def test_undivided_head_count_is_a_lint_error(pool, minus):
    out = pool.run(case_head_attr, minus)
    assert all(o == out[0] for o in out)
    finding, raised = out[0]
    how = "each head's 8 features would be cut to" if minus else "torch would raise: shape"
    assert "layers.0.attn" in finding
    assert "layers.*.attn" in raised and "(2 modules)" in raised  # shard() merges what differs by layer only
    for text in (finding, raised):
        assert "attribute n_heads=4" in text and how in text and "Heads(attrs=('n_heads',))" in text, text
    print(finding)


def case_hf():
    model = build_hf("llama")
    return [str(f) for f in hpf.lint(model, hpf.ShardingPlan.from_hf(model), mesh()) if f.code == "head-attr"]


def test_hf_attention_needs_nothing(pool):
    assert pool.run(case_hf) == [[]] * pool.world
