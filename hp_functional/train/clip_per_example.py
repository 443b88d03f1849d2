"""Per-example gradient clipping, DP-SGD's core, at any layout: ``shard()`` (TP), ``hpf.fsdp`` over
it (FSDP × TP), and plain data parallel (``dp_axis=``).  See docs/training.md#per-example-clipping-dp-sgd.

Two methods, one result.  ``"ghost"`` (``train.ghost_norms``): one forward per block of examples
serves both passes; its backward to a zero per example gives each example's squared norm from the
layers' inputs and output gradients (a per-example zero added to the leaves without a rule), and the
clipped mean is booked from the same output gradients, without a second backward.  ``"vmap"``: pass 1
takes ``vmap(grad)`` of the loss over chunks of examples and reduces each chunk's per-example
gradients to squared norms at once; pass 2 is one ordinary gradient of ``sum_i c_i loss_i / B``.
Either way the local squared norms are summed with one all-reduce per model axis per block.  Under
FSDP both run on the inner ``shard()`` apply_fn over the bucket-gathered (TP-local) parameters, so no
per-example gradient passes through FSDP's reduce-scatter (which would add example i of one dp rank to
example i of another); the clipped gradient goes back through the same buckets' backward, FSDP's
reduce-scatter (the dp mean).
"""

from __future__ import annotations

__all__ = ["clip_per_example"]

import dataclasses
import math
from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils import _pytree as pytree

from ..core.collectives import AxisGroup
from ..core.errors import PlanError, ShapeError
from ..core.facets import ReducedOver, RowSplit, SummedOver
from ..core.host_comm import gather_flat, mesh_groups
from ..core.placement import ShardInfo, owns, splits
from ..core.raw_collectives import mesh_device, raw_all_reduce
from ..runtime.apply_fn import ApplyFn
from .data_parallel import reduce_gradients
from .fsdp_bucket import Bucket, Sync
from .ghost_norms import GhostRun, ghost_batches

WHERE = "clip_per_example"
METHODS = ("vmap", "ghost")
LossFn = Callable[[Callable, Mapping[str, Tensor], object], Tensor]


