"""The bad-input matrix: each row raises a clear error of a tested type and message, on every
rank, before any collective (no rank hangs), with the model untouched."""

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import hp_functional as hpf
from tests.support.helpers import mesh, raised, world
from tests.support.models import MLP, PLANS, build_llama, make_llama_state
from tests.support.snapshot import assert_unchanged, snapshot


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(8, 16)
        self.odd_emb = nn.Embedding(7, 16)
        self.proj = nn.Linear(16, 7)  # 7 divides by neither 2 nor 4
        self.back = nn.Linear(7, 16)
        self.fused = nn.Linear(16, 12)  # four packed blocks of 3: 3 splits neither 2 nor 4 ways
        self.num_heads = 3


# row → (plan, exception type, message needle, culprit named)
PLAN_ROWS = {
    "no_match": ({"model.layers.*.self_atn.q_proj": "colwise"}, hpf.PlanError, "matches no module", "self_attn.q_proj"),
    "indivisible_colwise": ({"proj": hpf.Colwise(gather_output=True)}, hpf.ShapeError, "not divisible by mesh axis 'tp'",
                            "proj.weight"),
    "indivisible_rowwise": ({"back": hpf.Rowwise()}, hpf.ShapeError, "not divisible by mesh axis 'tp'", "back.weight"),
    "indivisible_vocab": ({"odd_emb": hpf.VocabEmbedding()}, hpf.ShapeError, "not divisible by mesh axis 'tp'", "odd_emb.weight"),
    "indivisible_heads": ({"": hpf.Heads(("num_heads",))}, hpf.PlanError, "num_heads=3 is not divisible", "mesh axis 'tp'"),
    "indivisible_packed": ({"fused": hpf.Colwise(packed=4)}, hpf.ShapeError, "packed blocks (3, 3, 3, 3)", "fused.weight"),
    "packed_gather": ({"fused": hpf.Colwise(packed=4, gather_output=True)}, hpf.PlanError,
                      "a packed Colwise keeps its output sharded", "fused"),
    "unknown_axis": ({"proj": hpf.Colwise(axis="ep")}, hpf.PlanError, "mesh axis 'ep' is not in the mesh", "proj"),
    "unknown_tp_axis": (hpf.ShardingPlan({"emb": "embedding_rowwise"}, axes={"tp": "model"}), hpf.PlanError,
                        "mesh axis 'model' is not in the mesh", "emb"),
    "wrong_module": ({"emb": hpf.Colwise()}, hpf.PlanError,
                     "Colwise needs a Linear or Conv1d or Conv2d or Conv3d, got Embedding", "emb"),
    "hf_unsupported": ({"proj": "grouped_gemm"}, hpf.PlanError, "style 'grouped_gemm' is not supported", "proj"),
    "conflicting_styles": ({"model.layers.*.mlp.up_proj": "colwise", "model.layers.0.mlp.*": "rowwise"},
                           hpf.PlanError, "conflicting plan entries", "model.layers.0.mlp.up_proj"),
    "tied_conflict": ({"model.embed_tokens": "embedding_rowwise", "lm_head": "rowwise"}, hpf.PlanError,
                      "conflicting placements", "lm_head.weight"),
    "spec_bad_param": ({"proj": hpf.ModuleSpec(params={"kernel": {"tp": Replicate()}})}, hpf.PlanError,
                       "parameter 'kernel'", "proj"),
    "bad_placement": ({"proj": hpf.ModuleSpec(params={"weight": {"tp": hpf.NoParallel()}})}, hpf.PlanError,
                      "is not a placement", "proj"),
}
LLAMA_ROWS = {"no_match", "conflicting_styles", "tied_conflict"}


def case_plan_row(state, kind: str):
    plan = PLAN_ROWS[kind][0]
    model = build_llama(state, tie_word_embeddings=kind == "tied_conflict") if kind in LLAMA_ROWS else Odd()
    before = snapshot(model)
    error = raised(lambda: hpf.shard(model, plan, mesh()))
    assert_unchanged(before, snapshot(model))
    return error


@pytest.mark.parametrize("kind", sorted(PLAN_ROWS))
def test_bad_plan_raises_on_every_rank(pool, kind):
    results = pool.run(case_plan_row, make_llama_state(tie_word_embeddings=kind == "tied_conflict"), kind)
    _, exc_type, needle, culprit = PLAN_ROWS[kind]
    for error in results:
        assert error is not None, "no error raised"
        name, msg = error
        assert name == exc_type.__name__ and needle in msg and culprit in msg, error


