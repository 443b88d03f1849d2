"""Channel-split convolutions: the convolution helpers ``Colwise``/``Rowwise`` use, and ``Channels``,
the style of the per-channel modules between a channel-split ``Colwise`` and ``Rowwise`` convolution
(a grouped or depthwise convolution, BatchNorm, GroupNorm).

A convolution's features are its channels, dim 1 of a batched ``(N, C, ...)`` input: ``Colwise``
splits its output channels (output ``Shard(1)``), ``Rowwise`` its input channels (input
``Shard(1)``, output partial sums), and between them every module must compute each channel (or
each group of channels) from that channel alone.  BatchNorm's running statistics stay whole
buffers on every rank (``hpf.buffers`` says replicated, and that stays true): a rank reads its
channels' slice, and in training mode, where the forward updates them, it all-gathers the
updated slices (one all-gather of ``2C`` values per call, outside the gradient) so that every rank
holds the same whole statistics again.
"""

from __future__ import annotations

__all__ = ["CONVS", "Channels", "batched_conv", "channel_dim"]

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import Placement, Shard

from ...core.collectives import AxisGroup
from ...core.errors import PlanError, ShapeError
from ...core.module_kinds import CONVS
from ...core.style import ModuleSpec, Style

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def channel_dim(layout: Placement) -> Placement:
    """``layout`` on a convolution's activations: ``Shard(-1)`` (the feature dim, as a Linear's
    layouts say it) is the channel dim, ``Shard(1)``; any other placement as it is."""
    return Shard(1) if isinstance(layout, Shard) and layout.dim == -1 else layout


@dataclass(frozen=True)
class BatchedForward:
    """A channel-split module's forward behind two checks that keep a wrong input from reaching
    torch (or, worse, from being split on the wrong dim): the input is batched, ``(N, C, ...)``
    with ``spatial`` dims after the channels (an unbatched ``(C, ...)`` input has its channels on
    dim 0, where no boundary of the plan splits them), and it holds ``channels`` channels (the
    local count, or the whole one where the style takes a replicated input).  ``run``: the
    forward (the module's own, or ``Channels``' BatchNorm)."""

    fqn: str
    run: Callable
    dims: tuple[int, ...] | None  # the input's accepted numbers of dims (None: any from 2 on)
    channels: int
    what: str  # "its local share of the channels" / "every channel": for the message

    @property
    def __signature__(self) -> inspect.Signature:
        """``run``'s: the boundary finds the planned arguments by it."""
        return inspect.signature(self.run)

    def __call__(self, *args, **kwargs):
        x = args[0] if args else kwargs.get("input")
        if isinstance(x, Tensor):
            if x.dim() not in self.dims if self.dims is not None else x.dim() < 2:
                raise ShapeError(
                    f"{self.fqn}: input of shape {tuple(x.shape)} is not batched (N, C, ...): the plan splits its "
                    "channels on dim 1; add the batch dim (x.unsqueeze(0)) or leave this module replicated")
            if x.shape[1] != self.channels:
                raise ShapeError(
                    f"{self.fqn}: input of shape {tuple(x.shape)} has {x.shape[1]} channels on dim 1 where the plan "
                    f"hands it {self.what} ({self.channels}): its producer is planned otherwise (a channel-split "
                    "input comes from a Colwise convolution or a Channels module)")
        return self.run(*args, **kwargs)


def batched_conv(module: nn.Module, forward: Callable, fqn: str, *, split_input: bool) -> BatchedForward:
    """A convolution's local forward: its own, behind ``BatchedForward`` (``module`` is the
    skeleton's copy: ``in_channels`` already local where ``split_input``, under ``Rowwise``)."""
    return BatchedForward(fqn, forward, (len(module.kernel_size) + 2,), module.in_channels,
                          "its local share of the channels" if split_input else "every channel")


@dataclass(frozen=True)
class BatchNormForward:
    """``nn.BatchNorm``'s forward on this rank's channels: its running statistics are the whole
    (replicated) buffers, of which it reads the slice of its channels; in training mode it updates
    that slice and all-gathers the updated slices so that every rank holds the whole statistics
    (no gradient flows through them, as in the module's own forward)."""

    module: nn.Module
    group: AxisGroup

    def __call__(self, x: Tensor) -> Tensor:
        m, g = self.module, self.group
        factor = 0.0 if m.momentum is None else m.momentum
        update = m.training and m.track_running_stats
        if update and m.num_batches_tracked is not None:
            m.num_batches_tracked.add_(1)
            factor = 1.0 / float(m.num_batches_tracked) if m.momentum is None else m.momentum
        use_stats = m.running_mean is not None and (not m.training or m.track_running_stats)
        mean = var = None
        if use_stats:
            local = m.num_features  # divided on the skeleton
            mean = m.running_mean.narrow(0, g.rank * local, local)
            var = m.running_var.narrow(0, g.rank * local, local)
            if update:  # batch_norm updates them in place and saves them for its backward: copies of its own
                mean, var = mean.clone(), var.clone()
        batch_stats = m.training or m.running_mean is None
        out = F.batch_norm(x, mean, var, m.weight, m.bias, batch_stats, factor, m.eps)
        if update and use_stats:  # this rank's slices were updated: every rank takes every rank's
            with torch.no_grad():
                both = torch.stack([mean, var]).detach()
                both = g.all_gather(both, 1) if g.size > 1 else both  # [2, C]: one collective
                m.running_mean.copy_(both[0])
                m.running_var.copy_(both[1])
        return out


