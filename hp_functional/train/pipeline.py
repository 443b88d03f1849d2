"""Pipeline stages: a model split into stages (``pipeline_split``), each sharded by ``shard()`` on its own
ranks (``shard_stage``), run by torch's ``torch.distributed.pipelining`` schedules (``stage_module``), tied
parameters' gradients added across stages (``sum_tied``).  See docs/pipeline.md.
"""

from __future__ import annotations

__all__ = [
    "Stage", "pipeline_split", "shard_stage", "stage_mesh", "stage_module", "stage_plan", "stage_view", "sum_tied"
]

import copy
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ..core.collectives import AxisGroup
from ..core.errors import PlanError
from ..core.paths import path_matches
from ..core.placement import ShardInfo
from ..core.raw_collectives import mesh_device, raw_exchange
from ..plan.plan import ShardingPlan
from ..runtime.shard import shard
from .module import FunctionalModule
from .pipeline_trace import RootTrace, trace_root


@dataclass(frozen=True)
class Stage:
    """One pipeline stage of a split (``pipeline_split``): rank-independent, the same on every rank.

    ``layers``: global indices of the decoder layers it runs, under ``layers_path``; ``before`` /
    ``after``: the modules run before the layers (first stage) and after them (last stage);
    ``held``: modules it holds but never runs (the tied embedding on the last stage); ``tied``:
    the parameter FQNs another stage holds too, whose gradients ``sum_tied`` adds."""

    index: int
    num_stages: int
    layers_path: str
    layers: tuple[int, ...]
    before: tuple[str, ...]
    after: tuple[str, ...]
    held: tuple[str, ...] = ()
    tied: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()  # the split's modules this stage neither runs nor holds: identities in its view
    root_ops: tuple[str, ...] = ()  # the root forward's own operations this stage runs (``pipeline_trace``)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


def _pp_plan(model: nn.Module) -> list[str]:
    """The model's split points as module paths in module order: HF merges the base model's
    ``base_model_pp_plan`` (under its prefix) and the head's into the instance's ``_pp_plan``."""
    plan = dict(getattr(model, "_pp_plan", None) or {})
    if not plan:
        base = dict(getattr(getattr(model, "config", None), "base_model_pp_plan", None) or {})
        prefix = getattr(model, "base_model_prefix", "")
        plan = {(f"{prefix}.{p}" if prefix and hasattr(model, prefix) else p): v for p, v in base.items()}
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(plan, key=lambda p: order.get(p, len(order)))


