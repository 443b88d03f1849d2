"""GPipe as a function of the params: a pipeline step that ``torch.func.grad`` differentiates.

torch's schedules run the backward themselves (``torch.autograd.backward`` on each stage's
outputs), so they do not compose with ``torch.func``.  ``gpipe(apply_fn, stage, mesh, loss_fn,
microbatches)`` returns ``step(params, inputs, target)``, a plain differentiable function
on every stage: it runs the stage's forward on each micro-batch in turn, receiving its input
from the previous stage and sending its output to the next with two differentiable
point-to-point ops, and returns the stage's share of the loss (the mean micro-batch loss on the
last stage, a zero that carries the sends on the others).  Differentiating it on every rank
(``torch.func.grad(step)(params, ...)`` or ``step(...).backward()``) runs the backward
pipeline: each send's backward receives its output's gradient from the next stage, each
receive's backward sends its input's gradient to the previous one.

The backward's order across micro-batches is autograd's: on one device the engine runs the
ready node with the highest sequence number first, so every stage takes the micro-batches
backward from the last one, and the sends and receives of neighbouring stages pair up.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ..core.errors import PlanError
from ..core.host_comm import recv, send
from .pipeline import Stage, pipeline_ranks


class _Send(torch.autograd.Function):
    """Forward: send ``x`` to ``peer``, return a zero scalar (the stage's loss term).
    Backward: receive ``x``'s gradient from ``peer``."""

    @staticmethod
    def forward(x: Tensor, peer: int, group) -> Tensor:
        send(x.detach(), peer, group)
        return x.new_zeros(())

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ctx.peer, ctx.group = inputs
        ctx.shape, ctx.dtype, ctx.device = x.shape, x.dtype, x.device

    @staticmethod
    def backward(ctx, _):
        dx = torch.empty(ctx.shape, dtype=ctx.dtype, device=ctx.device)
        recv(dx, ctx.peer, ctx.group)
        return dx, None, None


class _Recv(torch.autograd.Function):
    """Forward: receive a ``shape`` tensor from ``peer``, as a function of ``anchor`` (a zero
    computed from the params, so that the backward reaches this node).  Backward: send the
    received tensor's gradient back to ``peer``."""

    @staticmethod
    def forward(anchor: Tensor, shape: tuple[int, ...], dtype: torch.dtype, peer: int, group) -> Tensor:
        x = torch.empty(shape, dtype=dtype, device=anchor.device)
        recv(x, peer, group)
        return x

    @staticmethod
    def setup_context(ctx, inputs, output):
        anchor, _, _, ctx.peer, ctx.group = inputs
        ctx.anchor = (anchor.shape, anchor.dtype)

    @staticmethod
    def backward(ctx, dx):
        send(dx, ctx.peer, ctx.group)
        return torch.zeros(ctx.anchor[0], dtype=ctx.anchor[1], device=dx.device), None, None, None, None


def _anchor(params: Mapping[str, Tensor]) -> Tensor:
    """A zero scalar that depends on the params (autograd and ``torch.func`` both track it)."""
    for p in params.values():
        if p.is_floating_point() and p.numel():
            return p.reshape(-1)[0] * 0
    raise PlanError("gpipe: the stage has no floating-point parameter to differentiate")


def gpipe(apply_fn: Callable, stage: Stage, mesh: DeviceMesh, loss_fn: Callable[[Tensor, Tensor], Tensor],
          microbatches: int, *, hidden_size: int, dtype: torch.dtype | None = None,
          pp_axis: str = "pp") -> Callable[..., Tensor]:
    """``step(params, inputs, target)`` for this rank's ``stage`` (see the module docstring).

    ``inputs``: the whole batch of token ids ``[B, S]`` (the first stage computes on it; the
    others read only its shape, which sizes the activations ``[B / microbatches, S,
    hidden_size]`` they receive); ``target``: the batch ``loss_fn(logits, target)`` compares
    with on the last stage.  Both go to every stage, so that a bad batch raises on every rank
    before any transfer.  ``dtype``: the activations' (default: the params'; set it when the
    stages compute in another, e.g. under ``hpf.fsdp(param_dtype=...)``).  Call the step on
    every rank of the pipeline.

    >>> step = hpf.gpipe(apply_fn, stage, mesh, causal_lm_loss, 4, hidden_size=config.hidden_size)
    >>> grads = torch.func.grad(step)(params, ids, ids)          # every stage: its own gradients
    """
    if not (isinstance(microbatches, int) and microbatches > 0):
        raise PlanError(f"gpipe: microbatches must be a positive int, got {microbatches!r}")
    group = mesh.get_group(pp_axis)
    peer = pipeline_ranks(mesh, pp_axis)
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
                x = _Recv.apply(anchor, (mb, seq, hidden_size), act, peer[stage.index - 1], group)
            out = apply_fn(params, **{name: x, "use_cache": False})
            out = out if isinstance(out, Tensor) else out[0]
            term = loss_fn(out, y) / microbatches if stage.is_last else _Send.apply(out, peer[stage.index + 1], group)
            total = term if total is None else total + term
        return total

    return step
