"""A model's private meta copy with every stack of blocks reduced to one block of each kind.

Blocks of one kind compute the same function of their own weights, so what holds for one of them
holds for all: the shard-time checks (``compile.dataflow``, ``runtime.probe``) run on this copy,
at a cost independent of the depth.  ``names`` maps each parameter of the copy to the original
parameters it stands for.
"""

from __future__ import annotations

__all__ = ["Reduced", "plan_marks", "reduced_copy", "reduced_plan"]

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..analysis.copies import meta_copy, to_meta
from ..core.paths import most_specific, path_matches
from ..core.placement import ShardInfo
from ..core.program import Boundary
from ..plan.plan import ShardingPlan


@dataclass
class Reduced:
    """The reduced copy (meta tensors) and, per copy FQN, the original FQNs it stands for."""

    model: nn.Module
    names: dict[str, list[str]]
    renames: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (copy prefix, the original prefixes it stands for)

    def original(self, name: str) -> str:
        """The first original path a parameter/buffer/module path of the copy stands for."""
        for prefix, originals in self.renames:
            if name == prefix or name.startswith(prefix + "."):
                return originals[0] + name[len(prefix):]
        return name


def block_kind(block: nn.Module, marks: Mapping[str, str] = {}) -> tuple:  # read only
    """What makes two blocks of a stack compute differently: their module structure (classes,
    parameter shapes), the layer-type attributes hybrid models branch on (on the block or any module
    in it), and how the plan treats them (``marks``: path relative to the block → the style or placement the plan gives it)."""
    layout = tuple((n, type(m).__name__, tuple((k, tuple(p.shape)) for k, p in m._parameters.items() if p is not None))
                   for n, m in block.named_modules())
    planned = tuple(sorted(marks.items()))
    kinds = ("attention_type", "layer_type", "is_sliding", "sliding_window")  # on the block or in it (Gemma 3's attention)
    return (layout, planned, *(str(getattr(m, a, None)) for m in block.modules() for a in kinds))


def plan_marks(boundaries: Sequence[Boundary], infos: Mapping[str, ShardInfo], leaf_of: Mapping[str, str]) -> dict[str, str]:
    """Module or parameter path → how a compiled plan treats it (its style, its placements): blocks
    the plan treats differently are different kinds, however alike their structure."""
    marks = {fqn: repr(infos[key].placements) for fqn, key in leaf_of.items()}
    marks.update({b.planned.fqn: repr(b.planned.style) for b in boundaries})
    return marks


def _within(marks: Mapping[str, str], prefix: str) -> dict[str, str]:
    return {k[len(prefix) + 1:]: v for k, v in marks.items() if k.startswith(prefix + ".")}


def _is_block_stack(container: nn.Module) -> bool:
    children = list(container.children())
    return len(children) > 1 and all(type(c).__name__.endswith(("Layer", "Block")) for c in children)


def reduced_copy(model: nn.Module, marks: Mapping[str, str] | None = None,
                 inputs: tuple[tuple, dict] | None = None, keep: int | None = 1) -> Reduced:
    """A meta copy of ``model`` whose ``ModuleList``/``ModuleDict`` stacks of blocks (children named
    ``*Layer``/``*Block``) keep the first block of each kind (``block_kind``, ``marks`` from
    ``plan_marks``), in order, without the user's module hooks (those of torch and transformers
    stay).  ``model`` is only read.

    Where ``inputs`` (``(args, kwargs)``, a batch the model takes) are given, the reduction is
    checked on meta tensors: the copy's forward must run and call a stand-in of every module the
    whole model's forward calls.  A forward whose control flow counts its layers (Granite Speech's
    CTC head run after layer ``num_hidden_layers // 2``) or that chains blocks of one kind at
    different widths breaks a one-block copy; then two blocks of each kind are kept, else none is
    dropped (the checks then cost the whole model's depth).  ``keep``: the blocks of each kind to
    start from (None: none dropped)."""
    whole: set[str] | None = None
    for level in (1, 2) if keep == 1 else (keep,) if keep else ():
        reduced = _reduced(model, marks or {}, level)
        if inputs is None or not reduced.renames:
            return reduced
        whole = whole if level > 1 else called_modules(meta_copy(model), inputs)
        if whole is None or _stands_in(reduced, inputs, whole):
            return reduced
    return Reduced(meta_copy(model), {name: [name] for name, _ in model.named_parameters(remove_duplicate=False)})


def called_modules(model: nn.Module, inputs: tuple[tuple, dict]) -> set[str] | None:
    """The paths of the modules ``model``'s forward calls on ``inputs`` (as meta tensors; ``model``
    a meta copy), or None where that forward does not run on meta tensors."""
    called: set[str] = set()
    handles = [m.register_forward_pre_hook(lambda *_, path=path: called.add(path)) for path, m in model.named_modules()]
    try:
        with torch.no_grad():
            model(*to_meta(inputs[0]), **to_meta(inputs[1]))
    except Exception:  # noqa: BLE001 - meta-hostile code (a data-dependent branch): the reduction is not checked
        return None
    finally:
        for h in handles:
            h.remove()
    return called


def _stands_in(reduced: Reduced, inputs: tuple[tuple, dict], whole: set[str]) -> bool:
    """Whether ``reduced``'s forward runs on ``inputs`` and calls the stand-in of every module of ``whole``."""
    called = called_modules(reduced.model, inputs)
    if called is None:
        return False
    stand_in = {o: copy for copy, originals in reduced.renames for o in originals}

    def in_copy(path: str) -> str:
        parts = path.split(".")
        for n in range(len(parts), 0, -1):
            prefix = ".".join(parts[:n])
            if prefix in stand_in:
                return ".".join([stand_in[prefix], *parts[n:]])
        return path

    return all(in_copy(path) in called for path in whole)


