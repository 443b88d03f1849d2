"""Functional optimizers over the params pytree, in optax's shape: pure ``init``/``update`` equal to
``torch.optim.AdamW``/``SGD`` op for op, schedules, masks and groups by FQN, and where the state sits
(``state_info``).  Mask and group patterns follow the package's one pattern rule (``core.paths``,
docs/plan-language.md#patterns).  See docs/training.md#optimizers (and why not torchopt).

>>> opt = hpf.optim.adamw(hpf.optim.warmup_cosine(3e-4, 100, 10_000), weight_decay=0.1,
...                       mask=hpf.optim.decay_mask())
>>> state = opt.init(params)
>>> params, state = opt.update(grads, state, params)
"""

from __future__ import annotations

__all__ = [
    "AdamWState", "Grads", "Mask", "MuonState", "Optimizer", "Params", "PartitionState", "PatternMask", "SGDState",
    "Schedule", "ZeroState", "adamw", "constant", "decay_mask", "linear_warmup", "muon", "partition", "replicated_info", "sgd",
    "state_info", "warmup_cosine", "zero", "zero_info"
]

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor
from torch.distributed.tensor import Replicate

from ..core.buckets import BUCKET_BYTES
from ..core.collectives import AxisGroup
from ..core.errors import PlanError, ShapeError
from ..core.paths import most_specific_patterns
from ..core.placement import ShardInfo
from .optim_masks import Mask, PatternMask, decay_mask, mask_fn
from .optim_muon import NS_COEFFICIENTS, adjusted_lr, check_muon, is_matrix, orthogonalized
from .optim_schedules import Schedule, check_lr, constant, linear_warmup, lr_at, warmup_cosine
from .optim_zero import agree_stepped, gather_rows, row_infos, rows_of, scatter_rows

Params = Mapping[str, Tensor]
Grads = Mapping[str, Tensor | None]


class Optimizer(NamedTuple):
    """A pair of pure functions (optax's ``GradientTransformation``, returning params rather than updates).

    ``init(params) -> state``; ``update(grads, state, params) -> (new_params, new_state)``.

    A ``None`` gradient leaves its parameter and its state as they were, as torch skips a parameter
    without ``.grad``.  ``step`` is one count for all leaves, so a leaf whose gradient is ``None`` on
    some steps and not on others gets the bias correction (AdamW) or the first-step momentum rule
    (SGD, matters only with ``dampening``) of the global step, where torch counts per parameter;
    leaves that always or never have a gradient match torch exactly."""

    init: Callable[[Params], Any]
    update: Callable[[Grads, Any, Params], tuple[dict[str, Tensor], Any]]


class AdamWState(NamedTuple):
    """``step``: updates taken (0-dim int64, CPU); ``mu``/``nu``: first/second moments, keyed like the params."""

    step: Tensor
    mu: dict[str, Tensor]
    nu: dict[str, Tensor]


class SGDState(NamedTuple):
    """``step``: updates taken (0-dim int64, CPU); ``momentum``: the buffers, keyed like the params
    (empty without momentum)."""

    step: Tensor
    momentum: dict[str, Tensor]


class MuonState(NamedTuple):
    """``step``: updates taken (0-dim int64, CPU); ``momentum``: Muon's buffers of the matrix leaves,
    keyed like the params; ``rest``: the state of the optimizer of the other leaves (``muon``'s ``rest``)."""

    step: Tensor
    momentum: dict[str, Tensor]
    rest: Any


class ZeroState(NamedTuple):
    """``over``: ``{axis: the inner optimizer's state over this rank's rows of every leaf}`` (the axis a
    key, so the pytree says where the state sits: ``state_info`` reads it)."""

    over: dict[str, Any]


class PartitionState(NamedTuple):
    """Each pattern's sub-optimizer state, over the leaves that pattern claims."""

    states: dict[str, Any]


