"""Passes: lower boundaries and parameter conversions — every src → dst placement difference
becomes ``Step``s through the one table (``core.lowering.lower``), once.

* ``lower_boundaries``: per planned module, the steps on its forward arguments and outputs; a
  region's undeclared output leaves with the placement its replicated input arrived in.
* ``lower_parameter_conversions``: per leaf, the steps from its storage placement to its use
  (replicated parameters used by rank-varying compute: identity / all-reduce; a Rowwise bias:
  Replicate → Partial).  Tied parameters must be used alike.
* ``bucket_parameter_conversions``: the leaves whose only steps are ``copy_to`` run together,
  one all-reduce per bucket and axis in the backward instead of one per parameter.
"""

from __future__ import annotations

__all__ = ["bucket_parameter_conversions", "lower_boundaries", "lower_parameter_conversions"]

import math
from collections.abc import Mapping, Sequence

import torch
from torch.distributed.tensor import Placement, Replicate, Shard

from ..core.buckets import BUCKET_BYTES, plan_buckets
from ..core.collectives import AllGather, AxisGroup, CopyTo, GatherFrom
from ..core.errors import PlanError
from ..core.lowering import Step, lower
from ..core.placement import ShardInfo, splits
from ..core.program import Boundary, ParamBucket, Planned
from ..core.style import ModuleSpec
from .place import Placed, declared
from .regions import Varying, consumer_axes


def tensor_steps(src: Mapping[str, Placement], dst: Mapping[str, Placement], groups: Mapping[str, AxisGroup], *,
                 consumer: set[str] | frozenset[str], src_varying: set[str] | frozenset[str], where: str) -> list[Step]:
    """The steps that take one tensor from ``src`` to ``dst`` (per axis; missing: Replicate / unchanged)."""
    steps = []
    for axis, g in groups.items():
        s = src.get(axis, Replicate())
        step = lower(s, dst.get(axis, s), g, consumer_varying=axis in consumer, src_varying=axis in src_varying, where=where)
        if step is not None:
            steps.append(step)
    return steps


def _exit_placement(spec: ModuleSpec, axis: str) -> Placement:
    """A region's undeclared output leaves with the placement its replicated input arrived in
    (a residual-stream block: Replicate in, Replicate out; sequence-sharded in, sharded out)."""
    return next(
        (spec.in_src.get(k, {}).get(axis, Replicate()) for k, d in spec.in_dst.items() if isinstance(d.get(axis), Replicate)),
        Replicate(),
    )


def _owned(groups: Mapping[str, AxisGroup], spec: ModuleSpec, named: set[str], v: Varying) -> Mapping[str, AxisGroup]:
    """The axes a boundary converts one argument or output on: those the spec names for it, and
    every axis on which the module is not varying only through its descendants.  A module made
    varying on an axis by a planned child alone (an ``Experts`` below a tp-only ``PrepareInput``)
    says nothing about that axis: the child's own boundary owns it there, so the parent adds no
    region entry or exit of its own (which the child, not knowing it is inside one, would
    contradict: its gather's backward would split a gradient kept on rank 0)."""
    own = {a for pls in spec.params.values() for a, pl in pls.items() if splits(pl)}
    own |= {a for d in spec.in_dst.values() for a, pl in d.items() if not isinstance(pl, Replicate)}
    return {a: g for a, g in groups.items()
            if a in named or a in own or a not in v.varying or a in v.region or a in v.inside}


def lower_boundaries(planned: Sequence[Planned], specs: Mapping[str, ModuleSpec], analysis: Mapping[str, Varying],
                     groups: Mapping[str, AxisGroup]) -> list[Boundary]:
    """One ``Boundary`` per planned module, with the steps on its arguments and outputs."""
    boundaries = []
    for p in planned:
        spec, v = specs[p.fqn], analysis[p.fqn]
        out_src = dict(spec.out_src)
        if v.region and "output" not in {*spec.out_src, *spec.out_dst}:
            out_src["output"] = {a: _exit_placement(spec, a) for a in v.region}  # leaves as it came in
        b = Boundary(p, spec, varying=set(v.varying))
        for key in {*spec.in_src, *spec.in_dst}:
            src = spec.in_src.get(key, {})
            dst = {**src, **spec.in_dst.get(key, {})}
            steps = tensor_steps(src, dst, _owned(groups, spec, {*dst}, v), consumer=v.varying,
                                 src_varying=v.inside, where=f"{p.fqn} input {key!r}")
            if steps:
                b.in_steps[key] = steps
        for key in {*out_src, *spec.out_dst}:
            src = out_src.get(key, {})
            dst = {**src, **spec.out_dst.get(key, {})}
            steps = tensor_steps(src, dst, _owned(groups, spec, {*dst}, v), consumer=v.inside,
                                 src_varying=v.varying, where=f"{p.fqn} output {key!r}")
            if steps:
                b.out_steps[key] = steps
        boundaries.append(b)
    return boundaries


