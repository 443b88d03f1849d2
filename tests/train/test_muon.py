"""hpf.optim.muon at every layout equals torch.optim.Muon (+ torch.optim.AdamW on the other leaves)
on the unsharded model, bit for bit, over 3 steps of a warm-up lr schedule: TP 2, FSDP dp 2, EP 2
(a Mixtral's stacked experts) at 2 ranks; FSDP x TP and replicated dp x TP (dp 2 x tp 2), EP x TP
at 4.  The gradients are random full tensors sliced to each layout (the optimizer is a function of
grads and params; the sharded gradients themselves are tested elsewhere), and Muon's momentum,
gathered through ``state_info``, equals torch's buffers.  The TP run's params and Muon state saved
after 2 steps (``hpf.save``) and loaded into a fresh optimizer at TP 2 and at FSDP dp 2
(``hpf.load`` reshards) take step 3 bit for bit as the uninterrupted run.  Also: one all-to-all each
way per bucket, the owners balanced, nothing the caller passed is mutated, a matrix's gradient
``None`` on one rank only refused on every rank before any all-to-all, and bad input refused by name."""

from __future__ import annotations

import optree
import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import hp_functional as hpf
from hp_functional import PlanError
from hp_functional.train.optim import state_info
from hp_functional.train.optim_muon import NS_COEFFICIENTS, is_matrix, orthogonalized
from tests.conftest import get_pool
from tests.support.helpers import mesh
from tests.support.models import build_llama, make_llama_state

STEPS, LR, WD = 3, 0.02, 0.1


def warmup(k: int) -> float:
    """The lr of update ``k`` (``torch.optim.lr_scheduler.LambdaLR``'s ``base_lr * lambda(k)``, op for op), so
    that a resumed run must read its step from the state it loaded."""
    return LR * ((k + 1) / STEPS)


def _moe(state=None):
    """A tiny Mixtral (4 experts, top-2): its experts are stacked 3-D leaves."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("mixtral", vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                  num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if state is not None:
        model.load_state_dict(state)
    return model


class AllToAlls(TorchDispatchMode):
    """Counts the all-to-alls dispatched (c10d's ``alltoall_base_``)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "alltoall" in func.overloadpacket.__name__:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _grads(full: dict, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(p.shape, generator=g) for k, p in full.items()} for _ in range(STEPS)]


def torch_reference(full: dict, grads: list[dict], matrices: list[str]) -> tuple[dict, dict]:
    """torch.optim.Muon on the matrices (a 3-D stack member by member) and AdamW on the rest, one
    process: (the params, Muon's momentum buffers)."""
    ref = {k: p.detach().clone().requires_grad_() for k, p in full.items()}
    members = {k: [torch.nn.Parameter(ref[k].detach()[i].clone()) for i in range(ref[k].shape[0])]
               for k in matrices if ref[k].ndim == 3}
    muon = torch.optim.Muon([p for k in matrices for p in (members[k] if k in members else [ref[k]])], lr=LR,
                            weight_decay=WD)
    adamw = torch.optim.AdamW([ref[k] for k in full if k not in matrices], lr=LR, weight_decay=WD)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda k: (k + 1) / STEPS) for o in (muon, adamw)]
    for g in grads:
        for k, p in ref.items():
            p.grad = g[k].clone()
        for k, ps in members.items():
            for i, p in enumerate(ps):
                p.grad = g[k][i].clone()
        muon.step()
        adamw.step()
        for schedule in schedules:
            schedule.step()
    def whole(k, of):
        return torch.stack([of(p) for p in members[k]]) if k in members else of(ref[k])
    return ({k: whole(k, lambda p: p.detach()) for k in full},
            {k: whole(k, lambda p: muon.state[p]["momentum_buffer"]) for k in matrices})


def _layout(kind: str, model):
    """(params, shard_info) of ``model`` laid out as ``kind``."""
    if kind == "tp":
        return hpf.shard(model, hpf.ShardingPlan.from_hf(model), mesh((2,), ("tp",)))[1:]
    if kind == "fsdp":
        m = mesh((2,), ("dp",))
        return hpf.fsdp(*hpf.shard(model, {}, m), m, "dp")[1:]
    if kind in ("dp_tp", "fsdp_tp"):
        m = mesh((2, 2), ("dp", "tp"))
        sharded = hpf.shard(model, hpf.ShardingPlan.from_hf(model), m)
        return sharded[1:] if kind == "dp_tp" else hpf.fsdp(*sharded, m, "dp")[1:]
    names = ("ep",) if kind == "ep" else ("ep", "tp")
    m = mesh((2,) if kind == "ep" else (2, 2), names)
    return hpf.shard(model, hpf.ShardingPlan.from_hf(model, ep_axis="ep"), m)[1:]


