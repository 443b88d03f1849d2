"""Context-parallel attention kernels against SDPA on the whole sequence (fp64), at cp 2 and 4.

Ring and all-gather attention, causal and not, zigzag and contiguous layouts, GQA: outputs and
the gradients of q, k and v (``.backward()`` and ``torch.func.vjp``) equal full-sequence SDPA;
``ContextAttention`` routes a module's SDPA calls (HF's repeated K/V included); the layouts
round-trip; a sequence that does not divide raises on every rank before any collective; and
the K/V memory of the ring stays flat from cp 2 to cp 4 while all-gather's grows."""

import pytest
import torch
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode

import hp_functional as hpf
from hp_functional.core.collectives import AxisGroup
from hp_functional.parallel.context.ring_attention import STRATEGIES, ContextAttention
from tests.conftest import get_pool
from tests.support.helpers import assert_close, mesh, world


def _group():
    return AxisGroup.from_mesh(mesh((world(),), ("cp",)), "cp")


def _qkv(heads: int, kv_heads: int, seq: int, dtype=torch.float64, v_dim: int = 8):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, heads, seq, 8, generator=gen, dtype=dtype)
    k = torch.randn(2, kv_heads, seq, 8, generator=gen, dtype=dtype)
    v = torch.randn(2, kv_heads, seq, v_dim, generator=gen, dtype=dtype)
    dout = torch.randn(2, heads, seq, v_dim, generator=gen, dtype=dtype)
    return q, k, v, dout


def case_kernel(strategy: str, layout: str, causal: bool, kv_heads: int, v_dim: int = 8):
    g = _group()
    q, k, v, dout = _qkv(4, kv_heads, 8 * g.size, v_dim=v_dim)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=kv_heads != 4)
    ref.backward(dout)
    local = [hpf.cp_shard(t, g, 2, layout=layout).requires_grad_() for t in (q, k, v)]
    out = STRATEGIES[strategy](*local, g, layout=layout, causal=causal)
    out.backward(hpf.cp_shard(dout, g, 2, layout=layout))
    worst = assert_close(hpf.cp_unshard(out.detach(), g, 2, layout=layout), ref.detach(), "output", 1e-10, 1e-10)
    for name, t, r in zip("qkv", local, full, strict=True):
        worst = max(worst, assert_close(hpf.cp_unshard(t.grad, g, 2, layout=layout), r.grad, f"d{name}", 1e-10, 1e-10))
    # torch.func.vjp: the same gradients
    attend = STRATEGIES[strategy]
    _, vjp = torch.func.vjp(lambda a, b, c: attend(a, b, c, g, layout=layout, causal=causal),
                            *[t.detach() for t in local])
    for name, got, t in zip("qkv", vjp(hpf.cp_shard(dout, g, 2, layout=layout)), local, strict=True):
        worst = max(worst, assert_close(got, t.grad, f"vjp d{name}", 1e-12, 1e-12))
    return worst


@pytest.mark.parametrize("strategy", ["ring", "allgather"])
@pytest.mark.parametrize("layout,causal", [("zigzag", True), ("contiguous", True), ("zigzag", False)])
def test_kernels_match_sdpa(pool, strategy, layout, causal):
    for kv_heads, v_dim in ((4, 8), (2, 8), (2, 4)):  # MHA, GQA, and values of another head dim (MLA)
        print(strategy, layout, causal, kv_heads, v_dim,
              max(pool.run(case_kernel, strategy, layout, causal, kv_heads, v_dim)))


class _SdpaAttention(torch.nn.Module):
    """Calls SDPA as HF's ``sdpa`` attention does with a mask: K/V repeated for GQA, its own mask."""

    is_causal = True
    num_key_value_groups = 2

    def forward(self, q, k, v):
        k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        local_mask = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()  # built for the chunk: ignored
        return F.scaled_dot_product_attention(q, k, v, attn_mask=local_mask)


def case_context_attention(strategy: str):
    g = _group()
    q, k, v, _ = _qkv(4, 2, 4 * g.size, torch.float32)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    module = _SdpaAttention()
    local = [hpf.cp_shard(t, g, 2).requires_grad_() for t in (q, k, v)]
    mode = ContextAttention(module, g, strategy, "zigzag", None, "attn")
    with mode:
        out = module(*local)
    out.sum().backward()
    assert mode.calls == 1
    worst = assert_close(hpf.cp_unshard(out.detach(), g, 2), ref, "output")
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True).sum().backward()
    for name, t, r in zip("qkv", local, full, strict=True):
        worst = max(worst, assert_close(hpf.cp_unshard(t.grad, g, 2), r.grad, f"d{name}"))
    return worst


