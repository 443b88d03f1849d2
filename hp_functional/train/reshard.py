"""``hpf.reshard``: this rank's local shards (params, optimizer state) moved in memory from one layout to
another over the same ranks (FSDP × TP → TP, tp 4 → dp 2 × tp 2, EP ↔ TP), bit for bit what gathering
and slicing again would give, without any rank holding more than its shards and two buckets.

Every rank computes, locally and alike, where every rank's source and destination shards sit
(``core.placement.boxes`` at each rank's coordinate), picks one source rank for each piece a
destination rank needs (itself where it holds it: a local copy), and moves the rest as raw bytes,
one variable-split all-to-all per bucket (``core.exchange``), after one small agreement that every
rank asked for the same move.  The bound on memory and the collectives: docs/reshard.md.
"""

from __future__ import annotations

__all__ = ["reshard"]

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from ..compile.agree import digest
from ..core.errors import PlanError, PlanMismatchError, ShapeError
from ..core.exchange import Exchange, exchange_over
from ..core.facets import RowSplit
from ..core.placement import Box, ShardInfo, boxes, fmt_placements, local_layout, packed_layout
from .optim import replicated_info


class _Leaf(NamedTuple):
    """One tensor to move: its name in errors, this rank's source shard, its two layouts."""

    name: str
    value: Tensor
    src: ShardInfo
    dst: ShardInfo


class _Piece(NamedTuple):
    """A box of elements moved between two ranks: ``peer`` is the other rank's index in the
    exchange (the source of a piece received, the destination of one sent), ``src``/``dst`` where
    the box starts in the source and destination local shards."""

    peer: int
    src: tuple[int, ...]
    dst: tuple[int, ...]
    size: tuple[int, ...]


class _Route(NamedTuple):
    """How one (source layout, destination layout) pair moves, seen from this rank: the pieces it
    copies locally, receives and sends (each in the plan's order, ``peer`` the other rank); the
    elements every rank sends to and receives from the others."""

    local: list[_Piece]
    recv: list[_Piece]
    send: list[_Piece]
    sent: tuple[int, ...]
    got: tuple[int, ...]


# ---------------------------------------------------------------- the public function
def reshard(tree: Any, src_info: Any, dst_info: Any, *, bucket_bytes: int = 64 * 2**20) -> Any:
    """Move this rank's local shards from the layout ``src_info`` describes to the one ``dst_info``
    describes (a collective: every rank of the meshes calls it alike).  Inverse: the same call with
    the layouts swapped.  Mutates nothing; never holds a full tensor a layout does not ask for.

    The result equals, bit for bit, ``slice_local(unshard(tree, src_info)[k], dst_info[k])``, with
    at most ``2 * bucket_bytes`` of buffers beyond the source and destination shards (a single
    tensor that moves more than that gets a bucket of its own).  Collectives: one all-gather of 3
    int64 per rank (the agreement) and one all-to-all per bucket of the tensors that some rank must
    receive from another; a tensor every rank already holds at the destination costs none (TP →
    FSDP × TP over the same TP: the agreement alone).  docs/reshard.md.

    Args:
        tree: this rank's local shards at ``src_info``: ``params`` (a dict FQN → tensor), an optimizer
            state (``hpf.optim``'s: its per-parameter leaves under the parameter's key), or any pytree
            of tensors shaped like ``src_info``.
        src_info, dst_info: two ``shard_info`` dicts (``hpf.shard``'s or ``hpf.fsdp``'s) of the same
            model over the same ranks, the meshes possibly different ((dp 2, tp 2) and (tp 4)); a leaf
            under a dict key takes that key's layout and any other (the optimizer's ``step``) is
            replicated (``hpf.optim.state_info``'s rule).  Or two pytrees of ``ShardInfo`` shaped like ``tree``.
        bucket_bytes: the most bytes one rank sends, and receives, in one all-to-all.

    Returns:
        ``tree``'s structure with new tensors at ``dst_info``'s local shapes; each keeps its dtype,
        device and ``requires_grad``.  A ``PlanError`` before any collective for keys, shapes or
        meshes that do not match; a ``PlanError`` on every rank after the agreement when the ranks
        were called differently or one rank's tensors do not have ``src_info``'s local shapes.
    """
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise PlanError(f"reshard: bucket_bytes must be a positive int, got {bucket_bytes!r}")
    leaves, rebuild = _leaves(tree, src_info, dst_info)
    if not leaves:
        return rebuild([])
    ex = exchange_over(list({id(m): m for leaf in leaves for m in (leaf.src.mesh, leaf.dst.mesh)}.values()), "reshard")
    places = _Places(ex)
    routes = [places.route(leaf) for leaf in leaves]
    _agree(leaves, places, bucket_bytes)
    return rebuild(_move(leaves, routes, _buckets(leaves, routes, ex.size, bucket_bytes), ex))


