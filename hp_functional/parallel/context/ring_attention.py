"""Attention over a sequence sharded on a ``cp`` axis: ring attention and all-gather attention.

Every rank holds queries, keys and values for its positions (``parallel.context.cp_layout``) as
``[batch, heads, local_seq, head_dim]``; keys/values may have fewer heads (GQA: each serves
``heads // kv_heads`` consecutive query heads), and values another head dim than queries and
keys (DeepSeek's MLA); K and V travel as one tensor, concatenated along the head dim.  The mask is over *global* positions: causal
(query position ≥ key position) or none.

* ``ring_attention`` — the K/V block of every rank visits every rank around the ring: ``cp``
  steps, each attends to the block held (fully masked causal blocks are skipped) while the next
  block is in flight (``ppermute`` to the next rank), and the partial results are merged by their
  log-sum-exp (online softmax, as flash attention merges tiles).  The backward is a second ring
  pass carrying ``(k, v, dk, dv)``: each rank adds its queries' share of the block's key/value
  gradients and passes the block on; after ``cp`` steps the accumulated ``dk, dv`` are back home.
  Each rank holds two K/V blocks at a time whatever ``cp`` is: K/V memory does not grow with the
  CP degree.  Forward: ``cp − 1`` point-to-point steps; backward: ``cp``.
* ``allgather_attention`` — one differentiable all-gather of K/V over the axis (backward: a
  reduce-scatter of their gradients), then SDPA with the global mask: fewer, larger messages,
  but every rank holds the whole sequence's K/V (memory grows with ``cp``).

``ContextAttention`` routes a module's own ``scaled_dot_product_attention`` calls to either, so
models that call SDPA (Hugging Face's ``sdpa`` attention among them) run unchanged.
"""

from __future__ import annotations

__all__ = ["ContextAttention", "STRATEGIES"]

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._C._functorch import TransformType
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from ...core import collectives as C
from ...core.collectives import AxisGroup
from ...core.errors import PlanError
from ...core.raw_collectives import start_ppermute
from .cp_layout import cp_positions, cp_ranges


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)  # fp32 at least: softmax statistics


def _expand(x: Tensor, groups: int) -> Tensor:
    """K/V heads repeated for the query heads they serve (GQA)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _fold(dx: Tensor, groups: int) -> Tensor:
    """The transpose of ``_expand``: per-query-head gradients summed onto their K/V head."""
    return dx if groups == 1 else dx.unflatten(1, (-1, groups)).sum(2)


def _block_mask(q_ranges, k_ranges, causal: bool, device) -> tuple[bool, Tensor | None]:
    """(skip, mask) of one (query block, key block) pair: ``skip`` when every pair is masked,
    ``mask`` None when none is (True = attend)."""
    if not causal:
        return False, None
    q_lo, q_hi = min(r.start for r in q_ranges), max(r.stop for r in q_ranges) - 1
    k_lo, k_hi = min(r.start for r in k_ranges), max(r.stop for r in k_ranges) - 1
    if q_hi < k_lo:
        return True, None
    if q_lo >= k_hi:
        return False, None
    q_pos = torch.cat([torch.arange(r.start, r.stop, device=device) for r in q_ranges])
    k_pos = torch.cat([torch.arange(r.start, r.stop, device=device) for r in k_ranges])
    return False, q_pos[:, None] >= k_pos[None, :]


def _scores(q: Tensor, k: Tensor, scale: float, mask: Tensor | None) -> Tensor:
    s = (q @ k.transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, torch.finfo(s.dtype).min)


class _Ring:
    """The ring of one call: this rank's position ranges and those of the block held at step ``s``."""

    def __init__(self, q: Tensor, group: AxisGroup, layout: str, causal: bool):
        self.g, self.causal, self.device = group, causal, q.device
        self.seq = q.shape[2] * group.size
        self.layout = layout
        self.mine = cp_ranges(group.rank, self.seq, group.size, layout)

    def block(self, step: int) -> tuple[bool, Tensor | None]:
        src = (self.g.rank - step) % self.g.size
        return _block_mask(self.mine, cp_ranges(src, self.seq, self.g.size, self.layout), self.causal, self.device)


def _differentiated() -> bool:
    """Whether the backward being run is itself differentiated: a ``torch.func`` grad or jvp level
    besides the grad level running it (``jvp(grad)``, ``grad(grad)``, ``hessian``), or an eager
    backward with ``create_graph=True`` (``vjp``'s function, which cannot be told from it, too)."""
    stack = torch._C._functorch.get_interpreter_stack() or []
    if not stack:
        return torch.is_grad_enabled()
    outer = stack[:-1] if stack[-1].key() == TransformType.Grad else stack
    return any(i.key() in (TransformType.Grad, TransformType.Jvp) for i in outer)


