"""``apply_fn``: the per-call path — parameter conversions, then ``functional_call``.

Everything here runs on every step, so it does no plan or placement work: ``shard()`` decided
all of it and hands over a ``Program``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from .collectives import AxisGroup
from .errors import PlanError
from .loss import vocab_parallel_cross_entropy

if TYPE_CHECKING:
    from .apply import Program


def make_apply_fn(skeleton: nn.Module, program: Program) -> Callable:
    """``apply_fn(params, *args, **kwargs)``: parameter conversions, then ``functional_call``."""
    conversions = tuple(program.param_steps.items())
    expected = {k: tuple(i.local_shape) for k, i in program.infos.items()}
    expected_keys = expected.keys()
    loss_parallel = program.loss_parallel

    def apply_fn(params: Mapping[str, Tensor], *args, **kwargs):
        if params.keys() != expected_keys:
            missing, extra = sorted(expected_keys - params.keys()), sorted(params.keys() - expected_keys)
            raise PlanError(f"apply_fn: params pytree keys differ from shard(): missing {missing[:5]}, extra {extra[:5]}")
        for key, shape in expected.items():
            if tuple(params[key].shape) != shape:
                raise PlanError(f"apply_fn: params[{key!r}] has shape {tuple(params[key].shape)}, expected local {shape}")
        if conversions:
            params = dict(params)
            for key, steps in conversions:
                value = params[key]
                for step in steps:
                    value = step(value)
                params[key] = value
        labels = kwargs.pop("labels", None) if loss_parallel else None
        out = torch.func.functional_call(skeleton, params, args, kwargs, tie_weights=True, strict=False)
        if labels is not None:
            out["loss"] = causal_lm_loss(out.logits, labels, *loss_parallel)
        return out

    apply_fn.program = program  # for explain() and tests; read-only by convention
    return apply_fn


def causal_lm_loss(local_logits: Tensor, labels: Tensor, group: AxisGroup, vocab_start: int) -> Tensor:
    """HF's causal-LM loss (labels shifted left, -100 ignored, mean) on vocab-sharded logits."""
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    return vocab_parallel_cross_entropy(local_logits, shifted, group, vocab_start=vocab_start)
