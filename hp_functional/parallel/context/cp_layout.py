"""Sequence layouts of context parallelism: which global positions each rank of the ``cp`` axis holds.

* ``"zigzag"`` (head-tail, load-balanced for causal masks): the sequence is cut into ``2·cp``
  equal chunks and rank ``i`` holds chunks ``i`` and ``2·cp − 1 − i``, so every rank does the
  same causal work (Megatron-CP, torchtitan's ``load_balance``);
* ``"contiguous"``: rank ``i`` holds the ``i``-th of ``cp`` equal blocks (cheapest to convert,
  but under a causal mask the last rank does ``2·cp − 1`` times the first rank's work).

``cp_shard`` and ``cp_unshard`` are inverses: ``cp_unshard(cp_shard(x)) == x`` on every rank.
Both are pure; ``cp_shard`` is local (no communication), ``cp_unshard`` is one differentiable
all-gather (backward: reduce-scatter, then this rank's positions).
"""

from __future__ import annotations

__all__ = ["check_layout", "cp_chunks", "cp_positions", "cp_ranges", "cp_shard", "cp_unshard"]

import torch
from torch import Tensor

from ...core import collectives as C
from ...core.collectives import AxisGroup
from ...core.errors import ShapeError

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout: str) -> str:
    """``layout`` itself, or a ValueError naming the layouts there are."""
    if layout not in LAYOUTS:
        raise ValueError(f"context-parallel layout must be one of {list(LAYOUTS)}, got {layout!r}")
    return layout


def cp_chunks(seq_len: int, cp: int, layout: str = "zigzag", *, axis: str = "cp") -> int:
    """The number of equal chunks ``seq_len`` is cut into; a ShapeError (naming the axis) when it
    does not divide."""
    n = 2 * cp if check_layout(layout) == "zigzag" else cp
    if seq_len % n:
        raise ShapeError(f"context parallelism over mesh axis {axis!r} (size {cp}, layout {layout!r}): the sequence "
                         f"length {seq_len} is not divisible by {n}" + (" (2·cp: each rank holds two chunks)"
                                                                       if layout == "zigzag" else ""))
    return n


def cp_ranges(rank: int, seq_len: int, cp: int, layout: str = "zigzag") -> tuple[range, ...]:
    """The global positions rank ``rank`` holds, as ranges in its local order."""
    n = cp_chunks(seq_len, cp, layout)
    c = seq_len // n
    chunks = (rank, 2 * cp - 1 - rank) if layout == "zigzag" else (rank,)
    return tuple(range(k * c, (k + 1) * c) for k in chunks)


def cp_positions(rank: int, seq_len: int, cp: int, layout: str = "zigzag", device=None) -> Tensor:
    """The global positions rank ``rank`` holds, in its local order.

    Args:
        rank: the rank's index on the ``cp`` axis.
        seq_len: the full sequence length (divisible by ``2·cp`` for zigzag, ``cp`` for contiguous).
        cp: the size of the ``cp`` axis.
        layout: ``"zigzag"`` or ``"contiguous"``.
        device: where the result lives (None: torch's default device).
    Returns:
        A 1-D ``int64`` tensor of ``seq_len // cp`` global positions.
    """
    return torch.cat([torch.arange(r.start, r.stop, device=device) for r in cp_ranges(rank, seq_len, cp, layout)])


def _group(mesh, axis: str) -> AxisGroup:
    return mesh if isinstance(mesh, AxisGroup) else AxisGroup.from_mesh(mesh, axis)


def cp_shard(x: Tensor, mesh, dim: int = 1, *, cp_axis: str = "cp", layout: str = "zigzag") -> Tensor:
    """This rank's positions of the full-sequence ``x`` along ``dim`` (inverse: ``cp_unshard``).
    Local: every rank holds the whole ``x`` and keeps its part (for batches and labels).

    Args:
        x: the full sequence, alike on every rank of the axis.
        mesh: the ``DeviceMesh`` (or an ``AxisGroup`` of the axis).
        dim: the sequence dim of ``x``.
        cp_axis: the mesh axis of context parallelism.
        layout: ``"zigzag"`` or ``"contiguous"``.
    Returns:
        A new tensor holding this rank's ``x.shape[dim] // cp`` positions along ``dim``, in local order.
    """
    g = _group(mesh, cp_axis)
    index = cp_positions(g.rank, x.shape[dim], g.size, layout, device=x.device)
    return x.index_select(dim, index)


def cp_unshard(x: Tensor, mesh, dim: int = 1, *, cp_axis: str = "cp", layout: str = "zigzag") -> Tensor:
    """The full sequence in global order from every rank's ``x`` (its ``cp_shard`` part) along
    ``dim`` (inverse: ``cp_shard``): one differentiable all-gather, then the positions sorted.
    A collective: call on every rank of the axis.

    Args:
        x: this rank's part, in ``cp_shard``'s local order.
        mesh: the ``DeviceMesh`` (or an ``AxisGroup`` of the axis).
        dim: the sequence dim of ``x``.
        cp_axis: the mesh axis of context parallelism.
        layout: the layout ``x`` was cut with.
    Returns:
        The full tensor (``cp`` times ``x``'s length along ``dim``), the same on every rank.
    """
    g = _group(mesh, cp_axis)
    seq_len = x.shape[dim] * g.size
    held = torch.cat([cp_positions(r, seq_len, g.size, layout, device=x.device) for r in range(g.size)])
    gathered = C.all_gather(x, dim, g)
    return gathered.index_select(dim % x.dim(), torch.argsort(held))
