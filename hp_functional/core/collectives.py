"""Differentiable collectives over one mesh axis that compose with ``torch.func``.

PyTorch's own differentiable collectives lack ``setup_context`` (so they raise under
``torch.func.grad``) and have no correct vmap rule.  Each collective here is an
``autograd.Function`` with ``setup_context``, ``backward`` (written with other collectives of
this module, so higher-order and ``vmap(grad(...))`` work), a forward-mode ``jvp`` (every
collective is linear: the tangent goes through the same forward op) and an explicit ``vmap``
rule (the vmapped dim is moved to the front; dims given as non-negative indices shift by one).

The raw communication uses ``torch.ops._c10d_functional`` so the forward is traceable by
``torch.compile`` and works on any backend (gloo, nccl, hccl).  Under ``torch.compile`` each
collective runs as a twin Function without the ``jvp``/``vmap`` rules (Dynamo refuses a custom
``jvp``), with the same forward and backward, so ``torch.compile(apply_fn)`` is one graph.

Naming follows the transpose pairs of JAX/Megatron:

=========================  ==================  ==================
function                   forward             backward
=========================  ==================  ==================
``all_reduce``             all-reduce          all-reduce
``all_gather``             all-gather          reduce-scatter
``reduce_scatter``         reduce-scatter      all-gather
``all_to_all``             all-to-all          all-to-all (reverse)
``copy_to``                identity            all-reduce
``reduce_from``            all-reduce          identity
``gather_from``            all-gather          split (local chunk)
``split_to``               split (local chunk) all-gather
``partial_from``           keep on rank 0      identity
``leave_region``           identity            keep on rank 0
=========================  ==================  ==================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

_funcol = torch.ops._c10d_functional


@dataclass(frozen=True)
class AxisGroup:
    """One mesh axis as seen by this rank: process-group name, size and this rank's index."""

    axis: str
    group_name: str
    size: int
    rank: int

    @classmethod
    def from_mesh(cls, mesh, axis: str) -> AxisGroup:
        """The group of ``mesh`` along ``axis`` (a mesh dim name)."""
        group = mesh.get_group(axis)
        return cls(axis, group.group_name, dist.get_world_size(group), dist.get_rank(group))


# ---------------------------------------------------------------- raw (non-differentiable) ops
def raw_all_reduce(x: Tensor, g: AxisGroup) -> Tensor:
    return _funcol.wait_tensor(_funcol.all_reduce(x.contiguous(), "sum", g.group_name))


def raw_all_gather(x: Tensor, dim: int, g: AxisGroup) -> Tensor:
    moved = x.movedim(dim, 0).contiguous()
    out = _funcol.wait_tensor(_funcol.all_gather_into_tensor(moved, g.size, g.group_name))
    return out.movedim(0, dim)


def _check_divisible(x: Tensor, dim: int, g: AxisGroup, op: str) -> None:
    """Raise (before communicating) rather than let the backend abort on an uneven split."""
    if x.shape[dim] % g.size:
        raise ValueError(f"{op} on mesh axis {g.axis!r}: dim {dim} of shape {tuple(x.shape)} is not divisible by {g.size}")


def raw_reduce_scatter(x: Tensor, dim: int, g: AxisGroup) -> Tensor:
    _check_divisible(x, dim, g, "reduce_scatter")
    moved = x.movedim(dim, 0).contiguous()
    out = _funcol.wait_tensor(_funcol.reduce_scatter_tensor(moved, "sum", g.size, g.group_name))
    return out.movedim(0, dim)


def raw_split(x: Tensor, dim: int, g: AxisGroup) -> Tensor:
    _check_divisible(x, dim, g, "split")
    return x.chunk(g.size, dim)[g.rank].clone()


