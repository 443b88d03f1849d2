"""Torch's own ``ParallelStyle`` objects (``torch.distributed.tensor.parallel``) as plan values.

A dict written for ``parallelize_module`` is a plan as it stands: ``ShardingPlan`` converts each
torch style once, when the plan is built (``from_torch_style``), into the style here with the
same placements, so nothing downstream knows torch's styles exist.  torchtitan's own styles are
recognised by their class's shape instead (``sources.torch_moe_styles``).  The conversion table, why
``use_local_output`` changes nothing, and what raises: docs/plan-language.md#torchs-own-styles.
"""

from __future__ import annotations

__all__ = ["ParallelStyle", "from_torch_style", "head_counts"]

from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel as TorchSequenceParallel,
)

from ..core.errors import PlanError
from ..core.style import ModuleSpec, Style
from ..parallel.tensor.styles import Colwise, PrepareInput, PrepareOutput, Rowwise, SequenceParallel
from ..parallel.tensor.vocab import VocabEmbedding
from .torch_moe_styles import behaviour_style


def _culprit(fqn: str, source: str) -> str:
    return f"{fqn or '<root module>'} ({source})" if source else (fqn or "<root module>")


def _plain_ids(module: nn.Embedding, input_layout: Placement, what: str, where: str) -> None:
    if not isinstance(input_layout, Replicate):
        raise PlanError(f"{where}: {what} on an nn.Embedding takes the token ids replicated: write "
                        f"input_layouts=Replicate() (got {input_layout})")
    if module.max_norm is not None:
        raise PlanError(f"{where}: {what} on an nn.Embedding does not support max_norm (it renormalises rows in place)")


@dataclass(frozen=True)
class TorchColwise(Colwise):
    """torch's ``ColwiseParallel``: a ``Colwise`` on an ``nn.Linear``; on an ``nn.Embedding`` the
    table is Shard(1) (each rank holds a slice of the embedding dim) and the output Shard(-1).
    ``source`` (the torch entry, for messages) takes no part in equality."""

    source: str = field(default="", compare=False, repr=False)

    def spec(self, module: nn.Module, fqn: str, axis: str) -> ModuleSpec:
        if isinstance(module, nn.Embedding):
            _plain_ids(module, self.input_layout, "ColwiseParallel", _culprit(fqn, self.source))
            return ModuleSpec(params={"weight": {axis: Shard(1)}},
                              out_src={"output": {axis: Shard(-1)}}, out_dst={"output": {axis: self.output_layout}})
        if not isinstance(module, nn.Linear):
            raise PlanError(f"{_culprit(fqn, self.source)}: ColwiseParallel needs an nn.Linear or nn.Embedding, "
                            f"got {type(module).__name__}")
        return super().spec(module, fqn, axis)


@dataclass(frozen=True)
class TorchRowwise(Rowwise):
    """torch's ``RowwiseParallel``: a ``Rowwise`` on an ``nn.Linear``; on an ``nn.Embedding`` a
    ``VocabEmbedding`` (table Shard(0), the partial rows all-reduced or reduce-scattered onto
    ``output_layout``).  ``source`` (the torch entry, for messages) takes no part in equality."""

    source: str = field(default="", compare=False, repr=False)

    def _vocab(self, module: nn.Module, fqn: str) -> VocabEmbedding | None:
        if not isinstance(module, nn.Embedding):
            return None
        _plain_ids(module, self.input_layout, "RowwiseParallel", _culprit(fqn, self.source))
        return VocabEmbedding(output_layout=self.output_layout, axis=self.axis)

    def spec(self, module: nn.Module, fqn: str, axis: str) -> ModuleSpec:
        vocab = self._vocab(module, fqn)
        if vocab is not None:
            return vocab.spec(module, fqn, axis)
        if not isinstance(module, nn.Linear):
            raise PlanError(f"{_culprit(fqn, self.source)}: RowwiseParallel needs an nn.Linear or nn.Embedding, "
                            f"got {type(module).__name__}")
        return super().spec(module, fqn, axis)

    def local_forward(self, module, forward, *, fqn, axis, axes):
        vocab = self._vocab(module, fqn)
        if vocab is not None:
            return vocab.local_forward(module, forward, fqn=fqn, axis=axis, axes=axes)
        return forward


@dataclass(frozen=True)
class PrepareInputOutput(Style):
    """``PrepareInput`` and ``PrepareOutput`` on one module (torch's ``PrepareModuleInputOutput``)."""

    inputs: PrepareInput
    outputs: PrepareOutput
    axis: str | None = None

    def spec(self, module: nn.Module, fqn: str, axis: str) -> ModuleSpec:
        out = self.outputs.spec(module, fqn, axis)
        return replace(self.inputs.spec(module, fqn, axis), out_src=out.out_src, out_dst=out.out_dst)


def head_counts(module: nn.Module) -> tuple[str, ...]:
    """The module's integer head-count attributes: names with "head" and no "dim"/"size"."""
    return tuple(n for n, v in vars(module).items() if isinstance(v, int) and not isinstance(v, bool) and v > 0
                 and "head" in n and "dim" not in n and "size" not in n)


