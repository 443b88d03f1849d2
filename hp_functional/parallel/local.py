"""``Local``: a plan entry whose forward is written by hand with explicit collectives —
``shard_map`` for modules (JAX's ``shard_map``, torch's experimental ``local_map``).

``fn(module, axes, *args, **kwargs)`` runs on every rank instead of the module's forward, on the
skeleton's copy holding this rank's shards, its arguments and results converted by the same
boundary contract as every other style.  A ``Local`` is a rank-varying region, so any mix of the
collectives bound on ``axes`` has exact gradients; ``check=True`` verifies declared Replicate
outputs at run time.  See docs/local.md.
"""

from __future__ import annotations

__all__ = ["Local"]

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import Placement, Replicate

from ..core.collectives import AxisGroup, raw_all_gather
from ..core.errors import PlanError, ReplicationError
from ..core.placement import AxisPlacements, is_placement
from ..core.signature import map_output, output_index
from ..core.style import Key, ModuleSpec, SequenceSplit, Style

#: A placement on the entry's own axis, or placements keyed by mesh axis name.
Layout = Placement | Mapping[str, Placement]
#: ``fn(module, axes, *args, **kwargs)``: the hand-written forward.
LocalFn = Callable[..., Any]
#: ``on_mismatch(error)``: what ``check`` does with a replication error (``True``: raise it).
OnMismatch = Callable[[ReplicationError], None]


def _per_axis(layouts: Mapping[Any, Layout], axis: str, what: str) -> dict[Any, AxisPlacements]:
    out = {}
    for key, layout in layouts.items():
        if is_placement(layout):
            out[key] = {axis: layout}
        elif isinstance(layout, Mapping) and all(is_placement(p) for p in layout.values()):
            out[key] = dict(layout)
        else:
            raise PlanError(f"Local {what}[{key!r}]: {layout!r} is not a Placement or a {{axis: Placement}} dict")
    return out


