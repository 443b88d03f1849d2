"""hpf.optim: the functional AdamW / SGD equal torch.optim step for step (masks as param groups,
schedules as per-step lr, partition as two optimizers), never touch their inputs, differentiate
through an update under torch.func.grad (checked against the same step written by hand in plain
autograd and against finite differences), and describe where their state sits.  One process."""

from __future__ import annotations

import io
import math

import optree
import pytest
import torch
from torch.distributed.tensor import Replicate

import hp_functional as hpf
from hp_functional import PlanError, ShapeError
from hp_functional.train.optim import AdamWState, PartitionState, SGDState

STEPS = 20
SHAPES = {"embed.weight": (10, 4), "layer.0.proj.weight": (4, 6), "layer.0.proj.bias": (6,), "layer.0.norm.weight": (6,),
          "head.scale": ()}
H, F, V = 8, 12, 16  # the names and shapes of a 2-layer Llama (plus a bias, which Llama has not)
LLAMA_SHAPES = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H),
                **{f"model.layers.{i}.{name}": shape for i in range(2) for name, shape in {
                    "self_attn.q_proj.weight": (H, H), "self_attn.k_proj.weight": (H // 2, H),
                    "self_attn.v_proj.weight": (H // 2, H), "self_attn.o_proj.weight": (H, H),
                    "self_attn.o_proj.bias": (H,), "mlp.gate_proj.weight": (F, H), "mlp.up_proj.weight": (F, H),
                    "mlp.down_proj.weight": (H, F), "input_layernorm.weight": (H,),
                    "post_attention_layernorm.weight": (H,)}.items()}}


def make_params(shapes=SHAPES, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g, dtype=dtype) for k, s in shapes.items()}


def make_grads(params, steps=STEPS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(p.shape, generator=g, dtype=p.dtype) for k, p in params.items()} for _ in range(steps)]


def run_torch(params, grads_seq, groups, cls, set_lr=None, **kw):
    """``cls`` over copies of ``params``: ``groups`` is [(keys, options)]; ``set_lr(step)`` sets every
    group's lr before step ``step``.  Returns the params after each step and the optimizer."""
    ref = {k: p.clone().requires_grad_() for k, p in params.items()}
    opt = cls([{"params": [ref[k] for k in keys], **o} for keys, o in groups], **kw)
    history = []
    for step, grads in enumerate(grads_seq):
        if set_lr is not None:
            for group in opt.param_groups:
                group["lr"] = set_lr(step)
        for k, p in ref.items():
            p.grad = None if grads[k] is None else grads[k].clone()
        opt.step()
        history.append({k: p.detach().clone() for k, p in ref.items()})
    return history, opt, ref


def run_ours(opt, params, grads_seq):
    state = opt.init(params)
    history = []
    for grads in grads_seq:
        params, state = opt.update(grads, state, params)
        history.append(params)
    return history, state


def assert_same(ours, theirs, what, atol=1e-6):
    assert list(ours) == list(theirs), what
    for k in theirs:
        torch.testing.assert_close(ours[k], theirs[k], atol=atol, rtol=1e-6, msg=lambda m: f"{what}: {k}: {m}")


def assert_histories(ours, theirs, what, atol=1e-6):
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert_same(a, b, f"{what} at step {step}", atol)


# ---------------------------------------------------------------- equality with torch.optim
@pytest.mark.parametrize("kw", [{}, {"weight_decay": 0.1, "betas": (0.8, 0.99), "eps": 1e-6}, {"maximize": True}],
                         ids=["defaults", "decay+betas", "maximize"])
def test_adamw_equals_torch(kw):
    params = make_params()
    grads = make_grads(params)
    ours, state = run_ours(hpf.optim.adamw(1e-2, **kw), params, grads)
    theirs, opt, ref = run_torch(params, grads, [(list(params), {})], torch.optim.AdamW, lr=1e-2, **kw)
    assert_histories(ours, theirs, "adamw")
    assert int(state.step) == STEPS and state.step.dtype == torch.int64
    assert_same(state.mu, {k: opt.state[ref[k]]["exp_avg"] for k in ref}, "exp_avg")
    assert_same(state.nu, {k: opt.state[ref[k]]["exp_avg_sq"] for k in ref}, "exp_avg_sq")


