"""Private copies for the analyses: a module's copy on meta (or fake, or valued) tensors without the
user's hooks, inputs moved the same way, and call arguments snapshotted as new empty tensors.  The
user's module and inputs are only read (``analysis.trace``, ``compile.reduced_copy``,
``runtime.rng_layout`` and the pipeline's trace build on these)."""

from __future__ import annotations

__all__ = ["meta_copy", "snapshot", "to_meta"]

import copy
from collections.abc import Mapping

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode


def meta_copy(module: nn.Module, shapes: Mapping[str, torch.Size] | None = None, device: str = "meta",
              values: bool = False) -> nn.Module:
    """A deep copy of ``module`` whose parameters and buffers are meta tensors (at ``shapes``, by
    name, where given), without the user's module hooks (a private check must not run them; those
    of torch and transformers, which record router logits and hidden states, stay); ``module``
    itself is only read.  Under a ``FakeTensorMode``, ``device="cpu"`` makes them fake CPU tensors
    instead (no storage either, but code that checks the device runs: ``trace_model``'s fallback).
    ``values``: real tensors on ``device`` holding the module's values (zeros for meta ones)."""
    shapes = shapes or {}
    memo: dict[int, object] = {}
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        if id(t) not in memo:
            meta = _valued(t, device) if values else torch.empty(shapes.get(name, t.shape), dtype=t.dtype, device=device)
            memo[id(t)] = nn.Parameter(meta, requires_grad=False) if isinstance(t, nn.Parameter) else meta
    twin = copy.deepcopy(module, memo)
    for m in twin.modules():
        for hooks in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks):
            for key in [k for k, fn in hooks.items() if not _library_hook(fn)]:
                del hooks[key]
    return twin


def _valued(t: Tensor, device: str) -> Tensor:
    """A copy of ``t`` on ``device`` with its values; zeros of its shape for a meta tensor."""
    if t.device.type == "meta":
        return torch.zeros(t.shape, dtype=t.dtype, device=device)
    return t.detach().to(device, copy=True)


def _library_hook(fn) -> bool:
    """Whether a module hook belongs to torch or transformers; anything else is the user's."""
    fn = getattr(fn, "func", fn)  # functools.partial
    return (getattr(fn, "__module__", None) or "").split(".")[0] in ("torch", "transformers")


def to_meta(obj, device: str = "meta", values: bool = False):
    """``obj`` with every tensor replaced by an empty one of its shape on ``device`` (meta, or a
    fake one); with ``values``, by a copy holding its values (``_valued``)."""
    if isinstance(obj, Tensor):
        return _valued(obj, device) if values else torch.empty(obj.shape, dtype=obj.dtype, device=device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_meta(o, device, values) for o in obj)
    if isinstance(obj, dict):
        return {k: to_meta(v, device, values) for k, v in obj.items()}
    return obj


class _EmptyCopies(TorchFunctionMode):
    """Deep copies of tensors as new empty ones of their shapes (meta or fake tensors have no data
    to keep; deep-copying a fake one reads its data pointer, which corrupts memory)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is Tensor.__deepcopy__:
            return torch.empty(args[0].shape, dtype=args[0].dtype, device=args[0].device)
        return func(*args, **(kwargs or {}))


def snapshot(obj):
    """A deep copy of ``obj`` (module call arguments: the trace's own meta or fake tensors, nested
    in objects such as a flex-attention mask too) with its tensors new and empty."""
    try:
        with _EmptyCopies():
            return copy.deepcopy(obj)
    except Exception:  # noqa: BLE001 - an argument that cannot be copied is replayed as it is
        return obj
