"""Reliability: cross-rank agreement, no hangs, determinism, and repeated use of shard()/apply_fn."""

import gc
import time
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.func import grad, vmap

import hp_functional as hpf
from hp_functional.compile import agree as agree_module
from tests.conftest import get_pool
from tests.support.helpers import assert_close, build_hf, mesh, rank, world
from tests.support.models import build_llama, make_llama_state
from tests.support.rank_pool import RankFailure, RankPool
from tests.support.snapshot import assert_unchanged, snapshot


# ------------------------------------------------------------------ cross-rank agreement
def case_mismatch(state, kind: str):
    """Rank 1 (or the last rank) differs in one way; every rank must raise the same PlanMismatchError."""
    odd = rank() == world() - 1
    m = mesh()
    model = build_llama(state)
    plan = hpf.ShardingPlan.from_hf(model)
    if odd and kind == "config":
        model = build_hf("llama", None, intermediate_size=256)
    elif odd and kind == "plan":
        plan = hpf.ShardingPlan({k: v for k, v in plan.entries.items() if "mlp" not in k})
    elif odd and kind == "version":
        original = agree_module._version
        agree_module._version = lambda name: "9.9.9" if name == "hp_functional" else original(name)
    checkpoint = ["model.layers.*"] if odd and kind == "checkpoint" else None  # only some ranks would recompute
    try:
        hpf.shard(model, plan, m, remat=checkpoint)
    except hpf.PlanMismatchError as exc:
        return str(exc)
    finally:
        if odd and kind == "version":
            agree_module._version = original
    return None


MISMATCH = {
    "config": "parameters model.layers.0.mlp.down_proj.weight: (64, 128)",
    "plan": "plan model.layers.0.mlp.down_proj",
    "version": "library hp_functional",
    "checkpoint": "plan checkpoint: None on ranks",
}


@pytest.mark.parametrize("kind", sorted(MISMATCH))
def test_ranks_that_disagree_raise_plan_mismatch_everywhere(pool, kind):
    messages = pool.run(case_mismatch, make_llama_state(), kind)
    last = pool.world - 1
    for msg in messages:
        assert msg is not None, "no PlanMismatchError"
        assert MISMATCH[kind] in msg and f"on ranks [{last}]" in msg, msg
    assert len(set(messages)) == 1, "ranks reported different messages"


def case_values_differ(kind: str, verify: bool = True):
    """Every rank builds the model itself; ``kind`` says what differs across ranks."""
    last = rank() == world() - 1
    torch.manual_seed(rank() if kind == "seed" else 0)  # "seed": each rank seeds differently (the silent bug)
    model = build_hf("llama")
    with torch.no_grad():
        if kind == "norm" and last:  # one replicated parameter differs on the last rank only
            model.model.layers[1].input_layernorm.weight.add_(1e-3)
        if kind == "buffer" and last:
            model.model.rotary_emb.inv_freq.mul_(1.5)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(3))
    try:
        apply_fn, params, _ = hpf.shard(model, hpf.ShardingPlan.from_hf(model), mesh(), verify_values=verify)
    except hpf.PlanMismatchError as exc:
        return str(exc)
    sharded = apply_fn(params, input_ids=ids, labels=ids).loss.item()
    return sharded, model(input_ids=ids, labels=ids).loss.item()


def test_ranks_with_different_weights_raise_naming_the_first_tensor(pool):
    """Seeding each rank differently used to give a silently wrong loss; now every rank raises
    the same PlanMismatchError naming the first parameter (in model order) and the ranks."""
    messages = pool.run(case_values_differ, "seed")
    for msg in messages:
        assert isinstance(msg, str), f"no PlanMismatchError: {msg}"
        first = msg.splitlines()[1]
        assert first.startswith("  values model.embed_tokens.weight: checksums") and "on ranks [0]" in first, msg
        assert "seed every rank alike" in msg
    assert len(set(messages)) == 1


@pytest.mark.parametrize("kind,name", [("norm", "model.layers.1.input_layernorm.weight"),
                                       ("buffer", "model.rotary_emb.inv_freq")])
def test_one_replicated_tensor_differing_on_one_rank_is_named(pool, kind, name):
    last = pool.world - 1
    for msg in pool.run(case_values_differ, kind):
        assert isinstance(msg, str), f"no PlanMismatchError: {msg}"
        lines = [line for line in msg.splitlines() if line.startswith("  values")]
        assert len(lines) == 1 and lines[0].startswith(f"  values {name}:") and f"on ranks [{last}]" in lines[0], msg


def test_verify_values_false_skips_the_check(pool):
    """Without the check, different weights go through and the loss matches no rank's model:
    what the check is there to stop."""
    results = pool.run(case_values_differ, "seed", False)
    sharded = results[0][0]
    assert all(abs(r[0] - sharded) < 1e-6 for r in results), "the sharded loss is one value on every rank"
    assert all(abs(r[1] - sharded) > 1e-4 for r in results), results