def pipeline_split(model: nn.Module, num_stages: int, *, layers: Sequence[int] | None = None,
                   plan: Sequence[str] | None = None, embedding_group: bool = False) -> list[Stage]:
    """``num_stages`` stage descriptions of ``model``, cut where it declares it may be (the config's
    ``base_model_pp_plan`` and the head's ``_pp_plan``): the first stage runs the embedding and its
    layers, the middle ones layers only, the last its layers, the norm and the head.  The root
    forward's own operations are traced (``pipeline_trace``) to check that such a split is exact.
    Raises ``PlanError`` for more stages than layers, a bad ``layers`` list, an operation a stage
    boundary would get wrong, or tied parameters across stages without ``embedding_group``.

    Args:
        model: the model to split (only read).
        num_stages: how many stages, from 1 to the number of decoder layers.
        layers: decoder layers per stage (None: as even as possible, the earlier stages one more).
        plan: the split points as module paths in order, exactly one of them the decoder ``ModuleList``
            (None: the Hugging Face model's ``pp_plan``).
        embedding_group: allow a split that puts tied parameters on different stages (both hold them;
            ``sum_tied`` adds their gradients).

    Returns:
        A list of ``num_stages`` ``Stage`` s, rank-independent: the same on every rank.

    >>> stages = hpf.pipeline_split(model, 2)        # Llama: [embed, layers 0-1] / [layers 2-3, norm, lm_head]
    """
    points = list(plan) if plan is not None else _pp_plan(model)
    if not points:
        raise PlanError(f"pipeline_split: {type(model).__name__} declares no pp_plan (config.base_model_pp_plan); "
                        "pass plan=[module paths in order]")
    modules = dict(model.named_modules())
    missing = [p for p in points if p not in modules]
    if missing:
        raise PlanError(f"pipeline_split: split point {missing[0]!r} is not a module of {type(model).__name__}")
    lists = [p for p in points if isinstance(modules[p], nn.ModuleList)]
    if len(lists) != 1:
        raise PlanError(f"pipeline_split: exactly one split point must be the decoder ModuleList, got {lists}")
    path = lists[0]
    total = len(modules[path])
    if not (isinstance(num_stages, int) and 1 <= num_stages <= total):
        raise PlanError(f"pipeline_split: num_stages={num_stages!r} must be between 1 and the {total} layers of {path!r}")
    counts = list(layers) if layers is not None else [total // num_stages + (i < total % num_stages)
                                                       for i in range(num_stages)]
    if len(counts) != num_stages or sum(counts) != total or min(counts) < 1:
        raise PlanError(f"pipeline_split: layers={counts} must give each of the {num_stages} stages at least one of "
                        f"the {total} layers of {path!r}")
    at = points.index(path)
    ops = trace_root(model, points, path) if num_stages > 1 else RootTrace(tuple(points[:at]), tuple(points[at + 1:]), (), ())
    before, after = ops.before, ops.after
    starts = [sum(counts[:i]) for i in range(num_stages)]
    ops.check_offsets(type(model).__name__, starts, counts)
    stages = [Stage(i, num_stages, path, tuple(range(s, s + c)), before if i == 0 else (),
                    after if i == num_stages - 1 else (),
                    root_ops=(ops.first if i == 0 else ()) + (ops.last if i == num_stages - 1 else ()))
              for i, (s, c) in enumerate(zip(starts, counts, strict=True))]
    return _tie(model, stages, embedding_group)


def _runs(stage: Stage) -> list[str]:
    return [*stage.before, *(f"{stage.layers_path}.{i}" for i in stage.layers), *stage.after]


def _tie(model: nn.Module, stages: list[Stage], embedding_group: bool) -> list[Stage]:
    """The stages with ``held``/``tied``/``dropped`` set: a parameter used by modules of two
    stages is held by both under its first FQN (the model's leaf key)."""
    first_fqn: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first_fqn.setdefault(id(p), name)
    users: dict[str, set[int]] = {}  # leaf key -> stages whose modules use it
    for s in stages:
        for path in _runs(s):
            for _, p in model.get_submodule(path).named_parameters(remove_duplicate=False):
                users.setdefault(first_fqn[id(p)], set()).add(s.index)
    shared = {k: v for k, v in users.items() if len(v) > 1}
    if shared and not embedding_group:
        k, on = next(iter(shared.items()))
        raise PlanError(f"pipeline_split: parameter {k!r} is tied across stages {sorted(on)}; pass "
                        "embedding_group=True to hold it on each of them and sum its gradients (hpf.sum_tied)")
    splits = [*stages[0].before, *stages[-1].after]
    out = []
    for s in stages:
        tied = tuple(k for k, on in shared.items() if s.index in on)
        held = tuple(dict.fromkeys(k.rpartition(".")[0] for k in tied if not any(
            k.startswith(f"{path}.") for path in _runs(s))))
        bad = [h for h in held if h not in stages[0].before]
        if bad:
            raise PlanError(f"pipeline_split: stage {s.index} would hold {bad[0]!r} (tied) without running it; only "
                            "the input embedding, which later stages skip, can be held so")
        dropped = tuple(p for p in splits if p not in _runs(s) and p not in held)
        out.append(Stage(s.index, s.num_stages, s.layers_path, s.layers, s.before, s.after, held, tied, dropped,
                         s.root_ops))
    return out


class StageExit(Exception):  # control flow, not an error
    """Raised after a non-last stage's last layer: its output is the stage's (``_stage_forward``)."""

    def __init__(self, output: Tensor):
        super().__init__()
        self.output = output