# ---------------------------------------------------------------- schedules
# ---------------------------------------------------------------- checks and foreach helpers
def _check(where: str, grads: Grads, params: Params, **state: Mapping[str, Tensor]) -> None:
    """Grads and every per-leaf state dict keyed exactly like ``params``, with its shapes; errors name the key."""
    if not isinstance(grads, Mapping) or not isinstance(params, Mapping):
        raise TypeError(f"{where}: grads and params must be dicts FQN -> tensor, got {type(grads).__name__} "
                        f"and {type(params).__name__}")
    for what, d in (("grads", grads), *state.items()):
        missing, extra = [k for k in params if k not in d], [k for k in d if k not in params]
        if missing or extra:
            raise PlanError(f"{where}: {what} and params have different keys: missing from {what} {missing[:5]}, "
                            f"not in params {extra[:5]}")
        for k, t in d.items():
            if t is not None and tuple(t.shape) != tuple(params[k].shape):
                raise ShapeError(f"{where}: {what}[{k!r}] has shape {tuple(t.shape)} but params[{k!r}] has "
                                 f"{tuple(params[k].shape)}")


def _state_type(state: Any, cls: type, where: str) -> None:
    if not isinstance(state, cls):
        raise TypeError(f"{where}: state is a {type(state).__name__}, not the {cls.__name__} this optimizer's init returns")


def _groups(keys: list[str], params: Params) -> list[list[str]]:
    """``keys`` grouped by their parameter's (device, dtype), in first-seen order (one foreach call each)."""
    groups: dict[tuple[torch.device, torch.dtype], list[str]] = {}
    for k in keys:
        groups.setdefault((params[k].device, params[k].dtype), []).append(k)
    return list(groups.values())


def _mul(xs: list[Tensor], s: float | Tensor) -> list[Tensor]:
    """``[x * s for x in xs]``; one foreach call unless ``s`` is a tensor that requires grad (torch 2.13's
    ``_foreach_mul(list, Tensor)`` has no usable backward with respect to the scalar)."""
    if isinstance(s, Tensor):
        if s.requires_grad:
            return [x * s for x in xs]
        s = s.to(xs[0].device) if xs and xs[0].device.type != "cpu" else s
    return list(torch._foreach_mul(xs, s))


# The step convention is torch's and optax's: ``step`` counts the updates taken; the k-th update (k = 0, 1, ...)
# uses ``lr = schedule(k)`` (``LambdaLR`` before its first ``scheduler.step()`` gives lambda(0)) and Adam's bias
# correction with t = k + 1 (torch's per-parameter ``state["step"]`` after its increment).  The scalars (bias
# corrections, step sizes) are Python floats computed from ``int(step)``, as torch's default (non-capturable)
# path does; a tensor ``lr`` makes the lr-dependent ones tensors.  Reading ``int(step)`` means an update cannot
# be captured in a CUDA graph (torch's ``capturable=True``); an update under ``torch.compile`` is untested.
def _step_of(state_step: Tensor) -> int:
    """Updates taken so far, as a Python int (the step lives on the CPU: no device sync)."""
    return int(state_step)


def _new_step(step: int) -> Tensor:
    return torch.tensor(step, dtype=torch.int64)


