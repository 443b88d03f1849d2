"""The forwards ``hpf.fsdp`` installs on a fresh skeleton: a group's modules gather their bucket
when they run (``GatherOnUse``); a block that reshards after its forward gathers again for its
backward (``ReshardedBlock``: regather tokens under eager autograd, a recomputed block under
``torch.func``, torch's selective checkpoint under ``torch.compile``).  Used by ``train/fsdp.py``.

The local leaves reach these forwards the way any parameter reaches a module: the fsdp
``apply_fn`` passes them to the inner ``apply_fn``, which binds them into the skeleton's slots; a
forward reads its bucket's leaves from there, gathers, and binds the gathered tensors in their
place while it runs.  A gather shared by a group's modules is kept for the call in the inner
``apply_fn``'s per-call cache (emptied when the call ends)."""

from __future__ import annotations

__all__ = ["GatherOnUse", "ReshardedBlock"]

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..core.errors import PlanError
from ..runtime.remat import RematForward
from .fsdp_bucket import Bucket

Slots = tuple[tuple[dict, str, int], ...]  # (owner module's _parameters, attribute, index in the group)
LeafSlots = tuple[tuple[dict, str, Tensor], ...]  # per key of a bucket: a slot bound to its leaf, and its placeholder


def _swap_in(slots: Slots, values: Sequence[Tensor]) -> list:
    before = [store[name] for store, name, _ in slots]
    for store, name, j in slots:
        store[name] = values[j]
    return before


def _swap_back(slots: Slots, before: Sequence) -> None:
    for (store, name, _), value in zip(slots, before, strict=True):
        store[name] = value


class GatherOnUse:
    """The forward of a module of a group gathered when it runs: gather the group's leaves (read
    from ``leaf_slots``, where the call bound them; once per call when ``shared`` by several
    modules, kept in the call's ``cache``), bind its parameters, run.  Autograd keeps what the
    backward needs of the gathered tensors, the rest is freed."""

    def __init__(self, inner: Callable, bucket: Bucket, slots: Slots, leaf_slots: LeafSlots, cache: dict,
                 shared: bool):
        self.inner, self.bucket, self.slots, self.leaf_slots = inner, bucket, slots, leaf_slots
        self.cache, self.shared = cache, shared
        self.key = ("fsdp gathered", bucket.name)  # its entry in the call's cache

    def __call__(self, *args, **kwargs):
        bucket = self.bucket
        hit = self.cache.get(self.key) if self.shared else None
        full = hit[1] if hit is not None else None
        if full is None:
            leaves = [store[name] for store, name, _ in self.leaf_slots]
            if any(leaf is placeholder for leaf, (_, _, placeholder) in zip(leaves, self.leaf_slots, strict=True)):
                raise PlanError(f"fsdp: {bucket.name} ran outside an apply_fn call (inside a recomputed block?)")
            full = bucket.gather(leaves)
            if self.shared:
                self.cache[self.key] = (None, full)
        before = _swap_in(self.slots, full)
        try:
            return self.inner(*args, **kwargs)
        finally:
            _swap_back(self.slots, before)


class _Regather:
    """What autograd saves instead of a gathered parameter (or a view of one) of a resharded
    block: the block's local leaves and where the tensor sat in the gathered parameter's storage.
    ``unpack`` gathers the bucket again, once per backward however many tensors ask (``shared``)."""

    __slots__ = ("shared", "index", "size", "stride", "offset")

    def __init__(self, shared: list, index: int, t: Tensor):
        self.shared, self.index = shared, index
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()

    def unpack(self) -> Tensor:
        bucket, leaves, full = self.shared
        if full is None:
            with torch.no_grad():
                full = self.shared[2] = [t.detach() for t in bucket.gather(leaves)]
        return full[self.index].as_strided(self.size, self.stride, self.offset)


def _storage(t: Tensor) -> int | None:
    try:  # the storage's identity, not its address: fake tensors (explain's memory estimate) all have address 0
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # a tensor without a plain storage: saved as it is
        return None


class ReshardedBlock(RematForward):
    """A block whose gathered parameters are freed after its forward and gathered again for its
    backward (one more all-gather; the reduce-scatter stays one).  Eager ``.backward()``: autograd
    saves a ``_Regather`` token instead of each gathered parameter (``saved_tensors_hooks``, as
    FSDP2 frees the storage of what autograd saved), so nothing is recomputed.  Under
    ``torch.func`` (which has no saved-tensor hooks) and in a block ``shard(remat=...)``
    recomputes anyway: a recomputed block (``Recompute``) whose leaves are the block's *local*
    leaves, bound by gathering them.  Under ``torch.compile``: torch's selective checkpoint that
    recomputes only the gathers."""

    def __init__(self, fqn: str, module: nn.Module, inner: Callable, slots: Slots, bucket: Bucket,
                 cache, device_type: str, preserve_rng: bool, recompute: bool):
        super().__init__(fqn, module, inner, slots, bucket.keys, cache, device_type, preserve_rng)
        self.bucket, self.recompute = bucket, recompute

    def bind(self, leaves: Sequence[Tensor]) -> list[Tensor]:
        return self.bucket.gather(leaves)

    def forward_without_grad(self, *args, **kwargs):
        return self._gathered(self.leaves(), args, kwargs)

    def _gathered(self, leaves: Sequence[Tensor], args, kwargs):
        before = _swap_in(self.slots, self.bind(leaves))
        try:
            return self.inner(*args, **kwargs)
        finally:
            _swap_back(self.slots, before)

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling() and torch.is_grad_enabled():
            # traced: torch's checkpoint is a higher-order op that Dynamo puts in the graph (our
            # Recompute would break it); its policy saves the compute and recomputes the gathers
            return checkpoint(self._gathered, self.leaves(), args, kwargs, use_reentrant=False,
                              context_fn=_recompute_gathers)
        if self.recompute or not torch.is_grad_enabled() or torch._C._functorch.maybe_current_level() is not None:
            return super().__call__(*args, **kwargs)
        return self._saving_tokens(args, kwargs)

    def _saving_tokens(self, args, kwargs):
        leaves = self.leaves()
        full = self.bind(leaves)
        shared = [self.bucket, leaves, None]
        where = {ptr: j for j, t in enumerate(full) if (ptr := _storage(t)) is not None}

        def pack(t: Tensor):
            j = where.get(_storage(t))
            return t if j is None else _Regather(shared, j, t)

        def unpack(saved):
            return saved.unpack() if isinstance(saved, _Regather) else saved

        before = _swap_in(self.slots, full)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                return self.inner(*args, **kwargs)
        finally:
            _swap_back(self.slots, before)


def _gather_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_RECOMPUTE if op in _GATHER_OPS else CheckpointPolicy.PREFER_SAVE


_GATHER_OPS = {torch.ops._c10d_functional.all_gather_into_tensor.default, torch.ops._c10d_functional.wait_tensor.default}


def _recompute_gathers():
    return create_selective_checkpoint_contexts(_gather_policy)