def clip_per_example(
    loss_fn: LossFn, apply_fn: ApplyFn, params: Mapping[str, Tensor], shard_info: Mapping[str, ShardInfo],
    batch: object, *, max_norm: float, chunk_size: int | None = None, dp_axis: str | None = None,
    method: str = "auto",
) -> tuple[dict[str, Tensor], Tensor]:
    """The mean over the global batch of each example's gradient clipped to ``max_norm`` (DP-SGD
    without the noise), and this rank's per-example norms; as Opacus' ``DPOptimizer`` with
    ``noise_multiplier=0``: ``c_i = min(1, max_norm / (norm_i + 1e-6))``, ``grads = sum_i c_i g_i / B``.

    ``norm_i`` is the L2 norm of example i's gradient over the whole model: every shard counted,
    each replicated leaf once.  At most ``chunk_size`` per-example gradients (of the TP-local
    model) exist at a time.  A collective: call on every rank.  Bad input, models it cannot
    differentiate per example exactly (BatchNorm in training mode, random ops, buffers updated in
    the forward) and unequal batch sizes raise ``PlanError`` on every rank.

    Args:
        loss_fn: ``loss_fn(apply_fn, params, example) -> scalar``: the loss of ONE example (``batch``'s
            leaves without their leading dim, as ``vmap`` passes them), computed by calling the
            ``apply_fn`` it is given with the ``params`` it is given (under FSDP those are the inner
            ``shard()`` apply_fn and the TP-local parameters, so close over neither).
        apply_fn, params, shard_info: what ``hpf.shard()`` returned, or ``hpf.fsdp()`` over it.
        batch: this rank's examples, a pytree of tensors sharing a leading batch dim: the same on the
            ranks of a model axis (tp), this dp rank's own on the data axes, equal sizes everywhere.
        max_norm: the per-example L2 norm to clip to.
        chunk_size: examples per block (None: the whole batch for ``"ghost"``, 8 for ``"vmap"``).  Ghost:
            activations of ``chunk_size`` examples at a time, both passes per block; vmap: ``chunk_size``
            gradients of the TP-local model at a time in pass 1.  One all-reduce of ``chunk_size`` numbers
            per model axis per block.
        dp_axis: plain data parallel without FSDP: the mesh axis (of ``shard_info``'s mesh) whose ranks
            hold their own examples; the result is averaged over it (``reduce_gradients``).  Under
            ``hpf.fsdp`` the data axis is fsdp's own (leave None, or name it).
        method: how pass 1 finds the norms. ``"ghost"``: one forward of the chunk shared by both passes;
            Linear, Embedding, Conv1d/2d, LayerNorm, RMSNorm and HF's Conv1D get their norms from their
            input and output gradient (``train.ghost_norms``), every other leaf (and one a check finds
            used twice or outside its layer) from a per-example zero added to it; the same result.
            ``"vmap"``: ``vmap(grad)`` of the whole model per chunk, then a second forward and backward.
            ``"auto"`` (default): ghost, or vmap where the apply_fn recomputes blocks (``shard(remat=)``).

    Returns:
        ``(grads, norms)``: ``grads`` keyed and laid out like ``params`` (local shards), the clipped
        mean over the global batch (every data rank's examples); ``norms``, float32 of shape
        ``[len(batch)]``, the unclipped global-model norm of each of this rank's examples.

    >>> def loss_fn(apply_fn, params, ids):
    ...     return apply_fn(params, input_ids=ids[None], labels=ids[None]).loss
    >>> grads, norms = hpf.clip_per_example(loss_fn, apply_fn, params, shard_info, ids, max_norm=1.0)
    """
    plan, error = None, None
    try:  # every local check before the one agreement; a failure is agreed there, not raised alone
        plan = _Plan.of(loss_fn, apply_fn, params, shard_info, batch, max_norm, chunk_size, dp_axis, method)
    except (PlanError, ShapeError) as exc:
        error = exc
    settings = (float(chunk_size or 0), float(max_norm), float(METHODS.index(plan.method))) if plan else (0.0,) * 3
    _agree(plan, error, shard_info, settings)
    if plan.method == "ghost":
        return plan.run_ghost(loss_fn, params, batch, max_norm, chunk_size or plan.size)
    return plan.run(loss_fn, params, batch, max_norm, chunk_size or 8)


# ---------------------------------------------------------------- the checks


