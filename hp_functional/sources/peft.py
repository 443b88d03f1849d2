"""peft's wrapping seen through, by structure (peft is never imported here): ``ShardingPlan.from_hf``
on a ``PeftModel`` plans the Hugging Face model inside it, and moves each entry that lands on a
LoRA layer onto the layer's ``base_layer`` and adapters.

A ``PeftModel`` holds the HF model at ``base_model.model`` (``peft_model_prefix``), so HF's
``tp_plan`` applies under the prefix ``base_model.model.``.  A LoRA layer (``base_layer`` plus
``lora_A``/``lora_B`` ModuleDicts) computes ``base_layer(x) + lora_B(lora_A(dropout(x))) * s``:

- Colwise (output features split): ``base_layer`` and every ``lora_B.<adapter>`` take the style
  (both make the same output features); ``lora_A`` stays replicated: its ``r`` outputs are
  needed whole by every rank's slice of ``lora_B``.
- Rowwise (input features split): ``base_layer`` and every ``lora_A.<adapter>`` take the style
  (``lora_A`` reads the same split input, and its ``r`` partial sums are reduced, a small
  all-reduce); ``lora_B`` stays replicated, on the reduced ``r`` features.

``modules_to_save`` copies (``original_module`` and ``modules_to_save.<adapter>``) each take the
entry's style.  What cannot be made exact is refused by name: DoRA and LoRA on an embedding
under a sharding style, another tuner's layer, a LoRA layer under a style other than
Colwise/Rowwise/NoParallel.  See docs/adapters.md.
"""

from __future__ import annotations

__all__ = ["is_peft_model", "lora_entries", "lora_view", "peft_model_prefix", "projection_of"]

from collections.abc import Callable, Mapping

from torch import nn

from ..core.errors import PlanError
from ..core.paths import path_matches
from ..core.style import Style
from ..parallel.tensor.styles import Colwise, NoParallel, Rowwise

