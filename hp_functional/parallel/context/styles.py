"""Context parallelism: the sequence sharded over a ``cp`` mesh axis.

Two plan pieces on the plan's ``cp_axis``: ``ContextParallel`` on each attention module (its SDPA
calls attend over the whole sequence: ``parallel.context.ring_attention``) and the root entry
``context_parallel_root``, added by the plan, which keeps each rank's positions, passes the global
``position_ids``, shifts the labels globally and returns the loss over the whole sequence.  The
rest runs unchanged on the local chunk.  See docs/context-parallel.md.
"""

from __future__ import annotations

__all__ = [
    "ContextParallel", "IGNORE", "_shifted", "attention_patterns", "check_context_entries", "check_context_shadowed",
    "context_parallel_root", "summed_cross_entropy"
]

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch.nn.functional as F
from torch import Tensor, nn

from ...core import collectives as C
from ...core.collectives import AxisGroup
from ...core.errors import PlanError
from ...core.paths import layer_patterns
from ...core.signature import named_arguments
from ...core.style import ModuleSpec, Style
from ..local import Local
from ..tensor.vocab import vocab_parallel_cross_entropy
from .cp_layout import check_layout, cp_chunks, cp_positions
from .ring_attention import STRATEGIES, ContextAttention

IGNORE = -100  # HF's ignored label


@dataclass(frozen=True)
class ContextParallel(Style):
    """An attention module whose SDPA calls attend over the sequence sharded on the CP axis.

    ``strategy``: ``"ring"`` (K/V blocks passed around the ring; K/V memory independent of the
    CP degree) or ``"allgather"`` (one all-gather of K/V).  ``layout``: None takes the plan's
    ``cp_layout``.  ``causal``: None follows the call (``is_causal``) or, when the module
    passes its own mask, the module's ``is_causal`` attribute (see ``ContextAttention``).
    The skeleton's copy of the module's ``config`` selects ``_attn_implementation="sdpa"``.

    >>> plan = hpf.ShardingPlan({"model.layers.*.self_attn": hpf.ContextParallel("ring")}, axes={"cp": "cp"})
    """

    strategy: str = "ring"
    layout: str | None = None
    causal: bool | None = None
    axis: str | None = None  # None: the plan's cp_axis
    axis_role = "cp"
    splits_sequence = True  # its axis holds the sequence cut between ranks that share their examples

    def spec(self, module: nn.Module, fqn: str, axis: str) -> ModuleSpec:
        self.check_strategy(fqn)
        if self.layout is not None:
            check_layout(self.layout)
        return ModuleSpec(varying=False, region=False)  # nothing is stored or placed differently on the axis

    def check_strategy(self, fqn: str) -> None:
        """A ``PlanError`` for a strategy this style does not run."""
        if self.strategy not in STRATEGIES:
            raise PlanError(f"{fqn}: ContextParallel strategy must be one of {sorted(STRATEGIES)}, got {self.strategy!r}")

    def attention(self, module: nn.Module, group: AxisGroup, layout: str, *, fqn: str,
                  axis: str) -> Callable[[], ContextAttention]:
        """A factory of the mode that routes ``module``'s SDPA calls, one per forward (a subclass
        swaps the attention: ``Ulysses``); checks that need the skeleton's copy run here."""
        strategy, causal = self.strategy, self.causal
        return lambda: ContextAttention(module, group, strategy, layout, causal, fqn)

    def local_forward(self, module: nn.Module, forward: Callable, *, fqn: str, axis: str,
                      axes: Mapping[str, AxisGroup]) -> Callable:
        config = getattr(module, "config", None)  # the skeleton's copy
        if config is not None and getattr(config, "_attn_implementation", "sdpa") != "sdpa":
            config._attn_implementation = "sdpa"
        make_mode, name = self.attention(module, axes[axis], self.layout or "zigzag", fqn=fqn, axis=axis), type(self).__name__

        def attend_over_sequence(*args, **kwargs):
            mode = make_mode()
            with mode:
                out = forward(*args, **kwargs)
            if not mode.calls:
                raise PlanError(f"{fqn}: {name} found no scaled_dot_product_attention call in its forward "
                                "(its attention would see only the local chunk); plan the module that calls SDPA")
            return out

        attend_over_sequence.__signature__ = inspect.signature(forward)
        return attend_over_sequence


