"""Expert parallelism: a mixture-of-experts layer's routed experts sharded over an ``ep`` axis.

``Experts`` on an experts module stores its ``[num_experts, ...]`` parameters ``Shard(0)`` (a
container of expert modules: ``StackedShard(i, E)``) and, per call, splits the tokens over ``ep``,
sends each row to its expert's owner (``all_to_all_v``), runs the module's own forward there and
combines the weighted results back (``dispatch_combine``); the router stays replicated.  TP inside
the experts, ``tokens="local"`` (``expert_mesh``) and capacity: see docs/experts.md.
"""

from __future__ import annotations

__all__ = ["Experts", "check_experts_entries", "expert_members", "expert_mesh", "expert_weights", "hf_ep_entries", "is_experts",
           "not_per_expert"]

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.nn import functional as F

from ...core import collectives as C
from ...core.collectives import AxisGroup
from ...core.errors import PlanError
from ...core.paths import layer_patterns, path_matches
from ...core.placement import StackedShard
from ...core.style import ModuleSpec, Style
from ..local import Local
from .calls import CALLS, ExpertsCall, experts_call

#: ``Experts(tokens=)``: the ep ranks hold the same tokens (split among them), or each its own.
TOKENS = ("replicated", "local")
#: ``on_drop(fqn, count)``: the assignments a capacity factor dropped on this rank in one call.
OnDrop = Callable[[str, Tensor], None]


def expert_weights(module: nn.Module) -> list[str]:
    """The module's own stacked expert parameters: 3-D, leading dim ``num_experts``."""
    n = getattr(module, "num_experts", None)
    return [name for name, p in module.named_parameters(recurse=False) if p.dim() == 3 and p.shape[0] == n]


def expert_params(module: nn.Module) -> list[str]:
    """Every parameter under fused experts that holds one slice per expert (leading dim
    ``num_experts``): the stacked weights, their biases (GPT-OSS's ``gate_up_proj_bias [E, 2I]``), a
    per-expert norm's scale in a child (Ergo's ``post_expert_norm.weight [E, H]``).  A rank's copy
    indexes them by its local expert ids, so each is sharded with the weights, never left whole."""
    n = getattr(module, "num_experts", None)
    return [name for name, p in module.named_parameters() if p.dim() >= 1 and p.shape[0] == n]


def not_per_expert(module: nn.Module) -> list[str]:
    """The parameters under fused experts that are not per expert, and the per-expert buffers
    (``Experts`` shards neither: a rank's tokens reach them through its own experts only)."""
    n, per_expert = getattr(module, "num_experts", None), set(expert_params(module))
    return ([f"{name} {tuple(p.shape)}" for name, p in module.named_parameters() if name not in per_expert]
            + [f"buffer {name} {tuple(b.shape)}" for name, b in module.named_buffers() if b.dim() >= 1 and b.shape[0] == n])


def expert_members(module: nn.Module) -> list[str]:
    """The child names of a container of expert modules (``nn.ModuleList``, or an
    ``nn.ModuleDict`` keyed ``expert_<i>`` as HF's Switch and NLLB-MoE), in expert order: the
    children whose names end in their index ``0 … E−1`` (other children, such as a dropout, are
    not experts); empty when the module is no such container."""
    if not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return []
    numbered = [(n, m) for n, m in module.named_children() if re.search(r"\d+$", n)]
    index = [int(re.search(r"\d+$", n).group()) for n, _ in numbered]
    kinds = {type(m) for _, m in numbered}
    count = getattr(module, "num_experts", len(numbered))
    return [n for n, _ in numbered] if numbered and index == list(range(count)) and len(kinds) == 1 else []


def _takes_routing(module: nn.Module) -> bool:
    """Whether the container has a forward of its own (HF's experts contract), not ``nn.ModuleList``'s none."""
    return type(module).forward is not nn.Module.forward


def is_experts(module: nn.Module) -> bool:
    """Whether ``Experts`` applies: fused ``[num_experts, ...]`` weights, or a container of expert
    modules with a forward taking the routing."""
    return bool(expert_weights(module)) or bool(expert_members(module)) and _takes_routing(module)


def _stacked_params(module: nn.Module, members: list[str]) -> dict[str, StackedShard]:
    """Each expert module's parameters as member ``i`` of the stack of ``len(members)``."""
    return {f"{child}.{name}": StackedShard(i, len(members))
            for i, child in enumerate(members) for name, _ in module.get_submodule(child).named_parameters()}


