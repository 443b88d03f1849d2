"""hpf.optim.zero: AdamW's state sharded over dp where the params are replicated (ZeRO-1: reduced
grads; ZeRO-2: each rank's own grads, reduce-scattered) equals torch.optim.AdamW on the whole model
bit for bit over 3 steps, at dp 2 and dp 2 x tp 2 on a tiny Llama; half the state per rank; one
all-gather (and for ZeRO-2 one reduce-scatter) per bucket; and hpf.save/hpf.load carry the sharded
state, into the same layout and into a plain (unsharded-state) AdamW's."""

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


class Collectives(TorchDispatchMode):
    """Counts the functional all-gathers and reduce-scatters."""

    def __init__(self):
        super().__init__()
        self.counts = {"all_gather_into_tensor": 0, "reduce_scatter_tensor": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.counts:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def torch_adamw(full: dict, grads: list[dict]) -> tuple[dict, dict]:
    """torch.optim.AdamW over copies of ``full``; (final params, exp_avg by key)."""
    ref = {k: p.detach().clone().requires_grad_() for k, p in full.items()}
    opt = torch.optim.AdamW(list(ref.values()), lr=LR, weight_decay=WD)
    for g in grads:
        for k, p in ref.items():
            p.grad = g[k].clone()
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
                      "counts": counts, "leaves": len(params)}
    hpf.save(f"{root}/zero", new, info, opt_state=opt_state).wait()
    same = hpf.load(f"{root}/zero", info, opt_state=opt.init(params)).opt_state
    out["same"] = all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(same), optree.tree_leaves(opt_state), strict=True))
    out["wrong_mu"] = _first_moments(root, info, params, exp_avg)
    out["refused"] = _refusals(info, m, params)
    if world == 4:  # into another layout: dp 4, no TP
        _, params4, info4 = hpf.shard(build_llama(state), {}, mesh((4,), ("dp",)))
        out["wrong_mu_dp4"] = _first_moments(root, info4, params4, exp_avg)
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
    for stage in (1, 2):
        r = out[stage]
        assert not r["bitwise"], f"ZeRO-{stage} differs from torch.optim.AdamW: {r['bitwise']}"
        assert r["state_numel"] * 2 == r["param_numel"], f"ZeRO-{stage}: not half the state per rank: {r}"
        for c in r["counts"]:
            gathers, scatters = c["all_gather_into_tensor"], c["reduce_scatter_tensor"]
            assert 1 < gathers < r["leaves"], f"ZeRO-{stage}: {gathers} all-gathers for {r['leaves']} leaves (bucketed?)"
            assert scatters == (gathers if stage == 2 else 0), c
    refused = out["refused"]
    assert "'cp' is not in the mesh" in refused["axis"] and "stage must be 1" in refused["stage"], refused
    assert "no shard_info for" in refused["keys"] and "is a MuonState" in refused["muon"], refused
    if "tp" in refused["sharded"]:  # dp x tp: a leaf sharded over tp has no replicated state there
        assert "is not replicated over 'tp'" in refused["sharded"], refused
    assert out["same"], "the ZeRO state did not load back as it was saved"
    assert not out["wrong_mu"], f"the loaded first moments differ from torch's exp_avg: {out['wrong_mu']}"
    assert not out.get("wrong_mu_dp4"), f"loaded at dp 4, the first moments differ: {out['wrong_mu_dp4']}"


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_zero_matches_torch_adamw(world, tmp_path):
    _check(get_pool(world).run(case_zero, make_llama_state(), world, str(tmp_path)))
