"""The vocab-parallel styles, written on the public ``Local`` mechanism (``parallel.local``):

* ``VocabEmbedding`` — an ``nn.Embedding`` with its table Shard(0): each rank looks up the ids in
  its range (the others shifted into range and zeroed) and the partial rows leave as Partial;
* ``LossParallelForward`` — the root of a ``loss_parallel`` plan: the model's own forward
  without ``labels``, then HF's causal-LM loss on the vocab-sharded logits
  (``vocab_parallel_cross_entropy``), so the full logits never exist.

See docs/whole-transformers.md ("Vocab-parallel embedding", "Loss parallel").
"""

from __future__ import annotations

__all__ = ["VocabEmbedding", "loss_parallel_root", "vocab_parallel_cross_entropy"]

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from ...core import collectives as C
from ...core.collectives import AxisGroup
from ...core.errors import PlanError
from ...core.style import ModuleSpec, Style, _require
from ..local import Local


def _localise_table(module: nn.Embedding, axes: Mapping[str, AxisGroup], *, axis: str) -> None:
    """The skeleton's copy sees its local table (subclasses such as scaled embeddings keep working)."""
    g = axes[axis]
    rows = module.num_embeddings // g.size
    start, pad = g.rank * rows, module.padding_idx
    module.num_embeddings = rows
    module.padding_idx = pad - start if pad is not None and start <= pad < start + rows else None


def vocab_parallel_lookup(module: nn.Embedding, axes: Mapping[str, AxisGroup], ids: Tensor, *, axis: str,
                          forward: Callable | None = None) -> Tensor:
    """This rank's partial rows: the ids in its range through ``forward`` (the module's forward as the
    skeleton holds it — ghost norms' tapped one; None: its class's), the rest zeroed."""
    rows = module.num_embeddings  # already local (``_localise_table``)
    shifted = ids - axes[axis].rank * rows
    keep = (shifted >= 0) & (shifted < rows)
    out = (forward or partial(type(module).forward, module))(torch.where(keep, shifted, 0))
    return out * keep.unsqueeze(-1).to(out.dtype)


@dataclass(frozen=True)
class VocabEmbedding(Style):
    """Vocab-parallel ``nn.Embedding``: the table is Shard(0); each rank looks up the ids in its
    range (others shifted into range and zeroed), and the partial rows are all-reduced, or
    reduce-scattered onto the sequence dim with ``output_layout=Shard(1)``.  A ``Local`` entry."""

    output_layout: Placement = Replicate()
    axis: str | None = None

    def local(self, axis: str, forward: Callable | None = None) -> Local:
        """The ``Local`` this style is (``forward``: the one its lookup runs, ``vocab_parallel_lookup``)."""
        return Local(partial(vocab_parallel_lookup, axis=axis, forward=forward), params={"weight": Shard(0)},
                     out_src={"output": Partial()}, out_dst={"output": self.output_layout},
                     setup=partial(_localise_table, axis=axis))

    def spec(self, module: nn.Module, fqn: str, axis: str) -> ModuleSpec:
        _require(module, (nn.Embedding,), self, fqn)
        if module.max_norm is not None:
            raise PlanError(f"{fqn}: VocabEmbedding does not support max_norm (it renormalises rows in place)")
        return self.local(axis).spec(module, fqn, axis)

    def local_forward(self, module, forward, *, fqn, axis, axes):
        return self.local(axis, forward).local_forward(module, forward, fqn=fqn, axis=axis, axes=axes)


@dataclass(frozen=True)
class LossParallelForward:
    """The ``Local`` fn of a ``loss_parallel`` plan's root: the model's forward without
    ``labels``, then ``out["loss"]`` from the vocab-sharded logits (this rank's slice starts at
    ``rank * local vocab``: a Colwise head divides the vocabulary evenly)."""

    axis: str

    def __call__(self, module: nn.Module, axes: Mapping[str, AxisGroup], *args, labels: Tensor | None = None, **kwargs):
        out = type(module).forward(module, *args, **kwargs)
        if labels is not None:
            g = axes[self.axis]
            out["loss"] = causal_lm_loss(out.logits, labels, g, g.rank * out.logits.shape[-1])
        return out


def loss_parallel_root(axis: str) -> Local:
    """The root entry a ``loss_parallel`` plan adds (``ShardingPlan.resolve``)."""
    return Local(LossParallelForward(axis), varying=False, axis=axis)


