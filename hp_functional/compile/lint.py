"""Plan lint: findings about a plan resolved against a model, read off the specs the compiler built.

``build_program`` runs ``lint_specs`` (and ``shadowed``) right after resolving the plan and
``enforce``s the result; the public ``lint()`` (``compile.build``) returns every finding instead.
Nothing here builds a program, mutates the model or the plan, or communicates.  The codes, their
levels and what each finds: docs/tools.md#lint.
"""

from __future__ import annotations

__all__ = ["collapse", "enforce", "layer_pattern", "lint_entries", "lint_specs", "shadowed"]

import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from ..core.errors import PlanError, PlanWarning
from ..core.findings import Finding, Level
from ..core.paths import most_specific, specificity
from ..core.placement import replica_group
from ..core.program import Planned
from ..core.signature import arg_slots
from ..core.style import ModuleSpec
from ..plan.plan import ShardingPlan
from ..sources.peft import lora_view
from .lint_heads import audit_regions


def lint_entries(model: nn.Module, plan: ShardingPlan, mesh: DeviceMesh) -> tuple[list[Finding], ShardingPlan | None]:
    """The per-entry checks (unmatched patterns, unknown axes), conflicts and shadowed entries,
    and the plan of the entries that resolve by themselves (None: the mesh is unusable)."""
    if not isinstance(mesh, DeviceMesh) or not mesh.mesh_dim_names:
        return [Finding(Level.ERROR, "mesh", "the mesh must be a DeviceMesh with named dims "
                        "(init_device_mesh(device_type, shape, mesh_dim_names=(...)))", "mesh")], None
    findings, good = [], {}
    for pattern, style in plan.entries.items():  # each entry alone: unmatched pattern, unknown axis
        try:
            plan.restricted({pattern: style}).resolve(model, mesh)
            good[pattern] = style
        except PlanError as exc:
            findings.append(Finding(Level.ERROR, pattern, str(exc), "entry"))
    usable = plan.with_entries(good, axes=plan.restricted(good).axes)  # the roles the usable entries use
    return findings + _conflicts(model, usable) + shadowed(model, usable), usable


def lint_specs(model: nn.Module, plan: ShardingPlan, mesh: DeviceMesh, planned: list[Planned],
               specs: Mapping[str, ModuleSpec]) -> list[Finding]:
    """The checks on module structure over the specs the compiler built (a planned module
    missing from ``specs`` had a style error): siblings of sharded Linears, heads, forward
    arguments, and each parallelism's own (``Parallelism.lint``: sequence parallelism's)."""
    findings: list[Finding] = []
    for p in planned:
        spec = specs.get(p.fqn)
        keys = [*dict.fromkeys([*spec.in_src, *spec.in_dst])] if spec is not None else []
        if keys:
            try:
                arg_slots(p.module.forward, keys, p.fqn)
            except PlanError as exc:
                findings.append(Finding(Level.ERROR, p.fqn, str(exc), "argument"))
    by_fqn = {p.fqn: p for p in planned if p.fqn in specs}
    entries = {p.fqn for p in planned}  # with an entry, even one whose style failed
    heads = frozenset(h for par in plan.parallelisms for h in par.sharded_outputs(plan, model))  # loss parallel's head
    modules = dict(model.named_modules(remove_duplicate=False))
    view, seen, seen_specs, seen_entries = lora_view(modules, by_fqn, specs, dict.fromkeys(entries))  # LoRA: its base
    parents = {fqn.rpartition(".")[0] for fqn, m in view.items() if isinstance(m, nn.Linear) and fqn in seen}
    for parent in sorted(parents):
        findings += _siblings(_Family(parent, view, seen, seen_specs, heads, mesh, set(seen_entries)))
    for par in plan.parallelisms:
        findings += par.lint(plan, by_fqn, specs)
    out_head = getattr(model, "get_output_embeddings", lambda: None)()
    skip = {*heads, *(f for f, m in modules.items() if out_head is not None and m is out_head)}
    try:
        rules = {n: {plan.axes[r.axis_role]: r.placement} for n, r in plan.param_rules(model).items()}
    except PlanError:  # a handler that matches nothing: placing the parameters raises it
        rules = {}
    named = {f.where.rpartition(".")[0] for f in findings if f.level == Level.ERROR}  # already refused: no second error
    errors, missed = audit_regions(model, mesh, planned, specs, skip=tuple(skip), rules=rules, named=named)
    findings += [Finding(Level.ERROR, where, message, code) for where, code, message in errors]
    findings += [Finding(Level.NOTE, where, f"{where or '<root module>'}: not audited: {why}", "not-audited")
                 for where, why in missed]
    return findings


