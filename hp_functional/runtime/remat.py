"""Activation recompute (remat), decided once in ``shard(..., remat=...)``: a remat block runs its
forward without keeping its activations and recomputes them in the backward, as a differentiable
function of its leaves (``Recompute``), since ``torch.utils.checkpoint`` meets the skeleton's meta
placeholders and does not compose with ``torch.func``.  (Named apart from checkpoints on disk,
``train.dcp``.)  See docs/transforms.md#activation-recompute-remat (why, and the limits).
"""

from __future__ import annotations

__all__ = [
    "Remat", "RematForward", "RematPlan", "check_recorded_outputs", "install_remat", "neutralise_hf_checkpointing",
    "resolve_remat"
]

import difflib
import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

# torch's pytree, not optree: Hugging Face registers its output and cache types with it, so a
# block's arguments and outputs flatten into tensors here as they do inside transformers
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..core.errors import PlanError
from ..core.paths import path_matches
from .boundary import ConversionCache

_HF_LAYER = "transformers.modeling_layers.GradientCheckpointingLayer"
_CACHE_KWARGS = ("cache", "past_key_values", "layer_past")  # HF's names for a layer's KV cache


@dataclass(frozen=True)
class Remat:
    """Which blocks ``shard()`` recomputes in the backward (activation recompute, "remat"), and how.

    ``blocks``: True — the Hugging Face decoder layers (instances of ``GradientCheckpointingLayer``);
    or module-path patterns under the one pattern rule (``"model.layers.*"``; ``*`` is one segment,
    ``**`` any number: docs/plan-language.md#patterns).
    ``preserve_rng``: replay the forward's RNG state in the recompute, so dropout masks match
    (costs a copy of the RNG state per block and call).

    ``shard(model, plan, mesh, remat=True)`` is ``remat=Remat()``; ``remat=["model.layers.*"]`` is
    ``Remat(blocks=("model.layers.*",))``.
    """

    blocks: bool | tuple[str, ...] = True
    preserve_rng: bool = True

    def __post_init__(self):
        blocks = self.blocks
        if blocks is False:
            blocks = ()
        elif isinstance(blocks, str):
            blocks = (blocks,)
        elif not isinstance(blocks, bool) and isinstance(blocks, Sequence):
            blocks = tuple(blocks)
        if not (blocks is True or (isinstance(blocks, tuple) and all(isinstance(b, str) for b in blocks))):
            raise PlanError(f"remat blocks must be True or module-path patterns (strings), got {self.blocks!r}")
        object.__setattr__(self, "blocks", blocks)


@dataclass(frozen=True)
class RematPlan:
    """What ``resolve_remat`` decided: the recomputed blocks' paths (``named_modules`` order) and
    whether their recompute replays the RNG."""

    blocks: tuple[str, ...]
    preserve_rng: bool = True


def as_remat(value: object) -> Remat | None:
    """``shard()``'s ``remat=`` as a policy: None (follow the model: the layers on which Hugging
    Face's ``gradient_checkpointing_enable()`` was called), False (off), True, patterns or a ``Remat``."""
    if value is None or isinstance(value, Remat):
        return value
    if value is False:
        return Remat(blocks=())
    if value is True or isinstance(value, str | Sequence):
        return Remat(blocks=value)
    raise PlanError(f"shard(remat=...): expected None, a bool, module-path patterns or hpf.Remat, "
                    f"got {type(value).__name__}")


def _hf_layer_class() -> type | None:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return None
    return GradientCheckpointingLayer


def hf_checkpointed(model: nn.Module) -> tuple[list[str], list[str]]:
    """(decoder layers, other modules) of ``model`` whose Hugging Face ``gradient_checkpointing``
    flag is on (``gradient_checkpointing_enable()`` was called)."""
    layer = _hf_layer_class()
    layers, others = [], []
    for path, m in model.named_modules():
        if m.__dict__.get("gradient_checkpointing") is True:
            (layers if layer is not None and isinstance(m, layer) else others).append(path)
    return layers, others


