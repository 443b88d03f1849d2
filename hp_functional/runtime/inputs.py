"""Run-time agreement of ``apply_fn``'s inputs across the ranks that must see them alike: each new
input signature (and with ``HPF_CHECK_INPUTS=1`` every call's values) is compared over the
process group's key-value store just before the call's first collective; a difference raises
``InputMismatchError`` on every rank of the axis.  See docs/guarantees.md#run-time-agreement-of-apply_fns-inputs.
"""

from __future__ import annotations

__all__ = ["InputAgreement"]

import inspect
import json
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..compile.agree import checksum
from ..core.errors import InputMismatchError
from ..core.program import Program
from ..core.raw_collectives import get_timeout


def agreeing_axes(program: Program) -> list[str]:
    """The mesh axes (of size > 1) whose ranks must receive the same inputs: those of every
    boundary and conversion step, less the axes on which ranks feed their own data
    (``summed_axes``: experts with ``tokens="local"``)."""
    local = {a for b in program.boundaries for a in b.spec.summed_axes}
    axes: list[str] = []
    for b in program.boundaries:
        steps = [s for group in (*b.in_steps.values(), *b.out_steps.values()) for s in group]
        for axis in (b.planned.axis, *(s.axis for s in steps)):
            if axis not in local and axis not in axes and axis in program.groups and program.groups[axis].size > 1:
                axes.append(axis)
    return axes


def signature(x):
    """A hashable summary of an argument: tensors by shape and dtype, plain scalars by value,
    containers element-wise, anything else by type."""
    if isinstance(x, Tensor):
        return (x.shape, x.dtype)
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, (list, tuple)):
        return tuple(signature(v) for v in x)
    if isinstance(x, dict):
        return tuple((k, signature(v)) for k, v in x.items())
    return type(x).__qualname__