PEFT_PREFIX = "base_model.model."  # where a (non prompt-learning) PeftModel holds the HF model
SAVED = ("original_module", "modules_to_save")  # peft's ModulesToSaveWrapper: the frozen module, the trained copies


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` is a peft ``PeftModel``: a ``peft_config`` mapping and a ``base_model``
    child module (an HF model's ``base_model`` is a property, never a child)."""
    return "base_model" in dict(model.named_children()) and isinstance(getattr(model, "peft_config", None), Mapping)


def peft_model_prefix(model: nn.Module) -> str:
    """``"base_model.model."`` for a peft ``PeftModel`` of LoRA adapters (``is_peft_model``, the HF
    model registered at ``base_model.model``), else ``""``; another peft method (prompt learning,
    IA3, ...) is a ``PlanError`` naming it."""
    if not is_peft_model(model):
        return ""
    config, base = model.peft_config, model.get_submodule("base_model")
    kinds = {name: getattr(c, "peft_type", None) for name, c in config.items()}
    other = {name: str(getattr(k, "value", k)) for name, k in kinds.items() if getattr(k, "value", k) != "LORA"}
    if other or "model" not in dict(base.named_children()):
        raise PlanError(f"{type(model).__name__}: from_hf plans peft's LoRA adapters only; adapters {other or config} "
                        "are another peft method (shard it with hpf.auto_plan, or plan it by hand)")
    return PEFT_PREFIX


def is_lora(module: nn.Module) -> bool:
    """peft's LoRA layer: a ``base_layer`` module and ``lora_A``/``lora_B`` ModuleDicts."""
    return isinstance(getattr(module, "base_layer", None), nn.Module) and all(
        isinstance(getattr(module, n, None), nn.ModuleDict) for n in ("lora_A", "lora_B"))


def _is_saved(module: nn.Module) -> bool:
    """peft's ``ModulesToSaveWrapper``: the original module and a ModuleDict of trained copies."""
    return isinstance(getattr(module, SAVED[0], None), nn.Module) and isinstance(getattr(module, SAVED[1], None),
                                                                                   nn.ModuleDict)


def _wrapped(module: nn.Module) -> bool:
    return isinstance(getattr(module, "base_layer", None), nn.Module) or _is_saved(module)


def _refusal(path: str, module: nn.Module, style: Style) -> str | None:
    """Why LoRA layer ``module`` at ``path`` cannot take ``style`` exactly (None: it can)."""
    if isinstance(style, NoParallel):
        return None
    name = type(style).__name__
    if not is_lora(module):
        return (f"{path}: a peft {type(module).__name__} layer (not LoRA) wraps a module the plan shards ({name}); "
                "from_hf moves only LoRA's adapters with the split: leave this module out of the peft config")
    dora = getattr(module, "lora_magnitude_vector", None)
    if isinstance(dora, nn.ModuleDict) and len(dora):
        return (f"{path}: DoRA (use_dora=True, adapters {sorted(dora)}) normalises each row of base_layer.weight + "
                f"lora_B @ lora_A, which {name} splits over the ranks: not supported; train plain LoRA "
                "(use_dora=False), or leave this module out of target_modules")
    embedding = getattr(module, "lora_embedding_A", None)
    if isinstance(embedding, nn.ParameterDict) and len(embedding):
        return (f"{path}: LoRA on an embedding the plan shards by vocabulary ({name}) is not supported (its lookup "
                "of lora_embedding_A is not masked per rank); leave the embedding out of target_modules (or train it "
                "whole with modules_to_save=[...])")
    if not isinstance(style, (Colwise, Rowwise)):
        return (f"{path}: a LoRA layer planned {name}: from_hf places LoRA's adapters for Colwise and Rowwise "
                "projections only; leave this module out of target_modules")
    return None


def _moved(pattern: str, style: Style, hits: Mapping[str, nn.Module]) -> dict[str, Style]:
    """The entries that replace ``pattern: style`` on the wrapped modules ``hits`` (path → module)."""
    for path, module in hits.items():
        why = _refusal(path, module, style) if not _is_saved(module) else None
        if why:
            raise PlanError(why)
    out: dict[str, Style] = {}
    if any(_is_saved(m) for m in hits.values()):
        out.update({f"{pattern}.{SAVED[0]}": style, f"{pattern}.{SAVED[1]}.*": style})
    if any(is_lora(m) for m in hits.values()):
        if isinstance(style, NoParallel):
            return {pattern: style, **out}  # the whole layer replicated, adapters included
        factor = "lora_B" if isinstance(style, Colwise) else "lora_A"  # the factor that meets the split dim
        out.update({f"{pattern}.base_layer": style, f"{pattern}.{factor}.*": style})
    return out


def lora_entries(model: nn.Module, entries: Mapping[str, object],
                 as_style: Callable[[object], object]) -> dict[str, object]:
    """``entries`` (full paths in ``model``) with every entry that lands on a peft layer moved
    (module docstring): onto ``base_layer`` and the adapter factor that meets the split, or onto
    both copies of a ``modules_to_save`` wrapper; where a pattern also matches plain modules
    (``layers_to_transform``), those keep the entry by their own paths.  ``as_style``: an entry's
    value as a style (HF's strings).  Entries on no peft layer are returned as they are."""
    modules = dict(model.named_modules())
    if not any(_wrapped(m) for m in modules.values()):
        return dict(entries)
    out: dict[str, object] = {}
    for pattern, value in entries.items():
        hits = {n: m for n, m in modules.items() if path_matches(pattern, n)}
        wrapped = {n: m for n, m in hits.items() if _wrapped(m)}
        if not wrapped:
            out[pattern] = value
            continue
        style = as_style(value)
        if not isinstance(style, Style):
            raise PlanError(f"plan entry {pattern!r}: {value!r} on the peft layers {sorted(wrapped)[:3]} is not a style")
        out.update(dict.fromkeys((n for n in hits if n not in wrapped), value))
        out.update(_moved(pattern, style, wrapped))
    return out


def projection_of(fqn: str, modules: Mapping[str, nn.Module]) -> str:
    """The projection a planned module stands for: the LoRA layer whose ``base_layer`` or
    ``lora_B.<adapter>`` it is (the K/V-head count is the attention's around the layer), else itself."""
    parts = fqn.split(".")
    for cut in (1, 2)[:len(parts) - 1]:
        layer = ".".join(parts[:-cut])
        if parts[-cut] in ("base_layer", "lora_B") and is_lora(modules.get(layer, nn.Module())):
            return layer
    return fqn


def lora_view(modules: Mapping[str, nn.Module], *planned: Mapping[str, object]):
    """``modules`` and each of the ``planned`` maps (by module path) with every LoRA layer standing as
    its ``base_layer`` (the adapters dropped): the structure lint's sibling checks read, so that a
    LoRA layer's planned pieces are checked as the projection they adapt."""
    layers = {f: f"{f}.base_layer" for f, m in modules.items() if is_lora(m)}
    if not layers:
        return (modules, *planned)
    inside = tuple(f"{f}." for f in layers)
    rename = {b: f for f, b in layers.items()}

    def keep(d: Mapping[str, object]) -> dict[str, object]:
        return {rename.get(f, f): v for f, v in d.items() if not f.startswith(inside) or f in rename}
    view = {rename.get(f, f): (modules[layers[f]] if f in layers else m) for f, m in modules.items()
            if not f.startswith(inside) or f in rename}
    return (view, *(keep(d) for d in planned))
