"""``hpf.as_module(apply_fn, params)``: the functional pair as an ``nn.Module`` for module-based tools.

Its parameters share storage with the pytree, its forward is ``apply_fn``, and ``torch.optim``,
``torch.compile`` and FSDP2's ``fully_shard`` (over data parallel, with TP from ``shard()``) take
it and train like the unsharded model.  ``torch.optim`` over ``params.values()`` works without it.
"""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import hp_functional as hpf
from tests.support.helpers import assert_close, mesh
from tests.support.models import MLP, PLANS, build_llama, make_llama_state, make_mlp_state
from tests.support.snapshot import assert_unchanged, snapshot

LR = 1e-2


def batch(seed: int, rows: int = 2, seq: int = 8) -> torch.Tensor:
    return torch.randint(0, 128, (rows, seq), generator=torch.Generator().manual_seed(seed))


def grads_of(m: nn.Module) -> dict[str, torch.Tensor]:
    grads = {k: p.grad for k, p in m.named_parameters()}
    m.zero_grad(set_to_none=True)
    return grads


# --- 1. the module itself: storage, names, forward, backward, torch.optim, params(), errors; torch.compile ---


def case_module(state):
    model = build_llama(state)
    before = snapshot(model)
    apply_fn, params, info = hpf.shard(model, hpf.ShardingPlan.from_hf(model), mesh())
    leaves = dict(params)
    m = hpf.as_module(apply_fn, params)
    assert dict(params) == leaves and all(params[k] is v for k, v in leaves.items()), "as_module changed the pytree"

    # parameters: new nn.Parameter objects on the pytree's storage, named and ordered like the pytree
    named = dict(m.named_parameters())
    assert list(named) == list(params)
    for k, p in named.items():
        assert isinstance(p, nn.Parameter) and p is not params[k], k
        assert p.data_ptr() == params[k].data_ptr() and p.shape == params[k].shape, f"{k}: not the pytree's storage"
        assert p.requires_grad == params[k].requires_grad, k
    assert list(m.state_dict()) == list(params)
    layer = m.get_submodule("model.layers.0")
    assert layer is m.model.layers[0] and isinstance(m.model.layers, nn.ModuleList) and len(m.model.layers) == 2
    assert dict(layer.named_parameters()) == {k[len("model.layers.0."):]: p for k, p in named.items()
                                             if k.startswith("model.layers.0.")}
    assert not any(isinstance(c, type(model)) for c in m.modules()), "the module holds the user's model"

    # params(): the functional form again, the same objects as named_parameters
    again = m.params()
    assert list(again) == list(params) and all(again[k] is named[k] for k in named)

    # forward = apply_fn(params); backward puts on m's parameters the gradients torch.func.grad gives
    ids = batch(1)
    out = m(input_ids=ids, labels=ids)
    expected = apply_fn(params, input_ids=ids, labels=ids)
    assert_close(out.loss, expected.loss.detach(), "module vs apply_fn loss", atol=0, rtol=0)
    assert_close(out.logits, expected.logits.detach(), "module vs apply_fn logits", atol=0, rtol=0)
    assert_close(out.loss, model(input_ids=ids, labels=ids).loss.detach(), "module vs unsharded loss")
    out.loss.backward()
    func_grads = torch.func.grad(lambda p: apply_fn(p, input_ids=ids, labels=ids).loss)(params)
    grads = {k: p.grad for k, p in m.named_parameters()}
    assert all(params[k].grad is None for k in params), "gradients landed on the pytree's tensors, not the module's"
    for k in params:
        assert grads[k] is not None, f"no gradient for {k}"
        assert_close(grads[k], func_grads[k], f"module .backward() vs torch.func.grad: {k}", atol=1e-6, rtol=1e-6)

    # torch.optim over m.parameters() steps the pytree itself (same storage); the same as AdamW on copies
    copies = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    for k, p in m.named_parameters():
        p.grad = grads[k].clone()
        copies[k].grad = grads[k].clone()
    opt, ref_opt = torch.optim.AdamW(m.parameters(), lr=LR), torch.optim.AdamW(copies.values(), lr=LR)
    start = {k: v.detach().clone() for k, v in params.items()}
    opt.step()
    ref_opt.step()
    for k, p in m.named_parameters():
        assert not torch.equal(params[k], start[k]), f"{k}: the pytree leaf did not move"
        assert p.data_ptr() == params[k].data_ptr(), k
        assert_close(params[k], copies[k].detach(), f"pytree leaf after m's AdamW step vs AdamW on a copy: {k}",
                     atol=0, rtol=0)
    assert_close(m(input_ids=ids, labels=ids).loss, apply_fn(params, input_ids=ids, labels=ids).loss.detach(),
                 "module vs apply_fn after the step", atol=0, rtol=0)
    assert_close(apply_fn(m.params(), input_ids=ids, labels=ids).loss, apply_fn(params, input_ids=ids, labels=ids).loss,
                 "apply_fn(m.params()) vs apply_fn(params)", atol=0, rtol=0)

    # errors: not the pytree shard() returned; DTensors (to_dtensor) instead of local shards
    with pytest.raises(hpf.PlanError, match=r"missing \['lm_head.weight'\]"):
        hpf.as_module(apply_fn, {k: v for k, v in params.items() if k != "lm_head.weight"})
    with pytest.raises(hpf.PlanError, match="must be a dict"):
        hpf.as_module(apply_fn, list(params.values()))
    with pytest.raises(hpf.PlanError, match="'model.embed_tokens.weight' is a DTensor"):
        hpf.as_module(apply_fn, hpf.to_dtensor(params, info))(input_ids=ids)
    assert_unchanged(before, snapshot(model))


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.slow
def test_as_module_shares_storage_and_runs_apply_fn(pool):
    pool.run(case_module, make_llama_state())


