"""hpf.optim.zero: AdamW's state sharded over dp where the params are replicated (ZeRO-1: reduced
grads; ZeRO-2: each rank's own grads, reduce-scattered) equals torch.optim.AdamW on the whole model
bit for bit over 3 steps, at dp 2 and dp 2 x tp 2 on a tiny Llama; half the state per rank; one
all-gather (and for ZeRO-2 one reduce-scatter) per bucket, after one small all-gather agreeing which
gradients are None; and hpf.save/hpf.load carry the sharded state, into the same layout and into a plain
(unsharded-state) AdamW's.  A gradient None on the dp ranks of index 1 only is refused on every rank, naming
the parameter and the ranks, before any data collective; None on every rank keeps the parameter, and the
next step is still exact."""

from __future__ import annotations

import optree
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hp_functional as hpf
from hp_functional import PlanError
from hp_functional.train.optim import state_info, zero_info
from hp_functional.train.optim_zero import row_infos
from tests.conftest import get_pool
from tests.support.helpers import mesh
from tests.support.models import build_llama, make_llama_state

STEPS, LR, WD = 3, 1e-2, 0.1
KEY = "model.layers.0.mlp.down_proj.weight"


class Collectives(TorchDispatchMode):
    """Counts the functional all-gathers and reduce-scatters of data (floating point), and the all-gathers
    of integers apart (``agree``: which gradients are None)."""

    def __init__(self):
        super().__init__()
        self.counts = {"all_gather_into_tensor": 0, "reduce_scatter_tensor": 0, "agree": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.counts:
            self.counts[name if args[0].is_floating_point() else "agree"] += 1
        return func(*args, **(kwargs or {}))


def torch_adamw(full: dict, grads: list[dict]) -> tuple[dict, dict]:
    """torch.optim.AdamW over copies of ``full`` (a None gradient: no ``.grad``); (final params, exp_avg by key)."""
    ref = {k: p.detach().clone().requires_grad_() for k, p in full.items()}
    opt = torch.optim.AdamW(list(ref.values()), lr=LR, weight_decay=WD)
    for g in grads:
        for k, p in ref.items():
            p.grad = None if g[k] is None else g[k].clone()
        opt.step()
    return {k: p.detach() for k, p in ref.items()}, {k: opt.state[p]["exp_avg"] for k, p in ref.items()}


def _run(opt, params, info, per_rank: list[list[dict]], stage: int, dp):
    """3 steps; the per-step collective counts."""
    state = opt.init(params)
    counts = []
    for step in per_rank:
        g = step[dp.get_local_rank()] if stage == 2 else {k: (step[0][k] + step[1][k]) / 2 for k in step[0]}
        with Collectives() as counted:
            params, state = opt.update({k: hpf.slice_local(g[k], info[k]) for k in params}, state, params)
        counts.append(dict(counted.counts))
    return params, state, counts


def case_zero(state, world: int, root: str):
    model = build_llama(state)
    m = mesh((2,), ("dp",)) if world == 2 else mesh((2, 2), ("dp", "tp"))
    _, params, info = hpf.shard(model, {} if world == 2 else hpf.ShardingPlan.from_hf(model), m)
    full, dp = dict(model.named_parameters()), m["dp"]
    gen = torch.Generator().manual_seed(1)
    per_rank = [[{k: torch.randn(p.shape, generator=gen) for k, p in full.items()} for _ in range(2)] for _ in range(STEPS)]
    ref, exp_avg = torch_adamw(full, [{k: (s[0][k] + s[1][k]) / 2 for k in full} for s in per_rank])
    out = {}
    for stage in (1, 2):
        opt = hpf.optim.zero(hpf.optim.adamw(LR, weight_decay=WD), info, m, "dp", stage=stage, bucket_bytes=16 * 1024)
        new, opt_state, counts = _run(opt, params, info, per_rank, stage, dp)
        got = hpf.unshard(new, info)
        mu = opt_state.over["dp"].mu
        out[stage] = {"bitwise": [k for k in ref if not torch.equal(got[k], ref[k])],
                      "state_numel": sum(t.numel() for t in mu.values()), "param_numel": sum(t.numel() for t in new.values()),
                      "counts": counts, "leaves": len(params), "none": _none_on_some(opt, params, info, full, dp)}
    hpf.save(f"{root}/zero", new, info, opt_state=opt_state).wait()
    same = hpf.load(f"{root}/zero", info, opt_state=opt.init(params)).opt_state
    out["same"] = all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(same), optree.tree_leaves(opt_state), strict=True))
    out["wrong_mu"] = _first_moments(root, info, params, exp_avg)
    out["refused"] = _refusals(info, m, params)
    if world == 4:  # into another layout: dp 4, no TP
        _, params4, info4 = hpf.shard(build_llama(state), {}, mesh((4,), ("dp",)))
        out["wrong_mu_dp4"] = _first_moments(root, info4, params4, exp_avg)
    return out


