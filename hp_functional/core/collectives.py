"""Differentiable collectives over one mesh axis that compose with ``torch.func``.

PyTorch's own differentiable collectives lack ``setup_context`` (so they raise under
``torch.func.grad``) and have no correct vmap rule.  Each collective here is an
``autograd.Function`` with ``setup_context``, ``backward`` (written with other collectives of
this module, so higher-order and ``vmap(grad(...))`` work), a forward-mode ``jvp`` (every
collective is linear: the tangent goes through the same forward op) and an explicit ``vmap``
rule (the vmapped dim is moved to the front; dims given as non-negative indices shift by one).

The raw communication (``core.raw_collectives``) uses ``torch.ops._c10d_functional`` so the
forward is traceable by ``torch.compile`` and works on any backend (gloo, nccl, hccl).  Under ``torch.compile`` each
collective runs as a twin Function without the ``jvp``/``vmap`` rules (Dynamo refuses a custom
``jvp``), with the same forward and backward, so ``torch.compile(apply_fn)`` is one graph.

Naming follows the transpose pairs of JAX/Megatron.  Read the types as JAX's: a value is
rank-invariant (I: one value, replicated, its cotangent the same on every rank) or
rank-varying (V: one value per rank — a shard, a partial sum, or a replicated value consumed
by per-rank compute, whose cotangent arrives as per-rank partial sums).  A collective's backward
is its transpose, and that transpose is itself a collective of this table (each block names its
transpose, the object: ``Collective.transpose``); its type (``CollectiveType``, of two
``ValueType``) says what is rank-invariant: I → V transposes to V → I and back, and the transpose of the
transpose is the collective again, so ``grad`` of ``grad``, ``jacrev``/``jacfwd`` of ``jacrev``
and ``hessian`` are exact at every order, not only the first:

========================  =====  ===================  ===================================  ========================
function                  type   forward              backward = transpose                 its backward
========================  =====  ===================  ===================================  ========================
``all_reduce``            V → V  all-reduce           ``all_reduce`` (all-reduce)          ``all_reduce``
``all_gather``            V → V  all-gather           ``reduce_scatter`` (RS)              ``all_gather``
``reduce_scatter``        V → V  reduce-scatter       ``all_gather`` (AG)                  ``reduce_scatter``
``all_to_all``            V → V  all-to-all           ``all_to_all`` (reverse)             ``all_to_all``
``ppermute``              V → V  send to perm's dst   ``ppermute`` (inverse perm)          ``ppermute``
``all_to_all_v``          V → V  variable all-to-all  ``all_to_all_v`` (splits swapped)    ``all_to_all_v``
``send_to``               V → V  send to one peer     ``recv_from`` (receive from it)      ``send_to``
``recv_from``             V → V  receive from a peer  ``send_to`` (send back to it)        ``recv_from``
``copy_to``               I → V  identity             ``reduce_from`` (all-reduce)         ``copy_to``
``reduce_from``           V → I  all-reduce           ``copy_to`` (identity)               ``reduce_from``
``gather_from``           V → I  all-gather           ``split_to`` (local chunk)           ``gather_from``
``split_to``              I → V  split (local chunk)  ``gather_from`` (all-gather)         ``split_to``
``partial_from``          I → V  keep on rank 0       ``leave_region`` (identity)          ``partial_from``
``leave_region``          V → I  identity             ``partial_from`` (keep on rank 0)    ``leave_region``
``copy_to_replicas``      I → V  identity             ``reduce_from_replicas`` (group AR)  ``copy_to_replicas``
``reduce_from_replicas``  V → I  group all-reduce     ``copy_to_replicas`` (identity)      ``reduce_from_replicas``
``gather_params``         V → V  all-gather (cast)    ``mean_scatter`` (RS ÷ divisor)      ``gather_params``
``mean_scatter``          V → V  RS ÷ divisor (cast)  ``gather_params`` (all-gather)       ``mean_scatter``
========================  =====  ===================  ===================================  ========================

The ``*_replicas`` pair is ``copy_to``/``reduce_from`` over groups of consecutive ranks of the
axis (``Replicas``; "group all-reduce" sums over the ranks of this rank's group): a value
replicated within each group (a KV head shared by the ranks whose query heads use it) entering
rank-varying compute.  The group sum is one all-reduce over the
axis of a buffer with one slot per group, so it needs no process group of its own.

``all_to_all``'s transpose swaps its split and concat dims; ``ppermute``'s sends every pair
back (dst → src), so ``shift(+1)``'s transpose is ``shift(-1)``.  ``send_to``/``recv_from`` are
the point-to-point pair of pipeline stages (only the two ranks take part): a send returns a zero
token that carries it into the loss, a receive is a function of a zero anchor, and each one's
backward is the other in the reverse direction.  ``leave_region``'s input is a
replicated value inside a rank-varying region (equal on every rank, hence identity forward).
``gather_params``/``mean_scatter`` are FSDP's pair (``train/fsdp_bucket.py``): a bucket of
dp-sharded parameters gathered for per-rank compute on per-rank data, and its gradients
reduce-scattered and divided by ``divisor`` (the dp size): FSDP's gradient is the *mean* over
the dp ranks of each rank's local-batch gradient, not the sum that the plain
``all_gather``/``reduce_scatter`` pair gives.  The pair is still a transpose pair, for the
pairing that says what FSDP computes: a value of the per-rank batch (a loss, an activation,
the gathered parameters as a rank's compute sees them) is paired as the mean over the ranks,
``<w, v> = Σ_r <w_r, v_r> / n``, a shard (the parameters, their gradients) as the sum,
``Σ_r <a_r, b_r>``.  Then ``<w, all_gather(t)> = <reduce_scatter(w) / n, t> =
<mean_scatter(w), t>``, one identity read both ways: each is the other's transpose, so
``jvp∘grad`` and ``grad∘grad`` are exact at every order for these semantics: the gradient is
the exact mean gradient ``G`` (sharded), an HVP either way (``jvp(grad)``, or ``grad`` of
``Σ <G_r, v_r>``) is the mean of the ranks' local HVPs, and a function of the gradient's shards
(a gradient penalty ``Σ_r ‖G_r‖²``) is differentiated as the sum over the shards, as the
unsharded ``‖∇L‖²``.  ``gather_params`` casts to the compute dtype before gathering and
``mean_scatter`` reduces in the reduce dtype and casts back (``Precision``, FSDP2's mixed
precision); a per-element ``divisor`` tensor (pieces owed a sum over a folded axis) broadcasts
along the flat bucket.  ``gather_params``'s ``accumulator`` (FSDP's ``no_sync``) makes a backward
keep its cotangent instead of transposing it (no collective, no gradient) while it defers, and
adds what it kept to the next ``mean_scatter``; that state outlives the backward, so a deferred
backward under a ``torch.func`` transform (``autograd.grad(is_grads_batched=True)`` vmaps it) or
``torch.compile`` raises ``PlanError``.
Each backward issues exactly the communication of its first-order rule above (the pairs only
decide what the backward's *own* backward is), so first-order schedules are unchanged.
Jacobians seed every rank at once: ``jacfwd``/``hessian`` w.r.t. a rank-varying input, and
``jacrev`` of a rank-varying output, give the sum over ranks of the per-rank Jacobians; for
exact Hessians differentiate rank-invariant (full) inputs, sliced inside with ``split_to``.
"""

