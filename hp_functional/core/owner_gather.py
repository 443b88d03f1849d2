"""Whole matrices at one owner rank each, and the results back to the shards (``hpf.optim.muon``'s
Newton–Schulz step, which needs a whole matrix where TP, FSDP or EP leave each rank a piece).

``plan_owners`` decides once, from every rank's boxes (one small all-gather of Python objects), which
rank owns each matrix (a *unit*: a 2-D leaf, or one member of a stacked 3-D leaf such as MoE experts)
and which rank sends each piece.  The owner is chosen among the ranks that hold part of the matrix,
largest matrices first, each to the least loaded such rank (ties: the lowest rank), so the work is
balanced and a matrix one rank holds whole never moves.  ``agree_flags`` gives every rank every
other rank's flags, a bool per matrix (``muon``'s: which have no gradient), by one all-gather of a
byte each; on the call that decides the plan they ride in ``plan_owners``' all-gather
(``OwnerPlan.flags``).  So a caller can refuse alike on every rank before any gather.  Per bucket of
leaves, ``gather_to_owners`` is one variable-split all-to-all of bytes (each rank sends its pieces
to their owners) and ``scatter_from_owners`` one more (each owner sends every holder its pieces of
the result); either is skipped where no piece would leave its rank (a bucket of experts each held
whole by one rank issues none; a replicated matrix, held whole by its owner, only the scatter to its
replicas).  Peak memory: the owned matrices of one bucket.
"""

from __future__ import annotations

__all__ = ["OwnerPlan", "agree_flags", "gather_to_owners", "plan_owners", "scatter_from_owners"]

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor
from torch.distributed.tensor import Replicate

from .buckets import plan_buckets
from .exchange import Exchange, exchange_over
from .host_comm import gather_objects
from .placement import Box, ShardInfo, boxes


class Unit(NamedTuple):
    """One matrix: leaf ``key`` (``index`` None), or member ``index`` of the stacked leaf ``key``;
    ``shape`` is the shape it is gathered in (``(1, rows, cols)`` for a stack member)."""

    key: str
    index: int | None
    shape: tuple[int, ...]


@dataclass(frozen=True)
class OwnerPlan:
    """What ``plan_owners`` decided, alike on every rank.  ``held[r][u]``: group rank ``r``'s boxes of
    unit ``u`` (``start`` relative to the unit); ``sends[r][u]``: which of them ``r`` sends to the
    owner; ``owners[u]``: the owner's group rank; ``buckets``: unit indices, whole leaves per bucket;
    ``flags[r]``: the ``flags`` group rank ``r`` gave ``plan_owners`` (``agree_flags`` of that call)."""

    exchange: Exchange
    units: tuple[Unit, ...]
    owners: tuple[int, ...]
    held: tuple[tuple[tuple[Box, ...], ...], ...]
    sends: tuple[tuple[tuple[bool, ...], ...], ...]
    buckets: tuple[tuple[int, ...], ...]
    flags: tuple[tuple[bool, ...], ...] = ()

    def owned(self, bucket: int) -> list[int]:
        """The units of ``bucket`` this rank owns."""
        return [u for u in self.buckets[bucket] if self.owners[u] == self.exchange.index]


def _units(shard_info: Mapping[str, ShardInfo], keys: Sequence[str], stacked: Callable[[str], bool]) -> list[Unit]:
    out = []
    for k in keys:
        shape = tuple(shard_info[k].global_shape)
        if stacked(k):
            out += [Unit(k, i, (1, *shape[1:])) for i in range(shape[0])]
        else:
            out.append(Unit(k, None, shape))
    return out


def _unit_boxes(bxs: Sequence[Box], unit: Unit) -> tuple[Box, ...]:
    """The parts of ``bxs`` (a rank's boxes of ``unit.key``) inside ``unit``, ``start`` relative to it."""
    if unit.index is None:
        return tuple(bxs)
    i, out = unit.index, []
    for b in bxs:
        if b.start[0] <= i < b.start[0] + b.size[0]:
            out.append(Box((0, *b.start[1:]), (b.local[0] + i - b.start[0], *b.local[1:]), (1, *b.size[1:])))
    return tuple(out)