@dataclasses.dataclass
class _Plan:
    """What one call decided before any collective: the data axes (ranks with their own examples),
    the model axes the norms are summed over, the pass-1 layout and the batch size."""

    apply_fn: ApplyFn
    infos: Mapping[str, ShardInfo]  # pass 1's leaves: the TP-local layout
    model_mesh: DeviceMesh  # their mesh
    data_axes: tuple[str, ...]
    norm_axes: tuple[str, ...]  # model axes of size > 1: the per-example squared norms are summed over them
    outer_mesh: DeviceMesh  # shard_info's mesh: the agreement's, and plain dp's
    size: int  # local batch size
    dp_axis: str | None
    method: str  # "ghost" or "vmap"

    @classmethod
    def of(cls, loss_fn, apply_fn, params, shard_info, batch, max_norm, chunk_size, dp_axis, method) -> _Plan:
        if not callable(loss_fn):
            raise PlanError(f"{WHERE}: loss_fn must be callable as loss_fn(apply_fn, params, example), got "
                            f"{type(loss_fn).__name__}")
        if not isinstance(apply_fn, ApplyFn) or apply_fn.runtime is None:
            raise PlanError(f"{WHERE}: apply_fn is not one that hpf.shard() or hpf.fsdp() returned")
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0 \
                or not math.isfinite(max_norm):
            raise PlanError(f"{WHERE}: max_norm must be a positive finite number, got {max_norm!r}")
        if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
            raise PlanError(f"{WHERE}: chunk_size must be a positive int or None, got {chunk_size!r}")
        method = _method(method, apply_fn)
        _check_params(params, shard_info)
        size = _batch_size(batch)
        outer = next(iter(shard_info.values())).mesh
        if outer.get_coordinate() is None:
            raise PlanError(f"{WHERE}: this rank is not in the mesh {outer.mesh.tolist()}")
        layout = apply_fn.fsdp
        runtime = apply_fn.runtime
        if layout is not None:
            axes = (layout.axis,) if isinstance(layout.axis, str) else tuple(layout.axis)
            if len(axes) > 1:
                raise PlanError(f"{WHERE}: hpf.fsdp over several axes {axes} folds a sum over a model axis into its "
                                "reduce-scatter; per-example clipping supports fsdp over one data axis")
            if dp_axis is not None and dp_axis != axes[0]:
                raise PlanError(f"{WHERE}: dp_axis={dp_axis!r}, but apply_fn is fsdp over {axes[0]!r}: under hpf.fsdp "
                                "the data axis is fsdp's (leave dp_axis None); fsdp plus another dp axis is not supported")
            if layout.sync.deferred:
                raise PlanError(f"{WHERE}: called inside apply_fn.fsdp.no_sync(); per-example clipping reduces its one "
                                "gradient at once, call it outside no_sync()")
            infos, data = runtime.program.infos, axes
        else:
            bad = next((k for k, i in shard_info.items() if i.facet(RowSplit) is not None), None)
            if bad is not None:
                raise PlanError(f"{WHERE}: shard_info[{bad!r}] is hpf.fsdp's layout but apply_fn is not the one "
                                "hpf.fsdp() returned: pass the three values of one call")
            data = ()
            if dp_axis is not None:
                if dp_axis not in (outer.mesh_dim_names or ()):
                    raise PlanError(f"{WHERE}: dp_axis {dp_axis!r} is not an axis of shard_info's mesh "
                                    f"{list(outer.mesh_dim_names or ())}")
                data = (dp_axis,)
            infos = shard_info
        model_mesh = next(iter(infos.values())).mesh
        names = tuple(model_mesh.mesh_dim_names or ())
        _check_data_axes(runtime.program, infos, data)
        _check_model(runtime.template)
        norm_axes = tuple(n for d, n in enumerate(names) if n not in data and model_mesh.size(d) > 1)
        return cls(apply_fn, infos, model_mesh, data, norm_axes, outer, size, dp_axis, method)

    # ---------------------------------------------------------------- the two passes

    def run(self, loss_fn: LossFn, params: Mapping[str, Tensor], batch, max_norm: float, chunk_size: int):
        fsdp = self.apply_fn.fsdp is not None
        if fsdp:  # the TP-local parameters, gathered by fsdp's buckets without its conversions
            inner = self.apply_fn.runtime.build()
            buckets = [_raw_bucket(b) for b in self.apply_fn.fsdp.buckets]
            rows = {k: v.detach() for k, v in params.items()}
            local, scatter = torch.func.vjp(lambda r: _gather(buckets, r), rows)
            local = {k: v.detach() for k, v in local.items()}
        else:
            inner = self.apply_fn
            local = {k: v.detach() for k, v in params.items()}
        versions = _versions(inner)

        def one(p, example):
            return loss_fn(inner, p, example)

        per_example = torch.func.vmap(torch.func.grad(one), in_dims=(None, 0), randomness="error")
        owned = [k for k in self.infos if self._owned(self.infos[k])]
        device = next(iter(local.values())).device if local else mesh_device(self.model_mesh)
        acc = torch.float64 if device.type == "cpu" else torch.float32
        groups = [AxisGroup.from_mesh(self.model_mesh, a) for a in self.norm_axes]
        norms = []
        for start in range(0, self.size, chunk_size):
            chunk = pytree.tree_map(lambda t, s=start: t[s:s + chunk_size], batch)
            grads = _guarded(lambda c=chunk: per_example(local, c))
            n = min(chunk_size, self.size - start)
            sq = torch.zeros(n, dtype=acc, device=device)
            for k in owned:
                g = grads[k]
                if g.numel():
                    sq = sq + torch.linalg.vector_norm(g.reshape(n, -1), 2, dim=1, dtype=acc).square()
            del grads
            for g in groups:  # one small all-reduce per model axis per chunk, whatever the parameter count
                sq = raw_all_reduce(sq, g)
            norms.append(sq.sqrt())
        norms_t = torch.cat(norms)
        coef = (max_norm / (norms_t + 1e-6)).clamp(max=1.0)  # Opacus 1.6's DPOptimizer.clip_and_accumulate

        def objective(p):
            losses = torch.func.vmap(lambda ex: one(p, ex), randomness="error")(batch)
            return (losses * coef.to(losses.dtype)).sum() / self.size

        grads = _guarded(lambda: torch.func.grad(objective)(local))
        if fsdp:  # FSDP's reduce-scatter (the buckets' backward): the dp mean of sum_i c_i g_i / B_local
            grads = scatter(grads)[0]
        elif self.dp_axis is not None:
            grads = reduce_gradients(grads, self.infos, self.outer_mesh, self.dp_axis, "mean")
        _check_versions(inner, versions)
        return {k: grads[k] for k in params}, norms_t.to(torch.float32)

    def run_ghost(self, loss_fn: LossFn, params: Mapping[str, Tensor], batch, max_norm: float, chunk_size: int):
        """Both passes over one forward per chunk (``train.ghost_norms``); a leaf that a check sends to
        the delta path starts the call again on a new skeleton (at most once per such leaf).  The run
        (its skeleton) is kept on the runtime for the next call with the same leaves
        (``Runtime.ghost_runs``); its checks run on every call."""
        local, scatter = self._local(params)
        owned = frozenset(k for k in self.infos if self._owned(self.infos[k]))
        runs, key = self.apply_fn.runtime.ghost_runs, (owned, tuple(self.infos.items()))
        run = runs.pop(key, None)
        excluded = run.excluded if run is not None else frozenset()
        with torch.enable_grad():
            while True:
                if run is None:
                    run = GhostRun(self.apply_fn.runtime, self.infos, owned, excluded)
                versions = _versions(run.apply_fn)
                try:
                    out = self._ghost_chunks(run, loss_fn, local, batch, max_norm, chunk_size)
                finally:
                    run.release()
                if isinstance(out, frozenset):
                    if out <= excluded:  # a delta leaf is never flagged: a second pass over the same set would loop
                        raise RuntimeError(f"{WHERE}: the ghost checks flagged delta leaves {sorted(out)[:3]}")
                    excluded, run = excluded | out, None
                    continue
                break
        grads, norms = out
        _check_versions(run.apply_fn, versions)
        runs[key] = run
        return self._finish(grads, scatter, params), norms.to(torch.float32)

    def _ghost_chunks(self, run: GhostRun, loss_fn: LossFn, local: dict[str, Tensor], batch, max_norm: float,
                      chunk_size: int) -> tuple[dict[str, Tensor], Tensor] | frozenset[str]:
        """Per chunk: one forward, the squared norms (one backward, reduced over the model axes), the
        clipped gradient; or the ghost leaves a check sends to the delta path (the call starts again)."""
        acc = torch.float64 if next(iter(local.values())).device.type == "cpu" else torch.float32
        groups = [AxisGroup.from_mesh(self.model_mesh, a) for a in self.norm_axes]
        total, norms = None, []
        for chunk, n in ghost_batches(batch, self.size, chunk_size):
            c = _guarded(lambda chunk=chunk, n=n: run.forward(loss_fn, local, chunk, n, acc))
            if run.reread():
                return run.reread()
            sq, outside, per_example = _guarded(lambda c=c, n=n: run.squared_norms(c, n))
            del c
            if outside:
                return outside
            for g in groups:  # one small all-reduce per model axis per chunk, whatever the parameter count
                sq = raw_all_reduce(sq, g)
            norms.append(sq.sqrt())
            coef = (max_norm / (norms[-1] + 1e-6)).clamp(max=1.0)  # Opacus 1.6's DPOptimizer.clip_and_accumulate
            grads = run.clipped(per_example, local, coef / self.size)
            total = grads if total is None else {k: total[k] + grads[k] for k in total}
        return total, torch.cat(norms)

    def _local(self, params: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], Callable | None]:
        """Pass 1's leaves (TP-local, requiring grad) and, under FSDP, the gather's backward (its reduce-scatter)."""
        scatter = None
        if self.apply_fn.fsdp is not None:  # the TP-local parameters, gathered by fsdp's buckets without its conversions
            buckets = [_raw_bucket(b) for b in self.apply_fn.fsdp.buckets]
            rows = {k: v.detach() for k, v in params.items()}
            local, scatter = torch.func.vjp(lambda r: _gather(buckets, r), rows)
        else:
            local = params
        return {k: v.detach().requires_grad_() for k, v in local.items()}, scatter

    def _finish(self, grads: dict[str, Tensor], scatter: Callable | None, params: Mapping[str, Tensor]):
        """The clipped mean of this rank's examples, reduced over the data axes as the layout does."""
        if scatter is not None:  # FSDP's reduce-scatter (the buckets' backward): the dp mean of sum_i c_i g_i / B_local
            grads = scatter(grads)[0]
        elif self.dp_axis is not None:
            grads = reduce_gradients(grads, self.infos, self.outer_mesh, self.dp_axis, "mean")
        return {k: grads[k].detach() for k in params}

    def _owned(self, info: ShardInfo) -> bool:
        """Whether this rank counts the leaf in the per-example norm: on the model axes, every
        shard and the first replica (the data axes hold other examples: no masking there)."""
        coord = self.model_mesh.get_coordinate()
        names = self.model_mesh.mesh_dim_names
        return all(owns(p, c) for n, c, p in zip(names, coord, info.placements, strict=True) if n not in self.data_axes)


