"""torchtitan 0.3.0's own models and sharding declarations (the ``titan3`` extra) through
``ShardingPlan.from_torchtitan``: tiny Llama 3, Qwen 3 and DeepSeek-V3 built from configs
torchtitan's ``set_*_sharding_config`` filled (``tests/support/titan3_models.py``), sharded at tp 2 and
4, loss and every gradient against the unsharded model under ``.backward()`` and
``torch.func.grad``.

The inner attention is torchtitan's ``ScaledDotProductAttention`` (causal, CPU backward);
torchtitan's language-model default, FlexAttention, is compiled and has no backward on the
CPU, so it is not run here; the shard-time probe says what it checked
(``apply_fn.runtime.checks``).  DeepSeek-V3 is checked under ``.backward()``
only: torchtitan 0.3.0's MoE combines the experts' outputs with a custom op
(``deterministic_scatter_add``) whose autograd has no ``torch.func`` support, which fails the
unsharded model under ``torch.func.grad`` as well.  Its routed experts compute in bf16 (``.bfloat16()`` before
``torch._grouped_mm``); the tests run them in float32 (``Float32Experts``) so the gradients
compare at 1e-4.  Expert parallelism (``enable_ep=True``) is refused, naming the module.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad_and_value
from torch.overrides import TorchFunctionMode

import hp_functional as hpf
from tests.support.helpers import mesh, worst_errors
from tests.support.titan3_models import HAVE_TITAN3, SEQ, VOCAB, WHY

pytestmark = pytest.mark.skipif(not HAVE_TITAN3, reason=WHY)


class Float32Experts(TorchFunctionMode):
    """torchtitan's grouped experts cast to bf16 (``x.bfloat16()``) before ``torch._grouped_mm``;
    under this mode ``Tensor.bfloat16`` returns the tensor unchanged, so the experts compute in
    float32 sharded and unsharded alike.  Everything else is untouched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.bfloat16:
            return args[0]
        return func(*args, **(kwargs or {}))


def _ce(logits, ids):
    return F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())


def _loss(logits, ids, m, vocab_sharded: bool):
    if vocab_sharded:
        assert logits.shape[-1] == VOCAB // m["tp"].size(), logits.shape
        return hpf.vocab_parallel_cross_entropy(logits.flatten(0, 1), ids.flatten(), m, "tp")
    return _ce(logits, ids)


def _check(model, apply_fn, params, info, ids, m, *, vocab_sharded=False, func=True) -> dict[str, float]:
    """Loss and every gradient of the sharded model vs the unsharded one, under ``.backward()``
    and (``func``) ``torch.func.grad``."""
    with Float32Experts():
        ref = _ce(model(ids), ids)
        ref.backward()

    def loss_of(p):
        with Float32Experts():
            return _loss(apply_fn(p, ids), ids, m, vocab_sharded)

    loss = loss_of(params)
    loss.backward()
    runs = {"backward": ({k: p.grad for k, p in params.items()}, loss)}
    if func:
        runs["torch.func"] = grad_and_value(loss_of)(params)
    return worst_errors(runs, ref, info, model)


def case_model(family: str, enable_sp: bool, loss_parallel: bool):
    """One torchtitan model with its declared sharding through ``from_torchtitan``."""
    from tests.support import titan3_models as T

    model = getattr(T, family)(enable_sp=enable_sp)
    plan = hpf.ShardingPlan.from_torchtitan(model, loss_parallel=loss_parallel)
    m = mesh()
    try:
        with Float32Experts():  # the shard-time probe runs the experts too
            apply_fn, params, info = hpf.shard(model, plan, m)
    except hpf.PlanError as exc:  # Qwen 3's 2 KV heads at tp 4: refused before any collective
        return str(exc)
    probe = apply_fn.runtime.checks["probe"]
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))
    worst = _check(model, apply_fn, params, info, ids, m, vocab_sharded=loss_parallel, func=family != "deepseek_v3")
    return worst, probe, {k: str(i.placements) for k, i in info.items()}, plan.explain()


CASES = [("llama3", True, False), ("llama3", False, False), ("llama3", True, True), ("qwen3", True, False),
         ("deepseek_v3", True, False), ("deepseek_v3", False, False)]


@pytest.mark.slow
@pytest.mark.parametrize("family,enable_sp,loss_parallel", CASES,
                         ids=["llama3_sp", "llama3", "llama3_sp_loss_parallel", "qwen3_sp", "deepseek_v3_sp", "deepseek_v3"])
def test_models_with_their_declared_sharding(pool, family, enable_sp, loss_parallel):
    out = pool.run(case_model, family, enable_sp, loss_parallel)[0]
    if family == "qwen3" and pool.world == 4:  # its 2 KV heads (the fused wqkv's groups) do not divide by 4
        assert isinstance(out, str) and "attention.qkv_linear" in out, out
        return
    worst, probe, placements, explain = out
    assert probe.startswith("exact") or (loss_parallel and "laid out differently" in probe), probe
    attn = "layers.0.attention.wq.weight" if family == "deepseek_v3" else "layers.0.attention.qkv_linear.wqkv.weight"
    assert placements[attn] == "(Shard(dim=0),)"
    assert placements["layers.1.attention.wo.weight"] == "(Shard(dim=1),)"
    assert placements["tok_embeddings.weight"] == "(Shard(dim=0),)"
    assert placements["layers.1.attention_norm.weight"] == "(Replicate(),)"
    if family == "deepseek_v3":
        assert placements["layers.1.moe.routed_experts.inner_experts.w1_EFD"] == "(Shard(dim=1),)"
        assert placements["layers.1.moe.routed_experts.inner_experts.w2_EDF"] == "(Shard(dim=2),)"
        assert placements["layers.1.moe.router.gate.weight"] == "(Replicate(),)"
    assert ("SequenceParallel" in explain) == enable_sp, explain
    print(f"{family} tp {pool.world} sp={enable_sp} loss_parallel={loss_parallel}: max |Δgrad| {worst}; probe: {probe}")


@pytest.mark.slow
def test_refused_layouts():
    """What cannot be expressed raises a PlanError naming the module and the layout: torchtitan's
    expert parallelism (its MoE counts tokens per tp rank, routed experts Shard(0) on ``ep``,
    tokens sequence-sharded over the tp ranks), and a model built without a sharding config; the model is only read."""
    from tests.support import titan3_models as T

    model = T.deepseek_v3(enable_ep=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(hpf.PlanError, match=r"layers\.1\.moe.*tokens_per_expert_E.*P.*enable_ep=False"):
        hpf.ShardingPlan.from_torchtitan(model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()), "the model is untouched"
    from torchtitan.models.common import Linear

    bare = Linear.Config(in_features=4, out_features=4).build()  # no set_*_sharding_config: nothing declared
    with pytest.raises(hpf.PlanError, match="declares no torchtitan sharding"):
        hpf.ShardingPlan.from_torchtitan(bare)
