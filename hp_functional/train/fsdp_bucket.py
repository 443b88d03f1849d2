"""FSDP's bucket collective: a group's local leaves as one flat buffer, gathered by one
all-gather whose backward is one reduce-scatter (``GatherParams``), and what gradient
accumulation keeps between backward passes (``Unreduced``, ``Sync``).  Used by ``train/fsdp.py``."""

from __future__ import annotations

__all__ = ["Bucket", "Piece", "Sync"]

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.collectives import COLLECTIVES, AxisGroup, raw_all_gather
from ..core.lowering import Step


class Unreduced:
    """A bucket's gradients kept unreduced across micro-batches (``FsdpLayout.no_sync``): the
    full flat gradient, summed in ``reduce_dtype``, added to the next reduce-scatter."""

    __slots__ = ("grad",)

    def __init__(self):
        self.grad: Tensor | None = None

    def keep(self, grad: Tensor) -> None:
        self.grad = grad if self.grad is None else self.grad + grad

    def take(self, grad: Tensor) -> Tensor:
        kept, self.grad = self.grad, None
        return grad if kept is None else grad + kept


class GatherParams(torch.autograd.Function):
    """All-gather of a group's flat local bucket (cast to ``param_dtype`` first); backward: the
    gradients cast to ``reduce_dtype``, reduce-scattered (the differentiable ``reduce_scatter``,
    so a double backward works), divided by ``divisor`` (the axis size, or per piece, see
    ``Piece.divisor``) and cast back to the bucket's dtype.
    While ``sync.deferred``, the backward keeps the gradient in ``unreduced`` instead (no
    collective; the local leaf gets no gradient), for the next reduce-scatter to include."""

    @staticmethod
    def forward(local: Tensor, group: AxisGroup, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
                unreduced: Unreduced, sync: Sync, divisor: int | Tensor) -> Tensor:
        return raw_all_gather(local.to(param_dtype), 0, group)

    @staticmethod
    def setup_context(ctx, inputs, output):
        local, ctx.group, _, ctx.reduce_dtype, ctx.unreduced, ctx.sync, ctx.divisor = inputs
        ctx.dtype = local.dtype

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.to(ctx.reduce_dtype)
        if ctx.sync.deferred:
            ctx.unreduced.keep(grad)
            return None, None, None, None, None, None, None
        summed = COLLECTIVES["reduce_scatter"].apply(ctx.unreduced.take(grad), 0, ctx.group)
        return (summed / ctx.divisor).to(ctx.dtype), None, None, None, None, None, None


class Sync:
    """Whether backward passes reduce-scatter now (the default) or defer (``FsdpLayout.no_sync``)."""

    __slots__ = ("deferred",)

    def __init__(self):
        self.deferred = False


@dataclass(frozen=True)
class Piece:
    """One leaf in a bucket: its TP-local (gathered) shape, rows per rank, where its padded piece
    starts in a rank's segment, and the parameter conversions ``shard()`` lowered for it."""

    key: str
    shape: torch.Size
    chunk: int
    start: int
    steps: tuple[Step, ...]
    divisor: int = 1  # the reduce-scattered gradient's divisor: the fsdp axes' sizes it is averaged over

    @property
    def size(self) -> int:
        return self.chunk * math.prod(self.shape[1:])


class Bucket:
    """A group's leaves as one flat buffer per rank: ``gather`` turns the local leaves into the
    TP-local parameters with one all-gather (see ``GatherParams``)."""

    def __init__(self, name: str, pieces: Sequence[Piece], group: AxisGroup, param_dtype: torch.dtype | None,
                 reduce_dtype: torch.dtype | None, sync: Sync):
        self.name, self.pieces, self.group, self.sync, self.unreduced = name, tuple(pieces), group, sync, Unreduced()
        self.keys = tuple(p.key for p in self.pieces)
        self.segment = sum(p.size for p in self.pieces)
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        # replicated parameters consumed by rank-varying compute (every piece converted by copy_to on
        # the same axes, as under context parallelism): one copy_to on the gathered buffer instead
        signatures = {tuple((s.name, s.axis) for s in p.steps) for p in self.pieces}
        shared = next(iter(signatures)) if len(signatures) == 1 else ()
        self.copy_to = self.pieces[0].steps if shared and all(n == "copy_to" for n, _ in shared) else ()
        # mean over the fsdp axes, sum over those folded (a per-piece divisor only where they differ)
        divisors = {p.divisor for p in self.pieces}
        self.divisor: int | Tensor = divisors.pop() if len(divisors) == 1 else torch.cat(
            [torch.full((p.size,), float(p.divisor)) for p in self.pieces])

    def unsharded_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of the gathered parameters (what a rank holds while the group is gathered)."""
        size = (self.param_dtype or dtype).itemsize
        return sum(math.prod(p.shape) for p in self.pieces) * size

    def gather(self, values: Sequence[Tensor]) -> list[Tensor]:
        """The TP-local parameters of this group from this rank's local leaves ``values``."""
        flat = []
        for piece, v in zip(self.pieces, values, strict=True):
            f = v.reshape(-1)
            flat.append(f if f.numel() == piece.size else torch.cat([f, f.new_zeros(piece.size - f.numel())]))
        local = torch.cat(flat) if len(flat) > 1 else flat[0]
        dtype = local.dtype
        divisor = self.divisor if isinstance(self.divisor, int) else self.divisor.to(local.device)
        full = GatherParams.apply(local, self.group, self.param_dtype or dtype, self.reduce_dtype or dtype,
                                  self.unreduced, self.sync, divisor)
        for step in self.copy_to:
            full = step(full)
        full = full.view(self.group.size, self.segment)
        out = []
        for piece in self.pieces:
            t = full[:, piece.start:piece.start + piece.size].reshape(-1, *piece.shape[1:])[:piece.shape[0]]
            for step in () if self.copy_to else piece.steps:
                t = step(t)
            out.append(t)
        return out
