"""Fast (world size 2) guards of invariants whose thorough tests are marked ``slow``, so that
``make test-fast`` catches a break of them too:

* ``hpf.fsdp``'s reduce-scatter averages over ``dp``, and over a folded ``("dp", "cp")`` axis divides
  by the ``dp`` size only (the ``cp`` sum is folded in): every gradient equals the unsharded
  model's (thorough: ``test_fsdp.py``, 20 AdamW steps, and
  ``test_exact_gradients.py::test_fsdp_folds_the_context_parallel_sum``, dp 2 × cp 2);
* every differentiable collective's backward is its transpose with the right scale, under
  ``.backward()`` and ``torch.func.grad``, and its jvp and vmap rules compute the math (thorough,
  at ws 2 and 4, with ``vmap(grad)``: ``test_collectives.py::test_collectives_match_math``);
* activation recompute replays the forward's RNG: dropout inside a checkpointed block gives the
  loss and every gradient of the non-recomputed run and of the unsharded model (thorough, on HF
  Llama: ``test_checkpoint.py::test_dropout_masks_are_replayed``);
* the value checksum of the cross-rank agreement is exact and position-sensitive (a permutation
  of a tensor's bytes, which keeps their sum, changes it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, grad_and_value, jvp, vmap

import hp_functional as hpf
from hp_functional import collectives as C
from tests.conftest import get_pool
from tests.support.helpers import assert_close, mesh, rank, world


class Deferred:
    """The comparisons of a case, each failure kept and raised at the end (``raise_any``), after
    the case's last collective: a check that fails on one rank only (a mutated collective breaks
    one rank's values) must not leave the other ranks waiting in the next collective."""

    def __init__(self):
        self.failures: list[str] = []

    def close(self, actual, expected, what: str) -> float:
        try:
            return assert_close(actual, expected, what)
        except AssertionError as exc:
            self.failures.append(str(exc).splitlines()[0])
            return float("nan")

    def raise_any(self) -> None:
        if self.failures:
            raise AssertionError(f"{len(self.failures)} comparisons failed:\n" + "\n".join(self.failures))


# ---------------------------------------------------------------- fsdp's reduce-scatter scale
def case_fsdp_scale(state) -> dict:
    """The scale of ``hpf.fsdp``'s reduce-scatter, both ways, against the unsharded model:

    * over ``"dp"`` (dp 2, each rank its own rows): the gradient is the mean over the dp ranks
      (an MLP, every leaf chunked over the two ranks);
    * over ``("dp", "cp")`` at dp 1 × cp 2 (the titan-style Llama with ring attention): the ``cp``
      sum is folded into the one reduce-scatter, which must then divide by the dp size (1), not by
      the group's size (2); no ``cp`` reduction is left owed."""
    from tests.parallel.test_context_inputs import CP
    from tests.support.titan_llama import VOCAB, Transformer

    diffs, checks = {}, Deferred()
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    m = mesh((2,), ("dp",))
    apply_fn, params, info = hpf.fsdp(*hpf.shard(mlp, hpf.ShardingPlan({}), m, verify=False), m, "dp")
    assert all(p.shape[0] < info[k].global_shape[0] for k, p in params.items()), "every leaf chunked over dp"
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(3))
    mlp(x).pow(2).mean().backward()
    grads = torch.func.grad(lambda p: apply_fn(p, x.chunk(2)[rank()]).pow(2).mean())(params)
    full = hpf.unshard(grads, info)
    diffs["dp mean"] = max(checks.close(full[k], p.grad, f"dp: grad {k}") for k, p in mlp.named_parameters())

    model = Transformer()
    model.load_state_dict(state)
    m = mesh((1, 2), ("dp", "cp"))
    plan = hpf.ShardingPlan({}).with_entries({"layers.*.attention.inner_attention": hpf.ContextParallel("ring")},
                                             axes={"cp": "cp"}, settings={"cp_inputs": CP})
    apply_fn, params, info = hpf.fsdp(*hpf.shard(model, plan, m, verify=False), m, ("dp", "cp"))
    assert not any(i.axes_of(hpf.ReducedOver) for i in info.values()), "the cp sum is folded, nothing owed"
    gen = torch.Generator().manual_seed(7)
    ids, labels = torch.randint(0, VOCAB, (2, 8), generator=gen), torch.randint(0, VOCAB, (2, 8), generator=gen)
    ref = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten())
    ref.backward()
    grads, loss = grad_and_value(lambda p: apply_fn(p, ids, labels=labels)[1])(params)
    full = hpf.unshard(grads, info)
    diffs["dp x cp loss"] = checks.close(loss, ref.detach(), "dp x cp: loss")
    diffs["dp x cp folded"] = max(checks.close(full[k], p.grad, f"dp x cp: grad {k}") for k, p in model.named_parameters())
    checks.raise_any()
    return diffs