from __future__ import annotations

__all__ = [
    "Accumulator", "AllGather", "AllReduce", "AllToAll", "AllToAllV", "AxisGroup", "COLLECTIVES", "Collective",
    "CollectiveType", "CopyTo", "CopyToReplicas", "GatherFrom", "GatherParams", "LeaveRegion", "MeanScatter",
    "PartialFrom", "Ppermute", "Precision", "RecvFrom", "ReduceFrom", "ReduceFromReplicas", "ReduceScatter",
    "Replicas", "SendTo", "SplitTo", "ValueType", "all_gather", "all_reduce", "all_to_all", "all_to_all_v", "copy_to",
    "copy_to_replicas", "gather_from", "gather_params", "leave_region", "mean_scatter", "partial_from", "ppermute",
    "raw_all_gather", "raw_all_reduce", "raw_all_to_all", "recv_from", "reduce_from", "reduce_from_replicas",
    "reduce_scatter", "ring", "send_to", "split_to"
]

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from .errors import PlanError
from .raw_collectives import (
    Gate,
    Replicas,
    check_perm,
    get_timeout,
    raw_all_gather,
    raw_all_reduce,
    raw_all_to_all,
    raw_all_to_all_v,
    raw_ppermute,
    raw_recv,
    raw_reduce_scatter,
    raw_replica_sum,
    raw_send,
    raw_split,
    ring,
)

