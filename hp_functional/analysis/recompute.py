"""Modules whose forward a model's own code recomputes in the backward, found from the Python stack
while a forward traces: a custom ``torch.autograd.Function`` that calls modules in its ``forward``
(Reformer's reversible layers) or ``torch.utils.checkpoint`` in the model's code re-runs those
modules in the backward and reads their parameters then — after ``apply_fn`` has returned and put
the skeleton's meta placeholders back.  Hugging Face's own checkpointing does not run in the traces
(it checkpoints only where a gradient is taken; ``shard()`` also turns it off on the skeleton:
``runtime.remat``).  Read at shard time only.
"""

from __future__ import annotations

__all__ = ["watch_recomputed"]

import sys
from collections.abc import Callable

import torch
from torch import nn
from torch.autograd.function import FunctionCtx

_CHECKPOINT_FILE = "torch/utils/checkpoint.py"


def _function_class(frame) -> type | None:
    """The ``torch.autograd.Function`` whose ``forward`` this frame runs, else None."""
    code = frame.f_code
    if code.co_name != "forward":
        return None
    ctx = frame.f_locals.get("ctx")
    if isinstance(ctx, FunctionCtx):  # the classic form: forward(ctx, ...)
        owner = getattr(type(ctx), "_forward_cls", None)
        return owner if isinstance(owner, type) else None
    obj = frame.f_globals.get(code.co_qualname.split(".")[0])  # forward(...) with setup_context
    for part in code.co_qualname.split(".")[1:-1]:
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) and issubclass(obj, torch.autograd.Function) else None


def recomputing_code(depth: int = 96) -> str | None:
    """The name of the code on the current stack that will recompute what runs now in the backward
    (a custom ``autograd.Function``'s qualified name, ``torch.utils.checkpoint``), else None."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        checkpoint = frame.f_code.co_filename.replace("\\", "/").endswith(_CHECKPOINT_FILE)
        cls = None if checkpoint else _function_class(frame)
        if checkpoint and frame.f_code.co_name == "checkpoint":
            return "torch.utils.checkpoint.checkpoint"
        if cls is not None:
            return f"{cls.__module__}.{cls.__qualname__}"
        frame = frame.f_back
    return None


def watch_recomputed(model: nn.Module) -> tuple[dict[str, str], Callable[[], None]]:
    """Hooks on every module of ``model`` holding parameters that need a gradient: the dict they fill
    (module path → the code that recomputes it, ``recomputing_code``) and a function removing them."""
    found: dict[str, str] = {}
    handles = []
    for path, module in model.named_modules():
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            def pre(_module, _args, path=path):
                if path not in found and (code := recomputing_code()) is not None:
                    found[path] = code
            handles.append(module.register_forward_pre_hook(pre))

    def remove() -> None:
        for h in handles:
            h.remove()
    return found, remove