def case_layout(state, kind: str, root: str | None = None):
    """3 Muon steps at layout ``kind`` against torch's on the full tensors: per leaf, whether bitwise
    equal and the worst difference; the all-to-alls of step 1; the buckets; the owners' loads.  With
    ``root`` (TP and FSDP at 2 ranks): the TP run saves after 2 steps, and each resumes from it."""
    model = _moe(state) if kind.startswith("ep") else build_llama(state)
    params, info = _layout(kind, model)
    full = dict(model.named_parameters())
    grads = _grads(full, 1)
    opt = hpf.optim.muon(warmup, weight_decay=WD, shard_info=info, bucket_bytes=32 * 1024)
    first, given = params, {k: p.clone() for k, p in params.items()}
    state_ = opt.init(params)
    counts = []
    for step, g in enumerate(grads):
        local = {k: hpf.slice_local(g[k], info[k]) for k in params}
        kept = {k: t.clone() for k, t in local.items()}
        with AllToAlls() as counted:
            params, state_ = opt.update(local, state_, params)
        counts.append(counted.count)
        assert all(torch.equal(kept[k], t) for k, t in local.items()), "muon.update changed the grads"
        if root is not None and kind == "tp" and step == 1:
            hpf.save(f"{root}/tp", params, info, opt_state=state_).wait()
    assert list(first) == list(given) and all(torch.equal(first[k], given[k]) for k in given), "params mutated"
    ours = hpf.unshard(params, info)
    ref, bufs = torch_reference(full, grads, list(state_.momentum))
    diffs = {k: (torch.equal(ours[k], ref[k]), (ours[k] - ref[k]).abs().max().item()) for k in ref}
    momentum = hpf.unshard(state_.momentum, state_info(state_, info).momentum)  # the state laid out as state_info says
    diffs |= {f"momentum {k}": (torch.equal(momentum[k], bufs[k]), 0.0) for k in bufs}
    if root is not None:
        diffs |= {f"resumed {k}": (False, 0.0) for k in _resumed(root, info, first, grads[-1], params, state_)}
    refused = _partial_none(first, info) if kind == "tp" else None
    return (diffs, counts, sorted(state_.momentum), _plan_summary(opt, info, state_), _experts_only(kind, params, info),
            refused)


def _resumed(root: str, info, first, grads: dict, params, state_) -> list[str]:
    """The TP run's checkpoint (2 steps) loaded at ``info``'s layout into a fresh optimizer, step 3 with
    ``grads``: the params and state leaves not bitwise those of the uninterrupted run (``params``, ``state_``)."""
    opt = hpf.optim.muon(warmup, weight_decay=WD, shard_info=info, bucket_bytes=32 * 1024)
    loaded = hpf.load(f"{root}/tp", info, opt_state=opt.init(first), params=first)
    assert int(loaded.opt_state.step) == 2 and int(loaded.opt_state.rest.step) == 2
    new, new_state = opt.update({k: hpf.slice_local(grads[k], info[k]) for k in first}, loaded.opt_state, loaded.params)
    bad = [k for k in params if not torch.equal(new[k], params[k])]
    paths, leaves, spec = optree.tree_flatten_with_path(new_state)
    assert spec == optree.tree_structure(state_)
    return bad + [str(p) for p, a, b in zip(paths, leaves, optree.tree_leaves(state_), strict=True) if not torch.equal(a, b)]


def _partial_none(params, info) -> list:
    """Muon with a matrix's gradient ``None`` on rank 1 only, on the call that decides the owners and on
    a later one: each call's error (or "accepted") and all-to-alls; then ``None`` on every rank, and a
    full step: accepted (the parameter kept where ``None``)."""
    key = "model.layers.0.mlp.down_proj.weight"
    opt = hpf.optim.muon(LR, shard_info=info)
    state_ = opt.init(params)
    grads = {k: torch.ones_like(p) for k, p in params.items()}
    out: list = []
    for _ in range(2):
        with AllToAlls() as counted:
            try:
                opt.update({**grads, key: None} if dist.get_rank() == 1 else grads, state_, params)
                out.append("accepted")
            except PlanError as e:
                out.append(str(e))
        out.append(counted.count)
    new, _ = opt.update({**grads, key: None}, state_, params)
    out.append(new[key] is params[key] and not torch.equal(new["model.layers.0.mlp.up_proj.weight"],
                                                            params["model.layers.0.mlp.up_proj.weight"]))
    new, _ = opt.update(grads, state_, params)
    out.append(not torch.equal(new[key], params[key]))
    return out


def _experts_only(kind: str, params, info) -> int | None:
    """The all-to-alls of a step of Muon on the experts alone under EP without TP (each expert whole on one rank)."""
    if kind != "ep":
        return None
    opt = hpf.optim.muon(LR, shard_info=info, mask="**.experts.*")
    state_ = opt.init(params)
    opt.update({k: torch.ones_like(p) for k, p in params.items()}, state_, params)  # the owners decided
    with AllToAlls() as counted:
        opt.update({k: torch.ones_like(p) for k, p in params.items()}, state_, params)
    return counted.count