_transforms_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
_legacy_batched = torch._C._functorch.is_legacy_batchedtensor  # autograd.grad(is_grads_batched=True)'s vmap


def _group_rank(group: dist.ProcessGroup) -> int:
    """This process's rank in ``group``, a Python int: the group's own, not ``dist.get_rank(group)``, which
    torch 2.14's ``LocalTensorMode`` replaces by a per-simulated-rank SymInt (2.13 leaves it alone) that
    ``AxisGroup`` can neither hash nor index a list with (``hpf.simulate(local_tensors=True)``)."""
    return group.rank()


@dataclass(frozen=True)
class AxisGroup:
    """One mesh axis as seen by this rank: process-group name, size and this rank's index (a value:
    equal groups compare equal); ``gate``: the ``raw_collectives.Gate`` where ``apply_fn``'s input
    agreement waits for the call's first collective over the axis, passed in by the group's maker
    (the program's, shared by its axes); None: no check waits on it."""

    axis: str
    group_name: str
    size: int
    rank: int
    gate: Gate | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_mesh(cls, mesh, axis: str, gate: Gate | None = None) -> AxisGroup:
        """The group of ``mesh`` along ``axis`` (a mesh dim name), with ``gate`` (None: a gate of its own)."""
        group = mesh.get_group(axis)
        return cls(axis, group.group_name, dist.get_world_size(group), _group_rank(group), gate or Gate())

    @classmethod
    def flat(cls, mesh, axes: Sequence[str], gate: Gate | None = None) -> AxisGroup:
        """Several axes of ``mesh`` flattened into one group (torchtitan's ``dp_shard_cp``): a
        process group per set of ranks that differ only on ``axes``, made by
        ``torch.distributed.new_group`` with the first axis's backend and timeout.  Every rank of
        the world must call it, in the same order (it creates groups); one axis is ``from_mesh``;
        ``gate`` as there."""
        if len(axes) == 1:
            return cls.from_mesh(mesh, axes[0], gate)
        first = mesh.get_group(axes[0])
        names = list(mesh.mesh_dim_names)
        moved = mesh.mesh.permute(*[names.index(n) for n in names if n not in axes],
                                  *[names.index(n) for n in axes])
        mine = None
        for ranks in moved.reshape(-1, math.prod(mesh.size(names.index(n)) for n in axes)).tolist():
            group = dist.new_group(sorted(ranks), backend=dist.get_backend(first),
                                   timeout=get_timeout(first.group_name))
            if mesh.get_rank() in ranks:
                mine = group
        return cls("+".join(axes), mine.group_name, dist.get_world_size(mine), _group_rank(mine), gate or Gate())

    # The collectives of a rank-varying region, bound to this axis (``hpf.Local``'s ``axes``): each
    # takes and gives rank-varying values, so its transpose is again one of these (see the table).
    def all_reduce(self, x: Tensor) -> Tensor:
        """``all_reduce(x, self)``: sum over the axis; backward all-reduce."""
        return all_reduce(x, self)

    def all_gather(self, x: Tensor, dim: int) -> Tensor:
        """``all_gather(x, dim, self)``; backward reduce-scatter."""
        return all_gather(x, dim, self)

    def reduce_scatter(self, x: Tensor, dim: int) -> Tensor:
        """``reduce_scatter(x, dim, self)``; backward all-gather."""
        return reduce_scatter(x, dim, self)

    def all_to_all(self, x: Tensor, split_dim: int, concat_dim: int) -> Tensor:
        """``all_to_all(x, split_dim, concat_dim, self)``; backward the reverse all-to-all."""
        return all_to_all(x, split_dim, concat_dim, self)

    def ppermute(self, x: Tensor, perm: Sequence[tuple[int, int]]) -> Tensor:
        """``ppermute(x, perm, self)``; backward the inverse permutation."""
        return ppermute(x, perm, self)

    def all_to_all_v(self, x: Tensor, dim: int, send: Sequence[int], recv: Sequence[int]) -> Tensor:
        """``all_to_all_v(x, dim, send, recv, self)``; backward the reverse exchange."""
        return all_to_all_v(x, dim, send, recv, self)

    def shift(self, x: Tensor, offset: int = 1) -> Tensor:
        """Ring step: rank ``i``'s ``x`` goes to rank ``(i + offset) % size``; backward ``shift(-offset)``."""
        return ppermute(x, ring(self.size, offset), self)


