"""``hpf.Experts`` on experts modules with other calling conventions (``parallel/experts/calls.py``),
without torchtitan: a grouped-experts module called as torchtitan's (rows pre-sorted by expert,
``num_tokens_per_expert``), and a module of the user's own convention planned with an
``hpf.ExpertsCall`` subclass; output and every gradient vs the unsharded MoE, under ``.backward()``
and ``torch.func.grad``, at ep 2 and 4."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad_and_value

import hp_functional as hpf
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
    apply_fn, params, info = hpf.shard(model, hpf.ShardingPlan({"experts": style}, axes={"ep": "ep"}), mesh(names=("ep",)))
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(1))
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
