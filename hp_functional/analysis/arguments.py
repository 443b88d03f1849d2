"""Arguments of one value per head handed from block to block (T5's position bias, computed in
the first layer and passed to every later one): the shape audit and the head search replay a
block with its traced arguments, which are global; on a rank such an argument arrives with the
rank's heads only.  ``per_head_arguments`` gives the local version to replay with when the
global one does not fit.  Only the replay is affected: the shard-time probe still checks the
real flow numerically."""

from __future__ import annotations

__all__ = ["head_counts", "per_head_arguments"]

from collections.abc import Mapping

import torch
from torch import Tensor, nn


def head_counts(module: nn.Module) -> frozenset[int]:
    """The integer attributes of ``module`` and the modules below it whose names say heads."""
    return frozenset(v for m in module.modules() for k, v in vars(m).items()
                     if type(v) is int and "head" in k.lower() and "dim" not in k.lower() and v > 1)


def per_head_arguments(args: tuple, kwargs: Mapping, heads: frozenset[int], n: int) -> tuple[tuple, dict] | None:
    """``(args, kwargs)`` with every tensor but the first (the hidden states) cut to ``1 / n``
    along its first dim after the batch that holds a head count; None where no tensor has one."""
    first, changed = True, False

    def cut(x):
        nonlocal first, changed
        if not isinstance(x, Tensor):
            return x
        if first:
            first = False
            return x
        dim = next((i for i in range(1, x.dim()) if x.shape[i] in heads and x.shape[i] % n == 0), None)
        if dim is None:
            return x
        changed = True
        shape = list(x.shape)
        shape[dim] //= n
        return torch.empty(shape, dtype=x.dtype, device=x.device)

    new = tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}
    return new if changed else None
