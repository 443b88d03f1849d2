"""Expert parallelism against the unsharded model (fp32, gloo).

HF ``MixtralForCausalLM`` and ``Qwen2MoeForCausalLM`` (shared expert) at ep 2, ep 4 and
ep 2 × tp 2: logits, loss (router auxiliary loss included) and every gradient within 1e-5, with
``.backward()`` and ``torch.func.grad``.  On the experts module itself: every token routed to
one expert (the other ranks receive nothing), the capacity factor's deterministic drops and
their count, and the variable all-to-all's split sizes.  ``explain`` shows the all-to-alls;
bad input raises on every rank before any collective."""

import math

import pytest
import torch
from torch.distributed.tensor import Shard
from torch.func import grad_and_value

import hp_functional as hpf
from hp_functional.core.placement import slice_local
from tests.conftest import get_pool
from tests.support.helpers import assert_close, assert_errors, mesh, plan_errors, rank, world
from tests.support.snapshot import assert_unchanged, snapshot

LAYERS = 2


def moe_config(family: str, **overrides):
    """A tiny HF MoE config: 4 experts, top-2, router aux loss on, eager attention."""
    from transformers import AutoConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=8,
              num_key_value_heads=4, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
              output_router_logits=True, router_aux_loss_coef=0.02, num_experts_per_tok=2)
    if family == "mixtral":
        kw.update(num_local_experts=4)
    else:
        kw.update(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48, decoder_sparse_step=1)
    kw.update(overrides)
    config = AutoConfig.for_model(family, **kw)
    config._attn_implementation = "eager"
    return config


def build_moe(family: str, state=None, **overrides):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(moe_config(family, **overrides))
    if state is not None:
        model.load_state_dict(state)
    return model


def make_moe_state(family: str, **overrides):
    torch.manual_seed(0)
    model = build_moe(family, **overrides)
    with torch.no_grad():  # experts initialised at HF's std are ~0: make their contribution visible
        for name, p in model.named_parameters():
            if "experts" in name or "norm" in name:
                p.normal_(0, 0.1) if "experts" in name else p.uniform_(0.5, 1.5)
    return model.state_dict()


def case_model(family: str, state, shape: tuple, names: tuple, root: str | None = None):
    model = build_moe(family, state)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(7))
    model(input_ids=ids)  # HF installs its router-logit recording hooks on the first call: not ours
    before = snapshot(model)
    m = mesh(shape, names)
    apply_fn, params, info = hpf.shard(model, hpf.ShardingPlan.from_hf(model, ep_axis="ep"), m)
    ep = m["ep"].size()
    key = "model.layers.0.mlp.experts.gate_up_proj"
    assert tuple(params[key].shape)[0] == 4 // ep  # each rank holds its experts only
    tp = m["tp"].size() if "tp" in names else 1  # TP inside the experts: gate/up colwise (packed), down rowwise
    assert tuple(params[key].shape)[1] == 2 * (32 if family == "qwen2_moe" else 64) // tp
    assert info[key].placements == tuple(Shard(0) if n == "ep" else Shard(1) for n in names)
    if "tp" in names and family == "qwen2_moe":  # the shared expert takes the TP plan
        assert info["model.layers.0.mlp.shared_expert.gate_proj.weight"].placements[names.index("tp")] == Shard(0)
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    assert ref.aux_loss is not None and ref.aux_loss > 0
    diffs = {}
    for functional in (False, True):
        if functional:
            grads, (loss, aux) = grad_and_value(
                lambda p: (lambda o: (o.loss, o.aux_loss))(apply_fn(p, input_ids=ids, labels=ids)),
                has_aux=True)(params)
        else:
            out = apply_fn(params, input_ids=ids, labels=ids)
            loss, aux = out.loss, out.aux_loss
            loss.backward()
            grads = {k: p.grad for k, p in params.items()}
        full = hpf.unshard(grads, info)
        diffs[f"loss {functional}"] = assert_close(loss.detach(), ref.loss.detach(), "loss")
        diffs[f"aux {functional}"] = assert_close(aux.detach(), ref.aux_loss.detach(), "aux loss")
        diffs[f"grads {functional}"] = max(assert_close(full[k], p.grad, f"grad {k}") for k, p in model.named_parameters())
    logits = apply_fn(params, input_ids=ids).logits
    diffs["logits"] = assert_close(logits, ref.logits.detach(), "logits")
    model.zero_grad(set_to_none=True)
    odd = ids[:1, :2 * ep + 1]  # a token count ep does not divide (a decoding step's): the last chunks shorter
    ref = model(input_ids=odd, labels=odd)
    ref.loss.backward()
    grads, loss = grad_and_value(lambda p: apply_fn(p, input_ids=odd, labels=odd).loss)(params)
    diffs["uneven loss"] = assert_close(loss, ref.loss.detach(), "loss of an uneven token count")
    full = hpf.unshard(grads, info)
    diffs["uneven grads"] = max(assert_close(full[k], p.grad, f"uneven grad {k}") for k, p in model.named_parameters())
    model.zero_grad(set_to_none=True)
    assert_unchanged(before, snapshot(model))
    if root is not None:  # the checkpoint holds the global experts: loaded at ep 4 (no tp) exactly
        hpf.save(f"{root}/moe", params, info).wait()
        _, _, info4 = hpf.shard(model, hpf.ShardingPlan.from_hf(model, ep_axis="ep"), mesh((4,), ("ep",)))
        loaded = hpf.load(f"{root}/moe", info4)
        for k, p in model.named_parameters():
            assert torch.equal(loaded.params[k], slice_local(p.detach(), info4[k])), k
    return diffs


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
@pytest.mark.slow
def test_moe_models_ep(pool, family):
    diffs = pool.run(case_model, family, make_moe_state(family), (pool.world,), ("ep",))
    print(f"{family} ep {pool.world}: {diffs[0]}")


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
@pytest.mark.slow
def test_moe_models_ep_times_tp(family, tmp_path):
    """TP inside the experts too; a checkpoint saved at ep 2 x tp 2 loads at ep 4 exactly."""
    diffs = get_pool(4).run(case_model, family, make_moe_state(family), (2, 2), ("ep", "tp"), str(tmp_path))
    print(f"{family} ep 2 x tp 2: {diffs[0]}")