# ---------------------------------------------------------------- how a block is built
def _shift_dims(args: tuple) -> tuple:
    """The default batching rule: dims (ints) as seen with a vmapped batch dim in front, the
    non-negative ones moved by one."""
    return tuple(a + 1 if isinstance(a, int) and not isinstance(a, bool) and a >= 0 else a for a in args)


def _same_args(*args):
    return args


def _unbatched(args: tuple) -> tuple:
    """The batching rule of an op that takes no dims (its raw op handles leading batch dims)."""
    return args


class ValueType(Enum):
    """Whether a value is the same on every rank of the axis (``INVARIANT``, I: its cotangent the
    same on every rank too) or one per rank (``VARYING``, V: a shard, a partial sum, or a
    replicated value consumed by per-rank compute, whose cotangent arrives as per-rank partial sums)."""

    INVARIANT = "I"
    VARYING = "V"


class CollectiveType(NamedTuple):
    """A collective's type: what its input (``src``) and output (``dst``) are; shown as ``I → V``."""

    src: ValueType
    dst: ValueType

    def __str__(self) -> str:
        return f"{self.src.value} → {self.dst.value}"

    @property
    def transposed(self) -> CollectiveType:
        """The type of the transpose: the same two ends, reversed."""
        return CollectiveType(self.dst, self.src)


_V_TO_V = CollectiveType(ValueType.VARYING, ValueType.VARYING)
_I_TO_V = CollectiveType(ValueType.INVARIANT, ValueType.VARYING)
_V_TO_I = CollectiveType(ValueType.VARYING, ValueType.INVARIANT)


class Collective(NamedTuple):
    """One collective as two ``autograd.Function`` classes with the same forward and backward:
    ``eager`` also has the forward-mode ``jvp`` and the ``vmap`` rule; ``traced`` has neither,
    because Dynamo cannot trace a Function with a custom ``jvp`` (torch.compile would graph-break).
    ``types`` says whether input and output are rank-invariant or rank-varying; ``transpose`` is
    the collective its backward applies (``conjugate()``, the block's reference to it: a pair's
    blocks name each other), with ``transpose_args(*args)``; ``batch_args(args)`` gives the
    arguments with the vmapped dim moved to the front."""

    name: str
    eager: type[torch.autograd.Function]
    traced: type[torch.autograd.Function]
    types: CollectiveType
    conjugate: Callable[[], Collective]
    transpose_args: Callable[..., tuple]
    batch_args: Callable[[tuple], tuple]

    def apply(self, x: Tensor, *args) -> Tensor:
        """Run the collective; under ``torch.compile`` the traceable twin (a constant choice at trace time).

        Outside ``torch.func`` transforms, ``eager`` is applied through ``_FunctionBase.apply``
        directly: ``Function.apply``'s Python wrapper would only re-bind the arguments through
        ``inspect.signature`` (the forwards have no defaults, so binding changes nothing) and
        unwrap dead functorch wrappers (done here for ``x``, the only tensor) — about 17 µs a
        call, twice per collective and step.  Under transforms it goes through ``Function.apply``
        (``custom_function_call``)."""
        if torch.compiler.is_compiling():
            return self.traced.apply(x, *args)
        if _transforms_active():
            return self.eager.apply(x, *args)
        return self.eager.apply_unbound(_unwrap_if_dead(x), *args)

    @property
    def transpose(self) -> Collective:
        """The collective its backward applies (itself for ``all_reduce``)."""
        return self.conjugate()

    @property
    def makes_invariant(self) -> bool:
        """Whether its output is rank-invariant (a V → I type): the value it hands on is
        identical on every rank of its axis, whatever it was before."""
        return self.types.dst is ValueType.INVARIANT