def vocab_parallel_cross_entropy(
    local_logits: Tensor,
    labels: Tensor,
    mesh: DeviceMesh | C.AxisGroup,
    tp_axis: str = "tp",
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    vocab_start: int | None = None,
) -> Tensor:
    """``F.cross_entropy(full_logits, labels)`` where each rank holds ``local_logits[..., V_r]``,
    its contiguous slice of the vocabulary (slices may differ in size); the full logits never exist.

    Args:
        local_logits: this rank's vocabulary slice of the logits, ``[..., V_r]`` (computed in fp32 at least).
        labels: global token ids, shaped ``local_logits.shape[:-1]``.
        mesh: the mesh, or the ``AxisGroup`` of the vocabulary axis itself.
        tp_axis: the mesh axis the vocabulary is sharded over (unused when ``mesh`` is an ``AxisGroup``).
        ignore_index: labels equal to it contribute zero loss and are left out of the mean.
        reduction: ``"mean"`` (over the labels not ignored), ``"sum"`` or ``"none"`` (per position).
        label_smoothing: as ``F.cross_entropy``'s (mixes in the mean over the whole vocabulary).
        vocab_start: the global id of this rank's first column; None: found with one tiny all-gather.
    Returns:
        the loss, replicated over ``tp_axis``: a scalar, or shaped like ``labels`` under ``reduction="none"``."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    g = mesh if isinstance(mesh, C.AxisGroup) else C.AxisGroup.from_mesh(mesh, tp_axis)
    v_local = local_logits.shape[-1]
    vocab_start, vocab_size = _vocab_range(v_local, vocab_start, g, local_logits.device)
    logits = local_logits if local_logits.dtype == torch.float64 else local_logits.float()  # fp32 at least

    # Only public collectives, so this works under .backward(), torch.func.grad and vmap.
    lse = _log_sum_exp(logits, g)
    target, owners = _target_logit(logits, labels - vocab_start, g)
    loss = lse - target
    # a label no rank owns (outside [0, V), not ignore_index) makes its loss NaN: F.cross_entropy raises there, and
    # a check that raised would need a host sync (no vmap, no torch.compile graph); a NaN cannot go unnoticed
    loss = torch.where((owners != 1) & (labels != ignore_index), torch.nan, loss)
    if label_smoothing:
        if vocab_size is None:
            vocab_size = int(C.raw_all_reduce(torch.tensor([v_local], device=logits.device), g).item())
        mean_logit = C.reduce_from(logits.sum(-1), g) / vocab_size
        loss = (1 - label_smoothing) * loss + label_smoothing * (lse - mean_logit)

    valid = labels != ignore_index
    loss = loss * valid.to(loss.dtype)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum()


def _vocab_range(v_local: int, vocab_start: int | None, g: C.AxisGroup, device: torch.device) -> tuple[int, int | None]:
    """(this rank's first global id, the whole vocabulary's size): both from one tiny all-gather of the
    slices' sizes when ``vocab_start`` is None; else ``vocab_start`` as given and None (not needed yet)."""
    if vocab_start is not None:
        return vocab_start, None
    sizes = C.raw_all_gather(torch.tensor([v_local], device=device), 0, g).tolist()
    return sum(sizes[: g.rank]), sum(sizes)


def _log_sum_exp(logits: Tensor, g: C.AxisGroup) -> Tensor:
    """The log-sum-exp over the whole vocabulary, replicated.  The row max is agreed across ranks by a detached
    all-gather (any common shift is exact); the sum of exponentials is summed with ``reduce_from``: the result
    is replicated, so each rank's partial term receives the full gradient."""
    local_max = logits.detach().amax(-1, keepdim=True)
    shift = C.all_gather(local_max, -1, g).amax(-1)  # detached: the same constant on every rank
    sum_exp = C.reduce_from(torch.exp(logits - shift.unsqueeze(-1)).sum(-1), g)
    return torch.log(sum_exp) + shift


def _target_logit(logits: Tensor, local_label: Tensor, g: C.AxisGroup) -> tuple[Tensor, Tensor]:
    """(the label's logit, how many ranks own the label), both replicated: the rank that owns a label (its
    ``local_label`` in ``[0, V_r)``) fetches the logit, the others give zero, and one ``reduce_from`` sums both."""
    owned = (local_label >= 0) & (local_label < logits.shape[-1])
    picked = logits.gather(-1, torch.where(owned, local_label, 0).unsqueeze(-1)).squeeze(-1)
    ones = owned.to(picked.dtype)
    target, owners = C.reduce_from(torch.stack([picked * ones, ones]), g).unbind(0)  # one collective for both
    return target, owners


def causal_lm_loss(local_logits: Tensor, labels: Tensor, group: C.AxisGroup, vocab_start: int) -> Tensor:
    """HF's causal-LM loss (labels shifted left, -100 ignored, mean) on vocab-sharded logits."""
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    return vocab_parallel_cross_entropy(local_logits, shifted, group, vocab_start=vocab_start)