def test_adamw_mask_equals_param_groups_on_llama_names():
    """decay_mask() on a tiny Llama's parameter names (written out: building the HF model costs
    seconds): the same as a decay and a no-decay param group; a list of patterns and a callable
    say the same."""
    params = make_params(LLAMA_SHAPES)
    no_decay = [k for k in params if "norm" in k or k.endswith("bias")]
    assert no_decay and len(no_decay) < len(params)
    grads = make_grads(params, steps=5)
    decay = [k for k in params if k not in no_decay]
    theirs, _, _ = run_torch(params, grads, [(decay, {}), (no_decay, {"weight_decay": 0.0})], torch.optim.AdamW,
                             lr=1e-2, weight_decay=0.1)
    for mask in (hpf.optim.decay_mask(), decay, lambda fqn: fqn in decay):
        ours, _ = run_ours(hpf.optim.adamw(1e-2, weight_decay=0.1, mask=mask), params, grads)
        assert_histories(ours, theirs, f"adamw mask {mask!r}")
    ours, _ = run_ours(hpf.optim.adamw(1e-2, weight_decay=0.1), params, grads)  # no mask: everything decays
    with pytest.raises(AssertionError):
        assert_same(ours[-1], theirs[-1], "unmasked")


@pytest.mark.parametrize("kw", [{}, {"momentum": 0.9}, {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-2},
                                {"momentum": 0.9, "dampening": 0.3, "weight_decay": 1e-2}, {"momentum": 0.5, "maximize": True}],
                         ids=["plain", "momentum", "nesterov+decay", "dampening+decay", "maximize"])
def test_sgd_equals_torch(kw):
    params = make_params()
    grads = make_grads(params)
    ours, state = run_ours(hpf.optim.sgd(1e-1, **kw), params, grads)
    theirs, opt, ref = run_torch(params, grads, [(list(params), {})], torch.optim.SGD, lr=1e-1, **kw)
    assert_histories(ours, theirs, "sgd")
    if kw.get("momentum"):
        assert_same(state.momentum, {k: opt.state[ref[k]]["momentum_buffer"] for k in ref}, "momentum_buffer")
    else:
        assert state.momentum == {}


def test_sgd_mask_equals_param_groups_on_llama_names():
    """sgd's weight-decay mask against torch.optim.SGD with a decay and a no-decay param group
    (momentum, Nesterov): decay_mask(), a list of names and a callable say the same, and the
    unmasked sgd differs (every leaf decays)."""
    params = make_params(LLAMA_SHAPES)
    no_decay = [k for k in params if "norm" in k or k.endswith("bias")]
    decay = [k for k in params if k not in no_decay]
    grads = make_grads(params, steps=5)
    kw = {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1}
    theirs, _, _ = run_torch(params, grads, [(decay, {}), (no_decay, {"weight_decay": 0.0})], torch.optim.SGD,
                             lr=1e-1, **kw)
    for mask in (hpf.optim.decay_mask(), decay, lambda fqn: fqn in decay):
        ours, _ = run_ours(hpf.optim.sgd(1e-1, mask=mask, **kw), params, grads)
        assert_histories(ours, theirs, f"sgd mask {mask!r}")
    ours, _ = run_ours(hpf.optim.sgd(1e-1, **kw), params, grads)
    with pytest.raises(AssertionError):
        assert_same(ours[-1], theirs[-1], "unmasked")


