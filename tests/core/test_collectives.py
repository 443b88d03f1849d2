"""Each collective's forward, backward, jvp, vmap and vmap(grad) against the math, on gloo ranks;
the table of transpose pairs is closed (higher orders: tests/core/test_higher_order.py)."""

import pytest
import torch
from torch.func import grad, jvp, vjp, vmap

import hp_functional as hpf
from hp_functional import collectives as C
from tests.conftest import get_pool
from tests.support.helpers import assert_close, cyclic_splits, mesh, rank, world

SHAPE = (4, 8, 12)  # every split dim divisible by 2 and 4


def _inputs(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(SHAPE, generator=g, dtype=torch.float64) for _ in range(n)]


def _weights(n: int, shape) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(n)]


# name -> (fn(x, group), math(all inputs, r) -> output on rank r)
def _cases(dim: int):
    n = world()
    cat = lambda xs: torch.cat(xs, dim)  # noqa: E731
    return {
        "all_reduce": (lambda x, g: C.all_reduce(x, g), lambda xs, r: sum(xs)),
        "reduce_from": (lambda x, g: C.reduce_from(x, g), lambda xs, r: sum(xs)),
        "copy_to": (lambda x, g: C.copy_to(x, g), lambda xs, r: xs[r]),
        "all_gather": (lambda x, g: C.all_gather(x, dim, g), lambda xs, r: cat(xs)),
        "gather_from": (lambda x, g: C.gather_from(x, dim, g), lambda xs, r: cat(xs)),
        "reduce_scatter": (lambda x, g: C.reduce_scatter(x, dim, g), lambda xs, r: sum(xs).chunk(n, dim)[r]),
        "split_to": (lambda x, g: C.split_to(x, dim, g), lambda xs, r: xs[r].chunk(n, dim)[r]),
        "all_to_all": (
            lambda x, g: C.all_to_all(x, dim, 0, g),
            lambda xs, r: torch.cat([xs[j].chunk(n, dim)[r] for j in range(n)], 0),
        ),
        "ppermute": (lambda x, g: C.ppermute(x, C.ring(n, 1), g), lambda xs, r: xs[(r - 1) % n]),
        "all_to_all_v": (lambda x, g: C.all_to_all_v(x, dim, *cyclic_splits(x.shape[dim], n, g.rank), g),
                         lambda xs, r: torch.cat([_segment(xs[k], dim, k, r) for k in range(n)], dim)),
        "ppermute(partial)": (lambda x, g: C.ppermute(x, [(0, n - 1)], g),
                              lambda xs, r: xs[0] if r == n - 1 else torch.zeros_like(xs[r])),
        "shift(-1)": (lambda x, g: g.shift(x, -1), lambda xs, r: xs[(r + 1) % n]),
        "send_to": (lambda x, g: exchange(x, g, send_first=g.rank % 2 == 0), lambda xs, r: xs[r ^ 1]),
        "recv_from": (lambda x, g: exchange(x, g, send_first=g.rank % 2 == 1), lambda xs, r: xs[r ^ 1]),
        "partial_from": (lambda x, g: C.partial_from(x, g), lambda xs, r: xs[r] if r == 0 else torch.zeros_like(xs[r])),
        "leave_region": (lambda x, g: C.leave_region(x, g), lambda xs, r: xs[r]),
        "copy_to_replicas": (lambda x, g: C.copy_to_replicas(x, PAIRS, g), lambda xs, r: xs[r]),
        "reduce_from_replicas": (lambda x, g: C.reduce_from_replicas(x, PAIRS, g), lambda xs, r: _group_sum(xs, r)),
        "gather_params": (lambda x, g: C.gather_params(x, dim, F64, n, g), lambda xs, r: cat(xs)),
        "mean_scatter": (lambda x, g: C.mean_scatter(x, dim, F64, n, g), lambda xs, r: sum(xs).chunk(n, dim)[r] / n),
    }


def exchange(x, g, send_first: bool):
    """Ranks 0 and 1 (2 and 3) swap ``x`` point to point, one of each pair sending first; the
    send's zero token is added to the result so the backward reaches both ops."""
    peer, zero = g.rank ^ 1, x.reshape(-1)[0] * 0
    if send_first:
        token = C.send_to(x, peer, g)
        return C.recv_from(zero, x.shape, peer, g) + token
    y = C.recv_from(zero, x.shape, peer, g)
    return y + C.send_to(x, peer, g)


