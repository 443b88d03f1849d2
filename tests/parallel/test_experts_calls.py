"""``hpf.Experts`` on experts modules with other calling conventions (``parallel/experts/calls.py``),
without torchtitan: a grouped-experts module called as torchtitan's (rows pre-sorted by expert,
``num_tokens_per_expert``), and a module of the user's own convention planned with an
``hpf.ExpertsCall`` subclass; output and every gradient vs the unsharded MoE, under ``.backward()``
and ``torch.func.grad``, at ep 2 and 4.  TP inside HF-routed fused experts takes its split dims from
the weights' shapes (HF's ``[E, 2I, H]`` or the transposed ``[E, H, 2I]``), refusing by name what
they cannot tell."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard
from torch.func import grad_and_value

import hp_functional as hpf
from tests.conftest import get_pool
from tests.support.helpers import assert_close, mesh

E, H, INTER, K = 4, 8, 6, 2


class Grouped(nn.Module):
    """torchtitan's calling convention: ``forward(x [N, H], num_tokens_per_expert [E])``, rows grouped by expert."""

    def __init__(self):
        super().__init__()
        self.num_experts = E
        self.w1, self.w2, self.w3 = (nn.Parameter(torch.randn(E, *s) * 0.5) for s in ((INTER, H), (H, INTER), (INTER, H)))

    def forward(self, x, num_tokens_per_expert):
        out = []
        for e, rows in enumerate(torch.split(x, num_tokens_per_expert.tolist())):
            out.append((F.silu(rows @ self.w1[e].T) * (rows @ self.w3[e].T)) @ self.w2[e].T)
        return torch.cat(out)


class ById(nn.Module):
    """A convention of the user's own: ``forward(hidden [T, H], expert_id [T])``, one expert per token."""

    def __init__(self):
        super().__init__()
        self.num_experts = E
        self.w = nn.Parameter(torch.randn(E, H, H) * 0.5)

    def forward(self, hidden, expert_id):
        return torch.tanh(torch.einsum("th,tgh->tg", hidden, self.w[expert_id]))


class ByIdCall(hpf.ExpertsCall):
    """``ById``'s convention as the protocol asks: both arguments carry tokens; top-1, unit weights."""

    n_args, token_args = 2, (0, 1)

    def routing(self, args, offset, total):
        hidden, ids = args
        return hidden, ids[:, None], hidden.new_ones(ids.shape[0], 1)

    def run(self, module, rows, ids, weights):
        return type(module).forward(module, rows, ids[:, 0])


class SortedMoE(nn.Module):
    """A top-k MoE that sorts its rows by expert and calls ``Grouped`` as torchtitan's MoE does."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = Grouped()

    def forward(self, x):
        scores = self.router(x).softmax(-1)
        w, idx = scores.topk(K, -1)
        order = torch.argsort(idx.reshape(-1), stable=True)
        counts = torch.bincount(idx.reshape(-1), minlength=E)
        out_sorted = self.experts(x[order // K], counts)
        out = torch.zeros(x.shape[0] * K, H).index_copy(0, order, out_sorted).view(-1, K, H)
        return (out * w[..., None]).sum(1)


class ByIdMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = ById()

    def forward(self, x):
        return self.experts(x, self.router(x).argmax(-1)) * self.router(x).softmax(-1).amax(-1, keepdim=True)


def case_calls(kind: str):
    torch.manual_seed(0)
    model = {"sorted": SortedMoE, "custom": ByIdMoE}[kind]()
    style = hpf.Experts() if kind == "sorted" else hpf.Experts(call=ByIdCall())
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(1))
    apply_fn, params, info = hpf.shard(model, hpf.ShardingPlan({"experts": style}, axes={"ep": "ep"}), mesh(names=("ep",)),
                                       example_inputs=(x,))
    t = torch.randn(16, H, generator=torch.Generator().manual_seed(2))
    ref = model(x)
    (ref * t).sum().backward()

    def loss(p):
        return (apply_fn(p, x) * t).sum()

    out = apply_fn(params, x)
    assert_close(out, ref.detach(), "output")
    loss(params).backward()
    runs = {"backward": {k: p.grad for k, p in params.items()}, "torch.func": grad_and_value(loss)(params)[0]}
    for label, grads in runs.items():
        full = hpf.unshard(grads, info)
        for k, p in model.named_parameters():
            assert_close(full[k], p.grad, f"{label} grad {k}")
    return str(info["experts.w1" if kind == "sorted" else "experts.w"].placements)


def test_sorted_and_custom_calling_conventions(pool):
    for kind in ("sorted", "custom"):
        assert pool.run(case_calls, kind)[0] == "(Shard(dim=0),)"


class Transposed(nn.Module):
    """Fused routed experts stored for ``x @ w`` (Llama 4's layout): ``gate_up_proj [E, H, 2I]``,
    ``down_proj [E, I, H]``, HF's routed forward; ``I = 2H``, so at tp 2 the skeleton's ``down_proj``
    shard is ``[E, H, H]``: its split dim then comes from the module's orientation."""

    def __init__(self, inter: int = 2 * H, bias: bool = False):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = E, H, inter
        self.gate_up_proj = nn.Parameter(torch.randn(E, H, 2 * inter) * 0.5)
        self.down_proj = nn.Parameter(torch.randn(E, inter, H) * 0.5)
        if bias:  # GPT-OSS: a bias after the rowwise product, which the tp ranks' partial sums would each add
            self.down_proj_bias = nn.Parameter(torch.randn(E, H))

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for k in range(top_k_index.shape[1]):
            e = top_k_index[:, k]
            gate, up = torch.einsum("th,thi->ti", hidden, self.gate_up_proj[e]).chunk(2, dim=-1)
            out = out + torch.einsum("ti,tih->th", F.silu(gate) * up, self.down_proj[e]) * top_k_weights[:, k, None]
        return out


class TransposedMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = Transposed()

    def forward(self, x):
        w, idx = self.router(x).softmax(-1).topk(K, -1)
        return self.experts(x, idx, w)


def case_transposed_tp_inside():
    torch.manual_seed(0)
    model = TransposedMoE()
    plan = hpf.ShardingPlan({"experts": hpf.Experts(tp_axis="tp")}, axes={"ep": "ep"})
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(1))
    apply_fn, params, info = hpf.shard(model, plan, mesh((1, 2), ("ep", "tp")), example_inputs=(x,))
    t = torch.randn(16, H, generator=torch.Generator().manual_seed(2))
    ref = model(x)
    (ref * t).sum().backward()
    out = apply_fn(params, x)
    assert_close(out, ref.detach(), "output")
    (out * t).sum().backward()
    full = hpf.unshard({k: p.grad for k, p in params.items()}, info)
    for k, p in model.named_parameters():
        assert_close(full[k], p.grad, f"grad {k}")
    return {k: str(info[k].placements) for k in ("experts.gate_up_proj", "experts.down_proj")}