def test_schedules_equal_torch():
    """A schedule is evaluated at the index of the update being taken (0 first): the same as setting
    the group's lr before each torch step, and as LambdaLR before each scheduler.step()."""
    params = make_params()
    grads = make_grads(params)
    sched = hpf.optim.warmup_cosine(1e-2, warmup_steps=5, total_steps=STEPS, end_lr=1e-4, init_lr=1e-3)
    ours, _ = run_ours(hpf.optim.adamw(sched, weight_decay=0.1), params, grads)
    theirs, _, _ = run_torch(params, grads, [(list(params), {})], torch.optim.AdamW, set_lr=sched, lr=1.0,
                             weight_decay=0.1)
    assert_histories(ours, theirs, "adamw with warmup_cosine")

    # Hugging Face's get_cosine_schedule_with_warmup as a LambdaLR, on SGD with momentum
    warm, total, peak = 4, STEPS, 0.1

    def hf_lambda(k):
        if k < warm:
            return k / warm
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * (k - warm) / (total - warm))))

    ref = {k: p.clone().requires_grad_() for k, p in params.items()}
    opt = torch.optim.SGD(ref.values(), lr=peak, momentum=0.9)
    lambda_lr = torch.optim.lr_scheduler.LambdaLR(opt, hf_lambda)
    ours, _ = run_ours(hpf.optim.sgd(hpf.optim.warmup_cosine(peak, warm, total), momentum=0.9), params, grads)
    for step, g in enumerate(grads):
        for k, p in ref.items():
            p.grad = g[k].clone()
        opt.step()
        lambda_lr.step()
        assert_same(ours[step], {k: p.detach() for k, p in ref.items()}, f"sgd with LambdaLR at step {step}", atol=1e-6)


def test_schedule_values():
    cos = hpf.optim.warmup_cosine(1.0, 10, 110, end_lr=0.1)
    assert [cos(k) for k in (0, 5, 10, 60, 110, 500)] == pytest.approx([0.0, 0.5, 1.0, 0.55, 0.1, 0.1])
    warm = hpf.optim.linear_warmup(2.0, 4, init_lr=1.0)
    assert [warm(k) for k in (0, 2, 4, 9)] == pytest.approx([1.0, 1.5, 2.0, 2.0])
    assert hpf.optim.constant(3e-4)(7) == 3e-4 and hpf.optim.linear_warmup(1.0, 0)(0) == 1.0
    for sched in (cos, warm):  # a 0-dim tensor step gives the same value, as a tensor
        for k in (0, 3, 10, 57, 200):
            value = sched(torch.tensor(k))
            assert isinstance(value, torch.Tensor) and value.item() == pytest.approx(sched(k), abs=1e-12)


# ---------------------------------------------------------------- purity, frozen leaves, the state pytree
def test_update_is_pure():
    params = make_params()
    grads = make_grads(params, steps=2)
    for opt in (hpf.optim.adamw(1e-2, weight_decay=0.1), hpf.optim.sgd(1e-1, momentum=0.9, weight_decay=0.1),
                hpf.optim.partition({"**.*bias": hpf.optim.sgd(1e-1, momentum=0.9), "**": hpf.optim.adamw(1e-2)})):
        state = opt.init(params)
        _, state = opt.update(grads[0], state, params)
        before = [t.clone() for t in optree.tree_leaves((params, grads[1], state))]
        new_params, new_state = opt.update(grads[1], state, params)
        after = optree.tree_leaves((params, grads[1], state))
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), "an input was written to"
        inputs = {t.data_ptr() for t in after if t.numel()}
        outputs = [t for t in optree.tree_leaves((new_params, new_state)) if t.numel()]
        assert not any(t.data_ptr() in inputs for t in outputs), "an output aliases an input"


