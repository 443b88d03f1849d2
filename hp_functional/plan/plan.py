"""``ShardingPlan``: module-path patterns → styles, resolved against a model.

Patterns are dot paths where ``*`` matches exactly one segment (``model.layers.*.mlp``).  A
module matched by several patterns takes the most specific one (fewest ``*``); two equally
specific patterns with different styles are an error naming both.  Resolution is pure: the
model and the plan object are only read.
"""

from __future__ import annotations

__all__ = ["ShardingPlan", "_as_style", "as_plan"]

import difflib
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, fields, replace

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from ..core.cp_layout import check_layout
from ..core.errors import PlanError
from ..core.paths import Candidate, most_specific, path_matches
from ..core.program import Planned
from ..core.style import ModuleSpec, ParamHandler, ParamRule, Style, default_handlers
from ..parallel.context.inputs import ContextInputs
from ..parallel.context.styles import (
    ContextParallel,
    attention_patterns,
    check_context_entries,
    check_context_shadowed,
    context_parallel_root,
)
from ..parallel.experts.styles import check_experts_entries, hf_ep_entries
from ..parallel.tensor.styles import Colwise
from ..parallel.tensor.vocab import loss_parallel_root
from ..sources.hf import HF_STYLES, hf_entries, tp_experts
from ..sources.torch_styles import ParallelStyle, from_torch_style


def _as_style(value: object, where: str) -> Style:
    if isinstance(value, Style):
        return value
    if isinstance(value, str):
        if value not in HF_STYLES:
            raise PlanError(f"{where}: style {value!r} is not supported (supported: {sorted(HF_STYLES)})")
        return HF_STYLES[value]
    if isinstance(value, ParallelStyle):  # torch's own (parallelize_module's), converted once here
        return from_torch_style(value, where)
    raise PlanError(f"{where}: {value!r} is not a style, a ModuleSpec, an HF style string or a torch ParallelStyle")


