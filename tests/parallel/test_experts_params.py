"""Every per-expert parameter of fused experts sharded with its experts, and auto_plan's experts.

``hpf.Experts`` on fused experts shards each parameter whose leading dim is ``num_experts`` —
the stacked weights, GPT-OSS's stacked biases, Ergo's per-expert norm in a child module — since a
rank's copy indexes them by its local expert ids; any other parameter under the module is refused
by name.  ``auto_plan`` plans a mixture of experts it finds from real routing as ``Experts`` over
its axis (expert parallel).  Numbers: the sharded loss and every gradient against the unsharded
model, with the shard-time probe off (``verify=False``), so the plan itself is what is checked."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad_and_value

import hp_functional as hpf
from tests.support.helpers import assert_close, mesh, world


def _perturbed(model: nn.Module) -> nn.Module:
    """Every experts parameter moved well off its init, so each expert's slice differs from the others'."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def _exact(model: nn.Module, inputs: dict, loss_of, plan, m) -> None:
    """The sharded loss and every gradient (``.backward()`` and ``torch.func.grad``) equal the model's."""
    ref = loss_of(model(**inputs))
    ref.backward()
    apply_fn, params, info = hpf.shard(model, plan, m, verify=False)
    grads, loss = grad_and_value(lambda p: loss_of(apply_fn(p, **inputs)))({k: v.detach() for k, v in params.items()})
    eager = loss_of(apply_fn(params, **inputs))
    eager.backward()
    for how, value, g in (("torch.func.grad", loss, grads), (".backward()", eager, {k: p.grad for k, p in params.items()})):
        assert_close(value, ref, f"{how} loss")
        full = hpf.unshard(g, info)
        for k, p in model.named_parameters():
            assert_close(full[k], p.grad, f"{how} grad {k}", atol=1e-5, rtol=1e-4)


def case_hf_moe_auto_planned(model_type: str) -> list[str]:
    from hp_functional.tools.sweep import build
    from hp_functional.tools.sweep_inputs import loss_of

    m = mesh()
    model, inputs, _, _ = build(model_type, world())
    model = _perturbed(model)
    plan = hpf.auto_plan(model, m, example_inputs=inputs)
    experts = sorted(k for k, v in plan.entries.items() if isinstance(v, hpf.Experts))
    _exact(model, inputs, loss_of, plan, m)
    return experts


@pytest.mark.slow
@pytest.mark.parametrize("model_type,per_expert", [
    ("gpt_oss", "gate_up_proj_bias"),  # stacked biases [E, 2I] beside the weights
    ("ergo", "post_expert_norm.weight"),  # a per-expert RMSNorm scale [E, H] in a child of the experts
])
def test_per_expert_biases_and_norms_are_sharded_with_their_experts(model_type, per_expert):
    """A bias or norm scale left whole would be indexed by the local expert ids: on rank 1 the
    first experts' rows, a wrong result (Ergo's went past the probe, which could not run its copy)."""
    from tests.conftest import get_pool

    for experts in get_pool(2).run(case_hf_moe_auto_planned, model_type):
        assert experts == ["model.layers.*.mlp.experts"], experts


# ---------------------------------------------------------------- a hand-written mixture of experts
class FusedExperts(nn.Module):
    """Stacked SwiGLU experts called as HF's are: ``(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``."""

    def __init__(self, num_experts: int, hidden: int, inner: int, shared_scale: bool = False):
        super().__init__()
        self.num_experts = num_experts
        self.w_in = nn.Parameter(torch.randn(num_experts, 2 * inner, hidden) * 0.3)
        self.w_out = nn.Parameter(torch.randn(num_experts, hidden, inner) * 0.3)
        self.bias = nn.Parameter(torch.randn(num_experts, hidden) * 0.3)
        self.scale = nn.Parameter(torch.ones(hidden)) if shared_scale else None

    def forward(self, x, index, weights):
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, k = torch.where(index == e)
            gate, up = (x[token] @ self.w_in[e].T).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ self.w_out[e].T + self.bias[e]
            out = out.index_add(0, token, y * weights[token, k, None])
        return out if self.scale is None else out * self.scale


