"""Functional FSDP (ZeRO-3) as a transform over ``shard()``'s result (docs/training.md#functional-fsdp).

``fsdp(apply_fn, params, shard_info, mesh, dp_axis="dp")`` returns a new ``(apply_fn, params,
shard_info)``: every leaf chunked further along dim 0 of its TP shard over ``dp_axis``
(``RowSplit`` in ``shard_info``).  Each group of leaves (a decoder layer, or the modules between
them, ``layout.groups``) is one bucket: one all-gather forward (``gather_params``), one
reduce-scatter of its gradients backward.  ``reshard_after_forward`` frees gathered blocks and
gathers again for the backward (a saved-tensor hook under ``.backward()``, a recompute under
``torch.func``); ``dp_axis=("dp", "cp")`` folds the cp sum into the reduce-scatter;
``apply_fn.fsdp.no_sync()`` defers reductions; ``param_dtype``/``reduce_dtype`` are FSDP2's
mixed precision.  The why of each choice is in the docs page, not repeated here.
"""

from __future__ import annotations

__all__ = ["fsdp", "split_info"]

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..compile.agree import agree
from ..core.collectives import AxisGroup, CopyTo
from ..core.errors import PlanError
from ..core.facets import ReducedOver, RowSplit
from ..core.placement import ShardInfo, fmt_placements, splits
from ..core.program import Program
from ..runtime.apply_fn import ApplyFn, ThreadGuard
from ..runtime.remat import Remat, RematForward, check_recorded_outputs, resolve_remat
from .fsdp_bucket import Bucket, Piece, Sync
from .fsdp_forwards import GatherOnUse, ReshardedBlock

# ---------------------------------------------------------------- grouping


@dataclass(frozen=True)
class Group:
    """One bucket's leaves: ``block`` (a module path) for a block, else None; ``modules``: the
    modules owning its parameters, on which its forwards are installed."""

    name: str
    keys: tuple[str, ...]
    block: str | None
    modules: tuple[str, ...]