class _Boundary:
    """A stage's first or last layer as the root forward calls it: ``entry`` (the previous
    stage's output) replaces its hidden states; ``stop`` ends the forward with its output."""

    def __init__(self, layer: nn.Module, entry: Tensor | None, stop: bool):
        self.layer, self.entry, self.stop = layer, entry, stop

    def __getattr__(self, name: str):  # the root may read the layer's attributes (attention_type)
        return getattr(self.__dict__["layer"], name)

    def __call__(self, *args, **kwargs):
        if self.entry is not None:
            args, kwargs = ((self.entry, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": self.entry})
        out = self.layer(*args, **kwargs)
        if self.stop:
            raise StageExit(out if isinstance(out, Tensor) else out[0])
        return out


class StageLayers(nn.Module):
    """A stage's decoder layers under their global indices (``model.layers.5``): iterates, slices
    and has a length like the model's ``ModuleList``; an int index is the global one.  During a
    stage's forward (``_stage_forward``) its first layer takes the previous stage's output
    (``enter``) and its last ends the forward (``leave``): a stage boundary lies between two
    layers, so the root's operations before the first layer and after the last run on the first
    and the last stage only."""

    def __init__(self, layers: Mapping[int, nn.Module], enter: bool = False, leave: bool = False):
        super().__init__()
        for i, layer in layers.items():
            self.add_module(str(i), layer)
        self.enter, self.leave = enter, leave
        self.running, self.entry = False, None

    def _calls(self) -> list:
        calls: list = list(self._modules.values())
        if self.running:
            if self.enter:
                calls[0] = _Boundary(calls[0], self.entry, False)
            if self.leave:
                calls[-1] = _Boundary(calls[-1], None, True)
        return calls

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._calls())

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, idx: int | slice):
        return self._calls()[idx] if isinstance(idx, slice) else self._modules[str(idx)]


def _stage_forward(self: nn.Module, *args, **kwargs):
    """A stage view's forward: the model's own, its ``StageLayers`` running (see there); a
    non-last stage returns its last layer's output (hidden states), not the model's."""
    layers = self.get_submodule(self._hpf_stage_layers)
    if layers.enter and not isinstance(kwargs.get("inputs_embeds"), Tensor):
        raise PlanError("a pipeline stage after the first takes the previous stage's output as inputs_embeds=")
    layers.running, layers.entry = True, kwargs.get("inputs_embeds") if layers.enter else None
    try:
        return type(self).forward(self, *args, **kwargs)
    except StageExit as stop:
        return stop.output
    finally:
        layers.running, layers.entry = False, None


def _replaced(module: nn.Module, replacements: Mapping[str, nn.Module]) -> nn.Module:
    """``module`` with the submodules at ``replacements``' paths swapped, neither mutating it nor
    copying anything but the modules on those paths (shallow copies with their own child dicts)."""
    if "" in replacements:
        return replacements[""]
    out = copy.copy(module)
    out._modules = dict(module._modules)
    for head in dict.fromkeys(p.split(".")[0] for p in replacements):
        below = {p[len(head) + 1:] if p != head else "": r for p, r in replacements.items()
                 if p == head or p.startswith(head + ".")}
        out._modules[head] = _replaced(module._modules[head], below)
    return out


def stage_view(model: nn.Module, stage: Stage) -> nn.Module:
    """The module tree ``stage`` runs, sharing the model's modules along the stage's paths (neither
    mutated nor copied): its decoder list is a ``StageLayers`` of the stage's layers under their
    global indices, and the split modules it does not run are ``nn.Identity``.  ``shard()`` builds
    its skeleton from the view, so only the stage's blocks are copied (as meta placeholders)."""
    layers = model.get_submodule(stage.layers_path)
    swaps: dict[str, nn.Module] = {stage.layers_path: StageLayers(
        {i: layers[i] for i in stage.layers}, enter=not stage.is_first, leave=not stage.is_last)}
    swaps.update({p: nn.Identity() for p in stage.dropped})
    view = _replaced(model, swaps)
    if stage.num_stages > 1:  # an attribute of the view alone; deep copies (the skeleton) rebind it
        view._hpf_stage_layers = stage.layers_path
        view.forward = types.MethodType(_stage_forward, view)
    return view


