"""KV-head replication: more TP ranks than KV heads (2 KV heads at TP 4, 1 at TP 2 and 4).

Each rank holds the KV head its query heads use, replicated over the ranks that share it; loss,
logits and every gradient match the unsharded model (``.backward()`` and ``torch.func``), ``unshard``
returns the original weights, checkpoints keep the original layout (loaded at another TP size),
the global gradient norm is counted once, and ``explain`` shows the memory and the extra reductions."""

import pytest
import torch
from torch.distributed.tensor import Shard
from torch.func import grad_and_value

import hp_functional as hpf
from hp_functional.core.placement import GroupedShard, slice_local
from tests.conftest import get_pool
from tests.support.helpers import assert_close, build_hf, make_hf_state, mesh, world
from tests.support.models import AttrAttention, attn_plan
from tests.support.snapshot import assert_unchanged, snapshot

K = "model.layers.0.self_attn.k_proj.weight"


def _kv(n: int) -> int:
    return n // 2  # 2 KV heads at TP 4, 1 at TP 2: fewer than the ranks


def _run(apply_fn, params, info, ids, functional: bool):
    if functional:
        grads, loss = grad_and_value(lambda p: apply_fn(p, input_ids=ids, labels=ids).loss)(params)
    else:
        loss = apply_fn(params, input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {k: p.grad for k, p in params.items()}
    return loss, hpf.unshard(grads, info)


def case_llama(state, kv: int, plan_kind: str, root: str | None):
    model = build_hf("llama", state, num_key_value_heads=kv)
    before = snapshot(model)
    plan = hpf.llama_sp_plan() if plan_kind == "sp" else hpf.ShardingPlan.from_hf(model)
    apply_fn, params, info = hpf.shard(model, plan, mesh())
    replicas = world() // kv
    assert info[K].placements == (GroupedShard(0, replicas),) and tuple(params[K].shape) == (8, 64)  # one head
    assert info["model.layers.0.self_attn.q_proj.weight"].placements == (Shard(0),)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(7))
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    diffs = {}
    for functional in (False, True):
        loss, grads = _run(apply_fn, params, info, ids, functional)
        diffs[f"loss {functional}"] = assert_close(loss, ref.loss.detach(), "loss")
        diffs[f"grad {functional}"] = max(assert_close(grads[k], p.grad, f"grad {k}") for k, p in model.named_parameters())
    logits = apply_fn(params, input_ids=ids).logits
    diffs["logits"] = assert_close(logits, ref.logits.detach(), "logits")
    full = hpf.unshard(params, info)
    assert all(torch.equal(full[k], p) for k, p in model.named_parameters()), "unshard returns the original weights"
    # the global gradient norm counts each replicated KV head once
    _, norm = hpf.clip_grad_norm({k: p.grad for k, p in params.items()}, info, 1.0)
    ref_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    diffs["norm"] = assert_close(norm, ref_norm, "grad norm")
    model.zero_grad(set_to_none=True)
    assert_unchanged(before, snapshot(model))
    assert model.model.layers[0].self_attn.num_key_value_groups == 8 // kv  # the user's module keeps its own
    if root is not None:
        hpf.save(f"{root}/kv", params, info).wait()
    else:  # validate compares every module output, the replicated K/V outputs included
        report = hpf.validate(model, plan, mesh(), input_ids=ids, labels=ids, raise_on_failure=True)
        assert report.ok, str(report)
    return diffs


@pytest.mark.parametrize("plan_kind", ["hf", "sp"])
@pytest.mark.slow
def test_llama_fewer_kv_heads_than_tp(pool, plan_kind, tmp_path_factory):
    kv = _kv(pool.world)
    root = str(tmp_path_factory.mktemp("kv")) if plan_kind == "hf" else None
    diffs = pool.run(case_llama, make_hf_state("llama", num_key_value_heads=kv), kv, plan_kind, root)
    print(f"world {pool.world}, {kv} KV heads, {plan_kind}: max diffs {diffs[0]}")
    if root is not None and pool.world == 4:  # the checkpoint holds the original layout: load it at TP 2
        get_pool(2).run(case_load_tp2, make_hf_state("llama", num_key_value_heads=kv), kv, root)


def case_load_tp2(state, kv: int, root: str):
    model = build_hf("llama", state, num_key_value_heads=kv)
    _, params, info = hpf.shard(model, hpf.ShardingPlan.from_hf(model), mesh())
    assert info[K].placements == (Shard(0),)  # 2 KV heads over 2 ranks: plain Colwise
    out = hpf.load(f"{root}/kv", info)
    for k, p in model.named_parameters():
        if k in out.params:
            assert torch.equal(out.params[k], slice_local(p.detach(), info[k])), k


@pytest.mark.slow
def test_single_kv_head_at_tp4():
    """1 KV head over 4 ranks: every rank holds it; its gradient is summed over all four."""
    print(get_pool(4).run(case_llama, make_hf_state("llama", num_key_value_heads=1), 1, "hf", None)[0])


