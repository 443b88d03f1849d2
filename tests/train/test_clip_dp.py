"""Global-norm gradient clipping and bucketed data parallel vs the unsharded model (and torch's clip_grad_norm_)."""

import math
from dataclasses import replace

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import TorchDispatchMode

import hp_functional as hpf
from hp_functional.core.placement import ShardInfo
from hp_functional.train.data_parallel import plan_buckets
from tests.support.helpers import assert_close, mesh, world
from tests.support.models import build_llama, make_llama_state

INF = math.inf


class CountCollectives(TorchDispatchMode):
    """Counts the collectives issued (every ``_c10d_functional`` op but the waits)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and "wait_tensor" not in str(func):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


AGREEMENT = ["_c10d_functional.all_gather_into_tensor.default"]


def raises_before_collectives(exc, match: str, fn, *args, agreed: bool = False, **kwargs) -> None:
    """``fn`` raises before any collective; ``agreed``: a check about the gradients, which may differ
    per rank, raised after the one small agreement all-gather (so a rank that catches it stays in step)."""
    with CountCollectives() as c, pytest.raises(exc, match=match):
        fn(*args, **kwargs)
    assert c.ops == (AGREEMENT if agreed else []), f"collectives before the error: {c.ops}"


def ref_clip(model, ref_grads, max_norm, norm_type):
    """torch.nn.utils.clip_grad_norm_ on the unsharded model: (total norm, clipped grads by FQN)."""
    for k, p in model.named_parameters():
        p.grad = ref_grads[k].clone()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    return total, {k: p.grad for k, p in model.named_parameters()}


def check_clip(model, grads, info, ref_grads, norm_type):
    """Clip to half the global norm: total norm and every gathered clipped grad equal torch's, one
    all-reduce, ``grads`` untouched."""
    max_norm = 0.5 * torch.nn.utils.get_total_norm(list(ref_grads.values()), norm_type).item()
    ref_total, ref_clipped = ref_clip(model, ref_grads, max_norm, norm_type)
    before = {k: g.clone() for k, g in grads.items()}
    with CountCollectives() as c:
        clipped, total = hpf.clip_grad_norm(grads, info, max_norm, norm_type)
    assert len(c.ops) == 1, c.ops
    assert_close(total, ref_total, f"total norm ({norm_type})")
    assert list(clipped) == list(grads)
    full = hpf.unshard(clipped, info)
    for k in ref_clipped:
        assert_close(full[k], ref_clipped[k], f"clipped grad {k} ({norm_type})")
        torch.testing.assert_close(grads[k], before[k], atol=0, rtol=0, msg=f"clip_grad_norm modified grads[{k}]")


def case_clip_tp_tied(state, cfg):
    m = mesh((world(),), ("tp",))
    model = build_llama(state, **cfg)
    apply_fn, params, info = hpf.shard(model, hpf.ShardingPlan.from_hf(model), m)
    assert "lm_head.weight" not in info  # tied: one leaf
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(3))
    grads = torch.func.grad(lambda p: apply_fn(p, input_ids=ids, labels=ids).loss)(params)
    model(input_ids=ids, labels=ids).loss.backward()
    ref_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    for norm_type in (2.0, INF):
        check_clip(model, grads, info, ref_grads, norm_type)

    # None is skipped (torch skips parameters without .grad)
    skip = "model.norm.weight"
    out, total = hpf.clip_grad_norm({**grads, skip: None}, info, 1e9)
    assert out[skip] is None
    ref = torch.nn.utils.get_total_norm([g for k, g in ref_grads.items() if k != skip])
    assert_close(total, ref, "norm without the skipped leaf")
    # errors, before any collective
    raises_before_collectives(hpf.PlanError, "missing from grads.*model.norm.weight",
                              hpf.clip_grad_norm, {k: g for k, g in grads.items() if k != skip}, info, 1.0, agreed=True)
    other = mesh((world(),), ("dp",))
    mixed = {**info, skip: replace(info[skip], mesh=other)}
    raises_before_collectives(hpf.PlanError, "one mesh.*model.norm.weight", hpf.clip_grad_norm, grads, mixed, 1.0,
                              agreed=True)
    with pytest.raises(RuntimeError, match="non-finite"):
        hpf.clip_grad_norm({**grads, skip: torch.full_like(grads[skip], INF)}, info, 1.0, error_if_nonfinite=True)


def test_clip_tp_tied_matches_torch(pool):
    cfg = {"tie_word_embeddings": True}
    pool.run(case_clip_tp_tied, make_llama_state(**cfg), cfg)


def case_dp_tp(state):
    """Each dp rank takes its slice of the global batch; the dp-mean of the gradients is the full-batch
    gradient, in one collective per bucket; clipping it matches torch on the full batch."""
    n = world()
    m = mesh((n // 2, 2), ("dp", "tp")) if n >= 4 else mesh((n,), ("dp",))
    model = build_llama(state)
    plan = hpf.ShardingPlan.from_hf(model) if "tp" in m.mesh_dim_names else hpf.ShardingPlan({})
    apply_fn, params, info = hpf.shard(model, plan, m)
    dp = m["dp"]
    ids = torch.randint(0, 128, (2 * dp.size(), 8), generator=torch.Generator().manual_seed(5))
    local_ids = ids.chunk(dp.size())[dp.get_local_rank()]
    grads = torch.func.grad(lambda p: apply_fn(p, input_ids=local_ids, labels=local_ids).loss)(params)
    model(input_ids=ids, labels=ids).loss.backward()
    ref_grads = {k: p.grad.clone() for k, p in model.named_parameters()}

    total_bytes = sum(g.numel() * g.element_size() for g in grads.values())
    bucket_bytes = total_bytes // 4
    before = {k: g.clone() for k, g in grads.items()}
    with CountCollectives() as c:
        reduced = hpf.reduce_gradients(grads, info, m, "dp", "mean", bucket_bytes=bucket_bytes)
    buckets = plan_buckets(grads, bucket_bytes)
    assert c.ops[:1] == AGREEMENT and len(c.ops) == 1 + len(buckets), (c.ops, buckets)  # the structure check, then buckets
    assert 4 <= len(buckets) <= len(grads) // 2, (len(buckets), len(grads))  # >= ceil(total / bucket), not one per leaf
    assert sorted(k for b in buckets for k in b) == sorted(grads)
    assert list(reduced) == list(grads)
    for k in grads:
        torch.testing.assert_close(grads[k], before[k], atol=0, rtol=0, msg=f"reduce_gradients modified grads[{k}]")
    full = hpf.unshard(reduced, info)
    for k in ref_grads:
        assert_close(full[k], ref_grads[k], f"dp-mean grad {k}")

    # sum, default buckets (one), None skipped
    skip = "model.norm.weight"
    with CountCollectives() as c:
        summed = hpf.reduce_gradients({**grads, skip: None}, info, m, op="sum")
    assert len(c.ops) == 2 and summed[skip] is None
    k = "model.layers.0.mlp.down_proj.weight"
    assert_close(summed[k], reduced[k] * dp.size(), "sum = dp * mean")

    # clip the reduced gradients: the full-batch global norm
    for norm_type in (2.0, INF):
        check_clip(model, reduced, info, ref_grads, norm_type)

    # errors, before any collective
    raises_before_collectives(hpf.PlanError, r"axis 'pp' is not in the mesh \(axes: \['dp'", hpf.reduce_gradients,
                              grads, info, m, "pp")
    raises_before_collectives(ValueError, "op must be one of.*'max'", hpf.reduce_gradients, grads, info, m, op="max")
    raises_before_collectives(hpf.PlanError, "missing from grads", hpf.reduce_gradients,
                              {k: g for k, g in grads.items() if k != skip}, info, m, agreed=True)
    i = info[skip]
    fsdp_info = {**info, skip: replace(i, placements=(Shard(0), *i.placements[1:]))}
    raises_before_collectives(hpf.PlanError, r"params\['model.norm.weight'\] is sharded on 'dp' \(FSDP\)",
                              hpf.reduce_gradients, grads, fsdp_info, m, agreed=True)


def test_reduce_gradients_dp_tp_then_clip(pool):
    pool.run(case_dp_tp, make_llama_state())


def chunk_of(full: torch.Tensor, n: int, r: int) -> tuple[torch.Tensor, int]:
    """Rank r's rows of ``full`` under torch.chunk (uneven: later ranks may hold fewer, or none) and their offset."""
    size = -(-full.shape[0] // n)
    start = min(r * size, full.shape[0])
    return full[start : start + size], start


def check_uneven(m, leaves, fulls):
    """``leaves``: name -> (placements, local piece); their global norm and clipped pieces equal torch's
    on the ``fulls``."""
    info = {k: ShardInfo(pl, m, fulls[k].shape, loc.shape, (0,) * loc.dim()) for k, (pl, loc) in leaves.items()}
    grads = {k: loc for k, (_, loc) in leaves.items()}
    for norm_type in (2.0, INF, 3.0):
        params = {k: torch.nn.Parameter(torch.zeros_like(f)) for k, f in fulls.items()}
        for k, p in params.items():
            p.grad = fulls[k].clone()
        max_norm = 0.5 * torch.nn.utils.get_total_norm(list(fulls.values()), norm_type).item()
        ref = torch.nn.utils.clip_grad_norm_(params.values(), max_norm, norm_type)
        with CountCollectives() as c:
            clipped, total = hpf.clip_grad_norm({**grads, "frozen": None}, {**info, "frozen": next(iter(info.values()))},
                                                max_norm, norm_type)
        assert len(c.ops) == 1, c.ops
        assert_close(total, ref, f"norm {norm_type} of uneven shards")
        coef = max_norm / (ref + 1e-6)
        for k, g in grads.items():
            assert_close(clipped[k], g * coef, f"clipped {k}")
        assert clipped["frozen"] is None


def case_uneven_shards():
    """FSDP-like leaves: Shard(0) / _StridedShard(0) on dp with torch.chunk's uneven rows (zero on the last rank)."""
    n = world()
    g = torch.Generator().manual_seed(11)
    fulls = {"a": torch.randn(n - 1, 3, generator=g), "b": torch.randn(2 * n + 1, 4, generator=g),
             "c": torch.randn(5, generator=g)}
    m = mesh((n,), ("dp",))
    r = m.get_local_rank()
    a, _ = chunk_of(fulls["a"], n, r)
    assert r < n - 1 or a.shape[0] == 0, "the last rank holds no rows of a"
    b = torch.cat([chunk_of(half, n, r)[0] for half in fulls["b"].chunk(2)])  # interleaved: split_factor=2
    check_uneven(m, {"a": ((Shard(0),), a), "b": ((_StridedShard(0, split_factor=2),), b), "c": ((Replicate(),), fulls["c"])},
                 fulls)
    if n >= 4:  # 2-D: Shard on dp, replicated on tp (counted once); then a sub-mesh that does not span the world
        m2 = mesh((n // 2, 2), ("dp", "tp"))
        dr, tr = m2["dp"].get_local_rank(), m2["tp"].get_local_rank()
        e, _ = chunk_of(fulls["b"], n // 2, dr)
        f, _ = chunk_of(fulls["a"][:1], 2, tr)
        check_uneven(m2, {"e": ((Shard(0), Replicate()), e), "f": ((Replicate(), Shard(0)), f),
                          "c": ((Replicate(), Replicate()), fulls["c"])}, {"e": fulls["b"], "f": fulls["a"][:1], "c": fulls["c"]})
        sub = m2["tp"]
        check_uneven(sub, {"a": ((Shard(0),), chunk_of(fulls["b"], 2, tr)[0])}, {"a": fulls["b"]})


def test_clip_uneven_fsdp_shards(pool):
    pool.run(case_uneven_shards)
