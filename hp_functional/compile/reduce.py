"""A model's private meta copy with every stack of blocks reduced to one block of each kind.

Blocks of one kind compute the same function of their own weights, so what holds for one of them
holds for all: the shard-time checks (``compile.dataflow``, ``runtime.probe``) run on this copy,
at a cost independent of the depth.  ``names`` maps each parameter of the copy to the original
parameters it stands for.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..plan.trace import meta_copy


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


def block_kind(block: nn.Module) -> tuple:
    """What makes two blocks of a stack compute differently: their module structure (classes,
    parameter shapes) and the layer-type attributes hybrid models branch on."""
    layout = tuple((n, type(m).__name__, tuple((k, tuple(p.shape)) for k, p in m._parameters.items() if p is not None))
                   for n, m in block.named_modules())
    return (layout, *(str(getattr(block, a, None)) for a in ("attention_type", "layer_type", "is_sliding")))


def _library_hook(fn) -> bool:
    """Whether a module hook belongs to torch or transformers (HF records router logits and hidden
    states with hooks it installs once per model); anything else is the user's."""
    fn = getattr(fn, "func", fn)  # functools.partial
    return (getattr(fn, "__module__", None) or "").split(".")[0] in ("torch", "transformers")


def _is_block_stack(container: nn.Module) -> bool:
    children = list(container.children())
    return len(children) > 1 and all(type(c).__name__.endswith(("Layer", "Block")) for c in children)


def reduced_copy(model: nn.Module) -> Reduced:
    """A meta copy of ``model`` whose ``ModuleList``/``ModuleDict`` stacks of blocks (children named
    ``*Layer``/``*Block``) keep the first block of each kind, in order, without the user's module
    hooks (those of torch and transformers stay).  ``model`` is only read."""
    twin = meta_copy(model)
    for m in twin.modules():  # the user's hooks are the user's: a private check must not run them
        for hooks in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks):
            for key in [k for k, fn in hooks.items() if not _library_hook(fn)]:
                del hooks[key]
    renames: list[tuple[str, tuple[str, ...]]] = []  # (copy prefix, every original prefix it stands for)
    for path, container in list(twin.named_modules()):
        if not isinstance(container, (nn.ModuleList, nn.ModuleDict)) or not _is_block_stack(container):
            continue
        kinds: dict[tuple, list[str]] = {}
        for key, block in container.named_children():
            kinds.setdefault(block_kind(block), []).append(key)
        kept = [keys for keys in kinds.values()]
        if len(kept) == len(container):
            continue
        blocks = [container.get_submodule(keys[0]) for keys in kept]
        new = nn.ModuleList(blocks) if isinstance(container, nn.ModuleList) else \
            nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})
        for i, keys in enumerate(kept):
            renames.append((f"{path}.{i}" if path else str(i), tuple(f"{path}.{k}" if path else k for k in keys)))
        owner, _, attr = path.rpartition(".")
        setattr(twin.get_submodule(owner), attr, new)
    names = {}
    for name, _ in twin.named_parameters(remove_duplicate=False):
        match = next(((prefix, originals) for prefix, originals in renames if name.startswith(prefix + ".")), None)
        names[name] = [o + name[len(match[0]):] for o in match[1]] if match else [name]
    return Reduced(twin, names, tuple(renames))