def _shifted(labels: Tensor, ignore: int = IGNORE) -> Tensor:
    """HF's causal-LM shift over the whole sequence: the label of position ``t`` is token ``t + 1``."""
    return F.pad(labels, (0, 1), value=ignore)[..., 1:]


@dataclass(frozen=True)
class ContextParallelForward:
    """The ``Local`` fn of the root of a CP plan (docs/context-parallel.md#what-each-rank-computes).  ``vocab_axis``:
    the TP axis of a ``loss_parallel`` plan (the logits arrive vocab-sharded).  A ``core.style.SequenceSplit``."""

    axis: str
    layout: str
    vocab_axis: str | None = None

    def positions(self, rank: int, seq_len: int, size: int) -> Tensor:
        """The global positions rank ``rank`` holds in the plan's layout, in its local order."""
        return cp_positions(rank, seq_len, size, self.layout)

    def sequence_keys(self) -> tuple[tuple[str, ...], dict[str, int]]:
        """(HF's label arguments, which only the loss reads; HF's sequence arguments → their sequence dim)."""
        return ("labels", "shift_labels"), {"input_ids": 1, "inputs_embeds": 1, "position_ids": 1}

    def __call__(self, module: nn.Module, axes: Mapping[str, AxisGroup], *args, cp_sharded: bool = False, **kwargs):
        g = axes[self.axis]
        named = named_arguments(module, args, kwargs)
        mask = named.pop("attention_mask", None)
        if mask is not None and not bool(mask.all()):
            raise PlanError("context parallelism: a padding attention_mask is not supported (the mask of each rank's "
                            "chunk would have to travel with its K/V); pack the batch without padding, ignore padded "
                            "positions with labels=-100, and pass attention_mask=None")
        x = named.get("input_ids") if named.get("input_ids") is not None else named.get("inputs_embeds")
        if x is None:
            raise PlanError("context parallelism: the root needs input_ids or inputs_embeds [batch, seq, ...]")
        labels, shift = named.pop("labels", None), named.pop("shift_labels", None)
        if cp_sharded and labels is not None:
            raise PlanError("context parallelism with cp_sharded=True: pass shift_labels=hpf.cp_shard(labels shifted "
                            "by one over the whole sequence, ...) instead of labels (the next token of a chunk's last "
                            "position is on another rank)")
        seq = x.shape[1] * (g.size if cp_sharded else 1)
        cp_chunks(seq, g.size, self.layout, axis=self.axis)  # a ShapeError on every rank alike
        positions = cp_positions(g.rank, seq, g.size, self.layout, device=x.device)
        count = None
        if not cp_sharded:
            keep = {k: v.index_select(1, positions) for k in ("input_ids", "inputs_embeds", "position_ids")
                    if isinstance(v := named.get(k), Tensor)}
            named.update(keep)
            if labels is not None or shift is not None:
                shift = _shifted(labels) if shift is None else shift
                count = (shift != IGNORE).sum()  # every rank holds the whole batch: no collective
                shift = shift.index_select(1, positions)
        if named.get("position_ids") is None:
            named["position_ids"] = positions.unsqueeze(0).expand(x.shape[0], -1)
        out = type(module).forward(module, **named)
        if shift is not None:
            if count is None:  # the valid tokens of every rank's chunk (no gradient)
                count = C.raw_all_reduce((shift != IGNORE).sum(), g)
            out["loss"] = self.loss(out.logits, shift, count, axes, g)
        return out

    def loss(self, logits: Tensor, shift: Tensor, count: Tensor, axes: Mapping[str, AxisGroup],
             g: AxisGroup) -> Tensor:
        """The mean over the ``count`` valid tokens of the whole sequence: this rank's sum over that
        count, summed over the axis (``reduce_from``: each rank's share gets the full gradient)."""
        return C.reduce_from(summed_cross_entropy(logits, shift, axes, self.vocab_axis) / count, g)