@dataclass(frozen=True)
class TorchPrepareInput(PrepareInput):
    """torch's ``PrepareModuleInput``: a ``PrepareInput`` that also localises the module's head
    counts.  Under torch's plan the module computes on DTensors of global shape, so code such
    as DeepSeek MLA's ``k_pe.expand(-1, -1, self.n_heads, -1)`` is right there with the global
    count; here the module sees local shards, so the skeleton's copy holds ``head_counts``
    divided by the axis size (a count that does not divide is refused naming it,
    ``compile.build.check_head_counts``).  ``source`` takes no part in equality."""

    source: str = field(default="", compare=False, repr=False)

    def spec(self, module: nn.Module, fqn: str, axis: str) -> ModuleSpec:
        return replace(super().spec(module, fqn, axis), divide_attrs=head_counts(module))

    def __hash__(self) -> int:
        return super().__hash__()


def _placement(p: Any, where: str, what: str, *, partial: bool = True) -> Placement:
    """``p`` when it is one of the placements the lowering table speaks, else a PlanError."""
    if type(p) in (Replicate, Shard):  # exact types: no subclass (or _StridedShard) passes as a plain Shard
        return p
    if partial and type(p) is Partial and p.reduce_op == "sum":
        return Partial()
    allowed = "Replicate(), Shard(d)" + (" or Partial() (sum)" if partial else "")
    raise PlanError(f"{where}: {what}={p!r} cannot be expressed here (supported: {allowed})")


def _pair(src: Any, dst: Any, where: str, what: str) -> tuple[Placement, Placement]:
    s = _placement(src, where, what)
    d = s if dst is None else _placement(dst, where, f"desired_{what}")  # None: annotate, no redistribution
    if isinstance(d, Partial) and isinstance(s, Shard):
        raise PlanError(f"{where}: {what} {s} -> {d} has no redistribution (a sharded value is no partial sum)")
    return s, d


def _inputs(style: PrepareModuleInput, where: str) -> dict:
    inputs: dict = {}
    for i, (s, d) in enumerate(zip(style.input_layouts or (), style.desired_input_layouts or (), strict=False)):
        if s is not None:  # torch: None leaves the argument as it is
            inputs[i] = _pair(s, d, where, f"input_layouts[{i}]")
    for name, s in style.input_kwarg_layouts.items():
        if s is not None:
            inputs[name] = _pair(s, style.desired_input_kwarg_layouts.get(name), where, f"input_kwarg_layouts[{name!r}]")
    return inputs


def _outputs(style: PrepareModuleOutput, where: str) -> dict:
    return {("output" if i == 0 else i): _pair(s, d, where, f"output_layouts[{i}]")
            for i, (s, d) in enumerate(zip(style.output_layouts, style.desired_output_layouts, strict=True))
            if s is not None}


def _colwise(style: ColwiseParallel, where: str) -> Style:
    return TorchColwise(input_layout=_placement(style.input_layouts[0], where, "input_layouts"),
                        output_layout=_placement(style.output_layouts[0], where, "output_layouts", partial=False),
                        source=where)


def _rowwise(style: RowwiseParallel, where: str) -> Style:
    return TorchRowwise(input_layout=_placement(style.input_layouts[0], where, "input_layouts"),
                        output_layout=_placement(style.output_layouts[0], where, "output_layouts"), source=where)


def _sequence(style: TorchSequenceParallel, where: str) -> Style:
    (seq,) = style.sequence_sharding
    return SequenceParallel(seq_dim=_placement(seq, where, "sequence_dim").dim)


_CONVERTERS = {
    ColwiseParallel: _colwise,
    RowwiseParallel: _rowwise,
    TorchSequenceParallel: _sequence,
    PrepareModuleInput: lambda s, where: TorchPrepareInput(_inputs(s, where), source=where),
    PrepareModuleOutput: lambda s, where: PrepareOutput(_outputs(s, where)),
    PrepareModuleInputOutput: lambda s, where: PrepareInputOutput(
        TorchPrepareInput(_inputs(s.prepare_module_input, where), source=where),
        PrepareOutput(_outputs(s.prepare_module_output, where))),
}


def from_torch_style(style: ParallelStyle, entry: str, *, tp_axis: str = "tp", ep_tokens: str = "replicated") -> Style:
    """The style here with the placements of torch's ``style`` (or of torchtitan's, recognised by
    its class's shape: ``sources.torch_moe_styles``); ``entry`` names the plan entry (``"plan entry
    'lm_head'"``) in the PlanError a style or layout that cannot be expressed raises; ``tp_axis``
    and ``ep_tokens`` go to the experts styles (``Experts(tp_axis=, tokens=)``)."""
    where = f"{entry} ({style!r})"
    convert = _CONVERTERS.get(type(style))  # exact type: a subclass may change what _apply does
    if convert is None:
        found = behaviour_style(style, where, tp_axis=tp_axis, ep_tokens=ep_tokens, placement=_placement,
                                both=PrepareInputOutput)
        if found is not None:
            return found
        names = sorted(c.__name__ for c in _CONVERTERS)
        names += ["torchtitan's NoParallel", "TensorParallel", "ExpertParallel", "ExpertTensorParallel"]
        raise PlanError(f"{where}: torch style {type(style).__name__} has no counterpart here (supported: {names}); "
                        "write the entry as an hpf style, a ModuleSpec or a Local")
    return convert(style, where)