def test_none_grads_leave_param_and_state_untouched():
    """A leaf whose gradient is always None: unchanged, its moments still zero, the rest as torch
    (which skips it); None on a single step: that step leaves it and its moments as they were."""
    params = make_params()
    grads = make_grads(params)
    frozen = [{**g, "embed.weight": None} for g in grads]
    ours, state = run_ours(hpf.optim.adamw(1e-2, weight_decay=0.1), params, frozen)
    theirs, _, _ = run_torch(params, frozen, [(list(params), {})], torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    assert_histories(ours, theirs, "adamw with a frozen leaf")
    assert ours[-1]["embed.weight"] is params["embed.weight"]
    assert not state.mu["embed.weight"].any() and not state.nu["embed.weight"].any()

    for opt in (hpf.optim.adamw(1e-2), hpf.optim.sgd(1e-1, momentum=0.9)):
        state = opt.init(params)
        p1, state = opt.update(grads[0], state, params)
        p2, state2 = opt.update({**grads[1], "layer.0.proj.bias": None}, state, p1)
        assert p2["layer.0.proj.bias"] is p1["layer.0.proj.bias"]
        for leaf in state._fields[1:]:
            assert getattr(state2, leaf)["layer.0.proj.bias"] is getattr(state, leaf)["layer.0.proj.bias"]
        assert not torch.equal(p2["layer.0.proj.weight"], p1["layer.0.proj.weight"])


def test_state_is_a_pytree_that_saves_and_resumes():
    params = make_params()
    grads = make_grads(params, steps=4)
    opt = hpf.optim.partition({"**.*norm*.**": hpf.optim.sgd(1e-1, momentum=0.9), "**": hpf.optim.adamw(1e-2)})
    state = opt.init(params)
    for g in grads[:2]:
        params, state = opt.update(g, state, params)
    leaves, spec = optree.tree_flatten(state)
    assert all(isinstance(t, torch.Tensor) for t in leaves)
    assert optree.tree_unflatten(spec, leaves) == state
    torch_leaves, _ = torch.utils._pytree.tree_flatten(state)
    assert len(torch_leaves) == len(leaves)
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert isinstance(loaded, PartitionState) and isinstance(loaded.states["**"], AdamWState)
    assert isinstance(loaded.states["**.*norm*.**"], SGDState)
    a, b = params, params
    for g in grads[2:]:
        a, state = opt.update(g, state, a)
        b, loaded = opt.update(g, loaded, b)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_state_info():
    """Moments share their parameter's ShardInfo; the step is replicated on the params' mesh."""
    from tests.support.models import MLP, PLANS

    def case(mesh):
        _, params, info = hpf.shard(MLP(), PLANS["tp"], mesh)
        opt = hpf.optim.partition({"**.*bias": hpf.optim.sgd(1e-1, momentum=0.9), "**": hpf.optim.adamw(1e-2)})
        state = opt.init(params)
        where = hpf.optim.state_info(state, info)
        bad = hpf.optim.adamw().init({**params, "up.weight": params["up.weight"][:1]})
        with pytest.raises(ShapeError, match="up.weight"):
            hpf.optim.state_info(bad, info)
        with pytest.raises(PlanError, match="down.bias"):
            hpf.optim.state_info(state, {k: v for k, v in info.items() if k != "down.bias"})
        return params, info, state, where

    params, info, state, where = hpf.simulate(case, world_size=2)
    assert optree.tree_structure(where) == optree.tree_structure(state)
    adam, adam_info = state.states["**"], where.states["**"]
    assert set(adam.mu) == {k for k in params if not k.endswith("bias")}
    for k in adam.mu:
        assert adam_info.mu[k] is info[k] and adam_info.nu[k] is info[k]
    assert info["up.weight"].is_sharded  # Colwise: a moment is sharded like its weight
    for k in state.states["**.*bias"].momentum:
        assert where.states["**.*bias"].momentum[k] is info[k]
    for step_info in (adam_info.step, where.states["**.*bias"].step):
        assert step_info.placements == (Replicate(),) and step_info.global_shape == torch.Size([]) == step_info.local_shape
        assert step_info.mesh is info["up.weight"].mesh


# ---------------------------------------------------------------- differentiating through an update
X, Y = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2)), \
    torch.randn(8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))


def small_params():
    g = torch.Generator().manual_seed(4)
    return {"w": torch.randn(4, 3, generator=g, dtype=torch.float64), "b": torch.randn(3, generator=g, dtype=torch.float64)}


def inner_loss(p):
    return ((torch.tanh(X @ p["w"] + p["b"]) - Y) ** 2).mean()


def outer_loss(p):
    return ((torch.tanh(X.flip(0) @ p["w"] + p["b"]) - Y) ** 3).mean()


B1, B2, EPS, WD = 0.9, 0.99, 1e-3, 0.1  # a large eps keeps the Adam step far from sign(g)