class RingAttention(torch.autograd.Function):
    """``ring_attention`` as one autograd.Function (see the module docstring).  Its backward is the
    second ring pass, which uses the saved log-sum-exp and so is not itself differentiable; where
    it is differentiated (``grad(grad)``, ``jvp(grad)``, ``hessian``, ``create_graph=True``) the
    backward is all-gather attention's vector-Jacobian product instead: the same function (the
    same positions and mask), computed by table collectives and SDPA's differentiable math, so
    every order is exact.  Forward mode (``jvp``) is all-gather attention's jvp, for the same
    reason; ``vmap`` folds the vmapped dim into the batch (attention is batched over it)."""

    @staticmethod
    def forward(q, k, v, group: AxisGroup, layout: str, causal: bool, scale: float):
        ring, groups, dtype = _Ring(q, group, layout, causal), q.shape[1] // k.shape[1], _compute_dtype(q)
        qc, d = q.to(dtype), k.shape[-1]
        held = torch.cat([k, v], -1)  # one block in flight: K | V along the head dim
        out = lse = None
        for step in range(group.size):
            wait = start_ppermute(held, C.ring(group.size), group) if step < group.size - 1 else None
            skip, mask = ring.block(step)
            if not skip:
                kb, vb = _expand(held[..., :d].to(dtype), groups), _expand(held[..., d:].to(dtype), groups)
                s = _scores(qc, kb, scale, mask)
                lse_b = torch.logsumexp(s, -1)
                out_b = torch.exp(s - lse_b[..., None]) @ vb
                if out is None:
                    out, lse = out_b, lse_b
                else:
                    new = torch.logaddexp(lse, lse_b)
                    out = out * torch.exp(lse - new)[..., None] + out_b * torch.exp(lse_b - new)[..., None]
                    lse = new
            if wait is not None:
                held = wait()
        return out.to(q.dtype), lse

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, group, layout, causal, scale = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.save_for_forward(q, k, v)
        ctx.group, ctx.layout, ctx.causal, ctx.scale = group, layout, causal, scale
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def _same(ctx):
        """All-gather attention with this call's arguments: the function ring attention computes."""
        return lambda q, k, v: allgather_attention(q, k, v, ctx.group, layout=ctx.layout, causal=ctx.causal,
                                                   scale=ctx.scale)

    @staticmethod
    def jvp(ctx, dq, dk, dv, *_):
        primals = ctx.saved_tensors
        tangents = tuple(torch.zeros_like(x) if t is None else t for x, t in zip(primals, (dq, dk, dv), strict=True))
        return torch.func.jvp(RingAttention._same(ctx), primals, tangents)[1], None

    @staticmethod
    def vmap(info, in_dims, q, k, v, group, layout, causal, scale):
        def fold(x, dim):  # the vmapped dim into the batch: [size * B, H, S, D]
            x = x.expand(info.batch_size, *x.shape) if dim is None else x.movedim(dim, 0)
            return x.reshape(-1, *x.shape[2:])

        out, lse = RingAttention.apply(fold(q, in_dims[0]), fold(k, in_dims[1]), fold(v, in_dims[2]), group, layout,
                                       causal, scale)
        return (out.unflatten(0, (info.batch_size, -1)), lse.unflatten(0, (info.batch_size, -1))), (0, 0)

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if _differentiated():  # a derivative of the backward is wanted: the same function's, differentiable
            return (*torch.func.vjp(RingAttention._same(ctx), q, k, v)[1](dout), None, None, None, None)
        with torch.no_grad():
            return RingAttention._ring_backward(ctx, dout, q, k, v, out, lse)

    @staticmethod
    def _ring_backward(ctx, dout, q, k, v, out, lse):
        g, scale = ctx.group, ctx.scale
        ring, groups, dtype = _Ring(q, g, ctx.layout, ctx.causal), q.shape[1] // k.shape[1], _compute_dtype(q)
        qc, do = q.to(dtype), dout.to(dtype)
        delta = (do * out.to(dtype)).sum(-1, keepdim=True)
        dq = torch.zeros_like(qc)
        d, kv = k.shape[-1], k.shape[-1] + v.shape[-1]  # held: K | V | dK | dV along the head dim
        held = torch.cat([k.to(dtype), v.to(dtype), torch.zeros_like(k, dtype=dtype), torch.zeros_like(v, dtype=dtype)], -1)
        for step in range(g.size):
            skip, mask = ring.block(step)
            if not skip:
                kb, vb = _expand(held[..., :d], groups), _expand(held[..., d:kv], groups)
                p = torch.exp(_scores(qc, kb, scale, mask) - lse[..., None])
                ds = p * (do @ vb.transpose(-1, -2) - delta)
                dq = dq + (ds @ kb) * scale
                grads = torch.cat([_fold(ds.transpose(-1, -2) @ qc, groups) * scale,
                                   _fold(p.transpose(-1, -2) @ do, groups)], -1)
                held = torch.cat([held[..., :kv], held[..., kv:] + grads], -1)
            # the block moves on with its gradients; after the last step only the gradients travel (home)
            held = C.ppermute(held if step < g.size - 1 else held[..., kv:].contiguous(), C.ring(g.size), g)
        return dq.to(q.dtype), held[..., :d].to(k.dtype), held[..., d:].to(v.dtype), None, None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: AxisGroup, *, layout: str = "zigzag",
                   causal: bool = True, scale: float | None = None) -> Tensor:
    """Attention of this rank's queries to every rank's keys/values, K/V blocks passed around
    the ring (see the module docstring).  ``q``, ``k``: ``[B, H, S_local, D]``, ``[B, H_kv, S_local, D]``,
    ``H % H_kv == 0``; ``v``: ``[B, H_kv, S_local, D_v]``; positions from ``layout``."""
    _check_heads(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return RingAttention.apply(q, k, v, group, layout, causal, scale)[0]


def allgather_attention(q: Tensor, k: Tensor, v: Tensor, group: AxisGroup, *, layout: str = "zigzag",
                        causal: bool = True, scale: float | None = None) -> Tensor:
    """Attention after one all-gather of K/V over the axis (backward: reduce-scatter), masked
    over global positions; SDPA is the local kernel (its math backend on CPU: a composite of
    differentiable ops, so derivatives of every order are exact)."""
    _check_heads(q, k, v)
    seq = q.shape[2] * group.size
    kv = C.all_gather(torch.cat([k, v], -1), 2, group)  # [B, H_kv, seq, D + D_v] in rank order
    d = k.shape[-1]
    mask = None
    if causal:
        q_pos = cp_positions(group.rank, seq, group.size, layout, device=q.device)
        k_pos = torch.cat([cp_positions(r, seq, group.size, layout, device=q.device) for r in range(group.size)])
        mask = q_pos[:, None] >= k_pos[None, :]
    with sdpa_kernel(SDPBackend.MATH) if q.device.type == "cpu" else contextlib.nullcontext():
        return F.scaled_dot_product_attention(q, kv[..., :d], kv[..., d:], attn_mask=mask, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])