# ---------------------------------------------------------------- AdamW
def adamw(
    lr: float | Tensor | Schedule = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
    weight_decay: float = 1e-2, mask: Mask = None, *, maximize: bool = False,
) -> Optimizer:
    """AdamW (decoupled weight decay), equal to ``torch.optim.AdamW`` with the same arguments.

    ``lr``: a float, a 0-dim tensor (differentiable) or a schedule ``step -> lr``, called with the
    update's index as a Python int (see ``warmup_cosine``).
    ``mask``: which leaves get weight decay — ``None`` (all, torch's default), a callable ``fqn -> bool``,
    or FQN patterns of the FQNs that decay, under the one pattern rule (docs/plan-language.md#patterns;
    ``decay_mask()`` excludes biases and norms); the same as two torch param groups, one with
    ``weight_decay=0``."""
    b1, b2 = betas
    if not callable(lr):
        check_lr(lr, "adamw")
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"adamw: invalid betas {betas!r} (each must be in [0, 1))")
    if not eps >= 0.0:
        raise ValueError(f"adamw: invalid eps {eps!r} (must be >= 0)")
    if not weight_decay >= 0.0:
        raise ValueError(f"adamw: invalid weight_decay {weight_decay!r} (must be >= 0)")
    decays = mask_fn(mask, "adamw")

    def init(params: Params) -> AdamWState:
        return AdamWState(_new_step(0), {k: torch.zeros_like(p) for k, p in params.items()},
                          {k: torch.zeros_like(p) for k, p in params.items()})

    def update(grads: Grads, state: AdamWState, params: Params) -> tuple[dict[str, Tensor], AdamWState]:
        _state_type(state, AdamWState, "adamw.update")
        _check("adamw.update", grads, params, **{"state.mu": state.mu, "state.nu": state.nu})
        k = _step_of(state.step)
        lr_k, t = lr_at(lr, k, "adamw"), k + 1
        bias_correction1, bias_correction2_sqrt = 1 - b1**t, (1 - b2**t) ** 0.5
        step_size = lr_k / bias_correction1
        new_p, new_mu, new_nu = dict(params), dict(state.mu), dict(state.nu)
        for keys in _groups([n for n in params if grads[n] is not None], params):
            p, mu, nu = [params[n] for n in keys], [state.mu[n] for n in keys], [state.nu[n] for n in keys]
            g = [grads[n] for n in keys]
            g = list(torch._foreach_neg(g)) if maximize else g
            if weight_decay != 0:
                idx = [i for i, n in enumerate(keys) if decays(n)]
                if idx:
                    for i, q in zip(idx, _mul([p[i] for i in idx], 1 - lr_k * weight_decay), strict=True):
                        p[i] = q
            mu = torch._foreach_lerp(mu, g, 1 - b1)
            nu = torch._foreach_addcmul(torch._foreach_mul(nu, b2), g, g, value=1 - b2)
            denom = torch._foreach_add(torch._foreach_div(torch._foreach_sqrt(nu), bias_correction2_sqrt), eps)
            if isinstance(step_size, Tensor):
                p = torch._foreach_sub(p, _mul(list(torch._foreach_div(mu, denom)), step_size))
            else:
                p = torch._foreach_addcdiv(p, mu, denom, value=-step_size)
            for n, q, m, v in zip(keys, p, mu, nu, strict=True):
                new_p[n], new_mu[n], new_nu[n] = q, m, v
        return new_p, AdamWState(_new_step(t), new_mu, new_nu)

    return Optimizer(init, update)


# ---------------------------------------------------------------- SGD
def sgd(
    lr: float | Tensor | Schedule = 1e-3, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0,
    dampening: float = 0.0, mask: Mask = None, *, maximize: bool = False,
) -> Optimizer:
    """SGD with optional (Nesterov) momentum and L2 weight decay added to the gradient, equal to
    ``torch.optim.SGD`` with the same arguments.  The first update sets each momentum buffer to the
    gradient, as torch does; ``lr`` and ``mask`` as in ``adamw``."""
    if not callable(lr):
        check_lr(lr, "sgd")
    if not momentum >= 0.0:
        raise ValueError(f"sgd: invalid momentum {momentum!r} (must be >= 0)")
    if not weight_decay >= 0.0:
        raise ValueError(f"sgd: invalid weight_decay {weight_decay!r} (must be >= 0)")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("sgd: Nesterov momentum requires a momentum and zero dampening")
    decays = mask_fn(mask, "sgd")

    def init(params: Params) -> SGDState:
        bufs = {k: torch.zeros_like(p) for k, p in params.items()} if momentum else {}
        return SGDState(_new_step(0), bufs)

    def update(grads: Grads, state: SGDState, params: Params) -> tuple[dict[str, Tensor], SGDState]:
        _state_type(state, SGDState, "sgd.update")
        _check("sgd.update", grads, params, **({"state.momentum": state.momentum} if momentum else {}))
        k = _step_of(state.step)
        lr_k = lr_at(lr, k, "sgd")
        new_p, new_buf = dict(params), dict(state.momentum)
        for keys in _groups([n for n in params if grads[n] is not None], params):
            p, g = [params[n] for n in keys], [grads[n] for n in keys]
            g = list(torch._foreach_neg(g)) if maximize else g
            if weight_decay != 0:
                idx = [i for i, n in enumerate(keys) if decays(n)]
                if idx:
                    for i, d in zip(idx, torch._foreach_add([g[i] for i in idx], [p[i] for i in idx], alpha=weight_decay),
                                    strict=True):
                        g[i] = d
            if momentum:
                if k == 0:
                    buf = [x.clone() for x in g]
                else:
                    buf = torch._foreach_add(torch._foreach_mul([state.momentum[n] for n in keys], momentum), g,
                                             alpha=1 - dampening)
                g = torch._foreach_add(g, buf, alpha=momentum) if nesterov else buf
                for n, b in zip(keys, buf, strict=True):
                    new_buf[n] = b
            if isinstance(lr_k, Tensor):
                p = torch._foreach_sub(p, _mul(list(g), lr_k))
            else:
                p = torch._foreach_add(p, g, alpha=-lr_k)
            for n, q in zip(keys, p, strict=True):
                new_p[n] = q
        return new_p, SGDState(_new_step(k + 1), new_buf)

    return Optimizer(init, update)


