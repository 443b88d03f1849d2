"""Ulysses sequence parallelism against the unsharded computation (gloo).

The kernel against full-sequence SDPA in fp64 (causal and not, zigzag and contiguous, MHA, GQA
split and replicated over the axis, values of another head dim): output and dq/dk/dv under
``.backward()`` and ``torch.func.vjp``; jvp, vmap, vmap(grad), grad∘grad and jvp∘grad equal
all-gather attention's.  HF models (Llama, Qwen2, Qwen3: tiny configs, random weights) through
``from_hf(cp_strategy="ulysses")`` and a hand-written ``Ulysses`` plan: loss, logits and every
gradient (``.backward()`` and ``torch.func.grad``) at cp 2 and cp 4, cp 2 × tp 2, dp 2 × cp 2
under ``hpf.fsdp``; head counts that do not divide are refused by name on every rank, before any
collective."""

import pytest
import torch
import torch.nn.functional as F

import hp_functional as hpf
from hp_functional.core.collectives import AxisGroup
from hp_functional.parallel.context.ring_attention import STRATEGIES
from hp_functional.parallel.ulysses.attention import UlyssesAttention, ulysses_attention
from tests.conftest import get_pool
from tests.parallel.test_context_parallel_hf import _compare, _ids, _reference
from tests.support.helpers import assert_close, build_hf, make_hf_state, mesh, plan_errors, rank, world

SEQ = 16


def _group():
    return AxisGroup.from_mesh(mesh((world(),), ("cp",)), "cp")


def _qkv(heads: int, kv_heads: int, seq: int, v_dim: int = 8, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, seq, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, kv_heads, seq, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(2, kv_heads, seq, v_dim, generator=gen, dtype=torch.float64)
    dout = torch.randn(2, heads, seq, v_dim, generator=gen, dtype=torch.float64)
    return q, k, v, dout


def _kernel(layout: str, causal: bool, heads: int, kv_heads: int, v_dim: int) -> float:
    g = _group()
    q, k, v, dout = _qkv(heads, kv_heads, 4 * g.size, v_dim)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=kv_heads != heads)
    ref.backward(dout)
    local = [hpf.cp_shard(t, g, 2, layout=layout).requires_grad_() for t in (q, k, v)]
    out = ulysses_attention(*local, g, layout=layout, causal=causal)
    d_local = hpf.cp_shard(dout, g, 2, layout=layout)
    out.backward(d_local)
    what = f"{layout} causal={causal} heads {heads}/{kv_heads}"
    worst = assert_close(hpf.cp_unshard(out.detach(), g, 2, layout=layout), ref.detach(), f"{what} out", 1e-10, 1e-10)
    for name, t, r in zip("qkv", local, full, strict=True):
        worst = max(worst, assert_close(hpf.cp_unshard(t.grad, g, 2, layout=layout), r.grad, f"{what} d{name}",
                                        1e-10, 1e-10))
    _, vjp = torch.func.vjp(lambda a, b, c: ulysses_attention(a, b, c, g, layout=layout, causal=causal),
                            *[t.detach() for t in local])
    for name, got, t in zip("qkv", vjp(d_local), local, strict=True):
        worst = max(worst, assert_close(got, t.grad, f"{what} vjp d{name}", 1e-12, 1e-12))
    return worst


