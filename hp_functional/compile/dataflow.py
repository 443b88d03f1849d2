"""Pass: which replicated parameters does rank-varying data reach — wherever they sit.

The region analysis (``compile.regions``) sees the module tree; a parameter used *between*
planned modules (a per-head ``q_norm`` on a colwise ``q_proj``'s output, Apertus' xIELU scalars)
escapes it, and each rank would compute only its share of its gradient.  This pass follows the
data instead: one forward of a meta copy carrying, per tensor, the mesh axes on which it differs
per rank (JAX's varying type).  See docs/guarantees.md#exact-or-refused.
"""

from __future__ import annotations

__all__ = ["Unchecked", "synthesize_inputs", "trace_dataflow", "unchecked_in_regions"]

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn
from torch.distributed.tensor import Partial, Shard
from torch.overrides import TorchFunctionMode

from ..analysis.copies import to_meta
from ..analysis.recompute import watch_recomputed
from ..analysis.trace import _leaves
from ..core.errors import PlanError
from ..core.lowering import Step
from ..core.module_kinds import CONVS, is_conv1d
from ..core.placement import ShardInfo, splits
from ..core.program import Boundary, Planned
from ..core.signature import arg_slots, map_arguments
from ..core.style import ModuleSpec
from .reduced_copy import Reduced, plan_marks, reduced_copy
from .regions import Varying, consumer_axes, is_below


@dataclass(frozen=True)
class Dataflow:
    """The pass's result: ``varying_uses`` parameter FQN → axes on which rank-varying data
    reaches it; ``skipped`` the reason the forward could not be traced, None when it was."""

    varying_uses: dict[str, frozenset[str]]
    skipped: str | None = None  # None: traced
    #: leaf → axes of ``covered`` on which every traced use of it met data that does not vary there
    #: (GPT-NeoX-Japanese's ``dense_bias``: a parameter of the attention that the attention only
    #: returns, added to the residual stream after the rowwise reduce)
    unvarying: dict[str, frozenset[str]] = field(default_factory=dict)
    #: module path → the model's own code that recomputes its forward in the backward
    #: (``analysis.recompute``: Reformer's reversible layers)
    recomputed: dict[str, str] = field(default_factory=dict)


#: the first layers whose input ``synthesize_inputs`` can make: features of this width on the last dim
_FEATURES = (nn.Linear, nn.LayerNorm, nn.RMSNorm)


def synthesize_inputs(model: nn.Module, rows: int = 1, length: int = 8,
                      generator: torch.Generator | None = None) -> tuple[tuple, dict] | None:
    """A tiny batch the model's first layer takes — the first module with parameters, past the
    root's own (CLIP's ``logit_scale``) — else None: token ids ``[rows, length]`` for an
    ``nn.Embedding`` (``input_ids``, or the first positional argument; an encoder-decoder's
    ``decoder_input_ids`` the same ids, and ``labels`` with ``generator``), features
    ``[rows, length, width]`` for a ``Linear``/``LayerNorm``/``RMSNorm`` (``inputs_embeds`` where the
    forward takes it: a pipeline stage after the first; else the first positional argument).  Zeros
    without ``generator`` (a meta trace needs shapes), else random values."""
    first = next((m for name, m in model.named_modules() if name and any(True for _ in m.parameters(recurse=False))),
                 None)
    params = inspect.signature(model.forward).parameters
    if isinstance(first, nn.Embedding):
        ids = torch.zeros(rows, length, dtype=torch.long) if generator is None else \
            torch.randint(0, first.num_embeddings, (rows, length), generator=generator)
        if "input_ids" not in params:
            return (ids,), {}
        batch = {"input_ids": ids, **({"decoder_input_ids": ids} if "decoder_input_ids" in params else {})}
        return (), {**batch, **({"labels": ids} if generator is not None and "labels" in params else {})}
    if isinstance(first, _FEATURES) and params:
        width = first.in_features if isinstance(first, nn.Linear) else first.normalized_shape[-1]
        x = torch.zeros(rows, length, width) if generator is None else torch.randn(rows, length, width, generator=generator)
        x = x.to(next(first.parameters()).dtype)
        return ((), {"inputs_embeds": x}) if "inputs_embeds" in params else ((x,), {})
    return None


