"""Towers the example batch did not reach, traced on their own.

A vision-language model fine-tuned on text (no images in the batch) never calls its vision tower
or its projector, so a trace of that batch says nothing about them.  ``trace_towers`` finds the
modules with parameters that no traced call reached (``unreached``) and traces what takes images
or audio on an input built from the config (``analysis.media``): the model's own
``get_image_features`` / ``get_audio_features`` first (the tower and its projector, as the model
runs them), else the forward of an unreached module that takes a pixel or audio argument (a tower
alone).  Each candidate layout is tried in turn, the first that traces is kept, and its trace is
merged into the batch's, so the planner pairs the tower's projections exactly as it does when
the batch has images.  The model is only read; nothing here communicates.
"""

from __future__ import annotations

__all__ = ["trace_towers"]

import inspect
from collections.abc import Collection, Iterator

import torch
from torch import nn

from .media import AUDIO_KEYS, IMAGE_KEYS, audio_inputs, image_inputs
from .trace import ModelTrace, ModuleCall, trace_model

#: the model methods that run a modality's tower (and its projector), and that modality's arguments
GETTERS = (("get_image_features", IMAGE_KEYS), ("get_audio_features", AUDIO_KEYS))
#: the most input layouts tried per entry point
LAYOUTS = 8


def unreached(model: nn.Module, trace: ModelTrace, skip: Collection[str] = ()) -> list[str]:
    """The outermost modules holding parameters of which no module was called in ``trace``,
    outside ``skip`` (module paths, and what is below them: a base plan's, left as it is), in
    registration order."""
    reached, skip = _called_or_above(trace), set(skip)
    out: dict[str, None] = {}
    for path, m in model.named_modules():
        if path and path not in reached and not _below(path, skip) and not _below(path, out) and next(
                m.parameters(), None) is not None:
            out[path] = None
    return list(out)


def _called_or_above(trace: ModelTrace) -> set[str]:
    """Every module path the trace called, and every module that encloses one."""
    out: set[str] = set()
    for path in trace.calls:
        while path not in out:
            out.add(path)
            path = path.rpartition(".")[0]
    return out


def trace_towers(model: nn.Module, trace: ModelTrace, skip: Collection[str] = ()) -> tuple[ModelTrace, list[str]]:
    """``trace`` merged with a trace of each tower it did not reach (module docstring), and one
    note per tower: traced how, or why not (it stays unreached: the planner replicates it)."""
    pending = unreached(model, trace, skip)
    if not pending:
        return trace, []
    notes: list[str] = []
    failed: dict[str, str] = {}  # entry -> the first error of its layouts
    for entry, key, inputs in _entries(model, pending):
        todo = [p for p in pending if not _reached(p, trace)]
        if not todo:
            break
        if entry in pending and entry not in todo:
            continue
        found, why = _first_trace(model, entry, inputs)
        new = [p for p in todo if found is not None and _reached(p, found)]
        if new:
            trace = _merged(trace, found)
            notes.append(f"{', '.join(new)}: not reached by the example batch; traced on its own through "
                         f"{entry}({key}=...) on an input built from the config, and planned from that trace")
        elif found is None:
            failed[entry] = why
    for p in [p for p in pending if not _reached(p, trace)]:
        why = failed.get(p) or next((w for e, w in failed.items() if e not in pending), None)
        if why is not None:
            notes.append(f"{p}: not reached by the example batch, and tracing it on its own failed ({why}): left as "
                         "the batch's trace says (replicated); pass example_inputs that reach it to plan it")
    return trace, notes


def _below(path: str, scopes: Collection[str]) -> bool:
    """Whether ``path`` or one of its enclosing modules is in ``scopes``."""
    while path:
        if path in scopes:
            return True
        path = path.rpartition(".")[0]
    return False


def _reached(path: str, trace: ModelTrace) -> bool:
    return any(c == path or c.startswith(path + ".") for c in trace.calls)


def _entries(model: nn.Module, pending: list[str]) -> Iterator[tuple[str, str, Iterator[tuple[tuple, dict]]]]:
    """``(entry, its media argument, candidate inputs)``: the shallowest module's getter of each
    modality first, then each unreached module whose forward takes a media argument."""
    for name, keys in GETTERS:
        owner = next(((p, m) for p, m in model.named_modules() if callable(getattr(type(m), name, None))), None)
        if owner is not None:
            path, m = owner
            yield from _entry(model, m, f"{path}.{name}" if path else name, getattr(m, name), keys)
    modules = dict(model.named_modules())
    for path in pending:
        yield from _entry(model, modules[path], path, modules[path].forward, IMAGE_KEYS + AUDIO_KEYS)


def _entry(model: nn.Module, owner: nn.Module, entry: str, fn, keys: tuple[str, ...]):
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return
    key = next((k for k in keys if k in params), None)
    if key is not None:
        yield entry, key, _layouts(model, getattr(owner, "config", None) or getattr(model, "config", None), params, key)


def _layouts(model: nn.Module, config, params, key: str) -> Iterator[tuple[tuple, dict]]:
    """``((), kwargs)`` per candidate layout of ``key`` (``analysis.media``), only the arguments
    the entry takes; none without a config to build them from."""
    if config is None:
        return
    gen = torch.Generator().manual_seed(0)
    if key in AUDIO_KEYS:
        candidates = audio_inputs(config, params, key, gen)
    else:
        candidates = image_inputs(model, config, params, key, gen, video=key.endswith("videos"))
    for i, kwargs in enumerate(candidates):
        if i == LAYOUTS:
            return
        yield (), {k: v for k, v in kwargs.items() if k in params}


def _first_trace(model: nn.Module, entry: str, inputs) -> tuple[ModelTrace | None, str]:
    """The trace of ``entry`` on the first candidate input it runs on, else (None, the first error)."""
    first = ""
    for call in inputs:
        try:
            return trace_model(model, call, entry=entry), ""
        except Exception as exc:  # noqa: BLE001 - the next layout; the first error is the one reported
            first = first or f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    return None, first or "no input layout could be built from its config"


def _merged(a: ModelTrace, b: ModelTrace) -> ModelTrace:
    """One trace of both forwards: ``a``'s calls first, a module called in both with both calls' flow."""
    calls = dict(a.calls)
    for path, call in b.calls.items():
        mine = calls.get(path)
        calls[path] = call if mine is None else ModuleCall(
            mine.producers | call.producers, mine.first | call.first, mine.outputs | call.outputs,
            mine.main | call.main, mine.args, mine.kwargs, mine.count + call.count, mine.routed or call.routed,
            mine.opaque or call.opaque)
    return ModelTrace(calls, [*a.shape_calls, *b.shape_calls], a.output, [*a.assumed, *b.assumed],
                      [*a.routes, *b.routes], a.dispatch | b.dispatch, [*a.mixes, *b.mixes],
                      {k: a.param_users.get(k, set()) | b.param_users.get(k, set()) for k in {*a.param_users, *b.param_users}})
