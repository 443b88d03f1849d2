"""Parallel styles: each turns a module into a ``ModuleSpec`` (and, rarely, a local forward).

``ModuleSpec`` is the one low-level boundary contract every style compiles to: where the
module's own parameters are stored and used, and which placement each forward argument and
output has on the way in and out (keyed by mesh axis name).  ``shard()`` lowers every
src → dst difference to collectives once (see ``core.lowering``); a style never communicates
itself.  Styles are frozen dataclasses: pure descriptions, safe to share between plans.
"""

from __future__ import annotations

__all__ = [
    "Colwise", "Heads", "Key", "ModuleSpec", "NoParallel", "ParamHandler", "ParamRule", "PrepareInput",
    "PrepareOutput", "Rowwise", "SequenceParallel", "Style", "_require", "default_handlers", "is_conv1d",
    "layer_patterns", "path_matches"
]

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from ..core.collectives import AxisGroup
from ..core.errors import PlanError
from ..core.placement import AxisPlacements

Key = str | int  # a forward argument (name or position) or an output ("output" or tuple index)


class Style:
    """Base class of the named styles. ``axis`` None means the plan's axis for the style's
    ``axis_role``: ``"tp"`` (``tp_axis``) for most, ``"cp"`` (``cp_axis``) for context parallelism."""

    axis: str | None = None
    axis_role = "tp"
    #: whether the local forward is the module's own forward (False: the style computes with a function
    #: of its own, which communicates as its boundaries declare — ``Local`` and the styles built on it)
    own_forward = True

    def spec(self, module: nn.Module, fqn: str, axis: str) -> ModuleSpec:
        raise NotImplementedError

    def on_mesh(self, names: tuple[str, ...]) -> Style:
        """This style on a mesh with axes ``names`` (a style naming optional axes drops the missing ones)."""
        return self

    def local_forward(self, module: nn.Module, forward: Callable, *, fqn: str, axis: str,
                      axes: Mapping[str, AxisGroup]) -> Callable:
        """The forward to run on local shards, given the module's own ``forward``, its path, the
        style's axis and every mesh axis's group.  ``module`` is the private skeleton's copy, so a
        style may localise its attributes.  Styles whose compute is not the module's own forward
        build it with the public ``Local`` (``plan.local``)."""
        return forward


@dataclass(frozen=True)
class ModuleSpec(Style):
    """The boundary contract of one module, placements keyed by mesh axis name.

    ``params``: how each parameter is stored (missing: Replicate); its own by name, a descendant's
    by its dotted path below the module (``"q_proj.weight"``) unless a planned module nearer to it
    declares it.
    ``param_dst``: how it is used in the forward, when that differs (Rowwise bias: Partial).
    ``in_src``/``in_dst``: placement of a forward argument as it arrives / as the module needs it.
    ``out_src``/``out_dst``: placement of an output as produced / as handed on.
    ``varying``: force (True/False) whether the module's compute differs per rank on its style's
    axis; None derives it (sharded params here or below, or a sharded input), as on other axes.
    ``divide_attrs``: integer attributes (head counts) the skeleton's copy of the module holds
    divided by the axis size, for modules that reshape with ``self.num_heads``.
    ``set_attrs``: integer attributes the skeleton's copy holds with exactly these values (KV-head
    replication sets ``num_key_value_groups`` to the local query heads per local KV head).
    ``region``: force whether the module is a rank-varying region on its varying axes (the
    gradients of replicated values inside it are per-rank partial sums, reduced once at its
    entry: its replicated parameters' and Replicate inputs'); None: a region when it is varying
    and takes a Replicate input (``compile.regions``).  ``Local`` entries are regions.
    ``param_blocks``: packed parameters (fused ``gate_up_proj``/``qkv_proj``): a number of equal
    sub-blocks, or their sizes, along the sharded dim; each block is sharded separately.
    ``summed_axes``: axes on which every rank feeds its own data through this module's sharded
    parameters (experts when ``ep`` shares ranks with ``dp``); their gradients arrive summed over
    the axis, recorded as its ``SummedOver`` facet for ``reduce_gradients``.
    ``data_axes``: axes over which the data this module's subtree computes on is split per rank
    (context parallelism's sequence chunks): every replicated parameter below is consumed by
    rank-varying compute there, so its gradient is summed over those axes in the backward.
    """

    params: Mapping[str, AxisPlacements] = field(default_factory=dict)
    param_dst: Mapping[str, AxisPlacements] = field(default_factory=dict)
    in_src: Mapping[Key, AxisPlacements] = field(default_factory=dict)
    in_dst: Mapping[Key, AxisPlacements] = field(default_factory=dict)
    out_src: Mapping[Key, AxisPlacements] = field(default_factory=dict)
    out_dst: Mapping[Key, AxisPlacements] = field(default_factory=dict)
    varying: bool | None = None
    divide_attrs: tuple[str, ...] = ()
    param_blocks: Mapping[str, int | tuple[int, ...]] = field(default_factory=dict)
    region: bool | None = None
    set_attrs: Mapping[str, int] = field(default_factory=dict)
    summed_axes: tuple[str, ...] = ()
    data_axes: tuple[str, ...] = ()

    def spec(self, module: nn.Module, fqn: str, axis: str) -> ModuleSpec:
        """A ModuleSpec in a plan is used as written."""
        own = dict(module.named_parameters())
        for name in sorted({*self.params, *self.param_dst}):
            if name not in own:
                raise PlanError(f"{fqn or '<root module>'}: the plan names parameter {name!r}, module has "
                                f"{sorted(own)[:12]}")
        return self

    @property
    def axes(self) -> set[str]:
        """Every mesh axis the spec mentions."""
        maps = (self.params, self.param_dst, self.in_src, self.in_dst, self.out_src, self.out_dst)
        return {a for m in maps for per_axis in m.values() for a in per_axis}


