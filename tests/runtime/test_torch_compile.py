"""torch.compile(apply_fn) on a TP HF Llama: one graph, no graph break, and the loss, logits and
every gradient equal eager apply_fn and the unsharded model.

The backend is ``aot_eager``: it runs Dynamo and AOTAutograd (the tracing of our collectives
and of their backward rules) without Inductor's C++ code generation, which takes minutes per
graph on a 2-core machine; ``python benchmarks/tp_step.py --compile inductor`` runs Inductor.
"""

import pytest
import torch

import hp_functional as hpf
from tests.conftest import get_pool
from tests.support.helpers import assert_close, mesh
from tests.support.models import build_llama, make_llama_state


def _grads(params) -> dict[str, torch.Tensor]:
    grads = {k: p.grad for k, p in params.items()}
    for p in params.values():
        p.grad = None
    return grads


def case_compile(state, plan_kind: str):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = build_llama(state)
    plan = hpf.llama_sp_plan() if plan_kind == "sp" else hpf.ShardingPlan.from_hf(model, loss_parallel=True)
    apply_fn, params, info = hpf.shard(model, plan, mesh())
    compiled = torch.compile(apply_fn, backend="aot_eager", fullgraph=True)  # fullgraph: a graph break raises

    g = torch.Generator().manual_seed(11)
    batches = [torch.randint(0, 128, (2, 16), generator=g) for _ in range(2)]
    for step, ids in enumerate(batches):
        eager = apply_fn(params, input_ids=ids, labels=ids)
        eager.loss.backward()
        eager_grads = _grads(params)
        with torch.compiler.set_stance("fail_on_recompile" if step else "default"):  # new values, same graph
            out = compiled(params, input_ids=ids, labels=ids)
        out.loss.backward()
        grads = _grads(params)

        model.zero_grad(set_to_none=True)
        ref = model(input_ids=ids, labels=ids)
        ref.loss.backward()
        ref_logits = ref.logits.detach()
        if plan.settings["loss_parallel"]:
            ref_logits = ref_logits.chunk(mesh().size(), -1)[torch.distributed.get_rank()]
        assert_close(out.loss, eager.loss.detach(), "compiled vs eager loss", atol=1e-6, rtol=1e-6)
        assert_close(out.logits, eager.logits.detach(), "compiled vs eager logits", atol=1e-6, rtol=1e-6)
        assert_close(out.loss, ref.loss.detach(), "compiled vs unsharded loss")
        assert_close(out.logits, ref_logits, "compiled vs unsharded logits")
        assert set(grads) == set(params) and all(v is not None for v in grads.values()), "every parameter has a gradient"
        for k in params:
            assert_close(grads[k], eager_grads[k], f"step {step}: compiled vs eager grad {k}", atol=1e-6, rtol=1e-6)
        full = hpf.unshard(grads, info)
        for k, p in model.named_parameters():
            assert_close(full[k], p.grad, f"step {step}: compiled vs unsharded grad {k}")

        with torch.no_grad():  # a functional-style update: new tensors for the next step, the model alike
            params = {k: (p - 0.1 * grads[k]).requires_grad_(True) for k, p in params.items()}
            full = hpf.unshard(params, info)
            for k, p in model.named_parameters():
                p.copy_(full[k])
    return {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values())}


@pytest.mark.parametrize("plan_kind", ["sp", "loss_parallel"])  # between them every lowered collective kind
@pytest.mark.slow
def test_compiled_apply_fn_matches_eager_and_unsharded(plan_kind):
    """The 2-rank pool only: what compile adds (Dynamo and AOTAutograd tracing the collectives and
    their backward rules) does not depend on the world size, which changes only the shapes; the
    same plans at 4 ranks are the eager tests' (each compile here is ~10 s on 2 cores)."""
    for result in get_pool(2).run(case_compile, make_llama_state(), plan_kind):
        assert result == {"graphs": 1, "breaks": 0}, result
