"""Expert parallelism on the older form of experts: one module per expert in a container.

HF's ``SwitchTransformersForConditionalGeneration`` (an ``nn.ModuleDict`` of ``expert_<i>``
MLPs, routing as a one-hot mask whose empty rows are tokens the router dropped over capacity)
at ep 2 and ep 4: logits, loss (router z-loss and aux loss included) and every gradient within
1e-5 of the unsharded model under ``.backward()`` (Switch's router calls ``Module.to`` inside
its forward, which ``torch.func`` refuses on the unsharded model too); dp 2 × ep 2 with
``reduce_gradients`` and ``hpf.fsdp`` over dp; a checkpoint saved at dp 2 × ep 2 loading at ep 4
exactly.  An ``nn.ModuleList`` of SwiGLU experts taking HF's ``(hidden, top_k_index,
top_k_weights)`` alone: every token to the first rank's experts (the others receive nothing)
and random top-2 routing, outputs and every gradient under ``.backward()`` and
``torch.func.grad``.  Bad input raises on every rank before any collective."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import hp_functional as hpf
from hp_functional.core.placement import StackedShard, slice_local
from tests.conftest import get_pool
from tests.support.helpers import assert_close, assert_errors, mesh, plan_errors, rank, world
from tests.support.snapshot import assert_unchanged, snapshot

EXPERTS, HIDDEN = 4, 16


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate, self.up = nn.Linear(hidden, inter, bias=False), nn.Linear(hidden, inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class ListExperts(nn.ModuleList):
    """One SwiGLU MLP per expert; the container takes the routing (HF's experts contract)."""

    def __init__(self, experts: int = EXPERTS, hidden: int = HIDDEN, inter: int = 32):
        super().__init__(SwiGLU(hidden, inter) for _ in range(experts))
        self.num_experts = experts

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        hit = F.one_hot(top_k_index, self.num_experts)  # [T, k, E]
        for e in hit.sum((0, 1)).nonzero().flatten().tolist():  # only the experts with tokens
            token, slot = torch.where(hit[..., e])
            out.index_add_(0, token, self[e](hidden[token]) * top_k_weights[token, slot, None])
        return out


def list_state():
    torch.manual_seed(0)
    return ListExperts().state_dict()


def case_list(state, routings):
    module = ListExperts()
    module.load_state_dict(state)
    m = mesh((world(),), ("ep",))
    gen = torch.Generator().manual_seed(3)
    batch = (torch.randn(routings[-1].shape[0], HIDDEN, generator=gen), routings[-1], torch.rand(routings[-1].shape,
                                                                                                 generator=gen))
    apply_fn, params, info = hpf.shard(module, hpf.ShardingPlan({"": hpf.Experts()}, axes={"ep": "ep"}), m,
                                       example_inputs=batch)
    owner = EXPERTS // world()
    for e in range(EXPERTS):  # each rank holds its experts whole, the others as empty shards
        assert info[f"{e}.gate.weight"].placements == (StackedShard(e, EXPERTS),)
        assert params[f"{e}.gate.weight"].shape[0] == (32 if e // owner == rank() else 0)
    worst = 0.0
    for index in routings:
        gen = torch.Generator().manual_seed(3)
        hidden, weights = torch.randn(index.shape[0], HIDDEN, generator=gen), torch.rand(index.shape, generator=gen)
        module.zero_grad(set_to_none=True)
        h, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
        ref = module(h, index, w)
        ref.square().sum().backward()
        h2, w2 = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        out = apply_fn(leaves, h2, index, w2)
        out.square().sum().backward()
        worst = max(worst, assert_close(out.detach(), ref.detach(), "output"), assert_close(h2.grad, h.grad, "d hidden"),
                    assert_close(w2.grad, w.grad, "d weights"))
        expected = {k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in module.named_parameters()}
        full = hpf.unshard({k: v.grad for k, v in leaves.items()}, info)
        worst = max(worst, *(assert_close(full[k], g, f"grad {k}") for k, g in expected.items()))
        grads = torch.func.grad(lambda p: apply_fn(p, hidden, index, weights).square().sum())(params)
        full = hpf.unshard(grads, info)
        worst = max(worst, *(assert_close(full[k], g, f"func grad {k}") for k, g in expected.items()))
    return worst


def test_module_list_experts(pool):
    """Every token's top-2 on experts 0 and 1 (at ep 4 ranks 2 and 3 receive nothing), then random."""
    unbalanced = torch.tensor([[0, 1]] * 8)
    random = torch.stack([torch.randperm(EXPERTS, generator=torch.Generator().manual_seed(t))[:2] for t in range(8)])
    print(f"ep {pool.world}: {pool.run(case_list, list_state(), [unbalanced, random])[0]}")


def build_switch(state=None, **overrides):
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    kw = dict(vocab_size=128, d_model=32, d_kv=8, d_ff=64, expert_capacity=3, num_layers=2, num_sparse_encoder_layers=1,
              num_decoder_layers=2, num_sparse_decoder_layers=1, num_heads=4, num_experts=EXPERTS,
              router_jitter_noise=0.0, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    model = SwitchTransformersForConditionalGeneration(SwitchTransformersConfig(**{**kw, **overrides}))
    if state is not None:
        model.load_state_dict(state)
    return model


def switch_state():
    torch.manual_seed(0)
    model = build_switch()
    with torch.no_grad():  # experts initialised at T5's std are ~0: make their contribution visible
        for name, p in model.named_parameters():
            if "expert" in name:
                p.normal_(0, 0.1)
    return model.state_dict()


def _batch(rows: int = 2):
    gen = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(1, 128, (rows, 8), generator=gen), torch.randint(1, 128, (rows, 8), generator=gen)
    return ids, labels


def _dropped(state, ids, labels) -> int:
    """Assignments Switch's router dropped over its expert capacity (empty rows of its mask)."""
    model, masks = build_switch(state), []
    for name, m in model.named_modules():
        if name.endswith("mlp.experts"):
            m.register_forward_pre_hook(lambda _, args: masks.append(args[1]))
    model(input_ids=ids, labels=labels)
    return sum(int((mask.sum(-1) == 0).sum()) for mask in masks)


def _grads(model):
    return {k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in model.named_parameters()}


def case_switch(state):
    model = build_switch(state)
    ids, labels = _batch()
    assert _dropped(state, ids, labels) > 0  # the capacity mask has empty rows: dropped tokens are exercised
    model(input_ids=ids, labels=labels, output_router_logits=True)  # HF installs its recording hooks on this call
    before = snapshot(model)
    m = mesh((world(),), ("ep",))
    plan = hpf.ShardingPlan.from_hf(model, ep_axis="ep")
    apply_fn, params, info = hpf.shard(model, plan, m)
    kw = dict(input_ids=ids, labels=labels, output_router_logits=True)
    ref = model(**kw)
    ref.loss.backward()
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    out = apply_fn(leaves, **kw)
    out.loss.backward()
    diffs = {"loss": assert_close(out.loss.detach(), ref.loss.detach(), "loss"),
             "logits": assert_close(out.logits.detach(), ref.logits.detach(), "logits")}
    for what in ("encoder_z_loss", "encoder_aux_loss", "decoder_z_loss", "decoder_aux_loss"):
        assert getattr(ref, what) > 0, what
        diffs[what] = assert_close(getattr(out, what).detach(), getattr(ref, what).detach(), what)
    full = hpf.unshard({k: v.grad for k, v in leaves.items()}, info)
    diffs["grads"] = max(assert_close(full[k], g, f"grad {k}") for k, g in _grads(model).items())
    model.zero_grad(set_to_none=True)
    assert_unchanged(before, snapshot(model))
    exp = hpf.explain(model, plan, m, **kw)
    schedule = exp.schedule  # per MoE layer: counts, dispatch, combine; 2 back
    assert schedule is not None, exp.schedule_error
    assert (schedule.count(op="all_to_all", direction="fwd"), schedule.count(op="all_to_all", direction="bwd")) == (6, 4)
    return diffs


@pytest.mark.slow
def test_switch_transformers_ep(pool):
    print(f"switch ep {pool.world}: {pool.run(case_switch, switch_state())[0]}")


def case_switch_dp_ep(state, root):
    """dp 2 × ep 2: each dp rank its own half of the batch; gradients averaged over dp
    (``reduce_gradients``, and ``hpf.fsdp`` over dp on top) equal the unsharded mean, and so does
    their global norm (``clip_grad_norm``); a checkpoint saved here loads at ep 4 exactly."""
    model = build_switch(state)
    m = mesh((2, 2), ("dp", "ep"))
    plan = hpf.ShardingPlan.from_hf(model, ep_axis="ep")
    apply_fn, params, info = hpf.shard(model, plan, m)
    ids, labels = _batch(4)
    halves = [dict(input_ids=i, labels=t, output_router_logits=True) for i, t in zip(ids.chunk(2), labels.chunk(2), strict=True)]
    (sum(model(**h).loss for h in halves) / 2).backward()
    expected, mine = _grads(model), halves[m["dp"].get_local_rank()]
    worst = {}
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    apply_fn(leaves, **mine).loss.backward()
    mean = hpf.reduce_gradients({k: v.grad for k, v in leaves.items()}, info, m, dp_axis="dp")
    full = hpf.unshard(mean, info)
    worst["dp"] = max(assert_close(full[k], g, f"grad {k}") for k, g in expected.items())
    _, norm = hpf.clip_grad_norm(mean, info, max_norm=1.0)  # each expert counted once, by its owner
    worst["norm"] = assert_close(norm, torch.nn.utils.get_total_norm(list(expected.values())), "grad norm")
    f_apply, f_params, f_info = hpf.fsdp(apply_fn, params, info, m, dp_axis="dp", reshard_after_forward=False)
    f_leaves = {k: v.detach().requires_grad_() for k, v in f_params.items()}
    f_apply(f_leaves, **mine).loss.backward()
    full = hpf.unshard({k: v.grad for k, v in f_leaves.items()}, f_info)
    worst["fsdp"] = max(assert_close(full[k], g, f"fsdp grad {k}") for k, g in expected.items())
    hpf.save(f"{root}/switch", params, info).wait()
    ep4 = mesh((4,), ("ep",))
    _, _, info4 = hpf.shard(model, plan, ep4)
    loaded = hpf.load(f"{root}/switch", info4)
    for k, p in model.named_parameters():
        if k in info4:
            assert torch.equal(loaded.params[k], slice_local(p.detach(), info4[k])), k
    six = build_switch(num_experts=6)
    plain = nn.ModuleList(SwiGLU(HIDDEN, 32) for _ in range(EXPERTS))
    errors = plan_errors({
        "experts % ep": lambda: hpf.shard(six, hpf.ShardingPlan.from_hf(six, ep_axis="ep"), ep4),
        "no forward": lambda: hpf.shard(plain, hpf.ShardingPlan({"": hpf.Experts()}, axes={"ep": "ep"}), ep4),
        "tp inside": lambda: hpf.shard(ListExperts(), hpf.ShardingPlan({"": hpf.Experts(tp_axis="dp")}, axes={"ep": "ep"}), m),
        "to_dtensor": lambda: hpf.to_dtensor(params, info),
    })
    return worst, errors


@pytest.mark.slow
def test_switch_dp_times_ep_fsdp_and_checkpoint(tmp_path):
    results = get_pool(4).run(case_switch_dp_ep, switch_state(), str(tmp_path))
    assert_errors([r[1] for r in results], {
        "experts % ep": "experts.expert_0.wi.weight: 6 stacked tensors (one per expert) are not divisible by mesh axis 'ep'",
        "no forward": "has no forward", "tp inside": "TP inside experts needs the fused", "to_dtensor": "StackedShard"})
    print(results[0][0])