def _none_on_some(opt, params, info, full: dict, dp) -> dict:
    """A fresh run of ``opt``: KEY's gradient None on dp rank 1 only, and KEY left out of the params and grads
    there (each: the error, or "accepted", and the collectives issued); then None on every rank (the parameter
    kept) and a full step, gathered: the leaves not bitwise torch's AdamW (which skips the None), and those not
    the unsharded ``hpf.optim.adamw`` (one step count for every leaf, where torch counts per leaf: only KEY's
    differ, by design)."""
    gen = torch.Generator().manual_seed(2)
    g = [{k: torch.randn(p.shape, generator=gen) for k, p in full.items()} for _ in range(2)]
    g[0][KEY] = None
    local = [{k: None if x[k] is None else hpf.slice_local(x[k], info[k]) for k in params} for x in g]
    state, out = opt.init(params), {}
    without = {k: p for k, p in params.items() if k != KEY}
    calls = {"refused": (local[0], params), "not_given": ({k: local[1][k] for k in without}, without)}
    for name, (grads, mine) in calls.items():
        with Collectives() as counted:
            try:
                opt.update(*(grads, state, mine) if dp.get_local_rank() == 1 else (local[1], state, params))
                out[name] = "accepted"
            except PlanError as e:
                out[name] = str(e)
        out[f"{name} counts"] = dict(counted.counts)
    new, state = opt.update(local[0], state, params)
    out["kept"] = new[KEY] is params[KEY]
    new, state = opt.update(local[1], state, new)
    got, (ref, _) = hpf.unshard(new, info), torch_adamw(full, g)
    plain = hpf.optim.adamw(LR, weight_decay=WD)
    whole = {k: p.detach() for k, p in full.items()}
    plain_state = plain.init(whole)
    for grads in g:
        whole, plain_state = plain.update(grads, plain_state, whole)
    out["not_torch"] = [k for k in ref if not torch.equal(got[k], ref[k])]
    out["not_plain"] = [k for k in ref if not torch.equal(got[k], whole[k])]
    return out


def _refusals(info, m, params) -> dict[str, str]:
    """The PlanError message of each bad use (all raised before any collective)."""
    cases = {"axis": lambda: row_infos(info, m, "cp"),
             "sharded": lambda: row_infos(info, m, "tp" if "tp" in m.mesh_dim_names else "cp"),
             "stage": lambda: hpf.optim.zero(hpf.optim.adamw(), info, m, stage=3),
             "muon": lambda: hpf.optim.zero(hpf.optim.muon(), info, m).init(params),
             "keys": lambda: hpf.optim.zero(hpf.optim.adamw(), dict(list(info.items())[:3]), m).init(params)}
    out = {}
    for name, fn in cases.items():
        try:
            fn()
            out[name] = "accepted"
        except (PlanError, ValueError) as e:
            out[name] = str(e)
    return out


def _first_moments(root: str, info, params, exp_avg) -> list[str]:
    """The saved ZeRO state loaded into ``info``'s ZeRO layout, its first moments gathered through
    ``state_info``: the keys where they are not torch's exp_avg."""
    m = next(iter(info.values())).mesh
    loaded = hpf.load(f"{root}/zero", info, opt_state=hpf.optim.zero(hpf.optim.adamw(LR), info, m, "dp").init(params))
    rows = state_info(loaded.opt_state, info).over["dp"].mu
    assert rows == {k: x for k, x in zero_info(info, m).items()}
    full = hpf.unshard(loaded.opt_state.over["dp"].mu, rows)
    return [k for k in exp_avg if not torch.equal(full[k], exp_avg[k])]


def _check(results):
    out = results[0]
    for rank, result in enumerate(results):
        for stage in (1, 2):
            _check_none(result[stage]["none"], rank, len(results), stage)
    for stage in (1, 2):
        r = out[stage]
        assert not r["bitwise"], f"ZeRO-{stage} differs from torch.optim.AdamW: {r['bitwise']}"
        assert r["state_numel"] * 2 == r["param_numel"], f"ZeRO-{stage}: not half the state per rank: {r}"
        for c in r["counts"]:
            gathers, scatters = c["all_gather_into_tensor"], c["reduce_scatter_tensor"]
            assert 1 < gathers < r["leaves"], f"ZeRO-{stage}: {gathers} all-gathers for {r['leaves']} leaves (bucketed?)"
            assert scatters == (gathers if stage == 2 else 0) and c["agree"] == 1, c
    refused = out["refused"]
    assert "'cp' is not in the mesh" in refused["axis"] and "stage must be 1" in refused["stage"], refused
    assert "no shard_info for" in refused["keys"] and "is a MuonState" in refused["muon"], refused
    if "tp" in refused["sharded"]:  # dp x tp: a leaf sharded over tp has no replicated state there
        assert "is not replicated over 'tp'" in refused["sharded"], refused
    assert out["same"], "the ZeRO state did not load back as it was saved"
    assert not out["wrong_mu"], f"the loaded first moments differ from torch's exp_avg: {out['wrong_mu']}"
    assert not out.get("wrong_mu_dp4"), f"loaded at dp 4, the first moments differ: {out['wrong_mu_dp4']}"


def _check_none(r: dict, rank: int, world: int, stage: int) -> None:
    """Refused on every rank, naming KEY and the rank of its dp group whose gradient is None or not given (dp
    rank 1), with no data collective; then None everywhere kept KEY and the next step is exact."""
    dp_group = [rank % (world // 2), rank % (world // 2) + world // 2]  # dp x tp: rank = dp * tp_size + tp
    for name, state in (("refused", "None"), ("not_given", "not given")):
        assert f"'{KEY}' is {state} on rank(s) [{dp_group[1]}], a tensor on rank(s) [{dp_group[0]}]" in r[name], r
        assert f"'dp': {dp_group})" in r[name], r
        assert r[f"{name} counts"] == {"all_gather_into_tensor": 0, "reduce_scatter_tensor": 0, "agree": 1}, (stage, r)
    assert r["kept"], f"ZeRO-{stage}: a gradient None on every rank did not keep its parameter"
    assert r["not_torch"] == [KEY] and not r["not_plain"], f"ZeRO-{stage} after a None step: {r}"


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_zero_matches_torch_adamw(world, tmp_path):
    # a bounded wait: ranks whose buckets differ (a None gradient not agreed) hang in gloo, not fail
    _check(get_pool(world).run(case_zero, make_llama_state(), world, str(tmp_path), timeout=120))
