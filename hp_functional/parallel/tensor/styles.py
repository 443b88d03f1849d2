"""Tensor parallelism's styles (Megatron's column/row split, sequence parallel, head counts and the
input/output redistributions of torch's ``PrepareModuleInput``/``Output``): each turns a module
into a ``ModuleSpec`` (the contract in ``core.style``)."""

from __future__ import annotations

__all__ = ["Colwise", "Heads", "NoParallel", "PrepareInput", "PrepareOutput", "Rowwise", "SequenceParallel", "ShardedParams",
           "is_conv1d"]

from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from ...core.errors import PlanError
from ...core.module_kinds import CONVS, is_conv1d
from ...core.style import Key, ModuleSpec, Style, _require
from .channels import batched_conv, channel_dim


def _projection(module: nn.Module, style: Style, fqn: str) -> tuple[int, int]:
    """(weight dim of the output features, of the input features) of an ``nn.Linear`` (0, 1), a
    ``Conv1D`` (1, 0) or an ungrouped ``nn.Conv1d/2d/3d`` (0, 1: output, input channels); a
    PlanError for any other module."""
    if is_conv1d(module):
        return 1, 0
    if isinstance(module, CONVS):
        if module.groups != 1:
            raise PlanError(
                f"{fqn or '<root module>'}: {type(style).__name__} splits the channels of {type(module).__name__}, but it "
                f"is grouped (groups={module.groups}): each output channel sees only its group's inputs. Plan it "
                "Channels() if it sits between a channel-split Colwise and Rowwise (its groups then split with the "
                "channels), else NoParallel()")
        return 0, 1
    _require(module, (nn.Linear, *CONVS), style, fqn)
    return 0, 1


def _features(module: nn.Module, layout: Placement) -> Placement:
    """``layout`` on ``module``'s activations: ``Shard(-1)`` names the feature dim, the last for a
    Linear and the channels (dim 1) for a convolution."""
    return channel_dim(layout) if isinstance(module, CONVS) else layout


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
    holds ``nf`` (its output features) divided by the axis size.  On an ungrouped
    ``nn.Conv1d/2d/3d`` the output channels are split: weight and bias Shard(0), output Shard(1)
    (the channels of a batched ``(N, C, ...)`` input; ``Shard(-1)`` in a layout means that dim),
    the skeleton's ``out_channels`` divided; ``packed`` is refused there.

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
        if self.packed and isinstance(module, CONVS):
            raise PlanError(f"{fqn}: Colwise(packed=...) splits fused Linear projections, not the channels of "
                            f"{type(module).__name__}: drop packed (or split the convolution into one per block)")
        out = Replicate() if self.gather_output else self.output_layout
        if self.packed and out != Shard(-1):
            raise PlanError(f"{fqn}: a packed Colwise keeps its output sharded (gathering would interleave the blocks "
                            "rank by rank); drop gather_output/output_layout")
        names = ["weight"] + (["bias"] if module.bias is not None else []) + _per_feature(module, fqn)
        conv = isinstance(module, CONVS)
        return ModuleSpec(
            params={n: {axis: Shard(out_dim if n == "weight" else 0)} for n in names},
            param_blocks={n: self.packed for n in names} if self.packed else {},
            in_src={0: {axis: _features(module, self.input_layout)}},
            in_dst={0: {axis: Replicate()}},
            out_src={"output": {axis: _features(module, Shard(-1))}},
            out_dst={"output": {axis: _features(module, out)}},
            divide_attrs=("nf",) if out_dim == 1 else ("out_channels",) if conv else (),
        )

    def local_forward(self, module, forward, *, fqn, axis, axes):
        """A convolution's forward refuses an unbatched input (its channels are dim 0, not 1)."""
        return batched_conv(module, forward, fqn, split_input=False) if isinstance(module, CONVS) else forward


@dataclass(frozen=True)
class Rowwise(Style):
    """Linear with the input features sharded: weight Shard(1), output partial sums reduced.

    The bias is stored replicated and used as Partial (rank 0 adds it), so it is added once
    after the reduction.  ``output_layout=Shard(1)`` reduce-scatters onto the sequence dim
    (Megatron-SP); ``input_layout=Replicate()`` splits a replicated input locally.  On HF's
    ``Conv1D`` (weight ``[in, out]``) the weight is Shard(0).  On an ungrouped
    ``nn.Conv1d/2d/3d`` the input channels are split: weight Shard(1), input Shard(1) (the
    channels of a batched ``(N, C, ...)`` input; ``Shard(-1)`` in a layout means that dim), the
    skeleton's ``in_channels`` divided; the bias is added once, as on a Linear.
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
            in_src={0: {axis: _features(module, self.input_layout)}},
            in_dst={0: {axis: _features(module, Shard(-1))}},
            out_src={"output": {axis: Partial()}},
            out_dst={"output": {axis: _features(module, self.output_layout)}},
            divide_attrs=("in_channels",) if isinstance(module, CONVS) else (),
        )

    def local_forward(self, module, forward, *, fqn, axis, axes):
        """A convolution's forward refuses an unbatched input (its channels are dim 0, not 1)."""
        return batched_conv(module, forward, fqn, split_input=True) if isinstance(module, CONVS) else forward


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
class ShardedParams(Style):
    """The module computes as unsharded, on its whole parameters, which each rank stores split on
    dim 0 over the axis and gathers before every call (ZeRO-3's storage on the TP axis): for a
    module TP cannot split (an LSTM, a grouped convolution, a position table read whole) that every
    rank would otherwise hold whole.  Exact as ``NoParallel``: the same compute on the same values.
    The gather's backward keeps this rank's rows of the gradient (summed over the axis first where
    the data the module sees differs per rank, ``core.lowering``).  Costs one all-gather per
    parameter per call; the gathered weights live as long as autograd keeps them (to the backward)."""

    axis: str | None = None

    def spec(self, module: nn.Module, fqn: str, axis: str) -> ModuleSpec:
        own = dict(module.named_parameters(recurse=False))
        if not own or any(p.dim() == 0 for p in own.values()):
            raise PlanError(f"{fqn or '<root module>'}: ShardedParams() splits each of the module's own parameters on "
                            f"dim 0; it has {'none' if not own else 'a scalar one'} ({sorted(own)[:6]}): use NoParallel()")
        return ModuleSpec(params={n: {axis: Shard(0)} for n in own}, param_dst={n: {axis: Replicate()} for n in own},
                          varying=False)


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