@pytest.mark.parametrize("strategy", ["ring", "allgather"])
def test_context_attention_routes_sdpa(pool, strategy):
    print(max(pool.run(case_context_attention, strategy)))


def case_higher_order():
    """Grad of grad, jvp of grad, vmap and jvp through ring attention (torch.func, and autograd's
    create_graph) equal all-gather attention's, which is differentiable at every order (SDPA's
    math backend is a composite of differentiable ops): the ring's backward, which uses the
    saved log-sum-exp, is replaced by the same function's where it is differentiated."""
    g = _group()
    q = torch.randn(2, 2, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    t = torch.randn(2, 2, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    results = {}
    for strategy in ("ring", "allgather"):
        def f(x, attend=STRATEGIES[strategy]):
            return attend(x, x.flip(1), x.cos(), g).square().sum()

        x = q.clone().requires_grad_()
        (first,) = torch.autograd.grad(f(x), x, create_graph=True)
        results[strategy] = {
            "grad(grad)": torch.func.grad(lambda x: torch.func.grad(f)(x).sum())(q),
            "autograd create_graph": torch.autograd.grad(first.sum(), x)[0],
            "jvp(grad)": torch.func.jvp(torch.func.grad(f), (q,), (t,))[1],
            "jvp": torch.func.jvp(f, (q,), (t,))[1],
            "vmap(grad)": torch.func.vmap(torch.func.grad(f))(torch.stack([q, t])),
        }
    for what, want in results["allgather"].items():
        assert_close(results["ring"][what], want, f"ring {what}", atol=1e-10, rtol=1e-10)
    return len(results["ring"])


def test_ring_attention_higher_order_equals_allgather():
    assert get_pool(2).run(case_higher_order)[0] == 5


def case_layouts():
    g = _group()
    x = torch.arange(2 * 4 * g.size * 3.0).view(2, 4 * g.size, 3)
    for layout in ("zigzag", "contiguous"):
        local = hpf.cp_shard(x, g, 1, layout=layout)
        assert torch.equal(hpf.cp_unshard(local, g, 1, layout=layout), x), layout
    positions = hpf.cp_positions(g.rank, 4 * g.size, g.size).tolist()
    assert torch.equal(hpf.cp_shard(x, g, 1)[0, :, 0], x[0, positions, 0])
    try:
        hpf.cp_shard(x[:, :3], g, 1)  # 3 does not divide by 2·cp: raised locally, before any collective
    except hpf.ShapeError as e:
        return positions, str(e)
    raise AssertionError("no ShapeError")


def test_layouts_round_trip_and_zigzag_positions():
    results = get_pool(2).run(case_layouts)
    assert [r[0] for r in results] == [[0, 1, 6, 7], [2, 3, 4, 5]]  # chunks i and 2·cp−1−i
    assert all("'cp'" in msg and "not divisible by 4" in msg for _, msg in results), results


class _Largest(TorchDispatchMode):
    """The largest K/V buffer a rank holds: what collectives hand it and what is saved for backward."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "_c10d_functional" and isinstance(out, torch.Tensor):
            self.largest = max(self.largest, out.numel() * out.element_size())
        return out


def case_memory(strategy: str):
    """A fixed local chunk (16 positions, 1 head of 8): the ring's K/V buffer does not grow with cp."""
    g = _group()
    q, k, v, dout = (t[:1, :1, : 16 * g.size] for t in _qkv(1, 1, 16 * g.size, torch.float32))
    local = [hpf.cp_shard(t, g, 2).requires_grad_() for t in (q, k, v)]
    recorder, saved = _Largest(), [0]

    def pack(t):
        saved[0] = max(saved[0], t.numel() * t.element_size())
        return t

    with recorder, saved_tensors_hooks(pack, lambda t: t):
        out = STRATEGIES[strategy](*local, g)
    with recorder:
        out.backward(hpf.cp_shard(dout, g, 2))
    return max(recorder.largest, saved[0])


def test_ring_kv_memory_flat_allgather_grows():
    sizes = {s: [get_pool(n).run(case_memory, s)[0] for n in (2, 4)] for s in ("ring", "allgather")}
    print("largest K/V buffer per rank (bytes) at cp 2, cp 4:", sizes)
    block = 16 * 8 * 4  # one rank's K (or V): 16 positions x 8 dims x fp32
    assert sizes["ring"] == [4 * block] * 2, sizes  # K, V, dK, dV of one block in flight (backward)
    assert sizes["allgather"] == [2 * 2 * block, 2 * 4 * block], sizes  # K and V of all cp ranks