def stage_plan(plan: ShardingPlan | Mapping, view: nn.Module) -> ShardingPlan:
    """``plan`` without the entries that match no module of the stage's view (other stages' layers,
    or a module it does not run): one plan for the whole model serves every stage."""
    plan = plan if isinstance(plan, ShardingPlan) else ShardingPlan(plan)
    live = [n for n, m in view.named_modules() if not isinstance(m, nn.Identity)]
    return plan.with_entries({p: s for p, s in plan.entries.items() if any(path_matches(p, n) for n in live)})


def shard_stage(model: nn.Module, stage: Stage, plan: ShardingPlan | Mapping, mesh: DeviceMesh, pp_axis: str = "pp",
                **shard_kwargs) -> tuple[Callable, dict[str, Tensor], dict[str, ShardInfo]]:
    """This rank's ``stage`` of ``model``: ``shard()`` of the stage's view (``stage_view``) over the mesh's
    axes other than ``pp_axis``.  Checks (on every rank, before any collective): ``pp_axis`` in the
    mesh, its size the number of stages, this rank's coordinate on it the stage's index, at least one
    other axis.

    Args:
        model: the whole model (neither mutated nor copied; on meta, pass ``weights=``).
        stage: this rank's stage: ``stages[mesh.get_local_rank(pp_axis)]``.
        plan: one plan for the whole model; entries that match no module of the stage are dropped.
        mesh: the mesh with ``pp_axis`` and at least one other axis (size 1 for none).
        pp_axis: the pipeline's mesh axis.
        shard_kwargs: go to ``shard()`` (``weights=``, ``remat=``, ...).

    Returns:
        ``(apply_fn, params, shard_info)`` as ``shard()`` returns them, with the full model's FQNs.
        ``apply_fn`` is the model's forward on the stage: ``input_ids=`` on the first stage,
        ``inputs_embeds=`` (the previous stage's output) on the others; ``stage_module`` adapts it.
    """
    sub = stage_mesh(mesh, stage, pp_axis)
    view = stage_view(model, stage)
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if stage.index and hidden and "example_inputs" not in shard_kwargs:  # what the proof feeds a later stage
        dtype = next(model.parameters()).dtype
        embeds = torch.randn(2, 8, hidden, generator=torch.Generator().manual_seed(0)).to(dtype)
        shard_kwargs = {**shard_kwargs, "example_inputs": {"inputs_embeds": embeds}}
    return shard(view, stage_plan(plan, view), sub, **shard_kwargs)


def stage_mesh(mesh: DeviceMesh, stage: Stage, pp_axis: str = "pp") -> DeviceMesh:
    """The mesh a stage is sharded over: ``mesh`` without ``pp_axis``, after checking that the axis
    exists, has one coordinate per stage, this rank's being ``stage.index``, and is not alone."""
    names = tuple(mesh.mesh_dim_names or ())
    if pp_axis not in names:
        raise PlanError(f"shard_stage: pp_axis {pp_axis!r} is not in the mesh (axes: {list(names)})")
    size, here = mesh.size(names.index(pp_axis)), mesh.get_local_rank(pp_axis)
    if size != stage.num_stages or here != stage.index:
        raise PlanError(f"shard_stage: this rank is stage {here} of {size} on axis {pp_axis!r}, but was given stage "
                        f"{stage.index} of {stage.num_stages}: pass stages[mesh.get_local_rank({pp_axis!r})]")
    rest = tuple(n for n in names if n != pp_axis)
    if not rest:
        raise PlanError(f"shard_stage: the mesh has only {pp_axis!r}; give it a second axis to shard the stage over "
                        f"(size 1 for none: init_device_mesh(..., ({size}, 1), mesh_dim_names=({pp_axis!r}, 'dp')))")
    return mesh[rest if len(rest) > 1 else rest[0]]


