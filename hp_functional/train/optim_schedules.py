"""Learning-rate schedules of ``hpf.optim`` (re-exported there): a schedule maps the step (a Python
int or a 0-dim tensor) to the learning rate."""

from __future__ import annotations

__all__ = ["Schedule", "check_lr", "constant", "linear_warmup", "lr_at", "warmup_cosine"]

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

#: a learning rate schedule: the step (a Python int or a 0-dim tensor) -> the learning rate
Schedule = Callable[[Any], Any]


def check_lr(value: Any, what: str) -> None:
    """A ValueError for a negative (or NaN) Python learning rate; tensors are not inspected (no sync)."""
    if not isinstance(value, Tensor) and not value >= 0:
        raise ValueError(f"{what}: invalid learning rate {value!r} (must be >= 0)")


def _ramp(step: Any, length: int) -> Any:
    """``clamp(step, 0, length) / length`` (1 when ``length`` is 0), for a Python or a tensor step."""
    if length == 0:
        return 1.0
    if isinstance(step, Tensor):
        return step.to(torch.float64).clamp(0, length) / length
    return min(max(step, 0), length) / length


def constant(lr: float) -> Schedule:
    """``lr`` at every step."""
    check_lr(lr, "constant")
    return lambda step: lr


def linear_warmup(peak_lr: float, warmup_steps: int, init_lr: float = 0.0) -> Schedule:
    """``init_lr`` at step 0, rising linearly to ``peak_lr`` at ``warmup_steps``, then constant
    (optax's ``linear_schedule``; torch's ``LambdaLR(lambda k: min(1, k / warmup_steps))`` with init 0)."""
    check_lr(peak_lr, "linear_warmup")
    check_lr(init_lr, "linear_warmup")
    if warmup_steps < 0:
        raise ValueError(f"linear_warmup: warmup_steps must be >= 0, got {warmup_steps}")

    def schedule(step: Any) -> Any:
        return init_lr + (peak_lr - init_lr) * _ramp(step, warmup_steps)

    return schedule


def warmup_cosine(peak_lr: float, warmup_steps: int, total_steps: int, end_lr: float = 0.0, init_lr: float = 0.0) -> Schedule:
    """Linear warmup from ``init_lr`` to ``peak_lr`` over ``warmup_steps``, then a half cosine down to
    ``end_lr`` at ``total_steps`` (warmup included), ``end_lr`` after: optax's
    ``warmup_cosine_decay_schedule(init_lr, peak_lr, warmup_steps, total_steps, end_lr)``, and with
    ``init_lr = end_lr = 0`` Hugging Face's ``get_cosine_schedule_with_warmup`` up to ``total_steps``."""
    for v in (peak_lr, end_lr, init_lr):
        check_lr(v, "warmup_cosine")
    if not 0 <= warmup_steps < total_steps:
        raise ValueError(f"warmup_cosine: need 0 <= warmup_steps < total_steps, got {warmup_steps} and {total_steps}")
    warm, decay = linear_warmup(peak_lr, warmup_steps, init_lr), total_steps - warmup_steps

    def schedule(step: Any) -> Any:
        progress = _ramp(step - warmup_steps, decay)
        if isinstance(step, Tensor):
            cos = end_lr + (peak_lr - end_lr) * 0.5 * (1 + torch.cos(math.pi * progress))
            return torch.where(step < warmup_steps, warm(step), cos)
        return warm(step) if step < warmup_steps else end_lr + (peak_lr - end_lr) * 0.5 * (1 + math.cos(math.pi * progress))

    return schedule


def lr_at(lr: float | Tensor | Schedule, step: int, where: str) -> float | Tensor:
    """The learning rate of update ``step`` (0-based): a schedule evaluated there, else ``lr`` itself."""
    value = lr(step) if callable(lr) else lr
    if isinstance(value, Tensor) and value.numel() != 1:
        raise ValueError(f"{where}: the learning rate must be a scalar, got a tensor of shape {tuple(value.shape)}")
    check_lr(value, f"{where} at step {step}")
    return value