def _segment(x, dim, src, dst):
    """The slices of rank ``src``'s ``x`` that ``cyclic_splits`` sends to rank ``dst``."""
    send, _ = cyclic_splits(x.shape[dim], world(), src)
    return x.narrow(dim, sum(send[:dst]), send[dst])


PAIRS = C.Replicas(2)  # groups of 2 consecutive ranks: one group at world size 2, two at 4
F64 = C.Precision(torch.float64, torch.float64, torch.float64)  # FSDP's pair without a cast


def _group_sum(xs, r):
    first = r // PAIRS.size * PAIRS.size
    return sum(xs[first : first + PAIRS.size])


# Backward convention: per-rank losses L_r = <w_r, y_r>; each collective's backward is stated
# in the module docstring.  The expected gradient of x on rank r under that convention:
def _expected_grad(name, xs, ws, r, dim):
    n = world()
    if name == "all_reduce":
        return sum(ws)
    if name in ("reduce_from", "partial_from"):
        return ws[r]
    if name == "leave_region":  # the gradient stays on rank 0
        return ws[r] if r == 0 else torch.zeros_like(ws[r])
    if name == "copy_to":
        return sum(ws)
    if name == "copy_to_replicas":
        return _group_sum(ws, r)
    if name == "reduce_from_replicas":
        return ws[r]
    if name == "all_gather":
        return sum(ws).chunk(n, dim)[r]
    if name == "gather_from":
        return ws[r].chunk(n, dim)[r]
    if name == "reduce_scatter":
        return torch.cat(ws, dim)
    if name == "gather_params":  # the dp-mean of the ranks' cotangents (FSDP's gradient)
        return sum(ws).chunk(n, dim)[r] / n
    if name == "mean_scatter":  # its transpose for FSDP's pairing: the all-gather, undivided
        return torch.cat(ws, dim)
    if name == "split_to":
        return torch.cat(ws, dim)
    if name in ("send_to", "recv_from"):  # y_{r^1} = x_r
        return ws[r ^ 1]
    if name == "ppermute":  # y_{r+1} = x_r
        return ws[(r + 1) % n]
    if name == "ppermute(partial)":  # only rank 0's x reaches anyone (rank n - 1)
        return ws[n - 1] if r == 0 else torch.zeros_like(ws[r])
    if name == "shift(-1)":
        return ws[(r - 1) % n]
    if name == "all_to_all_v":  # the slices of every y_k that came from rank r, in k order
        total = xs[r].shape[dim]
        pieces = []
        for k in range(n):
            _, recv = cyclic_splits(total, n, k)
            pieces.append(ws[k].narrow(dim, sum(recv[:r]), recv[r]))
        return torch.cat(pieces, dim)
    if name == "all_to_all":  # y_j = cat_k x_k.chunk(dim)[j] on dim 0; grad flows back by the reverse
        return torch.cat([ws[j].chunk(n, 0)[r] for j in range(n)], dim)
    raise KeyError(name)


def case_collectives(dim: int):
    g = C.AxisGroup.from_mesh(mesh(), "tp")
    r, n = rank(), world()
    xs = _inputs(n)
    report = {}
    for name, (fn, math) in _cases(dim).items():
        x = xs[r].clone().requires_grad_(True)
        y = fn(x, g)
        assert_close(y, math(xs, r), f"{name} forward")
        ws = _weights(n, y.shape)
        # backward via autograd and via torch.func.grad
        (y * ws[r]).sum().backward()
        expect = _expected_grad(name, xs, ws, r, dim)
        assert_close(x.grad, expect, f"{name} backward")
        assert_close(grad(lambda t: (fn(t, g) * ws[r]).sum())(xs[r]), expect, f"{name} torch.func.grad")
        # jvp: linear maps, so the tangent output is the op on the tangents
        tangents = _weights(n, x.shape)
        _, t_out = jvp(lambda t: fn(t, g), (xs[r],), (tangents[r],))
        assert_close(t_out, math(tangents, r), f"{name} jvp")
        # vmap over a new leading batch dim: equals the op on each batch element
        batch = torch.stack([xs[r], 2 * xs[r], -xs[r]])
        out = vmap(lambda t: fn(t, g))(batch)
        for b, scale in enumerate((1.0, 2.0, -1.0)):
            assert_close(out[b], math([scale * x_ for x_ in xs], r), f"{name} vmap[{b}]")
        # vmap(grad): per-example gradients
        per = vmap(grad(lambda t: (fn(t, g) * ws[r]).sum()))(batch)
        for b in range(3):
            assert_close(per[b], expect, f"{name} vmap(grad)[{b}]")
        # vmap with the batch dim not in front
        out_t = vmap(lambda t: fn(t, g), in_dims=1)(batch.movedim(0, 1))
        assert_close(out_t, out, f"{name} vmap(in_dims=1)")
        report[name] = True
    return report