@pytest.mark.slow
def test_tp_inside_transposed_fused_experts_splits_the_dims_that_are_not_hidden():
    """At ep 1 x tp 2, ``gate_up_proj [E, H, 2I]`` is split on dim 2 (packed: each rank matching gate
    and up columns) and ``down_proj [E, I, H]`` on dim 1, output and every gradient against the
    unsharded MoE (a choice by name split both on their hidden dim)."""
    placements = get_pool(2).run(case_transposed_tp_inside)[0]
    assert placements == {"experts.gate_up_proj": "(Shard(dim=0), Shard(dim=2))",
                          "experts.down_proj": "(Shard(dim=0), Shard(dim=1))"}, placements


def test_tp_inside_fused_experts_dims_come_from_the_shapes_and_ambiguity_is_refused_by_name():
    """HF's ``[E, 2I, H]`` / ``[E, H, I]`` and the transposed layout from their shapes; ``I == H``
    (``down_proj [E, H, H]``) from the layout the module declares (HF's ``is_transposed``), refused by
    name without one or where it contradicts the shapes; interleaved gate/up columns and a per-expert
    bias after the rowwise product refused by name."""
    style = hpf.Experts(tp_axis="tp")
    hf = Transposed()
    hf.gate_up_proj, hf.down_proj = nn.Parameter(torch.zeros(E, 2 * 2 * H, H)), nn.Parameter(torch.zeros(E, H, 2 * H))
    square = Transposed(inter=H)
    declared = Transposed(inter=H)
    declared.is_transposed = True
    for module, dims in ((hf, (1, 2)), (Transposed(), (2, 1)), (declared, (2, 1))):
        spec = style.spec(module, "experts", "ep")
        assert (spec.params["gate_up_proj"]["tp"], spec.params["down_proj"]["tp"]) == tuple(Shard(d) for d in dims)
        assert spec.param_blocks == {"gate_up_proj": 2}
    with pytest.raises(hpf.PlanError, match=r"experts\.down_proj \(4, 8, 8\): both of its dims equal the experts' "
                                            r"hidden size 8 .*is_transposed = False for \[E, out, in\].*"
                                            r"Experts\(tp_axis=None\)"):
        style.spec(square, "experts", "ep")
    declared.is_transposed = False  # says gate_up is [E, 2I, H]: its shape [E, H, 2I] says otherwise
    with pytest.raises(hpf.PlanError, match=r"experts\.gate_up_proj \(4, 8, 16\): the module declares "
                                            r"is_transposed=False.*dim 2, but that dim is not 8"):
        style.spec(declared, "experts", "ep")
    interleaved = Transposed()
    interleaved.is_concatenated = False  # GPT-OSS: gate and up columns alternate
    with pytest.raises(hpf.PlanError, match=r"experts\.gate_up_proj: its gate and up columns are interleaved"):
        style.spec(interleaved, "experts", "ep")
    with pytest.raises(hpf.PlanError, match=r"experts\.down_proj_bias \(4, 8\): a per-expert bias"):
        style.spec(Transposed(bias=True), "experts", "ep")


def case_jetmoe():
    from hp_functional.tools.sweep import check_family

    return check_family("jetmoe", mesh())


@pytest.mark.slow
def test_jetmoe_counts_as_a_list_and_experts_of_another_width():
    """JetMoE's ``ParallelExperts`` takes its per-expert counts as a list of ints and its attention experts
    map the hidden size to another width: ``auto_plan`` plans them expert parallel and the model is exact
    (loss and every gradient, ``.backward()`` and ``torch.func``) against the unsharded HF model at tp 2."""
    from hp_functional.tools.sweep import EXACT, combine

    row = combine(get_pool(2).run(case_jetmoe))
    assert row["outcome"] == EXACT, row
