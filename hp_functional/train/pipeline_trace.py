"""Where a model's root forward computes, relative to its split points: traced on meta tensors.

A pipeline stage hands its last decoder layer's output to the next stage, whose first layer
takes it (``pipeline.StageLayers``).  So what the root forward computes on the data between the
embedding and the first layer runs on the first stage only, what it computes after the last
layer on the last stage only (Granite's embedding multiplier, Cohere's and Granite's logit
scales), and that is exact.  What it computes *between* two layers, or a layer fed anything but
the previous layer's output (the embeddings, values of ``input_ids``), would be skipped or wrong
at a stage boundary: ``trace_root`` refuses it with a ``PlanError`` naming the operation.

The trace runs one forward of a meta copy of the model on fake ``input_ids`` under a
``TorchFunctionMode``.  Every tensor carries labels: ``input_ids``, the split-point module whose
output it derives from (a module's output starts afresh), and every operation outside those
modules that computed on it.  Operations that return their input itself (``.to`` the same
dtype) or an identical view, and ``*_like``/``new_*`` factories (metadata only), add nothing.
Positions, masks and rotary embeddings then carry no label, since they depend on shapes only.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

from ..core.errors import PlanError
from ..plan.trace import meta_copy

IDS = "input_ids"
_METADATA_ONLY = {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like,
                  torch.randn_like, Tensor.new_zeros, Tensor.new_ones, Tensor.new_empty, Tensor.new_full}
_VIEWS = {Tensor.__getitem__, Tensor.view, Tensor.reshape, torch.reshape, Tensor.contiguous, Tensor.clone,
          Tensor.to, Tensor.type_as, Tensor.view_as, Tensor.reshape_as, Tensor.float}
_HERE, _TORCH = str(Path(__file__).resolve()), str(Path(torch.__file__).resolve().parent)


@dataclass(frozen=True)
class RootOps:
    """The root forward's operations on the data outside the split modules: ``first`` run before
    the first layer (the first stage's), ``last`` after the last layer (the last stage's)."""

    first: tuple[str, ...]
    last: tuple[str, ...]


def _leaves(obj) -> list:
    if isinstance(obj, (tuple, list)):
        return [x for o in obj for x in _leaves(o)]
    if isinstance(obj, dict):
        return [x for o in obj.values() for x in _leaves(o)]
    return [obj]


def _where() -> str:
    """``file.py:line`` of the innermost caller outside torch and this file."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH) or frame.f_code.co_filename == _HERE):
        frame = frame.f_back
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}" if frame is not None else "?"


def _identical(func, args, out) -> bool:
    """``out`` is ``args[0]``'s values unchanged: ``func`` returned it, or an identical view/copy."""
    x = args[0] if args else None
    if not isinstance(x, Tensor) or not isinstance(out, Tensor):
        return False
    return out is x or (func in _VIEWS and out.shape == x.shape and out.dtype == x.dtype
                        and out.stride() == x.stride() and out.storage_offset() == x.storage_offset())


class _Tracer(TorchFunctionMode):
    """Labels tensors (see the module docstring); ``depth`` > 0 inside a split module."""

    def __init__(self):
        super().__init__()
        self.labels: dict[int, frozenset[str]] = {}
        self.keep: list[Tensor] = []  # pins every labelled tensor, so ids stay unique
        self.depth = 0
        self.ops: list[str] = []

    def of(self, obj) -> frozenset[str]:
        return frozenset().union(*(self.labels.get(id(t), ()) for t in _leaves(obj) if isinstance(t, Tensor)))

    def tag(self, obj, labels: frozenset[str]) -> None:
        for t in _leaves(obj):
            if isinstance(t, Tensor):
                self.keep.append(t)
                self.labels[id(t)] = labels

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.depth or func in _METADATA_ONLY:
            return out
        labels = self.of((args, kwargs))
        if not labels or not any(isinstance(t, Tensor) for t in _leaves(out)):
            return out
        if _identical(func, args, out):
            self.tag(out, self.labels.get(id(args[0]), labels))
            return out
        name = f"{getattr(func, '__name__', str(func)).strip('_')} at {_where()} #{len(self.ops)}"
        self.ops.append(name)
        self.tag(out, labels | {name})
        return out


def _stream(args: tuple, kwargs: dict) -> Tensor | None:
    """A decoder layer's hidden states: its first positional argument or ``hidden_states=``."""
    first = args[0] if args else kwargs.get("hidden_states")
    return first if isinstance(first, Tensor) else None


def _is_op(label: str) -> bool:
    """An operation's label (``"mul at modeling_granite.py:388 #3"``), not a module's or ``input_ids``."""
    return " #" in label


def _shown(labels) -> str:
    return ", ".join(sorted(repr(x.rpartition(" #")[0] if _is_op(x) else x) for x in labels))