def _experts_module(state=None):
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    module = MixtralExperts(moe_config("mixtral"))
    if state is None:
        torch.manual_seed(0)
        with torch.no_grad():
            for p in module.parameters():
                p.normal_(0, 0.1)
    else:
        module.load_state_dict(state)
    return module


def _keep_mask(index: torch.Tensor, ep: int, experts: int, capacity: int) -> torch.Tensor:
    """The capacity rule by hand: per source rank (a contiguous chunk of tokens) and expert, the
    first ``capacity`` assignments in token order are kept."""
    keep = torch.zeros(index.shape, dtype=torch.bool)
    for chunk in torch.arange(index.shape[0]).chunk(ep):
        seen = [0] * experts
        for t in chunk.tolist():
            for j, e in enumerate(index[t].tolist()):
                keep[t, j] = seen[e] < capacity
                seen[e] += 1
    return keep


def case_routing(state, index, capacity_factor):
    """The experts module alone: fixed routing, outputs and gradients (hidden, weights, experts)."""
    module = _experts_module(state)
    drops = []
    plan = hpf.ShardingPlan({"": hpf.Experts(capacity_factor=capacity_factor,
                                             on_drop=lambda fqn, n: drops.append(int(n)))}, axes={"ep": "ep"})
    m = mesh((world(),), ("ep",))
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(index.shape[0], 64, generator=gen)
    weights = torch.rand(index.shape, generator=gen)
    # proved on this batch; a capacity factor computes its own rule, not the module's function: the hand reference
    proof = {"example_inputs": (hidden, index, weights)} if capacity_factor is None else {"verify": False}
    apply_fn, params, info = hpf.shard(module, plan, m, **proof)
    ref_weights = weights
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * (index.shape[0] // world()) * index.shape[1] / 4)
        ref_weights = weights * _keep_mask(index, world(), 4, capacity)
    h, w = hidden.clone().requires_grad_(), ref_weights.clone().requires_grad_()
    ref = module(h, index, w)
    ref.square().sum().backward()
    h2, w2 = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
    out = apply_fn(params, h2, index, w2)
    out.square().sum().backward()
    worst = assert_close(out.detach(), ref.detach(), "output")
    worst = max(worst, assert_close(h2.grad, h.grad, "d hidden"))
    if capacity_factor is None:
        worst = max(worst, assert_close(w2.grad, w.grad, "d weights"))
    full = hpf.unshard({k: p.grad for k, p in params.items()}, info)
    worst = max(worst, *(assert_close(full[k], p.grad, f"grad {k}") for k, p in module.named_parameters()))
    grads = torch.func.grad(lambda p: apply_fn(p, hidden, index, weights).square().sum())(params)
    full = hpf.unshard(grads, info)
    worst = max(worst, *(assert_close(full[k], p.grad, f"func grad {k}") for k, p in module.named_parameters()))
    return worst, drops


def _state():
    return _experts_module().state_dict()


def test_all_tokens_to_one_expert_other_ranks_receive_nothing(pool):
    """Every token's top-2 is experts 0 and 1, both on rank 0: the other ranks receive no rows."""
    index = torch.tensor([[0, 1]] * 8)
    worst, _ = pool.run(case_routing, _state(), index, None)[0]
    print(f"ep {pool.world}, all to experts 0/1: {worst}")


def test_random_routing_matches(pool):
    index = torch.stack([torch.randperm(4, generator=torch.Generator().manual_seed(t))[:2] for t in range(8)])
    print(pool.run(case_routing, _state(), index, None)[0])


# 4 tokens x 2 per rank over 4 experts.  Rank 0's tokens send 4 to expert 0 and 4 to expert 1;
# rank 1's send 3 to expert 0, 2 to expert 1, 2 to expert 2, 1 to expert 3.  Capacity 1.0:
# ceil(1.0 * 4 * 2 / 4) = 2, so 2 + 2 dropped on rank 0 and 1 on rank 1.  Capacity 1.25: 2.5 is not
# whole and rounds up to 3, so 1 + 1 dropped on rank 0 and none on rank 1 (rounded down, 2: 4 and 1).
@pytest.mark.parametrize("factor,dropped", [(1.0, [4, 1]), (1.25, [2, 0])], ids=["whole", "rounded_up"])
def test_capacity_factor_drops_deterministically(factor, dropped):
    """A capacity factor over unbalanced routing: the first ``ceil(c · T_local · k / E)`` assignments
    per (rank, expert) are kept, the rest contribute nothing; each rank reports what it dropped."""
    index = torch.tensor([[0, 1]] * 6 + [[2, 3], [0, 2]])
    results = get_pool(2).run(case_routing, _state(), index, factor)
    assert [r[1] for r in results] == [[n, n] for n in dropped], results  # one report per call, two calls
    print(results[0][0])


def case_explain():
    with torch.device("meta"):
        model = build_moe("mixtral")
    e = hpf.explain(model, hpf.ShardingPlan.from_hf(model, ep_axis="ep"), mesh((world(),), ("ep",)), batch=2, seq=8)
    s = e.schedule
    return str(e), s.count(op="all_to_all", direction="fwd"), s.count(op="all_to_all", direction="bwd"), e.memory.per_rank


def test_explain_shows_dispatch_and_combine():
    text, fwd, bwd, per_rank = get_pool(2).run(case_explain)[0]
    # forward: the split sizes, dispatch and combine per MoE layer; backward: the two reversed
    assert (fwd, bwd) == (3 * LAYERS, 2 * LAYERS), (fwd, bwd)
    assert "Experts" in text, text
    print(text)


def case_bad_input(state):
    model = build_moe("mixtral", state)
    m = mesh((world(),), ("ep",))
    errors = plan_errors({
        "experts % ep": lambda: hpf.shard(build_moe("mixtral", None, num_local_experts=6),
                                          hpf.ShardingPlan.from_hf(build_moe("mixtral", None, num_local_experts=6),
                                                                   ep_axis="ep"), m),
        "no ep axis": lambda: hpf.shard(model, hpf.ShardingPlan.from_hf(model, ep_axis="experts"), m),
        "no experts": lambda: hpf.shard(model, hpf.ShardingPlan({"model.layers.0.self_attn": hpf.Experts()},
                                                                axes={"ep": "ep"}), m),
        "no ep_axis": lambda: hpf.ShardingPlan({"model.layers.*.mlp.experts": hpf.Experts()}),
    })
    return errors


def test_bad_input():
    errors = get_pool(4).run(case_bad_input, make_moe_state("mixtral"))
    expect = {"experts % ep": "gate_up_proj", "no ep axis": "'experts' is not in the mesh",
              "no experts": "Experts needs stacked expert weights", "no ep_axis": "needs the plan's ep_axis"}
    assert_errors(errors, expect)


def case_dp_ep(state):
    """dp 2 × ep 2: each dp rank routes its own rows; gradients averaged over dp
    (``reduce_gradients``, or ``hpf.fsdp`` over dp on top of the expert sharding) equal the
    unsharded model's mean over the dp batches (the aux loss is per batch, as under any DP).
    Checkpointed blocks would lose the aux loss's gradient: refused, not silently wrong."""
    model = build_moe("mixtral", state)
    m = mesh((2, 2), ("dp", "ep"))
    apply_fn, params, info = hpf.shard(model, hpf.ShardingPlan.from_hf(model, ep_axis="ep"), m)
    ids = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(7))
    halves = ids.chunk(2)
    (sum(model(input_ids=h, labels=h).loss for h in halves) / 2).backward()
    rows = halves[m["dp"].get_local_rank()]
    worst = {}
    grads = torch.func.grad(lambda p: apply_fn(p, input_ids=rows, labels=rows).loss)(params)
    full = hpf.unshard(hpf.reduce_gradients(grads, info, m, dp_axis="dp"), info)
    worst["dp"] = max(assert_close(full[k], p.grad, f"grad {k}") for k, p in model.named_parameters())
    f_apply, f_params, f_info = hpf.fsdp(apply_fn, params, info, m, dp_axis="dp", reshard_after_forward=False)
    assert f_info["model.layers.0.mlp.experts.gate_up_proj"].axes["ep"] == Shard(0)
    grads = torch.func.grad(lambda p: f_apply(p, input_ids=rows, labels=rows).loss)(f_params)
    full = hpf.unshard(grads, f_info)
    worst["fsdp"] = max(assert_close(full[k], p.grad, f"fsdp grad {k}") for k, p in model.named_parameters())
    errors = plan_errors({"fsdp reshard": lambda: hpf.fsdp(apply_fn, params, info, m, dp_axis="dp"),
                          "checkpoint": lambda: hpf.shard(model, hpf.ShardingPlan.from_hf(model, ep_axis="ep"), m,
                                                          remat=True)})
    return worst, errors