def test_fsdp_reduce_scatter_scale_dp_mean_and_folded_cp_sum():
    from tests.support.titan_llama import make_titan_state

    print(get_pool(2).run(case_fsdp_scale, make_titan_state())[0])


# ---------------------------------------------------------------- every collective's backward
def _asymmetric_splits(total: int, n: int, r: int) -> list[int]:
    """Rank ``r``'s send splits of an all-to-all-v whose sends differ from its receives (at ws 2
    the cyclic splits of ``tests/core/test_collectives.py`` send what they receive, so a swapped
    transpose would go unnoticed): ``1 + r + j`` slices to rank j, the rest to the last rank."""
    head = [1 + r + j for j in range(n - 1)]
    return [*head, total - sum(head)]


def _asymmetric_case(dim: int) -> dict:
    """``all_to_all_v`` with ``_asymmetric_splits``: (fn, math, expected gradient) as the cases of
    ``tests/core/test_collectives.py``, under the name ``all_to_all_v(asymmetric)``."""
    n = world()

    def splits(total: int, r: int) -> tuple[list[int], list[int]]:
        return _asymmetric_splits(total, n, r), [_asymmetric_splits(total, n, k)[r] for k in range(n)]

    def fn(x, g):
        return C.all_to_all_v(x, dim, *splits(x.shape[dim], g.rank), g)

    def math(xs, r):  # rank r receives from each rank k the slices k sends it
        total = xs[0].shape[dim]
        return torch.cat([xs[k].narrow(dim, sum(splits(total, k)[0][:r]), splits(total, k)[0][r]) for k in range(n)], dim)

    def expected_grad(xs, ws, r):  # the slices of every y_j that came from rank r, in j order
        total = xs[0].shape[dim]
        return torch.cat([ws[j].narrow(dim, sum(splits(total, j)[1][:r]), splits(total, j)[1][r]) for j in range(n)], dim)

    return {"all_to_all_v(asymmetric)": (fn, math, expected_grad)}


def case_collective_backwards() -> dict:
    """Each collective of ``C.COLLECTIVES`` at dim 1 and -1: forward and the gradient of
    ``<w_r, y_r>`` (``.backward()`` and ``torch.func.grad``) against the math of
    ``tests/core/test_collectives.py``, and an all-to-all-v whose sends differ from its receives."""
    from tests.core.test_collectives import _cases, _expected_grad, _inputs, _weights

    g = C.AxisGroup.from_mesh(mesh(), "tp")
    r, n = rank(), world()
    xs = _inputs(n)
    seen, checks = {}, Deferred()
    for dim in (1, -1):
        cases = {name: (fn, math, lambda xs, ws, r, name=name: _expected_grad(name, xs, ws, r, dim))
                 for name, (fn, math) in _cases(dim).items()} | _asymmetric_case(dim)
        for name, (fn, math, expected_grad) in cases.items():
            x = xs[r].clone().requires_grad_(True)
            y = fn(x, g)
            checks.close(y, math(xs, r), f"{name} dim {dim} forward")
            ws = [_weights(n, math(xs, j).shape)[j] for j in range(n)]  # rank j's weights, of its output's shape
            (y * ws[r]).sum().backward()
            expect = expected_grad(xs, ws, r)
            seen[name] = max(checks.close(x.grad, expect, f"{name} dim {dim} backward"),
                             checks.close(grad(lambda t: (fn(t, g) * ws[r]).sum())(xs[r]), expect,
                                          f"{name} dim {dim} torch.func.grad"))
    checks.raise_any()
    return seen


def test_every_collective_backward_is_its_transpose_with_the_right_scale():
    results = get_pool(2).run(case_collective_backwards)
    for seen in results:
        assert set(C.COLLECTIVES) <= set(seen), sorted(set(C.COLLECTIVES) - set(seen))


def case_collective_jvp_and_vmap() -> dict:
    """Each collective of ``C.COLLECTIVES`` at dim 1: its jvp (the collective of the tangents: every
    collective is linear) and its vmap rule over a leading batch dim (the op on each element).  A
    backward applies the transpose, itself a collective of the table, so its batching rule is
    checked here too."""
    from tests.core.test_collectives import _cases, _inputs, _weights

    g = C.AxisGroup.from_mesh(mesh(), "tp")
    r, n = rank(), world()
    xs = _inputs(n)
    seen, checks = {}, Deferred()
    cases = {name: (fn, math) for name, (fn, math) in _cases(1).items()}
    cases |= {name: (fn, math) for name, (fn, math, _) in _asymmetric_case(1).items()}
    for name, (fn, math) in cases.items():
        tangents = _weights(n, xs[r].shape)
        _, t_out = jvp(lambda t: fn(t, g), (xs[r],), (tangents[r],))
        worst = checks.close(t_out, math(tangents, r), f"{name} jvp")
        out = vmap(lambda t: fn(t, g))(torch.stack([xs[r], -2 * xs[r]]))
        for b, scale in enumerate((1.0, -2.0)):
            worst = max(worst, checks.close(out[b], math([scale * x for x in xs], r), f"{name} vmap[{b}]"))
        seen[name] = worst
    checks.raise_any()
    return seen