class _Taint(TorchFunctionMode):
    """Carries each tensor's varying axes through every torch function.  Data is what derives
    from the inputs; a value computed from parameters, buffers and constants alone
    (``softplus(alpha) + beta``, ``1 + weight``) stays *parameter-derived*, tagged with its
    parameters; when one meets data, ``varying`` records the axes of that data for them and
    ``invariant`` the replicated axes on which it does not vary."""

    def __init__(self, params: Mapping[int, tuple[str, frozenset[str]]], axes: Sequence[str]):
        super().__init__()
        self.params, self.axes = params, frozenset(axes)
        self.data: dict[int, frozenset[str]] = {}  # tensor id -> varying axes
        self.derived: dict[int, tuple[frozenset[str], frozenset[str]]] = {}  # id -> (params, their split axes)
        self.keep: list[Tensor] = []
        self.varying: dict[str, set[str]] = {}
        self.invariant: dict[str, set[str]] = {}
        self.scope: list[frozenset[str]] = [frozenset()]  # axes every value computed here varies on

    def _kind(self, t: Tensor) -> tuple[frozenset[str], frozenset[str]] | None:
        """(params, split axes) of a parameter-derived tensor, else None (data)."""
        p = self.params.get(id(t))
        return (frozenset({p[0]}), p[1]) if p else self.derived.get(id(t))

    def of(self, obj) -> frozenset[str]:
        """The varying axes of the data tensors in ``obj``."""
        out: frozenset[str] = frozenset()
        for t in _leaves(obj):
            if isinstance(t, Tensor) and id(t) in self.data:
                out |= self.data[id(t)]
        return out

    def set(self, obj, taint: frozenset[str]) -> None:
        for t in _leaves(obj):
            if isinstance(t, Tensor) and id(t) not in self.params:
                self.keep.append(t)
                self.derived.pop(id(t), None)
                self.data[id(t)] = taint

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [t for t in _leaves((args, kwargs)) if isinstance(t, Tensor)]
        data = [t for t in tensors if id(t) in self.data]  # derived from the inputs
        derived = [k for t in tensors if (k := self._kind(t)) is not None]  # buffers and constants: neither
        if not data and not derived:
            return out
        if not data:  # parameters (and constants) only: the result is parameter-derived too
            params = frozenset().union(*(k[0] for k in derived))
            split = frozenset().union(*(k[1] for k in derived))
            for t in _leaves(out):
                if isinstance(t, Tensor) and id(t) not in self.params:
                    self.keep.append(t)
                    self.derived[id(t)] = (params, split)
            return out
        met = self.of(data) | self.scope[-1] | frozenset().union(*(k[1] for k in derived))
        for params, split in derived:
            for key in params:
                replicated = self.axes - split
                self.varying.setdefault(key, set()).update(met & replicated)
                self.invariant.setdefault(key, set()).update(replicated - met)
        self.set(out, met)
        return out