@dataclass(frozen=True, eq=False)
class Local(Style):
    """A hand-written local forward with declared boundaries (see the module docstring, docs/local.md).

    ``in_src``/``in_dst``: placement of forward argument (position or name) as it arrives / as
    ``fn`` receives it; ``out_src``/``out_dst``: of an output ("output" or a tuple index) as
    ``fn`` returns it / as it is handed on (missing: Replicate).  ``params``/``param_dst``: how
    the module's own parameters are stored / used (as ``ModuleSpec``).  A layout is a placement
    on ``axis`` (None: the plan's ``tp_axis``) or ``{axis: placement}``.  ``setup(module, axes)``
    runs once on the skeleton's copy (e.g. to localise sizes); ``divide_attrs`` divides integer
    attributes such as head counts there.  ``varying=False``: ``fn`` computes the same on every
    rank apart from its children's boundaries and the collectives it calls (the loss-parallel
    root), so it is no region.  ``check``: True raises ``ReplicationError`` when a
    Replicate output differs across ranks; a callable receives the error instead.  ``data_axes``:
    axes over which ``fn`` splits the data its children compute on (the context-parallel root):
    the replicated parameters below get their gradients summed over them (``ModuleSpec``).
    ``sequence_split``: how ``fn`` cuts the batch's sequence over ``axis`` where it does (the
    context-parallel root: ``fn`` itself, a ``core.style.SequenceSplit``), for ``hpf.rng``.

    Example — a sequence-parallel MLP that gathers and scatters the sequence itself::

        def mlp(module, axes, x):                       # x: this rank's tokens
            h = axes["tp"].all_gather(module.norm(x), 1)  # the whole sequence
            return axes["tp"].reduce_scatter(module.down(gelu(module.up(h))), 1)
        plan = {"mlp": Local(mlp, in_dst={0: Shard(1)}, out_src={"output": Shard(1)},
                             params={"up.weight": Shard(0), "up.bias": Shard(0), "down.weight": Shard(1)},
                             param_dst={"down.bias": Partial()})}  # added once, on rank 0

    (``examples/local_attention.py``: tensor-parallel attention with the heads split by hand.)
    """

    own_forward = False

    fn: LocalFn
    in_src: Mapping[Key, Layout] = field(default_factory=dict)
    in_dst: Mapping[Key, Layout] = field(default_factory=dict)
    out_src: Mapping[Key, Layout] = field(default_factory=dict)
    out_dst: Mapping[Key, Layout] = field(default_factory=dict)
    params: Mapping[str, Layout] = field(default_factory=dict)
    param_dst: Mapping[str, Layout] = field(default_factory=dict)
    setup: Callable[[nn.Module, Mapping[str, AxisGroup]], None] | None = None
    divide_attrs: tuple[str, ...] = ()
    check: bool | OnMismatch = False
    varying: bool = True
    axis: str | None = None
    data_axes: tuple[str, ...] = ()
    sequence_split: SequenceSplit | None = field(default=None, repr=False)

    @property
    def named_axes(self) -> set[str]:
        """The mesh axes named in its ``{axis: placement}`` layouts (checked against the mesh)."""
        maps = (self.in_src, self.in_dst, self.out_src, self.out_dst, self.params, self.param_dst)
        return {a for m in maps for layout in m.values() if isinstance(layout, Mapping) for a in layout}

    def spec(self, module: nn.Module, fqn: str, axis: str) -> ModuleSpec:
        """The boundary contract, after checking that ``fn`` takes what the plan declares."""
        if not callable(self.fn):
            raise PlanError(f"{fqn or '<root module>'}: Local fn must be callable, got {type(self.fn).__name__}")
        self._check_signature(fqn, [*dict.fromkeys([*self.in_src, *self.in_dst])])
        spec = ModuleSpec(
            params=_per_axis(self.params, axis, "params"), param_dst=_per_axis(self.param_dst, axis, "param_dst"),
            in_src=_per_axis(self.in_src, axis, "in_src"), in_dst=_per_axis(self.in_dst, axis, "in_dst"),
            out_src=_per_axis(self.out_src, axis, "out_src"), out_dst=_per_axis(self.out_dst, axis, "out_dst"),
            varying=self.varying, region=self.varying, divide_attrs=self.divide_attrs, data_axes=self.data_axes,
        )
        return spec.spec(module, fqn, axis)

    def _check_signature(self, fqn: str, keys: list[Key]) -> None:
        """``fn`` must take ``(module, axes, ...)`` and every declared argument (by position or name)."""
        try:
            params = list(inspect.signature(self.fn).parameters.values())
        except (TypeError, ValueError):  # a builtin without a signature: nothing to check
            return
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        var_pos = any(p.kind == p.VAR_POSITIONAL for p in params)
        var_kw = any(p.kind == p.VAR_KEYWORD for p in params)
        names = {p.name for p in params if p.kind != p.POSITIONAL_ONLY}
        where = f"{fqn or '<root module>'}: Local fn {getattr(self.fn, '__name__', self.fn)!r}"
        if len(positional) < 2 and not var_pos:
            raise PlanError(f"{where} must take (module, axes, *args, **kwargs); it takes {[p.name for p in params]}")
        for key in keys:
            if isinstance(key, int) and not (key + 2 < len(positional) or var_pos):
                raise PlanError(f"{where} does not take the declared argument {key} (forward argument {key} is "
                                f"fn's argument {key + 2}, after module and axes); it takes {[p.name for p in params]}")
            if isinstance(key, str) and key not in names and not var_kw:
                raise PlanError(f"{where} does not take the declared argument {key!r}; it takes "
                                f"{[p.name for p in params]}")

    def local_forward(self, module: nn.Module, forward: Callable, *, fqn: str, axis: str,
                      axes: Mapping[str, AxisGroup]) -> Callable:
        """``fn`` bound to the skeleton's ``module`` and the mesh's ``axes`` (with ``forward``'s
        signature, so that the boundary binds arguments as the module's own forward takes them)."""
        axes = dict(axes)  # fn's own copy (a plain dict: Dynamo traces it, not a mappingproxy)
        if self.setup is not None:
            self.setup(module, axes)
        fn, fqn = self.fn, fqn or "<root module>"
        checks = self._replicated_outputs(axes, axis) if self.check else ()
        on_mismatch = self.check if callable(self.check) else None

        def local(*args, **kwargs):
            out = fn(module, axes, *args, **kwargs)
            for key, group in checks:
                map_output(out, output_index(key), lambda t, key=key, g=group: _check(t, g, fqn, key, on_mismatch),
                           fqn, strict=False)
            return out

        local.__signature__ = inspect.signature(forward)
        return local

    def _replicated_outputs(self, axes: Mapping[str, AxisGroup], axis: str) -> tuple[tuple[Key, AxisGroup], ...]:
        """(output key, group) for every declared output (``out_src``, or ``out_dst`` alone) that
        ``fn`` returns as Replicate on an axis of size > 1.  An undeclared output of a region may
        leave as its input came in (``compile.lower``), so it is not checked."""
        declared = _per_axis(self.out_src, axis, "out_src")
        keys = dict.fromkeys([*declared, *self.out_dst])
        out = []
        for key in keys:
            for a, g in axes.items():
                if g.size > 1 and isinstance(declared.get(key, {}).get(a, Replicate()), Replicate) and (
                        a == axis or a in declared.get(key, {})):
                    out.append((key, g))
        return tuple(out)

    def __hash__(self) -> int:
        return hash((self.fn, self.axis))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Local) and repr(self) == repr(other)


@torch.compiler.disable
def _check(value: object, group: AxisGroup, fqn: str, key: Key, on_mismatch: OnMismatch | None) -> object:
    """``value`` unchanged, after checking it is the same on every rank of ``group`` (one all-gather)."""
    if not isinstance(value, Tensor):
        return value
    plain = value.detach()
    while torch._C._functorch.is_functorch_wrapped_tensor(plain):  # under torch.func: the value itself
        plain = torch._C._functorch.get_unwrapped(plain)
    everyone = raw_all_gather(plain.unsqueeze(0), 0, group).double()
    scale = everyone.abs().max().item() if everyone.numel() else 0.0
    diff = (everyone - everyone[0]).abs().max().item() if everyone.numel() else 0.0
    if diff > 1e-6 * max(scale, 1.0) or diff != diff:
        what = "output" if key == "output" else f"output {key!r}"
        error = ReplicationError(
            f"{fqn}: {what} is declared Replicate on mesh axis {group.axis!r} but differs across its ranks "
            f"(max |Δ| {diff:.3g}, max |value| {scale:.3g}): a partial sum left unreduced (call "
            f"axes[{group.axis!r}].all_reduce on it) or a rank-dependent value; if it is meant to differ, declare "
            f"it Partial() or Shard(d) in out_src")
        if on_mismatch is None:
            raise error
        on_mismatch(error)
    return value
