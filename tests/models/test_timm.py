"""timm's own ViT (``vit_tiny_patch16_224`` made tiny: 32 px, 8 px patches, 2 blocks, width 32,
4 heads, random weights), sharded by the hand plan of docs/diffusion-and-timm.md and by
``auto_plan``: loss and every gradient against the unsharded model at tp 2 and 4,
``torch.func.grad`` and ``.backward()``, every rank a thread (``hpf.emulate``).

timm imports torchvision, whose wheels on these machines match torch 2.14.1 only, so this runs in
``.venv-newest`` (``make timm-newest``) and is skipped where timm does not import."""

import pytest
import torch
import torch.nn.functional as F

import hp_functional as hpf
from hp_functional.tools.sweep_extras import hand_plan
from tests.support.helpers import assert_close

try:
    import timm
except Exception as exc:  # noqa: BLE001 - ImportError, or torchvision built for another torch (a RuntimeError)
    pytest.skip(f"timm does not import here: {type(exc).__name__}: {str(exc)[:120]}", allow_module_level=True)

pytestmark = pytest.mark.slow  # 0.5-2 s a case; `make timm-newest` runs them (not make test-newest's fast subset)


def _vit(qk_norm: bool = False):
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2, num_classes=5,
                             embed_dim=32, num_heads=4, qk_norm=qk_norm).eval()


def _exact(model, plan_of, n: int, given: bool = False) -> list:
    """Loss and every gradient equal the unsharded model's on every rank; returns the plans.
    ``given``: shard with ``example_inputs`` (the batch)."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 3, 32, 32, generator=g), torch.tensor([1, 3])
    model.zero_grad()
    ref = F.cross_entropy(model(x), y)
    ref.backward()

    def run(mesh):
        plan = plan_of(model, mesh, x)
        apply_fn, params, info = hpf.shard(model, plan, mesh, example_inputs=x if given else None)
        assert not given or "example_inputs" in apply_fn.runtime.checks["dataflow"], apply_fn.runtime.checks
        grads, loss = torch.func.grad_and_value(lambda p: F.cross_entropy(apply_fn(p, x), y))(params)
        leaves = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
        F.cross_entropy(apply_fn(leaves, x), y).backward()
        return plan, loss.detach(), hpf.unshard(grads, info), hpf.unshard({k: v.grad for k, v in leaves.items()}, info)

    ranks = hpf.emulate(run, (n,), ("tp",))
    for _, loss, *both in ranks:
        assert_close(loss, ref.detach(), f"tp {n} loss")
        for how, grads in zip(("torch.func.grad", ".backward()"), both, strict=True):
            for k, p in model.named_parameters():
                assert_close(grads[k], p.grad, f"tp {n} {how} grad {k}", atol=1e-6, rtol=1e-4)
    return [r[0] for r in ranks]


def _hand(model, mesh, x):
    return hand_plan("timm:vit_tiny_patch16_224")


def _auto(model, mesh, x):
    return hpf.auto_plan(model, mesh, example_inputs=x)


def test_vit_hand_plan_is_exact_at_tp2():
    _exact(_vit(), _hand, 2)


def test_vit_hand_plan_is_exact_at_tp4():
    _exact(_vit(), _hand, 4)


def test_vit_auto_plan_packs_qkv_and_is_exact():
    """auto_plan finds the hand plan: the fused qkv packed in three (the shape audit accepts its
    ``(B, N, 3, H, D)`` view), ``num_heads`` and ``attn_dim`` divided; the classifier head replicated."""
    for n in (2, 4):
        plan = _exact(_vit(), _auto, n)[0]
        assert plan.entries["blocks.*.attn.qkv"] == hpf.Colwise(packed=3)
        assert set(plan.entries["blocks.*.attn"].attrs) == {"num_heads", "attn_dim"}


def test_vit_with_qk_norm_auto_plan_reduces_the_norms_and_is_exact():
    plan = _exact(_vit(qk_norm=True), _auto, 2)[0]
    assert plan.entries["blocks.*.attn.q_norm"] == hpf.NoParallel(reduce_grads=True)


def test_vit_with_qk_norm_hand_plan_without_the_norms_is_refused_without_example_inputs():
    """Left unplanned, the per-head q_norm/k_norm would get per-rank partial gradients (8.6e-3 at
    tp 2); with no batch to synthesize (a patch embedding first) neither the dataflow pass nor the
    probe sees their data, so shard() refuses, naming a norm and the fixes."""
    with pytest.raises(hpf.PlanError, match=r"blocks\.0\.attn\.q_norm is not planned.*NoParallel\(reduce_grads=True\)"
                       r".*example_inputs"):
        _exact(_vit(qk_norm=True), _hand, 2)


def test_vit_with_qk_norm_hand_plan_without_the_norms_is_exact_with_example_inputs():
    """Given the batch, the dataflow pass traces it and reduces the norms' gradients itself."""
    _exact(_vit(qk_norm=True), _hand, 2, given=True)
