"""How ``hpf.Experts`` calls an experts module: its calling convention (docs/experts.md#calling-conventions).

``Experts`` calls the module's own forward on the rows each rank received (``parallel.experts.styles``), so it
must know how to read the routing from the forward's arguments and how to call the forward back on
rows of its local experts.  Built in: ``"routed"`` (HF's fused experts, ``RoutedCall``) and
``"sorted"`` (torchtitan's ``GroupedExperts``, ``SortedCall``), picked from the forward's positional
arity (three, two) unless ``Experts(call=...)`` names one; any other is an ``ExpertsCall`` subclass.
"""

from __future__ import annotations

__all__ = ["CALLS", "ExpertsCall", "experts_call"]

import inspect

import torch
from torch import Tensor, nn
from torch.distributed.tensor import Shard

from ...core.errors import PlanError


class ExpertsCall:
    """The calling-convention protocol (see the module docstring); subclass it for your own.  The
    forward must compute each row independently of the others (the rows of one call are split
    across ranks); the output is the token-wise weighted sum of ``run``'s rows."""

    name = "custom"
    #: the forward's positional arguments the boundary carries, and those whose dim 0 is the tokens
    n_args: int = 3
    token_args: tuple[int, ...] = (0, 1, 2)

    def routing(self, args: tuple[Tensor, ...], offset: int, total: int) -> tuple[Tensor, Tensor, Tensor]:
        """``(hidden [T, H], index [T, k] or one-hot [T, k, E], weights [T, k])`` of this rank's
        tokens from the forward's arguments; ``offset``: the position of this rank's first token
        among the ``total`` tokens of the call (0 and T when the rank holds all of them)."""
        raise NotImplementedError

    def run(self, module: nn.Module, rows: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """The module's own forward on ``rows [R, H]`` for expert ids ``ids [R, 1]`` (or one-hot
        ``[R, 1, E]``) with unit ``weights [R, 1]``: one output row per row."""
        raise NotImplementedError

    def tp_layouts(self, names: list[str], fqn: str) -> dict[str, tuple[Shard, int]]:
        """Stacked weight name → (its shard over ``tp``, packed blocks along that dim) for TP inside the experts."""
        raise PlanError(f"{fqn}: TP inside experts is not defined for the {self.name!r} calling convention: "
                        "plan Experts(tp_axis=None), or give its ExpertsCall a tp_layouts")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(type(self))


class RoutedCall(ExpertsCall):
    """HF's ``forward(hidden [T, H], top_k_index [T, k] (or a one-hot mask [T, k, E]), top_k_weights [T, k])``
    returning ``[T, H]``, each token's weighted sum over its experts; TP inside: the fused ``gate_up_proj
    [E, 2I, H]`` Shard(1) in two packed blocks, ``down_proj [E, H, I]`` Shard(2)."""

    name = "routed"

    def routing(self, args, offset, total):
        return args[0], args[1], args[2]

    def run(self, module, rows, ids, weights):
        return type(module).forward(module, rows, ids, weights)

    def tp_layouts(self, names, fqn):
        out = {}
        for n in names:
            if n.endswith("gate_up_proj"):
                out[n] = (Shard(1), 2)
            elif n.endswith("down_proj"):
                out[n] = (Shard(2), 1)
            else:
                raise PlanError(f"{fqn}: TP inside experts shards gate_up_proj (colwise, packed) and down_proj "
                                f"(rowwise); {n!r} is neither: plan Experts(tp_axis=None) for this module")
        return out


class SortedCall(ExpertsCall):
    """torchtitan's ``forward(x [N, H], num_tokens_per_expert [E])`` on rows grouped by expert in expert
    order, one unweighted output row per row (the MoE block weights and combines them itself); TP inside:
    ``w1``, ``w3`` ``[E, I, H]`` Shard(1), ``w2 [E, H, I]`` Shard(2)."""

    name = "sorted"
    n_args = 2
    token_args = (0,)

    def routing(self, args, offset, total):
        x, counts = args[0], args[1]
        experts = torch.arange(counts.shape[0], device=counts.device)
        ids = torch.repeat_interleave(experts, counts.long(), output_size=total)[offset:offset + x.shape[0]]
        return x, ids[:, None], x.new_ones((x.shape[0], 1), dtype=torch.float32)

    def run(self, module, rows, ids, weights):
        flat = ids[:, 0]
        order = torch.argsort(flat, stable=True)  # rows arrive by source rank, then expert: group them by expert
        counts = flat.new_zeros(module.num_experts).scatter_add_(0, flat, torch.ones_like(flat))
        out = type(module).forward(module, rows[order], counts)
        return out[torch.argsort(order)]

    def tp_layouts(self, names, fqn):
        roles = {"w1": (Shard(1), 1), "w3": (Shard(1), 1), "w2": (Shard(2), 1)}
        bad = [n for n in names if n not in roles]
        if bad:
            raise PlanError(f"{fqn}: TP inside torchtitan-style experts shards w1, w3 (colwise) and w2 (rowwise); "
                            f"{bad} are none of them: plan Experts(tp_axis=None) for this module")
        return {n: roles[n] for n in names}


#: The built-in conventions by name (``Experts(call="sorted")``).
CALLS: dict[str, ExpertsCall] = {"routed": RoutedCall(), "sorted": SortedCall()}


def experts_call(module: nn.Module, call: str | ExpertsCall | None, fqn: str) -> ExpertsCall:
    """The convention ``call`` names, or (None) the one the module's forward arity says."""
    if isinstance(call, ExpertsCall):
        return call
    if call is not None:
        if call not in CALLS:
            raise PlanError(f"{fqn}: Experts call={call!r} is not a calling convention (built in: {sorted(CALLS)}, "
                            "or an ExpertsCall instance)")
        return CALLS[call]
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return CALLS["routed"]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return CALLS["sorted"] if len(positional) == 2 else CALLS["routed"]