def _collective(name: str, forward: Callable, types: CollectiveType, transpose: Callable[[], Collective],
                transpose_args: Callable[..., tuple] = _same_args,
                batch_args: Callable[[tuple], tuple] = _shift_dims,
                keep: Callable[..., Tensor | None] | None = None) -> Collective:
    """The collective ``name`` whose forward is ``forward(x, *args)`` and whose backward is the
    collective ``transpose()`` (a reference to another block of the table, resolved when a
    backward runs, so that a pair's blocks can name each other) applied as
    ``transpose()(grad, *transpose_args(*args))`` (a Function of this module again, so the
    backward has its own backward, jvp and vmap rule).  Its vmap rule moves the batched dim of
    ``x`` to the front and applies ``forward`` to ``batch_args(args)``; its jvp is the forward on
    the tangent (every collective is linear).  ``keep(grad, *args)``, where given, runs first in
    the backward: it returns the cotangent to transpose, or None to keep it (no collective, no
    gradient: FSDP's ``no_sync``)."""

    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:]

    def backward(ctx, grad):
        if keep is not None:
            grad = keep(grad, *ctx.args)
            if grad is None:
                return (None, *([None] * len(ctx.args)))
        args = ctx.args if transpose_args is _same_args else transpose_args(*ctx.args)  # per step: no call for most
        conjugate = transpose().apply(grad, *args)
        return (conjugate, *([None] * len(ctx.args)))

    def jvp(ctx, tangent, *_):
        return eager.apply(tangent, *ctx.args)

    def vmap(info, in_dims, x, *args):
        if in_dims[0] is None:
            return eager.apply(x, *args), None
        return eager.apply(x.movedim(in_dims[0], 0), *batch_args(args)), 0

    cls = "".join(part.title() for part in name.split("_"))
    common = {
        # the raw op itself, not a ``*args`` wrapper: when no grad is needed Dynamo calls forward
        # with ctx first and drops it only if forward's arity matches apply's arguments
        "forward": staticmethod(forward),
        "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward),
        "__doc__": f"Differentiable {name} ({types}); backward: its transpose (see module docstring).",
    }
    eager = type(cls, (torch.autograd.Function,), {
        **common, "generate_vmap_rule": False, "jvp": staticmethod(jvp), "vmap": staticmethod(vmap),
    })
    traced = type(f"{cls}Traced", (torch.autograd.Function,), common)
    eager.apply_unbound = super(torch.autograd.Function, eager).apply  # the C++ apply (see Collective.apply)
    return Collective(name, eager, traced, types, transpose, transpose_args, batch_args)


# ---------------------------------------------------------------- the collectives, one block each
# A block is the collective (its forward, type, transpose — the other block itself — with the
# transpose's arguments, and batching rule, in one ``_collective`` call) and its public function;
# the table in the module docstring lists them, ``COLLECTIVES`` (at the end) names them.

AllReduce = _collective("all_reduce", raw_all_reduce, _V_TO_V, transpose=lambda: AllReduce)


def all_reduce(x: Tensor, group: AxisGroup) -> Tensor:
    """Sum over the axis; backward all-reduces (its own transpose: rank-varying in and out)."""
    return AllReduce.apply(x, group)


AllGather = _collective("all_gather", raw_all_gather, _V_TO_V, transpose=lambda: ReduceScatter)


