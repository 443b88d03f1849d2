"""The style contract: ``Style`` (one module → one ``ModuleSpec``, and, rarely, a local forward),
``ModuleSpec`` (where a module's parameters are stored and used, and each forward argument's and
output's placement on the way in and out, keyed by mesh axis name) and the special parameter
handlers.  ``shard()`` lowers every src → dst difference to collectives once (``core.lowering``);
a style never communicates itself.  Styles are frozen dataclasses: pure descriptions, safe to share
between plans.  Each parallelism's styles implement this contract (``hp_functional.parallel``).

What the compiler, the runtime and their analyses need to know of a style beyond its spec, they ask
the style (never its type, so that a new parallelism's styles are read alike):

* ``axis_role``: the plan role whose axis it acts on unless it names its own ``axis=``;
* ``own_forward``: False where its local forward is a function of its own (``Local`` and the styles
  built on it): the dataflow pass and the shape audit cannot see inside it, the proof says so;
* ``splits_sequence``: True where its axis holds the batch's sequence cut between ranks that share
  their examples (context parallelism, Ulysses): ``hpf.rng`` takes that axis for no data axis;
* ``sequence_split``: on the root entry that cuts the sequence (context parallelism's root), how it
  does (``SequenceSplit``): ``hpf.rng`` lays out random draws by global position through it;
* ``local_buffer_shapes(module, size)``: the shapes at which its local forward reads the module's
  own buffers where they are not the stored ones (``Channels``' BatchNorm: its channels' slice of the
  whole running statistics), for the shape audit.
"""

from __future__ import annotations

__all__ = ["Key", "ModuleSpec", "ParamHandler", "ParamRule", "SequenceSplit", "Style", "_require", "default_handlers"]

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn
from torch.distributed.tensor import Placement, Replicate, Shard

from .collectives import AxisGroup
from .errors import PlanError
from .placement import AxisPlacements

Key = str | int  # a forward argument (name or position) or an output ("output" or tuple index)


class Style:
    """Base class of the named styles. ``axis`` None means the plan's axis for the style's
    ``axis_role``: ``"tp"`` (``tp_axis``) for most, ``"cp"`` (``cp_axis``) for context parallelism."""

    axis: str | None = None
    axis_role = "tp"
    #: whether the local forward is the module's own forward (False: the style computes with a function
    #: of its own, which communicates as its boundaries declare — ``Local`` and the styles built on it)
    own_forward = True
    #: whether its axis holds the batch's sequence cut between ranks that share their examples
    #: (context parallelism's attention entries, Ulysses'), so that axis is no data axis of ``hpf.rng``
    splits_sequence = False
    #: how the root entry that cuts the batch's sequence does it (context parallelism's root), else None
    sequence_split: SequenceSplit | None = None

    def spec(self, module: nn.Module, fqn: str, axis: str) -> ModuleSpec:
        raise NotImplementedError

    def local_buffer_shapes(self, module: nn.Module, size: int) -> dict[str, torch.Size]:
        """The shapes at which the local forward on an axis of ``size`` ranks reads ``module``'s own
        buffers, where they are not the stored ones (the shape audit runs the module so); none here."""
        return {}

    def on_mesh(self, names: tuple[str, ...]) -> Style:
        """This style on a mesh with axes ``names`` (a style naming optional axes drops the missing ones)."""
        return self

    def local_forward(self, module: nn.Module, forward: Callable, *, fqn: str, axis: str,
                      axes: Mapping[str, AxisGroup]) -> Callable:
        """The forward to run on local shards, given the module's own ``forward``, its path, the
        style's axis and every mesh axis's group.  ``module`` is the private skeleton's copy, so a
        style may localise its attributes.  Styles whose compute is not the module's own forward
        build it with the public ``Local`` (``parallel.local``)."""
        return forward


class SequenceSplit(Protocol):
    """How a root entry cuts the batch's sequence over its mesh ``axis`` (context parallelism's root:
    its ``Local`` fn, called as one): ``hpf.rng`` runs it on meta tensors and reads the global
    position of each kept token through it (``runtime.rng_layout``)."""

    axis: str

    def positions(self, rank: int, seq_len: int, size: int) -> Tensor:
        """The global positions that rank ``rank`` of ``size`` holds of a sequence of ``seq_len``, in
        its local order."""
        ...

    def sequence_keys(self) -> tuple[tuple[str, ...], Mapping[str, int]]:
        """(the arguments that only its loss reads, such as the labels; every sequence argument → its
        sequence dim)."""
        ...

    def __call__(self, module: nn.Module, axes: Mapping[str, AxisGroup], *args, cp_sharded: bool = False,
                 **kwargs) -> object:
        """The root's forward on this rank's part of the sequence (``cp_sharded``: the arguments arrive cut)."""
        ...


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


def _require(module: nn.Module, kinds: tuple[type, ...], style: Style, fqn: str) -> None:
    if not isinstance(module, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise PlanError(f"{fqn or '<root module>'}: {type(style).__name__} needs a {names}, got {type(module).__name__}")



@dataclass(frozen=True)
class ParamRule:
    """What a special handler decides for one parameter: its storage placement on the axis of
    ``axis_role`` in the plan (the styles' default role, as a style's) and, for packed layouts, the
    sub-blocks sharded separately."""

    placement: Placement
    blocks: int | tuple[int, ...] | None = None
    axis_role: str = Style.axis_role


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