@dataclass(frozen=True)
class Channels(Style):
    """A per-channel module between a channel-split ``Colwise`` convolution and a ``Rowwise`` one:
    its input and output stay sharded on the channel dim (``Shard(1)`` of a batched ``(N, C, ...)``
    input) and its per-channel parameters are ``Shard(0)``.  Accepted modules:

    * a grouped convolution (``groups > 1``; depthwise: ``groups == in_channels``): weight and bias
      ``Shard(0)``, each rank holding whole groups; the skeleton's ``groups``, ``in_channels`` and
      ``out_channels`` divided (``groups`` must divide by the axis size);
    * ``nn.BatchNorm1d/2d/3d``: weight and bias ``Shard(0)``; the running statistics stay whole on
      every rank (read by slice; updated in training mode with one all-gather of the updated
      slices, outside the gradient), so ``hpf.buffers`` and checkpoints keep them replicated;
    * ``nn.GroupNorm``: weight and bias ``Shard(0)``; ``num_groups`` and ``num_channels`` divided.

    ``output_layout=Replicate()`` all-gathers the output (a channel-split block that leaves whole).
    A module whose input is not channel-split, a subclass with a forward of its own (SyncBatchNorm)
    and any other module are refused by name.

    Example — a ResNet basic layer::

        {"layer.0.convolution": Colwise(), "layer.0.normalization": Channels(),
         "layer.1.convolution": Rowwise()}
    """

    output_layout: Placement | None = None
    axis: str | None = None

    def spec(self, module: nn.Module, fqn: str, axis: str) -> ModuleSpec:
        where = fqn or "<root module>"
        if isinstance(module, CONVS):
            if module.groups == 1:
                raise PlanError(f"{where}: Channels needs a per-channel module, but {type(module).__name__} has groups=1 "
                                "(every output channel reads every input channel): plan it Colwise() to split its "
                                "output channels or Rowwise() to split its input channels")
            attrs: tuple[str, ...] = ("groups", "in_channels", "out_channels")
        elif isinstance(module, nn.modules.batchnorm._BatchNorm):
            if not isinstance(module, _BATCH_NORMS) or type(module).forward is not nn.modules.batchnorm._BatchNorm.forward:
                raise PlanError(f"{where}: Channels runs nn.BatchNorm's own computation on each rank's channels, but "
                                f"{type(module).__name__} has a forward of its own: plan a plain nn.BatchNorm{{1,2,3}}d "
                                "(SyncBatchNorm: its statistics are this library's to split), or NoParallel()")
            attrs = ("num_features",)
        elif isinstance(module, nn.GroupNorm):
            attrs = ("num_groups", "num_channels")
        else:
            raise PlanError(f"{where}: Channels needs a grouped convolution, an nn.BatchNorm1d/2d/3d or an nn.GroupNorm "
                            f"(per-channel compute), got {type(module).__name__}; a module that mixes channels (a "
                            "LayerNorm over them) cannot sit between a channel-split Colwise and Rowwise: gather "
                            "before it (Colwise(gather_output=True))")
        names = [n for n, p in module.named_parameters(recurse=False) if p is not None]
        bad = [n for n in names if n not in ("weight", "bias")]
        if bad:
            raise PlanError(f"{where}: Channels splits weight and bias by channel; {type(module).__name__} also holds "
                            f"{bad}, whose use on a share of the channels cannot be known: plan it NoParallel()")
        seq = Shard(1)
        return ModuleSpec(
            params={n: {axis: Shard(0)} for n in names},
            in_src={0: {axis: seq}},
            in_dst={0: {axis: seq}},
            out_src={"output": {axis: seq}},
            out_dst={"output": {axis: self.output_layout or seq}},
            divide_attrs=attrs,
        )

    def local_buffer_shapes(self, module: nn.Module, size: int) -> dict[str, torch.Size]:
        """A BatchNorm's running statistics as its local forward reads them: its channels' slice of
        the whole buffers (``BatchNormForward``)."""
        return {n: torch.Size([b.shape[0] // size]) for n, b in module.named_buffers(recurse=False)
                if b.dim() == 1 and b.shape[0] == getattr(module, "num_features", None)}

    def local_forward(self, module: nn.Module, forward: Callable, *, fqn: str, axis: str,
                      axes: Mapping[str, AxisGroup]) -> Callable:
        """The module's forward on its local channels, behind ``BatchedForward``'s checks
        (``module``: the skeleton's copy, its channel counts already divided)."""
        share = "its local share of the channels"
        if isinstance(module, CONVS):
            return batched_conv(module, forward, fqn, split_input=True)
        if isinstance(module, nn.GroupNorm):
            return BatchedForward(fqn, forward, None, module.num_channels, share)
        dims = {nn.BatchNorm1d: (2, 3), nn.BatchNorm2d: (4,), nn.BatchNorm3d: (5,)}
        kind = next(k for k in _BATCH_NORMS if isinstance(module, k))
        return BatchedForward(fqn, BatchNormForward(module, axes[axis]), dims[kind], module.num_features, share)
