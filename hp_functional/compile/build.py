"""``build_program(model, plan, mesh) -> Program``: the compiler, a short composer of named passes
(``_build`` runs them in order), and the public ``lint()``.  No pass communicates, so bad input
raises on every rank before any collective.  A new parallelism adds a pass here (or a transform
over the result), not branches in these.  See docs/architecture.md#the-passes.
"""

from __future__ import annotations

__all__ = ["build_program", "lint", "varying_uses"]

import warnings
from collections.abc import Mapping

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate

from ..analysis.trace import example_call
from ..core.collectives import AxisGroup, CopyTo
from ..core.errors import PlanError, PlanWarning
from ..core.facets import ReducedOver
from ..core.findings import Finding, Level
from ..core.program import Planned, Program
from ..core.style import ModuleSpec
from ..plan.plan import ShardingPlan, as_plan
from .dataflow import trace_dataflow
from .kv_heads import replicate_kv_heads
from .lint import enforce, lint_entries, lint_specs, shadowed
from .lower import bucket_parameter_conversions, lower_boundaries, lower_parameter_conversions
from .place import place_parameters
from .regions import analyse_regions


def check_mesh(model: nn.Module, mesh: object) -> dict[str, AxisGroup]:
    """The mesh's named axes as groups; a PlanError for a missing/unnamed mesh, a rank outside
    it, or a parameter/buffer on another device type (meta is allowed: materialised later)."""
    if not isinstance(mesh, DeviceMesh):
        raise PlanError(f"the mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}: "
                        "init_device_mesh(device_type, shape, mesh_dim_names=(...))")
    axes = list(mesh.mesh_dim_names or ())
    if not axes:
        raise PlanError("the mesh needs named dims (init_device_mesh(..., mesh_dim_names=(...)))")
    if mesh.get_coordinate() is None:
        raise PlanError(f"this rank ({dist.get_rank()}) is not in the mesh {mesh.mesh.tolist()}; call shard() on its ranks")
    check_devices(model, mesh.device_type)
    return {a: AxisGroup.from_mesh(mesh, a) for a in axes}


def check_devices(model: nn.Module, device_type: str) -> None:
    """Parameters and buffers must live on ``device_type`` (or on meta, materialised later)."""
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if t.device.type not in (device_type, "meta"):
            raise PlanError(
                f"{name} is on {t.device.type} but the mesh is {device_type}: move the model to the mesh's "
                "device type (or build it on the meta device)"
            )


def resolve_specs(model: nn.Module, plan: ShardingPlan, mesh: DeviceMesh) -> tuple[list[Planned], dict[str, ModuleSpec]]:
    """The planned modules (``named_modules`` order) and each one's ``ModuleSpec``; a style on a
    module it cannot handle raises naming the module."""
    planned = plan.resolve(model, mesh)
    return planned, {p.fqn: p.style.spec(p.module, p.fqn, p.axis) for p in planned}


def check_head_counts(planned: list[Planned], specs: Mapping[str, ModuleSpec], groups: Mapping[str, AxisGroup]) -> None:
    """Every attribute a spec divides (head counts) must be an int divisible by its axis size."""
    for p in planned:
        for attr in specs[p.fqn].divide_attrs:
            value, n = getattr(p.module, attr, None), groups[p.axis].size
            if not isinstance(value, int) or value % n:
                fix = ("fewer KV heads than ranks are replicated only when the module states its head_dim and its "
                       "K/V projections are planned Colwise (compile.kv_heads)") if "head" in attr else (
                       "every rank must hold an equal share: use a mesh axis whose size divides it, or leave this "
                       "module replicated (NoParallel())")
                raise PlanError(f"{p.fqn}: attribute {attr}={value!r} is not divisible by mesh axis {p.axis!r} "
                                f"(size {n}); {fix}")


