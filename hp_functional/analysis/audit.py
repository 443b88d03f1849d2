"""The shape audit: a module run at global and at local shapes on meta tensors, op by op.

``record`` runs one forward of a meta copy of a module (only read) and records its torch ops,
its planned children opaque; ``compare`` walks a global and a local record in step and returns
the first op whose local result is not the global result divided.  Nothing here communicates.
What it covers and cannot see: docs/guarantees.md#exact-or-refused-the-shape-audit.
"""

from __future__ import annotations

__all__ = ["Mismatch", "boundaries", "compare", "culprits", "divided", "handoff", "record", "record_or_resize"]

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode

from ..core.placement import splits
from .copies import meta_copy, snapshot, to_meta
from .packing import CONCATS, Packed, concatenated, permutation, slice_of, view_packing
from .trace import TracedInt, _leaves, _plain, fake_mode

VIEWS = {"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as"}
CONTRACTS = {"matmul", "__matmul__", "__rmatmul__", "bmm", "baddbmm", "mm", "linear", "scaled_dot_product_attention"}
FACTORIES = ("new_", "empty_like", "zeros_like", "ones_like", "full_like", "size", "dim")

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Op:
    """One recorded op: its name, its tensor inputs' and outputs' shapes, the attributes among
    its arguments, and the error it raised (None: it ran)."""

    name: str
    ins: tuple[Shape, ...]
    outs: tuple[Shape, ...]
    attrs: frozenset[tuple[str, str]]
    error: str | None = None
    packed: Packed | None = None  # the packing of its first packed tensor input (local runs only)
    cut: str | None = None  # why it cuts a packed dim off its blocks (local runs only)


@dataclass(frozen=True)
class Mismatch:
    """The first op that is not the global op divided: its index, the two records, the rule it
    breaks (``raises``, ``shape``, ``view``, ``lost``, ``contract``, ``count``) and why."""

    index: int
    glob: Op
    local: Op | None
    rule: str
    why: str


