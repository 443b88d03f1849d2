"""Ghost norms (``hpf.clip_per_example(method="ghost")``, ``train.ghost_norms``): on a model with every
rule (Embedding with a padding row, Conv1d, Conv2d with stride, LayerNorm, RMSNorm, Linear, Colwise and
Rowwise at tp 2) and every fallback (a layer with no rule, a position embedding whose output is the same
for every example, a layer called twice, a weight read outside its layer, a Rowwise bias converted in
the forward), a vocab-parallel embedding whose style's lookup runs the tapped forward, the per-example norms
and the clipped mean equal the single-device definition and the vmap path, at tp 2 and under FSDP; the
checks send exactly the leaves they must to the delta path; the pristine template is untouched; the
result equals Opacus 1.6's ghost clipping; a bad ``method`` is refused on every rank."""

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hp_functional as hpf
from hp_functional.train.ghost_norms import GhostRun
from tests.support.helpers import assert_close, mesh, raised
from tests.support.models import PLANS

VOCAB, SEQ, BATCH = 40, 6, 6


class Scale(nn.Module):
    """A layer no rule covers: its leaf is measured by a per-example delta."""

    def __init__(self, d: int):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        return x * self.w


class PadLookup(nn.Module):
    """A lookup with a padding row and no rule: a delta leaf, its weight batched under vmap (torch's
    batching rule keeps the padding row of the first example only: ``_ExactLookups`` writes it out)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(VOCAB, 16) * 0.1)

    def forward(self, ids):
        return F.embedding(ids, self.table, padding_idx=0)


class Zoo(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16, padding_idx=0)
        self.pos = nn.Embedding(SEQ, 16)  # fed arange: its output is the same for every example
        self.conv1 = nn.Conv1d(16, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(1, 2, 3, padding=1, stride=(1, 2), dilation=1)
        self.ln, self.rms, self.scale = nn.LayerNorm(16), nn.RMSNorm(16), Scale(16)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)  # Colwise, Rowwise (its bias converted)
        self.twice = nn.Linear(16, 16)  # called twice
        self.vocab = nn.Embedding(VOCAB, 16)  # vocab-parallel at tp: its style's lookup runs the tapped forward
        self.lookup = PadLookup()
        self.head = nn.Linear(16, VOCAB, bias=False)  # its weight also read outside it

    def forward(self, ids):  # ids [N, SEQ]
        h = self.emb(ids) + self.pos(torch.arange(ids.shape[-1])) + self.vocab(ids.flip(-1)) + self.lookup(ids)
        h = h + self.conv1(h.transpose(1, 2)).transpose(1, 2)
        h = h + self.conv2(h.unsqueeze(1)).transpose(1, 2).flatten(2)  # [N, 2, SEQ, 8] -> [N, SEQ, 16]
        h = self.scale(self.rms(self.ln(h)))
        h = h + self.down(torch.tanh(self.up(h)))
        h = self.twice(torch.tanh(self.twice(h)))
        logits = self.head(h)
        return torch.cat([logits[..., :16] + h @ self.head.weight[16:32].T, logits[..., 16:]], -1)


def zoo_loss(apply_fn, params, example):
    ids, target = example
    return F.cross_entropy(apply_fn(params, ids[None])[0], target)


def data():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    ids[0, :2] = 0  # the padding row: no gradient
    ids[2, 3] = 0  # (also in a later example: the batched-weight lookup's case)
    ids[1, :] = 7  # one id many times
    return ids, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def reference(model, batch):
    """Each example's gradient by a plain loop over the unsharded model, and its whole-model norm."""
    grads, norms = [], []
    for i in range(BATCH):
        model.zero_grad()
        zoo_loss(lambda p, x: model(x), None, (batch[0][i], batch[1][i])).backward()
        grads.append({k: p.grad.detach().clone() for k, p in model.named_parameters()})
        norms.append(torch.sqrt(sum(v.double().square().sum() for v in grads[-1].values())))
    return grads, torch.stack(norms)


def clipped_mean(grads, norms, max_norm):
    coef = [min(1.0, max_norm / (n.item() + 1e-6)) for n in norms]
    return {k: sum(c * g[k] for c, g in zip(coef, grads, strict=True)) / BATCH for k in grads[0]}