def test_checksum_is_exact_and_position_sensitive():
    """Equal bits, equal checksum; a swap of two elements, a sign flip, -0.0 or one ulp differ."""
    x = torch.randn(1000, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    c = agree_module.checksum
    assert c(x) == c(x.clone())
    swapped = x.clone()
    swapped[[3, 7]] = swapped[[7, 3]]
    ulp = x.clone()
    ulp[5] = torch.nextafter(ulp[5], torch.tensor(float("inf")))
    zeros = torch.zeros(4)
    signed = zeros.clone()
    signed[2] = -0.0
    assert len({c(x), c(swapped), c(ulp), c(-x)}) == 4 and c(zeros) != c(signed)
    for dtype in (torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.bool, torch.uint8, torch.complex64):
        t = torch.arange(6).to(dtype)
        assert c(t) == c(t.clone()) and c(t) != c(t.flip(0)), dtype
    big = torch.arange(3 * 4093 + 5, dtype=torch.float32)
    assert c(big) != c(big.roll(1))
    d = agree_module.device_checksum  # the accelerator path, run here on CPU bytes
    for t in (x, big, torch.arange(7, dtype=torch.uint8)):  # int32 words with a tail; plain bytes
        b = t.view(torch.uint8)
        assert d(b) == d(b.clone()) and d(b) != d(b.roll(4)) and d(b) != d(b.flip(0)), t.dtype
    assert d(swapped.view(torch.uint8)) != d(x.view(torch.uint8)) and d(ulp.view(torch.uint8)) != d(x.view(torch.uint8))


def case_submesh_agreement(state):
    """On a sub-mesh (one tp group of a dp x tp mesh) agreement runs over that sub-mesh only."""
    m = mesh((2, world() // 2), ("dp", "tp"))["tp"]
    model = build_llama(state) if rank() != world() - 1 else build_hf("llama", None, intermediate_size=256)
    try:
        hpf.shard(model, hpf.ShardingPlan.from_hf(model), m)
    except hpf.PlanMismatchError as exc:
        return str(exc)
    return None


def test_agreement_on_a_submesh():
    """Needs a proper sub-mesh, so 4 ranks (2 x 2): run on the world-size-4 pool only."""
    messages = get_pool(4).run(case_submesh_agreement, make_llama_state())
    assert messages[:2] == [None, None], "the first tp group agrees and must not raise"
    for msg in messages[2:]:
        assert "on ranks [3]" in msg and "mlp.down_proj.weight" in msg, msg


# ------------------------------------------------------------------ no hangs
def case_one_rank_fails_before_a_collective():
    if rank() == 1:
        raise RuntimeError("rank 1 fails on purpose")
    dist.all_reduce(torch.ones(1))


def case_one_rank_fails_inside_shard(state):
    cfg = {"intermediate_size": 129} if rank() == 1 else {}  # rank 1's MLP does not divide by 2
    model = build_hf("llama", None if cfg else state, **cfg)
    plan = hpf.ShardingPlan({"model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.gate_proj": "colwise",
                             "model.layers.*.mlp.down_proj": "rowwise"})
    hpf.shard(model, plan, mesh(), agree_timeout=3.0)


@pytest.mark.slow
def test_a_failing_rank_makes_the_others_fail_within_the_timeout():
    hang_pool = RankPool(2, pg_timeout=5.0)  # its own pool: a timed-out gloo group is not reusable
    try:
        for i, (case, args, original, other) in enumerate((
            (case_one_rank_fails_before_a_collective, (), "rank 1 fails on purpose", "rank 0"),
            (case_one_rank_fails_inside_shard, (make_llama_state(),), "not divisible by mesh axis 'tp'",
             "not every rank of the mesh reached the plan agreement"),
        )):
            if i:
                hang_pool.restart()  # fresh ranks for the next case (none after the last: it is closed)
            start = time.monotonic()
            with pytest.raises(RankFailure) as failure:
                hang_pool.run(case, *args, timeout=60)
            elapsed = time.monotonic() - start
            assert elapsed < 30, f"{case.__name__}: the other rank took {elapsed:.0f}s to fail"
            text = str(failure.value)
            assert original in text and "--- rank 0 ---" in text and other in text, text
    finally:
        hang_pool.close(graceful=False)


# ------------------------------------------------------------------ determinism
class DropoutMLP(nn.Module):
    """Dropout on the replicated input and output (identical to unsharded under TP) and on the
    sharded hidden features (reproducible, but not the unsharded model's masks)."""

    def __init__(self, hidden_dropout: float = 0.0):
        super().__init__()
        self.drop_in, self.drop_hidden, self.drop_out = nn.Dropout(0.3), nn.Dropout(hidden_dropout), nn.Dropout(0.3)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.drop_out(self.down(self.drop_hidden(F.gelu(self.up(self.drop_in(x))))))


def case_determinism(llama_state, mlp_state):
    m = mesh()
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(3))
    runs = []
    for _ in range(2):  # two runs, same seed: bit-identical loss and gradients (dropout on)
        model = build_llama(llama_state, attention_dropout=0.2)
        apply_fn, params, _ = hpf.shard(model, hpf.ShardingPlan.from_hf(model), m)
        torch.manual_seed(11)
        ids = torch.randint(0, 128, (2, 8))
        grads, loss = torch.func.grad_and_value(lambda p: apply_fn(p, input_ids=ids, labels=ids).loss)(params)
        runs.append((loss, grads))
    assert torch.equal(runs[0][0], runs[1][0]), "loss differs between two seeded runs"
    for k in runs[0][1]:
        assert torch.equal(runs[0][1][k], runs[1][1][k]), f"gradient of {k} differs between two seeded runs"

    # dropout in replicated regions: the same masks as the unsharded model
    model = DropoutMLP()
    model.load_state_dict(mlp_state)
    apply_fn, params, info = hpf.shard(model, {"up": hpf.Colwise(), "down": hpf.Rowwise()}, m)
    torch.manual_seed(5)
    ref = model(x)
    ref.square().sum().backward()
    torch.manual_seed(5)
    out = apply_fn(params, x)
    out.square().sum().backward()
    assert_close(out, ref.detach(), "output with replicated-region dropout")
    full = hpf.unshard({k: p.grad for k, p in params.items()}, info)
    for k, p in model.named_parameters():
        assert_close(full[k], p.grad, f"grad {k} with replicated-region dropout")

    # dropout inside sharded compute: reproducible with the same seed
    model = DropoutMLP(hidden_dropout=0.5)
    model.load_state_dict(mlp_state)
    apply_fn, params, _ = hpf.shard(model, {"up": hpf.Colwise(), "down": hpf.Rowwise()}, m)
    outs = []
    for _ in range(2):
        torch.manual_seed(9)
        outs.append(apply_fn(params, x))
    assert torch.equal(outs[0], outs[1]), "sharded-region dropout is not reproducible"


@pytest.mark.slow
def test_determinism_and_dropout_rule(pool):
    torch.manual_seed(0)
    pool.run(case_determinism, make_llama_state(), DropoutMLP().state_dict())


# ------------------------------------------------------------------ repeated use
def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def case_repeated_use(state):
    m = mesh()
    model = build_llama(state)
    before = snapshot(model)
    plans = [hpf.ShardingPlan.from_hf(model), hpf.llama_sp_plan()]
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(4))

    # many shard() calls with alternating plans: no growth in live tensors, nothing kept alive
    hpf.shard(model, plans[0], m)  # warm caches (mesh groups, HF lazy state)
    baseline = _live_tensors()
    refs = []
    for i in range(12):
        apply_fn, params, _ = hpf.shard(model, plans[i % 2], m)
        apply_fn(params, input_ids=ids, labels=ids).loss.backward()
        refs.append(weakref.ref(apply_fn))
        del apply_fn, params
    after = _live_tensors()
    assert after <= baseline, f"live tensors grew from {baseline} to {after} over 12 shard() calls"
    assert all(r() is None for r in refs), "an apply_fn stayed alive after it was dropped"
    assert_unchanged(before, snapshot(model))

    # one model sharded twice, both apply_fns used side by side against the reference
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    ref_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    sharded = [hpf.shard(model, p, m) for p in plans]
    for _ in range(2):
        for j, (apply_fn, params, info) in enumerate(sharded):
            grads, loss = torch.func.grad_and_value(lambda p: apply_fn(p, input_ids=ids, labels=ids).loss)(params)
            assert_close(loss, ref.loss.detach(), f"loss of plan {j}")
            for k, g in hpf.unshard(grads, info).items():
                assert_close(g, ref_grads[k], f"plan {j} grad {k}")
    assert_unchanged(before, snapshot(model))


@pytest.mark.parametrize("pool", [2], indirect=True, ids=["ws2"])  # what is kept alive per call: the same at any world size
@pytest.mark.slow
def test_repeated_shard_and_side_by_side_apply_fns(pool):
    pool.run(case_repeated_use, make_llama_state())


def case_nested_transforms_repeatedly(mlp_state):
    m = mesh()
    model = DropoutMLP()  # dropout off in eval: per-sample grads are deterministic
    model.load_state_dict(mlp_state)
    model.eval()
    apply_fn, params, info = hpf.shard(model, {"up": hpf.Colwise(), "down": hpf.Rowwise()}, m)
    x = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(6))
    ref_params = dict(model.named_parameters())

    def ref_loss(p, xi):
        return torch.func.functional_call(model, p, (xi,)).square().sum()

    expected = vmap(grad(ref_loss), in_dims=(None, 0))(ref_params, x)
    for i in range(3):
        per_sample = vmap(grad(lambda p, xi: apply_fn(p, xi).square().sum()), in_dims=(None, 0))(params, x)
        for b in range(x.shape[0]):
            full = hpf.unshard({k: v[b] for k, v in per_sample.items()}, info)
            for k in full:
                assert_close(full[k], expected[k][b], f"call {i} sample {b} grad {k}")


def test_apply_fn_nests_under_vmap_and_grad_repeatedly(pool):
    torch.manual_seed(0)
    pool.run(case_nested_transforms_repeatedly, DropoutMLP().state_dict())