def _positional_names(root: nn.Module) -> list[str]:
    """The names of the model's positional parameters (for error messages), from its class's forward."""
    try:
        params = list(inspect.signature(type(root).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _plain(t: Tensor) -> Tensor:
    """``t`` without torch.func's wrappers (grad, vmap): the values the rank holds."""
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t.detach()


def _describe(x, path: str, values: bool, out: list[tuple[str, str]]) -> None:
    """(path, description) of every leaf of ``x``, for the exchange and its error message."""
    if isinstance(x, Tensor):
        desc = f"shape {tuple(x.shape)} {x.dtype}"
        out.append((path, desc + (f" values {checksum(_plain(x))}" if values and x.device.type != "meta" else "")))
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            _describe(v, f"{path}[{i}]", values, out)
    elif isinstance(x, dict):
        for k, v in x.items():
            _describe(v, f"{path}[{k!r}]", values, out)
    elif x is None or isinstance(x, (bool, int, float, str)):
        out.append((path, f"value {x!r}"))
    else:
        out.append((path, f"a {type(x).__qualname__}"))


class InputAgreement:
    """The per-call input check of one ``apply_fn`` (kept on it as ``input_check``); ``values``
    switches the value check on or off (default: the ``HPF_CHECK_INPUTS`` environment variable)."""

    def __init__(self, program: Program, axes: list[str], root: nn.Module):
        mesh = program.mesh
        self.axes = [(a, mesh.get_group(a)) for a in axes]
        self.agreed: set = set()
        self.values = os.environ.get("HPF_CHECK_INPUTS", "0") not in ("", "0")
        self.names = _positional_names(root)

    @classmethod
    def for_program(cls, program: Program, root: nn.Module) -> InputAgreement | None:
        """The check for ``program``'s ``apply_fn`` (``root``: its skeleton); None when no axis
        needs one (or there is no process group to agree over)."""
        if not dist.is_initialized() or dist.get_backend() == "fake":
            return None
        axes = agreeing_axes(program)
        return cls(program, axes, root) if axes else None

    def pending(self, args: tuple, kwargs: dict) -> Callable[[], None] | None:
        """The check this call needs (``apply_fn`` runs it just before its first collective), or
        None for a signature agreed before (without the value check)."""
        key = None
        if not self.values:
            key = (tuple(signature(a) for a in args), tuple((k, signature(v)) for k, v in kwargs.items()))
            if key in self.agreed:
                return None
        return lambda: self.check(args, kwargs, key)

    def check(self, args: tuple, kwargs: dict, key=None, *, values: bool | None = None) -> None:
        """Raise ``InputMismatchError`` on every rank of an axis whose ranks were given different
        inputs (every tensor argument's shape and dtype, every plain scalar's value, by argument;
        with ``values`` — default ``self.values`` — a checksum of every tensor too); ``key``: the
        signature to remember once agreed."""
        values = self.values if values is None else values
        described: list[tuple[str, str]] = []
        for i, a in enumerate(args):
            _describe(a, f"argument {self.names[i]!r}" if i < len(self.names) else f"positional argument {i}",
                      values, described)
        for k, v in kwargs.items():
            _describe(v, f"argument {k!r}", values, described)
        payload = json.dumps(sorted(described)).encode()  # keyword order is not part of the input
        for axis, group in self.axes:
            everyone = _exchange(group, payload, axis)
            if any(p != payload for p in everyone):
                raise InputMismatchError(_explain(axis, dist.get_process_group_ranks(group), everyone))
        if key is not None:
            self.agreed.add(key)


def _exchange(group, payload: bytes, axis: str) -> list[bytes]:
    """Every rank of ``group``'s ``payload`` (in group rank order), through the store, not a
    collective: a rank whose signature is new waits there for its peers within the timeout
    (``hpf.set_timeout``), so a peer that skipped the check (a signature it agreed before) makes it
    raise rather than pair a check with a collective of the forward.  Exchanges are numbered per
    process group (a counter per rank in the store itself, no module state), so every rank of an
    axis must call its ``apply_fn``s in the same order (as any collective requires)."""
    name = group.group_name
    store = dist.distributed_c10d._get_default_store()
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank()
    seq = store.add(f"hpf/inputs/{name}/count/{me}", 1) - 1  # this rank's exchanges over the group, kept by the store
    keys = [f"hpf/inputs/{name}/{seq}/{r}" for r in ranks]
    store.set(keys[ranks.index(me)], payload)
    timeout = get_timeout(name)
    try:
        store.wait(keys, timeout)
    except RuntimeError as exc:
        raise InputMismatchError(
            f"apply_fn: the ranks of mesh axis {axis!r} ({ranks}) did not all check their inputs within "
            f"{timeout.total_seconds():g}s (hpf.set_timeout): a rank called apply_fn with input shapes it had used "
            "before while this rank's are new to it (so they differ), or a rank is stuck or failed; "
            f"the process group may be unusable now ({exc})") from exc
    everyone = [bytes(v) for v in store.multi_get(keys)]
    if seq >= 2:  # every peer has finished exchange seq - 2 (it is in seq - 1 or later)
        store.delete_key(f"hpf/inputs/{name}/{seq - 2}/{me}")
    return everyone


def _explain(axis: str, ranks: list[int], everyone: list[bytes]) -> str:
    """The first argument whose description differs across ``ranks``, with each variant's ranks."""
    decoded = [dict(map(tuple, json.loads(p))) for p in everyone]
    paths = list(dict.fromkeys(k for d in decoded for k in d))
    for path in paths:
        variants: dict[str, list[int]] = {}
        for r, d in zip(ranks, decoded, strict=True):
            variants.setdefault(d.get(path, "absent"), []).append(r)
        if len(variants) > 1:
            seen = "; ".join(f"{v} on ranks {rs}" for v, rs in variants.items())
            return (f"apply_fn: {path} differs across the ranks of mesh axis {axis!r}: {seen}. The plan replicates "
                    f"the inputs over {axis!r}, so every rank of the axis must be given the same batch (shard the "
                    "batch over a data axis instead)")
    return f"apply_fn: the inputs differ across the ranks of mesh axis {axis!r} ({ranks})"
