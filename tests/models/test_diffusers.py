"""diffusers' diffusion transformers (DiT, PixArt-α, SD3's MMDiT, Flux), tiny and random
(``hp_functional.tools.sweep_extras``), sharded by the hand plan of docs/diffusion-and-timm.md and
by ``auto_plan``: the diffusion loss (MSE against a fixed noise target) and every gradient against
the unsharded model at tp 2 and 4, ``torch.func.grad`` and ``.backward()``, every rank a thread
(``hpf.emulate``) — or refused by name.  Skipped without the ``diffusers`` extra."""

import pytest
import torch

import hp_functional as hpf
from hp_functional.tools.sweep_extras import extra_families, hand_plan
from tests.support.helpers import assert_close

pytest.importorskip("diffusers")

pytestmark = pytest.mark.slow  # each model: two shard() calls and their proofs, 1-3 s


def _run(name: str, plan_of, n: int, given: bool = False):
    """Per rank: (loss, full gradients) by torch.func.grad and by .backward(), and the unsharded
    model's loss and gradients; ``given``: shard with ``example_inputs`` (the batch)."""
    extra = extra_families()[name](n, 0)
    model = extra.model
    ref = extra.loss_of(model(**extra.inputs))
    ref.backward()

    def run(mesh):
        apply_fn, params, info = hpf.shard(model, plan_of(model, mesh, extra), mesh,
                                           example_inputs=extra.inputs if given else None)
        assert not given or "example_inputs" in apply_fn.runtime.checks["dataflow"], apply_fn.runtime.checks
        grads, loss = torch.func.grad_and_value(lambda p: extra.loss_of(apply_fn(p, **extra.inputs)))(params)
        leaves = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
        eager = extra.loss_of(apply_fn(leaves, **extra.inputs))
        eager.backward()
        by_backward = hpf.unshard({k: v.grad for k, v in leaves.items()}, info)
        return (loss.detach(), hpf.unshard(grads, info)), (eager.detach(), by_backward)
    return hpf.emulate(run, (n,), ("tp",)), ref.detach(), model


def _exact(name: str, plan_of, ns=(2, 4), given: bool = False) -> None:
    for n in ns:
        ranks, ref, model = _run(name, plan_of, n, given)
        for rank in ranks:
            for how, (loss, grads) in zip(("torch.func.grad", ".backward()"), rank, strict=True):
                assert_close(loss, ref, f"{name} tp {n} {how} loss")
                assert grads.keys() == {k for k, _ in model.named_parameters()}
                for k, p in model.named_parameters():
                    assert_close(grads[k], p.grad, f"{name} tp {n} {how} grad {k}", atol=1e-6, rtol=1e-4)


def _hand(name):
    return lambda model, mesh, extra: hand_plan(name)


def _auto(model, mesh, extra):
    return hpf.auto_plan(model, mesh, example_inputs=extra.inputs)


@pytest.mark.parametrize("name", ["diffusers:DiT", "diffusers:PixArt", "diffusers:SD3"])
def test_hand_plan_is_exact(name):
    _exact(name, _hand(name))


@pytest.mark.parametrize("name", ["diffusers:DiT", "diffusers:PixArt", "diffusers:SD3", "diffusers:Flux"])
def test_auto_plan_is_exact(name):
    """DiT's class-label table (1001 rows) stays replicated; Flux's single blocks, which concatenate
    attention and MLP features into one projection, are gathered; its per-head norms reduced."""
    _exact(name, _auto, ns=(2,), given=True)  # tp 4 too on demand (docs/diffusion-and-timm.md): 10 s more each


PER_HEAD_NORMS = {f"transformer_blocks.*.attn.{n}": hpf.NoParallel(reduce_grads=True)
                  for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k")}


def test_flux_hand_plan_with_its_per_head_norms_reduced_is_exact():
    """Flux's joint attention RMS-normalises q and k per head, on each rank's local heads: its
    norms' gradients are partial sums unless they are planned ``NoParallel(reduce_grads=True)``."""
    _exact("diffusers:Flux", lambda model, mesh, extra: {**hand_plan("diffusers:Flux"), **PER_HEAD_NORMS})


def test_flux_hand_plan_without_its_norms_is_refused_without_example_inputs():
    """Left unplanned, the per-head norms would get per-rank partial gradients (tp 2: 4e-4 on 6e-4);
    with no batch to synthesize (no embedding first) neither the dataflow pass nor the probe sees
    their data, so shard() refuses, naming a norm and the fixes."""
    with pytest.raises(hpf.PlanError, match=r"attn\.norm_(added_)?[qk] is not planned.*NoParallel\(reduce_grads=True\)"
                       r".*example_inputs"):
        _exact("diffusers:Flux", _hand("diffusers:Flux"), ns=(2,))


def test_flux_hand_plan_without_its_norms_is_exact_with_example_inputs():
    """Given the batch, the dataflow pass traces it and reduces the norms' gradients itself."""
    _exact("diffusers:Flux", _hand("diffusers:Flux"), ns=(2,), given=True)