def resolve_remat(model: nn.Module, remat: object) -> RematPlan | None:
    """The blocks ``remat`` names in ``model`` (see ``as_remat``), or None for none.
    Reads the model only; raises ``PlanError`` (on every rank, before any collective) for a
    pattern that matches no module, nested blocks, ``True`` on a model without Hugging Face
    decoder layers, or Hugging Face checkpointing that cannot be mapped to blocks."""
    policy = as_remat(remat)
    modules = dict(model.named_modules())
    if policy is None:
        layers, others = hf_checkpointed(model)
        if not layers and not others:
            return None
        if not layers:
            raise PlanError(
                f"{type(model).__name__} has Hugging Face gradient checkpointing enabled on "
                f"{', '.join(p or 'the model itself' for p in others[:3])}, which "
                "hp_functional cannot map to blocks (torch.utils.checkpoint does not work inside apply_fn): pass "
                "shard(..., remat=[module-path patterns]) or call model.gradient_checkpointing_disable()")
        policy, blocks = Remat(), layers
    elif policy.blocks is True:
        layer = _hf_layer_class()
        blocks = [p for p, m in modules.items() if layer is not None and isinstance(m, layer)]
        if not blocks:
            raise PlanError(
                f"shard(remat=True): {type(model).__name__} has no Hugging Face decoder layers "
                f"({_HF_LAYER}); name the blocks with module-path patterns, e.g. remat=['layers.*']")
    else:
        blocks = []
        for pattern in policy.blocks:
            hits = [p for p in modules if path_matches(pattern, p)]
            if not hits:
                close = difflib.get_close_matches(pattern, [p for p in modules if p], n=3, cutoff=0.5)
                raise PlanError(f"remat pattern {pattern!r} matches no module; closest paths: {close}")
            blocks += hits
        chosen = set(blocks)
        blocks = [p for p in modules if p in chosen]  # named_modules order, once each
    for outer in blocks:
        inner = next((b for b in blocks if b != outer and (outer == "" or b.startswith(outer + "."))), None)
        if inner is not None:
            raise PlanError(f"remat blocks nest: {inner!r} is inside {outer!r}; name only one of them")
    return RematPlan(tuple(blocks), policy.preserve_rng) if blocks else None


def check_recorded_outputs(model: nn.Module, who: str, instead: str) -> None:
    """A PlanError when the model records block internals by forward hooks that a loss is
    differentiated through: Hugging Face MoE models with ``output_router_logits`` compute the
    router's auxiliary loss from router logits recorded inside each decoder layer, and a block
    recomputed in the backward yields those records without a gradient (the aux loss's gradient
    would be silently lost)."""
    if getattr(getattr(model, "config", None), "output_router_logits", False):
        raise PlanError(f"{who}: {type(model).__name__} has config.output_router_logits=True: its auxiliary loss reads "
                        "router logits recorded inside each decoder layer, whose gradient a recomputed (remat) "
                        f"block cannot carry; {instead}, or set config.output_router_logits=False (no aux loss)")


def neutralise_hf_checkpointing(skeleton: nn.Module) -> None:
    """Turn off Hugging Face's own checkpointing on the private skeleton (its recompute would
    meet meta placeholders) and drop the input-require-grads hook that
    ``gradient_checkpointing_enable()`` registers on the input embeddings (it calls
    ``requires_grad_()``, which ``torch.func`` refuses; our recompute does not need it).
    The user's model keeps both."""
    for m in skeleton.modules():
        if m.__dict__.get("gradient_checkpointing") is True:
            m.gradient_checkpointing = False
        hooks = m.__dict__.get("_forward_hooks")
        if hooks:
            for key in [k for k, h in hooks.items() if getattr(h, "__name__", "") == "make_inputs_require_grads"]:
                del hooks[key]


# ---------------------------------------------------------------- the recompute
def _rng_state(device_type: str) -> tuple[Tensor, Tensor | None]:
    device = None
    if device_type not in ("cpu", "meta"):
        device = torch.get_device_module(device_type).get_rng_state()
    return torch.get_rng_state(), device


