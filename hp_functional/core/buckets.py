"""Bucketing: many tensors reduced by one collective per bucket instead of one per tensor.

``plan_buckets`` is the one grouping rule (by device and dtype, filled greedily in order up to a
byte cap); ``copy_to_many`` is ``copy_to`` over many replicated tensors at once — identity
forward, one all-reduce per bucket in the backward (its transpose ``reduce_from`` on the
bucket's flat buffer), so replicated parameters consumed by rank-varying compute get their full
gradients from a handful of collectives (the gradient of ``apply_fn`` is its gradient).
"""

from __future__ import annotations

__all__ = ["BUCKET_BYTES", "copy_to_many", "gather_many", "plan_buckets"]

from collections.abc import Callable, Hashable, Iterable, Sequence

import torch
from torch import Tensor

from .collectives import AxisGroup, reduce_from

#: The default bucket cap: large enough that a tiny model is one bucket, small enough that a
#: bucket's flat copy stays a fraction of the gradients.
BUCKET_BYTES = 25 * 2**20


def plan_buckets(items: Iterable[tuple[Hashable, Hashable, int]], bucket_bytes: int = BUCKET_BYTES) -> list[list[Hashable]]:
    """Buckets of ``(name, group key, bytes)`` items as lists of names: items grouped by key (e.g.
    device and dtype) in first-seen order, each group filled greedily in order, a new bucket
    started when the next item would take it past ``bucket_bytes`` (a larger item is a bucket of
    its own)."""
    groups: dict[Hashable, list[list[Hashable]]] = {}
    fill: dict[Hashable, int] = {}
    for name, key, size in items:
        buckets = groups.setdefault(key, [])
        if not buckets or (buckets[-1] and fill[key] + size > bucket_bytes):
            buckets.append([])
            fill[key] = 0
        buckets[-1].append(name)
        fill[key] += size
    return [b for buckets in groups.values() for b in buckets]


def _reduced(grads: Sequence[Tensor], buckets: Sequence[Sequence[int]], groups: Sequence[AxisGroup]) -> list[Tensor]:
    """``grads`` with each bucket's tensors summed over ``groups`` (one all-reduce per bucket and
    axis, differentiable: its backward is ``copy_to`` again)."""
    out = list(grads)
    for bucket in buckets:
        parts = [grads[i] for i in bucket]
        flat = torch.cat([p.reshape(-1) for p in parts]) if len(parts) > 1 else parts[0].reshape(-1)
        for g in groups:
            flat = reduce_from(flat, g)
        for i, piece in zip(bucket, flat.split([p.numel() for p in parts]), strict=True):
            out[i] = piece.view_as(grads[i])
    return out


def _forward(buckets, groups, *tensors):
    return tuple(t.view_as(t) for t in tensors)


def _setup_context(ctx, inputs, output):
    ctx.buckets, ctx.groups = inputs[0], inputs[1]


def _backward(ctx, *grads):
    return (None, None, *_reduced(grads, ctx.buckets, ctx.groups))


def _jvp(ctx, _buckets, _groups, *tangents):
    return tuple(t.view_as(t) for t in tangents)


def _vmap(info, in_dims, buckets, groups, *tensors):
    return tuple(t.view_as(t) for t in tensors), tuple(in_dims[2:])


_COMMON = {"forward": staticmethod(_forward), "setup_context": staticmethod(_setup_context),
           "backward": staticmethod(_backward)}
#: eager (with jvp and vmap rules) and traced (for torch.compile: Dynamo refuses a custom jvp) twins
CopyToMany = type("CopyToMany", (torch.autograd.Function,), {
    **_COMMON, "generate_vmap_rule": False, "jvp": staticmethod(_jvp), "vmap": staticmethod(_vmap),
    "__doc__": "copy_to over many tensors: identity forward; backward one all-reduce per bucket (reduce_from)."})
CopyToManyTraced = type("CopyToManyTraced", (torch.autograd.Function,), dict(_COMMON))


def copy_to_many(tensors: Sequence[Tensor], buckets: Sequence[Sequence[int]], groups: Sequence[AxisGroup]) -> tuple[Tensor, ...]:
    """``copy_to`` over every tensor of ``tensors`` on every group of ``groups``: the forward
    returns them unchanged; the backward sums each bucket's gradients (``buckets``: lists of
    indices into ``tensors``, from ``plan_buckets``) over the groups, one all-reduce per bucket
    and axis.  Inverse direction: ``reduce_from`` on each bucket's flat buffer."""
    fn = CopyToManyTraced if torch.compiler.is_compiling() else CopyToMany
    return fn.apply(tuple(tuple(b) for b in buckets), tuple(groups), *tensors)


def gather_many(tensors: Sequence[Tensor], gather: Callable[[Tensor], Tensor], size: int) -> list[Tensor]:
    """Each of ``tensors`` (this rank's dim-0 rows of a parameter) whole, by one ``gather`` (a
    differentiable all-gather of dim 0 over ``size`` ranks: its backward keeps this rank's part, or
    reduce-scatters) of their flat concatenation: rank ``r``'s rows of tensor ``i`` are the ``i``-th
    run of the ``r``-th row of the result viewed ``[size, total]``."""
    flat = torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) > 1 else tensors[0].reshape(-1)
    whole = gather(flat).view(size, -1)
    out, start = [], 0
    for t in tensors:
        n = t.numel()
        out.append(whole[:, start:start + n].reshape(size * t.shape[0], *t.shape[1:]))
        start += n
    return out