def all_gather(x: Tensor, dim: int, group: AxisGroup) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim``; backward is ``reduce_scatter``."""
    return AllGather.apply(x, dim, group)


ReduceScatter = _collective("reduce_scatter", raw_reduce_scatter, _V_TO_V, transpose=lambda: AllGather)


def reduce_scatter(x: Tensor, dim: int, group: AxisGroup) -> Tensor:
    """Sum over the axis and keep this rank's chunk of ``dim``; backward is ``all_gather``."""
    return ReduceScatter.apply(x, dim, group)


def _swap_dims(split_dim, concat_dim, group):
    return concat_dim, split_dim, group


AllToAll = _collective("all_to_all", raw_all_to_all, _V_TO_V, transpose=lambda: AllToAll, transpose_args=_swap_dims)


def all_to_all(x: Tensor, split_dim: int, concat_dim: int, group: AxisGroup) -> Tensor:
    """Re-shard from ``split_dim`` to ``concat_dim``; backward is the reverse ``all_to_all``."""
    return AllToAll.apply(x, split_dim, concat_dim, group)


def _invert_perm(perm, group):
    return tuple((d, s) for s, d in perm), group


Ppermute = _collective("ppermute", raw_ppermute, _V_TO_V, transpose=lambda: Ppermute, transpose_args=_invert_perm)


def ppermute(x: Tensor, perm: Sequence[tuple[int, int]], group: AxisGroup) -> Tensor:
    """Point-to-point: for each ``(src, dst)`` in ``perm``, rank ``dst`` receives rank ``src``'s
    ``x`` (ranks that receive nothing get zeros; shapes equal on every rank); backward sends the
    cotangents back along the inverse pairs (``ppermute`` again).  ``ring(size, k)`` is the ring
    step of ring attention (``AxisGroup.shift``)."""
    return Ppermute.apply(x, check_perm(perm, group), group)


def _swap_splits(dim, send, recv, group):
    return dim, recv, send, group


AllToAllV = _collective("all_to_all_v", raw_all_to_all_v, _V_TO_V, transpose=lambda: AllToAllV,
                        transpose_args=_swap_splits)


def all_to_all_v(x: Tensor, dim: int, send: Sequence[int], recv: Sequence[int], group: AxisGroup) -> Tensor:
    """Variable-split all-to-all along ``dim`` (``send[k]`` slices to rank k, ``recv[k]`` from it);
    backward is the reverse exchange (``all_to_all_v`` with the splits swapped)."""
    return AllToAllV.apply(x, dim, tuple(int(n) for n in send), tuple(int(n) for n in recv), group)


SendTo = _collective("send_to", raw_send, _V_TO_V, transpose=lambda: RecvFrom, batch_args=_unbatched)


def send_to(x: Tensor, peer: int, group: AxisGroup) -> Tensor:
    """Send ``x`` to rank ``peer`` of the axis alone (not a collective of the whole axis: pipeline
    stages) and return a zero scalar, the token that carries the send into what is differentiated
    (a stage adds it to its loss); backward receives ``x``'s gradient from ``peer``
    (``recv_from``).  ``peer`` calls ``recv_from`` for it, in the same order."""
    return SendTo.apply(x, tuple(x.shape), int(peer), group)


RecvFrom = _collective("recv_from", raw_recv, _V_TO_V, transpose=lambda: SendTo, batch_args=_unbatched)


def recv_from(anchor: Tensor, shape: Sequence[int], peer: int, group: AxisGroup) -> Tensor:
    """Receive a ``shape`` tensor of ``anchor``'s dtype from rank ``peer`` of the axis, as a
    function of ``anchor`` (a zero scalar computed from what is differentiated, so that the
    backward reaches here); backward sends the gradient back to ``peer`` (``send_to``) and
    gives ``anchor`` a zero."""
    if anchor.dim() != 0:
        raise ValueError(f"recv_from on mesh axis {group.axis!r}: anchor must be a scalar, got {tuple(anchor.shape)}")
    return RecvFrom.apply(anchor, tuple(int(n) for n in shape), int(peer), group)


def _identity(x: Tensor, g: AxisGroup) -> Tensor:
    return x.view_as(x)


CopyTo = _collective("copy_to", _identity, _I_TO_V, transpose=lambda: ReduceFrom)