def _method(method: object, apply_fn: ApplyFn) -> str:
    """``"ghost"`` or ``"vmap"``: ``"auto"`` is ghost unless blocks are recomputed (a recomputed tap
    would run outside the examples' vmap)."""
    if method not in ("auto", *METHODS):
        raise PlanError(f"{WHERE}: method must be 'auto', 'ghost' or 'vmap', got {method!r}")
    if apply_fn.remat_blocks and method == "ghost":
        raise PlanError(f"{WHERE}: method='ghost' with recomputed blocks ({next(iter(apply_fn.remat_blocks))}): "
                        "use method='vmap' (or 'auto'), or shard() without remat")
    return "vmap" if method == "vmap" or apply_fn.remat_blocks else "ghost"


def _check_params(params, shard_info) -> None:
    if not isinstance(params, Mapping) or not isinstance(shard_info, Mapping) or not shard_info:
        raise PlanError(f"{WHERE}: params and shard_info must be the dicts hpf.shard()/hpf.fsdp() returned")
    missing, extra = [k for k in shard_info if k not in params], [k for k in params if k not in shard_info]
    if missing or extra:
        raise PlanError(f"{WHERE}: params and shard_info have different keys: missing from params {missing[:5]}, "
                        f"not in shard_info {extra[:5]}")
    for k, info in shard_info.items():
        if not isinstance(params[k], Tensor) or tuple(params[k].shape) != tuple(info.local_shape):
            got = tuple(params[k].shape) if isinstance(params[k], Tensor) else type(params[k]).__name__
            raise ShapeError(f"{WHERE}: params[{k!r}] is {got}, but its shard_info expects the local shape "
                             f"{tuple(info.local_shape)}")