def _owner(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def _inside(path: str, block: str) -> bool:
    return block == "" or path == block or path.startswith(block + ".")


def group_parameters(template: nn.Module, leaf_of: Mapping[str, str], keys: Sequence[str],
                     blocks: tuple[str, ...]) -> list[Group]:
    """The buckets: one per block (leaves whose every alias is inside it), then one per run of
    modules between blocks for the rest (runs tied by a shared leaf merge), in module order."""
    fqns: dict[str, list[str]] = {}
    for fqn, key in leaf_of.items():
        fqns.setdefault(key, []).append(fqn)
    run_of: dict[str, int] = {}  # module path outside every block -> its run
    run, order = 0, {}
    for i, (path, _) in enumerate(template.named_modules()):
        order[path] = i
        if path in blocks:
            run += 1
        elif not any(_inside(path, b) for b in blocks):
            run_of[path] = run
    in_block: dict[str, list[str]] = {b: [] for b in blocks}
    parent = {r: r for r in set(run_of.values())}

    def find(r: int) -> int:
        while parent[r] != r:
            r = parent[r]
        return r

    rest: dict[str, list[int]] = {}
    for key in keys:
        owners = sorted({_owner(f) for f in fqns[key]}, key=order.__getitem__)
        home = next((b for b in blocks if all(_inside(o, b) for o in owners)), None)
        if home is not None:
            in_block[home].append(key)
            continue
        inside = [o for o in owners if o not in run_of]
        if inside:
            raise PlanError(f"fsdp: parameter {key} is shared by {owners}, across block {inside[0]!r} and modules "
                            "outside it; name blocks that contain every use of it (blocks=...)")
        runs = [find(run_of[o]) for o in owners]
        for r in runs[1:]:
            parent[r] = runs[0]
        rest[key] = runs
    groups = [Group(b, tuple(ks), b, tuple(sorted({_owner(f) for k in ks for f in fqns[k]}, key=order.__getitem__)))
              for b, ks in in_block.items() if ks]
    by_run: dict[int, list[str]] = {}
    for key, runs in rest.items():
        by_run.setdefault(find(runs[0]), []).append(key)
    for ks in by_run.values():
        modules = tuple(sorted({_owner(f) for k in ks for f in fqns[k]}, key=order.__getitem__))
        groups.append(Group("+".join(m or "(root)" for m in modules), tuple(ks), None, modules))
    return sorted(groups, key=lambda g: order[g.modules[0]])


# ---------------------------------------------------------------- layouts


def split_info(info: ShardInfo, mesh: DeviceMesh, axes: tuple[str, ...]) -> ShardInfo:
    """``info`` with dim 0 of its local shard chunked over ``axes`` of ``mesh``, flattened (see
    the module docstring); a sum owed over ``axes`` (``ReducedOver``) is now the reduce-scatter's."""
    names = mesh.mesh_dim_names
    split = RowSplit(axes[0] if len(axes) == 1 else axes, info)
    start, rows = split.span(*split.place(mesh))
    inner = info.axes

    def mine(axis: str):
        i = names.index(axis)
        later = [n for n in names[i + 1:]
                 if isinstance(inner.get(n), Shard) and inner[n].dim % len(info.global_shape) == 0]
        factor = math.prod(mesh.size(names.index(n)) for n in later)
        return _StridedShard(0, split_factor=factor) if later else Shard(0)

    placements = tuple(mine(n) if n in axes else inner.get(n, Replicate()) for n in names)
    reduced = tuple(a for a in info.axes_of(ReducedOver) if a not in axes)
    out = dataclasses.replace(info, placements=placements, mesh=mesh, local_shape=torch.Size((rows, *info.local_shape[1:])),
                              offset=(info.offset[0] + start, *info.offset[1:]), blocks=None)
    return out.with_facet(RowSplit, split).with_facet(ReducedOver, ReducedOver(reduced) if reduced else None)


@dataclass(frozen=True)
class FsdpLayout:
    """What ``fsdp`` decided, kept on its ``apply_fn`` as ``.fsdp`` (read-only): the axis, the
    groups in order, and whether blocks reshard after their forward."""

    axis: str | tuple[str, ...]
    groups: tuple[Group, ...]
    buckets: tuple[Bucket, ...]
    reshard_after_forward: bool
    sync: Sync = dataclasses.field(default_factory=Sync, compare=False)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation without a reduce-scatter per micro-batch, as FSDP2's
        ``set_requires_gradient_sync(False)``: backward passes run inside keep each bucket's full
        (TP-local) gradient, summed, and give the local leaves none; the first backward outside
        reduce-scatters the sum once.  Costs one unsharded gradient per group while accumulating.
        For ``.backward()`` in eager mode (the kept gradients outlive the call, which neither a
        ``torch.func`` transform nor a compiled graph allows: there, reduce each micro-batch)::

            with f_apply.fsdp.no_sync():
                for mb in micro_batches[:-1]:
                    (f_apply(f_params, **mb).loss / n).backward()
            (f_apply(f_params, **micro_batches[-1]).loss / n).backward()   # one reduce-scatter per group
        """
        before, self.sync.deferred = self.sync.deferred, True
        try:
            yield
        finally:
            self.sync.deferred = before

    def collectives_per_step(self) -> dict[str, int]:
        """All-gathers and reduce-scatters on ``axis`` of one forward + backward (the closed form)."""
        blocks = sum(g.block is not None for g in self.groups)
        resharded = blocks if self.reshard_after_forward else 0
        return {"all_gather": len(self.groups) + resharded, "reduce_scatter": len(self.groups)}


# ---------------------------------------------------------------- the transform


def fsdp(apply_fn: ApplyFn, params: Mapping[str, Tensor], shard_info: Mapping[str, ShardInfo], mesh: DeviceMesh,
         dp_axis: str | Sequence[str] = "dp", *, reshard_after_forward: bool = True, param_dtype: torch.dtype | None = None,
         reduce_dtype: torch.dtype | None = None, blocks: Sequence[str] | None = None,
         ) -> tuple[ApplyFn, dict[str, Tensor], dict[str, ShardInfo]]:
    """Shard ``shard()``'s result further over ``dp_axis`` of ``mesh`` (ZeRO-3); mutates nothing.

    Gradients w.r.t. the new params are the mean over ``dp_axis`` (each ``dp_axis`` rank feeds its own
    slice of the batch): one reduce-scatter per group of leaves (a block, or a run of modules between
    blocks).  Bad input raises ``PlanError`` on every rank before any collective.

    Args:
        apply_fn, params, shard_info: the three values of one ``shard()`` call (not already fsdp'd).
        mesh: a mesh with ``dp_axis`` that contains ``shard()``'s mesh (same axis sizes).
        dp_axis: the mesh axis to shard over (the leaves must not be sharded on it already), or several,
            flattened into one group (``("dp", "cp")``: torchtitan's ``dp_shard_cp``): the sum ``apply_fn``'s
            backward owes a parameter over one of them (``ReducedOver``, context parallelism) is folded into
            the reduce-scatter, and the mean is over the others.
        reshard_after_forward: free each block's gathered parameters after its forward and gather them again
            for its backward (False: keep them until the backward).
        param_dtype: the dtype each bucket is cast to before its all-gather, the compute's (FSDP2's mixed
            precision; None: the leaves').  The leaves keep theirs (master weights).
        reduce_dtype: the dtype gradients are reduce-scattered in (None: the leaves'); cast back after.
        blocks: module-path patterns of the blocks, one bucket each (None: the Hugging Face decoder layers;
            none for other models).

    Returns:
        ``(apply_fn, params, shard_info)`` like ``shard()``'s: ``params`` holds this rank's rows of every
        TP-local shard, ``shard_info`` the composed layout (a ``RowSplit`` facet), and ``apply_fn.fsdp`` the
        ``FsdpLayout`` (``no_sync()``, ``collectives_per_step()``).
    """
    axes = _axes(dp_axis, mesh)
    runtime = _check(apply_fn, params, shard_info, mesh, axes, param_dtype, reduce_dtype)
    if reshard_after_forward:  # resharded blocks are recomputed in the backward
        check_recorded_outputs(runtime.template, "fsdp(reshard_after_forward=True)", "pass reshard_after_forward=False")
    program: Program = runtime.program
    keys = tuple(program.infos)
    block_paths = _blocks(runtime.template, blocks)
    groups = group_parameters(runtime.template, program.leaf_of, keys, block_paths)
    _check_nesting(groups, runtime.remat.blocks if runtime.remat else ())
    infos = {k: split_info(program.infos[k], mesh, axes) for k in keys}
    agree(dataclasses.replace(program, mesh=mesh), None, None,
          {"fsdp": repr((axes, reshard_after_forward, str(param_dtype), str(reduce_dtype), [g.keys for g in groups]))})
    gate = next((g.gate for g in program.groups.values() if g.gate is not None), None)  # the program's
    group, sync = AxisGroup.flat(mesh, axes, gate), Sync()  # the input agreement runs before its gathers too
    sizes = {a: mesh.size(mesh.mesh_dim_names.index(a)) for a in axes}
    buckets = tuple(_bucket(g, program, infos, group, sizes, param_dtype, reduce_dtype, sync) for g in groups)
    layout = FsdpLayout(axes[0] if len(axes) == 1 else axes, tuple(groups), buckets, reshard_after_forward, sync)
    preserve_rng = runtime.remat.preserve_rng if runtime.remat else True
    install = _installer(program, groups, buckets, reshard_after_forward, preserve_rng)

    # the inner apply_fn binds the local rows themselves (their own shapes); its forwards gather them, and
    # the parameters' conversions run after each gather (none before)
    inner_program = dataclasses.replace(program, param_steps={}, param_buckets=())
    inner = runtime.build(inner_program, install, axes=(group,),
                          local_shapes={k: torch.Size(infos[k].local_shape) for k in keys})
    new_params = {k: _rows(params[k], infos[k]) for k in keys}
    call = _fsdp_apply(inner, layout, infos)
    out = apply_fn.then("fsdp", call, fsdp=layout, program=inner.program, buffer_slots=inner.buffer_slots,
                        input_check=inner.input_check, remat_blocks=inner.remat_blocks, binder=None)
    return out, new_params, infos


def _installer(program: Program, groups: Sequence[Group], buckets: Sequence[Bucket], reshard_after_forward: bool,
               preserve_rng: bool) -> Callable[[nn.Module, object], None]:
    """``install(skeleton, cache)``: each group's forwards on a skeleton — a block resharded after its
    forward (``ReshardedBlock``), else the modules that gather their bucket on first use (``GatherOnUse``)."""

    def install(skeleton: nn.Module, cache) -> None:
        slots_of = {}
        for fqn, key in program.leaf_of.items():
            owner, _, attr = fqn.rpartition(".")
            slots_of.setdefault(owner, []).append((skeleton.get_submodule(owner)._parameters, attr, key))
        bound = {}  # key -> a slot the call binds its leaf to, and the placeholder it holds between calls
        for owned in slots_of.values():
            for store, attr, key in owned:
                bound.setdefault(key, (store, attr, store[attr]))
        for g, bucket in zip(groups, buckets, strict=True):
            index = {k: j for j, k in enumerate(g.keys)}
            if g.block is not None and reshard_after_forward:
                module = skeleton.get_submodule(g.block)
                slots = tuple((s, a, index[k]) for o in slots_of if _inside(o, g.block) for s, a, k in slots_of[o])
                inner = module.forward
                recompute = isinstance(inner, RematForward) and inner.fqn == g.block
                if recompute:
                    inner = inner.inner  # the block is recomputed already: no second remat around it
                module.forward = ReshardedBlock(g.block, module, inner, slots, bucket, cache,
                                                program.mesh.device_type, preserve_rng, recompute)
                continue
            members = g.modules if g.block is None else (g.block,)
            for m in members:
                module = skeleton.get_submodule(m)
                owners = [m] if g.block is None else [o for o in slots_of if _inside(o, g.block)]
                slots = tuple((s, a, index[k]) for o in owners for s, a, k in slots_of[o] if k in index)
                module.forward = GatherOnUse(module.forward, bucket, slots, tuple(bound[k] for k in g.keys), cache,
                                             shared=len(members) > 1)

    return install


def _check_nesting(groups: Sequence[Group], remat: Sequence[str]) -> None:
    """A group's forwards read this call's leaves, so none may run inside a block that
    ``shard(remat=...)`` recomputes after the call (its own block may be one: it is wrapped)."""
    for g in groups:
        for m in g.modules if g.block is None else (g.block,):
            outer = next((b for b in remat if b != m and _inside(m, b)), None)
            if outer is not None:
                raise PlanError(f"fsdp: group {g.name} runs inside the remat block {outer!r}, which is recomputed "
                                f"after apply_fn returns; make {outer!r} an fsdp block (blocks=[...]) or recompute "
                                "smaller blocks")


def _rows(local: Tensor, info: ShardInfo) -> Tensor:
    split = info.facet(RowSplit)
    start, rows = split.span(*split.place(info.mesh))
    return local.detach().narrow(0, start, rows).clone().requires_grad_(local.requires_grad)


def _bucket(g: Group, program: Program, infos: Mapping[str, ShardInfo], group: AxisGroup, sizes: Mapping[str, int],
            param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None, sync: Sync) -> Bucket:
    """``g``'s bucket.  A piece's ``copy_to`` on an fsdp axis is folded into the reduce-scatter (which
    sums over that axis anyway); its gradient is then averaged over the fsdp axes it was not owed."""
    pieces, start = [], 0
    for k in g.keys:
        shape = torch.Size(program.infos[k].local_shape)
        steps = program.param_steps.get(k, ())
        folded = {s.axis for s in steps if s.collective is CopyTo and s.axis in sizes}
        kept = tuple(s for s in steps if not (s.collective is CopyTo and s.axis in folded))
        divisor = math.prod(n for a, n in sizes.items() if a not in folded)
        piece = Piece(k, shape, infos[k].facet(RowSplit).chunk(group.size), start, kept, divisor)
        pieces.append(piece)
        start += piece.size
    dtypes = {program.dtypes[k] for k in g.keys}
    if len(dtypes) > 1:
        raise PlanError(f"fsdp: group {g.name} mixes parameter dtypes {sorted(map(str, dtypes))}; one bucket has one dtype")
    return Bucket(g.name, pieces, group, param_dtype, reduce_dtype, sync)


def _blocks(template: nn.Module, patterns: Sequence[str] | None) -> tuple[str, ...]:
    """The block paths: ``patterns`` resolved, or the Hugging Face decoder layers (none for other models)."""
    if patterns is not None:
        resolved = resolve_remat(template, Remat(blocks=tuple(patterns)))
        return resolved.blocks if resolved else ()
    try:
        resolved = resolve_remat(template, Remat(blocks=True))
    except PlanError:  # not a Hugging Face model: no blocks, one group per run of modules
        return ()
    return resolved.blocks if resolved else ()


def _axes(axis: str | Sequence[str], mesh: DeviceMesh) -> tuple[str, ...]:
    """``axis`` as a tuple of mesh axes in mesh order (one or several, each once), or a PlanError."""
    names = mesh.mesh_dim_names or ()
    axes = (axis,) if isinstance(axis, str) else tuple(axis) if isinstance(axis, (tuple, list)) else None
    if not axes or len(set(axes)) != len(axes) or not all(isinstance(a, str) for a in axes):
        raise PlanError(f"fsdp: axis must be a mesh axis name or a tuple of distinct ones, got {axis!r}")
    missing = [a for a in axes if a not in names]
    if missing:
        raise PlanError(f"fsdp: mesh axis {missing[0]!r} is not in the mesh (axes: {list(names)})")
    return tuple(n for n in names if n in axes)


def _check(apply_fn, params, shard_info, mesh: DeviceMesh, axes: tuple[str, ...], param_dtype, reduce_dtype):
    """Every local check of ``fsdp``'s input (before any collective); returns ``apply_fn.runtime``."""
    if not isinstance(apply_fn, ApplyFn) or apply_fn.runtime is None:
        raise PlanError("fsdp: apply_fn is not one that hpf.shard() returned (it has no .runtime)")
    if apply_fn.fsdp is not None:
        raise PlanError(f"fsdp: apply_fn is already sharded by hpf.fsdp on axis {apply_fn.fsdp.axis!r}; "
                        "apply fsdp once, to the apply_fn that hpf.shard() returned")
    runtime = apply_fn.runtime
    names = mesh.mesh_dim_names or ()
    infos = runtime.program.infos
    if not isinstance(params, Mapping) or params.keys() != infos.keys() or set(shard_info) != set(infos):
        theirs = set(params) if isinstance(params, Mapping) else set()
        raise PlanError(f"fsdp: params/shard_info are not this apply_fn's (missing {sorted(set(infos) - theirs)[:3]}, "
                        f"extra {sorted(theirs - set(infos))[:3]}): pass the three values of one hpf.shard() call")
    for dtype, what in ((param_dtype, "param_dtype"), (reduce_dtype, "reduce_dtype")):
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise PlanError(f"fsdp: {what} must be a floating torch.dtype, got {dtype!r}")
    sizes = dict(zip(names, mesh.shape, strict=True))
    for k, info in infos.items():
        if shard_info[k] != info or tuple(params[k].shape) != tuple(info.local_shape):
            raise PlanError(f"fsdp: params[{k!r}] / shard_info[{k!r}] do not come from this apply_fn's hpf.shard() call "
                            f"(expected local shape {tuple(info.local_shape)}, {fmt_placements(info.placements)})")
        theirs = dict(zip(info.mesh.mesh_dim_names, info.mesh.shape, strict=True))
        if any(sizes.get(a) != n for a, n in theirs.items()):
            raise PlanError(f"fsdp: the mesh {sizes} does not contain shard()'s mesh {theirs} (parameter {k})")
        axis = next((a for a in axes if splits(info.axes.get(a))), None)
        if axis is not None:
            raise PlanError(f"fsdp: parameter {k} is already sharded on mesh axis {axis!r} "
                            f"({fmt_placements(info.placements)}); choose another axis for fsdp")
        if len(info.local_shape) == 0:
            raise PlanError(f"fsdp: parameter {k} is a scalar; fsdp shards dim 0 of every parameter")
    if mesh.get_coordinate() is None:
        raise PlanError("fsdp: this rank is not in the mesh")
    return runtime


def _fsdp_apply(inner: Callable, layout: FsdpLayout, infos: Mapping[str, ShardInfo]) -> Callable:
    keys = tuple(infos)
    shapes = tuple(torch.Size(infos[k].local_shape) for k in keys)
    guard = ThreadGuard(max((i.mesh.size() for i in infos.values()), default=1), "fsdp apply_fn")

    def apply_fn(params: Mapping[str, Tensor], *args, **kwargs):
        guard.check()
        if not isinstance(params, Mapping) or params.keys() != infos.keys():
            theirs = set(params) if isinstance(params, Mapping) else set()
            raise PlanError(f"fsdp apply_fn: params keys differ from hpf.fsdp()'s: missing {sorted(set(keys) - theirs)[:5]}, "
                            f"extra {sorted(theirs - set(keys))[:5]}")
        for k, s in zip(keys, shapes, strict=True):
            if params[k].shape != s:
                raise PlanError(f"fsdp apply_fn: params[{k!r}] has shape {tuple(params[k].shape)}, expected local "
                                f"{tuple(s)}: pass the params that hpf.fsdp() returned")
        if layout.sync.deferred and (torch._C._functorch.maybe_current_level() is not None
                                     or torch.compiler.is_compiling()):
            raise PlanError("fsdp apply_fn: no_sync() keeps gradients across backward passes, which works with "
                            ".backward() in eager mode only; under torch.func or torch.compile reduce every micro-batch")
        return inner(params, *args, **kwargs)  # binds the leaves where the gathering forwards read them

    return apply_fn