@contextmanager
def _replayed_rng(state: tuple[Tensor, Tensor | None] | None, device_type: str):
    """Run with the RNG state of the forward, then put the current state back."""
    if state is None:
        yield
        return
    cpu, device = state
    devices = [torch.get_device_module(device_type).current_device()] if device is not None else []
    with torch.random.fork_rng(devices=devices, device_type=device_type if devices else "cuda"):
        torch.set_rng_state(cpu)
        if device is not None:
            torch.get_device_module(device_type).set_rng_state(device)
        yield


class _Call:
    """One call of a remat block: what its forward and recompute need besides the leaves
    (the non-tensor arguments, where the tensors go, the RNG state, the output structure)."""

    __slots__ = ("block", "flat", "spec", "where", "rng", "out_spec", "out_consts", "out_where", "diff")

    def __init__(self, block: RematForward, flat: list, spec, where: tuple[int, ...], rng):
        self.block, self.flat, self.spec, self.where, self.rng = block, flat, spec, where, rng
        self.out_spec = self.out_consts = self.out_where = self.diff = None

    def run(self, leaves: Sequence[Tensor]) -> tuple[list, object]:
        """The block on ``leaves`` (its parameter tensors, then its tensor inputs): the flat
        output and its structure.  The boundaries' per-call conversion cache is set aside while
        the block runs and restored afterwards, so a conversion made without grad in the forward
        is never reused outside the block, and a recompute (after ``apply_fn`` has returned)
        leaves no entries behind."""
        block = self.block
        n = len(block.keys)
        flat = list(self.flat)
        for i, t in zip(self.where, leaves[n:], strict=True):
            flat[i] = t
        args, kwargs = tree_unflatten(flat, self.spec)
        bound = block.bind(leaves[:n])
        slots, cache = block.slots, block.cache
        before = [store[name] for store, name, _ in slots]
        aside = None
        if cache is not None:
            aside = dict(cache)
            cache.clear()
        try:
            for store, name, j in slots:
                store[name] = bound[j]
            out = block.inner(*args, **kwargs)
        finally:
            for (store, name, _), value in zip(slots, before, strict=True):
                store[name] = value
            if cache is not None:
                cache.clear()
                cache.update(aside)
        return tree_flatten(out)