def test_every_collective_jvp_and_vmap_rule_match_the_math():
    for seen in get_pool(2).run(case_collective_jvp_and_vmap):
        assert set(C.COLLECTIVES) <= set(seen), sorted(set(C.COLLECTIVES) - set(seen))


# ---------------------------------------------------------------- recompute replays the RNG
class DropBlock(nn.Module):
    """Dropout on the block's (replicated) input, then a Colwise → Rowwise MLP, residual."""

    def __init__(self):
        super().__init__()
        self.drop, self.up, self.down = nn.Dropout(0.5), nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.drop(x))))


class DropNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(DropBlock() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


_DROP_PLAN = {"layers.*.up": hpf.Colwise(), "layers.*.down": hpf.Rowwise()}


def case_recompute_replays_rng() -> dict:
    """Dropout inside the checkpointed blocks: the recompute in the backward must draw the
    forward's masks.  Loss and every gradient (``.backward()`` and ``torch.func.grad``) of the
    checkpointed run equal the non-recomputed run's and the unsharded model's at the same seed;
    without the replay (``preserve_rng=False``) the gradients differ, which shows the masks matter."""
    torch.manual_seed(0)
    model = DropNet()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    m = mesh()

    def run(apply_fn, params, info, func: bool) -> tuple[torch.Tensor, dict]:
        torch.manual_seed(11)
        if func:
            grads, loss = grad_and_value(lambda p: apply_fn(p, x).pow(2).mean())(params)
        else:
            leaves = {k: p.detach().requires_grad_() for k, p in params.items()}
            loss = apply_fn(leaves, x).pow(2).mean()
            loss.backward()
            grads = {k: p.grad for k, p in leaves.items()}
        return loss.detach(), hpf.unshard(grads, info)

    torch.manual_seed(11)
    ref = model(x).pow(2).mean()
    ref.backward()
    ref_grads = {k: p.grad for k, p in model.named_parameters()}
    plain = hpf.shard(model, _DROP_PLAN, m, verify=False)
    ck = hpf.shard(model, _DROP_PLAN, m, remat=["layers.*"], verify=False)
    no_replay = hpf.shard(model, _DROP_PLAN, m, verify=False, remat=hpf.Remat(blocks=("layers.*",), preserve_rng=False))
    diffs, checks = {}, Deferred()
    for func in (False, True):
        for label, sharded in (("plain", plain), ("checkpointed", ck)):
            loss, grads = run(*sharded, func)
            diffs[f"{label} func={func}"] = max(
                checks.close(loss, ref.detach(), f"{label} func={func} loss"),
                *(checks.close(grads[k], g, f"{label} func={func} grad {k}") for k, g in ref_grads.items()))
    loss, grads = run(*no_replay, False)
    checks.raise_any()
    assert_close(loss, ref.detach(), "the forward is the same without the replay")
    key = "layers.0.up.weight"
    assert not torch.allclose(grads[key], ref_grads[key]), "dropout masks must matter to the gradient"
    # forward mode: the recompute inside the jvp rule draws the forward's masks too
    tangents = []
    for apply_fn, params, info in (plain, ck):
        v = hpf.gaussian_like(params, info, std=1.0, seed=3)
        torch.manual_seed(11)
        tangents.append(jvp(lambda p, f=apply_fn: f(p, x).pow(2).mean(), (params,), (v,)))
    (p_out, p_tan), (c_out, c_tan) = tangents
    assert_close(c_out, p_out, "jvp primal, checkpointed vs plain")
    diffs["checkpointed jvp"] = assert_close(c_tan, p_tan, "jvp tangent, checkpointed vs plain")
    return diffs


def test_checkpoint_recompute_replays_dropout_rng():
    print(get_pool(2).run(case_recompute_replays_rng)[0])


# ---------------------------------------------------------------- the value checksum
def test_value_checksum_is_exact_and_position_sensitive():
    """``compile.agree.checksum`` (the CPU's CRC-32) and ``device_checksum`` (an accelerator's,
    computed here on CPU bytes): equal for equal bits; different for the same bytes permuted
    (rows swapped: the same sum) and for one flipped bit."""
    from hp_functional.compile.agree import checksum, device_checksum

    t = torch.randn(6, 5000, generator=torch.Generator().manual_seed(0))
    flipped = t.clone()
    flipped.view(torch.int32)[3, 7] ^= 1
    for fn in (checksum, lambda x: device_checksum(x.contiguous().view(-1).view(torch.uint8))):
        assert fn(t) == fn(t.clone())
        assert fn(t) != fn(t.flip(0)), "rows swapped: same bytes, other positions"
        assert fn(t) != fn(flipped), "one bit flipped"
