"""Ghost norms: per-example gradient norms of Linear, Embedding, Conv and norm layers from each
layer's input and output gradient, without materialising a per-example gradient (the "ghost
clipping" of Li et al. 2022 and Opacus' fast gradient clipping), for ``hpf.clip_per_example``.

How it stays exact.  The call runs on a private skeleton (``Runtime.build`` over shallow copies of
the pristine template) whose ruled leaf modules have a *tapped* forward: it computes the layer with
the parameter taken from this call's ``_Taps`` (never from the module's slot) and passes the output
through ``_Tap``, whose backward turns (input, output gradient) into the example's squared norm and
hands it out as the gradient of a zero scalar ``z_i`` given to example ``i``.  A ghost leaf's whole
gradient therefore flows through its taps, and the run checks what else could add to it: each ghost
leaf read once per forward (a layer called twice, a tied weight), its tap reached whenever its module
is called (a style computing with a function of its own) and batched there (an output the same for
every example), and nothing using the slot the model sees (a weight read outside its layer: the slot
holds a view of the leaf, whose gradient must be None).  A leaf that fails a check, or has no rule
(HF's RMSNorm, a fused expert weight, a parameter converted in the forward: a replicated weight in
rank-varying compute, whose gradient the backward all-reduces), is a *delta* leaf: example ``i`` binds
``p + d_i`` with ``d`` zeros of shape ``[n, *p.shape]``, so ``d``'s gradient is each example's
gradient of ``p`` through every use (the vmap path restricted to those leaves; ``_ExactLookups``
keeps a padded lookup of such a batched weight exact).

One forward and one backward: the backward of ``sum_i loss_i`` to ``z`` and the deltas (no weight
gradient computed) gives the squared norms and books each tapped layer's (input, output gradient);
the clipped mean is then one product per layer of the booked output gradients weighted by
``c_i / B`` with its inputs ("book-keeping", Bu et al. 2023), and ``sum_i c_i d_i / B`` per delta
leaf.  TP-aware as the vmap path: a rule sees its layer's local input and output gradient (inside
the boundary's collectives), so a sharded weight's local squared norm is summed over the model axes
by the caller, a replicated leaf counted on its owner.
"""

from __future__ import annotations

__all__ = ["GhostRun", "ghost_batches"]

import copy
import dataclasses
import inspect
import math
import types
from collections.abc import Callable, Mapping, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ..core.errors import PlanError
from ..core.facets import ReducedOver, SummedOver
from ..core.module_kinds import is_conv1d
from ..core.placement import ShardInfo

# ---------------------------------------------------------------- the rules (a leading example dim)


def _pairs(a: Tensor, g: Tensor, counted: tuple[bool, bool]) -> Tensor:
    """Per example, ||sum_t g_t a_t^T||^2 (weight) + ||sum_t g_t||^2 (bias) of the tokens ``a`` [B, T, in],
    ``g`` [B, T, out]: by the Gram matrices where 2 T^2 <= in * out (no [out, in] per example), else by
    the per-example gradient itself (the cheaper of the two, as Opacus picks)."""
    a, g = a.float(), g.float()
    sq = g.new_zeros(g.shape[0])
    if counted[0]:
        t, n_in, n_out = a.shape[1], a.shape[2], g.shape[2]
        if 2 * t * t <= n_in * n_out:
            sq = sq + (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))
        else:
            sq = sq + torch.bmm(g.transpose(1, 2), a).square().sum((1, 2))
    if counted[1]:
        sq = sq + g.sum(1).square().sum(1)
    return sq


def _linear_sq(rule: _Rule, x: Tensor, g: Tensor) -> Tensor:
    n = x.shape[0]
    return _pairs(x.reshape(n, -1, x.shape[-1]), g.reshape(n, -1, g.shape[-1]), rule.counted)


