"""torchtitan's own models and plans (the installed package, the ``titan`` extra) through
``ShardingPlan.from_torch``: the plan dicts torchtitan's ``parallelize`` functions hand to
``parallelize_module`` (recorded, not applied: ``tests/support/torchtitan_real.py``) given to ``shard``.

* Llama 3 ``apply_tp`` (sequence parallel, gathered head and loss parallel) and dense Qwen 3
  ``apply_non_moe_tp`` at tp 2 and 4;
* DeepSeek-V3 (MLA with its global ``n_heads`` expand, torchtitan's ``NoParallel``, a MoE layer
  with shared experts) with ``apply_non_moe_tp`` + ``apply_moe_ep_tp`` at tp 2 (MoE
  ``TensorParallel``), ep 2 (``ExpertParallel``) and ep 2 × tp 2 (``ExpertTensorParallel``);

loss and every gradient against the unsharded model, under ``.backward()`` and
``torch.func.grad``.  DeepSeek's MoE counts tokens into a buffer in its forward
(``tokens_per_expert.add_``), which ``torch.func`` refuses on a captured tensor: the MoE cases
pass the buffers through ``apply_fn(..., buffers=)`` under ``torch.func.grad`` and compare the
counts it returns with the unsharded model's after its forward.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad_and_value

import hp_functional as hpf
from tests.conftest import get_pool
from tests.support.helpers import assert_close, mesh, worst_errors
from tests.support.torchtitan_real import HAVE_TITAN, SEQ, VOCAB, WHY

pytestmark = [pytest.mark.skipif(not HAVE_TITAN, reason=WHY), pytest.mark.slow]


def _ce(logits, ids):
    return F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())


def _check(model, apply_fn, params, info, ids, m, *, vocab_sharded: bool, func: bool, ctx,
           state=None) -> dict[str, float]:
    """Loss and every gradient of the sharded model vs the unsharded one (under ``ctx``); with
    ``state`` (``hpf.buffers``, taken before any forward), ``torch.func.grad`` runs with the
    buffers passed through ``apply_fn`` and those it returns equal the model's after its forward."""
    with ctx():
        ref = _ce(model(ids), ids)
        ref.backward()

    def loss_of(p, buffers=None):
        with ctx():
            logits = apply_fn(p, ids) if buffers is None else apply_fn(p, ids, buffers=buffers)
        if buffers is not None:
            logits, after = logits
            return _loss(logits, ids, m, vocab_sharded), after
        return _loss(logits, ids, m, vocab_sharded)

    loss = loss_of(params)
    loss.backward()
    runs = {"backward": ({k: p.grad for k, p in params.items()}, loss)}
    if state is not None:
        grads, (value, after) = grad_and_value(loss_of, has_aux=True)(params, state)
        runs["torch.func + buffers"] = grads, value
        for k, b in model.named_buffers():
            assert_close(after[k], b, f"buffer {k} after the forward")
        assert any(not torch.equal(after[k], state[k]) for k in state), "the forward counted nothing"
    elif func:
        runs["torch.func"] = grad_and_value(loss_of)(params)
    return worst_errors(runs, ref, info, model)


def _loss(logits, ids, m, vocab_sharded: bool):
    if vocab_sharded:
        assert logits.shape[-1] == VOCAB // m["tp"].size(), logits.shape
        return hpf.vocab_parallel_cross_entropy(logits.flatten(0, 1), ids.flatten(), m, "tp")
    return _ce(logits, ids)


def case_dense(family: str, loss_parallel: bool):
    """Llama 3 / Qwen 3 with torchtitan's own TP plan function, recorded and given to ``from_torch``."""
    from contextlib import nullcontext

    from tests.support import torchtitan_real as T

    if family == "llama3":
        from torchtitan.models.llama3.infra.parallelize import apply_tp

        model = T.llama3()
        plans = T.parallelize_plans(apply_tp, model, "tp", loss_parallel, False)
    else:
        from torchtitan.models.qwen3.infra.parallelize import apply_non_moe_tp

        model = T.qwen3()
        plans = T.parallelize_plans(apply_non_moe_tp, model, "tp", loss_parallel, False, False, False)
    m = mesh()
    apply_fn, params, info = hpf.shard(model, hpf.ShardingPlan.from_torch(plans["tp"]), m)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))
    worst = _check(model, apply_fn, params, info, ids, m, vocab_sharded=loss_parallel, func=True, ctx=nullcontext)
    return worst, {k: str(i.placements) for k, i in info.items()}


