"""Per-example clipping (``hpf.clip_per_example``, DP-SGD without the noise) at TP, FSDP × TP and
plain DP × TP equals the single-device definition on a tiny Llama (each example's gradient by a
plain loop over the unsharded model, clipped by its whole-model norm, averaged over the global
batch): the gathered gradients and every rank's per-example norms; equals Opacus 1.6's
``DPOptimizer`` with ``noise_multiplier=0``; refuses what it cannot do exactly, on every rank."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hp_functional as hpf
from tests.support.helpers import assert_close, mesh, raised
from tests.support.models import MLP, PLANS, build_llama, make_llama_state, make_mlp_state

GLOBAL_BATCH, SEQ = 6, 8


def lm_loss(apply_fn, params, ids):
    """The causal LM loss of ONE sequence (``ids``: [seq], vmap's example)."""
    return apply_fn(params, input_ids=ids[None], labels=ids[None], use_cache=False).loss


def reference(model, ids):
    """(per-example gradients, their whole-model norms) by a plain loop over the unsharded model."""
    grads, norms = [], []
    for x in ids:
        model.zero_grad()
        lm_loss(lambda p, **kw: model(**kw), None, x).backward()
        g = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        grads.append(g)
        norms.append(torch.sqrt(sum(v.double().square().sum() for v in g.values())))
    return grads, torch.stack(norms)


def clipped_mean(grads, norms, max_norm):
    coef = [min(1.0, max_norm / (n.item() + 1e-6)) for n in norms]
    return {k: sum(c * g[k] for c, g in zip(coef, grads, strict=True)) / len(grads) for k in grads[0]}


def _layout(model, kind: str, world: int):
    """(apply_fn, params, shard_info, dp mesh or None, dp_axis) of one layout."""
    tp_plan = hpf.ShardingPlan.from_hf(model)
    if kind == "tp":
        return (*hpf.shard(model, tp_plan, mesh((world,), ("tp",))), None, None)
    if world == 2:  # dp 2 alone: fsdp, or plain dp
        m = mesh((2,), ("dp",))
        sharded = hpf.shard(model, {}, m)
    else:
        m = mesh((2, 2), ("dp", "tp"))
        sharded = hpf.shard(model, tp_plan, m)
    if kind == "fsdp":
        return (*hpf.fsdp(*sharded, m, "dp"), m["dp"], None)
    return (*sharded, m["dp"], "dp")


def case_layouts(state, world: int, kinds: list[str]) -> dict[str, tuple[float, float]]:
    """Each layout's (worst gradient difference, worst norm difference) against the definition;
    max_norm is the median norm, so some examples are clipped and some are not."""
    model = build_llama(state)
    ids = torch.randint(0, 128, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    per_example, ref_norms = reference(model, ids)
    max_norm = ref_norms.median().item()
    assert (ref_norms > max_norm).any() and (ref_norms <= max_norm).any(), ref_norms
    want = clipped_mean(per_example, ref_norms, max_norm)
    out = {}
    for kind in kinds:
        apply_fn, params, info, dp, dp_axis = _layout(model, kind, world)
        params = {k: v.detach() for k, v in params.items()}
        rows = slice(None) if dp is None else slice(dp.get_local_rank() * 3, dp.get_local_rank() * 3 + 3)
        # chunks of 2 over 3 local examples: a partial last chunk; tp: chunks of 4 and 2
        chunk = 4 if dp is None else 2
        grads, norms = hpf.clip_per_example(lm_loss, apply_fn, params, info, ids[rows], max_norm=max_norm,
                                            chunk_size=chunk, dp_axis=dp_axis)
        assert list(grads) == list(params) and all(grads[k].shape == params[k].shape for k in params)
        full = hpf.unshard(grads, info)
        worst = max(assert_close(full[k], want[k], f"{kind}: clipped mean gradient of {k}", atol=1e-6, rtol=1e-4)
                    for k in want)
        out[kind] = (worst, assert_close(norms.double(), ref_norms[rows], f"{kind}: per-example norms", atol=1e-5,
                                         rtol=1e-5))
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_tp_matches_the_single_device_definition(pool):
    """The fast case: tp 2, every rank with the same six examples."""
    for r in pool.run(case_layouts, make_llama_state(), pool.world, ["tp"]):
        assert set(r) == {"tp"}


@pytest.mark.slow
def test_fsdp_and_dp_match_the_single_device_definition(pool):
    """ws 2: fsdp over dp 2 and plain dp 2; ws 4: fsdp dp 2 × tp 2 and plain dp 2 × tp 2.
    Each dp rank passes its own three examples."""
    for r in pool.run(case_layouts, make_llama_state(), pool.world, ["fsdp", "dp"]):
        assert set(r) == {"fsdp", "dp"}


# ---------------------------------------------------------------- Opacus


def case_opacus(state) -> float:
    """Opacus 1.6 (GradSampleModule + DPOptimizer, noise_multiplier=0, mean reduction) on the
    unsharded MLP against clip_per_example over its TP shards (Colwise → Rowwise)."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    model = MLP()
    model.load_state_dict(state)
    max_norm = 1.6
    gsm = GradSampleModule(model, loss_reduction="mean")
    opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=1.0), noise_multiplier=0.0, max_grad_norm=max_norm,
                      expected_batch_size=len(x), loss_reduction="mean")
    nn.functional.mse_loss(gsm(x), y).backward()  # mean over examples of each example's mean-square loss
    per_sample = torch.stack([p.grad_sample.reshape(len(x), -1).norm(dim=1) for p in gsm.parameters()], 1).norm(dim=1)
    assert (per_sample > max_norm).any() and (per_sample <= max_norm).any(), per_sample
    assert opt.pre_step()  # clip, add (zero) noise, scale: p.grad is the clipped mean
    theirs = {k: p.grad.detach() for k, p in model.named_parameters()}

    plain = MLP()
    plain.load_state_dict(state)
    apply_fn, params, info = hpf.shard(plain, PLANS["tp"], mesh())

    def loss_fn(apply_fn, params, example):
        xi, yi = example
        return (apply_fn(params, xi) - yi).square().mean()

    grads, norms = hpf.clip_per_example(loss_fn, apply_fn, {k: v.detach() for k, v in params.items()}, info, (x, y),
                                        max_norm=max_norm, chunk_size=3)
    assert_close(norms, per_sample, "per-example norms vs Opacus' grad_sample norms")
    full = hpf.unshard(grads, info)
    return max(assert_close(full[k], theirs[k], f"clipped mean gradient of {k} vs Opacus", atol=1e-6) for k in theirs)


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.slow  # importing opacus (scipy) in the ranks: about 2 s
def test_equals_opacus_dp_optimizer_without_noise(pool):
    pytest.importorskip("opacus", minversion="1.6")
    pool.run(case_opacus, make_mlp_state())


# ---------------------------------------------------------------- refusals


class _BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(16, 16), nn.BatchNorm1d(16)

    def forward(self, x):
        return self.bn(self.lin(x))


class _Counter(nn.Module):
    """Counts its calls in a buffer (as a MoE router counts tokens)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.lin(x)


class _Reassigned(_Counter):
    """Swaps its buffer for a new tensor (no in-place op for torch.func to refuse)."""

    def forward(self, x):
        self.calls = self.calls + 1
        return self.lin(x)


class _Dropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.drop = nn.Linear(16, 16), nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.lin(x))


def _square(apply_fn, params, x):
    return apply_fn(params, x).square().sum()


def case_refusals() -> dict[str, tuple[str, str] | None]:
    """What each bad call raised on this rank; after each, the next call still pairs its collectives."""
    torch.manual_seed(0)
    tp, dp = mesh((2,), ("tp",)), mesh((2,), ("dp",))
    x = torch.randn(4, 16)
    out = {}
    for name, cls in (("batchnorm", _BatchNormNet), ("buffer", _Counter), ("reassigned", _Reassigned),
                      ("dropout", _Dropout)):
        a, p, i = hpf.shard(cls(), {}, tp)
        out[name] = raised(hpf.clip_per_example, _square, a, p, i, x, max_norm=1.0)
    a, p, i = hpf.shard(nn.Linear(16, 16), {}, dp)
    mine = x[: 3 if dist.get_rank() == 0 else 2]  # unequal dp batch sizes
    out["unequal"] = raised(hpf.clip_per_example, _square, a, p, i, mine, max_norm=1.0, dp_axis="dp")
    bad = x if dist.get_rank() == 0 else x[:0]  # an empty batch on one rank only: agreed, raised on both
    out["empty"] = raised(hpf.clip_per_example, _square, a, p, i, bad, max_norm=1.0, dp_axis="dp")
    out["chunks"] = raised(hpf.clip_per_example, _square, a, p, i, x, max_norm=1.0, chunk_size=1 + dist.get_rank())
    out["max_norm"] = raised(hpf.clip_per_example, _square, a, p, i, x, max_norm=0.0)
    out["dp_axis"] = raised(hpf.clip_per_example, _square, a, p, i, x, max_norm=1.0, dp_axis="nope")
    fa, fp, fi = hpf.fsdp(a, p, i, dp, "dp")
    out["fsdp_apply"] = raised(hpf.clip_per_example, _square, a, fp, fi, x, max_norm=1.0)
    with fa.fsdp.no_sync():
        out["no_sync"] = raised(hpf.clip_per_example, _square, fa, fp, fi, x, max_norm=1.0)
    out["ok"] = raised(hpf.clip_per_example, _square, fa, fp, fi, x, max_norm=1.0)  # still in step
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_refuses_what_it_cannot_do_exactly_on_every_rank(pool):
    expected = {
        "batchnorm": "module bn \\(BatchNorm1d\\) is in training mode",
        "buffer": "updates (a buffer|buffers .*) in place",
        "reassigned": "the forward updated the buffer calls",
        "dropout": "draws random numbers",
        "unequal": "different numbers of examples \\(rank 0: 3, rank 1: 2\\)",
        "empty": "batch is empty|local checks failed on ranks \\[1\\]",
        "chunks": "different chunk_size \\(rank 0: 1, rank 1: 2\\)",
        "max_norm": "max_norm must be a positive finite number",
        "dp_axis": "dp_axis 'nope' is not an axis",
        "fsdp_apply": "is hpf.fsdp's layout but apply_fn is not",
        "no_sync": "inside apply_fn.fsdp.no_sync",
    }
    import re

    for out in pool.run(case_refusals):
        assert out.pop("ok") is None
        for what, pattern in expected.items():
            assert out[what] is not None and out[what][0] == "PlanError", (what, out[what])
            assert re.search(pattern, out[what][1]), (what, out[what][1])
