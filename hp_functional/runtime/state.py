"""Model state (buffers) through ``apply_fn``: a second pytree next to ``params`` —
``hpf.buffers(apply_fn)`` and ``apply_fn(params, *args, buffers=...)``, which binds a clone of
each for the call and returns ``(output, buffers after the forward)``.
See docs/training.md#buffers-model-state.
"""

from __future__ import annotations

__all__ = ["BufferSlots", "buffers"]

from collections.abc import Mapping

import torch
from torch import Tensor, nn
from torch.distributed.tensor import Replicate

from ..core.errors import PlanError
from ..core.placement import ShardInfo


class BufferSlots:
    """Where each buffer of a skeleton is bound: FQN (the first of tied names) -> its
    ``(module._buffers, attribute)`` slots."""

    def __init__(self, skeleton: nn.Module, mesh):
        self.mesh = mesh
        self.slots: dict[str, list[tuple[dict, str]]] = {}
        first: dict[int, str] = {}
        for path, module in skeleton.named_modules(remove_duplicate=False):
            for attr, b in module._buffers.items():
                if b is None:
                    continue
                key = first.setdefault(id(b), f"{path}.{attr}" if path else attr)
                self.slots.setdefault(key, []).append((module._buffers, attr))

    def current(self) -> dict[str, Tensor]:
        """The buffers bound now, by key."""
        return {k: slots[0][0][slots[0][1]] for k, slots in self.slots.items()}

    def check(self, state: object, devices: frozenset[str]) -> Mapping[str, Tensor]:
        """``state`` if it can be bound (a dict of tensors keyed by buffer FQNs, each of the
        buffer's shape, on the mesh's device), else a PlanError naming the buffer."""
        if not isinstance(state, Mapping):
            raise PlanError(f"apply_fn: buffers= must be a dict of tensors keyed by buffer FQN (hpf.buffers(apply_fn)), "
                            f"got {type(state).__name__}")
        own = self.current()
        for k, v in state.items():
            if k not in own:
                raise PlanError(f"apply_fn: buffers[{k!r}] is not a buffer of the model (buffers: {sorted(own)[:5]}...)")
            if not isinstance(v, Tensor) or v.shape != own[k].shape or v.device.type not in devices:
                got = (tuple(v.shape), v.device.type) if isinstance(v, Tensor) else type(v).__name__
                raise PlanError(f"apply_fn: buffers[{k!r}] is {got}, expected shape {tuple(own[k].shape)} on "
                                f"{sorted(devices - {'meta'})[0]}")
        return state

    def bind(self, state: Mapping[str, Tensor]) -> list[tuple[dict, str, Tensor]]:
        """Bind a clone of every tensor of ``state``; returns what to restore."""
        saved = []
        for k, v in state.items():
            owned = v.clone()
            for store, attr in self.slots[k]:
                saved.append((store, attr, store[attr]))
                store[attr] = owned
        return saved

    def collect(self, keys) -> dict[str, Tensor]:
        """The bound tensors of ``keys`` after the forward (reassigned ones included)."""
        return {k: self.slots[k][0][0][self.slots[k][0][1]] for k in keys}

    @staticmethod
    def restore(saved: list[tuple[dict, str, Tensor]]) -> None:
        for store, attr, value in reversed(saved):
            store[attr] = value


def buffers(apply_fn) -> tuple[dict[str, Tensor], dict[str, ShardInfo]]:
    """The buffers of an ``apply_fn`` as a pytree to pass as ``apply_fn(..., buffers=)``.
    ``save``/``load``/``unshard`` take them merged with the params:
    ``hpf.save(path, params | buffers, shard_info | buffer_info)``.

    Args:
        apply_fn: an ``apply_fn`` from ``hpf.shard`` or ``hpf.fsdp`` (anything else: ``PlanError``).
    Returns:
        ``(buffers, buffer_info)``: new tensors keyed by FQN (tied buffers once) holding its skeleton's
        buffers as they are now (the model's at ``shard()`` unless calls without ``buffers=`` updated
        them), and a ``ShardInfo`` per buffer, replicated on every mesh axis.
    """
    slots = getattr(apply_fn, "buffer_slots", None)  # an ApplyFn's (runtime.apply_fn: this module is below it)
    if not isinstance(slots, BufferSlots):
        raise PlanError("hpf.buffers: apply_fn is not one that hpf.shard() or hpf.fsdp() returned")
    names = slots.mesh.mesh_dim_names or ()
    out, info = {}, {}
    for k, b in slots.current().items():
        out[k] = b.detach().clone()
        shape = torch.Size(b.shape)
        info[k] = ShardInfo(placements=(Replicate(),) * len(names), mesh=slots.mesh, global_shape=shape,
                            local_shape=shape, offset=(0,) * len(shape))
    return out, info
