"""``hpf.Local``: hand-written local forwards with explicit collectives, against the unsharded model
(loss and every gradient, ``.backward()`` and ``torch.func.grad``); the replication check; bad input."""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

import hp_functional as hpf
from tests.support.helpers import assert_close, mesh
from tests.support.models import MLP, make_mlp_state
from tests.support.snapshot import assert_unchanged, snapshot

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "local_attention.py"


def _example():
    spec = importlib.util.spec_from_file_location("local_attention", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def case_example():
    """examples/local_attention.py's check, both ways of reducing the heads' partial sums."""
    example = _example()
    return {how: example.compare(mesh(), reduce_inside=how == "inside") for how in ("declared", "inside")}


@pytest.mark.slow
def test_hand_written_attention_example_matches_unsharded(pool):
    for worst in pool.run(case_example):
        assert worst["declared"] <= 1e-5 and worst["inside"] <= 1e-5, worst


# ---------------------------------------------------------------- a sequence-parallel MLP by hand
def sp_mlp(module, axes, x):
    """Megatron-SP by hand: norm on this rank's tokens, gather the sequence, up (local features),
    down (partial sums) and reduce-scatter back onto this rank's tokens."""
    tp = axes["tp"]
    h = tp.all_gather(module.norm(x), 1)
    return tp.reduce_scatter(module.down(F.gelu(module.up(h))), 1)


SP_MLP = hpf.Local(
    sp_mlp, in_src={0: Replicate()}, in_dst={0: Shard(1)}, out_src={"output": Shard(1)}, out_dst={"output": Replicate()},
    params={"up.weight": Shard(0), "up.bias": Shard(0), "down.weight": Shard(1)}, param_dst={"down.bias": Partial()},
)


def _mlp_input():
    return torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))


def case_sp_mlp(state):
    ref = MLP()
    ref.load_state_dict(state)
    x = _mlp_input()
    ref(x).pow(2).sum().backward()
    apply_fn, params, info = hpf.shard(ref, {"": SP_MLP}, mesh())
    loss = apply_fn(params, x).pow(2).sum()
    loss.backward()
    assert_close(loss, ref(x).pow(2).sum(), "loss")
    func = torch.func.grad(lambda p: apply_fn(p, x).pow(2).sum())({k: p.detach() for k, p in params.items()})
    for how, grads in (("backward", {k: p.grad for k, p in params.items()}), ("torch.func.grad", func)):
        full = hpf.unshard(grads, info)
        for name, p in ref.named_parameters():
            assert_close(full[name], p.grad, f"{how} {name}")
    totals = hpf.explain(ref, {"": SP_MLP}, mesh(), x).schedule.totals()  # fn's own collectives are counted
    return {(direction, op): n for (direction, op, _), (n, _) in totals.items()}


def test_mlp_region_with_its_own_gather_and_scatter(pool):
    # forward: fn's gather and scatter, then the exit's gather; backward: their transposes (the input
    # needs no gradient) and one bucketed all-reduce for the replicated norm parameters used on local tokens
    expected = {("fwd", "all_gather"): 2, ("fwd", "reduce_scatter"): 1, ("bwd", "all_gather"): 1,
                ("bwd", "reduce_scatter"): 1, ("bwd", "all_reduce"): 1}
    for counts in pool.run(case_sp_mlp, make_mlp_state()):
        assert counts == expected, counts


# ---------------------------------------------------------------- the replication check
def unreduced_mlp(module, axes, x):
    """Broken on purpose: Rowwise partial sums returned as if reduced (the all-reduce is missing)."""
    return module.down(F.gelu(module.up(module.norm(x))))


def rank_dependent_mlp(module, axes, x):
    """Broken on purpose: reduced correctly, then a per-rank value is added."""
    return axes["tp"].all_reduce(unreduced_mlp(module, axes, x)) + axes["tp"].rank


def _tp_mlp(fn, **kw):
    return hpf.Local(fn, in_dst={0: Replicate()}, out_src={"output": Replicate()},
                     params={"up.weight": Shard(0), "up.bias": Shard(0), "down.weight": Shard(1)},
                     param_dst={"down.bias": Partial()}, **kw)