# ---------------------------------------------------------------- Muon
def muon(
    lr: float | Tensor | Schedule = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95, nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS, eps: float = 1e-7, ns_steps: int = 5,
    adjust_lr_fn: str | None = None, *, shard_info: Mapping[str, ShardInfo] | None = None, mask: Mask = None,
    rest: Optimizer | None = None, bucket_bytes: int = BUCKET_BYTES,
) -> Optimizer:
    """Muon on the matrix leaves, equal to ``torch.optim.Muon`` with the same arguments, and ``rest``
    (default ``adamw(lr, weight_decay=weight_decay)``, Moonlight's pairing) on the others.

    Each matrix's Newton–Schulz step runs on the whole matrix at one owner rank, chosen among the
    ranks holding part of it to balance the work, gathered and scattered back in buckets of
    ``bucket_bytes`` (one all-to-all each way per bucket: ``core.owner_gather``), so any layout of
    ``shard_info`` (``shard()``'s or ``hpf.fsdp``'s: TP, FSDP, EP, and their products) steps exactly as
    one device would; ``shard_info=None`` is one device.  The momentum, the weight decay and the
    update are elementwise on the local shards.  ``update`` is a collective over the mesh (every rank
    calls it; the first call decides the owners, one small all-gather); a matrix's gradient must be
    ``None`` on every rank or on none (else a PlanError on every rank: one small all-gather a step
    checks it).  Not differentiable: the update runs without autograd.
    ``mask``: the leaves that take Muon (patterns or ``fqn -> bool``; each must be 2-D, or a 3-D stack
    under an ``experts`` module, member by member); by default every such leaf but embeddings and the
    output head (``optim_muon.is_matrix``).  ``lr`` as in ``adamw`` (a tensor is read as a float)."""
    if not callable(lr):
        check_lr(lr, "muon")
    check_muon(momentum, weight_decay, ns_coefficients, ns_steps, eps, adjust_lr_fn)
    chosen = None if mask is None else mask_fn(mask, "muon")
    rest = adamw(lr, weight_decay=weight_decay) if rest is None else rest
    if not isinstance(rest, Optimizer):
        raise TypeError(f"muon: rest must be an hpf.optim Optimizer (adamw(...)), got {type(rest).__name__}")
    plans: dict = {}
    hyper = _MuonHyper(momentum, nesterov, weight_decay, adjust_lr_fn, (tuple(ns_coefficients), ns_steps, eps), bucket_bytes)

    def init(params: Params) -> MuonState:
        mat, others = _muon_split(params, shard_info, chosen)
        return MuonState(_new_step(0), {k: torch.zeros_like(params[k]) for k in mat}, rest.init({k: params[k] for k in others}))

    def update(grads: Grads, state: MuonState, params: Params) -> tuple[dict[str, Tensor], MuonState]:
        _state_type(state, MuonState, "muon.update")
        _check("muon.update", grads, params)
        mat, others = _muon_split(params, shard_info, chosen)
        _check("muon.update", {k: grads[k] for k in mat}, {k: params[k] for k in mat}, **{"state.momentum": state.momentum})
        k = _step_of(state.step)
        lr_k = float(lr_at(lr, k, "muon"))
        new_p, bufs = _muon_matrices({n: grads[n] for n in mat}, state.momentum, {n: params[n] for n in mat}, lr_k,
                                     hyper, shard_info, plans)
        rest_p, rest_state = rest.update({n: grads[n] for n in others}, state.rest, {n: params[n] for n in others})
        new_p.update(rest_p)
        return {n: new_p[n] for n in params}, MuonState(_new_step(k + 1), bufs, rest_state)

    return Optimizer(init, update)


class _MuonHyper(NamedTuple):
    momentum: float
    nesterov: bool
    weight_decay: float
    adjust_lr_fn: str | None
    ns: tuple[tuple[float, float, float], int, float]
    bucket_bytes: int


