"""``as_module(apply_fn, params)``: the functional pair as an ``nn.Module``, for module-based tools
(``torch.optim``, ``torch.compile``, ``state_dict()``, FSDP2's ``fully_shard``).  See docs/training.md#fsdp2-interop.
"""

from __future__ import annotations

__all__ = ["FunctionalModule", "as_module"]

import functools
from collections.abc import Callable, Mapping

from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ..core.errors import PlanError
from .generate import generate


class _Node(nn.Module):
    """One container of the mirrored FQN tree.  Calling it runs ``run()``: the root calls the
    containers that carry hooks around ``apply_fn``, so the hooks bracket the whole call."""

    def forward(self, run: Callable[[], object]) -> object:
        return run()


class _NodeList(nn.ModuleList):
    """A container whose children are named ``0 .. n-1`` (``model.layers``): indexable and
    iterable like the model's ``ModuleList``, called like ``_Node``."""

    def forward(self, run: Callable[[], object]) -> object:
        return run()


class FunctionalModule(nn.Module):
    """``apply_fn`` with its params pytree as an ``nn.Module``; build it with ``as_module``."""

    def __init__(self, apply_fn: Callable, params: Mapping[str, Tensor]):
        super().__init__()
        self.__dict__["_apply_fn"] = apply_fn  # a plain attribute even if apply_fn is a module: never a child
        tree: dict = {}
        for fqn, leaf in params.items():
            _insert(tree, fqn, leaf)
        _build(self, tree, "")
        slots = []  # (fqn, owning container, parameter name), in the pytree's order
        for fqn in params:
            mod, _, name = fqn.rpartition(".")
            slots.append((fqn, self.get_submodule(mod), name))
        self._slots = tuple(slots)
        self._containers = tuple(m for _, m in self.named_modules() if m is not self)

    def params(self) -> dict[str, Tensor]:
        """The parameters the module holds now, keyed by FQN in the pytree's order: the functional
        form again (``apply_fn(m.params(), ...)``).  Under ``fully_shard`` these are FSDP2's
        DTensors on its mesh between steps (``.full_tensor()`` gives this rank's TP-local shard)."""
        return {fqn: node._parameters[name] for fqn, node, name in self._slots}

    # The forward reads every parameter from its container at call time (``container._parameters[name]``),
    # which is the slot FSDP2 swaps (torch/distributed/fsdp/_fully_shard/_fsdp_param.py:
    # ``FSDPParam._setattr_on_modules`` -> ``unsafe_setattr_param`` stores the sharded DTensor parameter, then in
    # the pre-forward hook the unsharded ``nn.Parameter``, straight into ``module._parameters``).  ``apply_fn``
    # binds all of its parameters at once, so a container that carries forward hooks (``fully_shard`` on a block)
    # is *called* around the whole ``apply_fn`` call: its pre-forward hook unshards it before, its post-forward
    # hook reshards it after and registers the pre-backward unshard on the outputs.
    def forward(self, *args, **kwargs):
        """``apply_fn(self.params(), *args, **kwargs)``, inside the calls of every container that
        carries forward hooks (outermost first in module order)."""
        run = functools.partial(self._call_apply_fn, args, kwargs)
        for node in reversed(self._containers):
            if node._forward_pre_hooks or node._forward_hooks:
                run = functools.partial(node, run)
        return run()

    def _call_apply_fn(self, args: tuple, kwargs: dict):
        values = self.params()
        for fqn, v in values.items():
            if isinstance(v, DTensor):
                raise PlanError(
                    f"as_module: parameter {fqn!r} is a DTensor ({v.placements} on {v.device_mesh}) at forward time: "
                    "FSDP2 unshards a module's parameters in its forward pre-hook, so call the module (the root "
                    "fully_shard'ed one), not apply_fn(m.params(), ...); as_module takes plain local shards, "
                    "not hpf.to_dtensor(...)"
                )
        return self._apply_fn(values, *args, **kwargs)

    def generate(self, *args, **kwargs):
        """Hugging Face's ``generate()`` on the sharded model: ``hpf.generate(apply_fn, self.params(), ...)``
        (train/generate.py; the same tokens as the unsharded model's ``eval()`` then ``generate()``)."""
        return generate(self._apply_fn, self.params(), *args, **kwargs)

    def extra_repr(self) -> str:
        return f"{len(self._slots)} parameters"


