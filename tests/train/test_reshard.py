"""``hpf.reshard``: local shards moved in memory between the layouts ``shard()`` and ``fsdp()`` produce over
the same ranks — tp 4 ↔ dp 2 × tp 2, FSDP × TP → TP, TP → FSDP × TP (KV heads replicated at tp 4:
``GroupedShard``), Mixtral's experts at ep 2 × tp 2 (packed) → tp 4, per-module experts (``StackedShard``)
→ dp 2 × ep 2, uneven FSDP rows at world 2, a 1-D mesh over part of the world — each bitwise equal to
gathering and slicing again, the optimizer state with it; the moved params run the destination
``apply_fn`` to the unsharded loss; the collectives are counted (one agreement, one all-to-all per
bucket); bad input raises on every rank and nothing hangs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import hp_functional as hpf
from hp_functional.core.exchange import exchange_over
from hp_functional.core.placement import ShardInfo, is_grouped, slice_local
from hp_functional.train.optim import AdamWState, state_info
from hp_functional.train.reshard import reshard
from tests.conftest import get_pool
from tests.support.helpers import assert_close, mesh, raised, rank
from tests.support.models import MLP, PLANS, build_llama, make_llama_state


class CountCollectives(TorchDispatchMode):
    """Counts every collective issued (torch's ``c10d`` and ``_c10d_functional`` ops) by kind."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            self.ops.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def counted(*args, **kwargs):
    """``reshard(*args, **kwargs)`` and the collectives it issued."""
    with CountCollectives() as c:
        out = reshard(*args, **kwargs)
    return out, c.ops


def expected(params, src_info, dst_info) -> dict:
    """What gathering and slicing again gives: the reference every move is compared with."""
    full = hpf.unshard(params, src_info)
    return {k: slice_local(full[k], dst_info[k]) for k in params}


def assert_bitwise(got: dict, want: dict, what: str) -> None:
    assert list(got) == list(want), f"{what}: keys {list(got)[:3]} vs {list(want)[:3]}"
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), f"{what}: {k}"


def loss_of(apply_fn, params, ids) -> torch.Tensor:
    return apply_fn(params, input_ids=ids, labels=ids).loss.detach()


# ---------------------------------------------------------------- a tiny Llama at world 4
def case_llama(state):
    model = build_llama(state, num_key_value_heads=2)
    plan = hpf.ShardingPlan.from_hf(model)
    m22 = mesh((2, 2), ("dp", "tp"))
    tp4 = hpf.shard(model, plan, mesh((4,), ("tp",)), verify=False)
    tp2 = hpf.shard(model, plan, m22, verify=False)  # tp 2, replicated over dp
    fsdp = hpf.fsdp(*tp2, m22, "dp")
    assert any(is_grouped(p) for info in tp4[2].values() for p in info.placements), "tp 4 over 2 KV heads: grouped"
    layouts = {"tp4": tp4, "dp2xtp2": tp2, "fsdp": fsdp}
    counts = {}
    for src, dst in [("tp4", "dp2xtp2"), ("dp2xtp2", "tp4"), ("fsdp", "dp2xtp2"), ("fsdp", "tp4"),
                     ("dp2xtp2", "fsdp"), ("tp4", "fsdp")]:
        _, params, info = layouts[src]
        got, ops = counted(params, info, layouts[dst][2])
        assert_bitwise(got, expected(params, info, layouts[dst][2]), f"{src} -> {dst}")
        counts[f"{src} -> {dst}"] = ops
    # new tensors, inputs untouched, requires_grad kept
    _, params, info = fsdp
    before = {k: v.clone() for k, v in params.items()}
    moved = reshard(params, info, tp4[2])
    assert all(torch.equal(params[k], before[k]) for k in params), "reshard changed its input"
    assert all(moved[k].requires_grad == params[k].requires_grad for k in params)
    assert all(moved[k].untyped_storage().data_ptr() != params[k].untyped_storage().data_ptr() for k in params)
    # the FSDP x TP training layout moved to the TP sampling layout runs the unsharded model's loss
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    assert_close(loss_of(tp4[0], moved, ids), model(input_ids=ids, labels=ids).loss.detach(), "tp 4 loss after reshard")
    return counts, _mixed_buckets(tp4, tp2), _optimizer_state(model, fsdp, tp4, ids)