def _checks(apply_fn, params, info, batch) -> dict[str, list[str]]:
    """What the run's checks send to the delta path, stage by stage, on the first forward."""
    run = GhostRun(apply_fn.runtime, info, frozenset(info))
    local = {k: v.detach().requires_grad_() for k, v in params.items()}
    chunk = run.forward(zoo_loss, local, batch, BATCH, torch.float64)
    out = {"rules": sorted(f"{f}:{r.kind}" for f, r in run.rules.items()), "reread": sorted(run.reread()),
           "delta": sorted(run.delta)}
    out["outside"] = sorted(run.squared_norms(chunk, BATCH)[1])
    return out


def case_zoo(kind: str) -> dict:
    torch.manual_seed(0)
    model = Zoo()
    batch = data()
    per_example, want_norms = reference(model, batch)
    max_norm = want_norms.median().item()  # some examples clipped, some not
    want = clipped_mean(per_example, want_norms, max_norm)
    assert (want_norms > max_norm).any() and (want_norms <= max_norm).any(), want_norms
    if kind == "tp":
        apply_fn, params, info = hpf.shard(model, {**PLANS["tp"], "vocab": hpf.VocabEmbedding()}, mesh((2,), ("tp",)))
        rows = slice(None)
    else:  # fsdp over dp 2: each rank its own three examples
        dp = mesh((2,), ("dp",))
        apply_fn, params, info = hpf.fsdp(*hpf.shard(model, {}, dp), dp, "dp")
        rows = slice(3 * dist.get_rank(), 3 * dist.get_rank() + 3)
    params = {k: v.detach() for k, v in params.items()}
    mine = (batch[0][rows], batch[1][rows])
    out = {"checks": _checks(apply_fn, params, info, batch) if kind == "tp" else None}
    results = {m: hpf.clip_per_example(zoo_loss, apply_fn, params, info, mine, max_norm=max_norm, method=m)
               for m in ("ghost", "vmap")}
    for m, (grads, norms) in results.items():
        assert_close(norms.double(), want_norms[rows], f"{kind} {m}: per-example norms", atol=1e-5, rtol=1e-5)
        full = hpf.unshard(grads, info)
        for k in want:
            assert_close(full[k], want[k], f"{kind} {m}: clipped mean gradient of {k}", atol=1e-6, rtol=1e-4)
    for k in params:  # the two paths agree leaf by leaf, local shards
        assert_close(results["ghost"][0][k], results["vmap"][0][k], f"{kind}: ghost vs vmap, {k}", atol=1e-6)
    out["template_untouched"] = not any("forward" in vars(m) for m in apply_fn.runtime.template.modules())
    kept = apply_fn.runtime.ghost_runs  # the run (its skeleton, its delta leaves) is kept, holding no tensor
    run = next(iter(kept.values()))
    out["kept"] = len(kept) == 1 and not run.taps.values and not run.taps.book
    half = {k: v * 0.5 for k, v in params.items()}  # the next step's parameters: the kept run, exact on them
    again = hpf.clip_per_example(zoo_loss, apply_fn, half, info, mine, max_norm=max_norm, method="ghost")
    ref = hpf.clip_per_example(zoo_loss, apply_fn, half, info, mine, max_norm=max_norm, method="vmap")
    out["kept"] &= next(iter(kept.values())) is run
    assert_close(again[1], ref[1], f"{kind}: kept run, norms", atol=1e-6, rtol=1e-5)
    for k in params:
        assert_close(again[0][k], ref[0][k], f"{kind}: kept run vs vmap, {k}", atol=1e-6)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("pool", [2], indirect=True)
def test_ghost_equals_the_definition_and_the_vmap_path_at_tp_2(pool):
    for out in pool.run(case_zoo, "tp"):
        assert out["template_untouched"] and out["kept"]
        checks = out["checks"]
        assert checks["rules"] == ["conv1:conv", "conv2:conv", "down:linear", "emb:embedding", "head:linear",
                                   "ln:layer_norm", "pos:embedding", "rms:rms_norm", "twice:linear", "up:linear",
                                   "vocab:embedding"]
        assert checks["delta"] == ["down.bias", "lookup.table", "scale.w"]  # no rule; converted (Rowwise's bias)
        # the same for every example; called twice (the vocab-parallel lookup reaches its tap: a ghost leaf)
        assert checks["reread"] == ["pos.weight", "twice.bias", "twice.weight"]
        assert checks["outside"] == ["head.weight"]  # read outside its layer