def _embedding_sq(rule: _Rule, ids: Tensor, g: Tensor) -> Tensor:
    """Per example, ||sum over tokens of g_t scattered to row ids_t||^2: the tokens sorted by id, each
    run of one id summed by differences of a cumulative sum (O(T dim), no [V, dim] per example)."""
    n = ids.shape[0]
    if not rule.counted[0]:  # a replica another rank counts
        return g.new_zeros(n, dtype=torch.float32)
    ids, g = ids.reshape(n, -1), g.reshape(n, -1, g.shape[-1]).float()
    if rule.config["padding_idx"] is not None:  # the padding row gets no gradient
        g = g * (ids != rule.config["padding_idx"]).unsqueeze(-1)
    ids, order = ids.sort(1)
    csum = g.gather(1, order.unsqueeze(-1).expand_as(g)).cumsum(1)
    last = torch.cat([ids[:, 1:] != ids[:, :-1], ids.new_ones(n, 1, dtype=torch.bool)], 1)  # a run's last token
    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    ends = torch.where(last, pos, -1)
    before = torch.cat([ends.new_full((n, 1), -1), ends[:, :-1]], 1).cummax(1).values  # the previous run's end
    prev = csum.gather(1, before.clamp(min=0).unsqueeze(-1).expand_as(csum)) * (before >= 0).unsqueeze(-1)
    return ((csum - prev) * last.unsqueeze(-1)).square().sum((1, 2))