@pytest.mark.parametrize("dim", [1, -1])
@pytest.mark.slow
def test_collectives_match_math(pool, dim):
    results = pool.run(case_collectives, dim)
    assert all(set(C.COLLECTIVES) <= set(r) for r in results)


_DIM_OPS = {"all_gather", "reduce_scatter", "gather_from", "split_to"}
PREC = C.Precision(torch.float32, torch.bfloat16, torch.float32)


def _sample_args(name: str) -> tuple:
    if name == "ppermute":
        return ((0, 1), (1, 2), (2, 0)), "group"
    if name == "all_to_all_v":
        return 1, (0, 3, 5), (2, 2, 4), "group"
    if name in ("send_to", "recv_from"):
        return (4, 8), 1, "group"
    if name.endswith("_replicas"):
        return PAIRS, "group"
    if name == "gather_params":  # the accumulator (no_sync) is the gather's alone: None round-trips
        return 0, PREC, 2, None, "group"
    if name == "mean_scatter":
        return 0, PREC, 2, "group"
    return (1, 0, "group") if name == "all_to_all" else (1, "group") if name in _DIM_OPS else ("group",)


def test_transpose_pairs_are_closed():
    """The conjugate pairs: for every collective C with backward B (the object its block names),
    B is a collective of the table, B's backward is C again, B's type is C's reversed
    (I → V ↔ V → I), and B's arguments map back to C's."""
    assert len(C.COLLECTIVES) == 18
    table = set(map(id, C.COLLECTIVES.values()))
    for name, c in C.COLLECTIVES.items():
        assert c.name == name and callable(getattr(C, name))
        b = c.transpose
        assert id(b) in table, f"{name}'s backward is not a collective of the table"
        assert b.transpose is c, f"{name}'s backward is {b.name}, whose backward is {b.transpose.name}"
        assert b.types == c.types.transposed, f"{name} is {c.types} but its transpose {b.name} is {b.types}"
        assert c.makes_invariant == (c.types.dst is C.ValueType.INVARIANT)
        args = _sample_args(name)
        assert b.transpose_args(*c.transpose_args(*args)) == args, name
    assert C.AllToAll.transpose_args(1, 0, "group") == (0, 1, "group")  # the reverse all-to-all
    assert C.Ppermute.transpose_args(((0, 1), (1, 2)), "group") == (((1, 0), (2, 1)), "group")  # sent back
    assert C.AllToAllV.transpose_args(0, (1, 2), (3, 0), "group") == (0, (3, 0), (1, 2), "group")  # the reverse
    assert (C.SendTo.transpose, C.RecvFrom.transpose) == (C.RecvFrom, C.SendTo)  # receive what was sent, send back
    assert C.SendTo.batch_args(((4, 8), 1, "g")) == ((4, 8), 1, "g")  # a peer is not a dim: not shifted
    assert (C.GatherParams.transpose, C.MeanScatter.transpose) == (C.MeanScatter, C.GatherParams)
    assert C.MeanScatter.batch_args((0, PREC, 2, "g")) == (1, PREC, 2, "g")  # the divisor is not a dim


def test_docstring_table_states_the_pairs():
    """The module docstring's table says what the table does: type, backward, its backward."""
    lines = C.__doc__.splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("====")]
    assert len(rules) == 3, "one table: top rule, header rule, bottom rule"
    widths = [len(col) for col in lines[rules[0]].split()]
    rows = {}
    for line in lines[rules[1] + 1 : rules[2]]:
        cols, start = [], 0
        for width in widths:  # fixed-width columns: a cell that overflows breaks the table
            cols.append(line[start : start + width].strip())
            assert line[start + width : start + width + 2].strip() == "", f"cell overflows: {line!r}"
            start += width + 2
        rows[cols[0].strip("`")] = cols
    assert set(rows) == set(C.COLLECTIVES)
    for name, (_, types, _, backward, backwards_backward) in rows.items():
        c = C.COLLECTIVES[name]
        assert types == str(c.types), name
        assert backward.split()[0] == f"``{c.transpose.name}``", name
        assert backwards_backward == f"``{name}``", name