def _build(model: nn.Module, plan: ShardingPlan, mesh: DeviceMesh, *, run_lint: bool,
           varying_uses: Mapping[str, frozenset[str]] | None = None, real: bool = False,
           inputs: tuple[tuple, dict] | None = None) -> Program:
    # Each pass reads what the ones before decided: the mesh; the specs; KV-head replication
    # (compile.kv_heads); lint (errors raise together, warnings warn: compile.lint, with the shape
    # audit of every planned region, compile.lint_heads); head counts; storage placements, tied and
    # packed leaves (compile.place); regions (compile.regions); boundaries and parameter conversions
    # (compile.lower), the latter also for the replicated parameters rank-varying data reaches outside
    # the planned modules (compile.dataflow); the copy_to-only conversions bucketed (one all-reduce
    # per bucket and axis in the backward).
    groups = check_mesh(model, mesh)
    planned, specs = replicate_kv_heads(model, *resolve_specs(model, plan, mesh), groups)
    if run_lint:
        enforce(shadowed(model, plan) + lint_specs(model, plan, mesh, planned, specs))
    check_head_counts(planned, specs, groups)
    placed = place_parameters(model, plan, mesh, specs)
    analysis = analyse_regions(planned, specs, list(groups))
    boundaries = lower_boundaries(planned, specs, analysis, groups)
    tree_steps = lower_parameter_conversions(placed, specs, analysis, groups)
    covered = {k: {s.axis for s in v} for k, v in tree_steps.items()}
    whole = {k: frozenset(s.axis for s in v if isinstance(s.dst, Replicate)) for k, v in tree_steps.items()}
    flow = trace_dataflow(model, boundaries, analysis, placed.infos, placed.leaf_of, list(groups), covered, inputs,
                          real=real, whole=whole)
    uses = dict(flow.varying_uses)
    for key, axes in (varying_uses or {}).items():
        uses[key] = uses.get(key, frozenset()) | axes
    # a replicated parameter of a rank-varying module that the trace saw used only with data that
    # does not vary (never inside the module's own compute) takes no reduction there
    unvarying = {k: axes & {s.axis for s in tree_steps[k] if s.collective is CopyTo} for k, axes in flow.unvarying.items()}
    param_steps = lower_parameter_conversions(placed, specs, analysis, groups, uses, unvarying)
    dtypes = {leaf: model.get_parameter(leaf).dtype for leaf in placed.infos}
    infos = {k: i.with_facet(ReducedOver, ReducedOver(owed) if owed else None)
             for k, i in placed.infos.items()
             for owed in [tuple(s.axis for s in param_steps.get(k, ()) if s.collective is CopyTo)]}
    return Program(
        mesh=mesh,
        boundaries=boundaries,
        infos=infos,
        leaf_of=placed.leaf_of,
        param_steps=param_steps,
        groups=groups,
        dtypes=dtypes,
        param_buckets=bucket_parameter_conversions(param_steps, infos, dtypes),
        dataflow_skipped=None if varying_uses is not None else flow.skipped,
        recomputed=flow.recomputed,
    )


def varying_uses(model: nn.Module, plan: ShardingPlan | Mapping, mesh: DeviceMesh,
                 inputs: tuple[tuple, dict] | None = None
                 ) -> tuple[dict[str, frozenset[str]], str | None, dict[str, str]]:
    """(``compile.dataflow``'s varying uses of ``model``'s parameters traced on ``model`` itself —
    real tensors, for a private probe copy whose forward cannot run on meta —, why not if it failed: None when it ran,
    the modules its own code recomputes in the backward: ``Program.recomputed``);
    ``inputs``: ``(args, kwargs)`` of that forward, on ``model``'s device (None: synthesized token ids)."""
    program = _build(model, as_plan(plan), mesh, run_lint=False, real=True, inputs=inputs)
    uses: dict[str, frozenset[str]] = {}
    for key, steps in program.param_steps.items():
        axes = frozenset(s.axis for s in steps if s.collective is CopyTo)
        if axes:
            uses[key] = axes
    return uses, program.dataflow_skipped, program.recomputed


