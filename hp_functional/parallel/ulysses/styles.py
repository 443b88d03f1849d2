"""The ``Ulysses`` style: an attention module whose SDPA calls attend over the sequence sharded on
the plan's ``cp`` axis by two all-to-alls (``parallel.ulysses.attention``).

It is a context-parallel entry like ``ContextParallel`` (the same root shards the batch in the
plan's ``cp_layout`` and computes the loss; the same shadowing and layout checks apply); only the
attention differs.  See docs/context-parallel.md#ulysses.
"""

from __future__ import annotations

__all__ = ["Ulysses"]

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ...core.collectives import AxisGroup
from ...core.errors import PlanError
from ..context.styles import ContextParallel
from .attention import UlyssesAttention, kv_copies


def _local_heads(module: nn.Module) -> tuple[int, int] | None:
    """(query heads, K/V heads) of this rank's copy of an attention module with separate
    ``q_proj``/``k_proj`` Linears and a ``head_dim`` (HF's; their shapes are local, after tensor
    parallelism), else None: the count is then checked at the first call."""
    q, k, d = getattr(module, "q_proj", None), getattr(module, "k_proj", None), getattr(module, "head_dim", None)
    if not (isinstance(q, nn.Linear) and isinstance(k, nn.Linear) and isinstance(d, int) and d > 0):
        return None
    rows = q.weight.shape[0], k.weight.shape[0]  # the skeleton holds local shapes
    if rows[0] % d or rows[1] % d:
        return None
    return rows[0] // d, rows[1] // d


@dataclass(frozen=True)
class Ulysses(ContextParallel):
    """Ulysses sequence parallelism (DeepSpeed-Ulysses) on an attention module: the heads are
    split over the ``cp`` axis around attention, the sequence everywhere else.

    ``layout``: None takes the plan's ``cp_layout``.  ``causal``: as ``ContextParallel``'s (None
    follows the call, or the module's ``is_causal`` when it passes its own mask).  The module's query
    heads (after tensor parallelism) must divide by the axis size; K/V heads divide too, or are
    fewer and divide it (each rank then receives the K/V head its query heads use).

    >>> plan = hpf.ShardingPlan({"model.layers.*.self_attn": hpf.Ulysses()}, axes={"cp": "cp"})
    >>> plan = hpf.ShardingPlan.from_hf(model, cp_axis="cp", cp_strategy="ulysses")   # the same
    """

    strategy: str = "ulysses"
    layout: str | None = None
    causal: bool | None = None
    axis: str | None = None  # None: the plan's cp_axis
    axis_role = "cp"

    def check_strategy(self, fqn: str) -> None:
        if self.strategy != "ulysses":
            raise PlanError(f"{fqn}: Ulysses has strategy 'ulysses', got {self.strategy!r} (ContextParallel("
                            f"{self.strategy!r}) is that strategy)")

    def attention(self, module: nn.Module, group: AxisGroup, layout: str, *, fqn: str,
                  axis: str) -> Callable[[], UlyssesAttention]:
        heads = _local_heads(module)
        if heads is not None:  # known from the local projections: refused when apply_fn is built
            kv_copies(*heads, group.size, fqn=fqn, axis=axis)
        causal = self.causal
        return lambda: UlyssesAttention(module, group, layout, causal, fqn)
