"""Context parallelism for any model: the sequence arguments declared instead of HF's names.

``ShardingPlan(..., axes={"cp": "cp"}, settings={"cp_inputs": hpf.ContextInputs(sequence={"tokens": 1},
positions="positions")})`` replaces the HF root of ``parallel.context.styles`` (which knows ``input_ids``,
``inputs_embeds``, ``position_ids`` and ``labels`` with HF's shift) by one that reads the
declaration: each rank keeps its layout's positions of every sequence argument, hands the
*global* positions to the argument that carries them (rotary embeddings), and, when
``apply_fn`` is given the declared labels keyword, returns ``(output, loss)`` with the loss the
mean over the valid labels of the whole sequence (summed per rank by ``loss``, divided by the
global count, summed over the axis: its gradient is the gradient).  Without labels it returns
this rank's chunk of the output, in the layout's order, as HF's root does.
"""

from __future__ import annotations

__all__ = ["ContextInputs"]

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from torch import Tensor, nn

from ...core import collectives as C
from ...core.collectives import AxisGroup
from ...core.errors import PlanError
from ...core.signature import named_arguments
from ..local import Local
from .cp_layout import check_layout, cp_chunks, cp_positions
from .styles import IGNORE, _shifted, summed_cross_entropy

#: ``loss(output, labels) -> Tensor``: the *sum* of the per-position losses of this rank's chunk.
LossFn = Callable[[object, Tensor], Tensor]


@dataclass(frozen=True)
class ContextInputs:
    """How a model's forward takes the sequence, for context parallelism without HF's names.

    ``sequence``: forward argument → its sequence dimension (``{"tokens": 1}``); every one
    passed is cut to this rank's positions (they must agree in length).  ``positions``: the
    argument that receives each kept token's global position, shape ``[1, local seq]``
    (required: a model that numbers positions itself would number the chunk from 0; a
    positions tensor the caller passes, ``[B, seq]``, is cut like the sequence).  ``labels``:
    the ``apply_fn`` keyword holding per-position targets ``[B, seq]``, consumed before the
    forward; ``shift``: shift them by one over the whole sequence first (HF's rule; torchtitan's
    loader shifts already).  ``loss(output, labels)``: the sum over this chunk's positions
    (default: cross-entropy of the output as logits, ``ignore_index`` skipped).

    >>> cp = hpf.ContextInputs(sequence={"tokens": 1}, positions="positions")
    >>> plan = hpf.ShardingPlan({"layers.*.attention": hpf.ContextParallel("ring")}, axes={"cp": "cp"},
    ...                         settings={"cp_inputs": cp})
    >>> output, loss = apply_fn(params, tokens, labels=labels)
    """

    sequence: Mapping[str, int]
    positions: str
    labels: str = "labels"
    shift: bool = False
    loss: LossFn | None = field(default=None, compare=False)
    ignore_index: int = IGNORE

    def __post_init__(self):
        if not self.sequence or not all(isinstance(k, str) and isinstance(d, int) for k, d in self.sequence.items()):
            raise PlanError(f"ContextInputs: sequence must map forward argument names to their sequence dimension, "
                            f"got {self.sequence!r}")
        if not isinstance(self.positions, str) or not self.positions:
            raise PlanError("ContextInputs: positions must name the forward argument that carries the global positions "
                            "(each rank holds a chunk; numbered from 0 locally, its rotary angles would be wrong)")

    def reference_loss(self, output, labels: Tensor) -> Tensor:
        """The loss ``apply_fn`` returns, from the unsharded model's output over the whole sequence
        (the shard-time probe compares the two)."""
        if self.shift:
            labels = _shifted(labels, self.ignore_index)
        return _loss_sum(self, output, labels) / (labels != self.ignore_index).sum()

    def root(self, axis: str, layout: str, vocab_axis: str | None) -> Local:
        """The plan's root entry (``ShardingPlan.resolve``): replicated parameters' gradients are
        summed over ``axis`` (``data_axes``)."""
        if vocab_axis is not None and self.loss is not None:
            raise PlanError("ContextInputs: a loss function with loss_parallel (the logits arrive vocab-sharded: the "
                            "default loss is the vocab-parallel cross-entropy; drop loss= or loss_parallel)")
        fn = ContextInputsForward(axis, check_layout(layout), self, vocab_axis)
        return Local(fn, varying=False, axis=axis, data_axes=(axis,), setup=self.check_forward, sequence_split=fn)

    def check_forward(self, module: nn.Module, axes: Mapping[str, AxisGroup]) -> None:
        """The root's forward takes every declared argument (``Local.setup``: at shard time)."""
        params = inspect.signature(type(module).forward).parameters
        if any(p.kind == p.VAR_KEYWORD for p in params.values()):
            return
        missing = [name for name in (*self.sequence, self.positions) if name not in params]
        if missing:
            raise PlanError(f"ContextInputs: {type(module).__name__}.forward has no argument {missing[0]!r} (it takes "
                            f"{list(params)[1:]}); declare the arguments its forward takes")