def _muon_split(params: Params, shard_info: Mapping[str, ShardInfo] | None,
                chosen: Callable[[str], bool] | None) -> tuple[list[str], list[str]]:
    """(the leaves that take Muon, the others), in ``params`` order, by their global shapes."""
    if shard_info is not None:
        missing = [k for k in params if k not in shard_info]
        if missing:
            raise PlanError(f"muon: no shard_info for {missing[:5]} (pass shard()'s or hpf.fsdp's shard_info)")
    mat = [k for k in params if is_matrix(k, shard_info[k].global_shape if shard_info is not None else params[k].shape,
                                          chosen)]
    chosen_set = set(mat)
    return mat, [k for k in params if k not in chosen_set]


def _muon_matrices(grads: Grads, bufs: Mapping[str, Tensor], params: Params, lr: float, hyper: _MuonHyper,
                   shard_info: Mapping[str, ShardInfo] | None, plans: dict) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(new params, new buffers) of the Muon leaves: torch.optim.Muon's step, the Newton–Schulz on
    whole matrices at their owners, ``param.mul(1 - lr * wd).add(O, alpha=-adjusted_lr)`` on the shards."""
    with torch.no_grad():
        new_bufs, updates = _muon_momentum(grads, bufs, hyper.momentum, hyper.nesterov)
        ortho = orthogonalized(updates, shard_info, plans, hyper.bucket_bytes, hyper.ns, [n for n in grads if grads[n] is None])
        new_p = dict(params)
        for n in params:
            if grads[n] is not None:
                shape = shard_info[n].global_shape if shard_info is not None else params[n].shape
                step = adjusted_lr(lr, hyper.adjust_lr_fn, shape)
                new_p[n] = params[n].mul(1 - lr * hyper.weight_decay).add(ortho[n], alpha=-step)
    return new_p, new_bufs


def _muon_momentum(grads: Grads, bufs: Mapping[str, Tensor], momentum: float,
                   nesterov: bool) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(new buffers, the bf16 updates to orthogonalise): torch.optim.Muon's ``buf.lerp_(grad, 1 - m)``
    and ``grad.lerp(buf, m)`` (Nesterov) or ``buf``, elementwise on the local shards.  A ``None``
    gradient keeps its buffer and sends zeros (its parameter is not updated)."""
    new_bufs, updates = dict(bufs), {}
    for n, g in grads.items():
        if g is None:
            updates[n] = torch.zeros_like(bufs[n], dtype=torch.bfloat16)
            continue
        new_bufs[n] = torch.lerp(bufs[n], g, 1 - momentum)
        updates[n] = (g.lerp(new_bufs[n], momentum) if nesterov else new_bufs[n]).bfloat16()
    return new_bufs, updates


# ---------------------------------------------------------------- state sharded over dp (ZeRO-1/2)
def zero_info(shard_info: Mapping[str, ShardInfo], mesh, axis: str = "dp") -> dict[str, ShardInfo]:
    """Where a ``zero(...)`` optimizer's per-leaf state sits: each leaf's rows chunked over ``axis``
    (``hpf.fsdp``'s layout).  ``state_info(state, zero_info(...))`` describes its state for
    ``hpf.save``/``hpf.load``/``hpf.reshard``."""
    return row_infos(shard_info, mesh, axis)