# ------------------------------------------------------------------ meshes
def case_mesh_rows():
    """Wrong world size and duplicate axis names are rejected by torch's own mesh constructor
    (before any group is created); a rank outside the mesh is rejected by shard()."""
    rows = {
        "too_big": raised(init_device_mesh, "cpu", (world() + 1,), mesh_dim_names=("tp",)),
        "duplicate_axes": raised(init_device_mesh, "cpu", (1, world()), mesh_dim_names=("tp", "tp")),
    }
    half = DeviceMesh("cpu", list(range(world() // 2)), mesh_dim_names=("tp",))  # every rank builds it
    model = MLP()
    before = snapshot(model)
    rows["rank_outside"] = raised(hpf.shard, model, hpf.ShardingPlan(PLANS["tp"]), half) if half.get_coordinate() is None \
        else ("outside only", "ranks of the first half are in the mesh")
    assert_unchanged(before, snapshot(model))
    return rows


def test_mesh_rows(pool):
    for r, rows in enumerate(pool.run(case_mesh_rows)):
        assert rows["too_big"][0] == "RuntimeError" and "Mesh should not be bigger than default world size" in rows["too_big"][1]
        assert rows["duplicate_axes"][0] == "RuntimeError" and "mesh_dim_name must be unique" in rows["duplicate_axes"][1]
        if r >= pool.world // 2:
            name, msg = rows["rank_outside"]
            assert name == "PlanError" and f"this rank ({r}) is not in the mesh" in msg, rows["rank_outside"]


# ------------------------------------------------------------------ apply_fn and unshard
def case_call_rows():
    m = mesh()
    torch.manual_seed(0)  # the same weights on every rank (shard() checks)
    model = MLP()
    before = snapshot(model)
    apply_fn, params, info = hpf.shard(model, hpf.ShardingPlan(PLANS["tp"]), m)
    seq_plan = {"": hpf.PrepareInput({"x": (Replicate(), Shard(1))}), **PLANS["sp"]}  # the model splits the sequence
    seq_fn, seq_params, _ = hpf.shard(model, hpf.ShardingPlan(seq_plan), m)
    batch_plan = {"": hpf.PrepareInput({"x": (Replicate(), Shard(0))}), "up": hpf.Colwise(), "down": hpf.Rowwise()}
    batch_fn, batch_params, _ = hpf.shard(model, hpf.ShardingPlan(batch_plan), m)
    key = next(iter(params))
    rows = {
        "seq_breaks_plan": raised(seq_fn, seq_params, torch.randn(2, 4 * world() + 1, 16)),
        "batch_breaks_plan": raised(batch_fn, batch_params, torch.randn(world() + 1, 4, 16)),
        "missing_key": raised(apply_fn, {k: v for k, v in params.items() if k != key}, torch.randn(2, 8, 16)),
        "extra_key": raised(apply_fn, {**params, "bogus.weight": torch.ones(1)}, torch.randn(2, 8, 16)),
        "wrong_shape": raised(apply_fn, {**params, "up.weight": torch.ones(3, 16)}, torch.randn(2, 8, 16)),
        "state_dict": raised(apply_fn, model.state_dict(), torch.randn(2, 8, 16)),
    }
    # unshard with a shard_info from another mesh: tp over every rank vs a size-1 tp axis
    _, _, other_info = hpf.shard(model, hpf.ShardingPlan(PLANS["tp"]), mesh((world(), 1), ("dp", "tp")))
    _, tp_params, _ = hpf.shard(model, hpf.ShardingPlan(PLANS["tp"]), m)
    rows["unshard_other_mesh"] = raised(hpf.unshard, tp_params, other_info)
    assert_unchanged(before, snapshot(model))
    return rows


CALL_ROWS = {
    "seq_breaks_plan": ("ShapeError", "argument 'x' of shape", "split on mesh axis 'tp': dim 1"),
    "batch_breaks_plan": ("ShapeError", "argument 'x' of shape", "split on mesh axis 'tp'"),
    "missing_key": ("PlanError", "missing ['norm.weight']", "params pytree keys differ"),
    "extra_key": ("PlanError", "extra ['bogus.weight']", "params pytree keys differ"),
    "wrong_shape": ("PlanError", "params['up.weight'] has shape (3, 16)", "expected local"),
    "state_dict": ("PlanError", "params['up.weight'] has shape (32, 16)", "pass the params pytree that shard() returned"),
    "unshard_other_mesh": ("ShapeError", "unshard: up.weight has local shape", "shard_info from another mesh"),
}


@pytest.mark.parametrize("row", sorted(CALL_ROWS))
def test_call_rows(pool, row):
    for rows in pool.run(case_call_rows):
        assert rows[row] is not None, f"{row}: nothing raised"
        name, msg = rows[row]
        exc_type, *needles = CALL_ROWS[row]
        assert name == exc_type and all(n in msg for n in needles), rows[row]


def test_parameters_on_another_device_type_than_the_mesh():
    """The device check runs before anything else; a CPU-only machine has no second device
    type, so the mesh's device type is stood in for."""
    from hp_functional.compile.build import check_devices

    with pytest.raises(hpf.PlanError, match=r"norm.weight is on cpu but the mesh is cuda"):
        check_devices(MLP(), "cuda")
    with torch.device("meta"):
        check_devices(MLP(), "cuda")  # meta models materialise later


def test_conflicts_do_not_depend_on_entry_order():
    """The most specific entries win whatever the dict order: an exact path settles a module that
    two equally specific wildcards disagree on; without it, both orders raise."""
    from types import SimpleNamespace

    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4)))
    fake_mesh = SimpleNamespace(mesh_dim_names=("tp",))
    wild = {"0.*": hpf.Colwise(), "*.0": hpf.Rowwise()}
    for entries in ({**wild, "0.0": hpf.Colwise()}, {"0.0": hpf.Colwise(), **wild}):
        [planned] = hpf.ShardingPlan(entries).resolve(model, fake_mesh)
        assert (planned.fqn, planned.pattern) == ("0.0", "0.0")
    for entries in (wild, dict(reversed(wild.items()))):
        with pytest.raises(hpf.PlanError, match="0.0: conflicting plan entries"):
            hpf.ShardingPlan(entries).resolve(model, fake_mesh)