def _alias(t):
    """A fresh alias of a module's output tensor, so that its label does not overwrite another's."""
    return t.view_as(t) if isinstance(t, Tensor) else t


def trace_root(model: nn.Module, before: Sequence[str], layers_path: str, after: Sequence[str]) -> RootOps:
    """The root forward's extra operations by stage (``RootOps``), or a ``PlanError`` naming an
    operation or input a stage boundary would get wrong.  ``model`` is only read."""
    name = type(model).__name__
    n = len(model.get_submodule(layers_path))
    layer = [f"{layers_path}.{i}" for i in range(n)]
    ends = {p: "first" for p in before} | {p: "last" for p in after}
    tracer = _Tracer()
    zone: dict[str, str] = {IDS: "first", **ends, layer[-1]: "last"}
    found: dict[str, set[str]] = {"first": set(), "last": set()}

    def zones(labels) -> set[str]:
        out = set()
        for x in labels:
            if x in zone:
                out.add(zone[x])
            elif not _is_op(x):
                out.add(x)  # a middle layer's output
        return out

    def refuse(what: str, labels) -> None:
        ops = [x for x in labels if _is_op(x)]
        how = f"through {_shown(ops)} in the root forward" if ops else "directly"
        source = _shown(x for x in labels if not _is_op(x))
        raise PlanError(f"pipeline_split: in {name}'s forward, the {what} derives from {source} {how}; a stage "
                        f"boundary would skip or misplace it. Only operations before the first layer (first stage) "
                        f"or after the last layer (last stage) can be placed: move it into a module, or split "
                        f"elsewhere with plan=[...]")

    def check(path: str, args: tuple, kwargs: dict) -> None:
        if path in layer:
            i = layer.index(path)
            x = _stream(args, kwargs)
            if x is None:
                raise PlanError(f"pipeline_split: {name}'s layer {path!r} takes no hidden states as its first argument "
                                f"or hidden_states=, so a stage cannot hand it the previous stage's output")
            got = tracer.of(x)
            ok = zones(got) == {"first"} if i == 0 else got == {f"{layer[i - 1]}"}
            if not ok:
                refuse(f"input of layer {path!r}", got)
            if i == 0:
                found["first"].update(filter(_is_op, got))
            for k, v in [*enumerate(args), *kwargs.items()]:
                if v is not x and tracer.of(v):
                    refuse(f"argument {k!r} of layer {path!r}", tracer.of(v))
        else:
            got = tracer.of((args, kwargs))
            if zones(got) - {ends[path]}:
                refuse(f"input of {path!r}", got)
            found[ends[path]].update(filter(_is_op, got))

    def pre(path):
        def hook(module, args, kwargs):
            if not tracer.depth:
                check(path, args, kwargs)
            tracer.depth += 1
        return hook

    def post(path):
        def hook(module, args, kwargs, output):
            tracer.depth -= 1
            if tracer.depth:
                return output
            if isinstance(output, Tensor):
                output = _alias(output)
                tracer.tag(output, frozenset({path}))
            elif type(output) is tuple:
                output = tuple(_alias(o) for o in output)
                tracer.tag(output[1:], frozenset({f"{path} (other outputs)"}))
                tracer.tag(output[0], frozenset({path}))
            else:
                tracer.tag(output, frozenset({path}))
            return output
        return hook

    twin = meta_copy(model)
    for path in [*before, *layer, *after]:
        m = twin.get_submodule(path)
        m.register_forward_pre_hook(pre(path), with_kwargs=True)
        m.register_forward_hook(post(path), with_kwargs=True)
    fake = FakeTensorMode(allow_non_fake_inputs=True)  # HF skips its data-dependent checks on fake tensors
    try:
        with torch.no_grad(), fake, tracer:
            ids = torch.zeros((2, 4), dtype=torch.long, device="meta")
            tracer.tag(ids, frozenset({IDS}))
            out = twin(input_ids=ids, use_cache=False)
    except PlanError:
        raise
    except Exception as exc:
        raise PlanError(f"pipeline_split: could not trace {name}'s forward on meta tensors to check where its "
                        f"operations run ({type(exc).__name__}: {exc})") from exc
    logits = out if isinstance(out, Tensor) else getattr(out, "logits", None)
    if logits is None and isinstance(out, (tuple, list)) and out:
        logits = out[0]
    got = tracer.of(logits)
    if zones(got) != {"last"}:
        refuse("output", got)
    found["last"].update(filter(_is_op, got))
    order = {op: i for i, op in enumerate(tracer.ops)}
    return RootOps(*(tuple(op.rpartition(" #")[0] for op in sorted(found[z], key=order.get)) for z in ("first", "last")))
