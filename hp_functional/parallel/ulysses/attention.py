"""Ulysses attention (DeepSpeed-Ulysses): the sequence sharded over a ``cp`` axis, the heads
exchanged for it around attention.

Every rank holds queries, keys and values of its positions (``parallel.context.cp_layout``) as
``[B, H, S/cp, D]``.  One all-to-all over the axis turns them into ``[B, H/cp, S, D]``: each rank
then holds a ``1/cp`` share of the heads for the whole sequence, attends over it with the local
kernel (SDPA, causal in true position order), and a second all-to-all turns the output back into
this rank's positions of every head.  Both are ``core.collectives.all_to_all``, whose transpose is
itself with the dims swapped: the backward is two all-to-alls too, and every ``torch.func``
transform (jvp, vmap, higher orders) goes through the table's rules and SDPA's math.

Heads: query heads must divide by the axis size (after tensor parallelism, which splits them
first).  K/V heads (GQA) divide too, or are fewer than the ranks and divide the axis size: then
each K/V head is repeated so that every rank receives the one its query heads use (as tensor
parallelism replicates KV heads, ``compile.kv_heads``).  Anything else raises ``PlanError``
naming the module, the head count and the axis size, before the first collective.

The all-to-all in front carries queries, keys and values in one message (packed per destination
rank), so a layer costs two all-to-alls forward and two backward whatever the axis size.
"""

from __future__ import annotations

__all__ = ["UlyssesAttention", "kv_copies"]

import contextlib
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from ...core import collectives as C
from ...core.collectives import AxisGroup
from ...core.errors import PlanError
from ..context.cp_layout import cp_chunks, cp_positions
from ..context.ring_attention import ContextAttention


def kv_copies(heads: int, kv_heads: int, size: int, *, fqn: str = "attention", axis: str = "cp") -> int:
    """How many copies of each K/V head the all-to-all carries: 1 when the K/V heads divide by
    ``size``, ``size // kv_heads`` when they are fewer and divide it (each rank receives the K/V
    head its query heads use); a ``PlanError`` naming ``fqn``, the head count and the axis size
    when the query heads do not divide by ``size`` or the K/V heads fit neither way."""
    where = f"{fqn}: Ulysses over mesh axis {axis!r} (size {size})"
    if heads % size:
        raise PlanError(f"{where} splits the attention heads over the axis, but the module has {heads} query heads "
                        f"on this rank (after tensor parallelism, if any), not divisible by {size}; use a cp size that "
                        "divides them, or ring/allgather attention (cp_strategy='ring')")
    if kv_heads <= 0 or heads % kv_heads:
        raise PlanError(f"{where}: {heads} query heads are not a multiple of the {kv_heads} K/V heads")
    if kv_heads % size == 0:
        return 1
    if size % kv_heads == 0:
        return size // kv_heads
    raise PlanError(f"{where}: the module has {kv_heads} K/V heads on this rank, which neither divide by {size} nor "
                    f"divide it (fewer K/V heads than ranks are replicated only when they divide the axis size)")


def _pack(x: Tensor, size: int) -> Tensor:
    """``[B, H, s, D]`` as ``[B, size, s, (H/size)·D]``: the head block for rank ``j`` at index ``j``."""
    b, h, s, d = x.shape
    return x.unflatten(1, (size, h // size)).permute(0, 1, 3, 2, 4).reshape(b, size, s, (h // size) * d)


def _unpack(x: Tensor, heads: int, dim: int) -> Tensor:
    """``[B, S, heads·dim]`` as ``[B, heads, S, dim]``."""
    return x.unflatten(-1, (heads, dim)).transpose(1, 2)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, group: AxisGroup, *, layout: str = "zigzag",
                      causal: bool = True, scale: float | None = None, fqn: str = "attention") -> Tensor:
    """Attention of this rank's positions over the whole sequence sharded on ``group``, by two
    all-to-alls (see the module docstring).

    Args:
        q: ``[B, H, s, D]``, this rank's ``s = S / cp`` positions in ``layout``'s local order.
        k: ``[B, H_kv, s, D]`` (``H % H_kv == 0``).
        v: ``[B, H_kv, s, D_v]``.
        group: the ``cp`` axis.
        layout: ``"zigzag"`` or ``"contiguous"`` (which global positions each rank holds).
        causal: mask over global positions (query position ≥ key position), else none.
        scale: the softmax scale (None: ``D ** -0.5``).
        fqn: the attention module's path, for errors.
    Returns:
        ``[B, H, s, D_v]``: this rank's positions, every head.
    """
    if q.dim() != 4 or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1] or q.shape[2] != k.shape[2]:
        raise ValueError(f"Ulysses attention needs q [B, H, S, D], k [B, H_kv, S, D] and v [B, H_kv, S, D_v]; got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    n, heads, d, dv = group.size, q.shape[1], q.shape[-1], v.shape[-1]
    copies = kv_copies(heads, k.shape[1], n, fqn=fqn, axis=group.axis)  # every check before the collective
    seq = q.shape[2] * n
    cp_chunks(seq, n, layout, axis=group.axis)
    kv = torch.cat([k, v], -1)
    if copies > 1:
        kv = kv.repeat_interleave(copies, 1)
    hq, hkv = heads // n, kv.shape[1] // n
    # one all-to-all for q, k and v: [B, n, s, F] → [B, 1, S, F], S in rank order
    packed = torch.cat([_pack(q, n), _pack(kv.to(q.dtype), n)], -1)
    got = C.all_to_all(packed, 1, 2, group).squeeze(1)
    qh = _unpack(got[..., : hq * d], hq, d)
    kvh = _unpack(got[..., hq * d:], hkv, d + dv)
    held = torch.cat([cp_positions(r, seq, n, layout, device=q.device) for r in range(n)])
    ordered = layout != "contiguous"  # contiguous: rank order is position order
    if ordered:  # true position order, so the mask is SDPA's own causal one
        order = torch.argsort(held)
        qh, kvh = qh.index_select(2, order), kvh.index_select(2, order)
    with sdpa_kernel(SDPBackend.MATH) if q.device.type == "cpu" else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(qh, kvh[..., :d], kvh[..., d:].to(v.dtype), is_causal=causal,
                                             scale=scale, enable_gqa=hq != hkv)
    if ordered:
        out = out.index_select(2, held)  # back to rank order: rank r's positions are block r
    return C.all_to_all(out.contiguous(), 2, 1, group)  # [B, H, s, D_v]: this rank's positions, every head


class UlyssesAttention(ContextAttention):
    """Inside a module's forward: its ``scaled_dot_product_attention`` calls become
    ``ulysses_attention`` over the whole (sharded) sequence.  The mask, dropout, sliding-window and
    repeated-K/V rules are ``ContextAttention``'s (``parallel.context.ring_attention``)."""

    def __init__(self, module, group: AxisGroup, layout: str, causal: bool | None, fqn: str):
        super().__init__(module, group, "allgather", layout, causal, fqn)
        self.attend = partial(ulysses_attention, fqn=fqn)
