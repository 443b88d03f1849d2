"""Initialising a model built on the meta device, module by module, with seeded generators: the
same values at any world size, mesh, plan or device.  Which inits this reproduces and which it
does not: docs/weights.md#a-meta-model-without-weights-per-shard-initialisation.
"""

from __future__ import annotations

__all__ = ["init_values", "init_weights"]

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..compile.agree import digest
from ..core.errors import PlanError
from .weights import _fresh_copy, init_fn_of


def module_seed(seed: int, fqn: str) -> int:
    """The generator seed of module ``fqn`` (stable across processes and runs)."""
    return digest(f"{seed}:{fqn}")


def init_values(model: nn.Module, seed: int, keep: Callable[[str, Tensor], Tensor | None]) -> dict[str, Tensor]:
    """``keep(name, full)`` of every meta parameter, initialised module by module: each module's
    own init — Hugging Face's ``_init_weights(module)`` (the nearest ``PreTrainedModel`` above it, as
    HF dispatches), else torch's ``reset_parameters()`` — runs on a private copy of that one module
    whose own parameters are fresh full-size CPU tensors, under a generator seeded by ``(seed,
    module path)``; ``keep`` takes what it needs (``shard()``: this rank's slice, None: nothing)
    and the full tensors are dropped before the next module (peak: one module's parameters).  A
    tied group is initialised once, by the module of its first name in ``named_parameters``
    order, and kept under that name."""
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
    out: dict[str, Tensor] = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        own = {n: p for n, p in module._parameters.items()
               if p is not None and p.device.type == "meta" and first[id(p)] == _join(fqn, n)}
        if not own:
            continue
        copy = _fresh_copy(module, own, torch.device("cpu"))
        init = init_fn_of(model, fqn)
        if init is None and not hasattr(module, "reset_parameters"):
            raise PlanError(f"parameter {_join(fqn, next(iter(own)))} is on the meta device and {type(module).__name__} "
                            "has no init (no reset_parameters and no Hugging Face PreTrainedModel above it): pass "
                            "weights=PATH, or build it on a real device")
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(module_seed(seed, fqn))
            init(copy) if init is not None else copy.reset_parameters()
        for n in own:
            full = copy._parameters[n].detach()
            if full.is_floating_point() and bool(full.isnan().any()):
                raise PlanError(f"parameter {_join(fqn, n)}: {type(module).__name__}'s init does not set it (it is still "
                                "uninitialised): pass weights=PATH, or give the module a reset_parameters()")
            kept = keep(_join(fqn, n), full)
            if kept is not None:
                out[_join(fqn, n)] = kept
        del copy
    return out


def init_weights(model: nn.Module, seed: int = 0) -> dict[str, Tensor]:
    """The full values ``shard(meta_model, plan, mesh, seed=seed)`` slices, for an unsharded
    reference.  Reads ``model``, never writes it.

    Args:
        model: a model whose parameters (some or all) are on the meta device.
        seed: the seed that, with each module's path, seeds its generator (as ``shard(seed=)``).
    Returns:
        A dict FQN → full CPU tensor for every meta parameter (tied groups once, under their first
        name), initialised module by module by its own init.
    """
    return init_values(model, seed, lambda name, full: full)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