def raw_all_to_all(x: Tensor, split_dim: int, concat_dim: int, g: AxisGroup) -> Tensor:
    """Chunk ``split_dim`` into ``size`` pieces, send piece k to rank k, concat received on ``concat_dim``."""
    _check_divisible(x, split_dim, g, "all_to_all")
    nd = x.dim()
    split_dim, concat_dim = split_dim % nd, concat_dim % nd
    n = g.size
    pieces = x.movedim(split_dim, 0)
    pieces = pieces.reshape(n, pieces.shape[0] // n, *pieces.shape[1:]).contiguous()
    flat = pieces.reshape(-1)
    split = [flat.numel() // n] * n
    got = _funcol.wait_tensor(_funcol.all_to_all_single(flat, split, split, g.group_name))
    got = got.reshape(pieces.shape).movedim(1, split_dim + 1)  # (n, *x-shape with split_dim/n)
    got = got.movedim(0, concat_dim)
    return got.flatten(concat_dim, concat_dim + 1)


def _identity(x: Tensor, g: AxisGroup) -> Tensor:
    return x.view_as(x)


def _keep_on_rank0(x: Tensor, g: AxisGroup) -> Tensor:
    return x.view_as(x) if g.rank == 0 else torch.zeros_like(x)


# ---------------------------------------------------------------- autograd.Function pairs
def _shift_dims(args: tuple) -> tuple:
    """Dims (ints) as seen with a vmapped batch dim in front: non-negative ones move by one."""
    return tuple(a + 1 if isinstance(a, int) and not isinstance(a, bool) and a >= 0 else a for a in args)


class Collective(NamedTuple):
    """One collective as two ``autograd.Function`` classes with the same forward and backward:
    ``eager`` also has the forward-mode ``jvp`` and the ``vmap`` rule; ``traced`` has neither,
    because Dynamo cannot trace a Function with a custom ``jvp`` (torch.compile would graph-break)."""

    eager: type[torch.autograd.Function]
    traced: type[torch.autograd.Function]

    def apply(self, x: Tensor, *args) -> Tensor:
        """Run the collective; under ``torch.compile`` the traceable twin (a constant choice at trace time)."""
        return (self.traced if torch.compiler.is_compiling() else self.eager).apply(x, *args)


def _collective(name: str, forward: Callable, transpose: Callable[..., Tensor]) -> Collective:
    """A collective whose forward is ``forward(x, *args)`` and whose backward is
    ``transpose(grad, *args)`` (itself built from collectives, so it is differentiable)."""

    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:]

    def backward(ctx, grad):
        return (transpose(grad, *ctx.args), *([None] * len(ctx.args)))

    def jvp(ctx, tangent, *_):
        return eager.apply(tangent, *ctx.args)

    def vmap(info, in_dims, x, *args):
        if in_dims[0] is None:
            return eager.apply(x, *args), None
        return eager.apply(x.movedim(in_dims[0], 0), *_shift_dims(args)), 0

    common = {
        # the raw op itself, not a ``*args`` wrapper: when no grad is needed Dynamo calls forward
        # with ctx first and drops it only if forward's arity matches apply's arguments
        "forward": staticmethod(forward),
        "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward),
        "__doc__": f"Differentiable {name} (see module docstring).",
    }
    eager = type(name, (torch.autograd.Function,), {
        **common, "generate_vmap_rule": False, "jvp": staticmethod(jvp), "vmap": staticmethod(vmap),
    })
    traced = type(f"{name}Traced", (torch.autograd.Function,), common)
    return Collective(eager, traced)


# The transposes refer to the public functions below, which exist by the time backward runs.
AllReduce = _collective("AllReduce", raw_all_reduce, lambda g, ax: all_reduce(g, ax))
AllGather = _collective("AllGather", raw_all_gather, lambda g, d, ax: reduce_scatter(g, d, ax))
ReduceScatter = _collective("ReduceScatter", raw_reduce_scatter, lambda g, d, ax: all_gather(g, d, ax))
AllToAll = _collective("AllToAll", raw_all_to_all, lambda g, s, c, ax: all_to_all(g, c, s, ax))
CopyTo = _collective("CopyTo", _identity, lambda g, ax: all_reduce(g, ax))
ReduceFrom = _collective("ReduceFrom", raw_all_reduce, lambda g, ax: g)
GatherFrom = _collective("GatherFrom", raw_all_gather, lambda g, d, ax: split_to(g, d, ax))
SplitTo = _collective("SplitTo", raw_split, lambda g, d, ax: all_gather(g, d, ax))
PartialFrom = _collective("PartialFrom", _keep_on_rank0, lambda g, ax: g)
LeaveRegion = _collective("LeaveRegion", _identity, lambda g, ax: partial_from(g, ax))


# ---------------------------------------------------------------- public functional API
def all_reduce(x: Tensor, group: AxisGroup) -> Tensor:
    """Sum over the axis; backward all-reduces (the transpose for per-rank losses)."""
    return AllReduce.apply(x, group)


def all_gather(x: Tensor, dim: int, group: AxisGroup) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim``; backward reduce-scatters."""
    return AllGather.apply(x, dim, group)


def reduce_scatter(x: Tensor, dim: int, group: AxisGroup) -> Tensor:
    """Sum over the axis and keep this rank's chunk of ``dim``; backward all-gathers."""
    return ReduceScatter.apply(x, dim, group)


def all_to_all(x: Tensor, split_dim: int, concat_dim: int, group: AxisGroup) -> Tensor:
    """Re-shard from ``split_dim`` to ``concat_dim``; backward is the reverse all-to-all."""
    return AllToAll.apply(x, split_dim, concat_dim, group)


def copy_to(x: Tensor, group: AxisGroup) -> Tensor:
    """Identity forward, all-reduce backward: a replicated value entering rank-varying compute."""
    return CopyTo.apply(x, group)


def reduce_from(x: Tensor, group: AxisGroup) -> Tensor:
    """All-reduce forward, identity backward: partial sums leaving into replicated compute."""
    return ReduceFrom.apply(x, group)


def gather_from(x: Tensor, dim: int, group: AxisGroup) -> Tensor:
    """All-gather forward, split backward: a sharded value leaving into replicated compute."""
    return GatherFrom.apply(x, dim, group)


def split_to(x: Tensor, dim: int, group: AxisGroup) -> Tensor:
    """Keep this rank's chunk of ``dim`` forward, all-gather backward."""
    return SplitTo.apply(x, dim, group)


def partial_from(x: Tensor, group: AxisGroup) -> Tensor:
    """Replicate → Partial: rank 0 keeps ``x``, the others contribute zeros; identity backward."""
    return PartialFrom.apply(x, group)


def leave_region(x: Tensor, group: AxisGroup) -> Tensor:
    """Identity forward; backward keeps the (replicated) gradient on rank 0 only.  A replicated
    value leaving a rank-varying region, whose gradients inside are per-rank partial sums."""
    return LeaveRegion.apply(x, group)