def _transforms() -> int:
    """torch.func through Ulysses equals all-gather attention (the same function, differentiable
    at every order), with K/V heads replicated over the axis (1 K/V head)."""
    g = _group()
    gen = torch.Generator().manual_seed(0)
    q, t = (torch.randn(2, 2 * g.size, 4, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    results = {}
    for name, attend in (("ulysses", ulysses_attention), ("allgather", STRATEGIES["allgather"])):
        def f(x, attend=attend):
            return attend(x, x[:, :1].flip(2), x[:, 1:2].cos(), g).square().sum()

        results[name] = {
            "grad": torch.func.grad(f)(q),
            "grad(grad)": torch.func.grad(lambda x: torch.func.grad(f)(x).sum())(q),
            "jvp(grad)": torch.func.jvp(torch.func.grad(f), (q,), (t,))[1],
            "jvp": torch.func.jvp(f, (q,), (t,))[1],
            "vmap(grad)": torch.func.vmap(torch.func.grad(f))(torch.stack([q, t])),
        }
    for what, want in results["allgather"].items():
        assert_close(results["ulysses"][what], want, f"ulysses {what}", atol=1e-10, rtol=1e-10)
    return len(results["ulysses"])


def case_kernel(cases, transforms: bool = True) -> dict:
    out = {c: _kernel(*c) for c in cases}
    if transforms:  # grad∘grad, jvp∘grad, jvp, vmap(grad) against all-gather attention's (once, at cp 2)
        out["transforms"] = _transforms()
    return out


def test_kernel_matches_sdpa():
    """cp 2: MHA, GQA split (2 K/V heads), GQA replicated (1 K/V head), another value head dim."""
    cases = [("zigzag", True, 4, 4, 8), ("zigzag", True, 4, 2, 8), ("contiguous", True, 4, 1, 8),
             ("zigzag", False, 4, 2, 4), ("contiguous", False, 2, 2, 8)]
    print(get_pool(2).run(case_kernel, cases)[0])


@pytest.mark.slow
def test_kernel_matches_sdpa_cp4():
    """cp 4: 1 and 2 K/V heads are fewer than the ranks (replicated), 4 split."""
    cases = [("zigzag", True, 8, 4, 8), ("zigzag", True, 8, 2, 8), ("contiguous", True, 4, 1, 4),
             ("zigzag", False, 4, 4, 8)]
    print(get_pool(4).run(case_kernel, cases, False)[0])


# ---------------------------------------------------------------- HF models
def _model_case(family: str, state, shape: tuple, names: tuple, overrides: dict, hand_written: bool = False,
                layout: str = "zigzag") -> dict:
    model = build_hf(family, state, **overrides)
    m = mesh(shape, names)
    if hand_written:  # the style in a plan of one's own: TP entries (if any) plus Ulysses on attention
        tp = hpf.ShardingPlan.from_hf(model).entries if "tp" in names else {}
        plan = hpf.ShardingPlan({**tp, "model.layers.*.self_attn": hpf.Ulysses()}, axes={"cp": "cp"},
                                settings={"cp_layout": layout})
    else:
        plan = hpf.ShardingPlan.from_hf(model, cp_axis="cp", cp_strategy="ulysses", cp_layout=layout)
    apply_fn, params, info = hpf.shard(model, plan, m)
    assert apply_fn.runtime.checks["probe"].startswith("exact"), apply_fn.runtime.checks
    ids = _ids()
    ref, ref_grads = _reference(model, ids, ids)
    diffs = _compare(apply_fn, params, info, m, ref, ref_grads, dict(input_ids=ids, labels=ids))
    logits = apply_fn(params, input_ids=ids).logits
    diffs["logits"] = assert_close(hpf.cp_unshard(logits.detach(), m, 1, layout=layout), ref.logits.detach(), "logits")
    return diffs


def case_models(cases) -> dict:
    out = {}
    for family, shape, names, overrides, *rest in cases:
        out[(family, shape, tuple(sorted(overrides.items())), *rest)] = _model_case(
            family, make_hf_state(family, **overrides), shape, names, overrides, *rest)
    return out


def test_llama_ulysses_cp2():
    """cp 2 on Llama through ``from_hf(cp_strategy="ulysses")``."""
    print(get_pool(2).run(case_models, [("llama", (2,), ("cp",), {})])[0])


@pytest.mark.slow
def test_ulysses_cp2_hand_written_contiguous():
    """A hand-written plan (``hpf.Ulysses()`` on the attention modules), contiguous layout."""
    print(get_pool(2).run(case_models, [("llama", (2,), ("cp",), {}, True, "contiguous")])[0])


@pytest.mark.slow
def test_ulysses_cp4():
    """cp 4: Llama (4 K/V heads split), Qwen3 with 2 K/V heads (replicated over the 4 ranks)."""
    cases = [("llama", (4,), ("cp",), {}), ("qwen3", (4,), ("cp",), {"num_key_value_heads": 2})]
    print(get_pool(4).run(case_models, cases)[0])


@pytest.mark.slow
def test_ulysses_cp2_times_tp2():
    """cp 2 × tp 2: heads split over tp, then over cp.  Qwen2 (4 K/V heads: 1 per rank), Qwen3
    with 2 K/V heads (1 per tp rank, replicated over cp), and a hand-written plan on Llama."""
    cases = [("qwen2", (2, 2), ("cp", "tp"), {}), ("qwen3", (2, 2), ("cp", "tp"), {"num_key_value_heads": 2}),
             ("llama", (2, 2), ("cp", "tp"), {}, True)]
    print(get_pool(4).run(case_models, cases)[0])


def case_fsdp(state) -> dict:
    """dp 2 × cp 2 with ``hpf.fsdp`` over dp: each dp rank its own rows; the mean loss and gradient
    over dp are the unsharded model's on the whole batch."""
    from torch.func import grad_and_value

    model = build_hf("qwen3", state)
    m = mesh((2, 2), ("dp", "cp"))
    plan = hpf.ShardingPlan.from_hf(model, cp_axis="cp", cp_strategy="ulysses")
    apply_fn, params, info = hpf.fsdp(*hpf.shard(model, plan, m), m, "dp")
    ids = _ids()
    both = torch.cat([ids, ids.flip(0)])
    ref = model(input_ids=both, labels=both)
    ref.loss.backward()
    rows = (ids, ids.flip(0))[m["dp"].get_local_rank()]
    kwargs = dict(input_ids=rows, labels=rows)
    apply_fn(params, **kwargs).loss.backward()
    functional, loss = grad_and_value(lambda p: apply_fn(p, **kwargs).loss)(params)
    dp = AxisGroup.from_mesh(m, "dp")
    diffs = {"loss": assert_close(hpf.collectives.raw_all_reduce(loss.detach(), dp) / 2, ref.loss.detach(), "loss")}
    for label, grads in (("backward", {k: p.grad for k, p in params.items()}), ("grad", functional)):
        full = hpf.unshard(grads, info)
        diffs[label] = max(assert_close(full[k], p.grad, f"{label} grad {k}") for k, p in model.named_parameters())
    return diffs


@pytest.mark.slow
def test_ulysses_dp2_times_cp2_fsdp():
    print(get_pool(4).run(case_fsdp, make_hf_state("qwen3"))[0])


# ---------------------------------------------------------------- refusals
def case_heads() -> dict:
    """Head counts that do not divide the axis: a PlanError naming the module, the count and the
    axis size, raised by shard() on every rank (its local projections show the counts), and by the
    attention itself (for modules whose projections do not show them) on one rank calling alone,
    before any collective."""
    errors = {}
    m = mesh((world(),), ("cp",))
    for what, overrides in (("query heads", dict(num_attention_heads=3, num_key_value_heads=3, hidden_size=48)),
                            ("kv heads", dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=48))):
        torch.manual_seed(0)  # the same weights on every rank
        model = build_hf("llama", None, **overrides)
        plan = hpf.ShardingPlan.from_hf(model, cp_axis="cp", cp_strategy="ulysses")
        errors.update(plan_errors({f"{what} at shard": lambda: hpf.shard(model, plan, m, verify=False)}))
        mode = UlyssesAttention(model.model.layers[0].self_attn, _group(), "zigzag", None, "model.layers.0.self_attn")
        q = torch.zeros(2, overrides["num_attention_heads"], 4, 8)
        k = torch.zeros(2, overrides["num_key_value_heads"], 4, 8)
        if rank() == 0:  # one rank alone: a check placed after a collective would hang here
            errors.update(plan_errors({f"{what} alone": lambda: mode._attention(q, k, k)}))
    torch.manual_seed(0)
    model = build_hf("llama", None)
    errors.update(plan_errors({
        "strategy": lambda: hpf.shard(model, hpf.ShardingPlan({"model.layers.*.self_attn": hpf.Ulysses("ring")},
                                                              axes={"cp": "cp"}), m),
    }))
    apply_fn, params, _ = hpf.shard(model, hpf.ShardingPlan({"model.layers.*.mlp": hpf.Ulysses()}, axes={"cp": "cp"}), m,
                                    verify=False)
    errors.update(plan_errors({"no sdpa": lambda: apply_fn(params, input_ids=_ids())}))
    return errors


@pytest.mark.slow
def test_heads_that_do_not_divide_are_refused():
    errors = get_pool(2).run(case_heads)
    for r, errs in enumerate(errors):
        expect = {"query heads at shard": "3 query heads", "kv heads at shard": "3 K/V heads",
                  "strategy": "strategy 'ulysses'", "no sdpa": "no scaled_dot_product_attention"}
        if r == 0:
            expect.update({"query heads alone": "3 query heads", "kv heads alone": "3 K/V heads"})
        for what, text in expect.items():
            assert what in errs and text in errs[what][1], (r, what, errs.get(what))
            assert "model.layers.0.self_attn" in errs[what][1] or what in ("strategy", "no sdpa"), errs[what]
            assert "size 2" in errs[what][1] or what in ("strategy", "no sdpa"), errs[what]