def adamw_by_hand(p, g, mu, nu, lr, t, decays):
    """One AdamW step in plain torch (differentiable in every argument)."""
    out = {}
    for k in p:
        q = p[k] * (1 - lr * WD) if decays(k) else p[k]
        m, v = B1 * mu[k] + (1 - B1) * g[k], B2 * nu[k] + (1 - B2) * g[k] ** 2
        out[k] = q - lr / (1 - B1**t) * m / (v.sqrt() / math.sqrt(1 - B2**t) + EPS)
    return out


def test_meta_gradient_through_adamw():
    """d outer(update(p, grad inner(p), lr)) / d lr and / d p under torch.func.grad, from a state
    one step in: equal to the step written by hand and differentiated by plain autograd, and (lr)
    to a central finite difference."""
    params = small_params()
    warm = hpf.optim.adamw(1e-2, betas=(B1, B2), eps=EPS, weight_decay=WD, mask=["w"])
    _, state = warm.update(torch.func.grad(inner_loss)(params), warm.init(params), params)

    def meta(lr, p):
        opt = hpf.optim.adamw(lr, betas=(B1, B2), eps=EPS, weight_decay=WD, mask=["w"])
        new, _ = opt.update(torch.func.grad(inner_loss)(p), state, p)
        return outer_loss(new)

    lr = torch.tensor(0.05, dtype=torch.float64)
    d_lr, d_p = torch.func.grad(meta, argnums=(0, 1))(lr, params)

    lr_ref, p_ref = lr.clone().requires_grad_(), {k: v.clone().requires_grad_() for k, v in params.items()}
    g = dict(zip(p_ref, torch.autograd.grad(inner_loss(p_ref), list(p_ref.values()), create_graph=True), strict=True))
    outer_loss(adamw_by_hand(p_ref, g, state.mu, state.nu, lr_ref, 2, lambda k: k == "w")).backward()
    torch.testing.assert_close(d_lr, lr_ref.grad, atol=1e-12, rtol=1e-10)
    for k in params:
        torch.testing.assert_close(d_p[k], p_ref[k].grad, atol=1e-12, rtol=1e-10)
    assert d_lr.abs() > 1e-3 and all(v.abs().sum() > 1e-3 for v in d_p.values())

    h = 1e-6
    fd = (meta(lr + h, params) - meta(lr - h, params)) / (2 * h)
    torch.testing.assert_close(d_lr, fd, atol=1e-8, rtol=1e-6)


def test_meta_gradient_through_sgd():
    """Two SGD-momentum updates unrolled: d outer / d p0 equals plain autograd on the same unroll."""
    params = small_params()

    def unrolled(p):
        opt = hpf.optim.sgd(0.3, momentum=0.9, nesterov=True, weight_decay=WD)
        state = opt.init(p)
        for _ in range(2):
            p, state = opt.update(torch.func.grad(inner_loss)(p), state, p)
        return outer_loss(p)

    ours = torch.func.grad(unrolled)(params)
    p0 = {k: v.clone().requires_grad_() for k, v in params.items()}
    p, buf = dict(p0), None
    for _ in range(2):
        g = dict(zip(p, torch.autograd.grad(inner_loss(p), list(p.values()), create_graph=True), strict=True))
        g = {k: g[k] + WD * p[k] for k in p}
        buf = dict(g) if buf is None else {k: 0.9 * buf[k] + g[k] for k in p}
        p = {k: p[k] - 0.3 * (g[k] + 0.9 * buf[k]) for k in p}
    outer_loss(p).backward()
    for k in params:
        torch.testing.assert_close(ours[k], p0[k].grad, atol=1e-12, rtol=1e-10)