@pytest.mark.slow
@pytest.mark.parametrize("pool", [2], indirect=True)
def test_ghost_equals_the_definition_under_fsdp(pool):
    for out in pool.run(case_zoo, "fsdp"):
        assert out["template_untouched"] and out["kept"]


# ---------------------------------------------------------------- refusals


def case_method_refusals() -> dict:
    torch.manual_seed(0)
    tp = mesh((2,), ("tp",))
    x = torch.randn(4, 16)
    a, p, i = hpf.shard(nn.Linear(16, 16), {}, tp)
    square = lambda apply_fn, params, e: apply_fn(params, e).square().sum()  # noqa: E731
    out = {"unknown": raised(hpf.clip_per_example, square, a, p, i, x, max_norm=1.0, method="fast")}
    mine = "ghost" if dist.get_rank() == 0 else "vmap"
    out["differs"] = raised(hpf.clip_per_example, square, a, p, i, x, max_norm=1.0, method=mine)
    ra, rp, ri = hpf.shard(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)), {}, tp, remat=["0"])
    out["remat"] = raised(hpf.clip_per_example, square, ra, rp, ri, x, max_norm=1.0, method="ghost")
    out["remat_auto"] = raised(hpf.clip_per_example, square, ra, rp, ri, x, max_norm=1.0)  # the vmap path
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_bad_method_is_refused_on_every_rank(pool):
    expected = {"unknown": "method must be 'auto', 'ghost' or 'vmap', got 'fast'",
                "differs": "different method",
                "remat": "method='ghost' with recomputed blocks"}
    for out in pool.run(case_method_refusals):
        assert out.pop("remat_auto") is None
        for what, pattern in expected.items():
            assert out[what] is not None and out[what][0] == "PlanError", (what, out[what])
            assert re.search(pattern, out[what][1]), (what, out[what][1])


# ---------------------------------------------------------------- Opacus' ghost clipping


class _PerSampleMSE(nn.Module):
    """Opacus' ``DPLossFastGradientClipping`` sets ``reduction="none"`` and wants one loss per example."""

    reduction = "mean"

    def forward(self, out, y):
        per = (out - y).square().mean(1)
        return per if self.reduction == "none" else per.mean()


def case_opacus_ghost(state) -> float:
    """Opacus 1.6's ghost clipping (``GradSampleModuleFastGradientClipping``, noise 0, mean reduction) on
    the unsharded MLP against ``method="ghost"`` over its TP shards (Colwise → Rowwise, its LayerNorm replicated)."""
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    from tests.support.models import MLP

    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    model = MLP()
    model.load_state_dict(state)
    max_norm = 1.6
    gsm = GradSampleModuleFastGradientClipping(model, max_grad_norm=max_norm, use_ghost_clipping=True,
                                               loss_reduction="mean")
    opt = DPOptimizerFastGradientClipping(torch.optim.SGD(gsm.parameters(), lr=1.0), noise_multiplier=0.0,
                                          max_grad_norm=max_norm, expected_batch_size=len(x), loss_reduction="mean")
    DPLossFastGradientClipping(gsm, opt, _PerSampleMSE(), loss_reduction="mean")(gsm(x), y).backward()
    theirs_norms = gsm.per_sample_gradient_norms.detach()
    assert (theirs_norms > max_norm).any() and (theirs_norms <= max_norm).any(), theirs_norms
    opt.pre_step()
    theirs = {k: p.grad.detach() for k, p in model.named_parameters()}

    plain = MLP()
    plain.load_state_dict(state)
    apply_fn, params, info = hpf.shard(plain, PLANS["tp"], mesh((2,), ("tp",)))

    def loss_fn(apply_fn, params, example):
        xi, yi = example
        return (apply_fn(params, xi) - yi).square().mean()

    grads, norms = hpf.clip_per_example(loss_fn, apply_fn, {k: v.detach() for k, v in params.items()}, info, (x, y),
                                        max_norm=max_norm, method="ghost")
    assert_close(norms, theirs_norms, "per-example norms vs Opacus' ghost norms")
    full = hpf.unshard(grads, info)
    return max(assert_close(full[k], theirs[k], f"clipped mean gradient of {k} vs Opacus' ghost clipping", atol=1e-6)
               for k in theirs)


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.slow  # importing opacus (scipy) in the ranks: about 2 s
def test_equals_opacus_ghost_clipping_without_noise(pool):
    pytest.importorskip("opacus", minversion="1.6")
    from tests.support.models import make_mlp_state

    pool.run(case_opacus_ghost, make_mlp_state())