def _norm_tokens(rule: _Rule, x: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """LayerNorm / RMSNorm: the normalised input x̂ and ``g`` as [B, tokens, features], in float32."""
    shape, eps = rule.config["shape"], rule.config["eps"]
    if rule.kind == "layer_norm":
        xhat = F.layer_norm(x.float(), shape, None, None, eps)
    else:
        xhat = F.rms_norm(x.float(), shape, None, torch.finfo(x.dtype).eps if eps is None else eps)
    n, size = x.shape[0], math.prod(shape)
    return xhat.reshape(n, -1, size), g.reshape(n, -1, size).float()


def _norm_sq(rule: _Rule, x: Tensor, g: Tensor) -> Tensor:
    """LayerNorm / RMSNorm: the weight's gradient is sum_t g_t * x̂_t, the bias's sum_t g_t."""
    xhat, g = _norm_tokens(rule, x, g)
    sq = g.new_zeros(g.shape[0])
    if rule.counted[0]:
        sq = sq + (g * xhat).sum(1).square().sum(1)
    if rule.counted[1]:
        sq = sq + g.sum(1).square().sum(1)
    return sq


def _conv_sq(rule: _Rule, x: Tensor, g: Tensor) -> Tensor:
    """Conv1d/2d (groups 1): the input unfolded to [positions, C_in * kernel] is a Linear's."""
    return _pairs(*_conv_tokens(rule, x, g), rule.counted)


def _conv_tokens(rule: _Rule, x: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """A convolution's input unfolded, [B, positions, C_in * kernel], and ``g`` as [B, positions, C_out]."""
    c = rule.config
    dims, n = len(c["kernel"]), x.shape[0]
    if x.dim() == dims + 2:  # each example unbatched: [B, C, *spatial]
        x, g = x.unsqueeze(1), g.unsqueeze(1)
    x, g = x.flatten(0, 1), g.flatten(0, 1)  # [B * N, C, *spatial]
    if dims == 1:  # as a 2-d convolution of height 1
        x, g = x.unsqueeze(-2), g.unsqueeze(-2)
        kernel, dilation, padding, stride = ((0 if k == "padding" else 1, *c[k])
                                             for k in ("kernel", "dilation", "padding", "stride"))
    else:
        kernel, dilation, padding, stride = (c[k] for k in ("kernel", "dilation", "padding", "stride"))
    cols = F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)  # [B * N, C_in * K, L]
    a = cols.transpose(1, 2).reshape(n, -1, cols.shape[1])
    return a, g.flatten(2).transpose(1, 2).reshape(n, -1, g.shape[1])


_SQ = {"linear": _linear_sq, "conv1d_hf": _linear_sq, "embedding": _embedding_sq, "layer_norm": _norm_sq,
       "rms_norm": _norm_sq, "conv": _conv_sq}


# ---------------------------------------------------------------- the clipped gradients (book-keeping)


def _linear_grads(rule: _Rule, x: Tensor, g: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """(weight, bias) gradients of the batch from ``g`` already weighted per example."""
    a, g = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    return (g.T @ a if rule.kind == "linear" else a.T @ g), g.sum(0)  # HF's Conv1D: weight [in, out]


def _embedding_grads(rule: _Rule, ids: Tensor, g: Tensor, weight: Tensor) -> tuple[Tensor, None]:
    ids, g = ids.reshape(-1), g.reshape(-1, g.shape[-1])
    if rule.config["padding_idx"] is not None:
        g = g * (ids != rule.config["padding_idx"]).unsqueeze(-1)
    return g.new_zeros(weight.shape).index_add_(0, ids, g), None


def _norm_grads(rule: _Rule, x: Tensor, g: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    xhat, g = _norm_tokens(rule, x, g)
    return (g * xhat).sum((0, 1)), g.sum((0, 1))


def _conv_grads(rule: _Rule, x: Tensor, g: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    a, g = _conv_tokens(rule, x, g)
    a, g = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
    return g.T @ a, g.sum(0)


_GRADS = {"linear": _linear_grads, "conv1d_hf": _linear_grads, "embedding": _embedding_grads,
          "layer_norm": _norm_grads, "rms_norm": _norm_grads, "conv": _conv_grads}


# ---------------------------------------------------------------- the tapped forwards


def _forward(rule: _Rule, module: nn.Module, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """The layer's own forward with ``w``, ``b`` (as its class computes it)."""
    kind = rule.kind
    if kind == "linear":
        return F.linear(x, w, b)
    if kind == "conv1d_hf":  # HF's Conv1D: weight [in, out]
        return torch.addmm(b, x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[-1])
    if kind == "embedding":
        return F.embedding(x, w, module.padding_idx)
    if kind == "layer_norm":
        return F.layer_norm(x, module.normalized_shape, w, b, module.eps)
    if kind == "rms_norm":
        return F.rms_norm(x, module.normalized_shape, w, module.eps)
    return module._conv_forward(x, w, b)


class _Tap(torch.autograd.Function):
    """Identity on a layer's output ``y`` (one example's, under the examples' vmap).  Its vmap rule
    hands the batch to ``_Measure``; where ``y`` or ``z`` is not batched there (an output the same
    for every example, a vmap of the caller's own), the layer's ghost leaves are marked unmeasured
    and the call starts again with them on the delta path."""

    @staticmethod
    def forward(y: Tensor, x: Tensor, z: Tensor, rule: _Rule, taps: _Taps) -> Tensor:
        taps.unmeasured.update(k for k, g in zip(rule.keys, rule.ghost, strict=True) if g)  # outside any vmap
        return y.view_as(y)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, g: Tensor):
        return g, None, None, None, None

    @staticmethod
    def vmap(info, in_dims, y: Tensor, x: Tensor, z: Tensor, rule: _Rule, taps: _Taps):
        ydim, xdim, zdim = in_dims[:3]
        if ydim is None or zdim is None or z.dim() != 1:
            taps.unmeasured.update(k for k, g in zip(rule.keys, rule.ghost, strict=True) if g)
            return y, ydim
        y = y.movedim(ydim, 0)
        x = x.movedim(xdim, 0) if xdim is not None else x.expand(y.shape[0], *x.shape)
        return _Measure.apply(y, x, z.movedim(zdim, 0), rule, taps), 0


class _Measure(torch.autograd.Function):
    """``_Tap`` on the whole batch: identity on ``y`` [B, ...]; its backward returns each example's
    squared norm of the layer's counted leaves as the gradient of ``z`` [B], and books the layer's
    input and output gradient for the clipped gradient (``GhostRun.clipped``)."""

    @staticmethod
    def forward(y: Tensor, x: Tensor, z: Tensor, rule: _Rule, taps: _Taps) -> Tensor:
        return y.view_as(y)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _, x, z, rule, taps = inputs
        ctx.save_for_backward(x)
        ctx.rule, ctx.taps, ctx.z_dtype = rule, taps, z.dtype

    @staticmethod
    def backward(ctx, g: Tensor):
        (x,) = ctx.saved_tensors
        ctx.taps.book.append((ctx.rule, x, g))  # for the clipped gradient, once the coefficients are known
        return g, None, _SQ[ctx.rule.kind](ctx.rule, x, g).to(ctx.z_dtype), None, None


@dataclasses.dataclass(frozen=True, eq=False)
class _Rule:
    """One ruled module: its kind, the leaf keys of (weight, bias) (None: absent), which of them are
    ghost leaves (read from the taps) and which this rank counts (owned ghost leaves), its config."""

    kind: str
    keys: tuple[str | None, str | None]
    ghost: tuple[bool, bool]
    counted: tuple[bool, bool]
    config: Mapping[str, object]


class _Taps:
    """One call's state, passed to its tapped forwards by closure: the ghost leaves' tensors, the
    current examples' ``z``, what the backward booked, and how often each ghost leaf was read."""

    def __init__(self):
        self.values: Mapping[str, Tensor] = {}
        self.z: Tensor | None = None
        self.book: list[tuple[_Rule, Tensor, Tensor]] = []  # (rule, input, output gradient) per measured call
        self.reads: dict[str, int] = {}  # ghost leaf -> tapped reads
        self.calls: dict[str, int] = {}  # ruled module -> calls (its pre-hook)
        self.unmeasured: set[str] = set()

    def param(self, rule: _Rule, i: int, bound: Tensor | None) -> Tensor | None:
        key = rule.keys[i]
        if key is None or not rule.ghost[i]:
            return bound
        self.reads[key] = self.reads.get(key, 0) + 1
        return self.values[key]


def _called(taps: _Taps, fqn: str, *_) -> None:
    taps.calls[fqn] = taps.calls.get(fqn, 0) + 1


def _tapped(rule: _Rule, taps: _Taps, signature: inspect.Signature) -> Callable:
    """The class's forward through the taps (its ``signature``, so that boundaries bind its argument)."""
    name = list(signature.parameters)[1]

    def forward(self: nn.Module, *args, **kwargs) -> Tensor:
        x = args[0] if args else kwargs[name]
        w = taps.param(rule, 0, self.weight)
        b = taps.param(rule, 1, getattr(self, "bias", None))
        spec = dataclasses.replace(rule, config=_config(rule.kind, self))  # the skeleton's (local) attributes
        return _Tap.apply(_forward(rule, self, x, w, b), x, taps.z, spec, taps)

    forward.__signature__ = signature
    return forward


class _ExactLookups(TorchFunctionMode):
    """Around the examples' forward: ``F.embedding`` with a ``padding_idx`` as the padding row's
    gradient-free lookup written out (the same values; no gradient at padding tokens).  torch 2.13's
    batching rule for an embedding whose weight is batched (a delta leaf's ``p + d_i``) flattens the
    examples' tables and keeps the padding row of the first example only, so the others' per-example
    gradients would get the padding rows' gradient.  ``scale_grad_by_freq`` has no such rewrite: refused."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.embedding:
            return func(*args, **kwargs)
        names = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
        call = {**dict(zip(names, args, strict=False)), **kwargs}
        if call.get("scale_grad_by_freq"):
            raise PlanError("clip_per_example: an embedding with scale_grad_by_freq=True has no exact per-example "
                            "gradient on the ghost path; use method='vmap'")
        pad = call.pop("padding_idx", None)
        if pad is None:
            return func(**call)
        ids, weight = call["input"], call["weight"]
        pad = pad if pad >= 0 else pad + weight.shape[0]
        out = func(**call)
        return torch.where((ids == pad).unsqueeze(-1), out.detach(), out)


# ---------------------------------------------------------------- which modules have a rule


def _kind(m: nn.Module) -> str | None:
    """The rule of a module computed by its class's own forward, or None (a subclass's forward, an
    instance's, parameters besides weight/bias, options the rules do not cover)."""
    cls = type(m)
    if "forward" in vars(m) or not set(m._parameters) <= {"weight", "bias"} or m._parameters.get("weight") is None:
        return None
    if isinstance(m, nn.Linear) and cls.forward is nn.Linear.forward:
        return "linear"
    if is_conv1d(m) and cls.forward.__qualname__ == "Conv1D.forward" and m._parameters.get("bias") is not None:
        return "conv1d_hf"
    if isinstance(m, nn.Embedding) and cls.forward is nn.Embedding.forward:
        return "embedding" if m.max_norm is None and not m.scale_grad_by_freq and not m.sparse else None
    if isinstance(m, nn.LayerNorm) and cls.forward is nn.LayerNorm.forward:
        return "layer_norm"
    if isinstance(m, nn.RMSNorm) and cls.forward is nn.RMSNorm.forward:
        return "rms_norm"
    for conv in (nn.Conv1d, nn.Conv2d):
        if isinstance(m, conv) and cls.forward is conv.forward:
            ok = m.groups == 1 and m.padding_mode == "zeros" and not isinstance(m.padding, str)
            return "conv" if ok else None
    return None


def _config(kind: str, m: nn.Module) -> dict[str, object]:
    if kind == "embedding":
        return {"padding_idx": m.padding_idx}
    if kind in ("layer_norm", "rms_norm"):
        return {"shape": tuple(m.normalized_shape), "eps": m.eps}
    if kind == "conv":
        return {k: tuple(getattr(m, a)) for k, a in (("kernel", "kernel_size"), ("dilation", "dilation"),
                                                     ("padding", "padding"), ("stride", "stride"))}
    return {}


def _plain(key: str | None, program, infos: Mapping[str, ShardInfo], users: Mapping[str, int]) -> bool:
    """Whether a leaf's gradient is its one layer's local one: one parameter path, no conversion in
    the forward (a replicated leaf in rank-varying compute is all-reduced in the backward), no
    gradient summed over other ranks (``ReducedOver``, ``SummedOver``)."""
    if key is None or key not in infos or users.get(key, 0) != 1 or program.param_steps.get(key):
        return False
    return not infos[key].axes_of(ReducedOver) and not infos[key].axes_of(SummedOver)


def _rules(template: nn.Module, program, infos: Mapping[str, ShardInfo], owned: frozenset[str],
           excluded: frozenset[str]) -> dict[str, _Rule]:
    """The ruled modules of ``template`` (by path) with at least one ghost leaf.  A module whose
    style computes with a function of its own (``own_forward`` False: ``Local``, the vocab-parallel
    embedding) never calls the tapped forward: its leaves are delta leaves from the start."""
    users: dict[str, int] = {}
    for key in program.leaf_of.values():
        users[key] = users.get(key, 0) + 1
    opaque = {b.planned.fqn for b in program.boundaries if not b.planned.style.own_forward}
    out = {}
    for fqn, m in template.named_modules():
        kind = _kind(m)
        if kind is None or fqn in opaque:
            continue
        keys = tuple(program.leaf_of.get(f"{fqn}.{n}" if fqn else n) if m._parameters.get(n) is not None else None
                     for n in ("weight", "bias"))
        ghost = tuple(k not in excluded and _plain(k, program, infos, users) for k in keys)
        if any(ghost):
            counted = tuple(g and k in owned for g, k in zip(ghost, keys, strict=True))
            out[fqn] = _Rule(kind, keys, ghost, counted, {})
    return out


def _retemplated(module: nn.Module, path: str, rules: Mapping[str, _Rule], taps: _Taps,
                 signatures: dict[type, inspect.Signature]) -> nn.Module:
    """``module`` with the ruled modules under it swapped for shallow copies whose ``forward`` is
    tapped, and their ancestors for shallow copies holding them; the rest (and the pristine template
    itself) shared and untouched.  ``Runtime.build`` deep-copies the result into a skeleton."""
    prefix = f"{path}." if path else ""
    if path not in rules and not any(p.startswith(prefix) for p in rules if p != path):
        return module
    out = copy.copy(module)
    out._modules = {name: None if child is None else _retemplated(child, prefix + name, rules, taps, signatures)
                    for name, child in module._modules.items()}
    if path in rules:
        cls = type(module)
        if cls not in signatures:
            signatures[cls] = inspect.signature(cls.forward)
        out.forward = types.MethodType(_tapped(rules[path], taps, signatures[cls]), out)
    return out


# ---------------------------------------------------------------- one call


@dataclasses.dataclass
class _Chunk:
    """Pass 1's forward over one chunk: the losses, and what its backward differentiates."""

    losses: Tensor
    z: Tensor
    deltas: dict[str, Tensor]
    views: dict[str, Tensor]


class GhostRun:
    """``hpf.clip_per_example``'s ghost path on one private skeleton: ``run`` returns the clipped
    mean's gradients (of ``local``'s leaves) and the per-example norms, or the leaves that must move
    to the delta path (read twice, or used outside their layer), with which the caller starts again."""

    def __init__(self, runtime, infos: Mapping[str, ShardInfo], owned: frozenset[str],
                 excluded: frozenset[str] = frozenset()):
        self.taps = _Taps()
        self.rules = _rules(runtime.template, runtime.program, infos, owned, excluded)
        template = _retemplated(runtime.template, "", self.rules, self.taps, {})
        self.apply_fn = dataclasses.replace(runtime, template=template).build(install=self._count_calls)
        self.ghost = frozenset(k for r in self.rules.values() for k, g in zip(r.keys, r.ghost, strict=True) if g)
        self.delta = tuple(k for k in infos if k not in self.ghost)
        self.owned, self.excluded = owned, excluded

    def release(self) -> None:
        """Drop what the call left on the taps (its leaves, booked activations), so a kept run holds no
        tensor of a past step."""
        taps = self.taps
        taps.values, taps.z, taps.book, taps.reads, taps.calls, taps.unmeasured = {}, None, [], {}, {}, set()

    def forward(self, loss_fn: Callable, local: Mapping[str, Tensor], chunk, n: int, acc: torch.dtype) -> _Chunk:
        """``loss_i`` of each example of ``chunk`` (under vmap), the ghost leaves read from the taps,
        the owned delta leaves as ``p + d_i``."""
        device = next(iter(local.values())).device
        z = torch.zeros(n, dtype=acc, device=device, requires_grad=True)
        deltas = {k: torch.zeros((n, *local[k].shape), dtype=local[k].dtype, device=device, requires_grad=True)
                  for k in self.delta}
        views = {k: local[k].view_as(local[k]) for k in self.ghost}  # the slots: a use outside the layer shows
        taps = self.taps
        taps.values, taps.reads, taps.calls, taps.unmeasured, taps.book = local, {}, {}, set(), []

        def one(example, zi, d):
            taps.z = zi
            p = {k: views[k] if k in views else local[k] + d[k] if k in d else local[k] for k in local}
            return loss_fn(self.apply_fn, p, example)

        try:
            with _ExactLookups():
                losses = torch.func.vmap(one, randomness="error")(chunk, z, deltas)
        finally:
            taps.z = None
        return _Chunk(losses, z, deltas, views)

    def _count_calls(self, skeleton: nn.Module, cache: object) -> None:
        """On this run's own skeleton (``Runtime.build``'s installer): count each ruled module's calls."""
        for fqn in self.rules:
            skeleton.get_submodule(fqn).register_forward_pre_hook(partial(_called, self.taps, fqn))

    def reread(self) -> frozenset[str]:
        """Ghost leaves the last forward read more than once (a layer called twice, a shared module),
        could not measure (a layer whose output is the same for every example), or never read although
        their module was called (a style whose local forward is a function of its own)."""
        reads, taps = self.taps.reads, self.taps
        bypassed = (k for fqn, r in self.rules.items() if taps.calls.get(fqn, 0) > 0
                    for k, g in zip(r.keys, r.ghost, strict=True) if g and reads.get(k, 0) == 0)
        return frozenset(k for k, c in reads.items() if c > 1) | frozenset(taps.unmeasured) | frozenset(bypassed)

    def squared_norms(self, c: _Chunk, n: int) -> tuple[Tensor, frozenset[str], dict[str, Tensor]]:
        """One backward of the summed loss to ``z`` and the deltas only (no weight gradient): each
        example's local squared norm over the owned leaves, the ghost leaves whose slot got a gradient
        (used outside their layer), and each delta leaf's per-example gradients."""
        inputs = [c.z, *c.deltas.values(), *c.views.values()]
        if c.losses.requires_grad:
            grads = torch.autograd.grad(c.losses.sum(), inputs, allow_unused=True)
        else:  # a loss that no leaf reaches
            grads = (None,) * len(inputs)
        gz, gd, gv = grads[0], grads[1:1 + len(c.deltas)], grads[1 + len(c.deltas):]
        outside = frozenset(k for k, g in zip(c.views, gv, strict=True) if g is not None)
        sq = torch.zeros_like(c.z) if gz is None else gz.detach()
        per_example = {}
        for k, g in zip(c.deltas, gd, strict=True):
            if g is None:
                continue
            per_example[k] = g
            if k in self.owned:
                sq = sq + torch.linalg.vector_norm(g.reshape(n, -1), 2, dim=1, dtype=sq.dtype).square()
        return sq, outside, per_example

    def clipped(self, per_example: Mapping[str, Tensor], local: Mapping[str, Tensor], weights: Tensor) -> dict[str, Tensor]:
        """``sum_i w_i g_i`` for every leaf, from what the backward booked (ghost leaves: one product per
        layer, no second backward) and the delta leaves' per-example gradients."""
        out: dict[str, Tensor] = {}
        for rule, x, g in self.taps.book:
            w = weights.to(g.dtype).view(-1, *([1] * (g.dim() - 1)))
            pair = _GRADS[rule.kind](rule, x, g * w, self.taps.values[rule.keys[0]])
            for key, ghost, grad in zip(rule.keys, rule.ghost, pair, strict=True):
                if ghost and grad is not None:
                    grad = grad.reshape(local[key].shape).to(local[key].dtype)
                    out[key] = grad if key not in out else out[key] + grad
        self.taps.book = []
        for k, g in per_example.items():
            out[k] = (g * weights.to(g.dtype).view(-1, *([1] * (g.dim() - 1)))).sum(0)
        return {k: out[k] if k in out else torch.zeros_like(v) for k, v in local.items()}


def ghost_batches(batch, size: int, chunk: int) -> Sequence[tuple[object, int]]:
    """``batch`` in chunks of ``chunk`` examples: (the chunk, its size)."""
    return [(pytree.tree_map(lambda t, s=s: t[s:s + chunk], batch), min(chunk, size - s)) for s in range(0, size, chunk)]