@pytest.mark.parametrize("family,loss_parallel", [("llama3", False), ("llama3", True), ("qwen3", False)],
                         ids=["llama3", "llama3_loss_parallel", "qwen3"])
def test_dense_models_with_torchtitans_tp_plan(pool, family, loss_parallel):
    out = pool.run(case_dense, family, loss_parallel)
    worst, placements = out[0]
    assert placements["layers.0.attention.wq.weight"] == "(Shard(dim=0),)"
    assert placements["layers.1.feed_forward.w2.weight"] == "(Shard(dim=1),)"
    assert placements["tok_embeddings.weight"] == "(Shard(dim=0),)"
    print(f"{family} tp {pool.world} loss_parallel={loss_parallel}: max |Δgrad| {worst}")


def deepseek_plans(model, layout: str) -> tuple[dict, tuple[int, ...], tuple[str, ...]]:
    """(every plan entry torchtitan's DeepSeek-V3 functions hand over, mesh shape, mesh names)."""
    from torchtitan.models.deepseek_v3.infra.parallelize import apply_non_moe_tp
    from torchtitan.models.llama4.infra.parallelize import apply_moe_ep_tp

    from tests.support import torchtitan_real as T

    entries: dict = {}
    if layout in ("tp", "ep_tp"):
        entries.update(T.parallelize_plans(apply_non_moe_tp, model, "tp", False, False, False)["tp"])
    meshes = {"tp": ("tp", None, None, None), "ep": (None, "ep", None, None), "ep_tp": ("tp", "ep", "etp", "ep_etp")}
    for plan in T.parallelize_plans(apply_moe_ep_tp, model, *meshes[layout]).values():
        entries.update(plan)
    shape, names = {"tp": ((2,), ("tp",)), "ep": ((2,), ("ep",)), "ep_tp": ((2, 2), ("ep", "tp"))}[layout]
    return entries, shape, names


def case_deepseek(layout: str):
    """DeepSeek-V3 (MLA, MoE) with torchtitan's plans: ``NoParallel``, the MLA expand by the
    global ``n_heads`` (localised by ``from_torch``), and the MoE experts styles."""
    from tests.support import torchtitan_real as T

    model = T.deepseek_v3()
    entries, shape, names = deepseek_plans(model, layout)
    m = mesh(shape, names)
    plan = hpf.ShardingPlan.from_torch(entries, tp_axis="tp", ep_axis="ep" if "ep" in names else None)
    apply_fn, params, info = hpf.shard(model, plan, m)
    state, _ = hpf.buffers(apply_fn)  # before any forward: the model's own initial buffers
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))
    worst = _check(model, apply_fn, params, info, ids, m, vocab_sharded=False, func=False, ctx=T.CpuHistc, state=state)
    return worst, {k: str(i.placements) for k, i in info.items() if "moe" in k or "wkv" in k}


@pytest.mark.parametrize("layout", ["tp", "ep", "ep_tp"])
def test_deepseek_v3_with_torchtitans_plans(layout):
    world = 4 if layout == "ep_tp" else 2
    worst, placements = get_pool(world).run(case_deepseek, layout)[0]
    experts = placements["layers.1.moe.experts.w1"]
    assert experts == {"tp": "(Shard(dim=1),)", "ep": "(Shard(dim=0),)", "ep_tp": "(Shard(dim=0), Shard(dim=1))"}[layout]
    if layout != "ep":  # torchtitan's NoParallel: replicated
        assert placements["layers.0.attention.wkv_a.weight"] == placements["layers.1.moe.router.gate.weight"]
        assert "Shard" not in placements["layers.1.moe.router.gate.weight"]
    print(f"deepseek {layout}: max |Δgrad| {worst}")


