"""Pass: KV-head replication — more ranks on a tensor-parallel axis than an attention module has
KV heads (Llama-3-70B: 8 KV heads, TP 16): each rank keeps the KV head its query heads use,
replicated over the ranks that share it (Megatron's and vLLM's GQA).  Communicates nothing.
See docs/whole-transformers.md#more-tp-ranks-than-kv-heads.
"""

from __future__ import annotations

__all__ = ["replicate_kv_heads"]

from collections.abc import Mapping, Sequence
from dataclasses import replace

from torch import nn
from torch.distributed.tensor import Shard

from ..core.collectives import AxisGroup
from ..core.errors import PlanError
from ..core.placement import GroupedShard
from ..core.program import Planned
from ..core.style import ModuleSpec
from ..sources.peft import projection_of

KV_COUNTS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head")
QUERY_COUNTS = ("num_heads", "n_heads", "num_attention_heads", "n_head")
GROUP_COUNTS = ("num_key_value_groups", "n_rep", "num_kv_groups", "num_queries_per_kv")
PATTERN = "(kv-head replication)"


def _read(source: object, name: str) -> object:
    """``source.name``, or None where reading it raises (transformers' heterogeneous configs refuse
    a per-layer attribute such as Gemma 4's ``head_dim`` on the global config)."""
    try:
        return getattr(source, name, None)
    except Exception:  # noqa: BLE001 - AmbiguousGlobalPerLayerAttributeError and the like: not known here
        return None


def _count(module: nn.Module, names: Sequence[str]) -> tuple[str | None, int | None]:
    """(attribute, value) of the first int count the module holds, else (None, the config's)."""
    for source, own in ((module, True), (getattr(module, "config", None), False)):
        for name in names:
            value = _read(source, name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return (name if own else None), value
    return None, None


def _kv_count(module: nn.Module, heads: int | None) -> tuple[str | None, int | None]:
    """The module's KV-head count: its own attribute, else its query heads over its own group
    count (a per-layer count the global config cannot give, Gemma 4), else its config's."""
    for name in KV_COUNTS:
        value = _read(module, name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return name, value
    group_attr, groups = _count(module, GROUP_COUNTS)
    if group_attr and heads and heads % groups == 0:
        return None, heads // groups
    return _count(module, KV_COUNTS)


def _is_attention(module: nn.Module, kv_attr: str | None) -> bool:
    """Whether ``module`` is an attention module: it holds a KV-head count itself, or its class is
    named so.  A module that only reaches the count through its ``config`` (an MLP, a shared expert
    whose projection happens to have ``kv_heads × head_dim`` features) is not one."""
    name = type(module).__name__.lower()
    return kv_attr is not None or "attention" in name or "attn" in name


def _head_dim(module: nn.Module, query_heads: int) -> int | None:
    value = _read(module, "head_dim") or _read(getattr(module, "config", None), "head_dim")
    if isinstance(value, int) and value > 0:
        return value
    hidden = _read(getattr(module, "config", None), "hidden_size")
    return hidden // query_heads if isinstance(hidden, int) and hidden % query_heads == 0 else None


def _is_colwise(module: nn.Module, spec: ModuleSpec, axis: str) -> bool:
    """A Linear with its output features sharded and its output left sharded (a gathered output
    holds every head again, so its features may split anywhere)."""
    stored = spec.params.get("weight", {}).get(axis)
    out = spec.out_dst.get("output", spec.out_src.get("output", {})).get(axis)
    return isinstance(module, nn.Linear) and type(stored) is Shard and stored.dim == 0 and type(out) is Shard


def replicate_kv_heads(
    model: nn.Module, planned: Sequence[Planned], specs: Mapping[str, ModuleSpec], groups: Mapping[str, AxisGroup]
) -> tuple[list[Planned], dict[str, ModuleSpec]]:
    """``planned`` and ``specs`` with the K/V projections that need it replicated, and an entry
    for each attention module whose skeleton copy changes attributes.

    A K/V projection is a planned Colwise ``nn.Linear`` (weight ``Shard(0)``, output left sharded)
    directly under an attention module that states a KV-head count and a head dim, with
    ``kv_heads × head_dim`` output features.  With ``n`` ranks and ``kv`` heads, its weight and bias
    are stored ``GroupedShard(0, n // kv)`` and used as this rank's ``Shard(0)`` slice, so the rest
    of the compiler sees a plain Colwise: the gradients are summed over each group's ranks in the
    backward (``copy_to_replicas``), the input gradient is reduced over the whole axis as for any
    Colwise.  A count that neither divides nor is divided by the axis size, or a packed projection
    that would need replication, raises ``PlanError``; query heads that do not divide the axis are
    lint's ``heads`` error."""
    modules = dict(model.named_modules())
    specs, parents = dict(specs), {}
    for p in planned:
        spec, n = specs[p.fqn], groups[p.axis].size
        if not p.fqn or not _is_colwise(p.module, spec, p.axis):
            continue
        parent_fqn = projection_of(p.fqn, modules).rpartition(".")[0]  # a LoRA layer's pieces: its attention
        parent = modules[parent_fqn]
        _, heads = _count(parent, QUERY_COUNTS)
        kv_attr, kv = _kv_count(parent, heads)
        if not _is_attention(parent, kv_attr):
            continue
        head_dim = _head_dim(parent, heads) if heads else None
        if kv is None or head_dim is None or p.module.out_features != kv * head_dim or kv % n == 0 or heads % n:
            continue  # whole KV heads per rank already; query heads that do not divide: lint's ``heads``
        if n % kv:
            raise PlanError(f"{parent_fqn or '<root module>'}: {kv} KV heads on mesh axis {p.axis!r} of size {n}: "
                            f"KV-head replication needs the axis size to be a multiple of the KV heads ({p.fqn} "
                            f"has {kv}×{head_dim} output features)")
        if spec.param_blocks:
            raise PlanError(f"{p.fqn}: a packed projection cannot replicate its {kv} KV heads over {n} ranks of "
                            f"axis {p.axis!r}; plan q/k/v as separate projections")
        grouped = GroupedShard(0, n // kv)  # on p.axis only: a placement the projection has on another axis stays
        specs[p.fqn] = replace(spec, params={k: {**v, p.axis: grouped} for k, v in spec.params.items()},
                               param_dst={**spec.param_dst,
                                          **{k: {**spec.param_dst.get(k, {}), p.axis: Shard(0)} for k in spec.params}})
        group_attr, _ = _count(parent, GROUP_COUNTS)
        values = {**({kv_attr: 1} if kv_attr else {}), **({group_attr: heads // n} if group_attr else {})}
        parents[parent_fqn] = (parent, p.axis, values)
    out = list(planned)
    for fqn, (module, axis, values) in parents.items():
        if fqn in specs:
            old = specs[fqn]
            specs[fqn] = replace(old, divide_attrs=tuple(a for a in old.divide_attrs if a not in values),
                                 set_attrs={**old.set_attrs, **values})
        else:
            specs[fqn] = ModuleSpec(set_attrs=values)
            out.append(Planned(fqn, module, specs[fqn], axis, PATTERN))
    order = {fqn: i for i, fqn in enumerate(modules)}
    return sorted(out, key=lambda p: order[p.fqn]), specs
