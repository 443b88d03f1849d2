"""GPipe as a function of the params (``gpipe``): a pipeline step that ``torch.func.grad``
differentiates, its stages linked by ``core.collectives.send_to``/``recv_from``, whose backwards
are each other's (torch's schedules run their own backward, so they do not compose with
``torch.func``).  See docs/pipeline.md#the-pipeline-under-torchfunc-hpfgpipe.
"""

from __future__ import annotations

__all__ = ["gpipe"]

from collections.abc import Callable, Mapping

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ..core.collectives import AxisGroup, recv_from, send_to
from ..core.errors import PlanError
from .pipeline import Stage


def _anchor(params: Mapping[str, Tensor]) -> Tensor:
    """A zero scalar that depends on the params (autograd and ``torch.func`` both track it)."""
    for p in params.values():
        if p.is_floating_point() and p.numel():
            return p.reshape(-1)[0] * 0
    raise PlanError("gpipe: the stage has no floating-point parameter to differentiate")


def gpipe(apply_fn: Callable, stage: Stage, mesh: DeviceMesh, loss_fn: Callable[[Tensor, Tensor], Tensor],
          microbatches: int, *, hidden_size: int, dtype: torch.dtype | None = None,
          pp_axis: str = "pp") -> Callable[..., Tensor]:
    """``step(params, inputs, target)`` for this rank's ``stage``: GPipe's forward, one micro-batch after the
    other, received from the previous stage and sent to the next; differentiating it on every rank
    (``torch.func.grad`` or ``.backward()``) runs the backward pipeline.

    Args:
        apply_fn: this stage's, from ``shard_stage`` (and ``fsdp``).
        stage: this rank's stage; its index must be this rank's coordinate on ``pp_axis``.
        mesh: the mesh holding ``pp_axis``.
        loss_fn: ``loss_fn(logits, target)`` of one micro-batch, on the last stage.
        microbatches: how many micro-batches the batch is cut into (it must divide the batch).
        hidden_size: the last dim of the activations between stages.
        dtype: the activations' dtype (None: the params'; set it when the stages compute in another, e.g.
            under ``hpf.fsdp(param_dtype=...)``).
        pp_axis: the pipeline's mesh axis.

    Returns:
        ``step(params, inputs, target)``, to call on every rank of the pipeline.  ``inputs``: the whole batch
        of token ids ``[B, S]`` (the first stage computes on it; the others read only its shape, which sizes
        the activations ``[B / microbatches, S, hidden_size]`` they receive); ``target``: what ``loss_fn``
        compares with on the last stage.  Both go to every stage, so that a bad batch raises on every rank
        before any transfer.  It returns the mean micro-batch loss on the last stage, on the others a zero
        that carries their sends.

    >>> step = hpf.gpipe(apply_fn, stage, mesh, causal_lm_loss, 4, hidden_size=config.hidden_size)
    >>> grads = torch.func.grad(step)(params, ids, ids)          # every stage: its own gradients
    """
    if not (isinstance(microbatches, int) and microbatches > 0):
        raise PlanError(f"gpipe: microbatches must be a positive int, got {microbatches!r}")
    group = AxisGroup.from_mesh(mesh, pp_axis)
    if group.rank != stage.index:
        raise PlanError(f"gpipe: this rank is stage {group.rank} of mesh axis {pp_axis!r}, but its stage is {stage.index}")
    name = "input_ids" if stage.is_first else "inputs_embeds"

    def step(params: Mapping[str, Tensor], inputs: Tensor, target: Tensor) -> Tensor:
        if inputs.dim() < 2 or inputs.shape[0] % microbatches:
            raise PlanError(f"gpipe: inputs {tuple(inputs.shape)} must be [batch, seq, ...] with the batch divisible "
                            f"into {microbatches} micro-batches")
        if not isinstance(target, Tensor) or target.shape[0] != inputs.shape[0]:
            raise PlanError(f"gpipe: target must be a tensor with the batch of inputs ({inputs.shape[0]}), got "
                            f"{tuple(target.shape) if isinstance(target, Tensor) else type(target).__name__}")
        mb, seq = inputs.shape[0] // microbatches, inputs.shape[1]
        anchor = None if stage.is_first else _anchor(params)
        act = dtype or (None if anchor is None else anchor.dtype)
        chunks = inputs.chunk(microbatches) if stage.is_first else [None] * microbatches
        targets = target.chunk(microbatches) if stage.is_last else [None] * microbatches
        total = None
        for x, y in zip(chunks, targets, strict=True):
            if not stage.is_first:
                x = recv_from(anchor.to(act), (mb, seq, hidden_size), stage.index - 1, group)
            out = apply_fn(params, **{name: x, "use_cache": False})
            out = out if isinstance(out, Tensor) else out[0]
            term = loss_fn(out, y) / microbatches if stage.is_last else send_to(out, stage.index + 1, group)
            total = term if total is None else total + term
        return total

    return step