def summed_cross_entropy(logits: Tensor, labels: Tensor, axes: Mapping[str, AxisGroup], vocab_axis: str | None,
                         ignore: int = IGNORE) -> Tensor:
    """The sum of this chunk's per-position cross-entropies (``ignore`` skipped), vocab-parallel
    over ``vocab_axis`` when the logits arrive vocab-sharded (loss parallel)."""
    if vocab_axis is not None:
        tp = axes[vocab_axis]
        return vocab_parallel_cross_entropy(logits, labels, tp, reduction="sum", vocab_start=tp.rank * logits.shape[-1],
                                            ignore_index=ignore)
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=ignore, reduction="sum")


def context_parallel_root(axis: str, layout: str, vocab_axis: str | None = None) -> Local:
    """The root entry a plan with ``cp_axis`` adds (``ShardingPlan.resolve``)."""
    fn = ContextParallelForward(axis, check_layout(layout), vocab_axis)
    return Local(fn, varying=False, axis=axis, data_axes=(axis,), sequence_split=fn)


def check_context_entries(entries: Mapping[str, Style], cp_axis: str | None, cp_layout: str) -> dict[str, Style]:
    """``entries`` with every ``ContextParallel`` on the plan's ``cp_layout`` (``ShardingPlan``'s
    check): they need ``cp_axis``, ``cp_axis`` needs them, and a layout of their own must agree."""
    context = {p: s for p, s in entries.items() if isinstance(s, ContextParallel)}
    if context and cp_axis is None:
        raise PlanError(f"plan entry {next(iter(context))!r}: ContextParallel needs the plan's cp_axis "
                        "(ShardingPlan(..., axes={'cp': 'cp'}))")
    if cp_axis is not None and not context:
        raise PlanError(f"cp_axis={cp_axis!r}: the plan has no ContextParallel entry (no attention module found to "
                        "attend over the sharded sequence)")
    for pattern, style in context.items():
        if style.layout not in (None, cp_layout):
            raise PlanError(f"plan entry {pattern!r}: ContextParallel layout {style.layout!r} differs from the plan's "
                            f"cp_layout {cp_layout!r} (the root shards the batch in that one)")
    return {p: replace(s, layout=cp_layout) if p in context else s for p, s in entries.items()}


def check_context_shadowed(candidates: Mapping[str, list], chosen: Mapping[str, tuple[str, Style]]) -> None:
    """A ContextParallel entry that loses a module to a more specific entry (``ShardingPlan.resolve``'s
    ``candidates`` and ``chosen``) would leave that module's attention on the local chunk: refused,
    naming both."""
    for path, cands in candidates.items():
        lost = next((c for c in cands if isinstance(c.style, ContextParallel) and c.pattern != chosen[path][0]), None)
        if lost is not None:
            raise PlanError(f"{path}: plan entry {lost.pattern!r} (ContextParallel) loses to the more specific entry "
                            f"{chosen[path][0]!r} ({chosen[path][1]}): a module takes one style, so its attention would "
                            "see only this rank's chunk; put ContextParallel on the module that calls "
                            "scaled_dot_product_attention (a child: torchtitan's 'layers.*.attention.inner_attention')")


def attention_patterns(model: nn.Module) -> list[str]:
    """The HF attention modules of ``model`` (class names ending in ``Attention`` with an
    ``is_causal`` attribute) as plan patterns, layer indices as ``*``."""
    return layer_patterns(name for name, m in model.named_modules()
                          if name and type(m).__name__.endswith("Attention") and hasattr(m, "is_causal"))
