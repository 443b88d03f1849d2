"""Hugging Face ``tp_plan`` strings → styles (``ShardingPlan.from_hf``); other strings raise
naming the style and the module.

``hf_entries`` reads an HF plan as transformers 5.25 applies it
(``transformers/distributed/tensor_parallel.py``): parameter entries, ``unit_colwise``,
``mla_kv_a_proj``, entries that match nothing; ``tp_experts`` plans the routed experts HF leaves
whole on a mesh without ``ep``.  See docs/whole-transformers.md#hf-plans-as-transformers-applies-them.
A peft model is planned through ``sources.peft``: the HF model's plan under peft's prefix, the
entries on LoRA layers moved onto their base layers and adapters (docs/adapters.md).
"""

from __future__ import annotations

__all__ = ["HF_STYLES", "hf_plan"]

import inspect
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from ..core.errors import PlanError
from ..core.paths import layer_patterns, path_matches
from ..core.style import ModuleSpec, Style
from ..parallel.context.styles import attention_patterns
from ..parallel.experts.styles import expert_weights, hf_ep_entries, is_experts
from ..parallel.tensor.styles import Colwise, NoParallel, Rowwise, SequenceParallel
from ..parallel.tensor.vocab import VocabEmbedding
from .peft import lora_entries, peft_model_prefix

#: HF styles of a parameter entry (``LocalParams``).
PARAM_STYLES = ("colwise", "rowwise", "packed_colwise", "packed_rowwise", "replicate")
#: HF styles of a module that runs its forward on its parameters' local shards.
OWNER_STYLES = ("local_params", "moe_tp_experts")


def param_placement(style: str, name: str, ndim: int, where: str) -> tuple[Placement, int | None]:
    """(storage placement, packed blocks) of a parameter of ``ndim`` dims under HF ``style``."""
    if style not in PARAM_STYLES:
        raise PlanError(f"{where}: HF style {style!r} on a parameter is not supported (supported: {list(PARAM_STYLES)})")
    if style == "replicate" or (style in ("rowwise", "packed_rowwise") and (ndim == 1 or name.endswith("bias"))):
        return Replicate(), None
    dim = max(ndim - 2, 0) if style in ("colwise", "packed_colwise") else ndim - 1
    return Shard(dim), (2 if style.startswith("packed") and ndim > 1 else None)