def _batch_size(batch) -> int:
    leaves = pytree.tree_leaves(batch)
    if not leaves or not all(isinstance(t, Tensor) and t.dim() >= 1 for t in leaves):
        raise PlanError(f"{WHERE}: batch must be a tensor or a pytree of tensors with a leading batch dim")
    sizes = {t.shape[0] for t in leaves}
    if len(sizes) > 1:
        raise PlanError(f"{WHERE}: batch's tensors have different leading (batch) sizes {sorted(sizes)}")
    size = sizes.pop()
    if size == 0:
        raise PlanError(f"{WHERE}: batch is empty (0 examples); every rank needs the same number of examples")
    return size


def _check_data_axes(program, infos: Mapping[str, ShardInfo], data: tuple[str, ...]) -> None:
    """Refuse a forward or backward that communicates over a data axis: under ``vmap`` it would
    add example i of one rank to example i of another (EP sharing ranks with dp, CP folded in)."""
    if not data:
        return
    for k, info in infos.items():
        for kind in (SummedOver, ReducedOver):
            shared = [a for a in info.axes_of(kind) if a in data]
            if shared:
                raise PlanError(f"{WHERE}: parameter {k}'s gradient is summed over the data axis {shared[0]!r} "
                                f"({kind.__name__}: its ranks feed their own examples through it), which mixes "
                                "examples of different ranks; per-example clipping needs each rank's examples apart")
        bad = next((a for a in data if splits(info.axes.get(a))), None)
        if bad is not None:
            raise PlanError(f"{WHERE}: parameter {k} is sharded on the data axis {bad!r}: a data axis holds "
                            "replicas (plain dp) or is hpf.fsdp's own")
    for b in program.boundaries:
        steps = [s for group in (*b.in_steps.values(), *b.out_steps.values()) for s in group]
        axis = next((a for a in (b.planned.axis, *(s.axis for s in steps)) if a in data), None)
        if axis is not None:
            raise PlanError(f"{WHERE}: module {b.planned.fqn} communicates over the data axis {axis!r}, which would "
                            "mix the examples of different ranks")
    for k, steps in program.param_steps.items():
        axis = next((s.axis for s in steps if s.axis in data), None)
        if axis is not None:
            raise PlanError(f"{WHERE}: parameter {k} is converted over the data axis {axis!r} ({steps[0].collective.name}), "
                            "which would mix the examples of different ranks")


