"""What a model output is differentiated by: ``scalar_loss`` (``loss_fn``, HF's ``out.loss``, else
the sum of the first output tensor), and how outputs are keyed (``output_items``).  Used by
``validate`` and ``explain``.  (The vocab-parallel loss itself is ``parallel.tensor.vocab``.)
"""

from __future__ import annotations

__all__ = ["output_items", "scalar_loss"]

from collections.abc import Callable, Mapping

from torch import Tensor

from ..core.errors import PlanError


def scalar_loss(out: object, loss_fn: Callable[[object], Tensor] | None = None, who: str = "the model") -> Tensor:
    """The scalar to differentiate a model output by: ``loss_fn(out)``, else HF's ``out.loss``,
    else the sum of the first output tensor (the tensor itself, element 0 of a tuple, or the
    first value of a mapping).  Used by ``validate`` and ``explain``."""
    if loss_fn is not None:
        value = loss_fn(out)
    elif isinstance(getattr(out, "loss", None), Tensor):
        value = out.loss
    else:
        first = first_tensor(out)
        if first is None:
            raise PlanError(f"{who} returned {type(out).__name__} with no tensor to differentiate; pass loss_fn=")
        value = first.float().sum()
    if not isinstance(value, Tensor) or value.numel() != 1:
        raise PlanError(f"the loss of {who} must be a scalar tensor, got {type(value).__name__}; pass loss_fn=")
    return value


def output_items(out: object) -> list[tuple[object, object]]:
    """A module output keyed as ``ModuleSpec`` keys outputs ("output": the tensor, or element 0)."""
    if isinstance(out, Tensor):
        return [("output", out)]
    if isinstance(out, Mapping):
        return list(out.items())
    if isinstance(out, (tuple, list)):
        return [("output" if i == 0 else i, v) for i, v in enumerate(out)]
    return []


def first_tensor(out: object) -> Tensor | None:
    """The first tensor of ``output_items(out)``, looking into nested tuples, lists and mappings
    (MGP-STR's logits are a tuple of three), if any."""
    for _, v in output_items(out):
        found = v if isinstance(v, Tensor) else first_tensor(v) if isinstance(v, (tuple, list, Mapping)) else None
        if found is not None:
            return found
    return None