def case_attr_heads(state, kv: int):
    """A non-HF attention that reshapes with ``self.num_key_value_heads`` (``Heads`` style)."""
    model = AttrAttention(hidden=32, heads=8, kv_heads=kv)
    model.load_state_dict(state)
    apply_fn, params, info = hpf.shard(model, attn_plan(), mesh())
    assert info["k_proj.weight"].placements == (GroupedShard(0, world() // kv),)
    assert info["k_proj.bias"].placements == (GroupedShard(0, world() // kv),)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1))
    ref = model(x)
    ref.square().mean().backward()
    grads, loss = grad_and_value(lambda p: apply_fn(p, x).square().mean())(params)
    assert_close(loss, ref.square().mean().detach(), "loss")
    full = hpf.unshard(grads, info)
    worst = max(assert_close(full[k], p.grad, f"grad {k}") for k, p in model.named_parameters())
    assert model.num_key_value_heads == kv
    return worst


def test_attribute_heads_fewer_kv_heads_than_tp(pool):
    kv = _kv(pool.world)
    torch.manual_seed(0)
    print(pool.run(case_attr_heads, AttrAttention(hidden=32, heads=8, kv_heads=kv).state_dict(), kv)[0])


def case_explain(kv: int, m):
    with torch.device("meta"):  # shapes only
        model = build_hf("llama", None, num_key_value_heads=kv)
    e = hpf.explain(model, hpf.ShardingPlan.from_hf(model), m, batch=2, seq=8)
    assert tuple(e.program.infos[K].local_shape) == (8, 64)  # one head of 8, not the 2 x 8 rows of both
    return str(e), e.schedule.count(op="all_reduce", direction="bwd"), e.memory.per_rank


@pytest.mark.slow
def test_explain_shows_memory_and_extra_reduction():
    """At tp 4 on the fake process group (a meta model: shapes and the schedule, no numbers)."""
    text, reduces, per_rank = hpf.simulate(lambda m: case_explain(2, m), world_size=4)
    _, plain_reduces, plain_per_rank = hpf.simulate(lambda m: case_explain(4, m), world_size=4)
    assert "GroupedShard(dim=0, replicas=2)" in text and "all_reduce(replicas of 2)" in text, text
    assert reduces == plain_reduces + 2 * 2, (reduces, plain_reduces)  # k and v weight per layer, 2 layers
    assert per_rank == plain_per_rank  # one KV head per rank, as when 4 KV heads split over 4 ranks
    print(text)


def case_bad_kv(kv: int, heads: int):
    model = build_hf("llama", None, num_key_value_heads=kv, num_attention_heads=heads, hidden_size=heads * 8)
    with pytest.raises(hpf.PlanError) as exc:
        hpf.shard(model, hpf.ShardingPlan.from_hf(model), mesh())
    return str(exc.value)


def test_kv_heads_that_neither_divide_nor_are_divided_raise(pool):
    msgs = pool.run(case_bad_kv, 3, 3 * pool.world)
    assert all(m == msgs[0] for m in msgs)
    assert "model.layers.0.self_attn: 3 KV heads" in msgs[0] and "'tp'" in msgs[0], msgs[0]


def case_fsdp(state):
    """FSDP over dp on top of KV replication over tp (1 KV head, dp 2 x tp 2)."""
    model = build_hf("llama", state, num_key_value_heads=1)
    m = mesh((2, 2), ("dp", "tp"))
    apply_fn, params, info = hpf.fsdp(*hpf.shard(model, hpf.ShardingPlan.from_hf(model), m), m, "dp")
    assert info[K].placements == (Shard(0), GroupedShard(0, 2))
    ids = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(7))
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    mine = ids.chunk(2)[m["dp"].get_local_rank()]
    apply_fn(params, input_ids=mine, labels=mine).loss.backward()
    grads = {k: p.grad for k, p in params.items()}
    full = hpf.unshard(grads, info)
    worst = max(assert_close(full[k], p.grad, f"grad {k}") for k, p in model.named_parameters())
    _, norm = hpf.clip_grad_norm(grads, info, 1.0)
    assert_close(norm, torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])), "norm")
    assert all(torch.equal(w, p) for w, p in zip(hpf.unshard(params, info).values(), model.parameters(), strict=True))
    return worst


def test_fsdp_over_replicated_kv_heads():
    print(get_pool(4).run(case_fsdp, make_hf_state("llama", num_key_value_heads=1))[0])


def case_auto_plan(state, kv: int):
    """``auto_plan`` emits plain Colwise K/V projections; the compiler's pass replicates them."""
    model = build_hf("llama", state, num_key_value_heads=kv)
    apply_fn, params, info = hpf.shard(model, hpf.auto_plan(model, mesh()), mesh())
    assert info[K].placements == (GroupedShard(0, world() // kv),)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(7))
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    loss, grads = _run(apply_fn, params, info, ids, functional=False)
    assert_close(loss, ref.loss.detach(), "loss")
    return max(assert_close(grads[k], p.grad, f"grad {k}") for k, p in model.named_parameters())


def test_auto_plan_gets_kv_replication(pool):
    kv = _kv(pool.world)
    print(pool.run(case_auto_plan, make_hf_state("llama", num_key_value_heads=kv), kv)[0])