@dataclass(frozen=True)
class LocalParams(Style):
    """HF ``local_params`` / ``moe_tp_experts``: the module's own forward on local shards of the
    parameters ``params`` names (``(name, HF parameter style)`` pairs).  ``partial_output``
    (``moe_tp_experts``): every rank computes part of every expert, so the output is a partial
    sum reduced once, and the hidden states (argument 0) and routing weights (argument 2, when
    the forward takes it) enter replicated, their gradients reduced at the entry."""

    params: tuple[tuple[str, str], ...] = ()
    partial_output: bool = False
    axis: str | None = None

    def spec(self, module: nn.Module, fqn: str, axis: str) -> ModuleSpec:
        own = dict(module.named_parameters())
        placements, blocks = {}, {}
        for name, style in self.params:
            if name not in own:
                raise PlanError(f"{fqn}: the HF plan shards parameter {name!r}, module has {sorted(own)[:12]}")
            placement, packed = param_placement(style, name, own[name].dim(), f"{fqn}.{name}")
            placements[name] = {axis: placement}
            if packed:
                blocks[name] = packed
        if not self.partial_output:
            return ModuleSpec(params=placements, param_blocks=blocks)
        if not any(isinstance(p[axis], Shard) for p in placements.values()):
            raise PlanError(f"{fqn}: moe_tp_experts sums every rank's output, so it needs parameter entries that shard "
                            f"the experts (HF: '{fqn}.gate_up_proj': 'packed_colwise', '{fqn}.down_proj': 'rowwise')")
        whole = {axis: Replicate()}
        positional = [p for p in inspect.signature(module.forward).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        keys = [k for k in (0, 2) if k < len(positional)]
        return ModuleSpec(params=placements, param_blocks=blocks, in_src=dict.fromkeys(keys, whole),
                          in_dst=dict.fromkeys(keys, whole), out_src={"output": {axis: Partial()}},
                          out_dst={"output": whole}, varying=True)


@dataclass(frozen=True)
class MlaRegion(Style):
    """An MLA attention module (DeepSeek) whose ``kv_a_proj_with_mqa`` is HF's ``mla_kv_a_proj``:
    a rank-varying region entered with replicated hidden states, so the replicated latent and
    ``k_rot`` computed inside it get their gradients summed over the ranks once, at the entry.
    The head-count attributes its copy holds are divided by the axis size."""

    attrs: tuple[str, ...] = ("num_heads",)
    axis: str | None = None

    def spec(self, module: nn.Module, fqn: str, axis: str) -> ModuleSpec:
        whole = {axis: Replicate()}
        return ModuleSpec(in_src={"hidden_states": whole}, in_dst={"hidden_states": whole}, varying=True, region=True,
                          divide_attrs=tuple(a for a in self.attrs if isinstance(getattr(module, a, None), int)))


HF_STYLES: dict[str, Style] = {
    "colwise": Colwise(),
    "unit_colwise": Colwise(),  # fewer KV heads than ranks: replicated per group (compile.kv_heads)
    "rowwise": Rowwise(),
    "colwise_gather_output": Colwise(gather_output=True),
    "colwise_rep": Colwise(gather_output=True),
    "rowwise_split_input": Rowwise(input_layout=Replicate()),
    "rowwise_rep": Rowwise(input_layout=Replicate()),
    "replicated_with_grad_allreduce": NoParallel(reduce_grads=True),
    "embedding_rowwise": VocabEmbedding(),
    "packed_colwise": Colwise(packed=2),
    "sequence_parallel": SequenceParallel(),
    "replicate": NoParallel(),
    "local_params": LocalParams(),
    "moe_tp_experts": LocalParams(partial_output=True),
    "mla_kv_a_proj": NoParallel(),  # its attention module becomes an MlaRegion (hf_entries)
}

#: The layout HF's ``moe_tp_experts`` gives fused experts ``[E, 2I, H]`` / ``[E, H, I]``.
TP_EXPERT_PARAMS = (("gate_up_proj", "packed_colwise"), ("down_proj", "rowwise"))


def _chunks_gate_up(module: nn.Module) -> bool:
    """Whether the experts' forward splits ``gate_up_proj``'s output into two halves (``chunk(2``),
    the packed layout sharded per half; an interleaved one would be sharded wrongly."""
    try:
        return ".chunk(2" in inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False


def tp_experts(model: nn.Module, entries: Mapping[str, object], ep_plan: Mapping[str, str], prefix: str,
               unplanned: dict[str, str]) -> dict[str, object]:
    """Routed-experts entries for a mesh without ``ep`` (``moe_tp_experts``: the fused ``gate_up_proj``
    packed colwise, ``down_proj`` rowwise, as ``Experts(tp_axis=)`` does inside each ep shard) for the
    experts named by the config's ``ep_plan`` (``ep_dispatch_experts``), else found by their stacked
    weights, that no entry plans yet; those of another layout are left whole, and why goes to ``unplanned``."""
    modules = dict(model.named_modules())
    named = [prefix + p for p, s in ep_plan.items() if s == "ep_dispatch_experts"]
    found = [n for n, m in modules.items() if n and (any(path_matches(p, n) for p in named)
                                                       or is_experts(m) and expert_weights(m))]
    out = {}
    for pattern in layer_patterns(found):
        if any(path_matches(pattern, n) and any(path_matches(e, n) for e in entries) for n in found):
            continue
        module = next(modules[n] for n in found if path_matches(pattern, n))
        own = sorted(n for n, _ in module.named_parameters())
        if own != sorted(n for n, _ in TP_EXPERT_PARAMS) or not _chunks_gate_up(module):
            unplanned[pattern] = (f"routed experts kept whole on tp: TP inside them shards gate_up_proj [E, 2I, H] "
                              f"(split in two halves) and down_proj [E, H, I]; {type(module).__name__} holds {own}")
            continue
        out[pattern] = LocalParams(TP_EXPERT_PARAMS, partial_output=True)
    return out


def hf_entries(model: nn.Module, raw: Mapping[str, object]) -> tuple[dict[str, object], dict[str, str]]:
    """``raw`` (an HF ``tp_plan``, full paths) as plan entries on modules, and the dropped entries
    with why (docs/whole-transformers.md#hf-plans-as-transformers-applies-them)."""
    modules = dict(model.named_modules())
    params = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    entries, owned, dropped = {}, {}, {}
    for pattern, style in raw.items():
        if any(path_matches(pattern, m) for m in modules):
            entries[pattern] = style
        elif any(path_matches(pattern, p) for p in params):
            owner, _, name = pattern.rpartition(".")
            owned.setdefault(owner, []).append((name, style))
        else:
            dropped[pattern] = f"{style}: matches no module or parameter of this {type(model).__name__} (HF drops it too)"
    for owner, names in owned.items():
        style = entries.get(owner)
        if style not in OWNER_STYLES:
            raise PlanError(f"HF plan entries {[f'{owner}.{n}' for n, _ in names]} shard parameters of {owner!r}, "
                            f"whose own entry is {style!r}, not one of {list(OWNER_STYLES)} (nothing would run their "
                            "forward on the local shards)")
        for name, s in names:
            if not isinstance(s, str):
                raise PlanError(f"HF plan entry {owner}.{name}: a parameter entry takes an HF style string, got {s!r}")
        entries[owner] = LocalParams(tuple(names), partial_output=style == "moe_tp_experts")
    for pattern, style in list(entries.items()):
        if style == "mla_kv_a_proj":
            attention = pattern.rpartition(".")[0]
            if not attention or attention in entries:
                raise PlanError(f"HF plan entry {pattern!r} (mla_kv_a_proj): its attention module {attention!r} "
                                "must be unplanned (it becomes the rank-varying region of the shared k_rot)")
            entries[attention] = MlaRegion()
    return entries, dropped


def hf_plan(model: nn.Module, *, tp_axis: str, loss_parallel: bool, cp_axis: str | None, cp_strategy: str,
            cp_layout: str, ep_axis: str | None, ep_tokens: str, parallelisms: tuple) -> dict[str, object]:
    """``ShardingPlan.from_hf``'s keyword arguments for ``ShardingPlan``: the entries a Hugging Face
    model declares, read as transformers applies them (``hf_entries``), the experts' entries
    (``parallel.experts``) and, with ``cp_axis``, the style of the parallelism in ``parallelisms``
    that offers ``cp_strategy`` on every attention module.  A peft ``PeftModel``: those of the HF
    model inside it, under its prefix; entries on LoRA layers go to their base layers and adapters
    (``sources.peft``)."""
    prefix = peft_model_prefix(model)
    inner = model.get_submodule(prefix[:-1]) if prefix else model
    kwargs = _model_plan(inner, tp_axis=tp_axis, loss_parallel=loss_parallel, cp_axis=cp_axis, cp_strategy=cp_strategy,
                         cp_layout=cp_layout, ep_axis=ep_axis, ep_tokens=ep_tokens, parallelisms=parallelisms)
    entries = {prefix + k: v for k, v in kwargs["entries"].items()}
    return dict(kwargs, entries=lora_entries(model, entries, _as_style),
                unplanned={prefix + k: why for k, why in kwargs["unplanned"].items()})


def _as_style(value: object) -> object:
    """An entry's value as the plan reads it: HF's style strings looked up, anything else as it is."""
    return HF_STYLES.get(value, value) if isinstance(value, str) else value


def _model_plan(model: nn.Module, *, tp_axis: str, loss_parallel: bool, cp_axis: str | None, cp_strategy: str,
                cp_layout: str, ep_axis: str | None, ep_tokens: str, parallelisms: tuple) -> dict[str, object]:
    """``hf_plan`` of a Hugging Face model itself (paths relative to it)."""
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
    axes = {"tp": tp_axis}
    if cp_axis is not None:
        offered = {name: make for p in parallelisms if p.role == "cp" for name, make in p.strategies.items()}
        if cp_strategy not in offered:
            raise PlanError(f"cp_strategy={cp_strategy!r}: the context-parallel strategy must be one of {sorted(offered)}")
        attention = attention_patterns(model)
        if not attention:
            raise PlanError(f"cp_axis={cp_axis!r}: {type(model).__name__} has no attention module (a module class "
                            "named *Attention with an is_causal attribute) to plan context parallelism on")
        raw.update(dict.fromkeys(attention, offered[cp_strategy]()))
        axes["cp"] = cp_axis
    if ep_axis is not None:
        axes["ep"] = ep_axis
    optional = ("tp",) if cp_axis is not None or ep_axis is not None else ()
    return dict(entries=raw, axes=axes, settings={"loss_parallel": loss_parallel, "cp_layout": cp_layout},
                optional_roles=optional, unplanned=unplanned)
