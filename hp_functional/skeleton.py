"""The private stand-in that ``apply_fn`` runs: the model's structure without its weights.

``build_skeleton`` deep-copies the module tree with every parameter replaced by a meta
placeholder of its *local* shape (tied parameters map to one placeholder) and every buffer
by an owned clone, so the user's model is never touched, not even temporarily by
``functional_call``.  ``install_boundary`` sets a planned skeleton module's ``forward`` to
its local forward with the pre-lowered input/output collectives around it.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor, nn

from .errors import PlanError, ShapeError
from .redistribute import Step


def build_skeleton(model: nn.Module, local_shapes: Mapping[str, torch.Size], canonical: Mapping[str, str]) -> nn.Module:
    """A deep copy of ``model``'s structure with meta placeholders for parameters.

    ``canonical`` maps every parameter FQN (aliases included) to its pytree key.
    """
    memo: dict[int, object] = {}
    placeholders: dict[str, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        key = canonical[name]
        if key not in placeholders:
            empty = torch.empty(local_shapes[key], dtype=p.dtype, device="meta")
            placeholders[key] = nn.Parameter(empty, requires_grad=p.requires_grad)
        memo[id(p)] = placeholders[key]
    for b in model.buffers():
        memo[id(b)] = b.detach().clone()
    try:
        return copy.deepcopy(model, memo)
    except Exception as exc:  # a module holding something that cannot be copied (a lock, a process group)
        raise PlanError(f"cannot build the private skeleton of {type(model).__name__}: {exc}") from exc


def _arg_slots(forward: Callable, keys: Sequence, fqn: str) -> list[tuple[object, str | None, int | None]]:
    """(key, keyword name, position) for each boundary key of ``forward``'s arguments."""
    params = [
        p for p in inspect.signature(forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    positional = [p for p in params if p.kind != p.KEYWORD_ONLY]
    has_var_kw = any(p.kind == p.VAR_KEYWORD for p in inspect.signature(forward).parameters.values())
    slots = []
    for key in keys:
        if isinstance(key, int):
            if key >= len(positional):
                raise PlanError(f"{fqn}: forward has no positional argument {key}")
            slots.append((key, positional[key].name, key))
            continue
        match = [i for i, p in enumerate(params) if p.name == key]
        if not match and not has_var_kw:
            raise PlanError(f"{fqn}: forward has no argument {key!r} (has {[p.name for p in params]})")
        pos = match[0] if match and params[match[0]].kind != params[match[0]].KEYWORD_ONLY else None
        slots.append((key, key, pos))
    return slots


def _run(steps: Sequence[Step], x: Tensor) -> Tensor:
    for step in steps:
        x = step(x)
    return x


def install_boundary(
    module: nn.Module,
    fqn: str,
    inner: Callable,
    in_steps: Mapping[object, Sequence[Step]],
    out_steps: Mapping[object, Sequence[Step]],
    shared: dict | None = None,
) -> None:
    """Make ``module.forward`` run ``inner`` with ``in_steps`` on its arguments and
    ``out_steps`` on its outputs (``"output"``: the tensor, or element 0 of a tuple).

    ``shared`` (one dict per ``apply_fn``, emptied after every call) lets modules that convert
    the *same* input tensor the same way share one conversion: q, k and v projections entering
    rank-varying compute then have one all-reduce in the backward (their gradients add up before
    it), not three — the sum of the all-reduces is the all-reduce of the sum."""
    slots = [(name, pos, tuple(in_steps[key]), f"argument {name!r}",
              tuple((s.axis, s.forward, s.backward) for s in in_steps[key]))
             for key, name, pos in _arg_slots(inner, list(in_steps), fqn)]
    outs = [(0 if key == "output" else key, tuple(steps), "output" if key == "output" else f"output {key}")
            for key, steps in out_steps.items()]
    if not slots and not outs:  # nothing to convert: the local forward alone (often the module's own)
        if inner != module.forward:
            module.forward = inner
        return

    def convert(value, steps, what):
        if value is None:
            return value
        if not isinstance(value, Tensor):
            raise TypeError(f"{fqn} {what}: the plan places a tensor here, got {type(value).__name__}")
        try:
            return _run(steps, value)
        except ValueError as exc:  # a split/scatter that the input's shape cannot take (same on every rank)
            raise ShapeError(f"{fqn} {what} of shape {tuple(value.shape)} does not fit the plan: {exc}") from exc

    def convert_input(value, steps, what, signature):
        if shared is None or not isinstance(value, Tensor):
            return convert(value, steps, what)
        hit = shared.get((id(value), signature))
        if hit is not None and hit[0] is value:  # the value is held, so its id is not reused meanwhile
            return hit[1]
        out = convert(value, steps, what)
        shared[(id(value), signature)] = (value, out)
        return out

    def forward(*args, **kwargs):
        if slots:
            args = list(args)
            for name, pos, steps, what, signature in slots:
                if name in kwargs:
                    kwargs[name] = convert_input(kwargs[name], steps, what, signature)
                elif pos is not None and pos < len(args):
                    args[pos] = convert_input(args[pos], steps, what, signature)
        out = inner(*args, **kwargs)
        for index, steps, what in outs:
            if isinstance(out, Tensor) and index == 0:
                out = convert(out, steps, what)
            elif isinstance(out, tuple):
                out = (*out[:index], convert(out[index], steps, what), *out[index + 1 :])
            else:
                raise TypeError(f"{fqn}: the plan places output {index}, forward returned {type(out).__name__}")
        return out

    module.forward = forward
