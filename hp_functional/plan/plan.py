"""``ShardingPlan``: the plan language — module-path patterns → styles, the mesh axis of each role,
settings and special parameter handlers — resolved against a model.

Patterns follow the one rule of ``core.paths`` (``*`` matches exactly one segment; the most specific
pattern wins; two equally specific patterns with different styles are an error naming both).  The
plan knows no parallelism by name: each one in ``parallelisms`` (``parallel.PARALLELISMS``) checks
its entries and settings, checks the mesh and adds its part when the plan is resolved
(``core.parallelism``).  Resolution is pure: the model and the plan object are only read.
"""

from __future__ import annotations

__all__ = ["ShardingPlan", "_as_style", "as_plan"]

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..core.errors import PlanError
from ..core.parallelism import Parallelism, Resolution
from ..core.paths import Candidate, most_specific, path_matches
from ..core.program import Planned
from ..core.style import ModuleSpec, ParamHandler, ParamRule, Style, default_handlers
from ..parallel import PARALLELISMS
from ..sources.hf import HF_STYLES, hf_plan
from ..sources.torch_styles import ParallelStyle, from_torch_style
from ..sources.torchtitan import torchtitan_entries

#: The role a style acts on when it names none, and the role of ``ShardingPlan``'s second positional argument.
DEFAULT_ROLE = "tp"


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