def path_matches(pattern: str, path: str) -> bool:
    """Whether a dot-path ``pattern`` (``*``: exactly one segment) matches module/parameter ``path``."""
    if not path or not pattern:  # the root module is addressed by the empty path only
        return pattern == path
    p, q = pattern.split("."), path.split(".")
    return len(p) == len(q) and all(a == "*" or a == b for a, b in zip(p, q, strict=True))


def layer_patterns(paths) -> list[str]:
    """Module paths as plan patterns, layer indices as ``*`` (``model.layers.3.mlp`` →
    ``model.layers.*.mlp``), each pattern once, in first-seen order."""
    return list(dict.fromkeys(".".join("*" if part.isdigit() else part for part in p.split(".")) for p in paths))


def _require(module: nn.Module, kinds: tuple[type, ...], style: Style, fqn: str) -> None:
    if not isinstance(module, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise PlanError(f"{fqn or '<root module>'}: {type(style).__name__} needs a {names}, got {type(module).__name__}")


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is HF's ``Conv1D`` (GPT-2 family: a Linear whose weight is stored
    transposed, ``[in, out]``, and whose forward reshapes with ``self.nf``); recognised by name
    and shape so that this layer needs no ``transformers`` import."""
    weight = getattr(module, "weight", None)
    return (any(k.__name__ == "Conv1D" for k in type(module).__mro__) and isinstance(weight, torch.Tensor)
            and weight.dim() == 2 and tuple(weight.shape) == (getattr(module, "nx", None), getattr(module, "nf", None)))


def _projection(module: nn.Module, style: Style, fqn: str) -> tuple[int, int]:
    """(weight dim of the output features, of the input features) of an ``nn.Linear`` (0, 1) or
    a ``Conv1D`` (1, 0); a PlanError for any other module."""
    if is_conv1d(module):
        return 1, 0
    _require(module, (nn.Linear,), style, fqn)
    return 0, 1


def _per_feature(module: nn.Module, fqn: str) -> list[str]:
    """The extra parameters of a Linear subclass, one value per output feature (Dory's LM head
    ``logit_scale`` [vocab]): sharded with the output features they scale.  Any other extra
    parameter is a PlanError naming it (its use on the sharded output cannot be known)."""
    out = getattr(module, "out_features", None) or getattr(module, "nf", None)
    extra = [(n, p) for n, p in module.named_parameters(recurse=False) if n not in ("weight", "bias")]
    bad = [f"{n} {tuple(p.shape)}" for n, p in extra if tuple(p.shape) != (out,)]
    if bad:
        raise PlanError(f"{fqn or '<root module>'}: Colwise shards the output features of {type(module).__name__}, whose "
                        f"forward also uses {bad}: a parameter that is not one value per output feature ({out}) cannot "
                        "follow the split; plan this module another way (e.g. Colwise on a plain nn.Linear, or Local)")
    return [n for n, _ in extra]


@dataclass(frozen=True)
class Colwise(Style):
    """Linear with the output features sharded: weight and bias Shard(0), output Shard(-1).
    On HF's ``Conv1D`` (weight ``[in, out]``) the weight is Shard(1) and the skeleton's copy
    holds ``nf`` (its output features) divided by the axis size.

    ``input_layout=Shard(1)`` all-gathers a sequence-sharded input (Megatron-SP);
    ``gather_output=True`` (or ``output_layout=Replicate()``) all-gathers the output.
    ``packed=2`` (or block sizes) shards each block of a fused projection separately, so every
    rank holds matching slices of, e.g., gate and up (HF ``packed_colwise``).  A Linear
    subclass's extra parameters of one value per output feature are sharded with them.
    """

    input_layout: Placement = Replicate()
    output_layout: Placement = Shard(-1)
    gather_output: bool = False
    packed: int | tuple[int, ...] | None = None
    axis: str | None = None

    def spec(self, module: nn.Module, fqn: str, axis: str) -> ModuleSpec:
        out_dim, _ = _projection(module, self, fqn)
        out = Replicate() if self.gather_output else self.output_layout
        if self.packed and out != Shard(-1):
            raise PlanError(f"{fqn}: a packed Colwise keeps its output sharded (gathering would interleave the blocks "
                            "rank by rank); drop gather_output/output_layout")
        names = ["weight"] + (["bias"] if module.bias is not None else []) + _per_feature(module, fqn)
        return ModuleSpec(
            params={n: {axis: Shard(out_dim if n == "weight" else 0)} for n in names},
            param_blocks={n: self.packed for n in names} if self.packed else {},
            in_src={0: {axis: self.input_layout}},
            in_dst={0: {axis: Replicate()}},
            out_src={"output": {axis: Shard(-1)}},
            out_dst={"output": {axis: out}},
            divide_attrs=("nf",) if out_dim == 1 else (),
        )


@dataclass(frozen=True)
class Rowwise(Style):
    """Linear with the input features sharded: weight Shard(1), output partial sums reduced.

    The bias is stored replicated and used as Partial (rank 0 adds it), so it is added once
    after the reduction.  ``output_layout=Shard(1)`` reduce-scatters onto the sequence dim
    (Megatron-SP); ``input_layout=Replicate()`` splits a replicated input locally.  On HF's
    ``Conv1D`` (weight ``[in, out]``) the weight is Shard(0).
    """

    input_layout: Placement = Shard(-1)
    output_layout: Placement = Replicate()
    axis: str | None = None

    def spec(self, module: nn.Module, fqn: str, axis: str) -> ModuleSpec:
        _, in_dim = _projection(module, self, fqn)
        has_bias = module.bias is not None
        return ModuleSpec(
            params={"weight": {axis: Shard(in_dim)}, **({"bias": {axis: Replicate()}} if has_bias else {})},
            param_dst={"bias": {axis: Partial()}} if has_bias else {},
            in_src={0: {axis: self.input_layout}},
            in_dst={0: {axis: Shard(-1)}},
            out_src={"output": {axis: Partial()}},
            out_dst={"output": {axis: self.output_layout}},
        )


@dataclass(frozen=True)
class NoParallel(Style):
    """The module is not parallelised: every parameter replicated (HF ``replicate``; named as
    torchtitan's style, so that it cannot be confused with the ``Replicate()`` placement).
    ``reduce_grads=True`` marks the compute rank-varying (e.g. a per-head norm on local heads,
    HF ``replicated_with_grad_allreduce``): the parameter gradients are then all-reduced inside
    the backward."""

    reduce_grads: bool = False
    axis: str | None = None

    def spec(self, module: nn.Module, fqn: str, axis: str) -> ModuleSpec:
        return ModuleSpec(varying=True if self.reduce_grads else None)


@dataclass(frozen=True)
class SequenceParallel(Style):
    """A norm (or any module with only 1-D parameters) on activations sharded on ``seq_dim``.

    Its replicated weights see only local tokens, so their gradients are all-reduced in the
    backward.  ``output_layout=Replicate()`` all-gathers the output.
    """

    seq_dim: int = 1
    output_layout: Placement | None = None
    axis: str | None = None

    def spec(self, module: nn.Module, fqn: str, axis: str) -> ModuleSpec:
        bad = [n for n, p in module.named_parameters(recurse=False) if p.dim() > 1]
        if bad:
            raise PlanError(f"{fqn}: SequenceParallel needs a norm-like module (1-D parameters); {bad} are not 1-D")
        seq = Shard(self.seq_dim)
        return ModuleSpec(
            in_src={0: {axis: seq}},
            in_dst={0: {axis: seq}},
            out_src={"output": {axis: seq}},
            out_dst={"output": {axis: self.output_layout or seq}},
        )


@dataclass(frozen=True)
class PrepareInput(Style):
    """Only re-places forward arguments: ``inputs={key: (src, dst)}``.  A module whose inputs
    become Replicate for sharded submodules is a *rank-varying region*: the gradient of those
    inputs is reduced once at its entry, not by every projection inside."""

    inputs: Mapping[Key, tuple[Placement, Placement]] = field(default_factory=dict)
    divide_attrs: tuple[str, ...] = ()
    axis: str | None = None

    def spec(self, module: nn.Module, fqn: str, axis: str) -> ModuleSpec:
        return ModuleSpec(
            in_src={k: {axis: s} for k, (s, _) in self.inputs.items()},
            in_dst={k: {axis: d} for k, (_, d) in self.inputs.items()},
            divide_attrs=self.divide_attrs,
        )

    def __hash__(self) -> int:
        return hash((tuple(self.inputs.items()), self.divide_attrs, self.axis))


@dataclass(frozen=True)
class Heads(Style):
    """An attention module that reshapes with attribute head counts: the skeleton's copy holds
    ``attrs`` divided by the axis size (the user's module and config are untouched).  A count
    that does not divide (e.g. ``num_key_value_heads`` < TP size) is rejected."""

    attrs: tuple[str, ...] = ("num_heads", "num_key_value_heads")
    axis: str | None = None

    def spec(self, module: nn.Module, fqn: str, axis: str) -> ModuleSpec:
        return ModuleSpec(divide_attrs=tuple(a for a in self.attrs if hasattr(module, a)))


@dataclass(frozen=True)
class PrepareOutput(Style):
    """Only re-places outputs: ``outputs={key: (src, dst)}``."""

    outputs: Mapping[Key, tuple[Placement, Placement]] = field(default_factory=dict)
    axis: str | None = None

    def spec(self, module: nn.Module, fqn: str, axis: str) -> ModuleSpec:
        return ModuleSpec(
            out_src={k: {axis: s} for k, (s, _) in self.outputs.items()},
            out_dst={k: {axis: d} for k, (_, d) in self.outputs.items()},
        )

    def __hash__(self) -> int:
        return hash((tuple(self.outputs.items()), self.axis))


@dataclass(frozen=True)
class ParamRule:
    """What a special handler decides for one parameter: its storage placement on the axis and,
    for packed layouts, the sub-blocks sharded separately."""

    placement: Placement
    blocks: int | tuple[int, ...] | None = None


ParamHandler = Callable[[torch.Tensor, str], ParamRule]


@dataclass(frozen=True)
class FixedRule:
    """A special handler that gives every parameter it matches the same rule (picklable)."""

    rule: ParamRule

    def __call__(self, param: torch.Tensor, fqn: str) -> ParamRule:
        return self.rule


def default_handlers() -> dict[str, ParamHandler]:
    """A new dict of the built-in special handlers; extend a copy and pass it to the plan
    (``ShardingPlan(..., handlers={**default_handlers(), "mine": fn})``) — nothing global changes.

    Returns:
        handler name → ``ParamHandler``: ``shard_heads`` (Shard(0)), ``shard_last`` (Shard(-1)), ``replicate``,
        ``packed_2`` / ``packed_3`` (Shard(0) in 2 or 3 packed blocks)."""
    return {
        "shard_heads": FixedRule(ParamRule(Shard(0))),  # per-head vectors: sinks, A_log, dt_bias
        "shard_last": FixedRule(ParamRule(Shard(-1))),
        "replicate": FixedRule(ParamRule(Replicate())),
        "packed_2": FixedRule(ParamRule(Shard(0), 2)),
        "packed_3": FixedRule(ParamRule(Shard(0), 3)),
    }
