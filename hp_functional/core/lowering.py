"""The one table that lowers a placement change on one mesh axis to a collective.

Every style states its boundaries as placements; ``lower`` turns each (src → dst) into a
``Step`` once, inside ``shard()``.  Whether a replicated value's gradient is partial decides
the backward (JAX's device-varying vs invariant values):

* ``consumer_varying`` — the value feeds rank-varying compute (sharded weights, sharded
  activations), so its gradient arrives as per-rank partial sums;
* ``src_varying`` — the value already lives inside such a region (its grads are partial too).

=============  ==============================  ===================================
src → dst      consumer invariant              consumer rank-varying
=============  ==============================  ===================================
R → R          nothing                         copy_to (id / all-reduce)
R → R (leave)  leave_region (id / rank 0)      nothing
S(d) → R       gather_from (AG / split)        all_gather (AG / reduce-scatter)
P → R          reduce_from (AR / id)           all_reduce (AR / AR)
P → S(d)       reduce_scatter (RS / AG)        reduce_scatter (RS / AG)
R → S(d)       split_to (split / AG)           split_to (split / AG)
S(i) → S(j)    all_to_all                      all_to_all
R → P          partial_from (rank 0 / id)      partial_from (rank 0 / id)
G(d) → S(d)    copy_to_replicas (id / AR)      copy_to_replicas (id / AR)
=============  ==============================  ===================================

``G(d)`` is a stored ``GroupedShard`` (KV-head replication): each group of ranks holds one chunk,
used as this rank's ``Shard(d)`` slice; the backward sums the gradient over the group's ranks
(one all-reduce over the axis of a buffer with a slot per group).

Each backward above is the collective's transpose (``Collective.transpose``), itself a
collective whose backward is the forward again, so every lowering is exact at higher orders too.

Inside a varying region (``src_varying``) gradients of replicated values are per-rank partial
sums: R → R into more varying compute is nothing (the region's entry reduces them once), R → R
out of the region into invariant compute is ``leave_region`` (its replicated gradient is kept on
rank 0 only, so the partial sums add up to it once), and R → S / R → P are rejected: their
transposes would over-count.
"""

from __future__ import annotations

__all__ = ["Step", "lower"]

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from . import collectives as C
from .errors import PlanError
from .placement import is_grouped, replica_group


@dataclass(frozen=True)
class Step:
    """One lowered conversion: the function to run, the collective of ``core.collectives`` it
    applies (the table's entry: code asks ``step.collective is C.CopyTo`` or reads its ``types``)
    and where it leaves the value, and, for ``explain``, what it communicates."""

    fn: Callable[[Tensor], Tensor]
    axis: str
    forward: str  # communication in the forward ("all_gather(1)", "identity", ...), for people
    backward: str  # communication in the backward, for people
    collective: C.Collective  # the entry it applies (C.CopyTo, ...)
    dst: Placement  # the value's placement on ``axis`` after it

    def __call__(self, x: Tensor) -> Tensor:
        return self.fn(x)


def _step(collective: C.Collective, g: C.AxisGroup, dst: Placement, fwd: str, bwd: str, *args) -> Step:
    """A Step applying ``collective`` (an entry of ``core.collectives``) as ``collective(x, *args, g)``,
    leaving ``dst``."""
    return Step(lambda x: collective.apply(x, *args, g), g.axis, fwd, bwd, collective, dst)


def lower(
    src: Placement, dst: Placement, g: C.AxisGroup, *, consumer_varying: bool, src_varying: bool = False,
    where: str = "",
) -> Step | None:
    """The Step that turns a value placed ``src`` on axis ``g`` into ``dst`` (None: nothing to do)."""
    if g.size == 1:
        return None
    R, S, P = Replicate, Shard, Partial
    if is_grouped(src) or is_grouped(dst):
        if is_grouped(src) and isinstance(dst, S) and dst.dim == src.dim:
            n = replica_group(src)
            return _step(C.CopyToReplicas, g, dst, "identity", f"all_reduce(replicas of {n})", C.Replicas(n))
        raise PlanError(f"{where}: no redistribution from {src} to {dst} on axis {g.axis!r} (a GroupedShard "
                        f"is used as its Shard({getattr(src, 'dim', 0)}) slice only)")
    if src == dst and not isinstance(src, R):
        return None
    if isinstance(src, R) and isinstance(dst, R):
        if consumer_varying and not src_varying:
            return _step(C.CopyTo, g, dst, "identity", "all_reduce")
        if src_varying and not consumer_varying:
            return _step(C.LeaveRegion, g, dst, "identity", "keep_on_rank0")
        return None
    if isinstance(src, S) and isinstance(dst, R):
        if consumer_varying:
            return _step(C.AllGather, g, dst, f"all_gather({src.dim})",
                         f"reduce_scatter({src.dim})", src.dim)
        return _step(C.GatherFrom, g, dst, f"all_gather({src.dim})", "split", src.dim)
    if isinstance(src, P) and isinstance(dst, R):
        if consumer_varying:
            return _step(C.AllReduce, g, dst, "all_reduce", "all_reduce")
        return _step(C.ReduceFrom, g, dst, "all_reduce", "identity")
    if isinstance(src, P) and isinstance(dst, S):
        return _step(C.ReduceScatter, g, dst, f"reduce_scatter({dst.dim})",
                     f"all_gather({dst.dim})", dst.dim)
    if isinstance(src, S) and isinstance(dst, S):
        return _step(C.AllToAll, g, dst,
                     f"all_to_all({src.dim}->{dst.dim})", f"all_to_all({dst.dim}->{src.dim})", src.dim, dst.dim)
    if isinstance(src, R) and isinstance(dst, (S, P)):
        if src_varying:
            raise PlanError(f"{where}: Replicate -> {dst} on axis {g.axis!r} inside a rank-varying region is not supported")
        if isinstance(dst, S):
            return _step(C.SplitTo, g, dst, "split", f"all_gather({dst.dim})", dst.dim)
        return _step(C.PartialFrom, g, dst, "keep_on_rank0", "identity")
    raise PlanError(f"{where}: no redistribution from {src} to {dst} on axis {g.axis!r}")