def _localise(module: nn.Module, axes: Mapping[str, AxisGroup], *, axis: str) -> None:
    """The skeleton's copy of fused experts holds this rank's experts: its ``num_experts`` is the local count."""
    module.num_experts //= axes[axis].size


def _is_fake(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def _route(idx: Tensor, w: Tensor, experts: int, capacity: int | None, valid: Tensor | None):
    """(token of each kept assignment, its weight, rows per expert, dropped), sorted by expert;
    assignments not ``valid`` (a one-hot mask's empty rows: the router dropped them) are left out."""
    flat = idx.reshape(-1) if valid is None else torch.where(valid.reshape(-1), idx.reshape(-1), experts)
    order = torch.argsort(flat, stable=True)  # by expert, token order kept within an expert; left-out ones last
    by_expert = flat[order]
    counts = flat.new_zeros(experts + 1).scatter_add_(0, flat, torch.ones_like(flat))  # bincount, but a fixed size
    keep = by_expert < experts
    dropped = counts.new_zeros(())
    if capacity is not None:
        starts = torch.cumsum(counts, 0) - counts
        within = torch.arange(flat.numel(), device=flat.device) - starts[by_expert] < capacity
        dropped = (keep & ~within).sum()
        keep = keep & within
    counts = counts[:experts] if capacity is None else counts[:experts].clamp(max=capacity)
    if valid is not None or capacity is not None:
        order = order[keep]
    return order // idx.shape[1], w.reshape(-1)[order], counts, dropped


def _connected(out: Tensor, rows: Tensor, module: nn.Module) -> Tensor:
    """``out`` (equal) made to depend on ``rows`` and on every local expert weight: HF's experts
    forward returns fresh zeros when no row arrives, and then the backward's reverse all-to-alls
    would run on the other ranks only (a hang) and the weights would get no gradient at all."""
    zero = sum(p.reshape(-1)[:1].sum() for p in module.parameters()) * 0
    return out + rows[:, :1] * 0 + zero


def _vmapped(t: Tensor) -> bool:
    """Whether ``t`` is batched by a ``torch.func.vmap`` level (under any grad/jvp wrappers)."""
    f = torch._C._functorch
    while f.maybe_get_level(t) != -1:
        if f.is_batchedtensor(t):
            return True
        t = f.get_unwrapped(t)
    return False


def dispatch_combine(module: nn.Module, axes: Mapping[str, AxisGroup], hidden: Tensor, top_k_index: Tensor,
                     top_k_weights: Tensor, *, axis: str, fqn: str, stacked: int, capacity_factor: float | None,
                     on_drop: OnDrop | None, call: ExpertsCall = CALLS["routed"]) -> Tensor:
    """This rank's tokens through their experts on whichever ranks own them (docs/experts.md#what-experts-does).
    ``top_k_index`` is ``[T, k]`` expert ids, or a one-hot mask ``[T, k, E]`` (HF's Switch), and
    the module is called back the same way, through ``call.run`` (``parallel.experts.calls``).
    ``stacked``: the number of experts of a container of expert modules, called with global
    expert ids (its children are all there, the other ranks' ones empty); 0: fused experts,
    localised, called with local ids."""
    g = axes[axis]
    if _vmapped(top_k_index):
        raise PlanError(f"{fqn}: expert parallelism under torch.func.vmap of the routed tokens (vmap, per-example "
                        "vmap(grad)): the routing decides how many rows each rank sends to each (all_to_all_v's split "
                        "sizes), which differs per vmapped example and cannot be batched; loop over the examples, or "
                        "vmap only what the routing does not depend on (jvp, hessian's tangents)")
    local = stacked // g.size if stacked else module.num_experts  # localised
    experts = local * g.size
    mask = top_k_index.dim() == 3
    valid = top_k_index.amax(-1) > 0 if mask else None
    index = top_k_index.argmax(-1) if mask else top_k_index
    tokens, k = index.shape
    fake = _is_fake(index)  # explain/simulate: shapes only, so routing is taken as balanced, nothing dropped
    capacity = None if capacity_factor is None or fake else math.ceil(capacity_factor * tokens * k / experts)
    token, weight, counts, dropped = _route(index, top_k_weights, experts, capacity, None if fake else valid)
    if on_drop is not None:
        on_drop(fqn, dropped)
    per_rank = counts.view(g.size, local)
    received = C.raw_all_to_all(per_rank, 0, 0, g)  # [source rank, local expert]: the rows this rank receives
    if fake:
        n = token.shape[0]
        send = recv = [n // g.size] * (g.size - 1) + [n - n // g.size * (g.size - 1)]
        rows_expert = None
    else:
        send, recv = per_rank.sum(1).tolist(), received.sum(1).tolist()
        rows_expert = torch.arange(local, device=counts.device).repeat(g.size).repeat_interleave(received.reshape(-1))
    rows = C.all_to_all_v(hidden[token], 0, send, recv, g)
    if rows_expert is None:
        out = rows.clone()
    else:
        ones = rows.new_ones((rows.shape[0], 1), dtype=top_k_weights.dtype)
        ids = rows_expert + g.rank * local if stacked else rows_expert
        ids = F.one_hot(ids, experts if stacked else local).to(top_k_index.dtype)[:, None] if mask else ids[:, None]
        out = _connected(call.run(module, rows, ids, ones), rows, module)
    back = C.all_to_all_v(out, 0, recv, send, g)
    weighted = (back * weight[:, None]).to(hidden.dtype)
    return hidden.new_zeros((hidden.shape[0], *weighted.shape[1:])).index_add(0, token, weighted)  # (width: the experts')


@dataclass(frozen=True)
class Experts(Style):
    """Routed experts sharded over the plan's ``ep_axis`` (see the module docstring and docs/experts.md).

    >>> plan = hpf.ShardingPlan({"model.layers.*.mlp.experts": hpf.Experts()}, axes={"ep": "ep"})
    """

    own_forward = False

    capacity_factor: float | None = None
    on_drop: OnDrop | None = None
    tp_axis: str | None = None
    axis: str | None = None  # None: the plan's ep_axis
    tokens: str = "replicated"  # or "local": ep shares ranks with dp (docs/experts.md#ep-sharing-ranks-with-dp)
    call: str | ExpertsCall | None = None  # the calling convention (parallel.experts.calls); None: from the forward
    tp_partial: bool = False  # TP inside: leave the output a partial sum over tp (the caller reduces it)
    axis_role = "ep"

    def on_mesh(self, names: tuple[str, ...]) -> Experts:
        """Without TP inside the experts when the mesh has no ``tp_axis`` (``from_hf`` names it)."""
        return self if self.tp_axis is None or self.tp_axis in names else replace(self, tp_axis=None)

    def local(self, module: nn.Module, fqn: str, axis: str) -> Local:
        """The ``Local`` this style is on ``module``.  The tokens enter and leave it whole: with
        ``tokens="replicated"`` its function splits them over ``ep`` itself (``split_to``/``gather_from``
        with the last rank's chunk padded, so any token count works: one token per decoding step)."""
        members = [] if expert_weights(module) else expert_members(module)
        call = experts_call(module, self.call, fqn)
        fn = partial(_dispatch_call, axis=axis, fqn=fqn, stacked=len(members), capacity_factor=self.capacity_factor,
                     on_drop=self.on_drop, call=call, split=self.tokens != "local")
        tp = self.tp_axis
        whole = {axis: Replicate()}
        if tp is not None:
            whole = {**whole, tp: Replicate()}
        if members:
            params = {n: {axis: p} for n, p in _stacked_params(module, members).items()}
        else:
            layouts = call.tp_layouts(expert_params(module), fqn) if tp else {}
            params = {n: {axis: Shard(0), **({tp: layouts[n][0]} if tp else {})} for n in expert_params(module)}
        out = {**whole, tp: Partial()} if tp and self.tp_partial else whole
        return Local(fn, in_src=dict.fromkeys(range(call.n_args), whole), in_dst=dict.fromkeys(range(call.n_args), whole),
                     out_src={"output": {**whole, **({tp: Partial()} if tp else {})}}, out_dst={"output": out},
                     params=params, setup=None if members else partial(_localise, axis=axis), axis=axis)

    def spec(self, module: nn.Module, fqn: str, axis: str) -> ModuleSpec:
        if not is_experts(module):
            own = {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False)}
            kind = type(module).__name__
            if expert_members(module):
                raise PlanError(f"{fqn}: Experts on a {kind} of expert modules needs the container to take the routing "
                                "itself, as HF's experts do: forward(hidden [T, H], top_k_index [T, k] (or a one-hot "
                                f"mask [T, k, E]), top_k_weights [T, k]); {kind} has no forward (the MoE block loops "
                                "over it), so there is no call to dispatch")
            raise PlanError(f"{fqn}: Experts needs stacked expert weights ([num_experts, ...] parameters and a "
                            f"num_experts attribute, as HF's fused experts) or a ModuleList/ModuleDict of expert "
                            f"modules numbered 0 … num_experts − 1; {kind} has {own}")
        others = not_per_expert(module) if expert_weights(module) else []
        if others:
            raise PlanError(f"{fqn}: Experts shards every parameter of fused experts by its leading num_experts "
                            f"({getattr(module, 'num_experts', None)}) dim, each rank its experts' slices; {others} "
                            "are not per-expert parameters (a rank's tokens reach them through its own experts only, "
                            "so their gradients would be per-rank shares): leave this module unplanned or give it an "
                            "hpf.Local of its own")
        if self.tp_axis is not None and not expert_weights(module):
            raise PlanError(f"{fqn}: TP inside experts needs the fused [num_experts, ...] weights; "
                            f"{type(module).__name__} holds one module per expert: plan Experts(tp_axis=None)")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise PlanError(f"{fqn}: Experts capacity_factor must be positive, got {self.capacity_factor!r}")
        if self.tokens not in TOKENS:
            raise PlanError(f"{fqn}: Experts tokens must be one of {list(TOKENS)}, got {self.tokens!r}")
        spec = self.local(module, fqn, axis).spec(module, fqn, axis)
        # invariant on ep: the tokens come back whole (split_to's backward gathers their gradient), or each rank's own
        spec = replace(spec, varying=False)
        if self.tokens == "local":  # ep is a data axis here: per-rank compute, no reduction at the entry
            spec = replace(spec, region=None, summed_axes=(axis,))
        if self.tp_axis is None:
            return spec
        layouts = experts_call(module, self.call, fqn).tp_layouts(expert_params(module), fqn)
        return replace(spec, param_blocks={n: b for n, (_, b) in layouts.items() if b > 1})

    def local_forward(self, module, forward, *, fqn, axis, axes):
        return self.local(module, fqn, axis).local_forward(module, forward, fqn=fqn, axis=axis, axes=axes)

    def __hash__(self) -> int:
        return hash((self.capacity_factor, self.tp_axis, self.axis, self.tokens, self.call, self.tp_partial))


def _dispatch_call(module: nn.Module, axes: Mapping[str, AxisGroup], *args: Tensor, axis: str, call: ExpertsCall,
                   split: bool, **kwargs) -> Tensor:
    """``dispatch_combine`` on the routing ``call`` reads from the forward's arguments.  With
    ``split`` (the ep ranks hold the same tokens) rank ``r`` routes tokens ``[r·c, (r+1)·c)`` of
    the ``T`` (``c = ⌈T/ep⌉``, the last chunks shorter or empty), and the results are gathered back."""
    g, call = axes[axis], call.for_call(args)
    total = args[call.token_args[0]].shape[0]
    if not split:
        return dispatch_combine(module, axes, *call.routing(args, 0, total), axis=axis, call=call, **kwargs)
    chunk = -(-total // g.size)
    start, rows = min(g.rank * chunk, total), max(0, min(chunk, total - g.rank * chunk))
    mine = list(args)
    for i in call.token_args:  # this rank's chunk; split_to's backward gathers every chunk's gradient back
        mine[i] = C.split_to(_padded(args[i], chunk * g.size), 0, g)[:rows]
    out = dispatch_combine(module, axes, *call.routing(tuple(mine), start, total), axis=axis, call=call, **kwargs)
    return C.gather_from(_padded(out, chunk), 0, g)[:total]


def _padded(x: Tensor, rows: int) -> Tensor:
    """``x`` with zero rows appended up to ``rows`` along dim 0."""
    return x if x.shape[0] == rows else torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


#: Hugging Face ``ep_plan`` strings: the experts module's style, or a parameter the style shards.
_HF_EP = {"ep_dispatch_experts": "experts", "grouped_gemm": "parameter"}
#: Shared (dense) experts' projections and their TP styles (Qwen2-MoE, DeepSeek).
_SHARED = {"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}


def check_experts_entries(entries: Mapping[str, Style], ep_axis: str | None) -> None:
    """``Experts`` entries need the plan's ``ep_axis`` unless they name their own axis (``ShardingPlan``'s check)."""
    experts = [(p, s) for p, s in entries.items() if isinstance(s, Experts)]
    if experts and ep_axis is None and not any(s.axis for _, s in experts):
        raise PlanError(f"plan entry {experts[0][0]!r}: Experts needs the plan's ep_axis "
                        "(ShardingPlan(..., axes={'ep': 'ep'}))")


def hf_ep_entries(model: nn.Module, tp_entries: Mapping[str, object],
                  tp_axis: str | None = None, tokens: str = "replicated") -> dict[str, object]:
    """An HF MoE model's plan entries for ``from_hf(..., ep_axis=)``: its ``tp_plan`` entries that
    match a module (a family's plan names dense-MLP paths that an all-MoE config lacks), the
    config's ``base_model_ep_plan`` experts as ``Experts(tp_axis=tp_axis, tokens=tokens)`` (TP inside each
    expert where the mesh has that axis), and TP on the shared experts' projections.  Models
    without an ``ep_plan`` get the same ``Experts`` on every module holding stacked expert weights
    or a numbered container of expert modules (HF's Switch Transformers)."""
    modules = dict(model.named_modules())
    entries = {p: s for p, s in tp_entries.items() if any(path_matches(p, m) for m in modules)}
    ep = getattr(getattr(model, "config", None), "base_model_ep_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    prefix = f"{prefix}." if prefix and hasattr(model, prefix) else ""
    for pattern, style in ep.items():
        if style not in _HF_EP:
            raise PlanError(f"ep_plan entry {pattern!r}: style {style!r} is not supported (supported: {sorted(_HF_EP)})")
        if _HF_EP[style] == "experts":
            entries[prefix + pattern] = Experts(tp_axis=tp_axis, tokens=tokens)
    if not any(isinstance(s, Experts) for s in entries.values()):
        found = [n for n, m in modules.items() if n and is_experts(m) and hasattr(m, "num_experts")]
        if not found:
            raise PlanError(f"ep_axis: {type(model).__name__} has no experts to shard (no base_model_ep_plan and no "
                            "module with stacked [num_experts, ...] weights or a numbered container of expert modules)")
        fused = all(expert_weights(modules[n]) for n in found)  # TP inside experts needs the fused weights
        entries.update(dict.fromkeys(layer_patterns(found), Experts(tp_axis=tp_axis if fused else None, tokens=tokens)))
    shared = [n for n, m in modules.items() if n.rpartition(".")[2] in ("shared_expert", "shared_experts")
              and all(isinstance(getattr(m, c, None), nn.Linear) for c in _SHARED)]
    for pattern in layer_patterns(shared):
        entries.update({f"{pattern}.{child}": style for child, style in _SHARED.items()})
    return entries


def expert_mesh(mesh: DeviceMesh, ep: int, *, dp_axis: str = "dp", names: tuple[str, str] = ("edp", "ep")) -> DeviceMesh:
    """``mesh`` over the same ranks with ``dp_axis`` (size ``D``) split into ``(edp, ep)`` of sizes
    ``(D / ep, ep)``, ep innermost so each ep group is consecutive ranks of the dp axis; the other
    axes stay.  For ``Experts(tokens="local")``: the batch is still split over all ``D`` ranks.
    A collective (new process groups): call on every rank.

    Args:
        mesh: the mesh holding ``dp_axis``.
        ep: the expert-parallel degree; must divide the size of ``dp_axis``.
        dp_axis: the axis to split.
        names: the two new axis names, outer (size ``D / ep``) then inner (size ``ep``): distinct, and not other
            axes of ``mesh``.
    Returns:
        a new ``DeviceMesh`` with ``dp_axis`` replaced by the two ``names`` axes in its place.

    >>> m = hpf.expert_mesh(init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)), ep=2)  # ("edp", "ep") = (2, 2)
    """
    dims = mesh.mesh_dim_names or ()
    if dp_axis not in dims:
        raise PlanError(f"expert_mesh: axis {dp_axis!r} is not in the mesh (axes: {list(dims)})")
    i, size = dims.index(dp_axis), mesh.size(dims.index(dp_axis))
    if not (isinstance(ep, int) and ep > 0 and size % ep == 0):
        raise PlanError(f"expert_mesh: ep={ep!r} must divide axis {dp_axis!r} of size {size}")
    clash = set(names) & (set(dims) - {dp_axis})
    if clash or len(set(names)) != 2:
        raise PlanError(f"expert_mesh: names {names!r} must be two new axis names (mesh axes: {list(dims)})")
    shape = (*mesh.mesh.shape[:i], size // ep, ep, *mesh.mesh.shape[i + 1:])
    return DeviceMesh(mesh.device_type, mesh.mesh.reshape(shape), mesh_dim_names=(*dims[:i], *names, *dims[i + 1:]))