@dataclass(frozen=True, eq=False)
class ShardingPlan:
    """Which style applies to which modules, and on which mesh axis (``tp_axis`` by default).

    ``cp_axis``: the mesh axis the sequence is sharded over (context parallelism, ``parallel.context.styles``):
    the plan's ``ContextParallel`` entries act on it and a root entry shards the batch in
    ``cp_layout`` (``"zigzag"`` or ``"contiguous"``); that root knows HF's arguments, and
    ``cp_inputs`` (``ContextInputs``) declares another model's sequence, positions and loss
    instead (``parallel.context.inputs``).  ``ep_axis``: the mesh axis routed experts
    are sharded over (``Experts`` entries, ``parallel.experts.styles``).  ``tp_optional``: entries on
    ``tp_axis`` are dropped when the mesh has no such axis (``from_hf`` with ``cp_axis`` or
    ``ep_axis``: CP or EP alone on a mesh without ``tp``).  ``special_handlers``: parameter-path
    pattern → the name of a handler in ``handlers`` (``parallel.tensor.styles.default_handlers``).
    ``unplanned``: HF pattern → why ``from_hf`` left it unplanned.

    A frozen dataclass: its fields are data, checked once when it is made (each parallelism's
    rule in its own module: ``context.check_context_entries``, ``experts.check_experts_entries``);
    ``dataclasses.replace`` / ``with_entries`` make a new one."""

    entries: Mapping[str, Style | str]
    tp_axis: str = "tp"
    _: KW_ONLY
    loss_parallel: bool = False
    cp_axis: str | None = None
    cp_layout: str = "zigzag"
    cp_inputs: ContextInputs | None = None
    ep_axis: str | None = None
    tp_optional: bool = False
    special_handlers: Mapping[str, str] | None = None
    handlers: Mapping[str, ParamHandler] | None = None
    unplanned: Mapping[str, str] | None = None

    def __post_init__(self):
        entries = {pattern: _as_style(style, f"plan entry {pattern!r}") for pattern, style in self.entries.items()}
        layout = check_layout(self.cp_layout)
        entries = check_context_entries(entries, self.cp_axis, layout)
        check_experts_entries(entries, self.ep_axis)
        handlers = dict(self.handlers) if self.handlers is not None else default_handlers()
        special = dict(self.special_handlers or {})
        for pattern, name in special.items():
            if name not in handlers:
                raise PlanError(f"special handler {name!r} for {pattern!r} is not registered (have {sorted(handlers)})")
        for name, value in (("entries", entries), ("cp_layout", layout), ("handlers", handlers),
                            ("special_handlers", special), ("unplanned", dict(self.unplanned or {}))):
            object.__setattr__(self, name, value)

    def param_rules(self, model: nn.Module) -> dict[str, ParamRule]:
        """Parameter FQN -> the rule its special handler decides (patterns must match something)."""
        rules = {}
        for pattern, name in self.special_handlers.items():
            hits = [(n, p) for n, p in model.named_parameters(remove_duplicate=False) if path_matches(pattern, n)]
            if not hits:
                raise PlanError(f"special handler pattern {pattern!r} matches no parameter")
            for n, p in hits:
                rule = self.handlers[name](p, n)
                if not isinstance(rule, ParamRule):
                    raise PlanError(f"special handler {name!r} returned {rule!r} for {n}, not a ParamRule")
                rules[n] = rule
        return rules

    def with_entries(self, entries: Mapping[str, Style | str], **changes) -> ShardingPlan:
        """A new ``ShardingPlan`` of ``entries`` with this plan's settings (``changes`` override
        them); a subclass's own fields (``AutoPlan``'s report) are not carried over."""
        settings = {f.name: getattr(self, f.name) for f in fields(ShardingPlan) if f.init and f.name != "entries"}
        return ShardingPlan(entries, **{**settings, **changes})

    @classmethod
    def from_hf(cls, model: nn.Module, tp_axis: str = "tp", *, loss_parallel: bool = False, cp_axis: str | None = None,
                cp_strategy: str = "ring", cp_layout: str = "zigzag", ep_axis: str | None = None,
                ep_tokens: str = "replicated") -> ShardingPlan:
        """The plan a Hugging Face model declares (``model._tp_plan``, else the config's
        ``base_model_tp_plan`` under ``base_model_prefix``).  An unsupported HF style raises
        naming the style and the module pattern.

        HF's entries are read as transformers applies them (``sources.hf.hf_entries``):
        parameter entries go to their module's ``local_params``/``moe_tp_experts`` entry, an
        entry that matches nothing in this model is dropped and noted (``explain()``); without
        ``ep_axis`` the routed experts HF leaves whole get TP inside them (``tp_experts``).

        Args:
            model: the HF model; only read.
            tp_axis: the mesh axis of HF's TP entries; with ``cp_axis`` or ``ep_axis`` they apply only when
                the mesh has it.
            loss_parallel: keep the logits vocab-sharded and compute HF's causal-LM loss on them.
            cp_axis: context parallelism too: ``ContextParallel(cp_strategy)`` on every attention module.
            cp_strategy: ``"ring"`` or ``"allgather"`` (``ContextParallel``).
            cp_layout: how the sequence is cut over ``cp_axis``: ``"zigzag"`` (load-balanced) or ``"contiguous"``.
            ep_axis: expert parallelism too, from the config's ``base_model_ep_plan`` (``parallel.experts.styles.hf_ep_entries``:
                ``Experts`` on the routed experts, TP on shared experts).
            ep_tokens: ``"replicated"`` (the ep ranks hold one batch) or ``"local"`` (``ep`` shares ranks with
                ``dp``: ``Experts(tokens=)``).
        Returns:
            a new ``ShardingPlan`` (a ``PlanError`` when the model declares no plan and ``cp_axis`` is None)."""
        raw = dict(getattr(model, "_tp_plan", None) or {})
        prefix = getattr(model, "base_model_prefix", "")
        prefix = f"{prefix}." if prefix and hasattr(model, prefix) else ""
        if not raw:
            base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
            raw = {prefix + k: v for k, v in base.items()}
        raw, unplanned = hf_entries(model, raw)
        if ep_axis is not None:
            raw = hf_ep_entries(model, raw, tp_axis, ep_tokens)
        else:
            ep_plan = getattr(getattr(model, "config", None), "base_model_ep_plan", None) or {}
            raw.update(tp_experts(model, raw, ep_plan, prefix, unplanned))
        if not raw and cp_axis is None:
            dropped = f" (its entries match nothing here: {sorted(unplanned)})" if unplanned else ""
            raise PlanError(f"{type(model).__name__} declares no tp_plan (neither _tp_plan nor config.base_model_tp_plan)"
                            f"{dropped}")
        if cp_axis is not None:
            attention = attention_patterns(model)
            if not attention:
                raise PlanError(f"cp_axis={cp_axis!r}: {type(model).__name__} has no attention module (a module class "
                                "named *Attention with an is_causal attribute) to plan ContextParallel on")
            raw.update(dict.fromkeys(attention, ContextParallel(cp_strategy)))
        return cls(raw, tp_axis=tp_axis, loss_parallel=loss_parallel, cp_axis=cp_axis, cp_layout=cp_layout,
                   ep_axis=ep_axis, tp_optional=cp_axis is not None or ep_axis is not None, unplanned=unplanned)

    def explain(self) -> str:
        """The plan's entries, one per line, and what ``from_hf`` dropped or left whole and why."""
        lines = [f"{pattern or '<root>'}: {style}" for pattern, style in self.entries.items()]
        lines += [f"not planned: {pattern}: {why}" for pattern, why in self.unplanned.items()]
        return "\n".join(lines)

    @classmethod
    def from_torch(cls, plan: Mapping[str, ParallelStyle] | ParallelStyle, tp_axis: str = "tp", *,
                   loss_parallel: bool = False, ep_axis: str | None = None, ep_tokens: str = "replicated") -> ShardingPlan:
        """The plan a ``parallelize_module(model, mesh, plan)`` call states: torch's styles
        (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``, ``PrepareModuleInput``,
        ``PrepareModuleOutput``, ``PrepareModuleInputOutput``) and torchtitan's ``NoParallel`` and
        MoE styles, recognised by their shape (``sources.torch_moe_styles``).  A style or layout that
        cannot be expressed raises naming the pattern and the style (``sources.torch_styles``).

        Args:
            plan: ``parallelize_module``'s plan, ``{pattern: style}`` (other values, this library's styles or
                HF strings, are kept), or one style alone, meaning the root module.
            tp_axis: the mesh axis ``parallelize_module`` was given.
            loss_parallel: keep the logits vocab-sharded and compute HF's causal-LM loss on them.
            ep_axis: the mesh axis the expert-parallel styles were given.
            ep_tokens: ``"replicated"`` (the ep ranks hold one batch) or ``"local"`` (each its own).
        Returns:
            a new ``ShardingPlan`` with every torch style converted once."""
        entries = {"": plan} if isinstance(plan, ParallelStyle) else plan
        entries = {p: from_torch_style(s, f"plan entry {p!r}", tp_axis=tp_axis, ep_tokens=ep_tokens)
                   if isinstance(s, ParallelStyle) else s for p, s in entries.items()}
        return cls(entries, tp_axis=tp_axis, loss_parallel=loss_parallel, ep_axis=ep_axis)

    def resolve(self, model: nn.Module, mesh: DeviceMesh) -> list[Planned]:
        """Every planned module in ``model.named_modules()`` order; raises PlanError on a pattern
        that matches nothing (with the closest paths), an unknown axis, or a conflict."""
        names = mesh.mesh_dim_names or ()
        modules = dict(model.named_modules())
        for what, axis in (("cp_axis", self.cp_axis), ("ep_axis", self.ep_axis)):
            if axis is not None and axis not in names:
                raise PlanError(f"{what}={axis!r} is not in the mesh (axes: {list(names)})")
        for pattern, style in self._entries(names).items():
            if isinstance(style, ModuleSpec):
                bad = (style.axes or {self.tp_axis}) - set(names)  # a spec naming no axis acts on tp_axis
            else:  # a Local may also name other axes in its layouts
                bad = ({self.axis_of(style, names)} | getattr(style, "named_axes", set())) - set(names)
            if bad:
                axis = sorted(bad)[0]
                hint = (f"; the plan acts on tp_axis={axis!r}: name the mesh's tensor-parallel axis with "
                        f"ShardingPlan(..., tp_axis=...) or ShardingPlan.from_hf(model, tp_axis=...)"
                        if axis == self.tp_axis else "")
                raise PlanError(f"plan entry {pattern!r}: mesh axis {axis!r} is not in the mesh (axes: {list(names)}){hint}")
        candidates = self.candidates(model, names)
        hit = {c.pattern for cands in candidates.values() for c in cands}
        for pattern in self._entries(names):
            if pattern not in hit:
                close = difflib.get_close_matches(pattern, [p for p in modules if p], n=3, cutoff=0.5)
                raise PlanError(f"plan entry {pattern!r} matches no module; closest paths: {close}")
        chosen = {path: most_specific(path, cands) for path, cands in candidates.items()}
        check_context_shadowed(candidates, chosen)
        head = self.loss_head(model) if self.loss_parallel else None
        vocab_axis = None
        if head is not None and head in chosen:  # the entry that wins the head, as for every module
            vocab_axis = self.axis_of(chosen[head][1], names)
        out = []
        root = self._root(vocab_axis)
        if root is not None:  # the loss (and, under CP, the batch's sharding) in a Local entry on the root
            if "" in chosen:
                raise PlanError(f"{root.pattern} computes the loss in a Local entry on the root module, which the "
                                f"plan already plans ({chosen[''][0]!r}: {chosen[''][1]}); drop that entry")
            out.append(Planned("", model, root.style, root.axis, root.pattern))
        for path, module in modules.items():
            if path in chosen:
                pattern, style = chosen[path]
                axis = self.axis_of(style, names)
                if path == head:  # loss parallel: the head keeps its logits vocab-sharded
                    style = replace(style, gather_output=False, output_layout=Shard(-1))
                out.append(Planned(path, module, style.on_mesh(tuple(names)), axis, pattern))
        return out

    def _root(self, vocab_axis: str | None) -> Planned | None:
        """The root entry the plan adds (module and path filled in by ``resolve``): CP's, which
        also computes the vocab-parallel loss, or loss parallel's alone."""
        if self.cp_axis is not None:
            root = context_parallel_root if self.cp_inputs is None else self.cp_inputs.root
            style = root(self.cp_axis, self.cp_layout, vocab_axis)
            return Planned("", None, style, self.cp_axis, "(context_parallel)")
        if vocab_axis is not None:
            return Planned("", None, loss_parallel_root(vocab_axis), vocab_axis, "(loss_parallel)")
        return None

    def _entries(self, names) -> dict[str, Style]:
        """The entries that apply on a mesh with axes ``names`` (``tp_optional``: those on a missing
        ``tp_axis`` are dropped)."""
        if not self.tp_optional or self.tp_axis in names:
            return self.entries
        return {p: s for p, s in self.entries.items() if self.axis_of(s, names) != self.tp_axis}

    def candidates(self, model: nn.Module, names=None) -> dict[str, list[Candidate]]:
        """Module path → every entry whose pattern matches it (on a mesh with axes ``names``)."""
        out: dict[str, list[Candidate]] = {}
        entries = self.entries if names is None else self._entries(names)
        for path in dict(model.named_modules()):
            for pattern, style in entries.items():
                if path_matches(pattern, path):
                    out.setdefault(path, []).append(Candidate(pattern.count("*"), pattern, style))
        return out

    def axis_of(self, style: Style, names: tuple[str, ...] = ()) -> str | None:
        """The mesh axis a style acts on (the one rule): its own ``axis=``, else the plan's axis
        for its role (``tp_axis``, ``cp_axis``, ``ep_axis``); a ModuleSpec on a mesh (``names``)
        without ``tp_axis`` names its axes itself (the first of the mesh's it names)."""
        if isinstance(style, ModuleSpec) and names and self.tp_axis not in names and style.axes:
            return next(a for a in names if a in style.axes)
        return getattr(style, "axis", None) or self.role_axes()[style.axis_role]

    def role_axes(self) -> dict[str, str | None]:
        """Each style role's mesh axis: ``{"tp": tp_axis, "cp": cp_axis, "ep": ep_axis}``."""
        return {"tp": self.tp_axis, "cp": self.cp_axis, "ep": self.ep_axis}

    def axes(self) -> set[str]:
        """Every mesh axis the plan acts on: its styles' and its roles'."""
        return {a for a in (*map(self.axis_of, self.entries.values()), *self.role_axes().values()) if a}


    def loss_head(self, model: nn.Module) -> str:
        """The FQN of the output head whose logits stay vocab-sharded under ``loss_parallel``."""
        get = getattr(model, "get_output_embeddings", None)
        head = get() if get else None
        path = next((n for n, m in model.named_modules() if head is not None and m is head), None)
        if path is None:
            raise PlanError(f"loss_parallel: {type(model).__name__} has no output head (get_output_embeddings())")
        cands = self.candidates(model).get(path)
        if not cands or not isinstance(most_specific(path, cands)[1], Colwise):  # the entry resolve() applies
            raise PlanError(f"loss_parallel: the output head {path!r} must be planned Colwise (vocab-sharded)")
        return path


def as_plan(plan: ShardingPlan | Mapping) -> ShardingPlan:
    """``plan`` itself, or a plain ``{pattern: style}`` dict as a ``ShardingPlan`` (``tp_axis="tp"``)."""
    return plan if isinstance(plan, ShardingPlan) else ShardingPlan(plan)