# ---------------------------------------------------------------- the input
def _leaves(tree: Any, src: Any, dst: Any) -> tuple[list[_Leaf], Callable[[list[Tensor]], Any]]:
    """The tensors of ``tree`` with their two layouts, and how to put new leaves back in its shape;
    a PlanError (alike on every rank) for what does not match."""
    accessors, values, spec = optree.tree_flatten_with_accessor(tree)
    flat = isinstance(tree, Mapping) and all(len(a.path) == 1 for a in accessors)
    names = [a.path[0] if flat else a.codify("tree") for a in accessors]
    if _is_info_dict(src) and _is_info_dict(dst):
        _check_info_keys(src, dst)
        if flat and set(tree) != set(src):
            raise PlanError(f"reshard: the tree and src_info have different keys: missing from the tree "
                            f"{sorted(set(src) - set(tree))[:5]}, not in src_info {sorted(set(tree) - set(src))[:5]}")
        pairs = [_by_key(a.path, v, src, dst, n) for a, v, n in zip(accessors, values, names, strict=True)]
    else:
        pairs = _by_tree(spec, src, dst)
    leaves = []
    for name, value, (s, d) in zip(names, values, pairs, strict=True):
        if not isinstance(value, Tensor):
            raise PlanError(f"reshard: {name} is a {type(value).__name__}, not a tensor")
        if tuple(s.global_shape) != tuple(d.global_shape):
            raise ShapeError(f"reshard: {name} has global shape {tuple(s.global_shape)} in src_info but "
                             f"{tuple(d.global_shape)} in dst_info: layouts of another model?")
        leaves.append(_Leaf(name, value, s, d))
    return leaves, lambda new: optree.tree_unflatten(spec, new)


def _is_info_dict(x: Any) -> bool:
    return isinstance(x, Mapping) and all(isinstance(k, str) and isinstance(v, ShardInfo) for k, v in x.items())


def _check_info_keys(src: Mapping[str, ShardInfo], dst: Mapping[str, ShardInfo]) -> None:
    if set(src) != set(dst):
        raise PlanError(f"reshard: src_info and dst_info have different keys (another model's shard_info?): missing "
                        f"from dst_info {sorted(set(src) - set(dst))[:5]}, not in src_info {sorted(set(dst) - set(src))[:5]}")


def _by_key(path: tuple, value: Any, src: Mapping[str, ShardInfo], dst: Mapping[str, ShardInfo],
            name: str) -> tuple[ShardInfo, ShardInfo]:
    """A leaf's two layouts by ``hpf.optim.state_info``'s rule: the layouts of the key it sits under,
    else (the optimizer's ``step``) replicated on each side's first mesh."""
    key = path[-1] if path else None
    if isinstance(key, str):
        if key not in src:
            raise PlanError(f"reshard: {name}: {key!r} is not in src_info")
        return src[key], dst[key]
    if not src:
        raise PlanError(f"reshard: {name} is replicated, but src_info is empty (no mesh to place it on)")
    shape = tuple(value.shape) if isinstance(value, Tensor) else ()
    return replicated_info(shape, next(iter(src.values())).mesh), replicated_info(shape, next(iter(dst.values())).mesh)


