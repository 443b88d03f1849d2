"""FSDP's buckets: a group's local leaves as one flat buffer, gathered by one all-gather whose
backward is one reduce-scatter averaged over dp (``core.collectives.gather_params``, whose
transpose is ``mean_scatter``: the pair's jvp, vmap and higher-order rules are the table's), and
what gradient accumulation keeps between backward passes (``Unreduced``, ``Sync``).  Used by
``train/fsdp.py``."""

from __future__ import annotations

__all__ = ["Bucket", "Piece", "Sync"]

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.collectives import AxisGroup, CopyTo, Precision, gather_params
from ..core.lowering import Step


class Unreduced:
    """A bucket's gradients kept unreduced across micro-batches (``FsdpLayout.no_sync``): the
    full flat gradient, summed in ``reduce_dtype``, added to the next reduce-scatter.  The
    ``accumulator`` of the bucket's ``gather_params`` (``core.collectives.Accumulator``)."""

    __slots__ = ("grad", "sync")

    def __init__(self, sync: Sync):
        self.grad: Tensor | None = None
        self.sync = sync

    @property
    def deferred(self) -> bool:
        return self.sync.deferred

    def keep(self, grad: Tensor) -> None:
        self.grad = grad if self.grad is None else self.grad + grad

    def take(self, grad: Tensor) -> Tensor:
        kept, self.grad = self.grad, None
        return grad if kept is None else grad + kept


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
    TP-local parameters with one all-gather (``gather_params``)."""

    def __init__(self, name: str, pieces: Sequence[Piece], group: AxisGroup, param_dtype: torch.dtype | None,
                 reduce_dtype: torch.dtype | None, sync: Sync):
        self.name, self.pieces, self.group, self.sync, self.unreduced = name, tuple(pieces), group, sync, Unreduced(sync)
        self.keys = tuple(p.key for p in self.pieces)
        self.segment = sum(p.size for p in self.pieces)
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        # replicated parameters consumed by rank-varying compute (every piece converted by copy_to on
        # the same axes, as under context parallelism): one copy_to on the gathered buffer instead
        signatures = {tuple((s.collective, s.axis) for s in p.steps) for p in self.pieces}
        shared = next(iter(signatures)) if len(signatures) == 1 else ()
        self.copy_to = self.pieces[0].steps if shared and all(c is CopyTo for c, _ in shared) else ()
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
        precision = Precision(dtype, self.param_dtype or dtype, self.reduce_dtype or dtype)
        full = gather_params(local, 0, precision, divisor, self.group, self.unreduced)
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