class _Recorder(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.ops: list[Op] = []
        self.depth = 0  # > 0 inside an opaque child
        self.packed: dict[int, tuple[Tensor, Packed]] = {}  # id → (the tensor, kept alive; its packing)

    def tag(self, t: Tensor, packed: Packed) -> None:
        self.packed[id(t)] = (t, packed)

    def packing(self, leaves) -> tuple[Tensor, Packed] | None:
        for t in leaves:
            if isinstance(t, Tensor) and id(t) in self.packed and self.packed[id(t)][0] is t:
                return self.packed[id(t)]
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.depth:
            return func(*_plain(args), **_plain(kwargs))
        name = getattr(func, "__name__", str(func))
        leaves = _leaves((args, kwargs))
        ins = tuple(tuple(t.shape) for t in leaves if isinstance(t, Tensor))
        attrs = frozenset().union(*(x.tags for x in leaves if isinstance(x, TracedInt)))
        try:
            out = func(*_plain(args), **_plain(kwargs))
        except Exception as exc:
            self.ops.append(Op(name, ins, (), attrs, str(exc).splitlines()[0] if str(exc) else type(exc).__name__))
            raise
        outs = tuple(tuple(t.shape) for t in _leaves(out) if isinstance(t, Tensor))
        found = self.packing(leaves) if self.packed else None
        cut = self._follow(name, args, out, *found) if found is not None else None
        if found is not None and name in CONCATS:
            cut = concatenated(args, kwargs, found[1])
        if outs and ins:
            self.ops.append(Op(name, ins, outs, attrs, packed=found[1] if found else None, cut=cut))
        return out

    def _follow(self, name: str, args, out, src: Tensor, p: Packed) -> str | None:
        """Tag what ``out`` holds of packed ``src``; why the op cuts its blocks (None: it does not)."""
        results = [t for t in _leaves(out) if isinstance(t, Tensor)]
        shape = tuple(src.shape)
        if len(results) == 1 and tuple(results[0].shape) == shape and name not in CONTRACTS:
            self.tag(results[0], p)  # elementwise: a bias, an activation, dropout, a dtype
        elif name in VIEWS and len(results) == 1:
            moved = view_packing(p, shape, tuple(results[0].shape))
            if moved is not None:
                self.tag(results[0], moved)
        elif name in ("permute", "transpose", "swapaxes", "swapdims", "movedim") and len(results) == 1:
            dims = permutation(name, args, len(shape))
            if dims is not None:
                self.tag(results[0], p.moved(dims.index(p.dim)))
        elif name in ("split", "chunk", "tensor_split", "split_with_sizes", "unbind") or name == "__getitem__":
            return self._pieces(name, args, results, shape, p)
        return None

    def _pieces(self, name, args, results, shape, p: Packed) -> str | None:
        """A split or slice of the packed dim: each piece must be whole blocks (tagged with them)."""
        if name == "__getitem__":
            span = slice_of(args[1] if len(args) > 1 else None, shape, p.dim)
            if span is None:
                return None  # the packed dim untouched or indexed by a number ("lost" sees that)
            spans, results = [span], results[:1]
        else:
            if name == "unbind" or any(len(t.shape) != len(shape) for t in results):
                return None
            sizes = [t.shape[p.dim] for t in results]
            if sum(sizes) != shape[p.dim] or len(sizes) < 2:
                return None  # another dim split
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            spans = list(zip(starts, [a + b for a, b in zip(starts, sizes, strict=True)], strict=True))
        edges = [sum(p.blocks[:i]) for i in range(len(p.blocks) + 1)]
        for (a, b), t in zip(spans, results, strict=True):
            if a not in edges or b not in edges:
                held = (f"is sharded as one block (a rank holds a contiguous range of its {shape[p.dim]}-wide local "
                        "rows, not a slice of every piece)" if len(p.blocks) == 1 else
                        f"holds {len(p.blocks)} packed blocks of local sizes {list(p.blocks)}, which the piece does not follow")
                fix = f"Colwise(packed={len(spans)})" if len({y - x for x, y in spans}) == 1 and len(spans) > 1 else \
                    "Colwise(packed=(...)) with the pieces' global sizes"
                return (f"it cuts dim {p.dim} of {p.source!r}'s output at [{a}:{b}] on a rank, but {p.source!r} {held}: "
                        f"plan {p.source!r} as {fix}, or gather it (Colwise(gather_output=True))")
            self.tag(t, p.moved(p.dim, tuple(p.blocks[edges.index(a):edges.index(b)])))
        return None


def record_or_resize(outputs: dict, i: int, rel: str, out: Tensor, layout, device) -> Tensor:
    """A planned module's output in a layout run: the global run (``layout`` None) records its
    shape as call ``i`` of ``rel`` in ``outputs``; a local run returns it at the shape ``layout``
    gives it from that global shape (a new empty tensor when it differs)."""
    calls = outputs.setdefault(rel, [])
    if layout is None:
        if i < len(calls):
            calls[i][1] = tuple(out.shape)
        return out
    glob = calls[i][1] if i < len(calls) and calls[i][1] is not None else tuple(out.shape)
    shape = layout.output(tuple(out.shape), glob)
    return out if shape == tuple(out.shape) else torch.empty(shape, dtype=out.dtype, device=device)

def record(module: nn.Module, args: tuple, kwargs: Mapping, *, shapes: Mapping[str, torch.Size] | None = None,
           attrs: Mapping[str, int] | None = None, opaque: Mapping[str, Callable] | None = None,
           outputs: dict[str, list] | None = None) -> tuple[list[Op], bool]:
    """(the ops of one forward of a meta copy of ``module``, whether it ran to the end).

    Every torch op with a tensor result is recorded (``Op``), with the ``(owner, attribute)`` pairs whose
    integers (``trace.TracedInt``) were among its arguments.  Planned children are opaque: their inner
    ops are not recorded, and at local shapes their output takes the layout the boundary hands on (a
    gathered output whole again, ``Shard(d)`` divided on ``d``).

    ``shapes``: parameter shapes by name below ``module``; ``attrs``: ``"sub.attr"`` → value;
    ``opaque``: relative path of a planned child → its ``Handoff`` (None: the global run, inputs
    and outputs kept); ``outputs``: filled with each opaque child's output shapes per call (the
    global run's, handed to ``Handoff.output`` in the local run)."""
    fake = any(isinstance(t, FakeTensor) for t in _leaves((args, kwargs)))  # traced on fake CPU tensors
    with fake_mode(fake) as device:
        return _record(module, args, kwargs, shapes, attrs, opaque, outputs, device)


def _record(module, args, kwargs, shapes, attrs, opaque, outputs, device: str) -> tuple[list[Op], bool]:
    twin = meta_copy(module, shapes, device)
    for path, m in twin.named_modules():
        for attr, value in list(vars(m).items()):
            if type(value) is int:
                setattr(m, attr, TracedInt(value, {(path, attr)}))
    for path, value in (attrs or {}).items():
        owner, _, attr = path.rpartition(".")
        setattr(twin.get_submodule(owner), attr, TracedInt(int(value), {(owner, attr)}))
    rec, handles, seen = _Recorder(), [], {}
    for rel, layout in (opaque or {}).items():
        def pre(mod, a, rel=rel, layout=layout):
            rec.depth += 1
            i = seen[rel] = seen.get(rel, -1) + 1
            calls = (outputs or {}).get(rel, [])
            first = a[0] if a and isinstance(a[0], Tensor) else None
            if layout is None:
                if outputs is not None:
                    outputs.setdefault(rel, []).append([tuple(first.shape) if first is not None else None, None])
                return a
            return layout.input(a, calls[i][0] if i < len(calls) else None)

        def post(mod, a, out, rel=rel, layout=layout):
            rec.depth -= 1
            if outputs is None or not isinstance(out, Tensor):
                return out
            out = record_or_resize(outputs, seen[rel], rel, out, layout, device)
            packed = layout.packing(rel, tuple(out.shape)) if layout is not None else None
            if packed is not None:
                rec.tag(out, packed)
            return out
        sub = twin.get_submodule(rel)
        handles += [sub.register_forward_pre_hook(pre), sub.register_forward_hook(post)]
    ok = True
    try:
        with torch.no_grad(), rec:
            twin(*to_meta(snapshot(tuple(args)), device), **to_meta(snapshot(dict(kwargs)), device))
    except Exception:  # noqa: BLE001 - the record says where it stopped
        ok = False
    finally:
        for h in handles:
            h.remove()
    return rec.ops, ok


def divided(glob: Shape, local: Shape) -> list[tuple[int, int]] | None:
    """(dim, factor) of every dim the local shape divides; None: not a division of ``glob``."""
    if len(glob) != len(local):
        return None
    out = []
    for d, (g, m) in enumerate(zip(glob, local, strict=True)):
        if g != m:
            if m <= 0 or g % m:
                return None
            out.append((d, g // m))
    return out


def groups(a: Shape, b: Shape) -> list[tuple[list[int], list[int]]] | None:
    """How a view of ``a`` into ``b`` groups their dims (size-1 dims left out): pairs of (dims
    of ``a``, dims of ``b``) with equal products; None when the sizes do not match."""
    ia, ib = [i for i, s in enumerate(a) if s != 1], [j for j, s in enumerate(b) if s != 1]
    out, i, j = [], 0, 0
    while i < len(ia) and j < len(ib):
        ga, gb, pa, pb = [ia[i]], [ib[j]], a[ia[i]], b[ib[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(ia):
                ga.append(ia[i])
                pa, i = pa * a[ia[i]], i + 1
            elif pb < pa and j < len(ib):
                gb.append(ib[j])
                pb, j = pb * b[ib[j]], j + 1
            else:
                return None
        out.append((ga, gb))
    return out if i == len(ia) and j == len(ib) else None


def _check(g: Op, m: Op, n: int) -> tuple[str, str] | None:
    """(rule, why) when op ``m`` at local shapes is not op ``g`` divided; None: it is."""
    if m.error is not None:
        return "raises", f"torch would raise: {m.error}"
    if g.name != m.name or len(g.ins) != len(m.ins) or len(g.outs) != len(m.outs):
        return "count", f"the local forward calls {m.name} where the global one calls {g.name}"
    if m.cut is not None:
        return "packed", m.cut
    ins = [divided(a, b) for a, b in zip(g.ins, m.ins, strict=True)]
    outs = [divided(a, b) for a, b in zip(g.outs, m.outs, strict=True)]
    for a, b, d in zip(g.outs, m.outs, outs, strict=True):
        if d is None or n % math.prod(k for _, k in d):  # several dims: replicated KV heads expanded over groups
            return "shape", f"its local result {list(b)} is not its global result {list(a)} divided along one dim"
    if g.name in CONTRACTS and len(g.ins) >= 2:
        first = 1 if g.name == "baddbmm" else 0
        a, b = ins[first], ins[first + 1]
        rank_b = len(g.ins[first + 1])
        contracted_b = rank_b - 1 if g.name == "linear" or rank_b == 1 else rank_b - 2
        if any(d == len(g.ins[first]) - 1 for d, _ in a or ()) or any(d == contracted_b for d, _ in b or ()):
            return "contract", "it sums over a divided dim (each rank would hold a partial sum)"
    if any(ins) and not any(outs) and not g.name.startswith(FACTORIES):
        return "lost", (f"its input is divided ({[list(s) for s in m.ins]} locally, {[list(s) for s in g.ins]} "
                        f"globally) but its result {list(m.outs[0])} is the whole global one")
    if g.name in VIEWS:
        return _view(g, m, ins[0], outs[0])
    return None


def _view(g: Op, m: Op, din, dout) -> tuple[str, str] | None:
    """A view's division must land on the outermost dim of its divided input dim's group — for a
    packed input of P equal blocks viewed with the blocks on dims of their own (``(..., 3, H, D)``),
    on the dim after them (each rank holds a slice of every block).  A group of leading dims only
    (no feature dim: ViTDet's ``(B, H, S, D)`` → ``(B*H, S, D)`` and back) may hold it on any of its
    dims: the rows are reordered, each one whole, and the shape checks of every later op still
    apply; the shard-time probe compares the numbers."""
    grouped = groups(g.ins[0], g.outs[0])
    if grouped is None or din is None or len(din) > 1:
        return None
    want: dict[int, int] = {}
    p = m.packed if m.packed is not None and din and m.packed.dim == din[0][0] else None
    if din:
        dim, k = din[0]
        group = next(((a, b) for a, b in grouped if dim in a), None)
        if group is None:
            return None
        rows = len(g.ins[0]) - 1 not in group[0] and len(g.outs[0]) - 1 not in group[1]
        if rows and len(dout or ()) == 1 and dout[0][0] in group[1] and dout[0][1] == k:
            return None  # rows only (ViTDet's batch × heads merged, then split back): each row whole
        if group[0][0] != dim:
            return "view", f"it merges the divided dim {dim} into a dim of which it is not the outermost part"
        want = {group[1][0]: k}
        if p is not None and len(p.blocks) > 1:  # judged on the global shapes: a local head count of 1 is ambiguous
            sizes = [g.outs[0][j] for j in group[1]]
            prefix = next((t for t in range(1, len(sizes)) if math.prod(sizes[:t]) == len(p.blocks)), None)
            whole = view_packing(p.moved(dim, tuple(b * k for b in p.blocks)), g.ins[0], g.outs[0])
            if prefix is not None and len(set(p.blocks)) == 1:
                want = {group[1][prefix]: k}  # the blocks on dims of their own, each divided inside
            elif whole is None:
                return "packed", (f"it views dim {dim} of {p.source!r}'s output, {len(p.blocks)} packed blocks of local "
                                  f"sizes {list(p.blocks)}, as {list(g.outs[0])} (local {list(m.outs[0])}): the blocks "
                                  "land neither on dims of their own nor whole on one dim, so each rank's rows would be "
                                  f"read as other rows (plan {p.source!r} as one block, Colwise(), if the view "
                                  "interleaves them per head)")
            else:
                want = {whole.dim: k}
    if dict(dout) != want:
        gl, lo = list(g.outs[0]), list(m.outs[0])
        if not want:
            return "view", f"its local result {lo} is not its global result {gl}: it divides a dim no input divides"
        dim_want, k = next(iter(want.items()))
        sizes = [gl[j] for j in group[1]]
        t = group[1].index(dout[0][0]) if len(dout) == 1 and dout[0][0] in group[1] else 0
        lead, note = math.prod(sizes[:t]), ""
        if p is not None and len(p.blocks) == 1 and lead in (2, 3):  # the same shapes as a head count kept global
            note = (f" (if {p.source!r} packs {lead} blocks, as a fused qkv or gate_up does, each rank holds a "
                    f"contiguous range of its rows, not a slice of every block: plan it Colwise(packed={lead}))")
        elif p is not None and len(p.blocks) > 1 and dim_want != group[1][0]:
            note = f" (the dim after the {len(p.blocks)} packed blocks of {p.source!r}'s output)"
        got = ", ".join(f"dim {d} ({gl[d]} → {lo[d]})" for d, _ in dout) or "no dim"
        if dout and all(d > dim_want for d, _ in dout) and dout[-1][0] == len(gl) - 1:
            return "view", (f"each head's {gl[-1]} features would be cut to {lo[-1]}: the division lands on {got} "
                            f"where it must land on dim {dim_want}{note}, {gl[dim_want]} → {gl[dim_want] // k} "
                            f"(local {lo}, global {gl})")
        return "view", (f"its local result {lo} is not its global result {gl} divided on dim {dim_want}{note}: "
                        f"the division lands on {got} (a -1 or a count kept global lands the division elsewhere)")
    return None


def compare(glob: list[Op], local: list[Op], n: int) -> Mismatch | None:
    """The first op at which ``local`` is not ``glob`` divided, with the rule it breaks; None: none.

    * ``raises``: the op raises at local shapes only (``view`` of a wrong size);
    * ``shape``: an output differs from the global one other than by dims divided by factors whose
      product divides ``n`` (one dim, or KV heads and their groups where KV heads are replicated);
    * ``view``: a ``view``/``reshape``/``flatten``/``unflatten`` whose division does not land on the
      outermost dim of the group its divided input dim becomes (a ``-1`` landing on the sequence, a
      head count kept global so that every head's features are cut), computed from the global shapes;
    * ``lost``: a divided input and an undivided result (``x[..., :q]`` with a global offset, a sum
      over the divided dim);
    * ``contract``: a matmul, ``linear`` or attention over a divided dim (partial sums);
    * ``count``: the local forward makes fewer or more ops."""
    for i, g in enumerate(glob):
        if i >= len(local):
            return Mismatch(i, g, None, "count", "the local forward stops before it")
        bad = _check(g, local[i], n)
        if bad is not None:
            return Mismatch(i, g, local[i], *bad)
    if len(local) > len(glob):
        return Mismatch(len(glob), local[len(glob)], local[len(glob)], "count", "the local forward makes more ops")
    return None


def culprits(ops: list[Op], at: int) -> tuple[frozenset[tuple[str, str]], Op | None]:
    """(the attributes that fed op ``at``, None) if any did, else those of the nearest earlier op
    fed by any, with that op."""
    if at < len(ops) and ops[at].attrs:
        return ops[at].attrs, None
    for op in reversed(ops[:at]):
        if op.attrs:
            return op.attrs, op
    return frozenset(), None


@dataclass(frozen=True)
class Handoff:
    """A planned child's boundaries as the audit's local run applies them: ``dst``, the placement
    its first tensor argument is brought to (``Shard(d)``: divided on ``d``; ``Replicate``: the
    whole global argument, gathered; None: as it comes), and ``out``, the placement its output is
    handed on in, when it differs from ``src``, the one it is produced in (``Shard(d)`` divides
    ``d`` unless its local result already is; anything else — gathered or reduced — is the whole
    global result)."""

    n: int
    out: object = None
    dst: object = None
    src: object = None  # the placement the output is produced in
    blocks: int | tuple[int, ...] | None = None  # the packed blocks of its weight (Colwise(packed=...))

    def packing(self, rel: str, local: Shape) -> Packed | None:
        """How the output handed on (at local shape ``local``) is divided: its sharded dim, one block
        or its weight's packed blocks; None: handed on whole."""
        dim = getattr(self.out, "dim", None)
        if dim is None or not local or self.n < 2:
            return None
        d, size = dim % len(local), local[dim % len(local)]
        if isinstance(self.blocks, int) and self.blocks > 1 and size % self.blocks == 0:
            return Packed(rel, d, (size // self.blocks,) * self.blocks)
        if isinstance(self.blocks, tuple) and all(b % self.n == 0 for b in self.blocks) and sum(self.blocks) == size * self.n:
            return Packed(rel, d, tuple(b // self.n for b in self.blocks))
        return Packed(rel, d, (size,))

    def input(self, args: tuple, glob: Shape | None) -> tuple:
        if self.dst is None or glob is None or not args or not isinstance(args[0], Tensor):
            return args
        have = tuple(args[0].shape)
        want = self._divided(have, glob, getattr(self.dst, "dim", None))
        return args if want == have else (torch.empty(want, dtype=args[0].dtype, device=args[0].device), *args[1:])

    def output(self, local: Shape, glob: Shape) -> Shape:
        if self.out == self.src:
            return local  # no boundary on the way out: what the module computed
        return self._divided(local, glob, getattr(self.out, "dim", None))

    def _divided(self, local: Shape, glob: Shape, dim: int | None) -> Shape:
        if dim is None or len(local) != len(glob):
            return glob if dim is None else local
        d = dim % len(glob)
        if local[d] != glob[d] and all(a == b for i, (a, b) in enumerate(zip(local, glob, strict=True)) if i != d):
            return local  # already divided there (by n, or by fewer for replicated KV heads)
        return (*glob[:d], glob[d] // self.n, *glob[d + 1:])


def handoff(spec, axis: str, n: int) -> Handoff:
    """The ``Handoff`` of a planned child from its ``ModuleSpec``."""
    src = spec.out_src.get("output", {}).get(axis)
    out = spec.out_dst.get("output", spec.out_src.get("output", {})).get(axis)
    dst = next((spec.in_dst[k].get(axis) for k in (0, "input") if k in spec.in_dst), None)
    return Handoff(n, out, dst, src, spec.param_blocks.get("weight"))


def boundaries(spec, axis: str) -> bool:
    """Whether the audit runs a planned module opaque, its boundaries applied: it shards a
    parameter (a projection, an embedding) or converts a layout on ``axis`` (a sequence-parallel
    norm, a ``PrepareModuleInput``: what it hands on is its output's declared layout)."""
    return any(splits(pl.get(axis)) for pl in spec.params.values()) or any(
        axis in layouts for layouts in (*spec.in_dst.values(), *spec.out_dst.values()))