def _by_tree(spec, src: Any, dst: Any) -> list[tuple[ShardInfo, ShardInfo]]:
    """The leaves of two pytrees of ``ShardInfo`` shaped like the tree (``spec``)."""
    sides = []
    for what, infos in (("src_info", src), ("dst_info", dst)):
        if optree.tree_structure(infos) != spec:
            raise PlanError(f"reshard: {what} is neither a shard_info dict nor a pytree of ShardInfo shaped like the "
                            f"tree ({optree.tree_structure(infos)} vs {spec})")
        found = optree.tree_leaves(infos)
        odd = next((x for x in found if not isinstance(x, ShardInfo)), None)
        if odd is not None:
            raise PlanError(f"reshard: {what} holds a {type(odd).__name__} where a ShardInfo belongs")
        sides.append(found)
    return list(zip(*sides, strict=True))


# ---------------------------------------------------------------- where every rank's shards sit
class _MeshAt:
    """A mesh as the rank ``rank`` sees it: ``core.placement``'s layout functions read the calling
    rank's coordinate from the mesh, and this one answers with ``coord`` (by axis name).  ``ranks``:
    the mesh's rank tensor (``DeviceMesh.mesh`` is rebuilt on every read in torch 2.13: read once)."""

    def __init__(self, mesh, rank: int, coord: Mapping[str, int], ranks: Tensor):
        self._of, self._rank = mesh, rank
        self.mesh, self.mesh_dim_names, self.ndim, self.device_type = ranks, mesh.mesh_dim_names, mesh.ndim, mesh.device_type
        missing = [n for n in mesh.mesh_dim_names if n not in coord]
        if missing:
            raise PlanError(f"reshard: mesh axis {missing[0]!r} of a layout is not an axis of its outer mesh ({list(coord)})")
        self._coord = [coord[n] for n in mesh.mesh_dim_names]

    def size(self, dim: int | None = None) -> int:
        return self._of.size(dim)

    def get_coordinate(self) -> list[int]:
        return list(self._coord)

    def get_rank(self) -> int:
        return self._rank

    def get_local_rank(self, name: str) -> int:
        return self._coord[self.mesh_dim_names.index(name)]


def _info_at(info: ShardInfo, rank: int, coord: Mapping[str, int], ranks: Tensor) -> ShardInfo:
    """``info`` as the rank at ``coord`` holds it: the same layout functions ``shard()`` and
    ``fsdp()`` used, asked at that coordinate (the local shape and offset of a plain or packed
    layout; an ``hpf.fsdp`` row split of the inner layout there).  ``ranks``: ``info.mesh``'s rank
    tensor (an inner layout's mesh is read by axis name only)."""
    mesh = _MeshAt(info.mesh, rank, coord, ranks)
    split = info.facet(RowSplit)
    if split is not None:
        inner = _info_at(split.inner, rank, coord, ranks)
        return dataclasses.replace(info, mesh=mesh).with_facet(RowSplit, RowSplit(split.axis, inner))
    shape, offset = local_layout(info.global_shape, info.placements, mesh, "reshard")
    if info.blocks:
        _, offset = packed_layout("reshard", info.global_shape, info.placements, shape, offset, info.blocks,
                                  mesh.mesh_dim_names)
    return dataclasses.replace(info, mesh=mesh, local_shape=shape, offset=offset)


def _layout_key(info: ShardInfo) -> tuple:
    """What ``boxes`` at every rank depends on (equal keys: equal boxes everywhere)."""
    split = info.facet(RowSplit)
    return (id(info.mesh), tuple(info.global_shape), info.placements, info.blocks,
            None if split is None else (split.axis, _layout_key(split.inner)))


def _coords(names: tuple[str, ...] | None, ranks: Tensor) -> dict[int, dict[str, int]]:
    """Global rank → its coordinate by axis name in a mesh of ``names`` whose rank tensor is ``ranks``."""
    if names is None:
        raise PlanError("reshard: a layout's mesh has no axis names (init_device_mesh(..., mesh_dim_names=...))")
    shape, out = tuple(ranks.shape), {}
    for pos, r in enumerate(ranks.reshape(-1).tolist()):
        idx = []
        for n in reversed(shape):
            pos, i = divmod(pos, n)
            idx.append(i)
        out[r] = dict(zip(names, reversed(idx), strict=True))
    return out


