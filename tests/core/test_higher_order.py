"""Higher-order derivatives through the collectives, on gloo ranks, against single-device math.

Every collective's backward is its transpose, itself a collective (``Collective.transpose``),
so the transpose of the transpose is the collective again and every order is exact:
``vjp(vjp(C)) == C``; grad∘grad, jacrev∘jacrev, jacfwd∘jacrev, jacrev∘jacfwd and ``hessian``
of sharded compositions equal the unsharded values; a gradient penalty on a sharded HF Llama and
one MAML step match the unsharded model.  Everything is fp64, so the tolerances are tight.
(Orders with a forward-mode step were exact before the pairs were closed: they only use the
backward ops' jvp, which is their forward, or the backward of a jvp, which is a first-order
backward.  Reverse-over-reverse is what the pairs fix.)

torch.compile does not take these orders (torch's limits, asserted in ``test_compile_limits`` so
a torch upgrade that lifts them shows): a ``create_graph=True`` backward of a compiled function
whose backward already ran without it raises (donated buffers), the double backward through a
compiled function raises, and ``torch.compile(torch.func.grad(f))`` silently ignores every
custom ``backward`` — the collectives' included — and differentiates their forwards instead.

Jacobians and rank-varying values (``test_jacobians_of_varying_values_sum_ranks``): forward
mode seeds the inputs and reverse mode the outputs, and seeding a rank-varying value seeds every
rank's piece at once.  So ``jacfwd`` (and ``hessian`` = jacfwd∘jacrev) w.r.t. a local shard, and
``jacrev`` of a rank-varying output, return the *sum over ranks* of the per-rank Jacobians;
``jacrev`` of an invariant output w.r.t. anything, and ``jacfwd`` w.r.t. an invariant input,
give this rank's own.  Exact Hessians therefore differentiate rank-invariant inputs: the full
parameters, sliced inside the function with ``split_to`` (whose transpose gathers).
"""

from __future__ import annotations

import optree
import pytest
import torch
from torch.distributed.tensor import Shard
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

import hp_functional as hpf
from hp_functional import collectives as C
from tests.conftest import get_pool
from tests.core.test_collectives import exchange
from tests.support.helpers import assert_close, cyclic_splits, mesh, rank, world
from tests.support.models import MLP, build_llama, make_llama_state

TOL = {"atol": 1e-9, "rtol": 1e-9}  # fp64 throughout
F64 = C.Precision(torch.float64, torch.float64, torch.float64)  # FSDP's pair without a cast
SHAPE = (4, 8, 12)  # every split dim divisible by 2 and 4


def _group() -> C.AxisGroup:
    return C.AxisGroup.from_mesh(mesh(), "tp")