class Recompute(torch.autograd.Function):
    """A remat block as a function of its leaves (its parameter tensors, then its tensor
    inputs), an ``autograd.Function`` with ``setup_context`` so that ``torch.func`` takes it:
    forward — the block under ``no_grad``, saving only the leaves;
    backward — the leaves bound into the block's ``_parameters`` slots of the skeleton (what was
    there put back afterwards), the forward's RNG state replayed (equal dropout masks), the block
    recomputed, and its vector-Jacobian product: from ``torch.func.vjp`` inside a ``torch.func``
    transform (or a double backward); a plain first-order ``.backward()`` uses
    ``torch.autograd.grad`` on detached leaves instead, which also works while saved-tensor hooks
    are active (``torch.autograd.graph.save_on_cpu``).
    jvp (forward mode, and so ``jvp(grad(...))`` HVPs, ``jacfwd``, ``hessian``) — the block
    recomputed under ``torch.func.jvp`` on the leaves and their tangents (the forward's RNG state
    replayed), the outputs' tangents; the forward pays one recompute.
    ``vmap`` gets a generated rule (forward, backward and jvp run on the batched values), so
    ``vmap(grad(...))`` and ``vmap(jvp(...))`` work too.  Blocks hold our own collectives: every
    rank recomputes the same blocks in the same order, so the recompute's collectives match
    across ranks."""

    generate_vmap_rule = True

    @staticmethod
    def forward(call: _Call, *leaves: Tensor) -> tuple[Tensor, ...]:
        with torch.no_grad():
            flat, spec = call.run(leaves)
        where = tuple(i for i, v in enumerate(flat) if isinstance(v, Tensor))
        # an output that is an input or a view of one is cloned: a Function may not return its inputs
        ids = {id(t) for t in leaves} | {id(t._base) for t in leaves if t._base is not None}
        outs = tuple(flat[i].clone() if id(flat[i]) in ids or id(flat[i]._base) in ids else flat[i] for i in where)
        call.out_spec, call.out_where = spec, where
        call.out_consts = [None if isinstance(v, Tensor) else v for v in flat]
        call.diff = tuple(k for k, t in enumerate(outs) if t.is_floating_point() or t.is_complex())
        return outs

    @staticmethod
    def setup_context(ctx, inputs, output):
        call, *leaves = inputs
        ctx.call = call
        ctx.save_for_backward(*leaves)
        ctx.save_for_forward(*leaves)
        fixed = [t for k, t in enumerate(output) if k not in call.diff]
        if fixed:
            ctx.mark_non_differentiable(*fixed)

    @staticmethod
    def backward(ctx, *grads):
        call: _Call = ctx.call
        leaves = list(ctx.saved_tensors)
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[1:]) if need]
        out_grads = [grads[k] for k in call.diff]
        result: list[Tensor | None] = [None] * len(leaves)
        if not wanted:
            return (None, *result)
        with _replayed_rng(call.rng, call.block.device_type):
            if torch._C._functorch.maybe_current_level() is None and not torch.is_grad_enabled():
                got = _grad_plain(call, leaves, wanted, out_grads)
            else:
                got = _grad_func(call, leaves, wanted, out_grads)
        for i, g in zip(wanted, got, strict=True):
            result[i] = g
        return (None, *result)


    @staticmethod
    def jvp(ctx, _call, *tangents):
        call: _Call = ctx.call
        leaves = list(ctx.saved_tensors)
        moved = [i for i, t in enumerate(tangents) if t is not None]
        out: list[Tensor | None] = [None] * len(call.out_where)
        if not moved:
            return tuple(out)

        def block(*primals):
            args = list(leaves)
            for i, p in zip(moved, primals, strict=True):
                args[i] = p
            return tuple(_outputs(call, args))

        with _replayed_rng(call.rng, call.block.device_type):
            _, got = torch.func.jvp(block, tuple(leaves[i] for i in moved), tuple(tangents[i] for i in moved))
        for k, t in zip(call.diff, got, strict=True):
            out[k] = t
        return tuple(out)


def _outputs(call: _Call, leaves: Sequence[Tensor]) -> list[Tensor]:
    flat, _ = call.run(leaves)
    outs = [flat[i] for i in call.out_where]
    return [outs[k] for k in call.diff]


def _grad_plain(call: _Call, leaves: list[Tensor], wanted: list[int], out_grads: list) -> tuple:
    """First-order ``.backward()``: recompute on detached leaves, ``torch.autograd.grad``."""
    with torch.enable_grad():
        for i in wanted:
            leaves[i] = leaves[i].detach().requires_grad_()
        outs = _outputs(call, leaves)
        pairs = [(o, g) for o, g in zip(outs, out_grads, strict=True) if o.requires_grad and g is not None]
        if not pairs:
            return tuple(None for _ in wanted)
        return torch.autograd.grad([o for o, _ in pairs], [leaves[i] for i in wanted], [g for _, g in pairs],
                                   allow_unused=True)


def _grad_func(call: _Call, leaves: list[Tensor], wanted: list[int], out_grads: list) -> tuple:
    """Inside a ``torch.func`` transform (or a double backward): ``torch.func.vjp``."""

    def block(*primals):
        args = list(leaves)
        for i, p in zip(wanted, primals, strict=True):
            args[i] = p
        return tuple(_outputs(call, args))

    outs, vjp_fn = torch.func.vjp(block, *[leaves[i] for i in wanted])
    cotangents = tuple(torch.zeros_like(o) if g is None else g for o, g in zip(outs, out_grads, strict=True))
    return vjp_fn(cotangents)


