"""Loss-parallel cross-entropy over vocab-sharded logits (never materialises the full logits).

Per row: the max is agreed across ranks (a detached all-gather: any common shift is exact),
the sum of exponentials and the target logit (fetched by the rank that owns it, zero
elsewhere) are summed with ``reduce_from`` — the loss is replicated, so each rank's partial
term receives the full gradient.  Everything is built from this package's collectives, so it
works under ``.backward()``, ``torch.func.grad`` and ``vmap``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ..core import collectives as C


def vocab_parallel_cross_entropy(
    local_logits: Tensor,
    labels: Tensor,
    mesh: DeviceMesh | C.AxisGroup,
    axis: str = "tp",
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    vocab_start: int | None = None,
) -> Tensor:
    """``F.cross_entropy(full_logits, labels)`` where each rank holds ``local_logits[..., V_r]``,
    its contiguous slice of the vocabulary starting at ``vocab_start`` (found with one tiny
    all-gather when None; slices may differ in size).  ``labels`` has ``local_logits.shape[:-1]``."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    g = mesh if isinstance(mesh, C.AxisGroup) else C.AxisGroup.from_mesh(mesh, axis)
    v_local = local_logits.shape[-1]
    if vocab_start is None:
        sizes = C.raw_all_gather(torch.tensor([v_local], device=local_logits.device), 0, g).tolist()
        vocab_start, vocab_size = sum(sizes[: g.rank]), sum(sizes)
    else:
        vocab_size = None
    logits = local_logits if local_logits.dtype == torch.float64 else local_logits.float()  # fp32 at least

    local_max = logits.detach().amax(-1, keepdim=True)
    shift = C.all_gather(local_max, -1, g).amax(-1)  # detached: the same constant on every rank
    sum_exp = C.reduce_from(torch.exp(logits - shift.unsqueeze(-1)).sum(-1), g)
    lse = torch.log(sum_exp) + shift

    local_label = labels - vocab_start
    owned = (local_label >= 0) & (local_label < v_local)
    picked = logits.gather(-1, torch.where(owned, local_label, 0).unsqueeze(-1)).squeeze(-1)
    target = C.reduce_from(picked * owned.to(picked.dtype), g)
    loss = lse - target
    if label_smoothing:
        if vocab_size is None:
            vocab_size = int(C.raw_all_reduce(torch.tensor([v_local], device=logits.device), g).item())
        mean_logit = C.reduce_from(logits.sum(-1), g) / vocab_size
        loss = (1 - label_smoothing) * loss + label_smoothing * (lse - mean_logit)

    valid = labels != ignore_index
    loss = loss * valid.to(loss.dtype)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum()


def causal_lm_loss(local_logits: Tensor, labels: Tensor, group: C.AxisGroup, vocab_start: int) -> Tensor:
    """HF's causal-LM loss (labels shifted left, -100 ignored, mean) on vocab-sharded logits."""
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    return vocab_parallel_cross_entropy(local_logits, shifted, group, vocab_start=vocab_start)


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
            raise TypeError(f"{who} returned {type(out).__name__} with no tensor; pass loss_fn=")
        value = first.float().sum()
    if not isinstance(value, Tensor) or value.numel() != 1:
        raise TypeError(f"the loss of {who} must be a scalar tensor, got {type(value).__name__}")
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
    """The first tensor of ``output_items(out)``, if any."""
    return next((v for _, v in output_items(out) if isinstance(v, Tensor)), None)
