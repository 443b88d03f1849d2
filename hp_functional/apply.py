"""``shard(model, plan, mesh)``: decide everything once, then run ``functional_call``.

Phases (hyper_parallel's ``apply_sharding_plan`` without touching the model):
1. resolve the plan → planned modules and their ``ModuleSpec``;
2. place every parameter (tied groups must agree) → ``ShardInfo``, shape checks;
3. decide rank-varying compute and lower every boundary to ``Step``s (``compile_plan``);
   everything up to here is local, so bad input raises on every rank before any collective;
4. slice the local shards into the params pytree;
5. build the private skeleton and install the local forwards on it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from .agree import agree
from .collectives import AxisGroup
from .errors import PlanError, ShapeError
from .lint import enforce, lint
from .placement import ShardInfo, local_layout, mesh_placements, slice_local
from .placement import fmt_placements as _fmt
from .plan import Planned, ShardingPlan
from .redistribute import Step, lower
from .runtime import make_apply_fn
from .skeleton import build_skeleton, install_boundary
from .styles import ModuleSpec


@dataclass
class Boundary:
    """One planned module after lowering."""

    planned: Planned
    spec: ModuleSpec
    in_steps: dict[object, list[Step]] = field(default_factory=dict)
    out_steps: dict[object, list[Step]] = field(default_factory=dict)
    varying: set[str] = field(default_factory=set)  # axes on which its compute differs per rank


@dataclass
class Program:
    """Everything ``shard()`` decided: placements, boundaries and parameter conversions."""

    mesh: DeviceMesh
    boundaries: list[Boundary]
    infos: dict[str, ShardInfo]  # pytree key → ShardInfo
    canonical: dict[str, str]  # every parameter FQN (aliases too) → pytree key
    param_steps: dict[str, list[Step]]  # pytree key → conversions applied before the forward
    groups: dict[str, AxisGroup]
    dtypes: dict[str, torch.dtype]  # pytree key → dtype (for the cross-rank fingerprint)
    loss_parallel: tuple[AxisGroup, int] | None = None  # (vocab axis, this rank's vocab start)

    def explain(self) -> str:
        """A readable table: per planned module, its parameters and collectives."""
        from .explain import render

        return render(self)


def _block_sizes(name, shape, placements, local_shape, blocks, axes) -> tuple[int, ...]:
    """Global sub-block sizes of a packed parameter, checked to shard evenly."""
    dims = [p.dim % len(shape) for p in placements if isinstance(p, Shard)]
    if len(dims) != 1:
        raise PlanError(f"parameter {name}: packed blocks need exactly one sharded dim, got {_fmt(placements)}")
    d = dims[0]
    sizes = (shape[d] // blocks,) * blocks if isinstance(blocks, int) else tuple(blocks)
    n = shape[d] // local_shape[d]
    if sum(sizes) != shape[d] or any(b % n for b in sizes):
        raise ShapeError(f"parameter {name}: packed blocks {sizes} along dim {d} (size {shape[d]}) do not each split {n} "
                         f"ways over mesh axes {[a for a, p in zip(axes, placements, strict=True) if isinstance(p, Shard)]}")
    return sizes


def _is_below(fqn: str, ancestor: str) -> bool:
    """Whether module ``fqn`` is a proper descendant of ``ancestor`` ("" is the root)."""
    return fqn != ancestor and (not ancestor or fqn.startswith(ancestor + "."))


def _exit_placement(spec: ModuleSpec, axis: str) -> Placement:
    """A region's undeclared output leaves with the placement its replicated input arrived in
    (a residual-stream block: Replicate in, Replicate out; sequence-sharded in, sharded out)."""
    return next(
        (spec.in_src.get(k, {}).get(axis, Replicate()) for k, d in spec.in_dst.items() if isinstance(d.get(axis), Replicate)),
        Replicate(),
    )


def _tensor_steps(src_map, dst_map, key, axes, groups, *, consumer, src_varying, where) -> list[Step]:
    steps = []
    for axis in axes:
        src = src_map.get(key, {}).get(axis, Replicate())
        dst = dst_map.get(key, {}).get(axis, src)
        step = lower(src, dst, groups[axis], consumer_varying=axis in consumer,
                     src_varying=axis in src_varying, where=where)
        if step is not None:
            steps.append(step)
    return steps


def _check_devices(model: nn.Module, mesh: DeviceMesh) -> None:
    """Parameters must live on the mesh's device type (or on meta, materialised later)."""
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if t.device.type not in (mesh.device_type, "meta"):
            raise PlanError(
                f"{name} is on {t.device.type} but the mesh is {mesh.device_type}: move the model to the mesh's "
                "device type (or build it on the meta device)"
            )


