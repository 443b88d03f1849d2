"""``validate``: run a plan beside the unsharded model and report where the two differ.

The reference runs on a private deep copy of the model, the sharded ``apply_fn`` on the same
inputs; every planned module's output (made full with its declared placement), every gradient,
the bit-identity of replicated gradients across the plan's axes and ``Local`` outputs declared
Replicate are compared.  Everything local happens before the first collective, and the ranks
agree on what they will gather first, so a disagreement raises everywhere instead of hanging.
``mode="dtensor"``: ``validate_dtensor``.  See docs/tools.md#validate.
"""

from __future__ import annotations

__all__ = ["validate"]

import copy
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from ..compile.agree import digest as stable_digest
from ..core.collectives import AxisGroup, raw_all_gather
from ..core.errors import PlanError, ReplicationError
from ..core.gather import unshard
from ..core.placement import GroupedShard, fmt_placements as _fmt, replica_group, to_full
from ..core.program import Boundary, Program
from ..parallel.local import Local
from ..plan.plan import ShardingPlan, as_plan
from ..runtime.loss import output_items, scalar_loss
from ..runtime.shard import shard
from .validate_dtensor import check_placements
from .validation_report import Diff, ReplicaMismatch, ValidationError, ValidationReport

MODES = ("numeric", "dtensor")


def validate(
    model: nn.Module,
    plan: ShardingPlan | Mapping,
    mesh: DeviceMesh,
    *args: Any,
    mode: str = "numeric",
    loss_fn: Callable[[Any], Tensor] | None = None,
    tolerance: float = 1e-4,
    atol: float = 1e-6,
    check_axes: Sequence[str] | None = None,
    raise_on_failure: bool = True,
    **kwargs: Any,
) -> ValidationReport:
    """Check ``plan`` against the unsharded ``model`` on ``model(*args, **kwargs)`` (call on every rank).

    Makes one private copy of the model; dropout must be off or seeded alike (both runs start from
    the same CPU and device RNG states).

    Args:
        model: the unsharded model; only read (the reference runs on a deep copy).
        plan: a ``ShardingPlan`` or a ``{pattern: style}`` dict.
        mesh: the device mesh, with named dims.
        args, kwargs: the inputs, as both the model and ``apply_fn`` take them.
        mode: ``"numeric"`` (compare outputs and gradients) or ``"dtensor"`` (``validate_placements``, forward only).
        loss_fn: ``output -> scalar`` to backpropagate; None: HF's ``output.loss``, else the sum of the first
            output tensor (on a sharded output, the sum of the local piece: its gradients are still those of
            the full sum).
        tolerance, atol: a tensor fails when ``max|Δ| > atol + tolerance * max|reference|``.
        check_axes: the axes on which replicated gradients must be bit-identical; None: the axes the plan acts on.
        raise_on_failure: raise a failed report as ``ValidationError`` (its ``report`` attached;
            ``PlacementMismatchError`` in ``"dtensor"`` mode), as every check of the package does; False:
            return it, failed or not, to print or inspect.
    Returns:
        a ``ValidationReport`` (in numeric mode the same on every rank: each value is the worst over the mesh).
    """
    _check_arguments(mesh, mode, loss_fn, tolerance, atol, check_axes)
    plan = as_plan(plan)
    if mode == "dtensor":
        found, checked = check_placements(model, plan, mesh, args, kwargs)
        report = ValidationReport(placement_mismatches=found, placements_checked=checked, mode=mode)
    else:
        report = _numeric(model, plan, mesh, args, kwargs, loss_fn, tolerance, atol, check_axes)
    if raise_on_failure:
        report.raise_if_failed()
    return report