@dataclass(frozen=True, eq=False, init=False)
class ShardingPlan:
    """Which style applies to which modules, and on which mesh axis.

    ``entries``: module-path pattern → style (a ``Style``, an HF style string or a torch
    ``ParallelStyle``, converted once).  ``axes``: each role's mesh axis — a style acts on its own
    ``axis=`` or on ``axes[style.axis_role]`` (``{"tp": "tp"}`` by default; context parallelism's
    ``"cp"``, expert parallelism's ``"ep"``).  ``settings``: the parallelisms' settings by name
    (``loss_parallel``, ``cp_layout``, ``cp_inputs``, ...; each owned by one parallelism, with its
    default).  ``optional_roles``: roles whose entries are dropped on a mesh without their axis
    (``from_hf`` with ``cp_axis`` or ``ep_axis``: CP or EP alone on a mesh without ``tp``).
    ``special_handlers``: parameter-path pattern → the name of a handler in ``handlers``
    (``core.style.default_handlers``).  ``unplanned``: HF pattern → why ``from_hf`` left it
    unplanned.  ``parallelisms``: the plug-ins that check and complete the plan
    (``parallel.PARALLELISMS``; a new one is added there, or passed here).

    A frozen dataclass: its fields are data, checked once when it is made; ``with_entries`` and
    ``dataclasses.replace`` make a new one.

    >>> hpf.ShardingPlan({"model.layers.*.self_attn": hpf.ContextParallel()}, axes={"cp": "cp"})
    """

    entries: Mapping[str, Style]
    axes: Mapping[str, str]
    settings: Mapping[str, object]
    optional_roles: frozenset[str]
    special_handlers: Mapping[str, str]
    handlers: Mapping[str, ParamHandler]
    unplanned: Mapping[str, str]
    parallelisms: tuple[Parallelism, ...]

    def __init__(self, entries: Mapping[str, Style | str], axes: Mapping[str, str] | None = None, *,
                 settings: Mapping[str, object] | None = None, optional_roles=(),
                 special_handlers: Mapping[str, str] | None = None, handlers: Mapping[str, ParamHandler] | None = None,
                 unplanned: Mapping[str, str] | None = None, parallelisms: tuple[Parallelism, ...] | None = None) -> None:
        parallelisms = tuple(PARALLELISMS if parallelisms is None else parallelisms)
        if isinstance(axes, str):  # a bare axis name is not a role mapping: say which one it would be
            raise PlanError(f"ShardingPlan(entries, {axes!r}): axes maps each role to its mesh axis, "
                            f"ShardingPlan(entries, axes={{{DEFAULT_ROLE!r}: {axes!r}}})")
        axes = {DEFAULT_ROLE: DEFAULT_ROLE, **(axes or {})}
        owned = {name: (p, default) for p in parallelisms for name, default in p.settings.items()}
        given = dict(settings or {})
        unknown = sorted(set(given) - set(owned))
        if unknown:
            raise PlanError(f"plan settings {unknown} belong to no parallelism (settings: {sorted(owned)})")
        handlers = dict(handlers) if handlers is not None else default_handlers()
        special = dict(special_handlers or {})
        for pattern, name in special.items():
            if name not in handlers:
                raise PlanError(f"special handler {name!r} for {pattern!r} is not registered (have {sorted(handlers)})")
        for name, value in (("axes", MappingProxyType(axes)),
                            ("settings", MappingProxyType({n: given.get(n, d) for n, (_, d) in owned.items()})),
                            ("optional_roles", frozenset(optional_roles)), ("handlers", handlers),
                            ("special_handlers", special), ("unplanned", dict(unplanned or {})),
                            ("parallelisms", parallelisms)):
            object.__setattr__(self, name, value)
        checked = {pattern: _as_style(style, f"plan entry {pattern!r}") for pattern, style in entries.items()}
        for p in parallelisms:
            checked = p.check_entries(checked, self)
        object.__setattr__(self, "entries", checked)

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
        """A new ``ShardingPlan`` of ``entries`` with this plan's axes, settings and the rest
        (``changes`` override them); a subclass's own fields (``AutoPlan``'s report) are not carried over."""
        kept = {f.name: getattr(self, f.name) for f in fields(ShardingPlan) if f.name != "entries"}
        return ShardingPlan(entries, **{**kept, **changes})

    def restricted(self, entries: Mapping[str, Style]) -> ShardingPlan:
        """``entries`` alone: this plan's axes for the default role and the roles they use, default
        settings (no root entries), so that each entry resolves by itself (``lint``)."""
        roles = {DEFAULT_ROLE, *(s.axis_role for s in entries.values())}
        return self.with_entries(entries, axes={r: a for r, a in self.axes.items() if r in roles}, settings={})

    @classmethod
    def from_hf(cls, model: nn.Module, tp_axis: str = "tp", *, loss_parallel: bool = False, cp_axis: str | None = None,
                cp_strategy: str = "ring", cp_layout: str = "zigzag", ep_axis: str | None = None,
                ep_tokens: str = "replicated") -> ShardingPlan:
        """The plan a Hugging Face model declares (``model._tp_plan``, else the config's
        ``base_model_tp_plan`` under ``base_model_prefix``), built through the parallelisms' packages
        (``sources.hf.hf_plan``).  An unsupported HF style raises naming the style and the module pattern.

        HF's entries are read as transformers applies them (``sources.hf``): parameter entries go to
        their module's ``local_params``/``moe_tp_experts`` entry, an entry that matches nothing in
        this model is dropped and noted (``explain()``); without ``ep_axis`` the routed experts HF
        leaves whole get TP inside them.

        Args:
            model: the HF model; only read.
            tp_axis: the mesh axis of HF's TP entries; with ``cp_axis`` or ``ep_axis`` they apply only when
                the mesh has it.
            loss_parallel: keep the logits vocab-sharded and compute HF's causal-LM loss on them.
            cp_axis: context parallelism too: the ``cp_strategy`` style on every attention module.
            cp_strategy: a strategy a context-parallel plug-in offers: ``"ring"`` or ``"allgather"``
                (``ContextParallel``).
            cp_layout: how the sequence is cut over ``cp_axis``: ``"zigzag"`` (load-balanced) or ``"contiguous"``.
            ep_axis: expert parallelism too, from the config's ``base_model_ep_plan`` (``Experts`` on the
                routed experts, TP on shared experts).
            ep_tokens: ``"replicated"`` (the ep ranks hold one batch) or ``"local"`` (``ep`` shares ranks with
                ``dp``: ``Experts(tokens=)``).
        Returns:
            a new ``ShardingPlan`` (a ``PlanError`` when the model declares no plan and ``cp_axis`` is None)."""
        return cls(**hf_plan(model, tp_axis=tp_axis, loss_parallel=loss_parallel, cp_axis=cp_axis,
                             cp_strategy=cp_strategy, cp_layout=cp_layout, ep_axis=ep_axis, ep_tokens=ep_tokens,
                             parallelisms=PARALLELISMS))

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
        axes = {"tp": tp_axis, **({"ep": ep_axis} if ep_axis is not None else {})}
        return cls(entries, axes, settings={"loss_parallel": loss_parallel})

    @classmethod
    def from_torchtitan(cls, model: nn.Module, tp_axis: str = "tp", *, loss_parallel: bool = False) -> ShardingPlan:
        """The plan a torchtitan 0.3.0 model declares: the ``ShardingConfig`` its
        ``set_*_sharding_config`` function put on every module (``module._sharding_config``), its
        ``tp`` layouts converted to this library's styles (``sources.torchtitan``).  A layout that
        cannot be expressed (expert parallelism among them) raises naming the module and the layout.

        Args:
            model: a model built from a config torchtitan's ``set_*_sharding_config`` filled; only read.
            tp_axis: the mesh axis torchtitan's ``tp`` layouts act on.
            loss_parallel: keep the ``lm_head``'s logits vocab-sharded (compute the loss with
                ``hpf.vocab_parallel_cross_entropy``); by default they are gathered.
        Returns:
            a new ``ShardingPlan`` on ``tp_axis``."""
        return cls(torchtitan_entries(model, tp_axis, loss_parallel=loss_parallel), {"tp": tp_axis})

    def resolve(self, model: nn.Module, mesh: DeviceMesh) -> list[Planned]:
        """Every planned module in ``model.named_modules()`` order, with the root entries the
        parallelisms add; raises PlanError on a pattern that matches nothing (with the closest
        paths), an unknown axis, or a conflict."""
        names = tuple(mesh.mesh_dim_names or ())
        modules = dict(model.named_modules())
        for p in self.parallelisms:
            p.check_mesh(self, names)
        entries = self._entries(names)
        for pattern, style in entries.items():
            if isinstance(style, ModuleSpec):  # a spec naming no axis acts on the default role's axis
                bad = (style.axes or {self.axes.get(DEFAULT_ROLE)}) - set(names)
            else:  # a Local may also name other axes in its layouts
                bad = ({self.axis_of(style, names)} | getattr(style, "named_axes", set())) - set(names)
            if bad:
                axis = sorted(bad, key=str)[0]
                role = next((r for r, a in self.axes.items() if a == axis), None)
                hint = (f"; the plan acts on its {role!r} axis {axis!r}: name the mesh's axis with "
                        f"ShardingPlan(..., axes={{{role!r}: ...}}) or ShardingPlan.from_hf(model, {role}_axis=...)"
                        if role is not None else "")
                raise PlanError(f"plan entry {pattern!r}: mesh axis {axis!r} is not in the mesh (axes: {list(names)}){hint}")
        candidates = self.candidates(model, names)
        hit = {c.pattern for cands in candidates.values() for c in cands}
        for pattern in entries:
            if pattern not in hit:
                close = difflib.get_close_matches(pattern, [p for p in modules if p], n=3, cutoff=0.5)
                raise PlanError(f"plan entry {pattern!r} matches no module; closest paths: {close}")
        chosen = {path: most_specific(path, cands) for path, cands in candidates.items()}
        resolution = Resolution(model, names, candidates, chosen)
        for p in self.parallelisms:
            resolution = p.resolve(self, resolution)
        out = []
        root = resolution.root
        if root is not None:  # a parallelism's root entry (CP's batch sharding, loss parallel's loss)
            if "" in resolution.chosen:
                planned = resolution.chosen[""]
                raise PlanError(f"{root.pattern} computes the loss in a Local entry on the root module, which the "
                                f"plan already plans ({planned[0]!r}: {planned[1]}); drop that entry")
            out.append(Planned("", model, root.style, root.axis, root.pattern))
        for path, module in modules.items():
            if path in resolution.chosen:
                pattern, style = resolution.chosen[path]
                out.append(Planned(path, module, style.on_mesh(names), self.axis_of(style, names), pattern))
        return out

    def _entries(self, names) -> dict[str, Style]:
        """The entries that apply on a mesh with axes ``names``: those on an optional role whose
        axis the mesh lacks are dropped."""
        missing = {self.axes[r] for r in self.optional_roles if r in self.axes and self.axes[r] not in names}
        if not missing:
            return dict(self.entries)
        return {p: s for p, s in self.entries.items() if self.axis_of(s, names) not in missing}

    def candidates(self, model: nn.Module, names=None) -> dict[str, list[Candidate]]:
        """Module path → every entry whose pattern matches it (on a mesh with axes ``names``)."""
        out: dict[str, list[Candidate]] = {}
        entries = self.entries if names is None else self._entries(names)
        for path in dict(model.named_modules()):
            for pattern, style in entries.items():
                if path_matches(pattern, path):
                    out.setdefault(path, []).append(Candidate(pattern, style))
        return out

    def axis_of(self, style: Style, names: tuple[str, ...] = ()) -> str | None:
        """The mesh axis a style acts on (the one rule): its own ``axis=``, else the plan's axis
        for its role (``axes[style.axis_role]``); a ModuleSpec on a mesh (``names``) without its
        role's axis names its axes itself (the first of the mesh's it names)."""
        own = getattr(style, "axis", None)
        if own:
            return own
        axis = self.axes.get(style.axis_role)
        if isinstance(style, ModuleSpec) and names and axis not in names and style.axes:
            return next(a for a in names if a in style.axes)
        return axis

    def role_axes(self) -> dict[str, str | None]:
        """Each role's mesh axis (``axes`` as a dict)."""
        return dict(self.axes)

    def axes_used(self) -> set[str]:
        """Every mesh axis the plan acts on: its styles' and its roles'."""
        return {a for a in (*map(self.axis_of, self.entries.values()), *self.axes.values()) if a}


def as_plan(plan: ShardingPlan | Mapping) -> ShardingPlan:
    """``plan`` itself, or a plain ``{pattern: style}`` dict as a ``ShardingPlan`` (``axes={"tp": "tp"}``)."""
    return plan if isinstance(plan, ShardingPlan) else ShardingPlan(plan)
