"""Muon's matrix step for ``hpf.optim.muon`` (re-exported there): the Newton–Schulz orthogonalisation
of ``torch.optim.Muon`` op for op, run on whole matrices at their owner ranks (``core.owner_gather``)
whatever the layout (TP, FSDP, EP, or one device), and which leaves are matrices.
See docs/training.md#muon."""

from __future__ import annotations

__all__ = ["NS_COEFFICIENTS", "adjusted_lr", "check_muon", "is_matrix", "orthogonalized"]

import math
from collections.abc import Callable, Collection, Mapping, Sequence

import torch
from torch import Tensor

from ..core.errors import PlanError
from ..core.owner_gather import OwnerPlan, agree_flags, gather_to_owners, plan_owners, scatter_from_owners
from ..core.placement import ShardInfo

#: Keller Jordan's quintic coefficients, torch.optim.Muon's defaults
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_NOT_MATRIX_NAMES = ("embed", "lm_head")


def newton_schulz(update: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> Tensor:
    """torch.optim.Muon's ``_zeropower_via_newtonschulz`` op for op (bf16, transposed when tall),
    so a whole matrix gives the same bits here as there."""
    a, b, c = coefficients
    x = update.bfloat16()
    if x is update:  # already bf16: torch would divide its input in place; this function is pure
        x = x.clone()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """torch.optim.Muon's ``_adjust_lr`` for a matrix of ``shape`` (rows, cols)."""
    rows, cols = shape[-2:]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


def check_muon(momentum: float, weight_decay: float, ns_coefficients, ns_steps: int, eps: float,
               adjust_lr_fn: str | None) -> None:
    """torch.optim.Muon's argument checks, as ValueErrors."""
    if not momentum >= 0.0:
        raise ValueError(f"muon: invalid momentum {momentum!r} (must be >= 0)")
    if not weight_decay >= 0.0:
        raise ValueError(f"muon: invalid weight_decay {weight_decay!r} (must be >= 0)")
    if len(tuple(ns_coefficients)) != 3:
        raise ValueError(f"muon: ns_coefficients must be three floats (a, b, c), got {ns_coefficients!r}")
    if not 0 <= ns_steps < 100:
        raise ValueError(f"muon: ns_steps must be in [0, 100), got {ns_steps!r}")
    if not eps >= 0.0:
        raise ValueError(f"muon: invalid eps {eps!r} (must be >= 0)")
    if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
        raise ValueError(f"muon: adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {adjust_lr_fn!r}")


def is_matrix(fqn: str, shape: Sequence[int], chosen: Callable[[str], bool] | None) -> bool:
    """Whether leaf ``fqn`` of global ``shape`` takes Muon: with ``chosen`` (the user's mask) when it
    says so, and then it must be 2-D, or 3-D under an ``experts`` module (a stack of matrices); by
    default every such leaf except embeddings and the output head (a segment containing ``embed``,
    or ``lm_head``), which torch's and Moonlight's Muon leave to AdamW."""
    stacked = len(shape) == 3 and "experts" in fqn.split(".")
    if chosen is not None:
        if not chosen(fqn):
            return False
        if len(shape) != 2 and not stacked:
            raise PlanError(f"muon: the mask gives {fqn!r} (shape {tuple(shape)}) to Muon, which takes 2-D matrices "
                            "and 3-D stacks of them under an 'experts' module only")
        return True
    if any(n in seg for seg in fqn.split(".") for n in _NOT_MATRIX_NAMES):
        return False
    return len(shape) == 2 or stacked


def _local(updates: Mapping[str, Tensor], coefficients, steps: int, eps: float) -> dict[str, Tensor]:
    """Every matrix orthogonalised where it is (one device): a stack member by member."""
    out = {}
    for k, u in updates.items():
        out[k] = (torch.stack([newton_schulz(m, coefficients, steps, eps) for m in u]) if u.ndim == 3
                  else newton_schulz(u, coefficients, steps, eps))
    return out


def orthogonalized(updates: Mapping[str, Tensor], shard_info: Mapping[str, ShardInfo] | None,
                   plans: dict[tuple[str, ...], OwnerPlan], bucket_bytes: int,
                   ns: tuple[tuple[float, float, float], int, float], absent: Collection[str] = ()) -> dict[str, Tensor]:
    """The Newton–Schulz result (bf16, local shards) of each matrix leaf's local ``updates``, each
    matrix orthogonalised whole at its owner; ``plans`` (the caller's cache, keyed by the leaves)
    keeps the ownership decided on the first call.  A collective over the leaves' mesh unless
    ``shard_info`` is None (one device).  ``absent``: the leaves whose gradient is ``None`` on this
    rank (zeros in ``updates``); one that is so on some ranks only is a ``PlanError`` on every rank,
    before any gather (``_agree_absent``: one small all-gather, ``plan_owners``' on the first call)."""
    coefficients, steps, eps = ns
    if shard_info is None or not updates:
        return _local(updates, coefficients, steps, eps)
    keys = tuple(updates)
    plan = _agree_absent(keys, shard_info, plans, bucket_bytes, absent)
    device = next(iter(updates.values())).device
    out: dict[str, Tensor] = {}
    for bucket in range(len(plan.buckets)):
        whole = gather_to_owners(plan, bucket, updates)
        results = {u: _orthogonal(m, coefficients, steps, eps) for u, m in whole.items()}
        out |= scatter_from_owners(plan, bucket, results, {k: updates[k].shape for k in updates}, torch.bfloat16, device)
    return {k: out[k] for k in keys}


def _agree_absent(keys: tuple[str, ...], shard_info: Mapping[str, ShardInfo], plans: dict[tuple[str, ...], OwnerPlan],
                  bucket_bytes: int, absent: Collection[str]) -> OwnerPlan:
    """The owner plan of ``keys`` (decided on the first call, kept in ``plans``), once every rank agrees
    which of them have no gradient: a matrix whose gradient is ``None`` on some ranks and not on others
    would be orthogonalised from zeros where it is missing while some of its shards stay put, so it is a
    ``PlanError`` naming it, alike on every rank."""
    missing = set(absent)
    flags = [k in missing for k in keys]
    if keys in plans:
        every = agree_flags(plans[keys], flags)
    else:
        plans[keys] = plan_owners(shard_info, keys, lambda k: len(shard_info[k].global_shape) == 3, bucket_bytes,
                                  "muon", flags)
        every = plans[keys].flags
    ranks = plans[keys].exchange.ranks
    split = [i for i in range(len(keys)) if len({row[i] for row in every}) > 1]
    if split:
        none = [ranks[r] for r, row in enumerate(every) if row[split[0]]]
        also = f" (likewise {[keys[i] for i in split[1:6]]})" if len(split) > 1 else ""
        raise PlanError(f"muon: the gradient of {keys[split[0]]!r} is None on rank(s) {none} and not on the others of "
                        f"{list(ranks)}{also}; Muon orthogonalises each matrix whole, so its gradient must be None on "
                        "every rank or on none (give it a zero gradient where it is unused, or leave it to rest with mask=)")
    return plans[keys]


def _orthogonal(matrix: Tensor, coefficients, steps: int, eps: float) -> Tensor:
    """``newton_schulz`` of a unit: a 2-D matrix, or a stack member gathered as ``(1, rows, cols)``."""
    if matrix.ndim == 3:
        return newton_schulz(matrix[0], coefficients, steps, eps).unsqueeze(0)
    return newton_schulz(matrix, coefficients, steps, eps)