def case_context(strategy: str, tp: bool):
    """torchtitan's Llama 3 ``Transformer(tokens, positions=)`` with context parallelism declared
    through ``hpf.ContextInputs`` (no HF names): the full batch on every rank, each keeps its
    zigzag chunk of ``tokens`` and gets the global ``positions``; ``labels=`` gives the mean loss
    over the whole sequence.  With ``tp``: torchtitan's own ``apply_tp`` plan (sequence parallel)
    on a (cp, tp) mesh."""
    from torchtitan.models.llama3.infra.parallelize import apply_tp

    from tests.support import torchtitan_real as T

    model = T.llama3(max_seq_len=64)  # the shard-time probe's batch is 8 x world size long
    entries = T.parallelize_plans(apply_tp, model, "tp", False, False)["tp"] if tp else {}
    m = mesh((2, 2), ("cp", "tp")) if tp else mesh((2,), ("cp",))
    cp = hpf.ContextInputs(sequence={"tokens": 1}, positions="positions")
    plan = hpf.ShardingPlan.from_torch(entries)
    if tp:  # torchtitan's plan gives the attention module a PrepareModuleInput: one style per module
        with pytest.raises(hpf.PlanError, match="layers.0.attention.*loses to the more specific"):
            hpf.shard(model, plan.with_entries({**plan.entries, "layers.*.attention": hpf.ContextParallel(strategy)},
                                               axes={"cp": "cp"}, settings={"cp_inputs": cp}), m)
    plan = plan.with_entries({**plan.entries, "layers.*.attention.inner_attention": hpf.ContextParallel(strategy)},
                             axes={"cp": "cp"}, settings={"cp_inputs": cp})
    apply_fn, params, info = hpf.shard(model, plan, m)
    assert apply_fn.runtime.checks["probe"].startswith("exact"), apply_fn.runtime.checks
    gen = torch.Generator().manual_seed(7)
    ids, labels = torch.randint(0, VOCAB, (2, 2 * SEQ), generator=gen), torch.randint(0, VOCAB, (2, 2 * SEQ), generator=gen)
    logits = model(ids)
    ref = _ce(logits, labels)
    ref.backward()
    out, loss = apply_fn(params, ids, labels=labels)
    worst = {"logits": assert_close(hpf.cp_unshard(out, m, 1), logits.detach(), "logits")}
    loss.backward()
    runs = {"backward": ({k: p.grad for k, p in params.items()}, loss),
            "torch.func": grad_and_value(lambda p: apply_fn(p, ids, labels=labels)[1])(params)}
    for label, (grads, value) in runs.items():
        assert_close(value, ref.detach(), f"{label} loss")
        full = hpf.unshard(grads, info)
        assert set(full) == {k for k, _ in model.named_parameters()}, "every parameter has a gradient"
        worst[label] = max(assert_close(full[k], p.grad, f"{label} grad {k}", atol=1e-5 * p.grad.abs().max().item(),
                                        rtol=1e-4) for k, p in model.named_parameters())
    return worst


@pytest.mark.parametrize("tp", [False, True], ids=["cp2", "cp2_tp2"])
@pytest.mark.parametrize("strategy", ["ring", "allgather"])
def test_context_parallel_on_torchtitans_llama(strategy, tp):
    print(f"llama3 {strategy} {'cp 2 x tp 2' if tp else 'cp 2'}: max |diff| "
          f"{get_pool(4 if tp else 2).run(case_context, strategy, tp)[0]}")


def case_bad_input():
    """torchtitan styles with no counterpart, and a head count the tp axis does not divide: a
    PlanError naming the entry or the attribute, before any collective; the model untouched."""
    from torchtitan.distributed.expert_parallel import ReordererSequenceParallel

    from tests.support import torchtitan_real as T
    from tests.support.helpers import plan_errors

    model = T.deepseek_v3(n_heads=3)
    entries, _, _ = deepseek_plans(model, "tp")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    errors = plan_errors({
        "reorderer": lambda: hpf.ShardingPlan.from_torch({"layers.1.moe.reorderer": ReordererSequenceParallel()}),
        "heads": lambda: hpf.shard(model, hpf.ShardingPlan.from_torch(entries), mesh()),
    })
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()), "the model is untouched"
    return errors


def test_bad_input():
    errors = get_pool(2).run(case_bad_input)[0]
    kind, message = errors["reorderer"]
    assert "'layers.1.moe.reorderer'" in message and "ReordererSequenceParallel" in message, message
    assert "expert_tensor_parallel_degree" in message, message
    kind, message = errors["heads"]
    assert "layers.0.attention" in message and "n_heads=3" in message, message