def _check_arguments(mesh, mode, loss_fn, tolerance, atol, check_axes) -> None:
    """Local checks of validate's own arguments (so every rank raises before any collective)."""
    if mode not in MODES:
        raise ValueError(f"validate: mode {mode!r} is not one of {MODES}")
    for name, value in (("tolerance", tolerance), ("atol", atol)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise ValueError(f"validate: {name} must be a finite number >= 0, got {value!r}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"validate: loss_fn must be callable (output -> scalar tensor), got {type(loss_fn).__name__}")
    if mode == "dtensor" and (loss_fn is not None or check_axes is not None):
        raise ValueError("validate: loss_fn and check_axes belong to mode='numeric'; mode='dtensor' runs the forward only")
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if not isinstance(mesh, DeviceMesh) or not names:
        raise PlanError("validate: the mesh must be a DeviceMesh with named dims (init_device_mesh(..., mesh_dim_names=...))")
    unknown = [a for a in (check_axes or ()) if a not in names]
    if isinstance(check_axes, str) or unknown:
        raise ValueError(f"validate: check_axes must be a sequence of mesh axis names {list(names)}, got {check_axes!r}")


class OutputRecorder:
    """Forward hooks that record planned modules' outputs into ``target`` ({(fqn, call): {key: tensor}})."""

    def __init__(self):
        self.target: dict | None = None

    def hook(self, fqn: str) -> Callable:
        def record(module, args, out):  # a plain function: deepcopy keeps it, so the skeleton's copy records here too
            if self.target is not None:
                call = sum(1 for f, _ in self.target if f == fqn)
                self.target[(fqn, call)] = {k: v.detach().clone() if isinstance(v, Tensor) else None
                                            for k, v in output_items(out)}

        return record


def _out_placements(b: Boundary, key: object, axes: list[str]) -> dict[str, Placement] | None:
    """The placements the plan declares for output ``key`` of boundary ``b`` (None: undeclared).
    A K/V projection whose weight is replicated over groups of ranks (``GroupedShard``) produces
    its sharded output replicated over the same groups."""
    spec = b.spec
    grouped = {a: replica_group(p) for per_axis in spec.params.values() for a, p in per_axis.items()
               if replica_group(p) > 1}
    for k in (key, 0) if key == "output" else (key,):
        if k in spec.out_src or k in spec.out_dst:
            src, dst = spec.out_src.get(k, {}), spec.out_dst.get(k, {})
            out = {a: dst.get(a, src.get(a, Replicate())) for a in axes}
            return {a: GroupedShard(p.dim, grouped[a]) if a in grouped and isinstance(p, Shard) else p
                    for a, p in out.items()}
    return None


def _infer(local: Tensor, ref: Tensor, n: int) -> Placement | None:
    """Replicate if ``local`` has the reference shape, Shard(d) if exactly dim d is 1/n of it."""
    if local.shape == ref.shape:
        return Replicate()
    if local.dim() != ref.dim():
        return None
    dims = [d for d in range(ref.dim()) if local.shape[d] != ref.shape[d]]
    return Shard(dims[0]) if len(dims) == 1 and local.shape[dims[0]] * n == ref.shape[dims[0]] else None


def _mesh_gather(v: Tensor, groups: dict[str, AxisGroup], axes: list[str]) -> Tensor:
    """``v`` from every rank of the mesh, stacked on dim 0 (the same on every rank)."""
    v = v.unsqueeze(0)
    for axis in axes:
        if groups[axis].size > 1:
            v = raw_all_gather(v, 0, groups[axis])
    return v


class _Measured(NamedTuple):
    """One compared tensor on this rank, before the worst over the mesh is taken."""

    max_abs: float
    max_rel: float
    ok: bool
    note: str


def _diff(full: Tensor, ref: Tensor | None, tol: float, atol: float) -> _Measured:
    if ref is None or full.shape != ref.shape:
        got = "no tensor" if ref is None else f"reference shape {tuple(ref.shape)}"
        return _Measured(math.inf, math.inf, False, f"shape {tuple(full.shape)} vs {got}")
    a, r = full.detach().double(), ref.detach().to(full.device).double()
    scale = r.abs().max().item() if r.numel() else 0.0
    err = (a - r).abs().max().item() if r.numel() else 0.0
    rel = err / scale if scale else (0.0 if err == 0 else math.inf)
    return _Measured(err, rel, err <= atol + tol * scale, "")


class _Entry(NamedTuple):
    """A recorded module output to compare: its local value, the reference, how to make it full."""

    fqn: str
    what: str
    local: Tensor | None
    reference: Tensor
    placements: dict[str, Placement] | None  # None: cannot be compared (``note`` says why)
    note: str
    compared: bool = True  # False: one side returns no tensor here (an output its consumers ignore); not a failure


class _Replica(NamedTuple):
    param: str
    axis: str
    max_abs: float  # from the axis' first rank
    differs: float  # 1.0 when the bits differ


def _run_both(ref: nn.Module, apply_fn: Callable, params: dict, mesh: DeviceMesh, rec: OutputRecorder, args, kwargs,
              loss_fn) -> tuple[dict, dict]:
    """The reference and the sharded forward + backward from the same RNG states; their recorded outputs."""
    ref_out, local_out = {}, {}
    accel = None if mesh.device_type == "cpu" else torch.get_device_module(mesh.device_type)
    devices = [] if accel is None else [accel.current_device()]
    # both runs start from the same CPU and device RNG states (dropout masks alike); the caller's are restored
    with torch.random.fork_rng(devices=devices, device_type=mesh.device_type if accel else "cuda"):
        rng, device_rng = torch.get_rng_state(), accel.get_rng_state() if accel else None
        for target, fn, who in ((ref_out, ref, "the unsharded model"), (local_out, partial(apply_fn, params), "apply_fn")):
            torch.set_rng_state(rng)
            if accel:
                accel.set_rng_state(device_rng)
            rec.target = target
            loss = scalar_loss(fn(*args, **kwargs), loss_fn, who=f"validate: {who}")
            if loss.requires_grad:  # the reference runs first and is local: bad inputs raise before any collective
                loss.backward()
        rec.target = None
    return ref_out, local_out


def _agree_on_structure(entries: list[_Entry], grads: dict[str, Tensor], check: list[str], groups, axes, device) -> None:
    """Every rank must compare the same things, or the gathers below would hang."""
    signature = repr(([(e.fqn, e.what, None if e.local is None else (tuple(e.local.shape), str(e.local.dtype)), e.note)
                       for e in entries], [(k, tuple(g.shape)) for k, g in grads.items()], check))
    digest = stable_digest(signature)
    hashes = _mesh_gather(torch.tensor([digest], dtype=torch.int64, device=device), groups, axes)
    if not bool((hashes == digest).all()):
        raise ValidationError("validate: the ranks disagree on the outputs or gradients to compare (structure or shapes "
                              "differ per rank); check that every rank passed the same model, plan and input shapes")


def _replicas(grads: dict[str, Tensor], program: Program, check: list[str]) -> list[_Replica]:
    """Per replicated gradient and checked axis: how far it is from the axis' first rank, and whether its bits differ."""
    out = []
    for key, g in grads.items():
        for axis in check:
            group = program.groups[axis]
            if group.size > 1 and isinstance(program.infos[key].axes[axis], Replicate):
                stacked = raw_all_gather(g.detach().unsqueeze(0), 0, group)
                bits = stacked.reshape(stacked.shape[0], -1).contiguous().view(torch.uint8)
                out.append(_Replica(key, axis, (stacked - stacked[0]).abs().max().item(),
                                    float(not (bits == bits[0]).all())))
    return out


def _numeric(model, plan, mesh, args, kwargs, loss_fn, tol, atol, check_axes) -> ValidationReport:
    ref = _reference_copy(model)
    rec = OutputRecorder()
    replication: list[ReplicationError] = []
    plan = _checking_locals(plan, replication.append)
    for p in plan.resolve(ref, mesh):
        ref.get_submodule(p.fqn).register_forward_hook(rec.hook(p.fqn))
    # verify=False: this is the comparison itself, module by module (the shard-time probe would only
    # refuse); the skeleton is a deep copy of ``ref``: it inherits the hooks
    batch = (tuple(args) if not kwargs else dict(kwargs) if not args else None) if args or kwargs else None  # traced
    apply_fn, params, infos = shard(ref, plan, mesh, verify=False, example_inputs=batch)
    program = apply_fn.program
    axes, groups = list(mesh.mesh_dim_names), program.groups
    # replicated gradients must be bit-identical over the axes the plan acts on; other axes (dp) may see other data
    check = list(check_axes) if check_axes is not None else [
        a for a in axes if any(a == b.planned.axis or a in b.spec.axes for b in program.boundaries)
    ]
    ref_out, local_out = _run_both(ref, apply_fn, params, mesh, rec, args, kwargs, loss_fn)

    # decide every comparison locally, then agree on the decisions before the first gather
    entries = _entries({b.planned.fqn: b for b in program.boundaries}, ref_out, local_out, axes, groups)
    grads = {k: p.grad for k, p in params.items() if p.grad is not None}
    device = next((t.device for t in grads.values()), torch.device(mesh.device_type))
    _agree_on_structure(entries, grads, check, groups, axes, device)

    modules = _module_rows(entries, axes, groups, tol, atol)
    rows = modules + _grad_rows(ref, unshard(grads, infos), infos, tol, atol)
    replicas = _replicas(grads, program, check)
    return _worst_report(rows, len(modules), entries, replicas, groups, axes, device, tol,
                         replication=list(dict.fromkeys(str(e) for e in replication)))


def _reference_copy(model: nn.Module) -> nn.Module:
    """The reference: a deep copy of ``model`` with no gradients, where hooks and gradients land (never on the user's)."""
    try:
        ref = copy.deepcopy(model)
    except Exception as exc:
        raise PlanError(f"validate: cannot copy {type(model).__name__}: {exc}") from exc
    for p in ref.parameters():
        p.grad = None
    return ref


#: a compared tensor on this rank: (module or parameter, what of it, measured)
_Row = tuple[str, str, _Measured]


def _module_rows(entries: list[_Entry], axes: list[str], groups, tol: float, atol: float) -> list[_Row]:
    """Per recorded module output: its full value (made from its placements) against the reference's."""
    rows: list[_Row] = []
    for e in entries:
        if not e.compared:
            rows.append((e.fqn, e.what, _Measured(0.0, 0.0, True, e.note)))
        elif e.placements is None:
            rows.append((e.fqn, e.what, _Measured(math.inf, math.inf, False, e.note)))
        else:
            m = _diff(to_full(e.local, [e.placements.get(a, Replicate()) for a in axes], [groups[a] for a in axes]),
                      e.reference, tol, atol)
            rows.append((e.fqn, e.what, m._replace(note=m.note or e.note)))
    return rows


def _grad_rows(ref: nn.Module, full: Mapping[str, Tensor], infos, tol: float, atol: float) -> list[_Row]:
    """Per parameter: its ``full`` (gathered) gradient against the reference's; a gradient on one side only fails."""
    rows: list[_Row] = []
    for key in infos:
        g_ref = ref.get_parameter(key).grad
        if key in full and g_ref is not None:
            m = _diff(full[key], g_ref, tol, atol)
            rows.append((key, "grad", m._replace(note=m.note or _fmt(infos[key].placements))))
        else:
            same = key not in full and g_ref is None
            why = "" if same else f"gradient only in the {'sharded run' if g_ref is None else 'reference'}"
            rows.append((key, "grad", _Measured(0.0 if same else math.inf, 0.0 if same else math.inf, same, why)))
    return rows


def _worst_report(rows: list[_Row], n_modules: int, entries: list[_Entry], replicas: list[_Replica], groups,
                  axes: list[str], device, tol: float, *, replication: list[str]) -> ValidationReport:
    """The report of the worst value over the mesh of each row and replica (one gather), so the report (and
    raising) is the same on every rank: the first ``n_modules`` rows are module outputs, the rest gradients."""
    values = torch.tensor([[m.max_abs, m.max_rel, float(not m.ok)] for _, _, m in rows]
                          + [[r.max_abs, r.differs, 0.0] for r in replicas], dtype=torch.float64, device=device).reshape(-1, 3)
    worst = _mesh_gather(values, groups, axes).amax(0).tolist()
    skipped = {(e.fqn, e.what) for e in entries if not e.compared}
    diffs = [Diff(name, what, w[0], w[1], not w[2], m.note, (name, what) not in skipped)
             for (name, what, m), w in zip(rows, worst, strict=False)]
    mods, prms = diffs[:n_modules], diffs[n_modules:]
    mods = [d for d in mods if not d.ok] + sorted((d for d in mods if d.ok), key=lambda d: -d.max_rel)
    prms = sorted(prms, key=lambda d: (d.ok, -d.max_rel))
    bad = [ReplicaMismatch(r.param, r.axis, w[0]) for r, w in zip(replicas, worst[len(rows):], strict=True) if w[1]]
    return ValidationReport(mods, prms, sorted(bad, key=lambda r: -r.max_abs), mode="numeric", tolerance=tol,
                            replication=replication)


def _checking_locals(plan: ShardingPlan, on_mismatch: Callable[[ReplicationError], None]) -> ShardingPlan:
    """``plan`` with its ``Local`` entries' replication check reporting to ``on_mismatch`` (a new plan)."""
    entries = {k: dataclasses.replace(s, check=on_mismatch) if isinstance(s, Local) else s for k, s in plan.entries.items()}
    return plan.with_entries(entries)


def _entries(boundaries: dict[str, Boundary], ref_out: dict, local_out: dict, axes: list[str], groups) -> list[_Entry]:
    """One ``_Entry`` per recorded output, in forward order.  An output that one side returns as
    no tensor (``None``: a ``Local`` attention returning no attention weights beside an eager
    reference that does) is listed as not compared; the module's main output missing, or a module
    that did not run in the sharded run, is a failure."""
    entries = []
    for (fqn, call), outs in ref_out.items():
        b, ran = boundaries[fqn], (fqn, call) in local_out
        got = local_out.get((fqn, call), {})
        for key in [*outs, *(k for k in got if k not in outs)]:
            r, local = outs.get(key), got.get(key)
            what = ("output" if key == "output" else f"output[{key}]") + (f" (call {call})" if call else "")
            if r is None and local is None:
                continue
            if ran and key != "output" and (r is None or local is None):
                side = "the sharded run" if local is None else "the unsharded model"
                entries.append(_Entry(fqn, what, local, r, None, f"not compared: {side} returns no tensor here",
                                      compared=False))
                continue
            placements, note = _out_placements(b, key, axes), "declared"
            if local is None:
                placements, note = None, "missing in the sharded run"
            elif r is None:
                placements, note = None, "missing in the unsharded model"
            elif placements is None:
                inferred = _infer(local, r, groups[b.planned.axis].size)
                placements = None if inferred is None else {b.planned.axis: inferred}
                note = "inferred" if inferred is not None else f"undeclared; shape {tuple(local.shape)} vs {tuple(r.shape)}"
            elif any(isinstance(p, Partial) and p.reduce_op not in ("sum", "avg") for p in placements.values()):
                placements, note = None, "Partial reduce_op not supported"
            if placements is not None:
                note = f"{_fmt(placements.get(a, Replicate()) for a in axes)} {note}"
            entries.append(_Entry(fqn, what, local, r, placements, note))
    return entries