def test_dp_times_ep_and_fsdp():
    results = get_pool(4).run(case_dp_ep, make_moe_state("mixtral"))
    assert_errors([r[1] for r in results], {"fsdp reshard": "output_router_logits", "checkpoint": "output_router_logits"})
    print(results[0][0])


def case_ep_shares_dp(state):
    """ep sharing ranks with dp: the 4 dp ranks as an expert mesh (edp 2, ep 2), every rank routing
    its own quarter of the batch (``tokens="local"``).  Expert gradients arrive summed over ep
    (its ``SummedOver`` facet); ``reduce_gradients`` over ep then edp (or ``hpf.fsdp`` over edp, then
    over ep) equals the unsharded mean over the four batches, with ``.backward()`` and
    ``torch.func.grad``.  A plan whose ep ranks share their tokens refuses ep as a data axis."""
    model = build_moe("mixtral", state)
    dense = mesh((4,), ("dp",))
    m = hpf.expert_mesh(dense, ep=2)
    assert m["ep"].mesh.tolist() == [0, 1] if rank() < 2 else [2, 3]  # ep groups: consecutive ranks
    apply_fn, params, info = hpf.shard(model, hpf.ShardingPlan.from_hf(model, ep_axis="ep", ep_tokens="local"), m)
    key = "model.layers.0.mlp.experts.gate_up_proj"
    assert info[key].axes_of(hpf.SummedOver) == ("ep",) and not info["model.embed_tokens.weight"].facets
    ids = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(7))
    parts = ids.chunk(4)
    (sum(model(input_ids=h, labels=h).loss for h in parts) / 4).backward()
    rows = parts[rank()]
    worst = {}
    for functional in (False, True):
        if functional:
            grads = torch.func.grad(lambda p: apply_fn(p, input_ids=rows, labels=rows).loss)(params)
        else:
            leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
            apply_fn(leaves, input_ids=rows, labels=rows).loss.backward()
            grads = {k: v.grad for k, v in leaves.items()}
        mean = hpf.reduce_gradients(hpf.reduce_gradients(grads, info, m, dp_axis="ep"), info, m, dp_axis="edp")
        full = hpf.unshard(mean, info)
        worst[f"grads {functional}"] = max(assert_close(full[k], p.grad, k) for k, p in model.named_parameters())
    f_apply, f_params, f_info = hpf.fsdp(apply_fn, params, info, m, dp_axis="edp", reshard_after_forward=False)
    f_grads = torch.func.grad(lambda p: f_apply(p, input_ids=rows, labels=rows).loss)(f_params)
    full = hpf.unshard(hpf.reduce_gradients(f_grads, f_info, m, dp_axis="ep"), f_info)
    worst["fsdp"] = max(assert_close(full[k], p.grad, f"fsdp {k}") for k, p in model.named_parameters())
    _, _, shared = hpf.shard(model, hpf.ShardingPlan.from_hf(model, ep_axis="ep"), m)
    errors = plan_errors({"shared tokens": lambda: hpf.reduce_gradients(grads, shared, m, dp_axis="ep"),
                          "tokens": lambda: hpf.shard(model, hpf.ShardingPlan(
                              {"model.layers.*.mlp.experts": hpf.Experts(tokens="mine")}, axes={"ep": "ep"}), m),
                          "ep divides": lambda: hpf.expert_mesh(dense, ep=3)})
    return worst, errors


@pytest.mark.slow
def test_ep_shares_ranks_with_dp():
    results = get_pool(4).run(case_ep_shares_dp, make_moe_state("mixtral"))
    assert_errors([r[1] for r in results], {"shared tokens": "experts.gate_up_proj", "tokens": "tokens must be one of",
                                            "ep divides": "ep=3 must divide axis 'dp'"})
    print(results[0][0])