def zero(inner: Optimizer, shard_info: Mapping[str, ShardInfo], mesh, axis: str = "dp", *, stage: int = 1,
         bucket_bytes: int = BUCKET_BYTES) -> Optimizer:
    """``inner`` (an elementwise optimizer: ``adamw``, ``sgd``) with its state sharded over ``axis``,
    where the params are replicated (plain data parallel): each rank updates its rows of every leaf
    (``zero_info``), then the updated rows are all-gathered, one all-gather per bucket of
    ``bucket_bytes``; equal to ``inner`` on the whole leaves, and ``1/dp`` of its state per rank.

    ``stage=1`` (ZeRO-1): ``grads`` are already reduced over ``axis`` (``hpf.reduce_gradients``), alike
    on its ranks; each rank reads its rows.  ``stage=2`` (ZeRO-2): ``grads`` are each rank's own,
    unreduced; one reduce-scatter per bucket gives each rank its rows of their mean (instead of an
    all-reduce of everything).  A collective over ``axis``; a leaf's ``None`` gradient must be so on
    every rank of it (it keeps its parameter), else a ``PlanError`` on each, before the data collectives
    (one small all-gather a step agrees it).  Inverse view: ``state_info(state, zero_info(...))``."""
    if not isinstance(inner, Optimizer):
        raise TypeError(f"zero: inner must be an hpf.optim Optimizer, got {type(inner).__name__}")
    if stage not in (1, 2):
        raise ValueError(f"zero: stage must be 1 (sharded state) or 2 (and reduce-scattered gradients), got {stage!r}")
    infos = row_infos(shard_info, mesh, axis)
    group = AxisGroup.from_mesh(mesh, axis)

    def keys(params: Params, where: str) -> None:
        missing = [k for k in params if k not in infos]
        if missing:
            raise PlanError(f"{where}: no shard_info for {missing[:5]} (zero was given another shard_info)")

    def init(params: Params) -> ZeroState:
        _check("zero.init", dict.fromkeys(params), params)
        keys(params, "zero.init")
        return ZeroState({axis: _elementwise(inner.init(rows_of(params, infos)))})

    def update(grads: Grads, state: ZeroState, params: Params) -> tuple[dict[str, Tensor], ZeroState]:
        _state_type(state, ZeroState, "zero.update")
        _check("zero.update", grads, params)
        keys(params, "zero.update")
        if list(state.over) != [axis]:
            raise PlanError(f"zero.update: the state is sharded over {list(state.over)}, this optimizer over {axis!r}")
        with torch.no_grad():
            stepped = agree_stepped(grads, infos, group, "zero.update")
            rows = rows_of(grads, infos) if stage == 1 else scatter_rows(grads, infos, stepped, group, bucket_bytes)
        new_rows, new_state = inner.update(rows, state.over[axis], rows_of(params, infos))
        with torch.no_grad():
            full = gather_rows(new_rows, infos, stepped, group, bucket_bytes)
        return {k: full.get(k, params[k]) for k in params}, ZeroState({axis: new_state})

    return Optimizer(init, update)


def _elementwise(state: Any) -> Any:
    """``state``, unless it is (or holds) the state of an optimizer that is not elementwise over a
    leaf's rows (``muon``: whole matrices; ``zero`` again): a PlanError, as its rows would step wrong."""
    nodes = optree.tree_leaves(state, is_leaf=lambda x: isinstance(x, (MuonState, ZeroState)))
    bad = next((type(x).__name__ for x in nodes if isinstance(x, (MuonState, ZeroState))), None)
    if bad is not None:
        raise PlanError(f"zero: the inner optimizer's state is a {bad}: zero shards elementwise optimizers (adamw, "
                        "sgd) by rows; Muon needs whole matrices (hpf.optim.muon(shard_info=...) shards its own work)")
    return state


