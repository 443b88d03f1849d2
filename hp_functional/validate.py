"""``validate``: run a plan beside the unsharded model and report where the two differ.

``validate(model, plan, mesh, *args, **kwargs)`` runs ``model(*args, **kwargs)`` on a private
deep copy (the reference) and the sharded ``apply_fn`` on the same inputs, backpropagates one
scalar through each, and compares:

* every planned module's output, made full with the placement the plan declares for it
  (``out_dst``, else ``out_src``, else Replicate per axis: Shard(d) all-gathered, Partial
  all-reduced).  An output the plan does not declare (a ``PrepareInput`` module) is taken as
  Replicate when it has the reference's shape, else as Shard(d) on the one dim that is 1/n of it;
* every parameter's gradient, gathered with ``unshard``;
* that every replicated parameter's gradient is bit-identical across the ranks of each axis the
  plan acts on (other axes, e.g. ``dp``, may legitimately see other data).

Output hooks go on the private copy *before* ``shard()`` reads it, so the private skeleton
inherits them; the user's model is never touched.  Everything local (arguments, the plan, the
reference run) happens before the first collective, and the ranks agree on a hash of what they
will gather before gathering anything, so a disagreement raises everywhere instead of hanging.
``mode="dtensor"`` checks declared placements against DTensor propagation (``validate_dtensor``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from .agree import digest as stable_digest
from .apply import Boundary, shard
from .collectives import AxisGroup, raw_all_gather, raw_all_reduce
from .errors import PlanError
from .placement import fmt_placements as _fmt
from .placement import unshard
from .plan import ShardingPlan

MODES = ("numeric", "dtensor")


class ValidationError(AssertionError):
    """The sharded run does not match the unsharded model; ``report`` holds every row.

    An ``AssertionError``, not a ``PlanError``: the plan *applied* (``PlanError`` means "cannot be
    applied, raised before any collective"); what failed is a check of its results, as in a test.
    """

    def __init__(self, message: str, report: ValidationReport | None = None):
        super().__init__(message)
        self.report = report

    def __reduce__(self):
        return type(self), (str(self), self.report)


class PlacementMismatchError(ValidationError, ValueError):
    """DTensor propagation gives a planned module's input or output another placement than the
    plan declares (upstream's contract: ``module``, ``expected``, ``actual``, ``stage``); also a
    ``ValueError``, as upstream."""

    def __init__(self, module: str, expected: tuple, actual: tuple, stage: str = "out_src", key: object = "output"):
        self.module, self.expected, self.actual, self.stage, self.key = module, tuple(expected), tuple(actual), stage, key
        super().__init__(
            f"[{module}] {stage} placement mismatch for {key!r}: expected {_fmt(self.expected)} (declared by the "
            f"plan), actual {_fmt(self.actual)} (DTensor propagation); check the plan entry for this module"
        )

    def __reduce__(self):
        return type(self), (self.module, self.expected, self.actual, self.stage, self.key)


@dataclass(frozen=True)
class Diff:
    """One compared tensor: a module output (``what`` "output", "output[1]", ...) or a gradient."""

    name: str  # module FQN or parameter FQN
    what: str
    max_abs: float
    max_rel: float  # max_abs / max |reference|
    ok: bool
    note: str = ""  # placements used, or why it could not be compared


@dataclass(frozen=True)
class ReplicaMismatch:
    """A replicated parameter whose gradient differs between the ranks of ``axis``."""

    param: str
    axis: str
    max_abs: float  # largest difference from the axis' first rank


@dataclass
class ValidationReport:
    """What ``validate`` found.  ``modules``: failing rows first, in forward order (the first one
    is where the sharded run starts to diverge; later ones inherit its error), then the passing
    rows worst first.  ``params``: gradient rows worst first.  Identical on every rank."""

    modules: list[Diff] = field(default_factory=list)
    params: list[Diff] = field(default_factory=list)
    mismatched_replicas: list[ReplicaMismatch] = field(default_factory=list)
    placement_mismatches: list[PlacementMismatchError] = field(default_factory=list)
    placements_checked: int = 0  # dtensor mode: declared placements compared with DTensor's
    mode: str = "numeric"
    tolerance: float = 0.0

    @property
    def ok(self) -> bool:
        return not (self.failed_modules or self.failed_params or self.mismatched_replicas or self.placement_mismatches)

    @property
    def failed_modules(self) -> list[Diff]:
        return [d for d in self.modules if not d.ok]

    @property
    def failed_params(self) -> list[Diff]:
        return [d for d in self.params if not d.ok]

    def summary(self) -> str:
        """One line naming the worst offenders first."""
        if self.ok and self.mode == "dtensor":
            return f"validate (dtensor): ok, {self.placements_checked} declared placements match DTensor propagation"
        if self.ok:
            return f"validate ({self.mode}): ok, {len(self.modules)} module outputs and {len(self.params)} gradients match"
        parts = [str(e) for e in self.placement_mismatches[:1]]
        if self.failed_modules:
            d = self.failed_modules[0]
            parts.append(f"first diverging module {d.name} {d.what} (max|Δ| {d.max_abs:.3g}, rel {d.max_rel:.3g})")
        if self.failed_params:
            d = self.failed_params[0]
            parts.append(f"worst gradient {d.name} (max|Δ| {d.max_abs:.3g}, rel {d.max_rel:.3g})")
        if self.mismatched_replicas:
            r = self.mismatched_replicas[0]
            parts.append(f"replicated gradient {r.param} differs across axis {r.axis!r} (max|Δ| {r.max_abs:.3g})")
        counts = [(len(self.placement_mismatches), "placements"), (len(self.failed_modules), "module outputs"),
                  (len(self.failed_params), "gradients"), (len(self.mismatched_replicas), "replicated gradients")]
        failing = ", ".join(f"{n} {what}" for n, what in counts if n)
        return f"validate ({self.mode}) failed: " + "; ".join(parts) + f" [failing: {failing}]"

    def __str__(self) -> str:
        lines = [self.summary()]
        lines += [f"  placement  {e}" for e in self.placement_mismatches]
        rows = [("module", d) for d in self.modules] + [("grad", d) for d in self.params]
        if rows:
            width = max(len(d.name) + len(d.what) for _, d in rows) + 1
            lines.append(f"  {'':4} {'kind':6} {'name':<{width}} {'max|Δ|':>9} {'rel':>9}  note")
            for kind, d in rows:
                label = d.name + ("" if kind == "grad" else " " + d.what)
                status = "ok" if d.ok else "FAIL"
                lines.append(f"  {status:4} {kind:6} {label:<{width}} {d.max_abs:9.2e} {d.max_rel:9.2e}  {d.note}")
        lines += [f"  FAIL replica {r.param} on axis {r.axis!r}: max|Δ| between ranks {r.max_abs:.3g}"
                  for r in self.mismatched_replicas]
        return "\n".join(lines)

    def raise_if_failed(self) -> None:
        """Raise the first ``PlacementMismatchError``, else a ``ValidationError`` naming the worst
        offenders first; do nothing when the report is ok."""
        if self.placement_mismatches:
            raise self.placement_mismatches[0]
        if not self.ok:
            failing = [r for r in str(self).splitlines()[1:] if "FAIL" in r]
            raise ValidationError("\n".join([self.summary(), *failing[:20]]), self)


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
    raise_on_failure: bool = False,
    **kwargs: Any,
) -> ValidationReport:
    """Check ``plan`` against the unsharded ``model`` on ``model(*args, **kwargs)`` (call on every rank).

    A tensor fails when ``max|Δ| > atol + tolerance * max|reference|``.  The loss is
    ``loss_fn(output)``, else HF's ``output.loss``, else the sum of the first output tensor (on a
    sharded output, the sum of the local piece: its gradients are still those of the full sum).
    ``check_axes``: the axes on which replicated gradients must be bit-identical (default: the
    axes the plan acts on).  ``mode="dtensor"`` runs ``validate_placements`` instead.  Returns a
    ``ValidationReport``; ``raise_on_failure`` raises it as ``ValidationError`` (or
    ``PlacementMismatchError``).  Makes one private copy of the model; dropout must be off or
    seeded alike (both runs start from the same CPU RNG state).
    """
    _check_arguments(mesh, mode, loss_fn, tolerance, atol, check_axes)
    plan = plan if isinstance(plan, ShardingPlan) else ShardingPlan(plan)
    if mode == "dtensor":
        from .validate_dtensor import check_placements

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


class _Recorder:
    """Forward hooks that record planned modules' outputs into ``target`` ({(fqn, call): {key: tensor}})."""

    def __init__(self):
        self.target: dict | None = None

    def hook(self, fqn: str) -> Callable:
        def record(module, args, out):  # a plain function: deepcopy keeps it, so the skeleton's copy records here too
            if self.target is not None:
                call = sum(1 for f, _ in self.target if f == fqn)
                self.target[(fqn, call)] = _tensors(out)

        return record


def _items(out) -> list[tuple[object, object]]:
    """A module output keyed as ``ModuleSpec`` keys outputs ("output": the tensor, or element 0)."""
    if isinstance(out, Tensor):
        return [("output", out)]
    if isinstance(out, Mapping):
        return list(out.items())
    if isinstance(out, (tuple, list)):
        return [("output" if i == 0 else i, v) for i, v in enumerate(out)]
    return []


def _tensors(out) -> dict[object, Tensor]:
    return {k: v.detach().clone() for k, v in _items(out) if isinstance(v, Tensor)}


def _scalar(out, loss_fn, who: str) -> Tensor:
    """The loss: ``loss_fn(out)``, else ``out.loss`` (HF), else the sum of the first output tensor."""
    if loss_fn is not None:
        value = loss_fn(out)
    elif isinstance(getattr(out, "loss", None), Tensor):
        value = out.loss
    else:
        first = next((v for _, v in _items(out) if isinstance(v, Tensor)), None)
        if first is None:
            raise TypeError(f"validate: {who} returned {type(out).__name__} with no tensor; pass loss_fn=")
        value = first.float().sum()
    if not isinstance(value, Tensor) or value.numel() != 1:
        raise TypeError(f"validate: the loss of {who} must be a scalar tensor, got {type(value).__name__}")
    return value


def _out_placements(b: Boundary, key: object, axes: list[str]) -> dict[str, Placement] | None:
    """The placements the plan declares for output ``key`` of boundary ``b`` (None: undeclared)."""
    spec = b.spec
    for k in (key, 0) if key == "output" else (key,):
        if k in spec.out_src or k in spec.out_dst:
            src, dst = spec.out_src.get(k, {}), spec.out_dst.get(k, {})
            return {a: dst.get(a, src.get(a, Replicate())) for a in axes}
    return None


def _infer(local: Tensor, ref: Tensor, n: int) -> Placement | None:
    """Replicate if ``local`` has the reference shape, Shard(d) if exactly dim d is 1/n of it."""
    if local.shape == ref.shape:
        return Replicate()
    if local.dim() != ref.dim():
        return None
    dims = [d for d in range(ref.dim()) if local.shape[d] != ref.shape[d]]
    return Shard(dims[0]) if len(dims) == 1 and local.shape[dims[0]] * n == ref.shape[dims[0]] else None


def _to_full(t: Tensor, placements: dict[str, Placement], groups: dict[str, AxisGroup], axes: list[str]) -> Tensor:
    for axis in reversed(axes):
        p, g = placements.get(axis, Replicate()), groups[axis]
        if g.size == 1:
            continue
        if isinstance(p, Shard):
            t = raw_all_gather(t, p.dim % t.dim(), g)
        elif isinstance(p, Partial):
            t = raw_all_reduce(t, g) / (g.size if p.reduce_op == "avg" else 1)
    return t


def _mesh_gather(v: Tensor, groups: dict[str, AxisGroup], axes: list[str]) -> Tensor:
    """``v`` from every rank of the mesh, stacked on dim 0 (the same on every rank)."""
    v = v.unsqueeze(0)
    for axis in axes:
        if groups[axis].size > 1:
            v = raw_all_gather(v, 0, groups[axis])
    return v


def _diff(full: Tensor, ref: Tensor | None, tol: float, atol: float) -> tuple[float, float, bool, str]:
    if ref is None or full.shape != ref.shape:
        got = "no tensor" if ref is None else f"reference shape {tuple(ref.shape)}"
        return math.inf, math.inf, False, f"shape {tuple(full.shape)} vs {got}"
    a, r = full.detach().double(), ref.detach().to(full.device).double()
    scale = r.abs().max().item() if r.numel() else 0.0
    err = (a - r).abs().max().item() if r.numel() else 0.0
    rel = err / scale if scale else (0.0 if err == 0 else math.inf)
    return err, rel, err <= atol + tol * scale, ""


def _numeric(model, plan, mesh, args, kwargs, loss_fn, tol, atol, check_axes) -> ValidationReport:
    try:
        ref = copy.deepcopy(model)  # the reference: hooks and gradients land here, never on the user's model
    except Exception as exc:
        raise PlanError(f"validate: cannot copy {type(model).__name__}: {exc}") from exc
    for p in ref.parameters():
        p.grad = None
    rec = _Recorder()
    for p in plan.resolve(ref, mesh):
        ref.get_submodule(p.fqn).register_forward_hook(rec.hook(p.fqn))
    apply_fn, params, infos = shard(ref, plan, mesh)  # the skeleton is a deep copy of ``ref``: it inherits the hooks
    program = apply_fn.program
    axes, groups = list(mesh.mesh_dim_names), program.groups
    check = list(check_axes) if check_axes is not None else [
        a for a in axes if any(a == b.planned.axis or a in b.spec.axes for b in program.boundaries)
    ]
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
            loss = _scalar(fn(*args, **kwargs), loss_fn, who)
            if loss.requires_grad:  # the reference runs first and is local: bad inputs raise before any collective
                loss.backward()
        rec.target = None

    # decide every comparison locally, then agree on the decisions before the first gather
    entries = _entries({b.planned.fqn: b for b in program.boundaries}, ref_out, local_out, axes, groups)
    grads = {k: p.grad for k, p in params.items() if p.grad is not None}
    signature = repr(([(e[0], e[1], None if e[2] is None else (tuple(e[2].shape), str(e[2].dtype)), e[5]) for e in entries],
                      [(k, tuple(g.shape)) for k, g in grads.items()], check))
    digest = stable_digest(signature)
    device = next((t.device for t in grads.values()), torch.device(mesh.device_type))
    hashes = _mesh_gather(torch.tensor([digest], dtype=torch.int64, device=device), groups, axes)
    if not bool((hashes == digest).all()):
        raise ValidationError("validate: the ranks disagree on the outputs or gradients to compare (structure or shapes "
                              "differ per rank); check that every rank passed the same model, plan and input shapes")

    table = []  # [name, what, max_abs, max_rel, ok, note]
    for fqn, what, local, r, placements, note in entries:
        if placements is None:
            table.append([fqn, what, math.inf, math.inf, False, note])
        else:
            err, rel, ok, why = _diff(_to_full(local, placements, groups, axes), r, tol, atol)
            table.append([fqn, what, err, rel, ok, why or note])
    n_modules, full = len(table), unshard(grads, infos)
    for key in infos:
        g_ref = ref.get_parameter(key).grad
        if key in full and g_ref is not None:
            err, rel, ok, why = _diff(full[key], g_ref, tol, atol)
            table.append([key, "grad", err, rel, ok, why or _fmt(infos[key].placements)])
        else:
            same = key not in full and g_ref is None
            table.append([key, "grad", 0.0 if same else math.inf, 0.0 if same else math.inf, same,
                          "" if same else f"gradient only in the {'sharded run' if g_ref is None else 'reference'}"])
    replicas = []  # [param, axis, max_abs between ranks, bits differ]
    for key, g in grads.items():
        for axis in check:
            if groups[axis].size > 1 and isinstance(infos[key].axes[axis], Replicate):
                stacked = raw_all_gather(g.detach().unsqueeze(0), 0, groups[axis])
                bits = stacked.reshape(stacked.shape[0], -1).contiguous().view(torch.uint8)
                replicas.append([key, axis, (stacked - stacked[0]).abs().max().item(), float(not (bits == bits[0]).all())])

    # every rank gets the worst value over the mesh, so the report (and raising) is the same everywhere
    values = torch.tensor([[d[2], d[3], float(not d[4])] for d in table] + [[r[2], r[3], 0.0] for r in replicas],
                          dtype=torch.float64, device=device).reshape(-1, 3)
    worst = _mesh_gather(values, groups, axes).amax(0).tolist()
    diffs = [Diff(d[0], d[1], w[0], w[1], not w[2], d[5]) for d, w in zip(table, worst, strict=False)]
    mods, prms = diffs[:n_modules], diffs[n_modules:]
    mods = [d for d in mods if not d.ok] + sorted((d for d in mods if d.ok), key=lambda d: -d.max_rel)
    prms = sorted(prms, key=lambda d: (d.ok, -d.max_rel))
    bad = [ReplicaMismatch(r[0], r[1], w[0]) for r, w in zip(replicas, worst[len(table):], strict=True) if w[1]]
    return ValidationReport(mods, prms, sorted(bad, key=lambda r: -r.max_abs), mode="numeric", tolerance=tol)


def _entries(boundaries: dict[str, Boundary], ref_out: dict, local_out: dict, axes: list[str], groups) -> list[tuple]:
    """(module, what, local, reference, placements or None, note) per recorded output, in forward order."""
    entries = []
    for (fqn, call), outs in ref_out.items():
        b, got = boundaries[fqn], local_out.get((fqn, call), {})
        for key, r in outs.items():
            what = ("output" if key == "output" else f"output[{key}]") + (f" (call {call})" if call else "")
            local, placements, note = got.get(key), _out_placements(b, key, axes), "declared"
            if local is None:
                placements, note = None, "missing in the sharded run"
            elif placements is None:
                inferred = _infer(local, r, groups[b.planned.axis].size)
                placements = None if inferred is None else {b.planned.axis: inferred}
                note = "inferred" if inferred is not None else f"undeclared; shape {tuple(local.shape)} vs {tuple(r.shape)}"
            elif any(isinstance(p, Partial) and p.reduce_op not in ("sum", "avg") for p in placements.values()):
                placements, note = None, "Partial reduce_op not supported"
            if placements is not None:
                note = f"{_fmt(placements.get(a, Replicate()) for a in axes)} {note}"
            entries.append((fqn, what, local, r, placements, note))
    return entries
