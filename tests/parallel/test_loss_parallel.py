"""vocab_parallel_cross_entropy against F.cross_entropy, and loss_parallel=True on HF Llama."""

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, vmap

import hp_functional as hpf
from tests.support.helpers import assert_close, mesh, rank, world


def _split_sizes(vocab: int, n: int) -> list[int]:
    base = [vocab // n] * n
    for i in range(vocab % n):
        base[i] += 1
    return base


def case_cross_entropy(vocab: int, smoothing: float, reduction: str):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, vocab, generator=g, dtype=torch.float64)
    labels = torch.randint(0, vocab, (3, 5), generator=g)
    labels[0, :2] = -100
    sizes = _split_sizes(vocab, world())
    start = sum(sizes[: rank()])
    local = logits[..., start : start + sizes[rank()]].clone().requires_grad_(True)
    full = logits.clone().requires_grad_(True)

    def ref_fn(x):
        return F.cross_entropy(x.transpose(1, 2), labels, ignore_index=-100, reduction=reduction, label_smoothing=smoothing)

    def ours(x, lab=labels):
        return hpf.vocab_parallel_cross_entropy(x, lab, mesh(), "tp", reduction=reduction, label_smoothing=smoothing)

    ref, out = ref_fn(full), ours(local)
    assert_close(out, ref.detach(), "loss")
    weight = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    (ref * weight).sum().backward()
    (out * weight).sum().backward()
    expect = full.grad[..., start : start + sizes[rank()]]
    assert_close(local.grad, expect, "backward")
    assert_close(grad(lambda x: (ours(x) * weight).sum())(local.detach()), expect, "torch.func.grad")
    # vmap over the batch dim: one loss per sequence
    per_seq = vmap(lambda x, lab: hpf.vocab_parallel_cross_entropy(x, lab, mesh(), label_smoothing=smoothing))(
        local.detach(), labels
    )
    ref_seq = torch.stack([
        F.cross_entropy(logits[b], labels[b], ignore_index=-100, label_smoothing=smoothing) for b in range(3)
    ])
    assert_close(per_seq, ref_seq, "vmap over batch")
    # a label outside [0, vocab) that is not ignore_index (F.cross_entropy raises): NaN there, never a number
    bad = labels.clone()
    bad[1, 1], bad[2, 3] = vocab + 3, -5
    per_token = hpf.vocab_parallel_cross_entropy(local.detach(), bad, mesh(), label_smoothing=smoothing, reduction="none")
    wrong = torch.zeros_like(bad, dtype=torch.bool)
    wrong[1, 1] = wrong[2, 3] = True
    assert per_token[wrong].isnan().all() and not per_token[~wrong].isnan().any()
    if reduction != "none":
        assert ours(local.detach(), bad).isnan()
    return True


@pytest.mark.parametrize("vocab", [32, 37])  # 37: an uneven split over 2 and 4 ranks
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_vocab_parallel_cross_entropy(pool, vocab, smoothing, reduction):
    pool.run(case_cross_entropy, vocab, smoothing, reduction)