def copy_to(x: Tensor, group: AxisGroup) -> Tensor:
    """Identity forward, all-reduce backward (``reduce_from``): a replicated value entering
    rank-varying compute."""
    return CopyTo.apply(x, group)


ReduceFrom = _collective("reduce_from", raw_all_reduce, _V_TO_I, transpose=lambda: CopyTo)


def reduce_from(x: Tensor, group: AxisGroup) -> Tensor:
    """All-reduce forward, identity backward (``copy_to``): partial sums leaving into replicated
    compute."""
    return ReduceFrom.apply(x, group)


GatherFrom = _collective("gather_from", raw_all_gather, _V_TO_I, transpose=lambda: SplitTo)


def gather_from(x: Tensor, dim: int, group: AxisGroup) -> Tensor:
    """All-gather forward, split backward (``split_to``): a sharded value leaving into replicated
    compute."""
    return GatherFrom.apply(x, dim, group)


SplitTo = _collective("split_to", raw_split, _I_TO_V, transpose=lambda: GatherFrom)


def split_to(x: Tensor, dim: int, group: AxisGroup) -> Tensor:
    """Keep this rank's chunk of ``dim`` forward, all-gather backward (``gather_from``): a
    replicated value entering sharded compute."""
    return SplitTo.apply(x, dim, group)


def _keep_on_rank0(x: Tensor, g: AxisGroup) -> Tensor:
    return x.view_as(x) if g.rank == 0 else torch.zeros_like(x)


PartialFrom = _collective("partial_from", _keep_on_rank0, _I_TO_V, transpose=lambda: LeaveRegion)


def partial_from(x: Tensor, group: AxisGroup) -> Tensor:
    """Replicate → Partial: rank 0 keeps ``x``, the others contribute zeros; identity backward
    (``leave_region``)."""
    return PartialFrom.apply(x, group)


LeaveRegion = _collective("leave_region", _identity, _V_TO_I, transpose=lambda: PartialFrom)


def leave_region(x: Tensor, group: AxisGroup) -> Tensor:
    """Identity forward; backward keeps the (replicated) gradient on rank 0 only (``partial_from``).
    A replicated value leaving a rank-varying region, whose gradients inside are per-rank partial
    sums."""
    return LeaveRegion.apply(x, group)


def _identity_replicas(x: Tensor, replicas: Replicas, g: AxisGroup) -> Tensor:
    return x.view_as(x)


CopyToReplicas = _collective("copy_to_replicas", _identity_replicas, _I_TO_V, transpose=lambda: ReduceFromReplicas)


def copy_to_replicas(x: Tensor, replicas: Replicas, group: AxisGroup) -> Tensor:
    """Identity forward; backward sums the gradient over this rank's group of replicas
    (``reduce_from_replicas``): a ``GroupedShard`` value entering rank-varying compute."""
    return CopyToReplicas.apply(x, replicas, group)


ReduceFromReplicas = _collective("reduce_from_replicas", raw_replica_sum, _V_TO_I, transpose=lambda: CopyToReplicas)


def reduce_from_replicas(x: Tensor, replicas: Replicas, group: AxisGroup) -> Tensor:
    """Sum over this rank's group of replicas forward, identity backward (``copy_to_replicas``)."""
    return ReduceFromReplicas.apply(x, replicas, group)


# FSDP's pair (see the module docstring): the gather of a bucket of dp-sharded parameters and the
# dp-mean of its gradients, each the other's transpose for FSDP's pairing (batch values paired as
# the mean over the ranks, shards as the sum).
class Precision(NamedTuple):
    """The dtypes of FSDP's pair: the leaves' (``dtype``: the master weights, and the gradients
    returned), the one gathered and computed in (``param``), the one gradients are reduced in
    (``reduce``)."""

    dtype: torch.dtype
    param: torch.dtype
    reduce: torch.dtype


class Accumulator(Protocol):
    """Gradients kept across backward passes (FSDP's ``no_sync``): while ``deferred``, a
    ``gather_params`` backward hands its cotangent (in the reduce dtype) to ``keep``; the next one
    transposes ``take(cotangent)`` (what was kept added)."""

    @property
    def deferred(self) -> bool: ...

    def keep(self, grad: Tensor) -> None: ...

    def take(self, grad: Tensor) -> Tensor: ...


