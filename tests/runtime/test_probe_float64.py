"""The shard-time probe judges a float32 mismatch again in float64 before refusing: rounding that a
model amplifies is not a wrong plan.

Dory's attention (nGPT) rescales its unit-norm queries by ``(sqk * head_dim**0.5 / 0.02)**2``: on
the probe's unit-scale random copy that is ~40,000, its softmax saturates, and the float32
gradients of the sharded and unsharded copies (sums in another order) differ by 2e-3 of their
largest entry — which refused HF's plan plus ``auto_plan`` (the model then ran HF's plan alone, a
rank holding 92 % of it).  In float64 they agree to 1e-9: the plan is accepted, the verdict says
so, and the real model's loss and every gradient equal the unsharded one's.  A plan that is wrong
differs in float64 too and stays refused (``tests/compile/test_gradient_proof.py``)."""


import hp_functional as hpf
from tests.conftest import get_pool
from tests.support.helpers import mesh


def case_dory():
    from hp_functional.tools.sweep import build, plan_for
    from hp_functional.tools.sweep_inputs import loss_of

    model, inputs, ref, ref_grads = build("dory", 2)
    plan, source = plan_for(model, mesh(), inputs)
    apply_fn, params, info = hpf.shard(model, plan, mesh(), example_inputs=inputs)
    loss = loss_of(apply_fn(params, **inputs))
    loss.backward()
    grads = hpf.unshard({k: p.grad for k, p in params.items()}, info)
    worst = max((grads[k] - g).abs().max().item() for k, g in ref_grads.items() if g is not None)
    return source, apply_fn.runtime.checks["probe"], abs(loss.item() - ref.item()), worst


def test_a_float32_mismatch_that_float64_resolves_is_accepted():
    for source, verdict, loss_diff, grad_diff in get_pool(2).run(case_dory):
        assert source == "from_hf+auto_plan"
        assert "in float64 (in float32 on a random copy of the model the gradient of" in verdict, verdict
        assert "sqk" in verdict, verdict
        assert loss_diff < 1e-5 and grad_diff < 1e-5, (loss_diff, grad_diff)


def _scripted(monkeypatch, first_error: float, second: str):
    """``run_probe`` over a stand-in copy whose float32 probe misses by ``first_error`` (relative) and
    whose float64 probe returns ``second`` (its reason for comparing less; "" compares everything)."""
    from types import SimpleNamespace

    from torch import nn

    from hp_functional.runtime import probe

    tolerances = []

    def scripted(_copy, _plan, _mesh, _shard_fn, _varying, _inputs, tolerance=probe.TOLERANCE):
        tolerances.append(tolerance)
        if len(tolerances) == 1:
            raise probe._mismatch("shard-time probe: on a random copy of the model the gradient of w differs; x",
                                  first_error)
        return second

    monkeypatch.setattr(probe, "_run_probe", scripted)
    copy = SimpleNamespace(model=nn.Linear(2, 2), names={})
    try:
        return probe.run_probe(copy, None, None, None, None), tolerances
    except hpf.PlanError as exc:
        return exc, tolerances


def test_a_near_miss_stands_unless_float64_compares_everything(monkeypatch):
    from hp_functional.runtime.probe import TOLERANCE, TOLERANCE64

    verdict, tolerances = _scripted(monkeypatch, 1e-3, "")  # float64 compares all and agrees: accepted
    assert not isinstance(verdict, Exception) and verdict.compared and "in float64" in str(verdict), verdict
    assert tolerances == [TOLERANCE, TOLERANCE64]
    refused, _ = _scripted(monkeypatch, 1e-3, "the loss agrees; gradients not compared: no backward")
    assert isinstance(refused, hpf.PlanError) and "differs" in str(refused), refused  # compared less: refused
    refused, tolerances = _scripted(monkeypatch, 0.5, "")  # far off: refused without a second look
    assert isinstance(refused, hpf.PlanError) and tolerances == [TOLERANCE], (refused, tolerances)