def _reduced(model: nn.Module, marks: Mapping[str, str], keep: int) -> Reduced:
    """``reduced_copy`` keeping the first ``keep`` blocks of each kind, unchecked."""
    twin = meta_copy(model)  # without the user's hooks
    renames: list[tuple[str, tuple[str, ...]]] = []  # (copy prefix, every original prefix it stands for)
    for path, container in list(twin.named_modules()):
        if not isinstance(container, (nn.ModuleList, nn.ModuleDict)) or not _is_block_stack(container):
            continue
        try:  # a stack inside a block an enclosing stack dropped (UnivNet's resblocks.2.convs) is gone with it
            if twin.get_submodule(path) is not container:
                continue
        except AttributeError:
            continue
        kinds: dict[tuple, list[str]] = {}
        for key, block in container.named_children():
            full = f"{path}.{key}" if path else key
            kinds.setdefault(block_kind(block, _within(marks, full)), []).append(key)
        kept = [(key, keys if i == keep - 1 or i == len(keys) - 1 else [key]) for keys in kinds.values()
                for i, key in enumerate(keys[:keep])]  # the last kept block of a kind stands for the rest
        if len(kept) == len(container):
            continue
        kept.sort(key=lambda k: list(container._modules).index(k[0]))
        blocks = [container.get_submodule(key) for key, _ in kept]
        new = nn.ModuleList(blocks) if isinstance(container, nn.ModuleList) else \
            nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})
        for i, (_, keys) in enumerate(kept):
            renames.append((f"{path}.{i}" if path else str(i), tuple(f"{path}.{k}" if path else k for k in keys)))
        owner, _, attr = path.rpartition(".")
        setattr(twin.get_submodule(owner), attr, new)
        if isinstance(container, nn.ModuleList):
            _renumber(twin, path, [int(key) for key, _ in kept], len(container))
    names = {}
    for name, _ in twin.named_parameters(remove_duplicate=False):
        match = next(((prefix, originals) for prefix, originals in renames if name.startswith(prefix + ".")), None)
        names[name] = [o + name[len(match[0]):] for o in match[1]] if match else [name]
    return Reduced(twin, names, tuple(renames))


#: config fields that count a stack's blocks
_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_decoder_layers", "encoder_layers",
           "decoder_layers", "depth")
#: a block's attributes that hold its index in the stack
_INDEX = ("layer_idx", "layer_id", "layer_index", "layer_number")


def _renumber(twin: nn.Module, path: str, kept: list[int], total: int) -> None:
    """Keep the config of the stack at ``path`` in step with the blocks kept (``kept``: their original
    indices, of ``total``): its block count, every per-layer list (``layer_types``, ``mlp_layer_types``,
    ...: a list or string of ``total`` entries whose name says layer, block or pattern) cut to the
    kept entries, every list of layer indices mapped to the kept ones, and each kept block's own
    index attributes renumbered — the model's forward zips them with its layers and resolves
    ``hidden_states`` indices by its config's count.  The copy's config is its own (``meta_copy``)."""
    config = next((c for c in _configs_above(twin, path) if any(getattr(c, n, None) == total for n in _COUNTS)), None)
    if config is not None:
        for name, value in list(vars(config).items()):
            if name in _COUNTS and value == total:
                setattr(config, name, len(kept))
            elif isinstance(value, (list, tuple, str)) and len(value) == total and \
                    any(w in name for w in ("layer", "block", "pattern")):
                cut = [value[k] for k in kept]
                setattr(config, name, "".join(cut) if isinstance(value, str) else type(value)(cut))
            elif isinstance(value, (list, tuple)) and value and "layer" in name and \
                    all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < total for v in value):
                setattr(config, name, type(value)(i for i, k in enumerate(kept) if k in value))
    container = twin.get_submodule(path)
    for i, (k, block) in enumerate(zip(kept, container, strict=True)):
        for module in block.modules():
            for attr in _INDEX:
                if getattr(module, attr, None) == k and not isinstance(getattr(module, attr), bool):
                    setattr(module, attr, i)


def _configs_above(twin: nn.Module, path: str) -> list:
    """The configs of the modules enclosing ``path``, nearest first (each module's ``config``)."""
    parts, found = path.split("."), []
    for n in range(len(parts), -1, -1):
        config = getattr(twin.get_submodule(".".join(parts[:n])), "config", None)
        if config is not None and hasattr(config, "to_dict") and all(config is not c for c in found):
            found.append(config)
    return found


def reduced_plan(plan: ShardingPlan, model: nn.Module, reduced: Reduced, axes: Sequence[str]) -> ShardingPlan:
    """``plan`` restated for the reduced copy: each module of the copy gets the style the plan gives
    the original it stands for (exact paths: a pattern naming a dropped or renumbered block still
    reaches its stand-in), special handlers likewise; the plan's settings are kept."""
    chosen = {path: most_specific(path, cands)[1] for path, cands in plan.candidates(model, tuple(axes)).items()}
    entries = {path: chosen[o] for path, _ in reduced.model.named_modules() if (o := reduced.original(path)) in chosen}
    handlers = {}
    for name, _ in reduced.model.named_parameters(remove_duplicate=False):
        o = reduced.original(name)
        hit = next((h for pattern, h in plan.special_handlers.items() if path_matches(pattern, o)), None)
        if hit is not None:
            handlers[name] = hit
    return plan.with_entries(entries, special_handlers=handlers)