def _shift_dim(args: tuple) -> tuple:
    """The batching rule of FSDP's pair: only ``dim`` (the first argument) is a dim (an int
    ``divisor`` is not)."""
    dim, *rest = args
    return (dim + 1 if dim >= 0 else dim, *rest)


def _gather_cast(x: Tensor, dim: int, precision: Precision, divisor, accumulator, g: AxisGroup) -> Tensor:
    return raw_all_gather(x.to(precision.param), dim, g)


def _keep_deferred(grad: Tensor, dim: int, precision: Precision, divisor, accumulator: Accumulator | None,
                   g: AxisGroup) -> Tensor | None:
    if accumulator is None:
        return grad
    grad = grad.to(precision.reduce)
    if accumulator.deferred:
        if _transforms_active() or _legacy_batched(grad) or torch.compiler.is_compiling():
            raise PlanError(f"gather_params on mesh axis {g.axis!r}: fsdp's no_sync() keeps gradients across backward "
                            "passes, which a backward under a torch.func transform (vmap over the backward: "
                            "autograd.grad(is_grads_batched=True)) or torch.compile cannot do (the kept value would "
                            "outlive the transform); run that backward outside no_sync()")
        accumulator.keep(grad)
        return None
    return accumulator.take(grad)


def _to_mean_scatter(dim, precision, divisor, accumulator, group):
    return dim, precision, divisor, group


GatherParams = _collective("gather_params", _gather_cast, _V_TO_V, transpose=lambda: MeanScatter,
                           transpose_args=_to_mean_scatter, batch_args=_shift_dim, keep=_keep_deferred)


def gather_params(x: Tensor, dim: int, precision: Precision, divisor: int | Tensor, group: AxisGroup,
                  accumulator: Accumulator | None = None) -> Tensor:
    """FSDP's parameter gather: ``x`` (this rank's shard) cast to ``precision.param`` and
    all-gathered along ``dim``; backward ``mean_scatter`` (the gradients' dp-mean, in
    ``precision.reduce``, cast back to ``precision.dtype``), or kept by ``accumulator`` while it
    defers (module docstring: the pairing that makes the two each other's transpose)."""
    return GatherParams.apply(x, dim, precision, divisor, accumulator, group)


def _scatter_mean(x: Tensor, dim: int, precision: Precision, divisor, g: AxisGroup) -> Tensor:
    return (raw_reduce_scatter(x.to(precision.reduce), dim, g) / divisor).to(precision.dtype)


def _to_gather_params(dim, precision, divisor, group):
    return dim, precision, divisor, None, group


MeanScatter = _collective("mean_scatter", _scatter_mean, _V_TO_V, transpose=lambda: GatherParams,
                          transpose_args=_to_gather_params, batch_args=_shift_dim)


def mean_scatter(x: Tensor, dim: int, precision: Precision, divisor: int | Tensor, group: AxisGroup) -> Tensor:
    """The dp-mean of per-rank gradients, sharded: ``x`` cast to ``precision.reduce``,
    reduce-scattered along ``dim``, divided by ``divisor`` (an int, or a tensor broadcasting
    against the result) and cast to ``precision.dtype``; backward ``gather_params`` (all-gather)."""
    return MeanScatter.apply(x, dim, precision, divisor, group)


#: Every collective of this module by its public function's name, for listing them (explain, the
#: tests): each block names its transpose itself.  The transpose's transpose is the collective
#: itself and the transpose's type is the reverse (tests/core/test_collectives.py checks both, and
#: that the module docstring's table agrees).
COLLECTIVES: MappingProxyType[str, Collective] = MappingProxyType({c.name: c for c in (
    AllReduce, AllGather, ReduceScatter, AllToAll, Ppermute, AllToAllV, SendTo, RecvFrom, CopyTo, ReduceFrom,
    GatherFrom, SplitTo, PartialFrom, LeaveRegion, CopyToReplicas, ReduceFromReplicas, GatherParams, MeanScatter)})