class _Places:
    """Every rank's boxes of each layout and each pair's route, memoised per layout for one call
    (a model's layers share a handful of layouts)."""

    def __init__(self, ex: Exchange):
        self.ex = ex
        self._meshes: dict[int, tuple[Tensor, dict[int, dict[str, int]]]] = {}
        self._boxes: dict[tuple, list[list[Box]]] = {}
        self._routes: dict[tuple, _Route] = {}
        self._text: dict[tuple, str] = {}

    def boxes(self, info: ShardInfo) -> list[list[Box]]:
        key = _layout_key(info)
        if key not in self._boxes:
            ranks, coords = self.mesh(info.mesh)
            self._boxes[key] = [boxes(_info_at(info, r, coords[r], ranks)) for r in self.ex.ranks]
        return self._boxes[key]

    def mesh(self, mesh) -> tuple[Tensor, dict[int, dict[str, int]]]:
        """``mesh``'s rank tensor and every rank's coordinate in it, read once."""
        if id(mesh) not in self._meshes:
            ranks = mesh.mesh
            self._meshes[id(mesh)] = ranks, _coords(mesh.mesh_dim_names, ranks)
        return self._meshes[id(mesh)]

    def route(self, leaf: _Leaf) -> _Route:
        key = (_layout_key(leaf.src), _layout_key(leaf.dst))
        if key not in self._routes:
            self._routes[key] = _route(leaf, self.boxes(leaf.src), self.boxes(leaf.dst), self.ex.index)
        return self._routes[key]

    def describe(self, info: ShardInfo) -> str:
        key = _layout_key(info)
        if key not in self._text:
            self._text[key] = _describe(info) + f" ranks {self.mesh(info.mesh)[0].tolist()}"
        return self._text[key]


def _describe(info: ShardInfo) -> str:
    """A layout as text, alike on every rank that holds it (the agreement hashes it, with the
    ranks of its outer mesh)."""
    m = info.mesh
    text = f"{tuple(info.global_shape)} {fmt_placements(info.placements)} on {dict(zip(m.mesh_dim_names, m.shape, strict=True))}"
    text += f" blocks {info.blocks}" if info.blocks else ""
    split = info.facet(RowSplit)
    return text + (f" rows over {split.axis} of ({_describe(split.inner)})" if split else "")


# ---------------------------------------------------------------- which rank sends what
def _chunks(leaf: _Leaf, src_boxes: list[list[Box]]) -> list[tuple[tuple, dict[int, tuple[int, ...]]]]:
    """The distinct source boxes ``((start, size), {rank index: local start})``, sorted: they must
    tile the global tensor (a PlanError otherwise, alike on every rank)."""
    found: dict[tuple, dict[int, tuple[int, ...]]] = {}
    for i, bxs in enumerate(src_boxes):
        for b in bxs:
            found.setdefault((b.start, b.size), {})[i] = b.local
    total, numel = sum(math.prod(size) for _, size in found), math.prod(leaf.src.global_shape)
    if total != numel:
        raise PlanError(f"reshard: {leaf.name}: the shards of its source layout ({_describe(leaf.src)}) "
                        f"{'overlap' if total > numel else 'do not cover the tensor'}; reshard moves the layouts "
                        "hpf.shard and hpf.fsdp produce")
    return sorted(found.items())


