"""``core.gather``: ``unshard`` and ``iter_full`` put every layout back together — Shard on any dim,
Replicate, packed blocks, KV-head replicas (``GroupedShard``), stacked experts
(``StackedShard``), 2-D meshes and ``hpf.fsdp``'s row splits (uneven chunks) — equal to the global tensors on every
rank; and a checkpoint whose leaves cannot be gathered is refused by name."""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import hp_functional as hpf
from hp_functional.core.errors import PlanError, ShapeError
from hp_functional.core.gather import check_gatherable, iter_full, plan_buckets, unshard
from hp_functional.core.placement import GroupedShard, ShardInfo, StackedShard, local_layout, slice_local
from tests.conftest import get_pool
from tests.support.helpers import assert_close, mesh, rank, world
from tests.support.models import MLP, PLANS


def _info(full, placements, m, blocks=None):
    shape, offset = local_layout(full.shape, placements, m, "test")
    if blocks is not None:  # packed: the rank's slice of every block, concatenated
        n, r = m.size(0), m.get_coordinate()[0]
        shape = torch.Size([sum(b // n for b in blocks), *full.shape[1:]])
        offset = (r * blocks[0] // n, *offset[1:])
    return ShardInfo(tuple(placements), m, full.shape, shape, offset, blocks=blocks)


def case_layouts():
    n, r = world(), rank()
    m = mesh()
    torch.manual_seed(0)
    full = {
        "rows": torch.randn(4 * n, 3),
        "cols": torch.randn(3, 2 * n),
        "replicated": torch.randn(5),
        "packed": torch.randn(4 * n, 3),
        "replicas": torch.randn(n, 3),  # n // 2 chunks, each held by 2 ranks
        **{f"expert.{i}": torch.randn(3, 2) for i in range(n)},
    }
    infos = {
        "rows": _info(full["rows"], [Shard(0)], m),
        "cols": _info(full["cols"], [Shard(1)], m),
        "replicated": _info(full["replicated"], [Replicate()], m),
        "packed": _info(full["packed"], [Shard(0)], m, blocks=(2 * n, 2 * n)),
        "replicas": _info(full["replicas"], [GroupedShard(0, 2)], m),
        **{f"expert.{i}": _info(full[f"expert.{i}"], [StackedShard(i, n)], m) for i in range(n)},
    }
    local = {k: slice_local(full[k], infos[k]) for k in full}
    assert local["expert.0"].shape[0] == (3 if r == 0 else 0)  # the owner holds the expert whole
    assert torch.equal(local["packed"], torch.cat([full["packed"][: 2 * n].chunk(n)[r], full["packed"][2 * n:].chunk(n)[r]]))
    got = unshard(local, infos)
    for k in full:
        assert_close(got[k], full[k], k, atol=0, rtol=0)
    streamed = {}
    buckets = plan_buckets(local, infos, 64)  # a small cap: several buckets
    for part in iter_full(local, infos, buckets):
        streamed.update(part)
    assert streamed.keys() == full.keys()
    for k in full:
        assert torch.equal(streamed[k], full[k]), k
    return len(buckets)


@pytest.mark.parametrize("ws", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_unshard_every_placement_kind(ws):
    assert all(b > 1 for b in get_pool(ws).run(case_layouts))


def case_two_dims_and_fsdp():
    n = world()
    m = mesh((2, n // 2), ("dp", "tp"))
    torch.manual_seed(1)
    full = torch.randn(6, 2 * n)
    info = _info(full, [Shard(0), Shard(1)], m)
    assert_close(unshard({"w": slice_local(full, info)}, {"w": info})["w"], full, "dp x tp", atol=0, rtol=0)
    model = MLP(d=5, h=8)  # 5 rows chunked over dp 2: 3 and 2 (torch.chunk's uneven sizes)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    apply_fn, params, sinfo = hpf.shard(model, hpf.ShardingPlan(PLANS["tp"]), m)
    _, fparams, finfo = hpf.fsdp(apply_fn, params, sinfo, m, "dp")
    assert any(i.facet(hpf.RowSplit) for i in finfo.values())
    got = unshard(fparams, finfo)
    for k, v in state.items():
        assert_close(got[k], v, f"fsdp {k}", atol=0, rtol=0)


@pytest.mark.slow
def test_unshard_two_dim_mesh_and_fsdp_row_splits():
    get_pool(4).run(case_two_dims_and_fsdp)


def test_check_gatherable_names_the_leaf_it_cannot_gather():
    full = torch.zeros(4)

    def run(m):
        info = ShardInfo((Shard(0),), m, full.shape, torch.Size([2]), (0,))
        check_gatherable({"a": full[:2]}, {"a": info}, "export")
        with pytest.raises(PlanError, match=r"export: no shard_info for \['b'\]"):
            check_gatherable({"a": full[:2], "b": full}, {"a": info}, "export")
        with pytest.raises(ShapeError, match=r"export: a has local shape \(4,\).*expects \(2,\)"):
            check_gatherable({"a": full}, {"a": info}, "export")
        return True

    assert hpf.simulate(run, world_size=2)
