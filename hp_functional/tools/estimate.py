"""Per-rank memory of one training step, measured on fake tensors: what ``explain(batch=, seq=)``
reports in its ``Memory`` and ``hp-functional plan --fit`` compares with a budget.

One step (forward, backward, optimizer update) of the sharded ``apply_fn`` runs on fake tensors
at the requested shape while ``LiveBytes`` (a dispatch mode) keeps the bytes of every live tensor
storage: parameters, optimizer state, inputs, and whatever the step allocates until it is freed.
Fake tensors have real shapes, dtypes and lifetimes, so the live bytes are those a real rank
holds, at any scale, for no compute; what the plan shards (tp heads, sequence parallel norms, the
cp sequence), FSDP's gathers and remat's recompute are in the measurement because they are in
the step.  The categories (parameters, gradients, optimizer state, activations left at the end of
the forward, the rest of the peak as transient) are read off the same run.  docs/tools.md#memory
says what is counted and what is not (the allocator's caching and fragmentation, the CUDA
context, communication buffers outside torch's allocator).
"""

from __future__ import annotations

__all__ = ["StepMemory", "block_paths", "measure_step", "optimizer_named"]

import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..core.errors import PlanError
from ..runtime.loss import scalar_loss
from ..runtime.remat import Remat, resolve_remat
from ..train.optim import Optimizer, adamw, sgd
from .record import ModuleHooks


class LiveBytes(TorchDispatchMode):
    """The bytes of live tensor storages: every storage an op creates while the mode is active, and
    those ``add`` registers (parameters made before), each counted once (views share it) until
    it is freed.  ``current`` and ``peak`` (``reset_peak`` starts a new one).  Works on real and on
    fake tensors alike; a storage is freed when its last tensor is (``weakref.finalize``)."""

    def __init__(self):
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def add(self, tensors: Iterable) -> None:
        """Count the storages of ``tensors`` (any pytree; non-tensors skipped)."""
        for t in tree_leaves(tensors):
            if isinstance(t, Tensor):
                self._track(t)

    def reset_peak(self) -> None:
        self.peak = self.current

    def _track(self, t: Tensor) -> None:
        if t.layout != torch.strided:
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # a wrapper subclass without storage of its own
            return
        key = storage._cdata
        if key in self.sizes:
            return
        self.sizes[key] = storage.nbytes()
        self.current += self.sizes[key]
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self.sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                self._track(t)
        return out


class _BlockClock(ModuleHooks):
    """Global module hooks: the live bytes each block's forward leaves behind (its saved
    activations and its output), for the blocks of ``paths``; forward passes only (a remat
    block's recompute in the backward is not its forward)."""

    def __init__(self, paths: tuple[str, ...], live: LiveBytes):
        self.paths, self.live = set(paths), live
        self.names: dict[int, str] | None = None
        self.open: list[tuple[str, int]] = []
        self.left: dict[str, int] = {}

    def _pre(self, module, args) -> None:
        if self.names is None:
            self.names = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
        fqn = self.names.get(id(module))
        if fqn in self.paths and torch._C._current_graph_task_id() == -1 and fqn not in self.left:
            self.open.append((fqn, self.live.current))

    def _post(self, module, args, output) -> None:
        if self.open and self.names is not None and self.open[-1][0] == self.names.get(id(module)):
            fqn, before = self.open.pop()
            self.left[fqn] = self.live.current - before


@dataclass(frozen=True)
class StepMemory:
    """Bytes one rank holds over one training step (fake tensors; see the module docstring).

    ``parameters``, ``gradients``, ``optimizer``: the leaves, their gradients and the optimizer's
    state.  ``activations``: what the forward leaves alive for the backward (saved tensors, the
    loss, FSDP's groups kept gathered), at its end.  ``peak_backward``/``peak_update``: the most
    live bytes during forward + backward and during the optimizer's update; ``peak`` the larger.
    ``blocks``: (block path, bytes its forward left alive) in forward order."""

    parameters: int
    gradients: int
    optimizer: int
    inputs: int
    activations: int
    peak_backward: int
    peak_update: int
    blocks: tuple[tuple[str, int], ...] = field(default_factory=tuple)

    @property
    def peak(self) -> int:
        return max(self.peak_backward, self.peak_update)

    @property
    def transient(self) -> int:
        """The peak beyond parameters, gradients, optimizer state, inputs and activations: the largest
        temporaries (the logits' gradient, an FSDP block gathered, the optimizer's new state)."""
        return self.peak - (self.parameters + self.gradients + self.optimizer + self.inputs + self.activations)


def optimizer_named(optimizer: str | Optimizer | None) -> Optimizer | None:
    """``"adamw"`` (``hpf.optim.adamw()``: two moments per leaf, in the leaf's dtype), ``"sgd"``
    (no state), an ``Optimizer``, or None (no update measured)."""
    if optimizer is None or isinstance(optimizer, Optimizer):
        return optimizer
    if optimizer == "adamw":
        return adamw()
    if optimizer == "sgd":
        return sgd()
    raise PlanError(f"explain: optimizer={optimizer!r} is not 'adamw', 'sgd', an hpf.optim Optimizer or None")


def block_paths(template: torch.nn.Module) -> tuple[str, ...]:
    """The Hugging Face decoder layers of ``template`` (none for other models)."""
    try:
        resolved = resolve_remat(template, Remat(blocks=True))
    except PlanError:
        return ()
    return resolved.blocks if resolved else ()


def _nbytes(tensors: Iterable[Tensor | None]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, Tensor):
            s = t.untyped_storage()
            seen[s._cdata] = s.nbytes()
    return sum(seen.values())


def measure_step(apply_fn: Callable, params: Mapping[str, Tensor], args: tuple, kwargs: Mapping,
                 optimizer: Optimizer | None, blocks: tuple[str, ...] = (),
                 around: Callable[[], object] | None = None) -> StepMemory:
    """Run one step (``scalar_loss(apply_fn(params, *args, **kwargs)).backward()``, then
    ``optimizer.update``) under ``LiveBytes``; ``params`` must be leaves that require grad (fake
    tensors for an estimate, real ones to measure).  ``around()`` gives a context the forward and
    backward run in (``explain``'s collective recorder).  The output is dropped once its loss is
    taken, as a training loop does (``apply_fn(...).loss``)."""
    import contextlib

    live = LiveBytes()
    live.add((params, args, kwargs))
    p_bytes = _nbytes(params.values())
    in_bytes = live.current - p_bytes
    state = None
    if optimizer is not None:
        with live, torch.no_grad():
            state = optimizer.init(dict(params))
    o_bytes = live.current - p_bytes - in_bytes
    live.reset_peak()
    clock = _BlockClock(blocks, live)
    with around() if around is not None else contextlib.nullcontext(), clock, live:
        loss = scalar_loss(apply_fn(params, *args, **kwargs), who="apply_fn")
        activations = live.current - p_bytes - in_bytes - o_bytes
        if loss.requires_grad:
            loss.backward()
        del loss
    peak_backward = live.peak
    grads = {k: p.grad for k, p in params.items()}
    g_bytes = _nbytes(grads.values())
    peak_update = live.current
    if optimizer is not None:
        live.reset_peak()
        with live, torch.no_grad():
            new = optimizer.update(grads, state, dict(params))
        peak_update = live.peak
        del new
    for p in params.values():
        p.grad = None
    order = [b for b in blocks if b in clock.left]
    return StepMemory(p_bytes, g_bytes, o_bytes, in_bytes, activations, peak_backward, peak_update,
                      tuple((b, clock.left[b]) for b in order))