def _pieces(i: int, dst_boxes: list[Box], chunks: list) -> list[_Piece]:
    """The pieces rank ``i`` needs, in one order every rank computes alike, each from one source:
    ``i`` itself where it holds the chunk, else one holder chosen by ``i`` (spreading the load)."""
    out = []
    for b in dst_boxes:
        for (start, size), holders in chunks:
            lo = tuple(max(a, c) for a, c in zip(b.start, start, strict=True))
            hi = tuple(min(a + n, c + m) for a, n, c, m in zip(b.start, b.size, start, size, strict=True))
            if any(x >= y for x, y in zip(lo, hi, strict=True)):
                continue
            s = i if i in holders else list(holders)[i % len(holders)]
            out.append(_Piece(s, tuple(h + x - c for h, x, c in zip(holders[s], lo, start, strict=True)),
                              tuple(d + x - a for d, x, a in zip(b.local, lo, b.start, strict=True)),
                              tuple(y - x for x, y in zip(lo, hi, strict=True))))
    return out


def _route(leaf: _Leaf, src_boxes: list[list[Box]], dst_boxes: list[list[Box]], me: int) -> _Route:
    """Every rank's pieces of one layout pair, kept where this rank sends or receives them."""
    chunks = _chunks(leaf, src_boxes)
    n = len(src_boxes)
    sent, got = [0] * n, [0] * n
    local, recv, send = [], [], []
    for i in range(n):
        pieces = _pieces(i, dst_boxes[i], chunks)
        if sum(math.prod(p.size) for p in pieces) != sum(math.prod(b.size) for b in dst_boxes[i]):
            raise PlanError(f"reshard: {leaf.name}: rank index {i}'s destination shard is not covered by the source "
                            f"layout ({_describe(leaf.src)} → {_describe(leaf.dst)})")
        for p in pieces:
            if p.peer != i:
                sent[p.peer] += math.prod(p.size)
                got[i] += math.prod(p.size)
            if i == me:
                (local if p.peer == me else recv).append(p)
            elif p.peer == me:
                send.append(p._replace(peer=i))
    return _Route(local, recv, send, tuple(sent), tuple(got))


def _buckets(leaves: list[_Leaf], routes: list[_Route], n: int, bucket_bytes: int) -> list[list[int]]:
    """The leaves that move between ranks, in order, grouped so that no rank sends or receives more
    than ``bucket_bytes`` in one group (a leaf that alone does is a group of its own); alike on every
    rank (it reads every rank's traffic)."""
    out: list[list[int]] = []
    cur: list[int] = []
    load = [0] * (2 * n)
    for j, (leaf, route) in enumerate(zip(leaves, routes, strict=True)):
        if not any(route.sent):
            continue
        mine = [x * leaf.value.element_size() for x in (*route.sent, *route.got)]
        if cur and any(a + b > bucket_bytes for a, b in zip(load, mine, strict=True)):
            out.append(cur)
            cur, load = [], [0] * (2 * n)
        cur.append(j)
        load = [a + b for a, b in zip(load, mine, strict=True)]
    return out + ([cur] if cur else [])


# ---------------------------------------------------------------- the agreement
def _agree(leaves: list[_Leaf], places: _Places, bucket_bytes: int) -> None:
    """One all-gather of (a digest of the call, this rank's first bad leaf and why): every rank
    raises alike unless all were called with the same move and hold the shards ``src_info`` says
    (shapes, and boxes where the layout functions place them at this rank's coordinate)."""
    ex = places.ex
    problem = next(((j + 1, 1) for j, leaf in enumerate(leaves) if tuple(leaf.value.shape) != tuple(leaf.src.local_shape)),
                   None) or next(((j + 1, 2) for j, leaf in enumerate(leaves) if not _placed(leaf, places)), (0, 0))
    text = "\n".join(f"{leaf.name} {leaf.value.dtype} {places.describe(leaf.src)} -> {places.describe(leaf.dst)}"
                     for leaf in leaves)
    mine = torch.tensor([digest(f"{bucket_bytes} {ex.ranks}\n{text}"), *problem], dtype=torch.int64)
    rows = ex.all_gather(mine).cpu().tolist()
    differ = [ex.ranks[i] for i, row in enumerate(rows) if row[0] != rows[0][0]]
    if differ:
        raise PlanMismatchError(f"reshard: ranks {differ} were called with other keys, dtypes, layouts or bucket_bytes "
                                f"than rank {ex.ranks[0]}: call reshard alike on every rank of the meshes")
    bad = [(ex.ranks[i], row[1] - 1, row[2]) for i, row in enumerate(rows) if row[1]]
    if bad:
        _raise_bad(leaves, bad, ex.ranks[ex.index])