# ---------------------------------------------------------------- partition and bad input
def test_partition_equals_two_torch_optimizers():
    params = make_params()
    grads = make_grads(params)
    opt = hpf.optim.partition({"**.bias": hpf.optim.sgd(1e-1, momentum=0.9),
                               "**.*norm*.**": hpf.optim.adamw(1e-3, weight_decay=0.0),
                               "**": hpf.optim.adamw(1e-2, weight_decay=0.1)})
    ours, state = run_ours(opt, params, grads)
    assert list(ours[-1]) == list(params)
    assert set(state.states["**.bias"].momentum) == {"layer.0.proj.bias"}
    assert set(state.states["**.*norm*.**"].mu) == {"layer.0.norm.weight"}
    rest = [k for k in params if k not in ("layer.0.proj.bias", "layer.0.norm.weight")]
    sgd_hist, _, _ = run_torch(params, grads, [(["layer.0.proj.bias"], {})], torch.optim.SGD, lr=1e-1, momentum=0.9)
    adam_hist, _, _ = run_torch(params, grads, [(["layer.0.norm.weight"], {"lr": 1e-3, "weight_decay": 0.0}),
                                                (rest, {})], torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        expected = {k: (sgd_hist if k == "layer.0.proj.bias" else adam_hist)[step][k] for k in params}
        assert_same(ours[step], expected, f"partition at step {step}")


def test_partition_errors():
    params = make_params()
    opt = hpf.optim.partition({"**.weight": hpf.optim.adamw(), "head.*": hpf.optim.sgd()})
    with pytest.raises(PlanError, match=r"'layer\.0\.proj\.bias' matches none of the patterns"):
        opt.init(params)
    ok = hpf.optim.partition({"**": hpf.optim.adamw()})
    other = hpf.optim.partition({"**.weight": hpf.optim.adamw(), "**": hpf.optim.adamw()})
    with pytest.raises(PlanError, match="not the patterns"):
        other.update(make_grads(params, 1)[0], ok.init(params), params)
    with pytest.raises(TypeError):
        hpf.optim.partition({"**": torch.optim.AdamW})


def test_bad_input():
    params = make_params()
    grads = make_grads(params, 1)[0]
    opt = hpf.optim.adamw()
    state = opt.init(params)
    with pytest.raises(PlanError, match=r"missing from grads \['head.scale'\]"):
        opt.update({k: v for k, v in grads.items() if k != "head.scale"}, state, params)
    with pytest.raises(PlanError, match=r"not in params \['extra'\]"):
        opt.update({**grads, "extra": torch.zeros(1)}, state, params)
    with pytest.raises(PlanError, match=r"missing from state.mu \['embed.weight'\]"):
        opt.update(grads, state._replace(mu={k: v for k, v in state.mu.items() if k != "embed.weight"}), params)
    with pytest.raises(ShapeError, match=r"grads\['layer.0.proj.weight'\] has shape \(6, 4\) but params"):
        opt.update({**grads, "layer.0.proj.weight": torch.zeros(6, 4)}, state, params)
    with pytest.raises(ShapeError, match=r"state.nu\['head.scale'\]"):
        opt.update(grads, state._replace(nu={**state.nu, "head.scale": torch.zeros(1)}), params)
    with pytest.raises(TypeError, match="SGDState"):
        opt.update(grads, hpf.optim.sgd().init(params), params)
    for bad in (lambda: hpf.optim.adamw(-1e-3), lambda: hpf.optim.adamw(1e-3, betas=(1.0, 0.9)),
                lambda: hpf.optim.adamw(eps=-1.0), lambda: hpf.optim.adamw(weight_decay=-0.1),
                lambda: hpf.optim.sgd(-0.1), lambda: hpf.optim.sgd(0.1, momentum=-0.5),
                lambda: hpf.optim.sgd(0.1, nesterov=True), lambda: hpf.optim.sgd(0.1, 0.9, nesterov=True, dampening=0.1),
                lambda: hpf.optim.warmup_cosine(1.0, 10, 10), lambda: hpf.optim.linear_warmup(1.0, -1),
                lambda: hpf.optim.constant(-1.0)):
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(ValueError, match="at step 0"):  # a schedule that goes negative, caught where it does
        hpf.optim.sgd(lambda step: -1.0).update(grads, hpf.optim.sgd().init(params), params)
    with pytest.raises(TypeError, match="mask"):
        hpf.optim.adamw(mask=[1, 2])