def _randn(seed: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _close_tree(actual, expected, what: str, **tol) -> None:
    """assert_close over two pytrees of the same structure (dicts of dicts of tensors)."""
    paths, leaves, _ = optree.tree_flatten_with_path(expected)
    got = optree.tree_leaves(actual)
    assert len(got) == len(leaves), f"{what}: {len(got)} leaves, expected {len(leaves)}"
    for path, a, e in zip(paths, got, leaves, strict=True):
        assert_close(a, e, f"{what} {'/'.join(map(str, path))}", **(tol or TOL))


# ---------------------------------------------------------------- vjp(vjp(C)) == C, per collective
def _apply(name: str, x: torch.Tensor, g: C.AxisGroup) -> torch.Tensor:
    if name in ("send_to", "recv_from"):  # a point-to-point op is linear only with its other end: a swap
        return exchange(x, g, send_first=(g.rank % 2 == 0) == (name == "send_to"))
    args = {"all_gather": (1,), "reduce_scatter": (1,), "gather_from": (1,), "split_to": (1,), "all_to_all": (1, 0),
            "ppermute": (C.ring(g.size, 1),), "copy_to_replicas": (C.Replicas(2),),
            "reduce_from_replicas": (C.Replicas(2),), "all_to_all_v": (1, *cyclic_splits(x.shape[1], g.size, g.rank)),
            "gather_params": (1, F64, g.size), "mean_scatter": (1, F64, g.size)}
    return getattr(C, name)(x, *args.get(name, ()), g)


def _typed(kind: str, seed: int, shape) -> torch.Tensor:
    """A value of ``kind``: "I" the same on every rank, "V" different on every rank."""
    return _randn(seed if kind == "I" else seed + 100 * (rank() + 1), *shape)


def case_vjp_of_vjp():
    """For every collective C (linear): vjp(vjp(C)) applied to v is C(v), with v typed as C's
    input; the backward ops' jvp and vmap rules agree with the backward itself."""
    g = _group()
    report = {}
    for name, coll in C.COLLECTIVES.items():
        src, dst = coll.types.src.value, coll.types.dst.value
        # leave_region's input is a replicated value inside a varying region: equal on every rank
        x = _typed("I" if name == "leave_region" else src, 0, SHAPE)
        y = _apply(name, x, g)
        ct = _typed(dst, 1, y.shape)  # where the inner vjp is taken: any point (it is linear)
        v = _typed("I" if name == "leave_region" else src, 2, SHAPE)

        def backward(c, x=x, name=name):  # c ↦ Cᵀ c
            return vjp(lambda t: _apply(name, t, g), x)[1](c)[0]

        _, second = vjp(backward, ct)
        assert_close(second(v)[0], _apply(name, v, g), f"vjp(vjp({name}))", **TOL)
        # the backward (Cᵀ) is linear: its jvp is itself on the tangent, its vmap stacks it
        t = _typed(dst, 3, y.shape)
        assert_close(jvp(backward, (ct,), (t,))[1], backward(t), f"jvp of {name}'s backward", **TOL)
        batch = torch.stack([ct, 2 * t, -ct])
        stacked = torch.stack([backward(b) for b in batch])
        assert_close(vmap(backward)(batch), stacked, f"vmap of {name}'s backward", **TOL)
        assert_close(vmap(backward, in_dims=1)(batch.movedim(0, 1)), stacked, f"vmap(in_dims=1) of {name}'s backward")
        # and the double transpose's own jvp / vmap rules
        double = lambda w: second(w)[0]  # noqa: E731
        assert_close(jvp(double, (v,), (x,))[1], _apply(name, x, g), f"jvp of vjp(vjp({name}))", **TOL)
        assert_close(vmap(double)(torch.stack([v, x])), torch.stack([_apply(name, v, g), _apply(name, x, g)]),
                     f"vmap of vjp(vjp({name}))", **TOL)
        report[name] = True
    return report


@pytest.mark.slow
def test_vjp_of_vjp_is_the_collective(pool):
    assert all(len(r) == len(C.COLLECTIVES) for r in pool.run(case_vjp_of_vjp))


# ---------------------------------------------------------------- the minimal case (once off by the world size)
def case_minimal():
    """w sharded (one vector per rank), x replicated, f(w, x) = reduce_from(Σ w·copy_to(x)):
    grad of ‖∂f/∂x‖² w.r.t. w is 2·Σ_r w_r (it was world × that)."""
    g, r, n = _group(), rank(), world()
    W, x = _randn(0, n, 3), _randn(1, 3)

    def f(w, x):
        return C.reduce_from((w * C.copy_to(x, g)).sum(), g)

    got = grad(lambda w: (grad(f, argnums=1)(w, x) ** 2).sum())(W[r])
    assert_close(got, 2 * W.sum(0), "grad of the penalty", **TOL)
    return (got / (2 * W.sum(0))).tolist()


def test_minimal_penalty_factor_is_one(pool):
    for ratios in pool.run(case_minimal):
        assert ratios == pytest.approx([1.0] * 3, rel=1e-12)


# ---------------------------------------------------------------- small compositions
# Each composition: (sharded F(inputs, g), its single-device reference F_ref(inputs, n)); the
# inputs are rank-invariant full tensors (sliced inside with split_to), so every derivative of
# every order is the reference's, on every rank.  Together they use ten of the sixteen collectives;
# every one of the sixteen is checked at second order per collective above (vjp of vjp).
def _tp_mlp(p, g):  # copy_to → Colwise → tanh → Rowwise → reduce_from
    h = torch.tanh(C.copy_to(p["x"], g) @ C.split_to(p["w1"], 1, g))
    return (torch.tanh(C.reduce_from(h @ C.split_to(p["w2"], 0, g), g)) ** 2).sum()


def _tp_mlp_ref(p, n):
    return (torch.tanh(torch.tanh(p["x"] @ p["w1"]) @ p["w2"]) ** 2).sum()


def _gather_mlp(p, g):  # Colwise with a gathered output into replicated compute
    h = C.gather_from(torch.tanh(C.copy_to(p["x"], g) @ C.split_to(p["w1"], 1, g)), -1, g)
    return (torch.tanh(h @ p["w2"]) ** 2).sum()


def _sp_mlp(p, g):  # sequence parallel: split rows, all-gather in, reduce-scatter out, gather
    a = C.all_gather(C.split_to(p["x"], 0, g), 0, g)
    h = torch.tanh(a @ C.split_to(p["w1"], 1, g))
    o = C.reduce_scatter(h @ C.split_to(p["w2"], 0, g), 0, g)
    return (C.gather_from(torch.tanh(o), 0, g) ** 2).sum()


def _all_to_all(p, g):  # rows-sharded → columns-sharded
    t = C.all_to_all(torch.tanh(C.split_to(p["x"], 0, g) * C.split_to(p["s"], 0, g)), 1, 0, g)
    return (C.gather_from(torch.tanh(t), 1, g) ** 2).sum()


def _all_to_all_ref(p, n):
    return (torch.tanh(torch.tanh(p["x"] * p["s"])) ** 2).sum()


def _partial(p, g):  # replicated → partial (rank 0 keeps it) + per-rank terms → reduce
    w = C.split_to(p["w"], 0, g)
    y = C.reduce_from(C.partial_from(torch.tanh(p["x"]), g) + torch.tanh(C.copy_to(p["x"], g) * w), g)
    return (torch.tanh(y) ** 2).sum()


def _partial_ref(p, n):
    return (torch.tanh(torch.tanh(p["x"]) + torch.tanh(p["x"] * p["w"]).sum(0)) ** 2).sum()


def _leave(p, g):  # a replicated value computed inside a varying region, leaving it
    u = torch.tanh(C.copy_to(p["x"], g) * C.copy_to(p["s"], g))
    return (C.leave_region(u, g) ** 2).sum() + C.reduce_from((u * C.split_to(p["w"], 0, g)).sum(), g) ** 2


def _leave_ref(p, n):
    u = torch.tanh(p["x"] * p["s"])
    return (u**2).sum() + (u * p["w"]).sum() ** 2


COMPOSITIONS = {
    "tp_mlp": (_tp_mlp, _tp_mlp_ref),
    "gather_mlp": (_gather_mlp, _tp_mlp_ref),
    "sp_mlp": (_sp_mlp, _tp_mlp_ref),
    "all_to_all": (_all_to_all, _all_to_all_ref),
    "partial": (_partial, _partial_ref),
    "leave_region": (_leave, _leave_ref),
}


def _composition_inputs(n: int) -> dict[str, torch.Tensor]:
    d, h = 4, 8  # x: (4 rows, d); rows and w1's columns split over 2 and 4 ranks
    return {"x": _randn(0, 4, d), "w1": _randn(1, d, h) / 2, "w2": _randn(2, h, d) / 2, "s": _randn(3, 4, d),
            "w": _randn(4, n, 1, d)}


def case_compositions():
    g, n = _group(), world()
    report = {}
    for name, (F, F_ref) in COMPOSITIONS.items():
        full = _composition_inputs(n)
        sharded, ref = (lambda p, F=F: F(p, g)), (lambda p, F_ref=F_ref: F_ref(p, n))
        assert_close(sharded(full), ref(full), f"{name} value", **TOL)
        _close_tree(grad(sharded)(full), grad(ref)(full), f"{name} grad")

        def penalty(fn):  # grad∘grad: ‖∂F/∂x‖² differentiated w.r.t. every input
            return lambda p: (grad(fn)(p)["x"] ** 2).sum()

        _close_tree(grad(penalty(sharded))(full), grad(penalty(ref))(full), f"{name} grad∘grad")
        _close_tree(jacrev(jacrev(sharded))(full), jacrev(jacrev(ref))(full), f"{name} jacrev∘jacrev")
        _close_tree(jacfwd(jacrev(sharded))(full), jacfwd(jacrev(ref))(full), f"{name} jacfwd∘jacrev")
        _close_tree(jacrev(jacfwd(sharded))(full), jacrev(jacfwd(ref))(full), f"{name} jacrev∘jacfwd")
        report[name] = True
    return report


@pytest.mark.slow
def test_compositions_every_order(pool):
    assert all(len(r) == len(COMPOSITIONS) for r in pool.run(case_compositions))


def case_local_shards():
    """Derivatives w.r.t. this rank's own shard (rank-varying): the gradient penalty gives this
    rank's block of the reference; mixed second derivatives follow the seeding rule of the
    module docstring."""
    g, r, n = _group(), rank(), world()
    x, w1, w2 = _randn(0, 4, 4), _randn(1, 4, 8) / 2, _randn(2, 8, 4) / 2
    h = 8 // n
    w1_r, w2_r = w1[:, r * h:(r + 1) * h], w2[r * h:(r + 1) * h]

    def f(x, a, b):  # the tp MLP on local shards
        return (torch.tanh(C.reduce_from(torch.tanh(C.copy_to(x, g) @ a) @ b, g)) ** 2).sum()

    def f_ref(x, a, b):
        return (torch.tanh(torch.tanh(x @ a) @ b) ** 2).sum()

    pen = lambda fn: lambda x, a, b: (grad(fn)(x, a, b) ** 2).sum()  # noqa: E731
    got = grad(pen(f), argnums=(0, 1, 2))(x, w1_r, w2_r)
    ref = grad(pen(f_ref), argnums=(0, 1, 2))(x, w1, w2)
    assert_close(got[0], ref[0], "penalty grad x", **TOL)
    assert_close(got[1], ref[1][:, r * h:(r + 1) * h], "penalty grad w1 shard", **TOL)
    assert_close(got[2], ref[2][r * h:(r + 1) * h], "penalty grad w2 shard", **TOL)
    # mixed second derivatives ∂²f/∂x∂(own shard): ∂f/∂(own shard) is rank-varying, so forward
    # mode w.r.t. the invariant x gives this rank's block, while reverse mode seeds every rank's
    # output at once and gives the sum of the blocks (see the module docstring)
    blocks = jacrev(jacrev(f_ref, argnums=1), argnums=0)(x, w1, w2).split(h, 1)
    assert_close(jacfwd(jacrev(f, argnums=1), argnums=0)(x, w1_r, w2_r), blocks[r], "jacfwd∘jacrev mixed", **TOL)
    assert_close(jacrev(jacrev(f, argnums=1), argnums=0)(x, w1_r, w2_r), sum(blocks), "jacrev∘jacrev mixed", **TOL)
    assert_close(jacrev(jacrev(f, argnums=0), argnums=1)(x, w1_r, w2_r), blocks[r].permute(2, 3, 0, 1),
                 "jacrev∘jacrev mixed, invariant output", **TOL)
    assert_close(hessian(f)(x, w1_r, w2_r), hessian(f_ref)(x, w1, w2), "hessian w.r.t. replicated x", **TOL)
    return True


def test_local_shard_derivatives(pool):
    pool.run(case_local_shards)


def case_jacobians_varying():
    """Seeding a rank-varying value seeds every rank's piece at once: jacfwd w.r.t. a local
    shard of an invariant output, and jacrev of a rank-varying output w.r.t. an invariant
    input, are sums over ranks; the other mode gives this rank's own Jacobian."""
    g, r, n = _group(), rank(), world()
    W, x = _randn(0, n, 3), _randn(1, 3)

    def f(w):  # rank-varying w → invariant output
        return C.reduce_from(torch.tanh(w * C.copy_to(x, g)), g)

    def h(x):  # invariant x → rank-varying output
        return torch.tanh(W[r] * C.copy_to(x, g))

    per_rank = [torch.diag((1 - torch.tanh(W[k] * x) ** 2) * x) for k in range(n)]
    assert_close(jacrev(f)(W[r]), per_rank[r], "jacrev, invariant output: this rank's Jacobian", **TOL)
    assert_close(jacfwd(f)(W[r]), sum(per_rank), "jacfwd, varying input: the sum over ranks", **TOL)
    per_rank = [torch.diag((1 - torch.tanh(W[k] * x) ** 2) * W[k]) for k in range(n)]
    assert_close(jacfwd(h)(x), per_rank[r], "jacfwd, invariant input: this rank's Jacobian", **TOL)
    assert_close(jacrev(h)(x), sum(per_rank), "jacrev, varying output: the sum over ranks", **TOL)
    return True


def test_jacobians_of_varying_values_sum_ranks(pool):
    pool.run(case_jacobians_varying)


# ---------------------------------------------------------------- hessian of a sharded model
def _small_mlp_state():
    torch.manual_seed(0)
    m = MLP(d=4, h=8).double()
    with torch.no_grad():
        m.norm.weight.uniform_(0.5, 1.5)
        m.norm.bias.uniform_(-0.5, 0.5)
    return m.state_dict()


def _small_mlp(state) -> MLP:
    m = MLP(d=4, h=8).double()
    m.load_state_dict(state)
    return m


def _local_from_full(full, info, groups):
    """This rank's shards of the full parameters, differentiably: ``split_to`` (transpose: a
    gather) along every mesh dim a leaf is sharded on, in DTensor's order; replicated leaves as
    they are."""
    out = {}
    for k, t in full.items():
        for axis, p in zip(info[k].mesh.mesh_dim_names, info[k].placements, strict=True):
            if isinstance(p, Shard):
                t = C.split_to(t, p.dim % t.dim(), groups[axis])
        out[k] = t
    return out


def case_hessian_mlp(state, plan_name: str):
    model = _small_mlp(state)
    plan = {"tp": {"up": hpf.Colwise(), "down": hpf.Rowwise()},
            "sp": {"norm": hpf.SequenceParallel(), "up": hpf.Colwise(input_layout=Shard(1)),
                   "down": hpf.Rowwise(output_layout=Shard(1))}}[plan_name]
    apply_fn, params, info = hpf.shard(model, plan, mesh())
    g = _group()
    x, y = _randn(5, 2, 4, 4), _randn(6, 2, 4, 4)
    full = {k: v.detach() for k, v in model.named_parameters()}
    assert set(full) == set(info)
    r, n = rank(), world()
    seq = plan_name == "sp"  # sequence-sharded input and output: the loss sums the per-rank pieces

    def loss(p):
        out = apply_fn(_local_from_full(p, info, {"tp": g}), x.chunk(n, 1)[r] if seq else x)
        sq = ((out - (y.chunk(n, 1)[r] if seq else y)) ** 2).sum()
        return (C.reduce_from(sq, g) if seq else sq) / y.numel()

    def ref_loss(p):
        return ((functional_call(model, p, (x,)) - y) ** 2).mean()

    assert_close(loss(full), ref_loss(full), "loss", **TOL)
    H, H_ref = hessian(loss)(full), hessian(ref_loss)(full)
    _close_tree(H, H_ref, f"{plan_name} hessian")
    numel = sum(v.numel() for v in full.values())
    return numel, sum(h.numel() for row in H.values() for h in row.values())


@pytest.mark.parametrize("plan_name", ["tp", "sp"])
def test_hessian_of_sharded_mlp(pool, plan_name):
    numel, entries = pool.run(case_hessian_mlp, _small_mlp_state(), plan_name)[0]
    assert entries == numel**2  # the whole Hessian, every parameter pair


# ---------------------------------------------------------------- MAML: one inner step
def case_maml(state, plan_name: str):
    model = _small_mlp(state)
    plan = {"tp": {"up": hpf.Colwise(), "down": hpf.Rowwise()},
            "gather": {"up": hpf.Colwise(gather_output=True)}}[plan_name]
    apply_fn, params, info = hpf.shard(model, plan, mesh())
    x1, y1, x2, y2 = (_randn(10 + i, 3, 4) for i in range(4))
    lr = 0.5

    def maml(fn):
        def inner(p, x, y):
            return ((fn(p, x) - y) ** 2).mean()

        def outer(p):
            step = grad(inner)(p, x1, y1)
            adapted = optree.tree_map(lambda w, s: w - lr * s, p, step)
            return inner(adapted, x2, y2)

        return outer

    ref_fn = lambda p, x: functional_call(model, p, (x,))  # noqa: E731
    ref_params = {k: v.detach() for k, v in model.named_parameters()}
    outer_grad = hpf.unshard(grad(maml(apply_fn))(params), info)
    ref = grad(maml(ref_fn))(ref_params)
    _close_tree(outer_grad, ref, f"{plan_name} MAML outer grad")
    # the same with autograd: create_graph inner step, .backward() outer
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    inner_loss = ((apply_fn(leaves, x1) - y1) ** 2).mean()
    steps = torch.autograd.grad(inner_loss, list(leaves.values()), create_graph=True)
    adapted = {k: w - lr * s for (k, w), s in zip(leaves.items(), steps, strict=True)}
    ((apply_fn(adapted, x2) - y2) ** 2).mean().backward()
    _close_tree(hpf.unshard({k: v.grad for k, v in leaves.items()}, info), ref, f"{plan_name} MAML autograd")
    return True


@pytest.mark.parametrize("plan_name", ["tp", "gather"])
def test_maml_step_matches_unsharded(pool, plan_name):
    pool.run(case_maml, _small_mlp_state(), plan_name)


# ---------------------------------------------------------------- gradient penalty on HF Llama
LLAMA = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
         "num_key_value_heads": 4, "head_dim": 4, "vocab_size": 32}


