"""A small TP MLP: Colwise/Rowwise (+ sequence parallel), 1-D and 2-D meshes, grad and vmap."""

import pytest
import torch
from torch.func import grad, grad_and_value, vmap

import hp_functional as hpf
from tests.support.helpers import assert_close, mesh
from tests.support.models import MLP, PLANS, make_mlp_state


def case_mlp(state, plan_name: str, mesh_shape):
    names = ("tp",) if len(mesh_shape) == 1 else ("dp", "tp")
    m = mesh(tuple(mesh_shape), names)
    model = MLP()
    model.load_state_dict(state)
    torch.manual_seed(1)
    x = torch.randn(2, 8, 16)
    w = torch.randn(2, 8, 16)
    apply_fn, params, info = hpf.shard(model, hpf.ShardingPlan(PLANS[plan_name]), m)

    ref_out = model(x)
    (ref_out * w).sum().backward()
    ref_grads = {k: p.grad.clone() for k, p in model.named_parameters()}

    tp = m["tp"]
    r, n = tp.get_local_rank(), tp.size()
    seq = plan_name == "sp"
    x_in = x.chunk(n, 1)[r] if seq else x
    w_local = w.chunk(n, 1)[r] if seq else w
    expect = ref_out.chunk(n, 1)[r] if seq else ref_out

    out = apply_fn(params, x_in)
    assert_close(out, expect.detach(), "output")
    # sequence-sharded outputs: the loss is the sum of the per-rank pieces
    (out * w_local).sum().backward()
    grads_bw = {k: p.grad for k, p in params.items()}
    grads_fn, _ = grad_and_value(lambda p: (apply_fn(p, x_in) * w_local).sum())(params)
    for label, grads in (("backward", grads_bw), ("grad_and_value", grads_fn)):
        full = hpf.unshard(grads, info)
        for k in ref_grads:
            assert_close(full[k], ref_grads[k], f"{label} grad {k}")
    return sorted(k for k, i in info.items() if i.is_sharded)


@pytest.mark.parametrize("plan_name", ["tp", "sp", "gather", "split_input"])
def test_mlp_matches_unsharded(pool, plan_name):
    sharded = pool.run(case_mlp, make_mlp_state(), plan_name, (pool.world,))
    expected = {"tp": ["down.weight", "up.bias", "up.weight"], "sp": ["down.weight", "up.bias", "up.weight"],
                "gather": ["up.bias", "up.weight"], "split_input": ["down.weight"]}[plan_name]
    assert sharded[0] == expected


def test_mlp_on_2d_mesh(pool):
    # world 2 -> (dp=1, tp=2): a size-1 axis; world 4 -> (dp=2, tp=2)
    pool.run(case_mlp, make_mlp_state(), "sp", (pool.world // 2, 2))


def case_per_sample_grads(state):
    model = MLP()
    model.load_state_dict(state)
    apply_fn, params, info = hpf.shard(model, PLANS["tp"], mesh())
    torch.manual_seed(2)
    xs, ys = torch.randn(5, 3, 16), torch.randn(5, 3, 16)

    def loss(p, x, y, fn):
        return ((fn(p, x) - y) ** 2).mean()

    per = vmap(grad(loss), in_dims=(None, 0, 0, None))(params, xs, ys, apply_fn)
    ref_params = {k: v.detach() for k, v in model.named_parameters()}
    ref_fn = lambda p, x: torch.func.functional_call(model, p, (x,))  # noqa: E731
    ref = vmap(grad(loss), in_dims=(None, 0, 0, None))(ref_params, xs, ys, ref_fn)
    for k, g in per.items():
        i = info[k]
        local_ref = ref[k]
        for d, (start, size) in enumerate(zip(i.offset, i.local_shape, strict=True)):
            local_ref = local_ref.narrow(d + 1, start, size)  # +1: the per-sample dim
        assert_close(g, local_ref, f"per-sample grad {k}")
    return True


def test_vmap_per_sample_grads_through_tp_mlp(pool):
    pool.run(case_per_sample_grads, make_mlp_state())