def trace_dataflow(model: nn.Module, boundaries: Sequence[Boundary], analysis: Mapping[str, Varying],
                   infos: Mapping[str, ShardInfo], leaf_of: Mapping[str, str], axes: Sequence[str],
                   covered: Mapping[str, set[str]], inputs: tuple[tuple, dict] | None = None, *,
                   real: bool = False, whole: Mapping[str, frozenset[str]] | None = None) -> Dataflow:
    """The varying uses of every parameter: one forward (global shapes, a synthesized batch,
    nothing communicated) carrying each tensor's varying axes, where

    * a parameter stored sharded on an axis is varying there, so is everything computed from it;
    * a planned module's output leaves varying on an axis where its boundary hands it on sharded
      or partial, and invariant where it reduces or gathers it (a rowwise all-reduce); a style
      with a forward of its own (``Local``, ``Experts``: ``own_forward`` False) hands its outputs
      on varying only as its inputs did (its function communicates as it declares, which the
      module's own forward traced here does not show);
    * an input a boundary splits (``in_dst`` sharded) and the data below a data-splitting module
      (``ModuleSpec.data_axes``) are varying on those axes.

    Every op that takes a replicated parameter together with data varying on an axis makes that
    parameter's gradient a per-rank share there.  A replicated parameter used both with varying
    and with invariant data on an axis that the module tree does not already decide raises
    ``PlanError`` (one conversion cannot give both uses their gradient).  Where no batch can be
    synthesized or the forward fails, the result is empty with the reason in ``skipped`` (None
    when it ran), and ``shard()``'s numeric probe is what checks the plan.  ``covered``: leaf →
    axes its conversions already have; ``real``: run ``model`` itself on real tensors (a private
    probe copy) instead of a meta copy."""
    inputs = inputs or synthesize_inputs(model)
    if inputs is None:
        return Dataflow({}, f"{type(model).__name__} does not start with an embedding or a linear layer: no batch to trace")
    reduced = Reduced(model, {}) if real else reduced_copy(model, plan_marks(boundaries, infos, leaf_of), inputs)
    mode = _Taint(_stored_axes(reduced, infos, leaf_of, axes, whole or {}), list(axes))
    args, kwargs = (inputs if real else (to_meta(inputs[0]), to_meta(inputs[1])))
    mode.set((args, kwargs), frozenset())
    handles = _hook_boundaries(reduced, boundaries, analysis, mode)
    recomputed, unwatch = watch_recomputed(reduced.model)
    try:
        with torch.no_grad(), mode:
            reduced.model(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - meta-hostile code, or a forward that does not take token ids: reported
        where = "real" if real else "meta"
        return Dataflow({}, f"one forward on {where} tensors failed ({type(exc).__name__}: {str(exc)[:120]})",
                        recomputed=recomputed)
    finally:
        unwatch()
        for h in handles:
            h.remove()
    return replace(_uses(mode, reduced, leaf_of, covered, analysis), recomputed=recomputed)


def _stored_axes(reduced: Reduced, infos: Mapping[str, ShardInfo], leaf_of: Mapping[str, str], axes: Sequence[str],
                 whole: Mapping[str, frozenset[str]]) -> dict[int, tuple[str, frozenset[str]]]:
    """``id`` of each parameter of the traced copy -> (its name there, the mesh axes it is used sharded on: stored
    sharded, less those its conversions gather whole before the forward, ``whole``: ``ShardedParams``)."""
    params: dict[int, tuple[str, frozenset[str]]] = {}
    for name, prm in reduced.model.named_parameters(remove_duplicate=False):
        original = reduced.names.get(name, [name])
        key = leaf_of[original[0]]
        info = infos[key]
        stored = frozenset(a for a, p in zip(axes, info.placements, strict=True) if splits(p)) - whole.get(key, frozenset())
        params.setdefault(id(prm), (name, stored))
    return params


def _hook_boundaries(reduced: Reduced, boundaries: Sequence[Boundary], analysis: Mapping[str, Varying],
                     mode: _Taint) -> list:
    """The hooks (``_hooks``) on the traced copy's planned modules, one block of each kind standing for the
    others; the handles, for the caller to remove."""
    modules = dict(reduced.model.named_modules())
    hooked: dict[str, Boundary] = {}
    for b in boundaries:
        path = _reduced_path(b.planned.fqn, reduced)
        if path is not None and path in modules:
            hooked.setdefault(path, b)
    return [h for path, b in hooked.items() for h in _hooks(modules[path], b, analysis[b.planned.fqn], mode)]


def _uses(mode: _Taint, reduced: Reduced, leaf_of: Mapping[str, str], covered: Mapping[str, set[str]],
          analysis: Mapping[str, Varying]) -> Dataflow:
    """The traced uses mapped back to the model's leaves as a ``Dataflow``, or a ``PlanError`` for a replicated
    parameter used both with varying and with invariant data on an axis the module tree does not decide."""
    varying = {leaf_of[o]: v for k, v in mode.varying.items() for o in reduced.names.get(k, [k])}
    invariant = {leaf_of[o]: v for k, v in mode.invariant.items() for o in reduced.names.get(k, [k])}
    mixed = _mixed_uses(varying, invariant, covered, leaf_of, analysis)
    for key, both in mixed.items():
        if both:
            raise PlanError(f"parameter {key} is used both with data that differs per rank and with data that does not "
                            f"on mesh axis {sorted(both)[0]!r}: no single conversion gives both uses their gradient; "
                            "plan its module (e.g. NoParallel or a style that shards it) or keep it out of the "
                            "sharded region")
    unvarying = {k: frozenset((covered[k] & invariant[k]) - varying.get(k, set())) for k in covered if k in invariant}
    return Dataflow({k: frozenset(v) for k, v in varying.items() if v}, unvarying={k: v for k, v in unvarying.items() if v})


def _mixed_uses(varying: Mapping[str, set[str]], invariant: Mapping[str, set[str]], covered: Mapping[str, set[str]],
                leaf_of: Mapping[str, str], analysis: Mapping[str, Varying]) -> dict[str, set[str]]:
    """Leaf → the axes on which it is used both with data that varies and with data that does not,
    where no conversion can give both uses their gradient: those the module tree does not decide
    (``covered``), and those it decides only from the module's own rank-varying compute outside any
    region (a head-split module's parameter: the trace's verdict, ``Dataflow.unvarying``, decides
    there, and a use on each side needs the reduction for one and not for the other).  Inside a
    region every value's gradient is a per-rank share, whatever data it meets."""
    out = {}
    for key, v in varying.items():
        both = v & invariant.get(key, set())
        decided = both & covered.get(key, set())
        if decided:  # rare: only then look for the leaf's modules
            owners = {n.rpartition(".")[0] for n, leaf in leaf_of.items() if leaf == key}
            decided -= set().union(*(consumer_axes(o, analysis) - consumer_axes(o, analysis, frozenset(decided))
                                     for o in owners))
        out[key] = both - decided
    return out


def _reduced_path(fqn: str, reduced: Reduced) -> str | None:
    """The path in the reduced copy of original module ``fqn`` (None: its block was dropped, a
    kept block of the same kind stands for it)."""
    if not reduced.names or not fqn:
        return fqn
    for copy_name, originals in reduced.names.items():
        for o in originals:
            if o.startswith(fqn + ".") or o == fqn:
                rest = o[len(fqn):]
                if copy_name.endswith(rest):
                    return copy_name[: len(copy_name) - len(rest)] if rest else copy_name
    return None


def _invariant_after(steps: Sequence[Step]) -> frozenset[str]:
    """The axes on which ``steps`` hand the value on identical on every rank: their collective's
    type ends rank-invariant (V→I: reduced, gathered or leaving a region)."""
    return frozenset(s.axis for s in steps if s.collective.makes_invariant)


def _split_after(steps: Sequence[Step]) -> frozenset[str]:
    """The axes on which ``steps`` hand the value on split across the ranks: placed ``Shard`` or
    ``Partial`` after it (split, partial, all-to-all, reduce-scatter).  The type column cannot say
    this: a value handed on ``Replicate`` to rank-varying compute (an all-gather's, an all-reduce's,
    an entry's identity) is typed rank-varying too, yet equal on every rank; it keeps the axes it had."""
    return frozenset(s.axis for s in steps if isinstance(s.dst, (Shard, Partial)))


def _hooks(module: nn.Module, b: Boundary, v: Varying, mode: _Taint) -> tuple:
    """Hooks on one planned module of the twin: each input enters as its boundary converts it
    (invariant on an axis it is gathered or reduced over, varying on one it is split over);
    everything inside varies on the module's ``data_axes``; each output leaves invariant on an
    axis where the boundary reduces or gathers it, varying where it splits it, else as computed."""
    # each argument: the axes it arrives split on (``in_src``: each rank was handed its share), then the
    # axes its steps make it invariant on, and those they split it over
    ins = {k: (frozenset(a for a, p in b.spec.in_src.get(k, {}).items() if splits(p)),
               _invariant_after(b.in_steps.get(k, ())), _split_after(b.in_steps.get(k, ())))
           for k in {*b.in_steps, *b.spec.in_src}}
    out_steps = [s for steps in b.out_steps.values() for s in steps]
    reduced, split_out = _invariant_after(out_steps), _split_after(out_steps)

    slots = arg_slots(module.forward, list(ins), b.planned.fqn) if ins else []

    def entering(slot, t):
        if not isinstance(t, Tensor):
            return t
        if id(t) not in mode.data:
            kind = mode._kind(t)
            if kind is None:
                return t
            arrived, invariant, split = ins[slot.key]
            alias = t.view_as(t)  # parameter-derived: converted at the boundary all the same
            mode.keep.append(alias)
            mode.derived[id(alias)] = (kind[0], (kind[1] - invariant) | split)
            return alias
        arrived, invariant, split = ins[slot.key]
        alias = t.view_as(t)
        mode.set(alias, ((mode.data[id(t)] | arrived) - invariant) | split)
        return alias

    def pre(_module, args, kwargs):
        mode.scope.append(mode.scope[-1] | v.data)
        if not slots:
            return None
        args, kwargs = map_arguments(slots, args, dict(kwargs), entering)
        return tuple(args), kwargs

    local = not b.planned.style.own_forward

    def post(_module, args, kwargs, output):
        mode.scope.pop()
        out = output.view_as(output) if isinstance(output, Tensor) else output
        entered = mode.of((args, kwargs))
        for t, o in zip(_leaves(output), _leaves(out), strict=True):  # each output as computed, then the boundary
            if isinstance(t, Tensor) and id(t) in mode.data:
                # a Local's fn makes its outputs what it declares with its own collectives (the module's own
                # forward traced here does not): they vary only as its inputs did, or where declared split
                mode.set(o, ((entered if local else mode.data[id(t)]) - reduced) | split_out)
            elif isinstance(t, Tensor) and (kind := mode._kind(t)) is not None:
                # computed from parameters and constants alone (MarkupLM's xpath embeddings of constant ids): the
                # boundary reduces or splits it all the same
                mode.keep.append(o)
                mode.derived[id(o)] = (kind[0], (kind[1] - reduced) | split_out)
        return out

    return (module.register_forward_pre_hook(pre, with_kwargs=True),
            module.register_forward_hook(post, with_kwargs=True))


@dataclass(frozen=True)
class Unchecked:
    """A module this pass would have had to trace: not planned, inside the planned ``region``, holding
    ``params`` (FQNs) replicated and unreduced on ``axis`` that need not see the region's replicated data."""

    module: str
    region: str
    axis: str
    params: tuple[str, ...]


def _widths(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of a Linear or HF Conv1D (weight stored ``[in, out]``), (in, out)
    channels of a convolution, else None."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, CONVS):
        return module.in_channels, module.out_channels
    if is_conv1d(module):
        return tuple(module.weight.shape)
    return None


def _innermost_first(item) -> tuple:
    (region, axis), _ = item
    return -(region.count(".") + bool(region)), region, axis


def unchecked_in_regions(model: nn.Module, boundaries: Sequence[Boundary], infos: Mapping[str, ShardInfo],
                         leaf_of: Mapping[str, str], param_steps: Mapping[str, Sequence[Step]]) -> list[Unchecked]:
    """What only this pass (or ``shard()``'s probe) can clear, for a model it could not trace: every
    module that is not planned, sits inside (or is, or encloses) a planned region — the parent of planned projections whose
    output stays sharded or whose input arrives sharded (``lint_heads.audit_regions``' notion, less a
    rowwise projection that splits a replicated input at its own entry: nothing sharded leaves it) — and
    holds parameters that stay replicated on the region's axis with no gradient reduction there.  Such
    a module may see each rank's share of the heads (a per-head q/k norm between a colwise projection
    and the attention), whose gradient is then a per-rank share that nothing reduces.

    A module whose parameters' last dim is a width the region's data has while replicated — the input
    of one of its colwise projections, the output of one of its rowwise ones (a pre-norm beside an MLP
    in one layer module, Whisper's layer norms) — is presumed to see that data and is not listed: a
    per-head norm's width is a head's, a fraction of the projection's.  Modules under a planned module
    that computes with a function of its own (``Local``, ``Experts``) are that style's to reduce."""
    planned: dict[str, Planned] = {b.planned.fqn: b.planned for b in boundaries}
    specs: dict[str, ModuleSpec] = {b.planned.fqn: b.spec for b in boundaries}
    regions: dict[tuple[str, str], set[int]] = {}  # (parent, axis) -> widths of its replicated data
    for fqn, p in planned.items():
        widths = _widths(p.module)
        spec = specs[fqn]
        if not fqn or widths is None or not any(splits(pl.get(p.axis)) for pl in spec.params.values()):
            continue
        # what arrives split (a rowwise after a colwise, sequence parallelism), not what its own entry splits
        split_in = any(splits(pl.get(p.axis)) for pl in spec.in_src.values())
        split_out = splits(spec.out_dst.get("output", spec.out_src.get("output", {})).get(p.axis))
        if not (split_in or split_out):
            continue
        replicated = regions.setdefault((fqn.rpartition(".")[0], p.axis), set())
        replicated |= {w for w, split in zip(widths, (split_in, split_out), strict=True) if not split}
    own = [f for f, p in planned.items() if not p.style.own_forward]
    found: list[Unchecked] = []
    for name, module in model.named_modules():
        if name in planned or any(name == f or is_below(name, f) for f in own):
            continue
        for (region, axis), widths in sorted(regions.items(), key=_innermost_first):
            # inside the region, the region itself, or above it: a parameter of an enclosing module (MLCD's root-level
            # class_pos_emb, joined to the rotary table its attention rotates head-sharded queries with) reaches it too
            near = is_below(name, region) or name == region or not name or is_below(region, name)
            if not near or any(is_below(region, f) or region == f for f in own):
                continue
            at_risk = []
            for pname, prm in module.named_parameters(recurse=False):
                full = f"{name}.{pname}" if name else pname
                leaf = leaf_of.get(full)
                if leaf is None or splits(infos[leaf].axes.get(axis)):
                    continue
                if any(s.axis == axis for s in param_steps.get(leaf, ())):
                    continue  # its gradient is already reduced (or converted) on this axis
                seen = module.in_channels if isinstance(module, CONVS) else prm.shape[-1] if prm.dim() >= 1 else None
                if seen in widths:
                    continue  # the width (a convolution: channels) of the region's replicated data: presumed to see it
                at_risk.append(full)
            if at_risk:
                found.append(Unchecked(name, region, axis, tuple(at_risk)))
                break
    return found