# ---------------------------------------------------------------- per-leaf groups
def partition(optimizers: Mapping[str, Optimizer]) -> Optimizer:
    """One optimizer per group of leaves: ``{pattern: optimizer}``, FQN patterns under the package's
    one pattern rule (docs/plan-language.md#patterns: ``*`` one segment, ``**`` any number); a leaf
    goes to the most specific pattern that matches it, whatever the dict's order, and every leaf
    must match one (``"**"`` claims the rest); two equally specific patterns matching one leaf are a
    ``PlanError`` naming both.  The state is ``PartitionState({pattern: that optimizer's state over
    its leaves})``; a pattern that claims no leaf still has a (leafless) state.  Torch's param
    groups with different hyperparameters.

    >>> opt = partition({"model.embed_tokens.weight": sgd(1e-1), "**": adamw(1e-3)})"""
    if not optimizers:
        raise ValueError("partition: no optimizers given")
    for pattern, opt in optimizers.items():
        if not isinstance(pattern, str) or not isinstance(opt, Optimizer):
            raise TypeError(f"partition: expected {{pattern: Optimizer}}, got {pattern!r}: {type(opt).__name__}")
    patterns = list(optimizers)
    memo: dict[str, str] = {}

    def resolve(fqns: Iterable[str]) -> None:
        """Label every FQN of ``fqns`` not labelled yet with the pattern that claims it."""
        for fqn in fqns:
            if fqn not in memo:
                memo[fqn] = _claimant(fqn, patterns)

    def split(tree: Mapping[str, Any], keys: Iterable[str]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {p: {} for p in patterns}
        for k in keys:
            out[memo[k]][k] = tree[k]
        return out

    def init(params: Params) -> PartitionState:
        resolve(params)
        parts = split(params, params)
        return PartitionState({p: optimizers[p].init(parts[p]) for p in patterns})

    def update(grads: Grads, state: PartitionState, params: Params) -> tuple[dict[str, Tensor], PartitionState]:
        _state_type(state, PartitionState, "partition.update")
        _check("partition.update", grads, params)
        if list(state.states) != patterns:
            raise PlanError(f"partition.update: the state's groups {list(state.states)} are not the patterns {patterns}")
        resolve(params)
        ps, gs = split(params, params), split(grads, params)
        new_params: dict[str, Tensor] = {}
        states = {}
        for p in patterns:
            new_params_p, states[p] = optimizers[p].update(gs[p], state.states[p], ps[p])
            new_params.update(new_params_p)
        return {k: new_params[k] for k in params}, PartitionState(states)

    return Optimizer(init, update)


def _claimant(fqn: str, patterns: list[str]) -> str:
    """The most specific of ``patterns`` matching ``fqn``; a PlanError when none or several do."""
    best = most_specific_patterns(fqn, patterns)
    if not best:
        raise PlanError(f"partition: parameter {fqn!r} matches none of the patterns {patterns}; add a catch-all '**'")
    if len(best) > 1:
        raise PlanError(f"partition: parameter {fqn!r} is matched by the equally specific patterns "
                        f"{' and '.join(map(repr, best))}; make one of them more specific")
    return best[0]


# ---------------------------------------------------------------- where the state sits
def replicated_info(shape: Sequence[int], mesh) -> ShardInfo:
    """The ``ShardInfo`` of a tensor every rank of ``mesh`` holds whole (the optimizer's step)."""
    shape = torch.Size(shape)
    return ShardInfo(placements=(Replicate(),) * mesh.ndim, mesh=mesh, global_shape=shape, local_shape=shape,
                     offset=(0,) * len(shape))


def state_info(state: Any, shard_info: Mapping[str, ShardInfo]) -> Any:
    """A pytree shaped like ``state`` whose leaves are each state leaf's ``ShardInfo`` (for saving
    and loading optimizer state sharded like the params).  A leaf stored under a dict key (a moment,
    a momentum buffer: ``state.mu[fqn]``) is that parameter's local shard's twin and gets
    ``shard_info[fqn]``; any other leaf (a NamedTuple field: ``step``) is replicated on the mesh of
    the first parameter; a ``ZeroState``'s leaves sit as ``zero_info`` says (rows over its axis).
    A PlanError names a key missing from ``shard_info``, a ShapeError a leaf whose shape is not its
    parameter's local shape."""
    paths, leaves, treespec = optree.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, ZeroState))
    mesh = next((i.mesh for i in shard_info.values()), None)
    infos = []
    for path, leaf in zip(paths, leaves, strict=True):
        where = "state" + "".join(f"[{e!r}]" for e in path)
        if isinstance(leaf, ZeroState):
            if mesh is None:
                raise PlanError(f"state_info: {where} is a ZeroState, but shard_info is empty (no mesh)")
            infos.append(ZeroState({a: state_info(inner, row_infos(shard_info, mesh, a)) for a, inner in leaf.over.items()}))
        else:
            infos.append(_leaf_info(leaf, path, where, shard_info, mesh))
    return optree.tree_unflatten(treespec, infos)


def _leaf_info(leaf: Tensor, path: tuple, where: str, shard_info: Mapping[str, ShardInfo], mesh) -> ShardInfo:
    key = path[-1] if path else None
    if isinstance(key, str):
        if key not in shard_info:
            raise PlanError(f"state_info: {where}: {key!r} is not in shard_info")
        info = shard_info[key]
        if tuple(leaf.shape) != tuple(info.local_shape):
            raise ShapeError(f"state_info: {where} has shape {tuple(leaf.shape)} but {key}'s local shape is "
                             f"{tuple(info.local_shape)}")
        return info
    if mesh is None:
        raise PlanError(f"state_info: {where} is replicated, but shard_info is empty (no mesh to place it on)")
    return replicated_info(leaf.shape, mesh)
