"""An attention module that reshapes with attribute head counts: the skeleton sees local counts."""

import pytest
import torch
from torch.distributed.tensor import Shard
from torch.func import grad_and_value

import hp_functional as hpf
from tests.support.helpers import assert_close, mesh
from tests.support.models import AttrAttention, attn_plan
from tests.support.snapshot import assert_unchanged, snapshot


def case_attr_heads(state, user_handler: bool):
    model = AttrAttention()
    model.load_state_dict(state)
    before = snapshot(model)
    handlers = None
    if user_handler:  # a user-registered handler, without touching the package's defaults
        handlers = {**hpf.default_handlers(), "mine": lambda p, fqn: hpf.ParamRule(Shard(0))}
        assert "mine" not in hpf.default_handlers()
    # the root module is addressed by the empty path
    apply_fn, params, info = hpf.shard(model, attn_plan(handlers), mesh())
    assert info["head_scale"].placements == (Shard(0),)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1))
    ref = model(x)
    ref.square().mean().backward()
    grads, loss = grad_and_value(lambda p: apply_fn(p, x).square().mean())(params)
    assert_close(apply_fn(params, x), ref.detach(), "output")
    assert_close(loss, ref.square().mean().detach(), "loss")
    full = hpf.unshard(grads, info)
    for k, p in model.named_parameters():
        assert_close(full[k], p.grad, f"grad {k}")
    model.zero_grad(set_to_none=True)
    assert_unchanged(before, snapshot(model))
    assert model.num_heads == 8 and model.num_key_value_heads == 4  # the user's module keeps global counts
    return True


@pytest.mark.parametrize("user_handler", [False, True])
def test_attribute_head_counts_and_per_head_params(pool, user_handler):
    torch.manual_seed(0)
    pool.run(case_attr_heads, AttrAttention().state_dict(), user_handler)