_LAYER_INDEX = re.compile(r"\.\d+(?=\.)")


def layer_pattern(text: str) -> str:
    """``text`` with its layer indices as ``*`` (``model.layers.3.mlp`` → ``model.layers.*.mlp``):
    how findings and the CLI's brief parameter table merge what differs only by layer."""
    return _LAYER_INDEX.sub(".*", text)


def collapse(findings: list[Finding]) -> list[str]:
    """The findings as lines, those that differ only in layer indices merged into one
    (``model.layers.*.mlp``, with a count)."""
    groups: dict[str, list[str]] = {}
    for f in findings:
        groups.setdefault(layer_pattern(str(f)), []).append(str(f))
    return [f"{line} ({len(lines)} modules)" if len(lines) > 1 else lines[0] for line, lines in groups.items()]


def enforce(findings: list[Finding]) -> None:
    """Raise the errors (all of them, in one PlanError); warn about the warnings (notes are
    ``hpf.lint``'s only)."""
    errors = [f for f in findings if f.level == Level.ERROR]
    if errors:
        raise PlanError("; ".join(collapse(errors)))
    for line in collapse([f for f in findings if f.level == Level.WARNING]):
        warnings.warn(line, PlanWarning, stacklevel=3)


# ---------------------------------------------------------------- pattern checks
def _conflicts(model: nn.Module, plan: ShardingPlan) -> list[Finding]:
    findings = []
    for path, cands in plan.candidates(model).items():
        try:
            most_specific(path, cands)
        except PlanError as exc:
            findings.append(Finding(Level.ERROR, path, str(exc), "conflict"))
    return findings


def shadowed(model: nn.Module, plan: ShardingPlan) -> list[Finding]:
    """Entries whose every match is taken by a more specific pattern."""
    hits: dict[str, list[bool]] = {}
    for cands in plan.candidates(model).values():
        best = max(specificity(c.pattern) for c in cands)
        for c in cands:
            hits.setdefault(c.pattern, []).append(specificity(c.pattern) < best)
    return [
        Finding(Level.WARNING, pattern, f"plan entry {pattern!r} has no effect: every module it matches is taken by a more "
                                    "specific pattern", "shadowed")
        for pattern, all_shadowed in hits.items() if all(all_shadowed)
    ]


# ---------------------------------------------------------------- structural checks
def _placement(spec_map: Mapping, key, axis: str):
    return spec_map.get(key, {}).get(axis)


@dataclass(frozen=True)
class _Family:
    """What the sibling checks read about one parent module and the plan around it."""

    parent: str
    modules: Mapping[str, nn.Module]
    by_fqn: Mapping[str, Planned]  # planned modules whose spec was built
    specs: Mapping[str, ModuleSpec]
    heads: frozenset[str]  # modules whose sharded output is meant (loss parallel's head: Parallelism.sharded_outputs)
    mesh: DeviceMesh
    entries: set[str]  # modules with a plan entry


def _cousins(f: _Family, axis: str) -> tuple[list[str], list[str]]:
    """(Shard(-1) producers, Shard(-1) consumers) planned on ``axis`` below ``f.parent``'s parent
    but outside ``f.parent``: a pair split over sibling modules of one block."""
    if not f.parent:
        return [], []
    top = f.parent.rpartition(".")[0]
    near = [c for c, p in f.by_fqn.items() if p.axis == axis and c not in f.heads and (not top or c.startswith(top + "."))
            and not c.startswith(f.parent + ".")]
    out = {c for c in near if isinstance(pl := _placement(f.specs[c].out_dst, "output", axis), Shard) and pl.dim == -1}
    into = {c for c in near if _placement(f.specs[c].in_src, 0, axis) == Shard(-1)}
    parent = lambda c: c.rpartition(".")[0]  # noqa: E731 - a cousin's own family must lack its partner
    return ([c for c in out if not any(parent(d) == parent(c) for d in into)],
            [c for c in into if not any(parent(d) == parent(c) for d in out)])