def case_llama_penalty(state, plan_kind: str, kv_heads: int | None = None):
    """J(p) = loss(ids) + ‖∂loss/∂inputs_embeds‖², differentiated w.r.t. every parameter, by
    torch.func (grad of a function calling grad) and by autograd (create_graph + backward).
    fp64, but HF's eager attention takes its softmax in fp32: fp32 tolerances."""
    cfg = LLAMA if kv_heads is None else {**LLAMA, "num_key_value_heads": kv_heads}
    model = build_llama(state, **cfg).double()
    plan = {"hf": lambda: hpf.ShardingPlan.from_hf(model), "sp": hpf.llama_sp_plan,
            "hf_loss_parallel": lambda: hpf.ShardingPlan.from_hf(model, loss_parallel=True),
            "regions_partial_exit": lambda: hpf.megatron_plan(model, partial_exit=True)}[plan_kind]()
    apply_fn, params, info = hpf.shard(model, plan, mesh())
    ids = torch.randint(0, cfg["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(7))
    embeds = model.get_input_embeddings()(ids).detach()

    def objective(fn):
        def J(p):
            penalty = (grad(lambda e: fn(p, inputs_embeds=e, labels=ids).loss)(embeds) ** 2).sum()
            return fn(p, input_ids=ids, labels=ids).loss + penalty

        return J

    ref_params = {k: v.detach() for k, v in model.named_parameters()}
    ref = grad(objective(lambda p, **kw: functional_call(model, p, (), kw)))(ref_params)
    assert all(ref[k].abs().sum() > 0 for k in ref), "every parameter takes part"
    got = hpf.unshard(grad(objective(apply_fn))(params), info)
    assert set(got) == set(ref)
    _close_tree(got, ref, f"{plan_kind} penalty torch.func", atol=1e-6, rtol=1e-6)

    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    e = embeds.clone().requires_grad_(True)
    (ge,) = torch.autograd.grad(apply_fn(leaves, inputs_embeds=e, labels=ids).loss, e, create_graph=True)
    (apply_fn(leaves, input_ids=ids, labels=ids).loss + (ge**2).sum()).backward()
    got_ag = hpf.unshard({k: v.grad for k, v in leaves.items()}, info)
    _close_tree(got_ag, ref, f"{plan_kind} penalty autograd", atol=1e-6, rtol=1e-6)
    return True


@pytest.mark.parametrize("plan_kind", ["hf", "sp", "hf_loss_parallel", "regions_partial_exit"])
@pytest.mark.slow
def test_llama_gradient_penalty(pool, plan_kind):
    pool.run(case_llama_penalty, make_llama_state(**LLAMA), plan_kind)


@pytest.mark.slow
def test_llama_gradient_penalty_kv_heads_replicated(pool):
    """Fewer KV heads than ranks (KV-head replication): exact at second order too."""
    kv = pool.world // 2
    pool.run(case_llama_penalty, make_llama_state(**{**LLAMA, "num_key_value_heads": kv}), "hf", kv)


# ---------------------------------------------------------------- torch.compile: torch's limits
DONATED = ("This backward function was compiled with non-empty donated buffers which requires create_graph=False "
           "and retain_graph=False. Please keep backward(create_graph=False, retain_graph=False) across all backward() "
           "function calls, or set torch._functorch.config.donated_buffer=False to disable donated buffer.")
DOUBLE = "torch.compile with aot_autograd does not currently support double backward"


def case_compile_limits():
    """Under torch.compile (aot_eager): (1) after a plain ``.backward()``, ``create_graph=True``
    on the same compiled function raises (donated buffers); (2) on a fresh compile the
    create_graph grad works but the double backward raises; (3) torch.func.grad of a compiled
    region drops every custom backward (pytorch/pytorch#193279): copy_to's all-reduce is lost,
    so ∂f/∂x is this rank's term only.  The plain ``.backward()`` keeps it (tests/runtime/test_torch_compile.py)."""
    g, r, n = _group(), rank(), world()
    W, x = _randn(0, n, 3), _randn(1, 3)

    def f(w, x):
        return C.reduce_from(torch.tanh(w * C.copy_to(x, g)).sum(), g)

    full = ((1 - torch.tanh(W * x) ** 2) * W).sum(0)  # ∂f/∂x
    own = (1 - torch.tanh(W[r] * x) ** 2) * W[r]  # rank r's term of it
    messages = []
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager")
    xx = x.clone().requires_grad_(True)
    compiled(W[r], xx).backward()
    assert_close(xx.grad, full, "compiled .backward()", **TOL)
    with pytest.raises(RuntimeError) as info:
        torch.autograd.grad(compiled(W[r], xx), xx, create_graph=True)
    messages.append(str(info.value))
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager")
    (gx,) = torch.autograd.grad(compiled(W[r], xx), xx, create_graph=True)
    assert_close(gx, full, "compiled create_graph grad", **TOL)
    with pytest.raises(RuntimeError) as info:
        (gx**2).sum().backward()
    messages.append(str(info.value))
    torch._dynamo.reset()
    dropped = torch.compile(grad(f, argnums=1), backend="aot_eager")(W[r], x)
    torch._dynamo.reset()
    assert_close(dropped, own, "compile(torch.func.grad): the custom backward is ignored", **TOL)
    assert not torch.allclose(dropped, full)
    return messages


@pytest.mark.slow
def test_compile_limits():
    """torch's, not ours: world size does not matter, so the 2-rank pool only."""
    assert get_pool(2).run(case_compile_limits) == [[DONATED, DOUBLE]] * 2