class RematForward:
    """The forward installed on a remat block of the skeleton: ``inner`` (its local forward,
    boundaries included) through ``Recompute`` when grad is enabled, else ``inner`` itself."""

    def __init__(self, fqn: str, module: nn.Module, inner: Callable, slots: Sequence[tuple[dict, str, int]],
                 keys: tuple[str, ...], cache: ConversionCache | None, device_type: str, preserve_rng: bool):
        self.fqn, self.inner, self.slots, self.keys, self.cache = fqn, inner, tuple(slots), keys, cache
        self.device_type, self.preserve_rng = device_type, preserve_rng
        self.first = tuple(next((store, name) for store, name, j in self.slots if j == k) for k in range(len(keys)))
        self.keeps_cache = bool(getattr(type(module), "_can_checkpoint_with_cache", False))
        self.what = type(module).__name__

    def leaves(self) -> list[Tensor]:
        """The block's leaves for this call, one per key: what its slots hold (a transform such as
        ``hpf.fsdp`` supplies others, from which ``bind`` makes what the slots get)."""
        return [store[name] for store, name in self.first]

    def bind(self, leaves: Sequence[Tensor]) -> Sequence[Tensor]:
        """What the block's slots hold while it runs on ``leaves`` (here: the leaves themselves)."""
        return leaves

    def forward_without_grad(self, *args, **kwargs):
        """The block when nothing is differentiated: nothing to save, nothing to recompute."""
        return self.inner(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.forward_without_grad(*args, **kwargs)
        if not self.keeps_cache:
            kwargs = self._without_cache(kwargs)
        flat, spec = tree_flatten((args, kwargs))
        where = tuple(i for i, v in enumerate(flat) if isinstance(v, Tensor))
        tensors = [flat[i] for i in where]
        for i in where:
            flat[i] = None  # the tensors travel as leaves (saved once), not inside the call
        rng = _rng_state(self.device_type) if self.preserve_rng else None
        call = _Call(self, flat, spec, where, rng)
        outs = Recompute.apply(call, *self.leaves(), *tensors)
        flat_out = list(call.out_consts)
        for i, t in zip(call.out_where, outs, strict=True):
            flat_out[i] = t
        return tree_unflatten(flat_out, call.out_spec)

    def _without_cache(self, kwargs: dict) -> dict:
        dropped = [k for k in _CACHE_KWARGS if kwargs.get(k) is not None]
        if not dropped and not kwargs.get("use_cache"):
            return kwargs
        if dropped:
            warnings.warn(f"recomputed (remat) {self.what} blocks run without their KV cache ({', '.join(dropped)}=None) when "
                          "differentiated, as with Hugging Face's checkpointing: the recompute would write it twice "
                          "(pass use_cache=False to the model to silence this)", UserWarning, stacklevel=3)
        kwargs = dict(kwargs)
        for k in dropped:
            kwargs[k] = None
        if "use_cache" in kwargs:
            kwargs["use_cache"] = False
        return kwargs


def install_remat(skeleton: nn.Module, plan: RematPlan, leaf_of: Mapping[str, str],
                  cache: ConversionCache | None, device_type: str) -> dict[str, RematForward]:
    """Make each block of ``plan`` a ``RematForward`` on the skeleton (after the
    boundaries are installed, so a block's own conversions are part of what it recomputes).
    ``leaf_of``: every parameter FQN → its leaf key (tied aliases share one leaf)."""
    installed = {}
    for fqn in plan.blocks:
        module = skeleton.get_submodule(fqn)
        prefix = f"{fqn}." if fqn else ""
        keys: dict[str, int] = {}
        slots = []
        for name, key in leaf_of.items():
            if name.startswith(prefix):
                owner, _, attr = name.rpartition(".")
                slots.append((skeleton.get_submodule(owner)._parameters, attr, keys.setdefault(key, len(keys))))
        wrapper = RematForward(fqn, module, module.forward, slots, tuple(keys), cache, device_type, plan.preserve_rng)
        module.forward = wrapper
        installed[fqn] = wrapper
    return installed