def case_pytorch_collectives_fail_under_grad():
    """The platform fact we build around: torch's own differentiable all-reduce raises under grad."""
    import torch.distributed.nn.functional as dnnf

    x = torch.ones(3)
    with pytest.raises(RuntimeError, match="must override the setup_context staticmethod"):
        grad(lambda t: dnnf.all_reduce(t).sum())(x)


def test_pytorch_own_collective_raises_under_grad(pool):
    """Only the documented refusal counts (any other exception would hide a changed platform)."""
    pool.run(case_pytorch_collectives_fail_under_grad)


class _Kept:
    """An ``Accumulator`` for the test: what ``no_sync`` keeps."""

    def __init__(self):
        self.deferred, self.grad = False, None

    def keep(self, grad):
        self.grad = grad if self.grad is None else self.grad + grad

    def take(self, grad):
        kept, self.grad = self.grad, None
        return grad if kept is None else grad + kept


def case_fsdp_pair():
    """FSDP's pair against the math at its precision (fp32 leaves, bf16 gathered, fp32 reduced):
    forward, backward (the dp-mean), torch.func.grad, jvp, vmap (in front and not), vmap(grad),
    vjp of vjp (the pair transposes each other), a per-element divisor, no_sync's accumulator
    under .backward() and its refusal under a batched backward; the eager fast path."""
    g = C.AxisGroup.from_mesh(mesh(), "tp")
    r, n = rank(), world()
    prec = C.Precision(torch.float32, torch.bfloat16, torch.float32)
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(4, 3, generator=gen) for _ in range(n)]  # each rank's shard
    ws = [torch.randn(4 * n, 3, generator=gen).bfloat16() for _ in range(n)]  # each rank's cotangent
    gather = lambda t: C.gather_params(t, 0, prec, n, g)  # noqa: E731
    bf = lambda ts: [t.bfloat16() for t in ts]  # noqa: E731
    # forward: cast, then all-gather; backward: fp32 reduce-scatter of the cotangents, divided by n
    y = gather(xs[r].clone().requires_grad_())
    assert y.dtype == torch.bfloat16 and torch.equal(y, torch.cat(bf(xs)))
    mean = sum(w.float() for w in ws).chunk(n)[r] / n
    x = xs[r].clone().requires_grad_()
    (gather(x).float() * ws[r].float()).sum().backward()
    assert x.grad.dtype == torch.float32
    assert_close(x.grad, mean, "gather_params backward: the dp-mean")
    assert_close(grad(lambda t: (gather(t).float() * ws[r].float()).sum())(xs[r]), mean, "torch.func.grad")
    t = torch.randn(4, 3, generator=torch.Generator().manual_seed(10 + r))
    ts = [torch.randn(4, 3, generator=torch.Generator().manual_seed(10 + k)) for k in range(n)]
    assert_close(jvp(gather, (xs[r],), (t,))[1].float(), torch.cat(bf(ts)).float(), "jvp: the gather of the tangents")
    batch = torch.stack([xs[r], 2 * xs[r]])
    want = torch.stack([torch.cat(bf(xs)), torch.cat(bf([2 * x_ for x_ in xs]))])
    assert torch.equal(vmap(gather)(batch), want) and torch.equal(vmap(gather, in_dims=1)(batch.movedim(0, 1)), want)
    per = vmap(grad(lambda t: (gather(t).float() * ws[r].float()).sum()))(batch)
    assert_close(per, torch.stack([mean, mean]), "vmap(grad)")
    # mean_scatter: the dp-mean forward, the gather (undivided) backward, in fp64 for vjp of vjp
    f64 = C.Precision(torch.float64, torch.float64, torch.float64)
    zs = _inputs(n)
    scatter = lambda t: C.mean_scatter(t, 1, f64, n, g)  # noqa: E731
    assert_close(scatter(zs[r]), sum(zs).chunk(n, 1)[r] / n, "mean_scatter forward")
    cs = _weights(n, (4, 8 // n, 12))
    assert_close(vjp(scatter, zs[r])[1](cs[r])[0], torch.cat(cs, 1), "mean_scatter backward: the gather")
    assert_close(jvp(scatter, (zs[r],), (cs[r].repeat(1, n, 1),))[1], sum(cs).repeat(1, n, 1).chunk(n, 1)[r] / n, "jvp")
    assert_close(vmap(scatter)(torch.stack([zs[r], -zs[r]])), torch.stack([sum(zs).chunk(n, 1)[r] / n,
                                                                            -sum(zs).chunk(n, 1)[r] / n]), "vmap")
    for fn, cot in ((lambda t: C.gather_params(t, 1, f64, n, g), _weights(n, (4, 8 * n, 12))[r]), (scatter, cs[r])):
        point, v = zs[r], zs[(r + 1) % n]  # any point (the pair is linear), any input
        second = vjp(lambda c, fn=fn, point=point: vjp(fn, point)[1](c)[0], cot)[1]
        assert_close(second(v)[0], fn(v), "vjp of vjp")
    # a per-element divisor (pieces owed a sum over a folded axis) broadcasts along the result
    divisor = torch.tensor([1.0, 2.0, 4.0])
    x = xs[r].clone().requires_grad_()
    (C.gather_params(x, 0, prec, divisor, g).float() * ws[r].float()).sum().backward()
    assert_close(x.grad, sum(w.float() for w in ws).chunk(n)[r] / divisor, "per-element divisor")
    # no_sync: a deferred backward keeps the cotangent (no collective, no gradient); the next adds it
    kept = _Kept()
    x = xs[r].clone().requires_grad_()
    kept.deferred = True
    (C.gather_params(x, 0, prec, n, g, kept).float() * ws[r].float()).sum().backward()
    assert x.grad is None and torch.equal(kept.grad, ws[r].float())
    with pytest.raises(hpf.PlanError, match="no_sync.*is_grads_batched"):  # a batched backward cannot keep it
        y = C.gather_params(x, 0, prec, n, g, kept)
        torch.autograd.grad(y, x, torch.stack([torch.ones_like(y)] * 2), is_grads_batched=True)
    kept.deferred = False
    (C.gather_params(x, 0, prec, n, g, kept).float() * ws[r].float()).sum().backward()
    assert_close(x.grad, 2 * mean, "the kept cotangent reduced with the next") and kept.grad is None
    # outside transforms the collective runs through the C++ apply (Collective.apply's fast path)
    eager = C.GatherParams.eager
    eager.apply = None  # Function.apply's Python wrapper: not reached outside a transform
    try:
        assert torch.equal(gather(xs[r]), torch.cat(bf(xs)))
    finally:
        del eager.apply
    return True


def test_fsdp_pair_matches_math():
    """FSDP's gather_params / mean_scatter, fast at world size 2 (the table's sweep covers them at
    2 and 4 among the others)."""
    assert all(get_pool(2).run(case_fsdp_pair))


def case_gate_and_exchange():
    """A check held by a group's gate runs just before the first collective over that group (one
    that raises stops the collective on every rank, so none hangs), once, never over a group with
    another gate, and not once released; ``raw_exchange`` swaps the first and last rank's tensors
    while the ranks between issue nothing."""
    from hp_functional.core.raw_collectives import Gate, raw_exchange

    gate, ran = Gate(), []
    g, other = C.AxisGroup.from_mesh(mesh(), "tp", gate), C.AxisGroup.from_mesh(mesh(), "tp")
    one = torch.ones(2)

    def check():
        ran.append(True)
        if len(ran) == 1:
            raise ValueError("inputs differ")

    gate.hold(check)
    C.all_reduce(one, other)  # another gate: the check still waits
    waited = not ran
    try:
        C.all_reduce(one, g)
        stopped = False
    except ValueError:
        stopped = True
    assert torch.equal(C.all_reduce(one, g), one * g.size)  # the gate let the check go with its first run
    gate.hold(check)
    gate.release(check)
    C.all_reduce(one, g)
    first, last = 0, g.size - 1
    got = raw_exchange(torch.full((3,), float(g.rank)), last - g.rank, g) if g.rank in (first, last) else None
    return waited, stopped, len(ran), None if got is None else got.tolist()


def test_a_gate_runs_its_check_before_the_first_collective_and_exchange_swaps(pool):
    for r, (waited, stopped, runs, got) in enumerate(pool.run(case_gate_and_exchange)):
        assert waited and stopped and runs == 1, (r, waited, stopped, runs)
        assert got == ([float(pool.world - 1 - r)] * 3 if r in (0, pool.world - 1) else None), (r, got)