def case_replication_check(state, which: str):
    fn = {"missing_all_reduce": unreduced_mlp, "rank_dependent": rank_dependent_mlp, "correct": None}[which]
    fn = fn or (lambda module, axes, x: axes["tp"].all_reduce(unreduced_mlp(module, axes, x)))
    model = MLP()
    model.load_state_dict(state)
    x = _mlp_input()
    apply_fn, params, _ = hpf.shard(model, {"": _tp_mlp(fn, check=True)}, mesh(), verify=False)  # the run-time check
    try:
        apply_fn(params, x)
        raised = None
    except hpf.ReplicationError as exc:
        raised = str(exc)
    report = hpf.validate(model, {"": _tp_mlp(fn)}, mesh(), x, raise_on_failure=False)  # validate turns the check on
    return raised, report.replication, report.ok


@pytest.mark.parametrize("which", ["missing_all_reduce", "rank_dependent", "correct"])
def test_replication_check_names_the_module_and_output(pool, which):
    for raised, found, ok in pool.run(case_replication_check, make_mlp_state(), which):
        if which == "correct":
            assert raised is None and found == [] and ok, (raised, found)
            continue
        for message in (raised, *found):
            assert message and "<root module>: output is declared Replicate on mesh axis 'tp'" in message, message
            assert "differs across its ranks" in message and "all_reduce" in message, message
        assert len(found) == 1 and not ok


# ---------------------------------------------------------------- bad input, before any collective
def takes_no_input(module, axes):
    return module.down(module.up(module.norm(torch.zeros(1))))


ROWS = {  # plan -> (message needle, culprit named)
    "missing_argument": ({"": hpf.Local(takes_no_input, in_dst={0: Replicate()})},
                         "does not take the declared argument 0", "takes_no_input"),
    "missing_keyword": ({"": hpf.Local(sp_mlp, in_dst={"x": Replicate(), "mask": Replicate()})},
                        "does not take the declared argument 'mask'", "sp_mlp"),
    "no_module_axes": ({"": hpf.Local(lambda x: x)}, "must take (module, axes, *args, **kwargs)", "<root module>"),
    "not_callable": ({"": hpf.Local("sp_mlp")}, "Local fn must be callable", "<root module>"),
    "axis_not_in_mesh": ({"": hpf.Local(sp_mlp, in_dst={0: {"cp": Shard(1)}})}, "mesh axis 'cp' is not in the mesh", "''"),
    "own_axis_not_in_mesh": ({"up": hpf.Local(sp_mlp, axis="ep")}, "mesh axis 'ep' is not in the mesh", "'up'"),
    "unknown_param": ({"": hpf.Local(sp_mlp, params={"up.kernel": Shard(0)})}, "names parameter 'up.kernel'", "root"),
    "bad_layout": ({"": hpf.Local(sp_mlp, out_src={"output": "shard"})}, "is not a Placement", "out_src"),
}


def case_bad_local(state, row: str):
    model = MLP()
    model.load_state_dict(state)
    before = snapshot(model)
    plan, needle, culprit = ROWS[row]
    try:
        hpf.shard(model, plan, mesh())
        outcome = None
    except Exception as exc:  # noqa: BLE001 - the test checks type and message
        outcome = (type(exc).__name__, str(exc))
    assert_unchanged(before, snapshot(model))
    return outcome, needle, culprit


@pytest.mark.parametrize("row", sorted(ROWS))
def test_bad_local_raises_on_every_rank_before_any_collective(pool, row):
    results = pool.run(case_bad_local, make_mlp_state(), row)
    for outcome, needle, culprit in results:
        assert outcome is not None and outcome[0] == "PlanError", outcome
        assert needle in outcome[1] and culprit in outcome[1], outcome
    assert len({r[0] for r in results}) == 1  # the same error on every rank (none reached a collective)


def test_local_layouts_fill_the_boundary_contract():
    """A bare placement is on the entry's axis; a dict names axes; the contract is a ModuleSpec."""
    local = hpf.Local(sp_mlp, in_dst={0: Shard(1)}, out_src={"output": {"tp": Shard(1), "dp": Replicate()}})
    spec = local.spec(MLP(), "", "tp")
    assert spec.in_dst == {0: {"tp": Shard(1)}} and spec.out_src == {"output": {"tp": Shard(1), "dp": Replicate()}}
    assert spec.varying and spec.region and local.named_axes == {"tp", "dp"}
    same = hpf.Local(sp_mlp, in_dst={0: Shard(1)}, out_src={"output": {"tp": Shard(1), "dp": Replicate()}})
    assert local == same and hash(local) == hash(same)  # equal plans agree (conflict detection, fingerprints)
    assert local != hpf.Local(sp_mlp, in_dst={0: Shard(2)})