def as_module(apply_fn: Callable, params: Mapping[str, Tensor]) -> FunctionalModule:
    """An ``nn.Module`` whose ``forward(*args, **kwargs)`` is ``apply_fn(params, *args, **kwargs)``
    with ``params`` read from the module at call time (inverse: ``m.params()``).

    Its ``nn.Parameter`` s share storage with ``params``' leaves (``requires_grad`` kept): an
    in-place update of one shows in the other, so ``torch.optim.AdamW(m.parameters())`` steps the
    pytree itself; gradients land on the module's parameters (``p.grad``), not the pytree's
    tensors.  Each FQN's container path is its prefix (``m.get_submodule("model.layers.0")``),
    containers named ``0..n-1`` are ``ModuleList`` s, and ``m.named_parameters()`` follows the
    pytree's order when that is a module order (as ``shard()`` returns it).

    FSDP2: ``fully_shard`` each block (``m.get_submodule("model.layers.0")``), then ``m``, over the
    data-parallel mesh.  FSDP2 then owns sharded copies (``params`` is no longer updated: use
    ``m.params()``).  ``apply_fn`` binds every parameter at once, so a forward unshards every block
    before ``apply_fn`` runs and they stay unsharded until the forward ends, and again through the
    backward: the step's peak holds the whole TP-local model; the savings are between steps
    (parameters, gradients, optimizer state sharded over data parallel).

    Args:
        apply_fn: ``apply_fn(params, *args, **kwargs)``, e.g. ``shard()``'s (then its keys are checked against
            ``params``); the module holds it (its skeleton is private), never the user's model.
        params: FQN -> plain tensor (the pytree ``shard()`` returned, not DTensors); neither the dict nor its
            tensors' attributes are changed.

    Returns:
        A ``FunctionalModule`` whose parameters mirror the FQNs; ``m.params()`` gives the pytree back.
    """
    if not isinstance(params, Mapping):
        raise PlanError(f"as_module: params must be a dict FQN -> tensor (the pytree shard() returned), "
                        f"got {type(params).__name__}")
    bad = [k for k, v in params.items() if not isinstance(v, Tensor)]
    if bad:
        raise PlanError(f"as_module: params[{bad[0]!r}] is a {type(params[bad[0]]).__name__}, not a tensor")
    program = getattr(apply_fn, "program", None)
    if program is not None and set(program.infos) != set(params):
        missing, extra = sorted(set(program.infos) - set(params)), sorted(set(params) - set(program.infos))
        raise PlanError(f"as_module: params keys differ from apply_fn's: missing {missing[:5]}, extra {extra[:5]}; "
                        "pass the params pytree that shard() returned with this apply_fn")
    return FunctionalModule(apply_fn, params)


def _insert(tree: dict, fqn: str, leaf: Tensor) -> None:
    """Put ``leaf`` at ``fqn`` in the nested dict ``tree`` (dicts are containers, tensors leaves)."""
    parts = fqn.split(".")
    if not all(parts):
        raise PlanError(f"as_module: parameter name {fqn!r} has an empty component")
    node = tree
    for i, part in enumerate(parts[:-1]):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise PlanError(f"as_module: {'.'.join(parts[: i + 1])!r} is a parameter and also the prefix of {fqn!r}")
    if parts[-1] in node:
        raise PlanError(f"as_module: {fqn!r} is a parameter and also the prefix of another parameter")
    node[parts[-1]] = leaf


def _build(module: nn.Module, tree: dict, prefix: str) -> None:
    """Register ``tree``'s leaves on ``module`` as parameters (sharing storage) and its dicts as
    child containers, parameters first (``named_parameters`` yields a module's own ones first)."""
    for name, value in tree.items():
        if isinstance(value, Tensor):
            try:
                module.register_parameter(name, nn.Parameter(value.detach(), requires_grad=value.requires_grad))
            except KeyError as exc:
                raise PlanError(f"as_module: cannot hold parameter {prefix + name!r}: {exc.args[0]}") from None
    for name, value in tree.items():
        if isinstance(value, dict):
            listed = list(value) == [str(i) for i in range(len(value))] and all(isinstance(v, dict) for v in value.values())
            child = _NodeList() if listed else _Node()
            try:
                module.add_module(name, child)
            except KeyError as exc:
                raise PlanError(f"as_module: cannot hold submodule {prefix + name!r}: {exc.args[0]}") from None
            _build(child, value, f"{prefix}{name}.")
