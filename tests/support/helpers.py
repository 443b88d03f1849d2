"""Helpers that run inside the ranks: meshes (created once per process), tiny models, comparisons."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from hp_functional.tools.models import tiny_config


@functools.cache
def mesh(shape: tuple[int, ...] | None = None, names: tuple[str, ...] = ("tp",)):
    """A cached CPU mesh over all ranks (new_group is a collective: create each shape once)."""
    return init_device_mesh("cpu", shape or (dist.get_world_size(),), mesh_dim_names=names)


def rank() -> int:
    return dist.get_rank()


def world() -> int:
    return dist.get_world_size()


def assert_close(actual, expected, what: str, atol: float = 1e-5, rtol: float = 1e-5) -> float:
    """assert_close that names ``what`` and returns the max abs difference."""
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")
    return (actual - expected).abs().max().item() if actual.numel() else 0.0


def worst_errors(runs, ref, info, model) -> dict[str, float]:
    """For each ``label: (grads, loss)`` of ``runs`` (sharded results), the loss against ``ref`` and
    every gathered gradient against the unsharded ``model``'s ``.grad`` (1e-4 relative); the worst
    gradient error per label."""
    import hp_functional as hpf

    worst = {}
    for label, (grads, value) in runs.items():
        assert_close(value, ref.detach(), f"{label} loss")
        full = hpf.unshard(grads, info)
        assert set(full) == {k for k, _ in model.named_parameters()}, "every parameter has a gradient"
        worst[label] = max(assert_close(full[k], p.grad, f"{label} grad {k}", atol=1e-4 * p.grad.abs().max().item() + 1e-9,
                                        rtol=1e-4) for k, p in model.named_parameters())
    return worst


def build_hf(family: str, state=None, **overrides):
    """An AutoModelForCausalLM of ``family``; with ``state``, loaded with those weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    if state is not None:
        model.load_state_dict(state)
    return model


def make_hf_state(family: str = "llama", **overrides):
    """Reference weights, built once in the test process and handed to every rank."""
    torch.manual_seed(0)
    model = build_hf(family, **overrides)
    with torch.no_grad():  # non-trivial norm weights, so their gradients are checked for real
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.state_dict()


def uneven_splits(total: int, n: int) -> list[int]:
    """``n`` split sizes summing to ``total``, uneven and with a zero: ``[0, 1, 2, ..., rest]``."""
    base = list(range(n - 1))
    return [*base, total - sum(base)]


def cyclic_splits(total: int, n: int, r: int) -> tuple[list[int], list[int]]:
    """(send, recv) of rank ``r`` in a variable all-to-all where rank ``k`` sends ``base[(j - k) % n]``
    slices to rank ``j``: uneven splits, yet every rank receives ``total`` (shapes stay equal)."""
    base = uneven_splits(total, n)
    return [base[(j - r) % n] for j in range(n)], [base[(r - k) % n] for k in range(n)]


def raised(fn, *args, **kwargs) -> tuple[str, str] | None:
    """(exception type name, message) of what ``fn(*args, **kwargs)`` raised, or None: bad-input
    tests return it from the ranks and check both."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the test checks type and message
        return type(exc).__name__, str(exc)
    return None


def plan_errors(makers) -> dict[str, tuple[str, str]]:
    """``{what: (error type, message)}`` of every ``makers[what]()`` that raises a PlanError."""
    from hp_functional import PlanError

    errors = {}
    for what, make in makers.items():
        try:
            make()
        except PlanError as e:
            errors[what] = (type(e).__name__, str(e))
    return errors


def assert_errors(per_rank, expect: dict[str, str]) -> None:
    """Every rank raised each expected error, its message holding the expected text."""
    for errs in per_rank:
        for what, text in expect.items():
            assert what in errs and text in errs[what][1], (what, errs.get(what))