def _check_model(template: nn.Module) -> None:
    """Batch-coupled modules (BatchNorm in training mode normalises over the batch and updates its
    running statistics) have no per-example gradient: refused by name."""
    for path, m in template.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training:
            raise PlanError(f"{WHERE}: module {path} ({type(m).__name__}) is in training mode: it couples the "
                            "examples of a batch, so they have no gradients of their own; use GroupNorm/LayerNorm, "
                            "or eval() it")
        if isinstance(m, nn.modules.instancenorm._InstanceNorm) and m.training and m.track_running_stats:
            raise PlanError(f"{WHERE}: module {path} ({type(m).__name__}) updates running statistics in training "
                            "mode; a buffer updated in the forward has no per-example meaning; eval() it")


def _agree(plan: _Plan | None, error: Exception | None, shard_info, settings: tuple[float, ...]) -> None:
    """One all-gather of [failed, batch size, chunk_size, max_norm] over shard_info's mesh: every
    rank passed its local checks, holds as many examples (tp ranks the same ones, dp ranks their
    own) and passed the same settings (another chunk_size would pair other all-reduces)."""
    mesh = plan.outer_mesh if plan is not None else _mesh_or_none(shard_info)
    if mesh is None or mesh.size() == 1:
        if error is not None:
            raise error
        return
    row = torch.tensor([float(error is not None), float(plan.size if plan else 0), *settings], dtype=torch.float64,
                       device=mesh_device(mesh))
    rows, order = gather_flat(row, mesh), mesh_groups(mesh)[1]
    if error is not None:
        raise error
    failed = [r for r, f in zip(order, rows[:, 0].tolist(), strict=True) if f]
    if failed:
        raise PlanError(f"{WHERE}: the local checks failed on ranks {failed} (see their error); every rank stops here")
    sizes = [int(s) for s in rows[:, 1].tolist()]
    if len(set(sizes)) > 1:
        seen = ", ".join(f"rank {r}: {s}" for r, s in zip(order, sizes, strict=True))
        raise PlanError(f"{WHERE}: ranks hold different numbers of examples ({seen}); the global mean needs equal "
                        "local batch sizes (pad or drop examples; tp ranks pass the same examples)")
    for col, name in ((2, "chunk_size"), (3, "max_norm"), (4, "method (0: vmap, 1: ghost)")):
        values = rows[:, col].tolist()
        if len(set(values)) > 1:
            seen = ", ".join(f"rank {r}: {v:g}" for r, v in zip(order, values, strict=True))
            raise PlanError(f"{WHERE}: ranks passed different {name} ({seen}); pass the same on every rank")


