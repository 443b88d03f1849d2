"""``core.buckets``: the one grouping rule (``plan_buckets``: by key, greedily in order, up to a
byte cap) and ``copy_to_many`` — identity forward, and a backward that sums each bucket's
gradients over the ranks with one all-reduce per bucket and axis, equal to per-tensor ``copy_to``."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hp_functional.core import collectives as C
from hp_functional.core.buckets import copy_to_many, plan_buckets
from tests.conftest import get_pool
from tests.support.helpers import assert_close, mesh, rank, world


def test_plan_buckets_groups_by_key_fills_greedily_and_isolates_large_items():
    items = [("a", "f32", 40), ("b", "f32", 40), ("x", "bf16", 10), ("c", "f32", 40), ("big", "f32", 500),
             ("d", "f32", 10), ("y", "bf16", 10)]
    assert plan_buckets(items, bucket_bytes=100) == [["a", "b"], ["c"], ["big"], ["d"], ["x", "y"]]
    assert plan_buckets(items) == [["a", "b", "c", "big", "d"], ["x", "y"]]  # the default cap: one per key
    assert plan_buckets([], bucket_bytes=1) == []
    assert plan_buckets([("a", 0, 5), ("b", 0, 5)], bucket_bytes=10) == [["a", "b"]]  # exactly full still fits
    assert plan_buckets([("a", 0, 5), ("b", 0, 6)], bucket_bytes=10) == [["a"], ["b"]]


class CountAllReduces(TorchDispatchMode):
    """Counts the all-reduces issued (``_c10d_functional.all_reduce``)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and "all_reduce" in str(func):
            self.count += 1
        return func(*args, **(kwargs or {}))


def case_copy_to_many():
    g = C.AxisGroup.from_mesh(mesh(), "tp")
    torch.manual_seed(0)  # the same tensors on every rank (replicated)
    shapes = [(3, 4), (5,), (2, 2, 2), (7,), (1,)]
    dtypes = [torch.float32, torch.float32, torch.float64, torch.float32, torch.float64]
    leaves = [torch.randn(s, dtype=d, requires_grad=True) for s, d in zip(shapes, dtypes, strict=True)]
    items = [(i, t.dtype, t.numel() * t.element_size()) for i, t in enumerate(leaves)]
    buckets = plan_buckets(items, bucket_bytes=64)  # several buckets per dtype
    out = copy_to_many(leaves, buckets, [g])
    for o, t in zip(out, leaves, strict=True):
        assert torch.equal(o, t), "the forward is the identity"
    # rank-varying use of the replicated tensors: each rank weighs them by its own factor
    weights = [torch.randn(t.shape, dtype=t.dtype, generator=torch.Generator().manual_seed(100 + rank())) for t in leaves]
    loss = sum(((o * w).sum() for o, w in zip(out, weights, strict=True)), torch.zeros((), dtype=torch.float64))
    with CountAllReduces() as counter:
        grads = torch.autograd.grad(loss, leaves)
    # the reference: copy_to per tensor (its backward sums over the ranks), i.e. the sum of every rank's weights
    for i, (gr, t) in enumerate(zip(grads, leaves, strict=True)):
        every = [torch.randn(t.shape, dtype=t.dtype, generator=torch.Generator().manual_seed(100 + r)) for r in range(world())]
        assert_close(gr, sum(every), f"gradient of tensor {i}")
        one = torch.autograd.grad((C.copy_to(t, g) * weights[i]).sum(), t)[0]
        assert_close(gr, one, f"gradient of tensor {i} against copy_to")
    return len(buckets), counter.count, [sorted({leaves[i].dtype for i in b}, key=str) for b in buckets]


@pytest.mark.parametrize("ws", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_copy_to_many_one_all_reduce_per_bucket(ws):
    n_buckets, n_reduces, dtypes = get_pool(ws).run(case_copy_to_many)[0]
    assert n_buckets >= 3
    assert n_reduces == n_buckets, f"{n_reduces} all-reduces for {n_buckets} buckets"
    assert all(len(d) == 1 for d in dtypes), "a bucket mixes dtypes"