def case_compile(state):
    """torch.compile(as_module(...)) on a TP MLP (test_compile.py compiles apply_fn on Llama; tracing
    Llama costs ~15 s here): one graph through the containers, no break, equal to eager."""
    from torch._dynamo.utils import counters

    model = MLP()
    model.load_state_dict(state)
    apply_fn, params, _ = hpf.shard(model, PLANS["tp"], mesh())
    m = hpf.as_module(apply_fn, params)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)  # fullgraph: a graph break raises
    assert list(compiled.state_dict()) == ["_orig_mod." + k for k in params]
    g = torch.Generator().manual_seed(4)
    for step in range(2):
        x = torch.randn(2, 4, 16, generator=g)
        eager = m(x)
        (eager**2).sum().backward()
        eager_grads = grads_of(m)
        with torch.compiler.set_stance("fail_on_recompile" if step else "default"):  # new values, same graph
            got = compiled(x)
        (got**2).sum().backward()
        compiled_grads = grads_of(m)
        assert_close(got, eager.detach(), f"step {step}: compiled vs eager output", atol=1e-6, rtol=1e-6)
        assert_close(eager, apply_fn(params, x).detach(), f"step {step}: module vs apply_fn", atol=0, rtol=0)
        if step == 0:
            assert_close(eager, model(x).detach(), "module vs unsharded output")
        for k in params:
            assert compiled_grads[k] is not None, f"step {step}: no compiled gradient for {k}"
            assert_close(compiled_grads[k], eager_grads[k], f"step {step}: compiled vs eager grad {k}", atol=1e-6,
                         rtol=1e-6)
        with torch.no_grad():  # an in-place update of the pytree: the compiled module sees it
            for p in params.values():
                p.mul_(0.9)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not sum(counters["graph_break"].values()), dict(counters["graph_break"])


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.slow
def test_compiled_as_module_is_one_graph_equal_to_eager(pool):
    pool.run(case_compile, make_mlp_state())


# --- 2. torch.optim over params.values() directly ---


