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
from ..core.host_comm import all_gather_objects
from .pipeline import Stage

_transformed = torch._C._are_functorch_transforms_active
_functorch = torch._C._functorch


def _anchor(params: Mapping[str, Tensor]) -> Tensor:
    """A zero scalar that depends on the params (autograd and ``torch.func`` both track it)."""
    for p in params.values():
        if p.is_floating_point() and p.numel():
            return p.reshape(-1)[0] * 0
    raise PlanError("gpipe: the stage has no floating-point parameter to differentiate")


def _carry(params: Mapping[str, Tensor], inputs: Tensor, target: Tensor) -> Tensor:
    """Under ``torch.func``: a zero scalar that depends on every param, ``inputs`` and ``target``,
    so that it carries every transform level any of them carries (batched under ``vmap``, a
    tangent under ``jvp``, tracked under ``grad``).  Each transfer is made as wrapped as it: a
    receive is a function of it, a send adds it, and a send's token is multiplied by ``1 + carry``
    (so the token's cotangent, the anchor of the backward's receive, carries it too).  Then both
    ends of every transfer, forward and backward, hold the same levels on every stage, whatever
    the stage's own values depend on."""
    zero = _anchor(params)
    for p in params.values():
        if p.is_floating_point() and p.numel():
            zero = zero + p.reshape(-1)[0] * 0
    for t in (inputs, target):
        zero = zero + t.reshape(-1)[0].to(zero.dtype) * 0
    return zero


def _levels(x: Tensor) -> tuple[tuple, ...]:
    """The ``torch.func`` levels wrapping ``x``, outermost first: ``("vmap", level, batch size)``
    or ``("grad/jvp", level)``."""
    out = []
    while (level := _functorch.maybe_get_level(x)) != -1:
        inner = _functorch.get_unwrapped(x)
        if _functorch.is_batchedtensor(x):
            out.append(("vmap", level, inner.shape[_functorch.maybe_get_bdim(x)]))
        else:
            out.append(("grad/jvp", level))
        x = inner
    return tuple(out)


def _agree_levels(carry: Tensor, pp_group, stage: Stage) -> None:
    """Under ``torch.func``, every stage's values must carry the same transforms (a receive takes
    a tangent or a batch only if its send gives one): one small exchange of the levels over the
    pipeline axis, and a ``PlanError`` on every stage if they differ (rather than a hang)."""
    mine = _levels(carry)
    with torch._C._DisableFuncTorch():  # the exchange's own tensors are not the transforms' to wrap
        every = all_gather_objects(mine, group=pp_group)
    if any(theirs != mine for theirs in every):
        raise PlanError(f"gpipe under torch.func: the stages' params/inputs/target carry different transforms "
                        f"(per stage, outermost first: {every}); a transfer between stages must be transformed alike "
                        "at both ends: apply the transform (grad, jvp, vmap and their in_dims) to every stage's step "
                        f"alike (this is stage {stage.index})")


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
    group = _stage_group(mesh, pp_axis, stage, microbatches)
    name = "input_ids" if stage.is_first else "inputs_embeds"
    pp_group = mesh.get_group(pp_axis)

    def step(params: Mapping[str, Tensor], inputs: Tensor, target: Tensor) -> Tensor:
        _check_batch(inputs, target, microbatches)
        mb, seq = inputs.shape[0] // microbatches, inputs.shape[1]
        transformed = _transformed()
        carry = _carry_of(params, inputs, target, transformed, pp_group, stage)
        anchor = None if stage.is_first else _anchor(params) if carry is None else carry
        act = dtype or (None if anchor is None else anchor.dtype)
        chunks = inputs.chunk(microbatches) if stage.is_first else [None] * microbatches
        targets = target.chunk(microbatches) if stage.is_last else [None] * microbatches
        total = None
        for x, y in zip(chunks, targets, strict=True):
            if not stage.is_first:
                x = recv_from(anchor.to(act), (mb, seq, hidden_size), stage.index - 1, group)
            out = apply_fn(params, **{name: x, "use_cache": False})
            out = out if isinstance(out, Tensor) else out[0]
            if stage.is_last:
                term = loss_fn(out, y) / microbatches
            else:
                term = _send(out, stage, group, carry, transformed)
            total = term if total is None else total + term
        return total

    return step


def _stage_group(mesh: DeviceMesh, pp_axis: str, stage: Stage, microbatches: int) -> AxisGroup:
    """The pipeline axis' group, once ``microbatches`` is a positive int and ``stage`` is this rank's
    coordinate on ``pp_axis`` (else a ``PlanError``, raised when ``gpipe`` is called)."""
    if not (isinstance(microbatches, int) and microbatches > 0):
        raise PlanError(f"gpipe: microbatches must be a positive int, got {microbatches!r}")
    group = AxisGroup.from_mesh(mesh, pp_axis)
    if group.rank != stage.index:
        raise PlanError(f"gpipe: this rank is stage {group.rank} of mesh axis {pp_axis!r}, but its stage is {stage.index}")
    return group


def _check_batch(inputs: Tensor, target: Tensor, microbatches: int) -> None:
    """A ``PlanError`` on every stage, before any transfer, unless ``inputs`` is ``[batch, seq, ...]`` with the
    batch divisible into ``microbatches`` and ``target`` a tensor with the same batch."""
    if inputs.dim() < 2 or inputs.shape[0] % microbatches:
        raise PlanError(f"gpipe: inputs {tuple(inputs.shape)} must be [batch, seq, ...] with the batch divisible "
                        f"into {microbatches} micro-batches")
    if not isinstance(target, Tensor) or target.shape[0] != inputs.shape[0]:
        raise PlanError(f"gpipe: target must be a tensor with the batch of inputs ({inputs.shape[0]}), got "
                        f"{tuple(target.shape) if isinstance(target, Tensor) else type(target).__name__}")


def _carry_of(params: Mapping[str, Tensor], inputs: Tensor, target: Tensor, transformed: bool, pp_group,
              stage: Stage) -> Tensor | None:
    """What the stage's transfers carry: under ``torch.func`` (``transformed``) every transform level of the
    params, ``inputs`` and ``target`` (``_carry``; the stages agree on the levels first); else, where a backward
    will run and the stage sends, the anchor that a double backward (``.backward(create_graph=True)``)
    reaches through the token; else None."""
    if transformed:
        carry = _carry(params, inputs, target)
        _agree_levels(carry, pp_group, stage)
        return carry
    if torch.is_grad_enabled() and not stage.is_last:
        return _anchor(params)
    return None


def _send(out: Tensor, stage: Stage, group: AxisGroup, carry: Tensor | None, transformed: bool) -> Tensor:
    """This micro-batch's send to the next stage, as its token; with a ``carry`` the token is multiplied by
    ``1 + carry`` (so the backward's receive is anchored on it), and under ``torch.func`` (``transformed``) the
    activations sent add it too (``_carry``)."""
    if carry is None:
        return send_to(out, stage.index + 1, group)
    sent = out + carry.to(out.dtype) if transformed else out
    return send_to(sent, stage.index + 1, group) * (1 + carry)