def _check_heads(q: Tensor, k: Tensor, v: Tensor) -> None:
    if (q.dim() != 4 or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1] or k.shape[1] == 0
            or q.shape[1] % k.shape[1]):
        raise ValueError(f"context-parallel attention needs q [B, H, S, D], k [B, H_kv, S, D] and v [B, H_kv, S, D_v] "
                         f"with H % H_kv == 0; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")


def _sliding_window(module) -> int | None:
    """An HF attention module's sliding window (its own attribute, else its config's), or None."""
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    return getattr(getattr(module, "config", None), "sliding_window", None)


#: The attention strategies a ``ContextParallel`` entry may name.
STRATEGIES: dict[str, Callable[..., Tensor]] = {"ring": ring_attention, "allgather": allgather_attention}


class ContextAttention(TorchFunctionMode):
    """Inside a module's forward: its ``scaled_dot_product_attention`` calls become the
    strategy's attention over the whole (sharded) sequence; every other call runs unchanged.

    The module's own ``attn_mask`` was built for the local chunk, so it is not used: the mask
    is causal over global positions when ``causal`` says so (None: the call's ``is_causal``,
    or, when the call passes a mask, the module's ``is_causal`` attribute — Hugging Face
    attention modules have one).  K/V that the caller repeated for GQA (its K/V heads equal
    to the query heads while the module states ``num_key_value_groups > 1``) are taken once per
    group, so the ring carries each K/V head once; the repeat's backward sums their gradients.
    A sliding window shorter than the sequence raises (a window at least as long is causal)."""

    def __init__(self, module, group: AxisGroup, strategy: str, layout: str, causal: bool | None, fqn: str):
        super().__init__()
        self.module, self.group, self.fqn = module, group, fqn
        self.attend, self.layout, self.causal = STRATEGIES[strategy], layout, causal
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not F.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        self.calls += 1
        return self._attention(*args, **(kwargs or {}))

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
        if dropout_p:
            raise PlanError(f"{self.fqn}: attention dropout (dropout_p={dropout_p}) is not supported under context "
                            "parallelism; set the model's attention dropout to 0 or call it in eval mode")
        causal = self.causal
        if causal is None:
            module_causal = getattr(self.module, "is_causal", None)
            if attn_mask is not None and module_causal is None:
                raise PlanError(f"{self.fqn}: the module passes its own attention mask to SDPA, which under context "
                                "parallelism covers only the local chunk; state the mask: ContextParallel(causal=True "
                                "or False)")
            causal = bool(is_causal or (attn_mask is not None and module_causal))
        window = _sliding_window(self.module)
        if window is not None and query.shape[2] * self.group.size > window:
            raise PlanError(f"{self.fqn}: a sliding-window attention (window {window}) over a sequence of "
                            f"{query.shape[2] * self.group.size} positions is not supported under context parallelism; "
                            "only full causal or unmasked attention is")
        groups = int(getattr(self.module, "num_key_value_groups", 1) or 1)
        if groups > 1 and key.shape[1] == query.shape[1]:  # repeated by the caller: each K/V head once
            key, value = key[:, ::groups], value[:, ::groups]
        return self.attend(query, key, value, self.group, layout=self.layout, causal=causal, scale=scale)