def lower_parameter_conversions(placed: Placed, specs: Mapping[str, ModuleSpec], analysis: Mapping[str, Varying],
                                groups: Mapping[str, AxisGroup], varying_uses: Mapping[str, frozenset[str]] | None = None,
                                unvarying: Mapping[str, frozenset[str]] | None = None) -> dict[str, list[Step]]:
    """Leaf key → the steps from its storage placement to its use in the forward (only leaves with
    steps).  ``varying_uses``: leaf key → axes on which ``compile.dataflow`` saw rank-varying data
    reach it, wherever its module sits (added to what the module tree decides); ``unvarying``: leaf
    key → axes on which the module's own varying compute decides a reduction that the trace saw no
    use needing (taken from it; a region's never is: ``consumer_axes``)."""
    param_steps: dict[str, list[Step]] = {}
    for name, leaf in placed.leaf_of.items():
        owner = placed.owners[name]
        stored = placed.infos[leaf].axes
        found = declared(name, owner, specs)
        used = {**stored, **(found[0].param_dst.get(found[1], {}) if found else {})}
        consumer = (consumer_axes(owner.module, analysis, (unvarying or {}).get(leaf, frozenset()))
                    | set((varying_uses or {}).get(leaf, ())))
        steps = tensor_steps(stored, used, groups, consumer=consumer, src_varying=set(), where=f"parameter {name}")
        if leaf in param_steps and _signature(param_steps[leaf]) != _signature(steps):
            raise PlanError(f"tied parameter {name} is used with different conversions by its modules")
        param_steps[leaf] = steps
    return {k: v for k, v in param_steps.items() if v}


def _signature(steps: Sequence[Step]) -> list[tuple[str, str, str]]:
    return [(s.axis, s.forward, s.backward) for s in steps]


def bucket_parameter_conversions(param_steps: Mapping[str, Sequence[Step]], infos: Mapping[str, ShardInfo],
                                 dtypes: Mapping[str, torch.dtype], bucket_bytes: int = BUCKET_BYTES
                                 ) -> tuple[ParamBucket, ...]:
    """The leaves whose steps are all ``copy_to`` (one per axis), grouped by those axes, in
    buckets of one dtype up to ``bucket_bytes`` (``core.buckets.plan_buckets``)."""
    by_axes: dict[tuple[str, ...], list[str]] = {}
    for key, steps in param_steps.items():
        if steps and all(s.collective is CopyTo for s in steps):
            by_axes.setdefault(tuple(s.axis for s in steps), []).append(key)
    out = [_bucketed(keys, axes, infos, dtypes, bucket_bytes, False) for axes, keys in by_axes.items()]
    gathers: dict[tuple[str, object], list[str]] = {}  # one gather of dim 0 (ShardedParams): by axis and collective
    for key, steps in param_steps.items():
        if (len(steps) == 1 and steps[0].collective in (GatherFrom, AllGather)
                and infos[key].axes.get(steps[0].axis) == Shard(0)):  # stored by rows: gathered whole on dim 0
            gathers.setdefault((steps[0].axis, steps[0].collective), []).append(key)
    out += [_bucketed(keys, (axis,), infos, dtypes, bucket_bytes, True) for (axis, _), keys in gathers.items()]
    return tuple(out)


def _bucketed(keys: list[str], axes: tuple[str, ...], infos: Mapping[str, ShardInfo], dtypes: Mapping[str, torch.dtype],
              bucket_bytes: int, gather: bool) -> ParamBucket:
    index = {k: i for i, k in enumerate(keys)}
    items = ((k, dtypes[k], math.prod(infos[k].local_shape) * dtypes[k].itemsize) for k in keys)
    return ParamBucket(tuple(keys), axes, tuple(tuple(index[k] for k in b) for b in plan_buckets(items, bucket_bytes)),
                       gather)