def _mesh_or_none(shard_info) -> DeviceMesh | None:
    try:
        mesh = next(iter(shard_info.values())).mesh
    except (AttributeError, StopIteration, TypeError):
        return None
    return mesh if mesh.get_coordinate() is not None else None


# ---------------------------------------------------------------- FSDP's gather without its conversions


def _raw_bucket(bucket: Bucket) -> Bucket:
    """``bucket`` gathering the leaves as ``shard()`` holds them (``shard()``'s apply_fn runs the
    conversions), with a synchronous ``Sync`` of its own (the user's ``no_sync`` state untouched)."""
    pieces = [dataclasses.replace(p, steps=()) for p in bucket.pieces]
    return Bucket(bucket.name, pieces, bucket.group, bucket.param_dtype, bucket.reduce_dtype, Sync())


def _gather(buckets: list[Bucket], rows: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The TP-local parameters from this rank's rows: one all-gather per bucket (its backward: one
    reduce-scatter, the mean over the data axis)."""
    out = {}
    for b in buckets:
        out.update(zip(b.keys, b.gather([rows[k] for k in b.keys]), strict=True))
    return out


# ---------------------------------------------------------------- refusals found at run time


def _versions(apply_fn: ApplyFn) -> dict[str, tuple[int, int]]:
    return {k: (id(t), t._version) for k, t in apply_fn.buffer_slots.current().items()}


def _check_versions(apply_fn: ApplyFn, before: Mapping[str, tuple[int, int]]) -> None:
    """A buffer the forward updated (in place or reassigned) changed once per vmap call, not per
    example: refused (the same on every rank, after the same collectives)."""
    after = _versions(apply_fn)
    changed = [k for k, v in after.items() if before.get(k) != v]
    in_place = [k for k in changed if before.get(k, (None,))[0] == after[k][0]]
    if in_place:  # the ghost path's forward is not under torch.func.grad, which refuses this one itself
        raise PlanError(f"{WHERE}: the forward updates a buffer in place ({in_place[0]}: a running statistic or a "
                        "counter): under vmap it is updated per chunk of examples, not per example; such models are "
                        "refused")
    if changed:
        raise PlanError(f"{WHERE}: the forward updated the buffer {changed[0]} (a running statistic or a counter): "
                        "under vmap it is updated per chunk of examples, not per example; such models are refused")


def _guarded(fn: Callable):
    """``fn()``, with torch's vmap refusals (random ops, in-place updates of captured tensors, ops
    without a batching rule) turned into a PlanError that says what to change."""
    try:
        return fn()
    except RuntimeError as exc:
        text = str(exc)
        if "mutate a captured Tensor" in text:
            raise PlanError(f"{WHERE}: the forward updates a buffer in place (a running statistic or a counter): under "
                            "vmap it would be updated per chunk of examples, not per example; such models are refused "
                            f"({text.splitlines()[0][:160]})") from exc
        if "randomness" in text or "random operation" in text:
            raise PlanError(f"{WHERE}: the forward draws random numbers (dropout?): pass 1 and pass 2 would draw "
                            "different ones, so the clipped gradient would not be exact; set dropout to 0 or eval() "
                            f"the model ({text.splitlines()[0]})") from exc
        if "vmap" in text or "Batched" in text or "batched" in text:
            raise PlanError(f"{WHERE}: the forward cannot run per example under torch.func.vmap (a batch-coupled op or a "
                            f"buffer updated in place?): {text.splitlines()[0]}") from exc
        raise