def _owners(units: Sequence[Unit], held) -> list[int]:
    """Each unit's owner: largest first, to the least loaded rank holding part of it (ties: lowest)."""
    load = [0] * len(held)
    owners = [0] * len(units)
    for u in sorted(range(len(units)), key=lambda u: -math.prod(units[u].shape)):
        candidates = [r for r in range(len(held)) if held[r][u]] or list(range(len(held)))
        owners[u] = min(candidates, key=lambda r: (load[r], r))
        load[owners[u]] += math.prod(units[u].shape)
    return owners


def _sends(units: Sequence[Unit], held, owners: Sequence[int], coords, replicated) -> list[list[tuple[bool, ...]]]:
    """Whether rank ``r`` sends each of its boxes of unit ``u``: a box several ranks hold (replicas)
    comes once, from the lowest rank of the owner's replica (same coordinates on the leaf's
    replicated mesh dims) that holds it, else from the lowest rank that holds it."""
    out = [[()] * len(units) for _ in held]
    for u, unit in enumerate(units):
        o, dims = owners[u], replicated[unit.key]
        first: dict[tuple, int] = {}
        for prefer in (True, False):
            for r in range(len(held)):
                if prefer and any(coords[r][d] != coords[o][d] for d in dims):
                    continue
                for b in held[r][u]:
                    first.setdefault((b.start, b.size), r)
        for r in range(len(held)):
            out[r][u] = tuple(first[(b.start, b.size)] == r for b in held[r][u])
    return out


def plan_owners(shard_info: Mapping[str, ShardInfo], keys: Sequence[str], stacked: Callable[[str], bool],
                bucket_bytes: int, what: str, flags: Sequence[bool] = ()) -> OwnerPlan:
    """The ``OwnerPlan`` of the matrices of ``keys`` (all on one mesh; ``stacked(key)``: a 3-D leaf
    is a stack of matrices along dim 0), buckets of at most ``bucket_bytes`` of whole leaves (at 4
    bytes an element), and every rank's ``flags`` (``OwnerPlan.flags``: ``agree_flags`` at no
    collective of its own).  A collective over the mesh: one all-gather of every rank's boxes."""
    mesh = shard_info[keys[0]].mesh
    exchange = exchange_over([mesh], what)
    mine = (exchange.index, tuple(mesh.get_coordinate()), {k: boxes(shard_info[k]) for k in keys}, tuple(flags))
    rows = sorted(gather_objects(mine, mesh), key=lambda row: row[0])
    units = _units(shard_info, keys, stacked)
    held = tuple(tuple(_unit_boxes(row[2][u.key], u) for u in units) for row in rows)
    owners = _owners(units, held)
    replicated = {k: [d for d, p in enumerate(shard_info[k].placements) if isinstance(p, Replicate)] for k in keys}
    sends = _sends(units, held, owners, [row[1] for row in rows], replicated)
    sizes = ((k, "bytes", 4 * math.prod(shard_info[k].global_shape)) for k in keys)
    by_key: dict[str, list[int]] = {}
    for u, unit in enumerate(units):
        by_key.setdefault(unit.key, []).append(u)
    buckets = tuple(tuple(u for k in b for u in by_key[k]) for b in plan_buckets(sizes, bucket_bytes))
    return OwnerPlan(exchange, tuple(units), tuple(owners), held, tuple(tuple(s) for s in sends), buckets,
                     tuple(tuple(bool(f) for f in row[3]) for row in rows))


def agree_flags(plan: OwnerPlan, flags: Sequence[bool]) -> tuple[tuple[bool, ...], ...]:
    """Every group rank's ``flags`` (one bool per matrix leaf, alike in length on every rank), in
    group rank order: one all-gather of a byte each over ``plan``'s group."""
    every = plan.exchange.all_gather(torch.tensor([bool(f) for f in flags], dtype=torch.uint8))
    return tuple(tuple(bool(f) for f in row) for row in every.cpu().tolist())


def _bytes(parts: Sequence[Tensor]) -> Tensor:
    flat = [p.contiguous().reshape(-1).view(torch.uint8) for p in parts]
    return torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)