@dataclass(frozen=True)
class ContextInputsForward:
    """The ``Local`` fn of the root of a plan with ``cp_inputs`` (see the module docstring); a
    ``core.style.SequenceSplit``."""

    axis: str
    layout: str
    inputs: ContextInputs
    vocab_axis: str | None = None

    def positions(self, rank: int, seq_len: int, size: int) -> Tensor:
        """The global positions rank ``rank`` holds in the plan's layout, in its local order."""
        return cp_positions(rank, seq_len, size, self.layout)

    def sequence_keys(self) -> tuple[tuple[str, ...], dict[str, int]]:
        """(the declared labels; the declared sequence arguments → their sequence dim, the positions' last)."""
        return (self.inputs.labels,), {**self.inputs.sequence, self.inputs.positions: -1}

    def __call__(self, module: nn.Module, axes: Mapping[str, AxisGroup], *args, cp_sharded: bool = False, **kwargs):
        g, spec = axes[self.axis], self.inputs
        labels = kwargs.pop(spec.labels, None)
        named = named_arguments(module, args, kwargs)
        seqs = {k: v for k in spec.sequence if isinstance(v := named.get(k), Tensor)}
        if not seqs:
            raise PlanError(f"context parallelism: none of the declared sequence arguments {sorted(spec.sequence)} "
                            f"was passed to {type(module).__name__}.forward")
        given = named.get(spec.positions)
        lengths = {k: v.shape[spec.sequence[k]] for k, v in seqs.items()}
        if isinstance(given, Tensor):
            lengths[spec.positions] = given.shape[-1]
        if len(set(lengths.values())) > 1:
            raise PlanError(f"context parallelism: the sequence arguments differ in length {lengths}")
        if cp_sharded and labels is not None and spec.shift:
            raise PlanError("context parallelism with cp_sharded=True and shift=True: shift the labels over the whole "
                            "sequence before cutting them (the next token of a chunk's last position is on another rank)")
        first = next(iter(seqs.values()))
        seq = next(iter(lengths.values())) * (g.size if cp_sharded else 1)
        cp_chunks(seq, g.size, self.layout, axis=self.axis)  # a ShapeError on every rank alike
        positions = cp_positions(g.rank, seq, g.size, self.layout, device=first.device)
        if not cp_sharded:
            named.update({k: v.index_select(spec.sequence[k], positions) for k, v in seqs.items()})
            if isinstance(given, Tensor):
                named[spec.positions] = given.index_select(-1, positions)
        if given is None:
            named[spec.positions] = positions.unsqueeze(0)
        out = type(module).forward(module, **named)
        if labels is None:
            return out
        if spec.shift:
            labels = _shifted(labels, spec.ignore_index)
        valid = labels != spec.ignore_index
        if cp_sharded:  # the valid tokens of every rank's chunk (no gradient)
            count = C.raw_all_reduce(valid.sum(), g)
        else:  # every rank holds the whole batch: no collective
            count, labels = valid.sum(), labels.index_select(1, positions)
        return out, C.reduce_from(_loss_sum(spec, out, labels, axes, self.vocab_axis) / count, g)


def _loss_sum(spec: ContextInputs, out, labels: Tensor, axes: Mapping[str, AxisGroup] | None = None,
              vocab_axis: str | None = None) -> Tensor:
    """``spec.loss``, else the summed cross-entropy of ``out`` as logits (``context.summed_cross_entropy``)."""
    if spec.loss is not None:
        return spec.loss(out, labels)
    if not isinstance(out, Tensor):
        raise PlanError(f"ContextInputs: the model returns {type(out).__name__}, not logits; give loss=(output, "
                        "labels) -> the sum of the chunk's per-position losses")
    return summed_cross_entropy(out, labels, axes or {}, vocab_axis, spec.ignore_index)
