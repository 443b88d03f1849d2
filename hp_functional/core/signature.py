"""Where a boundary's keys sit in a forward call: argument slots by name or position, and
output 0 / tuple indices.  Used by the runtime's boundaries, lint and ``validate``'s DTensor
mode, so argument binding exists once."""

from __future__ import annotations

__all__ = ["ArgSlot", "arg_slots", "map_arguments", "map_output", "named_arguments", "output_index"]

import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from torch import Tensor, nn

from .errors import PlanError


class ArgSlot(NamedTuple):
    """A boundary key (argument name or position) bound to ``forward``'s signature: the keyword
    ``name`` it may be passed by and its ``position`` (None: keyword-only)."""

    key: object
    name: str | None
    position: int | None


def arg_slots(forward: Callable, keys: Sequence, fqn: str) -> list[ArgSlot]:
    """One ``ArgSlot`` per key; a PlanError naming ``fqn`` for an argument ``forward`` lacks."""
    signature = inspect.signature(forward).parameters.values()
    params = [p for p in signature if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    positional = [p for p in params if p.kind != p.KEYWORD_ONLY]
    has_var_kw = any(p.kind == p.VAR_KEYWORD for p in signature)
    slots = []
    for key in keys:
        if isinstance(key, int):
            if key >= len(positional):
                raise PlanError(f"{fqn}: forward has no positional argument {key}")
            slots.append(ArgSlot(key, positional[key].name, key))
            continue
        match = [i for i, p in enumerate(params) if p.name == key]
        if not match and not has_var_kw:
            raise PlanError(f"{fqn}: forward has no argument {key!r} (has {[p.name for p in params]})")
        pos = match[0] if match and params[match[0]].kind != params[match[0]].KEYWORD_ONLY else None
        slots.append(ArgSlot(key, key, pos))
    return slots


def map_arguments(slots: Sequence[ArgSlot], args: tuple, kwargs: dict, fn: Callable[[ArgSlot, Any], Any]) -> tuple[list, dict]:
    """``args``/``kwargs`` with ``fn(slot, value)`` applied to the value each slot was passed as
    (``kwargs`` is updated in place; slots not passed are left alone)."""
    args = list(args)
    for slot in slots:
        if slot.name in kwargs:
            kwargs[slot.name] = fn(slot, kwargs[slot.name])
        elif slot.position is not None and slot.position < len(args):
            args[slot.position] = fn(slot, args[slot.position])
    return args, kwargs


def named_arguments(module: nn.Module, args: tuple, kwargs: dict) -> dict:
    """``module``'s forward arguments by name, as its class's ``forward`` binds ``args`` and
    ``kwargs`` (its ``**kwargs`` flattened in): how a root entry reads the batch it is called with."""
    sig = inspect.signature(type(module).forward)
    bound = sig.bind(module, *args, **kwargs).arguments
    bound.pop(next(iter(sig.parameters)))
    extra = next((p.name for p in sig.parameters.values() if p.kind == p.VAR_KEYWORD), None)
    return {**{k: v for k, v in bound.items() if k != extra}, **bound.get(extra, {})}


def output_index(key: object) -> int:
    """A spec's output key as an index: ``"output"`` is the tensor itself or element 0 of a tuple."""
    return 0 if key == "output" else key


def map_output(out: Any, index: int, fn: Callable[[Any], Any], fqn: str, *, strict: bool = True) -> Any:
    """``out`` with ``fn`` applied to output ``index``; a TypeError naming ``fqn`` when there is
    no such output (``strict``), else ``out`` unchanged."""
    if isinstance(out, Tensor) and index == 0:
        return fn(out)
    if isinstance(out, tuple) and isinstance(index, int) and index < len(out):
        return (*out[:index], fn(out[index]), *out[index + 1 :])
    if strict:
        raise TypeError(f"{fqn}: the plan places output {index}, forward returned {type(out).__name__}")
    return out
