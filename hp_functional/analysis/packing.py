"""How a local run's tensor is divided when a sharded projection's output flows through the shape
audit (``analysis.audit``): ``Packed`` (its dim and blocks, one for a plain ``Colwise``, the
``packed`` ones otherwise), and how a view, a permutation, a slice or a concatenation moves or
cuts those blocks.  docs/guarantees.md#exact-or-refused-the-shape-audit.
"""

from __future__ import annotations

__all__ = ["CONCATS", "Packed", "concatenated", "permutation", "slice_of", "view_packing"]

import math
from dataclasses import dataclass

from torch import Tensor

from .trace import _leaves

Shape = tuple[int, ...]
CONCATS = ("cat", "concat", "concatenate")


@dataclass(frozen=True)
class Packed:
    """How a tensor of a local run is divided: along ``dim``, each rank holding its slice of every
    block of ``blocks`` (local sizes, in order) — a planned projection's sharded output, one block
    for a plain ``Colwise``, ``packed`` blocks for ``Colwise(packed=...)`` — from the output of
    planned child ``source``.  A view, split or slice of ``dim`` is right only where it respects
    the blocks (docs/guarantees.md#exact-or-refused-the-shape-audit)."""

    source: str
    dim: int
    blocks: tuple[int, ...]

    def moved(self, dim: int, blocks: tuple[int, ...] | None = None) -> Packed:
        return Packed(self.source, dim, self.blocks if blocks is None else blocks)



def concatenated(args, kwargs, p: Packed) -> str | None:
    """Why a concatenation along a divided dim is not the global one divided: each rank holds its
    slice of every piece, not a contiguous slice of the whole (Flux's single block concatenates
    attention and MLP features and contracts them in one Rowwise projection)."""
    pieces = [t for t in (args[0] if args else kwargs.get("tensors", ())) if isinstance(t, Tensor)]
    dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    if len(pieces) < 2 or not isinstance(dim, int) or dim % pieces[0].dim() != p.dim:
        return None
    return (f"it concatenates {len(pieces)} tensors along dim {p.dim}, which {p.source!r}'s sharded output divides: a "
            "rank holds its slice of each piece, not a contiguous slice of the whole; gather the pieces "
            "(Colwise(gather_output=True)) or keep them apart")


def permutation(name: str, args, ndim: int) -> list[int] | None:
    """The input dim of every output dim of a permute/transpose/movedim; None: not readable."""
    rest = [int(a) for a in _leaves(args[1:]) if isinstance(a, int)]
    order = list(range(ndim))
    if name == "permute" and len(rest) == ndim:
        return [d % ndim for d in rest]
    if name in ("transpose", "swapaxes", "swapdims") and len(rest) == 2:
        a, b = (d % ndim for d in rest)
        order[a], order[b] = order[b], order[a]
        return order
    if name == "movedim" and len(rest) == 2:
        a, b = (d % ndim for d in rest)
        order.insert(b, order.pop(a))
        return order
    return None


def slice_of(index, shape: Shape, dim: int) -> tuple[int, int] | None:
    """The [start, stop) that ``x[index]`` keeps of ``dim`` when a step-1 slice cuts it; None when
    it keeps all of it, or indexes it otherwise."""
    items = list(index) if isinstance(index, tuple) else [index]
    if any(x is Ellipsis for x in items):
        at = next(i for i, x in enumerate(items) if x is Ellipsis)
        used = sum(1 for x in items if x is not None and x is not Ellipsis)
        items[at:at + 1] = [slice(None)] * (len(shape) - used)
    d = 0
    for x in items:
        if x is None:
            continue
        if d == dim:
            if not isinstance(x, slice) or x.step not in (None, 1):
                return None
            a, b, _ = slice(*(None if v is None else int(v) for v in (x.start, x.stop, x.step))).indices(shape[dim])
            return None if (a, b) == (0, shape[dim]) else (a, b)
        if not isinstance(x, (int, slice)):
            return None  # a tensor or list index: dims renumbered
        d += 1
    return None


def view_packing(p: Packed, before: Shape, after: Shape) -> Packed | None:
    """The packing a view of a packed tensor keeps on its outermost dim of the packed dim's group
    (its blocks in that dim's units), or None: the view puts the blocks on dims of their own (a
    ``(..., 3, H, D)`` view of packed q, k, v) or cannot keep them (``compare`` judges it)."""
    outer, inner = math.prod(before[:p.dim]), math.prod(before[p.dim + 1:])
    flat = [b * inner for b in p.blocks]
    for j in range(len(after)):  # the outermost dim starting where the packed dim starts (a local head count of 1 too)
        stride = math.prod(after[j + 1:])
        if math.prod(after[:j]) == outer and stride and all(f % stride == 0 for f in flat) and sum(flat) // stride == after[j]:
            return p.moved(j, tuple(f // stride for f in flat))
    return None