def _siblings(f: _Family) -> list[Finding]:
    """Colwise/Rowwise pairs among the direct children of ``f.parent``: ``unreduced`` is an
    unplanned Linear registered after Colwise siblings whose input width is their output width,
    when no Rowwise consumes their Shard(-1) outputs (q/k/v colwise, o_proj left out)."""
    findings: list[Finding] = []
    modules, specs, by_fqn = f.modules, f.specs, f.by_fqn
    join = (lambda n: f"{f.parent}.{n}") if f.parent else (lambda n: n)
    children = [join(n) for n, _ in modules[f.parent].named_children()]
    linears = [c for c in children if isinstance(modules[c], nn.Linear)]
    unplanned = [c for c in linears if c not in f.entries]
    planned = [c for c in linears if c in by_fqn]
    for axis in sorted({by_fqn[c].axis for c in planned}):
        mine = [c for c in planned if by_fqn[c].axis == axis]
        producers = [c for c in mine if c not in f.heads and isinstance(_placement(specs[c].out_dst, "output", axis), Shard)
                     and _placement(specs[c].out_dst, "output", axis).dim == -1]
        consumers = [c for c in mine if _placement(specs[c].in_src, 0, axis) == Shard(-1)]
        sharded = [c for c in mine if any(isinstance(pl.get(axis), Shard) for pl in specs[c].params.values())]
        flagged = set()
        cousins = _cousins(f, axis)  # BERT: query/key/value in attention.self, the rowwise dense in attention.output
        if consumers and not producers and cousins[0]:
            consumers = []
        if producers and not consumers:
            widths, first = {modules[c].out_features for c in producers}, min(children.index(c) for c in producers)
            culprits = [u for u in unplanned if modules[u].in_features in widths and children.index(u) > first]
            for u in culprits:
                findings.append(Finding(
                    Level.ERROR, u, f"{u} is left replicated (no plan entry) but consumes the Shard(-1) outputs of {producers}, "
                    "which nothing reduces: plan it Rowwise, or gather those outputs (gather_output=True)", "unreduced"))
            flagged.update(culprits)
            if not culprits and not cousins[1]:
                for c in producers:
                    findings.append(Finding(
                        Level.WARNING, c, f"{c}: its output stays sharded on the last dim (Colwise without gather_output) and "
                        "no sibling Rowwise consumes it", "sharded-output"))
        if consumers and not producers:
            for c in consumers:
                findings.append(Finding(
                    Level.WARNING, c, f"{c}: Rowwise expects its input sharded on the last dim but no sibling Colwise produces "
                    "it; use Rowwise(input_layout=Replicate()) to split a replicated input", "unsharded-input"))
        for u in unplanned:
            twin = next((c for c in sharded if modules[c].weight.shape == modules[u].weight.shape), None)
            if u not in flagged and twin is not None:
                findings.append(Finding(
                    Level.WARNING, u, f"{u} is left replicated while its sibling {twin} of the same shape is sharded; plan it "
                    "too, or plan it NoParallel() if that is meant", "replicated"))
        findings += _heads(f, producers, axis)
    return findings


def _heads(f: _Family, producers: list[str], axis: str) -> list[Finding]:
    """HF attention reshapes with ``-1`` and ``head_dim``: every rank needs whole heads (a producer of
    one value per head, as wide as the widest producer holds heads — LFM3's output gate — splits whole heads)."""
    head_dim = getattr(f.modules[f.parent], "head_dim", None)
    if not isinstance(head_dim, int) or head_dim <= 0 or (f.parent in f.specs and f.specs[f.parent].divide_attrs):
        return []
    n = f.mesh.size(list(f.mesh.mesh_dim_names).index(axis))
    heads = max((f.modules[c].out_features for c in producers), default=0) // head_dim
    findings = []
    for c in producers:
        out = f.modules[c].out_features
        if out == heads:
            continue  # one value per head
        weight = f.specs[c].params.get("weight", {}).get(axis)
        if getattr(f.by_fqn[c].style, "packed", None) or out % n or replica_group(weight) > 1:
            continue  # packed: not split by heads; indivisible dims raise ShapeError; KV heads replicated
        if (out // n) % head_dim:
            findings.append(Finding(
                Level.ERROR, c, f"{c}: {out} output features over {n} ranks of axis {axis!r} leave {out // n} per rank, not a "
                f"multiple of head_dim={head_dim} of {f.parent or 'the root'} (fewer heads than ranks)", "heads"))
    return findings