def case_optim_on_pytree(state, steps):
    model = build_llama(state)
    apply_fn, params, info = hpf.shard(model, hpf.ShardingPlan.from_hf(model), mesh())
    opt, ref_opt = torch.optim.AdamW(params.values(), lr=LR), torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(steps):
        ids = batch(10 + step)
        loss = apply_fn(params, input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref = model(input_ids=ids, labels=ids).loss
        ref.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert_close(loss.detach(), ref.detach(), f"step {step}: loss vs unsharded")
    full = hpf.unshard(params, info)
    for k, p in model.named_parameters():
        assert_close(full[k], p.detach(), f"after {steps} AdamW steps: {k}", atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_torch_optim_over_params_values_trains_like_unsharded(pool):
    pool.run(case_optim_on_pytree, make_llama_state(), 4)


# --- 3. FSDP2 fully_shard over as_module on dp, TP from shard() on tp ---


def fsdp_layout(info: hpf.ShardInfo, local: torch.Tensor) -> hpf.ShardInfo:
    """``info`` (replicated on dp, TP on tp) with dim 0 sharded over dp the way FSDP2 shards a
    TP-local tensor: interleaved (``_StridedShard``) when tp shards dim 0 too."""
    dp_placement, tp_placement = info.placements
    assert dp_placement == Replicate(), info
    tp_rows = isinstance(tp_placement, Shard) and tp_placement.dim == 0
    dp_placement = _StridedShard(0, split_factor=info.mesh["tp"].size()) if tp_rows else Shard(0)
    return replace(info, placements=(dp_placement, tp_placement), local_shape=local.shape)


def case_fully_shard(state, steps):
    """fully_shard each block then the root over dp, TP from shard() on tp; each dp rank trains on its
    slice of the global batch with torch.optim.AdamW; the dp-mean loss and the gathered parameters
    follow the unsharded model trained on the full batch."""
    from torch.distributed.fsdp import fully_shard

    m2 = mesh((2, 2), ("dp", "tp"))
    dp = m2["dp"]
    model = build_llama(state)
    apply_fn, params, info = hpf.shard(model, hpf.ShardingPlan.from_hf(model), m2)
    m = hpf.as_module(apply_fn, params)
    for layer in m.model.layers:
        fully_shard(layer, mesh=dp)
    fully_shard(m, mesh=dp)
    blocks = [k for k in params if k.startswith("model.layers.")]
    for k, p in m.params().items():  # FSDP2 holds a dp shard of each TP-local leaf
        assert isinstance(p, DTensor) and p.device_mesh == dp and p.placements == (Shard(0),), (k, p)
        assert p.to_local().shape[0] == params[k].shape[0] // dp.size(), (k, p.to_local().shape, params[k].shape)
        assert_close(p.full_tensor(), params[k].detach(), f"FSDP2's shards of {k} gather to the TP-local shard",
                     atol=0, rtol=0)
    opt, ref_opt = torch.optim.AdamW(m.parameters(), lr=LR), torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(steps):
        ids = batch(20 + step, rows=2 * dp.size())
        local = ids.chunk(dp.size())[dp.get_local_rank()]
        out = m(input_ids=local, labels=local)
        now = m.params()  # the blocks' post-forward hooks resharded them: apply_fn ran between the hooks
        assert all(isinstance(now[k], DTensor) for k in blocks), [k for k in blocks if not isinstance(now[k], DTensor)]
        out.loss.backward()
        for k, p in m.named_parameters():  # reduce-scattered over dp
            assert isinstance(p, DTensor) and isinstance(p.grad, DTensor) and p.grad.placements == (Shard(0),), k
        opt.step()
        opt.zero_grad()
        mean = out.loss.detach().clone()
        dist.all_reduce(mean, group=dp.get_group())
        ref = model(input_ids=ids, labels=ids).loss
        ref.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert_close(mean / dp.size(), ref.detach(), f"step {step}: dp-mean loss vs unsharded full-batch loss")
    sharded = {k: p.to_local() for k, p in m.params().items()}
    tp_local = {k: p.full_tensor() for k, p in m.params().items()}
    full = hpf.unshard(tp_local, info)
    for k, p in model.named_parameters():
        assert_close(full[k], p.detach(), f"after {steps} AdamW steps under fully_shard: {k}", atol=1e-4, rtol=1e-4)

    # to_dtensor with shard_info: global DTensors on (dp, tp) for a state dict, from the gathered
    # TP-local shards (replicated on dp) or, without a gather, from FSDP2's own shards
    replicated = hpf.to_dtensor(tp_local, info)
    fsdp_info = {k: fsdp_layout(info[k], v) for k, v in sharded.items()}
    on_dp_tp = hpf.to_dtensor(sharded, fsdp_info)
    for k, p in model.named_parameters():
        assert replicated[k].device_mesh == m2 and replicated[k].placements == info[k].placements, k
        assert replicated[k].shape == p.shape and on_dp_tp[k].shape == p.shape, k
        assert_close(replicated[k].full_tensor(), full[k], f"to_dtensor(TP-local shards): {k}", atol=0, rtol=0)
        assert_close(on_dp_tp[k].full_tensor(), full[k], f"to_dtensor(FSDP2 shards, {fsdp_info[k].placements}): {k}",
                     atol=0, rtol=0)


@pytest.mark.parametrize("pool", [4], indirect=True)
@pytest.mark.slow
def test_fully_shard_over_as_module_trains_like_unsharded(pool):
    pool.run(case_fully_shard, make_llama_state(), 5)