def _mixed_buckets(tp4, tp2):
    """Leaves of several dtypes in one bucket, bitwise; one all-to-all per bucket, counted."""
    _, params, info = tp4
    kinds = (torch.float32, torch.bfloat16, torch.int64)
    mixed = {k: (v * 1000).to(kinds[i % 3]) for i, (k, v) in enumerate(params.items())}
    want = expected(mixed, info, tp2[2])
    one, ops_one = counted(mixed, info, tp2[2])
    each, ops_each = counted(mixed, info, tp2[2], bucket_bytes=1)  # every moving leaf alone
    assert_bitwise(one, want, "mixed dtypes, one bucket")
    assert_bitwise(each, want, "mixed dtypes, a bucket per leaf")
    moving = sum(i.is_sharded for i in info.values())  # tp 4 -> tp 2: every sharded leaf, no replicated one
    return ops_one, ops_each, moving


def _optimizer_state(model, fsdp, tp4, ids):
    """AdamW's state after one step at FSDP x TP, moved to tp 4: moments bitwise, the step replicated."""
    apply_fn, params, info = fsdp
    opt = hpf.optim.adamw(1e-3)
    grads = torch.func.grad(lambda p: apply_fn(p, input_ids=ids, labels=ids).loss)(params)
    with torch.no_grad():
        _, state = opt.update(grads, opt.init(params), params)
    moved = reshard(state, info, tp4[2])
    assert isinstance(moved, AdamWState) and moved.step.dtype == torch.int64 and int(moved.step) == 1
    assert_bitwise(moved.mu, expected(state.mu, info, tp4[2]), "AdamW mu")
    assert_bitwise(moved.nu, expected(state.nu, info, tp4[2]), "AdamW nu")
    again = reshard(state, state_info(state, info), state_info(moved, tp4[2]))  # the pytree-of-ShardInfo form
    assert int(again.step) == 1 and all(torch.equal(again.nu[k], moved.nu[k]) for k in moved.nu)
    return len(moved.mu)


@pytest.mark.slow
def test_llama_layouts_bitwise_and_counted():
    counts, (ops_one, ops_each, moving), moments = get_pool(4).run(case_llama, make_llama_state(num_key_value_heads=2))[0]
    for move, ops in counts.items():
        # every move: the agreement and one all-to-all (the whole tiny model is one bucket), except
        # TP -> FSDP x TP over the same TP, where every rank already holds its rows: the agreement alone
        want = ["_allgather_base_"] if move == "dp2xtp2 -> fsdp" else ["_allgather_base_", "alltoall_base_"]
        assert ops == want, (move, ops)
    assert ops_one == ["_allgather_base_", "alltoall_base_"]
    assert ops_each == ["_allgather_base_"] + ["alltoall_base_"] * moving and moving > 10
    assert moments > 10


# ---------------------------------------------------------------- experts
def moe_config():
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "mixtral", vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
        num_local_experts=4, num_experts_per_tok=2)
    config._attn_implementation = "eager"
    return config