class MoE(nn.Module):
    def __init__(self, hidden: int, num_experts: int, shared_scale: bool = False):
        super().__init__()
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = FusedExperts(num_experts, hidden, 8, shared_scale)

    def forward(self, x):
        weights, index = torch.topk(self.router(x).softmax(-1), 2, dim=-1)
        return self.experts(x.reshape(-1, x.shape[-1]), index.reshape(-1, 2), weights.reshape(-1, 2)).view_as(x)


class TinyMoELM(nn.Module):
    """Embedding, an attention-free MLP, a mixture of experts, a head: names that say nothing."""

    def __init__(self, num_experts: int = 4, hidden: int = 16, shared_scale: bool = False):
        super().__init__()
        self.emb = nn.Embedding(32, hidden)
        self.a, self.b = nn.Linear(hidden, 32), nn.Linear(32, hidden)
        self.moe = MoE(hidden, num_experts, shared_scale)
        self.out = nn.Linear(hidden, 32, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.b(F.gelu(self.a(h)))
        return self.out(h + self.moe(h)).float().pow(2).mean()


def case_tiny_moe() -> None:
    torch.manual_seed(0)
    model, ids = TinyMoELM(), torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    m = mesh()
    plan = hpf.auto_plan(model, m, example_inputs=(ids,))
    assert plan.entries["moe.experts"] == hpf.Experts(axis="tp"), plan.entries
    assert plan.entries.get("moe.router", hpf.NoParallel()) in (hpf.NoParallel(), hpf.ShardedParams())  # computed whole
    _exact(model, {"ids": ids}, lambda loss: loss, plan, m)


@pytest.mark.slow
def test_auto_plan_shards_experts_it_finds_by_routing(pool):
    """At 2 ranks two experts each, at 4 one: tokens dispatched by the variable all-to-all and back."""
    pool.run(case_tiny_moe)


def test_experts_refuses_a_parameter_that_is_not_per_expert():
    model = TinyMoELM(shared_scale=True)
    plan = hpf.ShardingPlan({"moe.experts": hpf.Experts(axis="tp")})
    with pytest.raises(hpf.PlanError, match=r"moe\.experts: .*\['scale \(16,\)'\] are not per-expert parameters"):
        hpf.simulate(lambda m: hpf.shard(model, plan, m), world_size=2)


def test_auto_plan_refuses_experts_that_do_not_split_and_names_why():
    model, ids = TinyMoELM(num_experts=3), torch.randint(0, 32, (2, 8))
    with pytest.raises(hpf.PlanError, match=r"moe \(MoE\) is a mixture of experts .*\(moe\.experts: 3 experts do not split "
                                              r"over 2 ranks of axis 'tp'"):
        hpf.simulate(lambda m: hpf.auto_plan(model, m, example_inputs=(ids,)), world_size=2)
    plan = hpf.simulate(lambda m: hpf.auto_plan(model, m, example_inputs=(ids,), allow_uncovered=True), world_size=2)
    assert plan.entries["moe"] == hpf.NoParallel() and "moe: MoE left replicated" in plan.notes


def test_auto_plan_leaves_experts_with_a_shared_parameter_to_the_user():
    """What ``Experts`` would refuse, ``auto_plan`` does not plan (MuseSpark's shared post-expert norm)."""
    model, ids = TinyMoELM(shared_scale=True), torch.randint(0, 32, (2, 8))
    with pytest.raises(hpf.PlanError, match=r"cannot shard \(moe\.experts: \['scale \(16,\)'\] under the experts are not "
                                              r"per-expert parameters\)"):
        hpf.simulate(lambda m: hpf.auto_plan(model, m, example_inputs=(ids,)), world_size=2)