def _placed(leaf: _Leaf, places: _Places) -> bool:
    """Whether this rank's shards of ``leaf`` are where the boxes computed for every rank say."""
    me = places.ex.index
    return places.boxes(leaf.src)[me] == boxes(leaf.src) and places.boxes(leaf.dst)[me] == boxes(leaf.dst)


def _raise_bad(leaves: list[_Leaf], bad: list[tuple[int, int, int]], me: int) -> None:
    rank, j, kind = bad[0]
    leaf, ranks = leaves[j], [r for r, k, _ in bad if k == j]
    if kind == 1:
        here = (f" (this rank holds {tuple(leaf.value.shape)}, src_info says {tuple(leaf.src.local_shape)})"
                if me in ranks else "")
        raise ShapeError(f"reshard: {leaf.name} on ranks {ranks} does not have the local shape src_info gives it "
                         f"there{here}: shards of another layout or model?")
    raise PlanError(f"reshard: {leaf.name}: its layout ({_describe(leaf.src)} → {_describe(leaf.dst)}) "
                    f"does not place rank {rank}'s shards where boxes() says; reshard moves the layouts hpf.shard "
                    "and hpf.fsdp produce")


# ---------------------------------------------------------------- the move
def _view(t: Tensor, start: tuple[int, ...], size: tuple[int, ...]) -> Tensor:
    return t[tuple(slice(s, s + n) for s, n in zip(start, size, strict=True))]


def _bytes(t: Tensor) -> Tensor:
    """``t`` (a view whose last dim is contiguous) as its bytes, a view: bitwise for every dtype."""
    return (t.reshape(1) if t.dim() == 0 else t).view(torch.uint8)


def _move(leaves: list[_Leaf], routes: list[_Route], buckets: list[list[int]], ex: Exchange) -> list[Tensor]:
    """The destination shards: local pieces copied, the rest one all-to-all per bucket."""
    srcs = [leaf.value.detach().contiguous() for leaf in leaves]
    outs = [torch.empty(leaf.dst.local_shape, dtype=leaf.value.dtype, device=leaf.value.device) for leaf in leaves]
    with torch.no_grad():
        for src, out, route in zip(srcs, outs, routes, strict=True):
            for p in route.local:
                _view(out, p.dst, p.size).copy_(_view(src, p.src, p.size))
        for bucket in buckets:
            _exchange(bucket, srcs, outs, routes, ex)
    return [out.requires_grad_(leaf.value.requires_grad) for out, leaf in zip(outs, leaves, strict=True)]


def _exchange(bucket: list[int], srcs: list[Tensor], outs: list[Tensor], routes: list[_Route], ex: Exchange) -> None:
    """One bucket: pack what this rank sends (by destination rank, then leaf, then the plan's
    order) into one byte buffer, one all-to-all, unpack what arrives (in the same order by source)."""
    sends: list[list[Tensor]] = [[] for _ in range(ex.size)]
    recvs: list[list[Tensor]] = [[] for _ in range(ex.size)]
    for j in bucket:
        for p in routes[j].send:
            sends[p.peer].append(_bytes(_view(srcs[j], p.src, p.size)))
        for p in routes[j].recv:
            recvs[p.peer].append(_bytes(_view(outs[j], p.dst, p.size)))
    send_splits = [sum(v.numel() for v in vs) for vs in sends]
    buf = torch.empty(sum(send_splits), dtype=torch.uint8, device=ex.device)
    at = 0
    for v in (v for vs in sends for v in vs):
        buf[at:at + v.numel()].view(v.shape).copy_(v)
        at += v.numel()
    got = ex.all_to_all(buf, send_splits, [sum(v.numel() for v in vs) for vs in recvs])
    del buf
    at = 0
    for v in (v for vs in recvs for v in vs):
        v.copy_(got[at:at + v.numel()].view(v.shape))
        at += v.numel()