def _moves(plan: OwnerPlan, bucket: int, gather: bool) -> bool:
    """Whether any piece of ``bucket`` goes between two different ranks (alike on every rank): a
    piece sent to its owner (``gather``), else a piece of a result to a rank that holds it."""
    return any(r != plan.owners[u] and (any(plan.sends[r][u]) if gather else plan.held[r][u])
               for u in plan.buckets[bucket] for r in range(len(plan.held)))


def _exchange(plan: OwnerPlan, bucket: int, send: list[list[Tensor]], recv_bytes: list[int], device,
              gather: bool) -> list[Tensor]:
    """``send[j]`` (pieces for group rank ``j``) delivered; the bytes received from each rank, split."""
    ex = plan.exchange
    if not _moves(plan, bucket, gather):
        return [_bytes(send[ex.index]) if j == ex.index else torch.empty(0, dtype=torch.uint8) for j in range(ex.size)]
    bufs = [_bytes(s) for s in send]
    got = ex.all_to_all(torch.cat(bufs).to(device), [b.numel() for b in bufs], recv_bytes)
    return list(got.split(list(recv_bytes)))


def _nbytes(b: Box, dtype: torch.dtype) -> int:
    return math.prod(b.size) * torch.empty(0, dtype=dtype).element_size()


def gather_to_owners(plan: OwnerPlan, bucket: int, local: Mapping[str, Tensor]) -> dict[int, Tensor]:
    """The whole matrices (``unit.shape``) of the units of ``bucket`` this rank owns, keyed by unit
    index, from every rank's ``local`` shards; one all-to-all (none if no piece moves)."""
    me, n = plan.exchange.index, plan.exchange.size
    units = plan.buckets[bucket]
    send: list[list[Tensor]] = [[] for _ in range(n)]
    for u in units:
        for b, s in zip(plan.held[me][u], plan.sends[me][u], strict=True):
            if s:
                send[plan.owners[u]].append(b.of_local(local[plan.units[u].key]))
    owned = plan.owned(bucket)
    dtype = {u: local[plan.units[u].key].dtype for u in owned}
    recv = [sum(_nbytes(b, dtype[u]) for u in owned for b, s in zip(plan.held[r][u], plan.sends[r][u], strict=True) if s)
            for r in range(n)]
    device = next(iter(local.values())).device
    got = _exchange(plan, bucket, send, recv, device, True)
    out = {u: torch.zeros(plan.units[u].shape, dtype=dtype[u], device=device) for u in owned}
    for r in range(n):
        start = 0
        for u in owned:
            for b, s in zip(plan.held[r][u], plan.sends[r][u], strict=True):
                if s:
                    size = _nbytes(b, dtype[u])
                    piece = got[r][start:start + size].to(device).view(dtype[u]).view(b.size)
                    b.of_global(out[u]).copy_(piece)
                    start += size
    return out


def scatter_from_owners(plan: OwnerPlan, bucket: int, results: Mapping[int, Tensor],
                        local_shapes: Mapping[str, Sequence[int]], dtype: torch.dtype, device) -> dict[str, Tensor]:
    """This rank's local shards (``local_shapes``, ``dtype``) of the leaves of ``bucket``, cut from
    the owners' ``results`` (unit index -> whole matrix, the units this rank owns); one all-to-all
    (none if no piece moves).  Every rank that holds a piece gets it, replicas included."""
    me, n = plan.exchange.index, plan.exchange.size
    units = plan.buckets[bucket]
    send: list[list[Tensor]] = [[] for _ in range(n)]
    for r in range(n):
        for u in plan.owned(bucket):
            send[r] += [b.of_global(results[u].to(dtype)) for b in plan.held[r][u]]
    recv = [sum(_nbytes(b, dtype) for u in units if plan.owners[u] == r for b in plan.held[me][u]) for r in range(n)]
    got = _exchange(plan, bucket, send, recv, device, False)
    keys = dict.fromkeys(plan.units[u].key for u in units)
    out = {k: torch.empty(tuple(local_shapes[k]), dtype=dtype, device=device) for k in keys}
    start = [0] * n
    for u in units:
        r = plan.owners[u]
        for b in plan.held[me][u]:
            size = _nbytes(b, dtype)
            b.of_local(out[plan.units[u].key]).copy_(got[r][start[r]:start[r] + size].to(device).view(dtype).view(b.size))
            start[r] += size
    return out