def _plan_summary(opt, info, state_) -> tuple[int, list[int]]:
    """(buckets, per-rank owned elements) of the optimizer's owner plan, read through a fresh plan."""
    from hp_functional.core.owner_gather import plan_owners

    keys = list(state_.momentum)
    plan = plan_owners(info, keys, lambda k: len(info[k].global_shape) == 3, 32 * 1024, "test")
    load = [0] * plan.exchange.size
    for u, o in enumerate(plan.owners):
        load[o] += torch.Size(plan.units[u].shape).numel()
    return len(plan.buckets), load


def _check(results, layout: str):
    diffs, counts, matrices, (buckets, load), experts_only, _ = results[0]
    for r in results[1:]:
        assert r[0] == diffs, f"{layout}: ranks disagree"
    for r in results if layout == "tp" else ():  # refused on every rank, before any all-to-all, then usable
        first, n_first, later, n_later, kept, stepped = r[5]
        for message in (first, later):
            assert "'model.layers.0.mlp.down_proj.weight'" in message and "None on rank(s) [1]" in message, r[5]
        assert n_first == n_later == 0 and kept and stepped, r[5]
    not_bitwise = {k: d for k, (same, d) in diffs.items() if not same}
    assert not not_bitwise, f"{layout}: differs from torch.optim.Muon/AdamW: {not_bitwise}"
    assert any("q_proj" in k or "experts" in k for k in matrices) and not any("embed" in k for k in matrices)
    assert buckets > 1, f"{layout}: the test means to cross buckets"
    assert min(load) > 0, f"{layout}: a rank owns no matrix: {load}"
    # one all-to-all each way per bucket at most (exactly, where every matrix is split over every rank)
    exact = layout in ("tp", "fsdp", "fsdp_tp", "dp_tp")
    assert all(c == 2 * buckets if exact else 0 < c <= 2 * buckets for c in counts), (layout, counts, buckets)
    assert experts_only in (None, 0), f"{layout}: experts held whole where they are owned moved: {experts_only}"


@pytest.mark.slow
def test_muon_matches_torch_at_two_ranks(tmp_path):
    pool = get_pool(2)
    llama, moe = make_llama_state(), _moe().state_dict()
    for kind, state, root in (("tp", llama, str(tmp_path)), ("fsdp", llama, str(tmp_path)), ("ep", moe, None)):
        _check(pool.run(case_layout, state, kind, root), kind)


@pytest.mark.slow
def test_muon_matches_torch_at_four_ranks():
    pool = get_pool(4)
    llama, moe = make_llama_state(), _moe().state_dict()
    for kind, state in (("fsdp_tp", llama), ("dp_tp", llama), ("ep_tp", moe)):
        _check(pool.run(case_layout, state, kind), kind)


# ---------------------------------------------------------------- one process
def test_newton_schulz_is_torchs_and_pure():
    """The Newton–Schulz of a wide, a tall and a square matrix (fp32 and bf16) is torch.optim.Muon's, bit
    for bit, and a bf16 input is left as it was (torch's divides it in place)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = torch.Generator().manual_seed(0)
    ns = (NS_COEFFICIENTS, 5, 1e-7)
    for shape in ((8, 24), (24, 8), (16, 16)):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(shape, generator=g).to(dtype)
            kept = x.clone()
            ours = orthogonalized({"w": x}, None, {}, 0, ns)["w"]
            assert torch.equal(ours, _zeropower_via_newtonschulz(kept.clone(), *ns)), (shape, dtype)
            assert torch.equal(x, kept), "the input was changed"


def test_which_leaves_take_muon_and_bad_input():
    """2-D leaves and experts' 3-D stacks take Muon, embeddings, the head and vectors AdamW; a mask
    naming a vector, a bad argument or a missing shard_info is refused by name."""
    assert is_matrix("model.layers.0.mlp.up_proj.weight", (8, 4), None)
    assert is_matrix("model.layers.0.mlp.experts.down_proj", (4, 8, 4), None)
    assert not any(is_matrix(k, s, None) for k, s in (("model.embed_tokens.weight", (16, 8)), ("lm_head.weight", (16, 8)),
                                                       ("model.norm.weight", (8,)), ("conv.weight", (4, 4, 3))))
    params = {"a.weight": torch.randn(4, 6), "a.bias": torch.randn(6)}
    with pytest.raises(PlanError, match="'a.bias'"):
        hpf.optim.muon(mask="**").init(params)
    for bad in ({"momentum": -1.0}, {"ns_steps": 100}, {"adjust_lr_fn": "other"}, {"ns_coefficients": (1.0, 2.0)}):
        with pytest.raises(ValueError):
            hpf.optim.muon(**bad)
    with pytest.raises(PlanError, match="a.bias"):
        hpf.optim.muon(shard_info={"a.weight": None}).init(params)
    with pytest.raises(TypeError, match="rest"):
        hpf.optim.muon(rest=torch.optim.AdamW)
