"""The private stand-in that ``apply_fn`` runs: the model's structure without its weights.

``build_skeleton`` deep-copies the module tree with every parameter replaced by a meta
placeholder of its *local* shape (tied parameters map to one placeholder) and every buffer
by an owned clone, so the user's model is never touched, not even temporarily by
``functional_call``.  (``runtime.boundary`` then installs the local forwards on it.)
"""

from __future__ import annotations

__all__ = ["build_skeleton"]

import copy
from collections.abc import Mapping

import torch
from torch import nn

from ..core.errors import PlanError


def build_skeleton(model: nn.Module, local_shapes: Mapping[str, torch.Size], leaf_of: Mapping[str, str],
                   buffers: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
    """A deep copy of ``model``'s structure with meta placeholders for parameters.

    ``leaf_of`` maps every parameter FQN (aliases included) to its leaf key in the params pytree;
    ``buffers`` (by FQN) replace the model's own (a meta model's, materialised by ``shard()``).
    """
    memo: dict[int, object] = {}
    placeholders: dict[str, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        key = leaf_of[name]
        if key not in placeholders:
            empty = torch.empty(local_shapes[key], dtype=p.dtype, device="meta")
            placeholders[key] = nn.Parameter(empty, requires_grad=p.requires_grad)
        memo[id(p)] = placeholders[key]
    for name, b in model.named_buffers():
        memo[id(b)] = buffers[name] if buffers is not None and name in buffers else b.detach().clone()
    try:
        return copy.deepcopy(model, memo)
    except Exception as exc:  # a module holding something that cannot be copied (a lock, a process group)
        raise PlanError(f"cannot build the private skeleton of {type(model).__name__}: {exc}") from exc
