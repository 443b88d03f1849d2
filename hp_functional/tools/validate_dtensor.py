"""DTensor mode of ``validate``: run the planned layouts with DTensor placement propagation as
the reference for what each planned module really produces (upstream's ``validate_mode``),
forward only.  What is checked and what is not: ``check_placements``; docs/tools.md#validate.
"""

from __future__ import annotations

__all__ = ["check_placements", "validate_placements"]

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication

from ..compile.build import build_program
from ..core.errors import PlanError
from ..core.placement import mesh_placements, slice_local, to_dtensor
from ..core.program import Boundary
from ..core.signature import arg_slots, map_arguments, map_output, output_index
from ..parallel.local import Local
from ..parallel.tensor.styles import NoParallel
from ..plan.plan import ShardingPlan, as_plan
from ..runtime.skeleton import build_skeleton
from .validation_report import PlacementMismatchError


def same_placements(a: tuple[Placement, ...], b: tuple[Placement, ...], ndim: int) -> bool:
    """Equal per mesh dim, with Shard dims normalised by ``ndim`` and any Partial subclass
    (DTensor's masked embedding partial) equal to ``Partial`` of the same reduce op."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if isinstance(x, Shard) and isinstance(y, Shard):
            if x.dim % max(ndim, 1) != y.dim % max(ndim, 1):
                return False
        elif isinstance(x, Partial) and isinstance(y, Partial):
            if x.reduce_op != y.reduce_op:
                return False
        elif not (isinstance(x, Replicate) and isinstance(y, Replicate)):
            return False
    return True


def validate_placements(
    model: nn.Module,
    plan: ShardingPlan | Mapping,
    mesh: DeviceMesh,
    *args: Any,
    raise_on_failure: bool = True,
    **kwargs: Any,
) -> list[PlacementMismatchError]:
    """Run ``model(*args, **kwargs)`` as DTensors laid out by ``plan`` (call on every rank), forward
    only, and find every planned module whose actual input/output placement differs from the
    declared ``in_src``/``out_src``.

    Args:
        model: the unsharded model; only read.
        plan: a ``ShardingPlan`` or a ``{pattern: style}`` dict.
        mesh: the device mesh.
        args, kwargs: what ``apply_fn`` would get (this rank's local data).
        raise_on_failure: raise the first mismatch instead of returning the list (the keyword ``validate``
            takes; note the default here is True).
    Returns:
        the ``PlacementMismatchError`` of every mismatch, in forward order (empty: all placements agree).
    """
    found, _ = check_placements(model, plan, mesh, args, kwargs)
    if found and raise_on_failure:
        raise found[0]
    return found


def check_placements(
    model: nn.Module, plan: ShardingPlan | Mapping, mesh: DeviceMesh, args: tuple, kwargs: dict
) -> tuple[list[PlacementMismatchError], int]:
    """``validate_placements`` without raising: (mismatches in forward order, placements compared).

    A private skeleton gets every parameter as a DTensor with ``shard()``'s placements; each planned
    module's arguments are wrapped (plain tensors, as ``in_src`` declares) or checked (DTensors) and
    redistributed to ``in_dst``, its own forward runs under DTensor dispatch, and its outputs' actual
    placements are compared with ``out_src`` before going to ``out_dst``.  Plain tensors that meet
    DTensors (rotary tables, masks) count as replicated; HF models get ``use_cache=False`` unless given.

    Checkable: every style whose compute is the module's own forward (``Heads`` too: DTensor works on
    global shapes, so no head count is divided); ``VocabEmbedding`` through DTensor's own embedding rule
    (a broken ``local_forward`` is numeric mode's job).  Not checked: ``Local`` entries (skipped),
    ``param_dst`` (DTensor decides how a Rowwise bias meets the partial sums).  Rejected up front: packed
    parameters, channel-split convolutions and norms, ``labels=`` under ``loss_parallel``.  A forward
    DTensor cannot dispatch is a ``PlanError``
    naming the innermost planned module.  DTensor may reduce a Partial earlier than the plan does (Gemma's
    scaled embedding): that reads as a mismatch (expected Partial, actual Replicate)."""
    plan = as_plan(plan)
    program = build_program(model, plan, mesh)  # local: a bad plan raises here, on every rank
    packed = sorted(k for k, i in program.infos.items() if i.blocks)
    if packed:
        raise PlanError(f"validate_placements: packed parameters {packed[:3]} have no DTensor layout; use validate()")
    convs = sorted(b.planned.fqn for b in program.boundaries if not isinstance(b.planned.style, NoParallel)
                   and isinstance(model.get_submodule(b.planned.fqn), nn.modules.conv._ConvNd | nn.modules.batchnorm._NormBase
                                  | nn.GroupNorm))
    if convs:
        raise PlanError(f"validate_placements: channel-split modules {convs[:3]} have no DTensor rule (DTensor's "
                        "convolution takes no channel-sharded weight); use validate()")
    if plan.settings.get("loss_parallel") and kwargs.get("labels") is not None:
        raise PlanError("validate_placements: the loss_parallel labels= loss is not checked by DTensor; pass no labels")
    dmodel = build_skeleton(model, {k: i.global_shape for k, i in program.infos.items()}, program.leaf_of)
    local = {k: slice_local(model.get_parameter(k), i) for k, i in program.infos.items()}
    dparams = {k: nn.Parameter(v, requires_grad=False) for k, v in to_dtensor(local, program.infos).items()}
    for name, key in program.leaf_of.items():
        owner, _, pname = name.rpartition(".")
        setattr(dmodel.get_submodule(owner), pname, dparams[key])

    trail = _Trail()
    for b in program.boundaries:
        if isinstance(b.planned.style, Local):  # its compute is fn, not the module's forward: numeric mode's job
            continue
        _attach(dmodel.get_submodule(b.planned.fqn), b, mesh, trail)
    if "use_cache" in inspect.signature(dmodel.forward).parameters and "use_cache" not in kwargs:
        kwargs = {**kwargs, "use_cache": False}  # HF's KV cache concatenates plain tensors with DTensors
    try:
        with torch.no_grad(), implicit_replication():
            dmodel(*args, **kwargs)
    except Exception as exc:
        where = (f"inside {trail.stack[-1]}" if trail.stack else f"after {trail.last}" if trail.last
                 else "before any planned module")
        raise PlanError(f"validate_placements: the DTensor forward failed {where}: {type(exc).__name__}: {exc}") from exc
    return trail.found, trail.checked


class _Trail:
    """What the hooks saw: mismatches, how many placements were compared, where the forward is."""

    def __init__(self):
        self.found: list[PlacementMismatchError] = []
        self.checked = 0
        self.stack: list[str] = []  # planned modules entered and not yet left
        self.last = ""  # the last planned module left


def _attach(module: nn.Module, b: Boundary, mesh: DeviceMesh, trail: _Trail) -> None:
    """Hooks that wrap/check/redistribute ``module``'s arguments and outputs as ``b`` declares."""
    spec, fqn = b.spec, b.planned.fqn
    in_keys = list(dict.fromkeys([*spec.in_src, *spec.in_dst]))
    out_keys = list(dict.fromkeys([*spec.out_src, *spec.out_dst]))
    slots = arg_slots(module.forward, in_keys, fqn) if in_keys else []

    def convert(value, key, src_map, dst_map, stage: str):
        if not isinstance(value, Tensor):
            return value
        expected = mesh_placements(src_map.get(key, {}), mesh, f"{fqn} {stage} {key!r}")
        target = tuple(dst_map.get(key, {}).get(a, p) for a, p in zip(mesh.mesh_dim_names, expected, strict=True))
        if isinstance(value, DTensor):
            actual = tuple(value.placements)
        elif stage == "in_src":  # the caller's data arrives as the plan says it does
            value, actual = DTensor.from_local(value, mesh, expected, run_check=False), expected
        else:  # a plain output computed without DTensor: replicated
            actual = (Replicate(),) * mesh.ndim
            value = DTensor.from_local(value, mesh, actual, run_check=False)
        trail.checked += 1
        if not same_placements(actual, expected, value.ndim):
            trail.found.append(PlacementMismatchError(fqn, expected, actual, stage, key))
        return value.redistribute(mesh, target)

    def pre(mod, args, kwargs):
        trail.stack.append(fqn)
        args, kwargs = map_arguments(slots, args, kwargs,
                                     lambda slot, v: convert(v, slot.key, spec.in_src, spec.in_dst, "in_src"))
        return tuple(args), kwargs

    def post(mod, args, out):
        trail.last = trail.stack.pop()
        for key in out_keys:
            out = map_output(out, output_index(key), lambda v, key=key: convert(v, key, spec.out_src, spec.out_dst, "out_src"),
                             fqn, strict=False)
        return out

    module.register_forward_pre_hook(pre, with_kwargs=True)
    module.register_forward_hook(post)
