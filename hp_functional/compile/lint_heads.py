"""Lint ``head-attr``: a sharded Colwise output reshaped with a head count the skeleton keeps global.

An attention module that reshapes its projections with ``self.n_heads`` needs the local count on
the skeleton (``Heads(attrs=...)``).  Left undivided, torch fails at the first call with a bare
``shape '[2, 16, 8, 8]' is invalid for input of size 1024`` — or, with a ``-1`` in the shape,
silently splits every head in two.  This check finds both before anything runs: it traces the
module's forward twice on meta tensors — at global shapes, and at the local shapes and
attributes the skeleton would have — and compares every ``view``/``reshape``/``unflatten`` that
splits a last dim.  A split that fails only at local shapes, or whose trailing (per-head) size
differs from the global trace's, is an error naming the module and the integer attributes that
fed it.  Meta copies only (``plan.trace.meta_copy``): the model is read, never run or mutated.
A module whose forward needs more than one tensor argument, or that fails at global shapes too,
is not traced (HF attention reshapes with ``-1`` and ``head_dim``, and needs nothing).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.overrides import TorchFunctionMode

from ..core.errors import PlanError
from ..core.placement import local_layout, mesh_placements
from ..core.program import Planned
from ..plan.local import Local
from ..plan.styles import ModuleSpec
from ..plan.trace import meta_copy

_SPLITS = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.unflatten}


@dataclass(frozen=True)
class _Split:
    """One view/reshape/unflatten call: the ints it was given, its input and output shapes (None:
    it raised, with ``error``)."""

    ints: tuple[int, ...]
    shape_in: tuple[int, ...]
    shape_out: tuple[int, ...] | None
    error: str = ""


class _Recorder(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls: list[_Split] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _SPLITS or not args or not isinstance(args[0], torch.Tensor):
            return func(*args, **kwargs)
        ints = tuple(i for a in (*args[1:], *kwargs.values()) for i in (a if isinstance(a, (tuple, list)) else (a,))
                     if isinstance(i, int) and not isinstance(i, bool))
        try:
            out = func(*args, **kwargs)
        except RuntimeError as exc:
            self.calls.append(_Split(ints, tuple(args[0].shape), None, str(exc).splitlines()[0]))
            raise
        self.calls.append(_Split(ints, tuple(args[0].shape), tuple(out.shape)))
        return out


def _trace(module: nn.Module, shapes: Mapping[str, torch.Size], attrs: Mapping[str, int], width: int) -> list[_Split] | None:
    """The splits of one forward of a meta copy of ``module`` whose tensors have ``shapes`` and
    whose attributes ``attrs`` (path → value) are set; None if the forward fails elsewhere."""
    twin = meta_copy(module, shapes)
    for path, value in attrs.items():
        owner, _, attr = path.rpartition(".")
        setattr(twin.get_submodule(owner), attr, value)
    x = torch.empty(1, 4, width, device="meta")
    recorder = _Recorder()
    try:
        with torch.no_grad(), recorder:
            twin(x)
    except Exception:  # noqa: BLE001 - any failure: the calls recorded so far say whether a split raised
        return recorder.calls if recorder.calls and recorder.calls[-1].shape_out is None else None
    return recorder.calls


def _one_tensor_forward(module: nn.Module) -> bool:
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) == 1


def _culprits(module: nn.Module, call: _Split, attrs: Mapping[str, int]) -> list[tuple[str, int]]:
    """(name, value) of the integer attributes of ``module`` the call was given: the head counts
    among them if any (names with "head" and no "dim"/"size"), else all of them."""
    hits = [(n, v) for n, v in vars(module).items() if isinstance(v, int) and not isinstance(v, bool) and v > 1
            and v in call.ints and n not in attrs]
    heads = [(n, v) for n, v in hits if "head" in n and "dim" not in n and "size" not in n]
    return heads or hits


def _ints(module: nn.Module) -> tuple[tuple[str, int], ...]:
    return tuple(sorted((n, v) for n, v in vars(module).items() if isinstance(v, int) and not isinstance(v, bool)))


def undivided_head_attrs(model: nn.Module, mesh: DeviceMesh, planned: Sequence[Planned],
                         specs: Mapping[str, ModuleSpec]) -> list[tuple[str, str]]:
    """``(module, message)`` of every ``head-attr`` error (see the module docstring), over the
    parents of Colwise Linears whose output stays sharded; identical layers are traced once."""
    by_fqn = {p.fqn: p for p in planned if p.fqn in specs}
    parents: dict[str, list[str]] = {}
    for fqn, p in by_fqn.items():
        out = specs[fqn].out_dst.get("output", specs[fqn].out_src.get("output", {})).get(p.axis)
        if fqn and isinstance(p.module, nn.Linear) and isinstance(out, Shard) and specs[fqn].params:
            parents.setdefault(fqn.rpartition(".")[0], []).append(fqn)
    findings, seen = [], {}
    modules = dict(model.named_modules())
    for parent, children in sorted(parents.items()):
        module = modules[parent]
        if parent in by_fqn and isinstance(by_fqn[parent].style, Local) or not _one_tensor_forward(module):
            continue
        try:
            shapes, attrs = _local_view(parent, module, by_fqn, specs, mesh)
        except PlanError:  # indivisible dims, bad placements: placing the parameters raises those itself
            continue
        key = (type(module), tuple((n, tuple(t.shape)) for n, t in module.named_parameters()),
               tuple(sorted(shapes.items())), tuple(sorted(attrs.items())), _ints(module))
        if key not in seen:
            seen[key] = _compare(module, shapes, attrs, modules[children[0]].in_features)
        bad = seen[key]
        if bad is not None:
            call, how = bad
            names = _culprits(module, call, {a for a in attrs if "." not in a})
            which = ", ".join(f"attribute {n}={v}" for n, v in names) or f"the ints {list(call.ints)}"
            fix = f"Heads(attrs={tuple(n for n, _ in names)!r})" if names else "Heads(attrs=(...))"
            findings.append((parent, (
                f"{parent or '<root module>'}: reshapes the sharded output of {[c.rpartition('.')[2] for c in children]} "
                f"with {which}, which the skeleton keeps at its global value ({how}); plan {parent!r} as {fix} "
                "so that the skeleton holds the local count (or PrepareInput(..., divide_attrs=...))")))
    return findings


def _local_view(parent: str, module: nn.Module, by_fqn: Mapping[str, Planned], specs: Mapping[str, ModuleSpec],
                mesh: DeviceMesh) -> tuple[dict[str, torch.Size], dict[str, int]]:
    """(local shapes by parameter path below ``parent``, skeleton attributes by path) of the
    planned modules at or below ``parent``, as the skeleton would hold them."""
    shapes, attrs = {}, {}
    for fqn, p in by_fqn.items():
        if fqn != parent and not fqn.startswith(f"{parent}." if parent else ""):
            continue
        rel = fqn[len(parent) + 1:] if parent and fqn != parent else ("" if fqn == parent else fqn)
        prefix = f"{rel}." if rel else ""
        spec = specs[fqn]
        for name, per_axis in spec.params.items():
            full = dict(module.named_parameters()).get(prefix + name)
            if full is not None:
                shapes[prefix + name] = local_layout(full.shape, mesh_placements(per_axis, mesh, fqn), mesh, fqn)[0]
        size = mesh.size(list(mesh.mesh_dim_names).index(p.axis))
        sub = module.get_submodule(rel) if rel else module
        for attr in spec.divide_attrs:
            value = getattr(sub, attr, None)
            if not isinstance(value, int) or value % size:
                raise PlanError(f"{fqn}: {attr}")  # check_head_counts names it; nothing to trace
            attrs[prefix + attr] = value // size
        for attr, value in spec.set_attrs.items():
            attrs[prefix + attr] = value
    return shapes, attrs


def _compare(module: nn.Module, shapes, attrs, width: int) -> tuple[_Split, str] | None:
    """The first split that fails or cuts the per-head size at local shapes, with how; None: fine."""
    whole = _trace(module, {}, {}, width)
    if whole is None or (whole and whole[-1].shape_out is None):
        return None  # not traceable at global shapes: nothing to compare
    local = _trace(module, shapes, attrs, width)
    if local is None:
        return None
    for g, mine in zip(whole, local, strict=False):
        if mine.shape_out is None:
            return mine, f"torch would raise: {mine.error}"
        splits_last = len(g.shape_out) > len(g.shape_in) and len(mine.shape_out) == len(g.shape_out)
        if splits_last and g.shape_out[-1] != mine.shape_out[-1]:
            return mine, f"each head's {g.shape_out[-1]} features would be cut to {mine.shape_out[-1]}"
    return None