def compile_plan(model: nn.Module, plan: ShardingPlan | Mapping, mesh: DeviceMesh) -> Program:
    """Phases 1-3: resolve, place and lower. Reads ``model``; communicates nothing."""
    if not isinstance(plan, ShardingPlan):
        plan = ShardingPlan(plan)
    axes = list(mesh.mesh_dim_names or ())
    if not axes:
        raise PlanError("the mesh needs named dims (init_device_mesh(..., mesh_dim_names=(...)))")
    if mesh.get_coordinate() is None:
        raise PlanError(f"this rank ({dist.get_rank()}) is not in the mesh {mesh.mesh.tolist()}; call shard() on its ranks")
    _check_devices(model, mesh)
    planned = plan.resolve(model, mesh)
    specs = {p.fqn: p.style.spec(p.module, p.fqn, p.axis) for p in planned}  # a style on the wrong module raises here
    enforce(lint(model, plan, mesh, planned))
    groups = {a: AxisGroup.from_mesh(mesh, a) for a in axes}
    for p in planned:
        for attr in specs[p.fqn].divide_attrs:
            value, n = getattr(p.module, attr, None), groups[p.axis].size
            if not isinstance(value, int) or value % n:
                raise PlanError(
                    f"{p.fqn}: attribute {attr}={value!r} is not divisible by mesh axis {p.axis!r} (size {n}); "
                    "grouped-query attention with fewer KV heads than the TP size is rejected"
                )

    # phase 2: storage placements; tied parameters form one leaf under the first FQN
    first_name: dict[int, str] = {}
    canonical: dict[str, str] = {}
    owner: dict[str, tuple[str, str]] = {}  # param FQN → (module FQN, param name)
    for name, prm in model.named_parameters(remove_duplicate=False):
        canonical[name] = first_name.setdefault(id(prm), name)
        mod, _, pname = name.rpartition(".")
        owner[name] = (mod, pname)
    rules = plan.param_rules(model)
    infos: dict[str, ShardInfo] = {}
    chosen: dict[str, tuple[tuple, str, object]] = {}
    for name in canonical:
        mod, pname = owner[name]
        spec = specs.get(mod)
        per_axis, blocks = (spec.params.get(pname, {}), spec.param_blocks.get(pname)) if spec else ({}, None)
        if name in rules:
            per_axis, blocks = {plan.tp_axis: rules[name].placement}, rules[name].blocks
        placements = mesh_placements(per_axis, mesh, f"parameter {name}")
        key = canonical[name]
        if key in chosen and chosen[key][0] != placements:
            raise PlanError(
                f"tied parameters {chosen[key][1]} and {name} get conflicting placements "
                f"{_fmt(chosen[key][0])} vs {_fmt(placements)}; give both modules the same layout"
            )
        chosen.setdefault(key, (placements, name, blocks))
    aliases_of: dict[str, list[str]] = {}
    for name, key in canonical.items():
        if name != key:
            aliases_of.setdefault(key, []).append(name)
    for key, (placements, _, blocks) in chosen.items():
        prm = model.get_parameter(key)
        local_shape, offset = local_layout(prm.shape, placements, mesh, f"parameter {key}")
        aliases = tuple(aliases_of.get(key, ()))
        sizes = _block_sizes(key, prm.shape, placements, local_shape, blocks, axes) if blocks else None
        if sizes:
            d = next(p.dim % prm.dim() for p in placements if isinstance(p, Shard))
            n = prm.shape[d] // local_shape[d]
            offset = (*offset[:d], offset[d] // local_shape[d] * (sizes[0] // n), *offset[d + 1 :])
        infos[key] = ShardInfo(placements, mesh, prm.shape, local_shape, offset, aliases, sizes)

    # phase 3: which compute is rank-varying, and the regions that own gradient reduction
    sharded_axes = {
        mod: {a for pls in spec.params.values() for a, pl in pls.items() if isinstance(pl, Shard)}
        for mod, spec in specs.items()
    }
    boundaries: list[Boundary] = []
    region: dict[str, set[str]] = {}
    for p in planned:
        spec = specs[p.fqn]
        below = set().union(*(s for m, s in sharded_axes.items() if m == p.fqn or _is_below(m, p.fqn)))
        inside = set().union(*(r for m, r in region.items() if _is_below(p.fqn, m)), set())
        varying = set(inside)
        for axis in axes:
            if spec.varying is not None:
                if spec.varying and axis == p.axis:
                    varying.add(axis)
            elif axis in below or any(isinstance(d.get(axis), (Shard, Partial)) for d in spec.in_dst.values()):
                varying.add(axis)
        region[p.fqn] = {a for a in varying if any(isinstance(d.get(a), Replicate) for d in spec.in_dst.values())}
        out_src = dict(spec.out_src)
        if region[p.fqn] and "output" not in {*spec.out_src, *spec.out_dst}:
            out_src["output"] = {a: _exit_placement(spec, a) for a in region[p.fqn]}  # leaves as it came in
        b = Boundary(p, spec, varying=varying)
        for key in {*spec.in_src, *spec.in_dst}:
            b.in_steps[key] = _tensor_steps(spec.in_src, spec.in_dst, key, axes, groups, consumer=varying,
                                            src_varying=inside, where=f"{p.fqn} input {key!r}")
        for key in {*out_src, *spec.out_dst}:
            b.out_steps[key] = _tensor_steps(out_src, spec.out_dst, key, axes, groups, consumer=inside,
                                             src_varying=varying, where=f"{p.fqn} output {key!r}")
        b.in_steps = {k: v for k, v in b.in_steps.items() if v}
        b.out_steps = {k: v for k, v in b.out_steps.items() if v}
        boundaries.append(b)

    # parameter conversions: replicated params used by rank-varying compute get their
    # gradients all-reduced (copy_to); Replicate → Partial uses (Rowwise bias) keep rank 0's
    regions = {m: r for m, r in region.items() if r}
    varying_of = {b.planned.fqn: b.varying for b in boundaries}
    param_steps: dict[str, list[Step]] = {}
    for name in canonical:
        mod, pname = owner[name]
        key = canonical[name]
        consumer = set(varying_of.get(mod, set()))
        consumer |= set().union(*(r for m, r in regions.items() if mod == m or _is_below(mod, m)), set())
        spec = specs.get(mod)
        stored = {a: pl for a, pl in zip(axes, infos[key].placements, strict=True)}
        dst = dict(stored)
        if spec is not None:
            dst.update(spec.param_dst.get(pname, {}))
        steps = _tensor_steps({0: stored}, {0: dst}, 0, axes, groups, consumer=consumer, src_varying=set(),
                              where=f"parameter {name}")
        if key in param_steps and [(s.forward, s.backward) for s in param_steps[key]] != [
            (s.forward, s.backward) for s in steps
        ]:
            raise PlanError(f"tied parameter {name} is used with different conversions by its modules")
        param_steps[key] = steps
    param_steps = {k: v for k, v in param_steps.items() if v}
    loss = None
    if plan.loss_parallel:
        head = next(p for p in planned if p.fqn == plan.loss_head(model))
        loss = (groups[head.axis], infos[canonical[f"{head.fqn}.weight"]].offset[0])
    dtypes = {key: model.get_parameter(key).dtype for key in infos}
    return Program(mesh, boundaries, infos, canonical, param_steps, groups, dtypes, loss)


def shard(
    model: nn.Module, plan: ShardingPlan | Mapping, mesh: DeviceMesh, *, agree_timeout: float | None = 300.0
) -> tuple[Callable, dict[str, Tensor], dict[str, ShardInfo]]:
    """Shard ``model`` by ``plan`` over ``mesh`` without mutating it.

    Returns ``(apply_fn, params, shard_info)``: ``apply_fn(params, *args, **kwargs)`` returns
    what ``model(*args, **kwargs)`` returns; ``params`` maps each parameter FQN (tied groups
    once) to this rank's local shard; ``shard_info`` says where each shard sits.  All checks
    are local and raise on every rank before any collective; then one small all-gather
    agrees on a fingerprint of the result (``PlanMismatchError`` if ranks differ, or if a rank
    does not arrive within ``agree_timeout`` seconds; None waits for the process group's timeout).
    """
    program = compile_plan(model, plan, mesh)
    agree(program, None if agree_timeout is None else timedelta(seconds=agree_timeout))
    params = {
        key: slice_local(model.get_parameter(key), info).requires_grad_(model.get_parameter(key).requires_grad)
        for key, info in program.infos.items()
    }
    skeleton = build_skeleton(model, {k: i.local_shape for k, i in program.infos.items()}, program.canonical)
    shared: dict = {}  # input conversions shared within one apply_fn call (see install_boundary)
    for b in program.boundaries:
        skel_module = skeleton.get_submodule(b.planned.fqn)
        group = program.groups[b.planned.axis]
        for attr in b.spec.divide_attrs:
            setattr(skel_module, attr, getattr(skel_module, attr) // group.size)
        inner = b.planned.style.local_forward(skel_module, group, skel_module.forward)
        install_boundary(skel_module, b.planned.fqn, inner, b.in_steps, b.out_steps, shared)
    return make_apply_fn(skeleton, program, shared), params, program.infos
