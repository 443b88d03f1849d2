"""Model state (buffers) through ``apply_fn``: a second pytree next to ``params`` —
``hpf.buffers(apply_fn)`` and ``apply_fn(params, *args, buffers=...)``, which binds a clone of
each for the call and returns ``(output, buffers after the forward)``.  A forward that updates a
buffer in place under a ``torch.func`` transform without ``buffers=`` is refused by torch; its
error is mapped to a ``PlanError`` naming the buffers and the fix (``BufferSlots.update_error``,
on the failure path only).  See docs/training.md#buffers-model-state.
"""

from __future__ import annotations

__all__ = ["BufferSlots", "buffers"]

import re
from collections.abc import Mapping
from types import TracebackType

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
        self.owners: dict[int, tuple[str, str]] = {}  # id(module._buffers) -> (module path, class name): errors only
        first: dict[int, str] = {}
        for path, module in skeleton.named_modules(remove_duplicate=False):
            for attr, b in module._buffers.items():
                if b is None:
                    continue
                key = first.setdefault(id(b), f"{path}.{attr}" if path else attr)
                self.slots.setdefault(key, []).append((module._buffers, attr))
                self.owners.setdefault(id(module._buffers), (path, type(module).__name__))

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
        """Put back what ``bind`` replaced: the skeleton holds its own buffers again."""
        for store, attr, value in reversed(saved):
            store[attr] = value

    def update_error(self, exc: RuntimeError, state: Mapping[str, Tensor] | None) -> PlanError | None:
        """The ``PlanError`` to raise for ``exc`` (raised by the forward of a call with ``buffers=state``)
        when it is torch's refusal of an in-place buffer update under a ``torch.func`` transform:
        it names the buffers of the module that was running (the innermost module with buffers in
        the traceback) and the fix.  None for any other error.  Called on the failure path only."""
        if not self.slots or torch._C._functorch.maybe_current_level() is None:
            return None
        text = str(exc)
        broadcast = _BROADCAST.search(text)
        if _CAPTURED in text:
            transform = "torch.func.grad/vjp/jvp"
        elif _BN_VMAP in text or _VMAP_INPLACE in text or broadcast:
            transform = "torch.func.vmap"
        else:
            return None
        module, keys = self._updating(exc.__traceback__)
        if broadcast:  # a generic message: only an update of a buffer of the out-of-place result's shape is ours
            shape = tuple(int(n) for n in broadcast.group(1).replace(" ", "").split(",") if n)
            own = self.current()
            keys = [k for k in keys if tuple(own[k].shape) == shape]
            if not keys:
                return None
        where = f" (module {module[0]!r}, {module[1]})" if module else ""
        passed = [k for k in keys if state is not None and k in state]
        if passed and len(passed) == len(keys):
            if transform != "torch.func.vmap":
                return None
            return PlanError(
                f"apply_fn: the forward updates buffers {passed}{where} in place from the vmapped input under "
                f"{transform}, but the buffers passed are not batched: pass them batched (e.g. stacked, with "
                "in_dims 0 for buffers=), as with torch.func.functional_call (docs/training.md#buffers-model-state)")
        missing = [k for k in keys if k not in passed]
        return PlanError(
            f"apply_fn: the forward updates buffers {missing}{where} in place under {transform}, which torch refuses "
            "for state the transformed function does not take as input. Pass the buffers and take the updated ones "
            "back: buffers, _ = hpf.buffers(apply_fn) once, then out, buffers = apply_fn(params, ..., buffers=buffers) "
            "inside the transformed function, returning buffers as its aux output "
            "(docs/training.md#buffers-model-state)")

    def _updating(self, tb: TracebackType | None) -> tuple[tuple[str, str] | None, list[str]]:
        """The innermost module of the skeleton with buffers that the traceback ``tb`` runs in (its
        path and class) and its buffer keys; (None, every key) when none is found."""
        found = None
        while tb is not None:
            owner = tb.tb_frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and id(owner._buffers) in self.owners:
                found = owner._buffers
            tb = tb.tb_next
        if found is None:
            return None, list(self.slots)
        return self.owners[id(found)], [k for k, slots in self.slots.items() if any(s is found for s, _ in slots)]


#: torch's messages for an in-place update of a captured tensor under a transform (see ``update_error``)
_CAPTURED = "that would mutate a captured Tensor"
_BN_VMAP = "which will be updated in place, were not batched"
_VMAP_INPLACE = "vmap: inplace arithmetic"
_BROADCAST = re.compile(r"output with shape \[([0-9, ]*)\] doesn't match the broadcast shape")


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