def build_program(model: nn.Module, plan: ShardingPlan | Mapping, mesh: DeviceMesh, *,
                  varying_uses: Mapping[str, frozenset[str]] | None = None, example_inputs=None) -> Program:
    """Compile ``plan`` for ``model`` on ``mesh`` (docs/architecture.md#the-passes).  Reads
    ``model`` and ``plan``; communicates nothing; raises ``PlanError``/``ShapeError`` naming the
    culprit and warns ``PlanWarning`` for lint's warnings.

    Args:
        model: the model to shard (on the mesh's device type, or on meta).
        plan: a ``ShardingPlan`` or a plain ``{pattern: style}`` dict.
        mesh: a ``DeviceMesh`` with named dims that holds this rank.
        varying_uses: leaf key → axes: what a trace of a real probe copy found, for a model whose
            forward cannot run on meta tensors (``shard()`` passes it); None: trace a meta copy.
        example_inputs: what one forward of ``model`` takes (a tensor, a tuple of positional
            arguments or a dict of keyword arguments, as ``auto_plan``'s): the dataflow pass traces
            it (on meta) instead of token ids it synthesizes only for a model that starts with an
            embedding; None: synthesize.
    Returns:
        The ``Program``: boundaries, every leaf's ``ShardInfo``, parameter conversions, axis groups.
    """
    inputs = None if example_inputs is None else example_call(model, example_inputs)
    return _build(model, as_plan(plan), mesh, run_lint=True, varying_uses=varying_uses, inputs=inputs)


def lint(model: nn.Module, plan: ShardingPlan | Mapping, mesh: DeviceMesh) -> list[Finding]:
    """Every finding about ``plan`` on ``model`` and ``mesh``, collected rather than raised — also
    the errors that resolving and placing would raise.  Reads the model and the plan, never
    mutates them, and communicates nothing (docs/tools.md#lint lists the codes).

    Args:
        model: the model the plan is for (a meta model is enough).
        plan: a ``ShardingPlan`` or a plain ``{pattern: style}`` dict.
        mesh: the ``DeviceMesh`` to shard over.
    Returns:
        A list of ``Finding(level, where, message, code)``, ``level`` a ``Level``: ``"error"``, ``"warning"`` or
        ``"note"`` (a ``str`` enum: it compares equal to those strings).
    """
    try:
        plan = as_plan(plan)
    except PlanError as exc:
        return [Finding(Level.ERROR, "plan", str(exc), "entry")]
    findings, usable = lint_entries(model, plan, mesh)
    if usable is None:
        return findings
    try:
        usable.param_rules(model)
        planned = usable.resolve(model, mesh)
    except PlanError as exc:
        if not any(f.code == "conflict" for f in findings):
            findings.append(Finding(Level.ERROR, "plan", str(exc), "style"))
        return findings
    specs, style_errors = {}, []
    for p in planned:
        try:
            specs[p.fqn] = p.style.spec(p.module, p.fqn, p.axis)
        except PlanError as exc:
            style_errors.append(Finding(Level.ERROR, p.fqn, str(exc), "style"))
    if not style_errors:
        try:
            planned, specs = replicate_kv_heads(model, planned, specs, {a: AxisGroup.from_mesh(mesh, a)
                                                                          for a in mesh.mesh_dim_names})
        except PlanError as exc:
            style_errors.append(Finding(Level.ERROR, "plan", str(exc), "heads"))
    findings += style_errors + lint_specs(model, usable, mesh, planned, specs)
    if not any(f.level == Level.ERROR for f in findings):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", PlanWarning)
                _build(model, plan, mesh, run_lint=False)
        except PlanError as exc:
            findings.append(Finding(Level.ERROR, "plan", str(exc), "placement"))
    return findings