class StageModule(FunctionalModule):
    """A stage's ``apply_fn`` as the ``nn.Module`` torch's ``PipelineStage`` wraps:
    ``forward(x)`` is the stage's tensor in, tensor out (token ids on the first stage, hidden
    states between stages, the logits on the last)."""

    def __init__(self, apply_fn: Callable, params: Mapping[str, Tensor], stage: Stage):
        super().__init__(apply_fn, params)
        self._input = "input_ids" if stage.is_first else "inputs_embeds"

    def forward(self, x: Tensor) -> Tensor:
        out = super().forward(**{self._input: x, "use_cache": False})
        return out if isinstance(out, Tensor) else out[0]


def stage_module(apply_fn: Callable, params: Mapping[str, Tensor], stage: Stage) -> StageModule:
    """The stage as an ``nn.Module`` for ``torch.distributed.pipelining`` (``as_module`` plus the
    stage's input name); gradients land on its parameters' ``.grad``, the pytree's storage is shared.

    Args:
        apply_fn, params: the stage's, from ``shard_stage`` (and ``fsdp``).
        stage: the stage they run: its forward takes ``input_ids`` on the first stage, ``inputs_embeds`` after.

    Returns:
        A ``StageModule`` whose ``forward(x)`` is one tensor in (token ids, or the previous stage's hidden
        states), one out (the hidden states, or the logits on the last stage).

    >>> pipe = PipelineStage(hpf.stage_module(apply_fn, params, stage), stage.index, stage.num_stages,
    ...                      device, group=mesh.get_group("pp"))
    >>> ScheduleGPipe(pipe, n_microbatches=4, loss_fn=loss_fn).step(ids)   # first stage; the last: target=ids
    """
    return StageModule(apply_fn, params, stage)


def sum_tied(grads: Mapping[str, Tensor | None], stage: Stage, mesh: DeviceMesh,
             pp_axis: str = "pp") -> dict[str, Tensor | None]:
    """``grads`` with those of ``stage.tied`` (parameters held by several stages: the embedding
    and the tied head) summed over the first and last stage holding them: each sends its flat
    buffer to the other over ``pp_axis`` and adds what it receives (point to point: the middle
    stages issue nothing, and no process group is made), after a tiny exchange agreeing which of
    them have a gradient (a ``None`` on one stage only is a ``PlanError`` on both).  Pure.  Call
    it on every rank of the mesh after each step's backward, before the optimizer; a stage without
    tied parameters communicates nothing.

    Args:
        grads: this stage's gradients, FQN -> tensor or None.
        stage: this rank's stage; its ``tied`` keys are summed.
        mesh: the mesh holding ``pp_axis``.
        pp_axis: the pipeline's mesh axis.

    Returns:
        A new dict: the tied gradients summed (new tensors), the others as given.
    """
    out = dict(grads)
    if not stage.tied:
        return out
    if not (stage.is_first or stage.is_last):
        raise PlanError(f"sum_tied: stage {stage.index} holds tied parameters {list(stage.tied)[:3]}, but only the "
                        "first and the last stage may (their gradients are summed between those two)")
    group = AxisGroup.from_mesh(mesh, pp_axis)
    peer = stage.num_stages - 1 if stage.is_first else 0
    present = [grads.get(k) is not None for k in stage.tied]
    device = next((grads[k].device for k, mine in zip(stage.tied, present, strict=True) if mine), mesh_device(mesh))
    # the two stages first agree on which tied gradients exist, so their buffers cannot differ (a hang)
    theirs = raw_exchange(torch.tensor(present, dtype=torch.bool, device=device), peer, group, "sum_tied").tolist()
    mixed = [k for k, mine, other in zip(stage.tied, present, theirs, strict=True) if mine != other]
    if mixed:
        raise PlanError(f"sum_tied: the gradients of the tied {mixed} are None on some of the 2 stages holding them "
                        "and not on the others; give every such stage a gradient for them, or None on all")
    keys = [k for k, mine in zip(stage.tied, present, strict=True) if mine]
    if not keys:
        return out
    flat = torch.cat([grads[k].reshape(-1) for k in keys])
    flat = flat + raw_exchange(flat, peer, group, "sum_tied")
    for k, piece in zip(keys, flat.split([grads[k].numel() for k in keys]), strict=True):
        out[k] = piece.view(grads[k].shape)
    return out