def test_apply_fn_params_on_another_device_type_than_the_mesh():
    """The per-call device check: the mesh's device type is stood in for (a CPU-only machine has
    no second device type); a dtype cast (mixed precision) is allowed."""
    from types import SimpleNamespace

    from hp_functional.runtime.apply_fn import make_apply_fn

    infos = {"weight": SimpleNamespace(local_shape=(2, 2))}
    program = SimpleNamespace(infos=infos, leaf_of={"weight": "weight"}, param_steps={}, param_buckets=(), loss_parallel=None,
                              recomputed={}, groups={}, mesh=SimpleNamespace(device_type="cuda", size=lambda: 1))
    apply_fn = make_apply_fn(nn.Linear(2, 2, bias=False).to("meta"), program)
    with pytest.raises(hpf.PlanError, match=r"params\['weight'\] is on cpu, but the mesh's device type is cuda"):
        apply_fn({"weight": torch.ones(2, 2)}, torch.ones(1, 2))
    program.mesh = SimpleNamespace(device_type="cpu", size=lambda: 1)
    apply_fn = make_apply_fn(nn.Linear(2, 2, bias=False).to("meta"), program)
    out = apply_fn({"weight": torch.ones(2, 2, dtype=torch.float64)}, torch.ones(1, 2, dtype=torch.float64))
    assert out.dtype == torch.float64 and out.tolist() == [[2.0, 2.0]]


def test_no_mesh_is_a_plan_error():
    """``shard(model, plan, None)`` names what a mesh must be (before any collective)."""
    for bad in (None, "tp", (2,)):
        with pytest.raises(hpf.PlanError, match="the mesh must be a torch.distributed DeviceMesh"):
            hpf.shard(MLP(), PLANS["tp"], bad)
    findings = hpf.lint(MLP(), PLANS["tp"], None)
    assert [f.code for f in findings] == ["mesh"], findings


def test_a_plan_axis_the_mesh_lacks_points_to_tp_axis():
    """A mesh whose TP axis is not called "tp" with from_hf's default: the error says how to name it."""
    from types import SimpleNamespace

    model = build_llama(make_llama_state())
    with pytest.raises(hpf.PlanError, match=r"mesh axis 'tp' is not in the mesh \(axes: \['model'\]\).*from_hf\(model, tp_axis="):
        hpf.ShardingPlan.from_hf(model).resolve(model, SimpleNamespace(mesh_dim_names=("model",)))
    [first, *_] = hpf.ShardingPlan.from_hf(model, tp_axis="model").resolve(model, SimpleNamespace(mesh_dim_names=("model",)))
    assert first.axis == "model"