def moe_state():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(moe_config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name:
                p.normal_(0, 0.1)
    return model.state_dict()


def case_mixtral(state):
    """Mixtral's fused experts at ep 2 x tp 2 (gate/up packed) -> tp 4, bitwise, and the loss there."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(moe_config())
    model.load_state_dict(state)
    _, params, info = hpf.shard(model, hpf.ShardingPlan.from_hf(model, ep_axis="ep"), mesh((2, 2), ("ep", "tp")),
                                verify=False)
    assert any(i.blocks for i in info.values()), "packed gate/up under tp"
    dst_fn, _, dst = hpf.shard(model, hpf.ShardingPlan.from_hf(model), mesh((4,), ("tp",)), verify=False)
    moved = reshard(params, info, dst)
    assert_bitwise(moved, expected(params, info, dst), "ep 2 x tp 2 -> tp 4")
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    assert_close(loss_of(dst_fn, moved, ids), model(input_ids=ids, labels=ids).loss.detach(), "tp 4 loss")


class SwiGLU(nn.Module):
    def __init__(self, hidden: int = 8, inter: int = 16):
        super().__init__()
        self.gate, self.up = nn.Linear(hidden, inter, bias=False), nn.Linear(hidden, inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class ListExperts(nn.ModuleList):
    """One MLP per expert, the container taking HF's routing (``hpf.Experts`` stacks them: ``StackedShard``)."""

    def __init__(self, experts: int = 4):
        super().__init__(SwiGLU() for _ in range(experts))
        self.num_experts = experts

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            out.index_add_(0, token, self[e](hidden[token]) * top_k_weights[token, slot, None])
        return out


def case_stacked(state):
    """Per-module experts, each held whole by one rank (the others empty): ep 4 <-> dp 2 x ep 2."""
    module = ListExperts()
    module.load_state_dict(state)
    plan = hpf.ShardingPlan({"": hpf.Experts()}, axes={"ep": "ep"})
    _, p4, ep4 = hpf.shard(module, plan, mesh((4,), ("ep",)), verify=False)
    _, p22, ep22 = hpf.shard(module, plan, mesh((2, 2), ("dp", "ep")), verify=False)
    assert_bitwise(reshard(p4, ep4, ep22), p22, "ep 4 -> dp 2 x ep 2")
    assert_bitwise(reshard(p22, ep22, ep4), p4, "dp 2 x ep 2 -> ep 4")


@pytest.mark.slow
def test_expert_layouts():
    pool = get_pool(4)
    pool.run(case_mixtral, moe_state())
    torch.manual_seed(0)
    pool.run(case_stacked, ListExperts().state_dict())


# ---------------------------------------------------------------- world 2, part of the world
def case_uneven(state):
    """tp 2 <-> FSDP over dp 2 whose 15-row leaves split 8 + 7, at world 2."""
    model = MLP(15, 30)
    model.load_state_dict(state)
    _, params, info = hpf.shard(model, PLANS["tp"], mesh((2,), ("tp",)), verify=False)
    m = mesh((2, 1), ("dp", "tp"))
    _, f_params, f_info = hpf.fsdp(*hpf.shard(model, PLANS["tp"], m, verify=False), m, "dp")
    assert (8 if rank() == 0 else 7) in {v.shape[0] for v in f_params.values()}, "15 rows split 8 + 7"
    assert_bitwise(reshard(params, info, f_info), f_params, "tp 2 -> fsdp")
    assert_bitwise(reshard(f_params, f_info, info), params, "fsdp -> tp 2")


def test_uneven_rows_at_world_2():
    torch.manual_seed(0)
    get_pool(2).run(case_uneven, MLP(15, 30).state_dict())


def case_flattened(state):
    """FSDP over dp and cp flattened (15 rows over 4 ranks: 4, 4, 4, 3) <-> tp 4 and -> whole; FSDP x TP
    -> whole, where the rows a rank gathers come from ranks 0, 2, 1, 3 in order (FSDP inside TP)."""
    model = MLP(15, 28)
    model.load_state_dict(state)
    m, m22 = mesh((2, 2), ("dp", "cp")), mesh((2, 2), ("dp", "tp"))
    layouts = {"tp4": hpf.shard(model, PLANS["tp"], mesh((4,), ("tp",)), verify=False)[1:],
               "whole": hpf.shard(model, {}, m, verify=False)[1:],
               "flat": hpf.fsdp(*hpf.shard(model, {}, m, verify=False), m, ("dp", "cp"))[1:],
               "fsdp x tp": hpf.fsdp(*hpf.shard(model, PLANS["tp"], m22, verify=False), m22, "dp")[1:]}
    assert layouts["flat"][1]["norm.weight"].local_shape[0] == (3 if rank() == 3 else 4)
    for src, dst in (("flat", "tp4"), ("tp4", "flat"), ("flat", "whole"), ("fsdp x tp", "whole"), ("whole", "fsdp x tp"),
                     ("fsdp x tp", "tp4")):
        assert_bitwise(reshard(*layouts[src], layouts[dst][1]), layouts[dst][0], f"{src} -> {dst}")


def case_part_of_world(state):
    """A 1-D mesh over 2 of the 4 ranks (each dp row its own): tp 2 -> whole on both, over that
    mesh's group; a 2-D mesh over part of the world is refused (no group to exchange over)."""
    model = MLP()
    model.load_state_dict(state)
    sub = mesh((2, 2), ("dp", "tp"))["tp"]
    _, params, info = hpf.shard(model, PLANS["tp"], sub, verify=False)
    whole = {k: ShardInfo((Replicate(),), sub, i.global_shape, i.global_shape, (0,) * len(i.global_shape))
             for k, i in info.items()}
    got, ops = counted(params, info, whole)
    assert_bitwise(got, {k: v.detach() for k, v in model.state_dict().items()}, "tp 2 -> whole")
    stub = type("Mesh", (), {"mesh": torch.tensor([[0, 1]]), "device_type": "cpu", "ndim": 2})()
    return ops, raised(exchange_over, [stub], "reshard")


def test_flattened_fsdp_and_part_of_the_world():
    torch.manual_seed(0)
    get_pool(4).run(case_flattened, MLP(15, 28).state_dict())
    results = get_pool(4).run(case_part_of_world, MLP().state_dict())
    for r, (ops, err) in enumerate(results):
        assert ops == ["_allgather_base_", "alltoall_base_"], ops
        assert err[0] == "PlanError" and ("none is 1-D" if r < 2 else "not in the meshes") in err[1], err


# ---------------------------------------------------------------- bad input
def case_bad():
    torch.manual_seed(0)  # the same weights on every rank
    model = MLP()
    _, params, tp4 = hpf.shard(model, PLANS["tp"], mesh((4,), ("tp",)), verify=False)
    _, p22, tp2 = hpf.shard(model, PLANS["tp"], mesh((2, 2), ("dp", "tp")), verify=False)
    _, _, other = hpf.shard(nn.Sequential(nn.Linear(16, 32)), {"0": hpf.Colwise()}, mesh((4,), ("tp",)), verify=False)
    sub = mesh((2, 2), ("dp", "tp"))["tp"]
    wider = dataclasses.replace(tp2["up.weight"], global_shape=torch.Size((64, 16)))
    errors = {}
    bad = {
        "another model": (params, tp4, other),
        "global shape": (params, tp4, {**tp2, "up.weight": wider}),
        "world size": (params, tp4, {k: dataclasses.replace(i, mesh=sub) for k, i in tp2.items()}),
        "bucket_bytes": (params, tp4, tp2, 0),
    }
    for what, (p, s, d, *b) in bad.items():
        with CountCollectives() as c:
            errors[what] = raised(reshard, p, s, d, **({"bucket_bytes": b[0]} if b else {}))
        assert not c.ops, f"{what}: collectives before the error: {c.ops}"
    # after the agreement (one all-gather, no all-to-all): local shapes from another layout, on every
    # rank or on rank 1 alone, and ranks called differently
    wrong = {**params, "up.weight": params["up.weight"][:1]} if rank() == 1 else params
    for what, args, kw in (("local shapes", (p22, tp4, tp2), {}), ("one rank's shape", (wrong, tp4, tp2), {}),
                           ("disagree", (params, tp4, tp2), {"bucket_bytes": 1 if rank() == 0 else 2})):
        with CountCollectives() as c:
            errors[what] = raised(reshard, *args, **kw)
        assert c.ops == ["_allgather_base_"], (what, c.ops)
    ok = torch.ones(1)
    dist.all_reduce(ok)  # the group is still usable
    assert int(ok) == 4
    assert_bitwise(reshard(params, tp4, tp2), p22, "a good call after the bad ones")
    return errors, _bucket_bound(params, tp4, tp2)


def _bucket_bound(params, tp4, tp2):
    """The all-to-alls that bucket_bytes allows, at its edge.  tp 4 -> dp 2 x tp 2 moves (in key order)
    down.weight, up.bias, up.weight: a fp32 quarter (512 bytes, 32 for up.bias) from each of ranks 1 and
    2 to two ranks, so ranks 1 and 2 send 1024 (64) bytes and receive as much, ranks 0 and 3 half."""
    counts = {}
    for cap in (1088, 1087, 1024):
        got, ops = counted(params, tp4, tp2, bucket_bytes=cap)
        assert_bitwise(got, expected(params, tp4, tp2), f"bucket_bytes={cap}")
        counts[cap] = ops.count("alltoall_base_")
    return counts


def test_bad_input_raises_on_every_rank():
    expect = {
        "another model": ("PlanError", "different keys (another model's shard_info?)"),
        "global shape": ("ShapeError", "up.weight has global shape (32, 16) in src_info but (64, 16) in dst_info"),
        "world size": ("PlanError", "the meshes are over different ranks"),
        "bucket_bytes": ("PlanError", "bucket_bytes must be a positive int"),
        "local shapes": ("ShapeError", "does not have the local shape src_info gives it there"),
        "one rank's shape": ("ShapeError", "up.weight on ranks [1]"),
        "disagree": ("PlanMismatchError", "were called with other keys, dtypes, layouts or bucket_bytes"),
    }
    for errors, buckets in get_pool(4).run(case_bad):
        # [down.weight, up.bias] fill 1088 bytes exactly, up.weight alone; one byte less: each alone
        assert buckets == {1088: 2, 1087: 3, 1024: 3}, buckets
        for what, (kind, text) in expect.items():
            assert errors[what] is not None and errors[what][0] == kind and text in errors[what][1], (what, errors[what])
