"""Where a model's root forward computes, relative to its split points: traced on fake tensors
(``trace_root``), so that ``pipeline_split`` refuses, with a ``PlanError`` naming the operation, a split
that a stage boundary would get wrong (an operation between two layers, a layer fed anything but the
previous layer's output, layers whose other arguments differ by position).  See docs/pipeline.md.
"""

from __future__ import annotations

__all__ = ["RootTrace", "trace_root"]

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

from ..analysis.copies import meta_copy
from ..core.errors import PlanError

IDS = "input_ids"
_METADATA_ONLY = {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like,
                  torch.randn_like, Tensor.new_zeros, Tensor.new_ones, Tensor.new_empty, Tensor.new_full}
_VIEWS = {Tensor.__getitem__, Tensor.view, Tensor.reshape, torch.reshape, Tensor.contiguous, Tensor.clone,
          Tensor.to, Tensor.type_as, Tensor.view_as, Tensor.reshape_as, Tensor.float}
_HERE, _TORCH = str(Path(__file__).resolve()), str(Path(torch.__file__).resolve().parent)


@dataclass(frozen=True)
class RootTrace:
    """Where the root forward calls the split points other than the layers (``before`` the first
    layer, ``after`` the last, in call order) and its own operations on the data outside them:
    ``first`` before the first layer (the first stage's), ``last`` after the last (the last stage's)."""

    before: tuple[str, ...]
    after: tuple[str, ...]
    first: tuple[str, ...]
    last: tuple[str, ...]
    layer_args: tuple[tuple, ...] = ()  # per layer, what its other arguments are (``_Root.signature``)

    def check_offsets(self, name: str, starts: Sequence[int], counts: Sequence[int]) -> None:
        """A ``PlanError`` unless every stage's ``i``-th layer gets the arguments the model's
        ``i``-th layer gets: a stage runs the root's loop over its own layers only, so a root that
        picks a layer's inputs by the loop's index (Gemma 2's ``layer_types[i]`` masks) hands
        layer ``start + i`` the inputs of layer ``i``."""
        for start, count in zip(starts, counts, strict=True):
            for i in range(count):
                if self.layer_args and self.layer_args[start + i] != self.layer_args[i]:
                    which = sorted({k for k, _ in self.layer_args[start + i] ^ self.layer_args[i]}, key=str)
                    raise PlanError(f"pipeline_split: {name}'s layer {start + i} gets other arguments ({which}) than "
                                    f"layer {i}, and a stage starting at layer {start} would run it as the loop's "
                                    f"{i}-th layer; split where the layers' arguments repeat (layers=[...])")


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
    """Labels tensors during one forward under a ``TorchFunctionMode``; ``depth`` > 0 inside a split module.

    A tensor's labels: ``input_ids``, the split-point module whose output it derives from (a module's
    output starts afresh), and every operation outside those modules that computed on it.  Operations
    that return their input itself (``.to`` the same dtype) or an identical view, and ``*_like``/``new_*``
    factories (metadata only), add nothing, so positions, masks and rotary embeddings carry no label:
    they depend on shapes only."""

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


class _Root:
    """One traced forward's checks (``trace_root``): the hooks on the split modules of ``twin``."""

    def __init__(self, name: str, points: Sequence[str], layers: Sequence[str]):
        self.name, self.layers, self.tracer = name, list(layers), _Tracer()
        self.zone: dict[str, str] = {IDS: "first"}  # label -> "first" / "last" (a middle layer: none)
        self.order: list[str] = []  # the split points in call order (layers excluded)
        self.found: dict[str, set[str]] = {"first": set(), "last": set()}
        self.stack: list[str] = []  # the split modules running; left as it was where the forward raised
        self.called = 0  # layers called so far
        self.args: list[frozenset] = []  # per layer, its arguments other than the hidden states
        self.seen: dict[int, int] = {}  # tensor id -> its number among the layers' arguments
        self.points = [p for p in points if p not in self.layers]

    def zones(self, labels) -> set[str]:
        return {self.zone.get(x, x) for x in labels if not _is_op(x)}

    def refuse(self, what: str, labels) -> None:
        ops = [x for x in labels if _is_op(x)]
        how = f"through {_shown(ops)} in the root forward" if ops else "directly"
        source = _shown(x for x in labels if not _is_op(x)) or "nothing the previous stage hands on"
        raise PlanError(f"pipeline_split: in {self.name}'s forward, the {what} derives from {source} {how}; a stage "
                        f"boundary would skip or misplace it. Only operations before the first layer (first stage) "
                        f"or after the last layer (last stage) can be placed: move it into a module, or split "
                        f"elsewhere with plan=[...]")

    def check_layer(self, path: str, args: tuple, kwargs: dict) -> None:
        i, x, of = self.layers.index(path), _stream(args, kwargs), self.tracer.of
        if x is None:
            raise PlanError(f"pipeline_split: {self.name}'s layer {path!r} takes no hidden states as its first argument "
                            f"or hidden_states=, so a stage cannot hand it the previous stage's output")
        if i != self.called:
            raise PlanError(f"pipeline_split: {self.name}'s forward calls layer {path!r} out of order")
        got = of(x)
        if not (self.zones(got) == {"first"} if i == 0 else got == {self.layers[i - 1]}):
            self.refuse(f"input of layer {path!r}", got)
        if i == 0:
            self.found["first"].update(filter(_is_op, got))
        for k, v in [*enumerate(args), *kwargs.items()]:
            if v is not x and of(v):
                self.refuse(f"argument {k!r} of layer {path!r}", of(v))
        self.args.append(frozenset((k, self.signature(v)) for k, v in [*enumerate(args), *kwargs.items()] if v is not x))
        self.called += 1

    def signature(self, value) -> tuple:
        """What a layer argument is, comparably across layers: each tensor by identity (the same
        mask object for every layer, or one of several), other values by ``repr``."""
        out = []
        for leaf in _leaves(value):
            if isinstance(leaf, Tensor):
                self.tracer.keep.append(leaf)
                out.append(self.seen.setdefault(id(leaf), len(self.seen)))
            else:
                out.append(repr(leaf) if isinstance(leaf, (int, float, str, bool, type(None))) else type(leaf).__name__)
        return tuple(out)

    def check_point(self, path: str, args: tuple, kwargs: dict) -> None:
        if 0 < self.called < len(self.layers):
            raise PlanError(f"pipeline_split: {self.name}'s forward calls {path!r} between its layers; a split point "
                            f"runs before the first layer or after the last")
        where = "first" if not self.called else "last"
        got = self.tracer.of((args, kwargs))
        if self.zones(got) - {where}:
            self.refuse(f"input of {path!r}", got)
        self.found[where].update(filter(_is_op, got))
        self.zone[path] = where
        self.order.append(path)

    def hooks(self, twin: nn.Module) -> None:
        def pre(path):
            def hook(module, args, kwargs):
                if not self.tracer.depth:
                    (self.check_layer if path in self.layers else self.check_point)(path, args, kwargs)
                self.tracer.depth += 1
                self.stack.append(path)
            return hook

        def post(path):
            def hook(module, args, kwargs, output):
                self.tracer.depth -= 1
                self.stack.pop()
                if self.tracer.depth:
                    return output
                if path == self.layers[-1]:
                    self.zone[path] = "last"
                if isinstance(output, Tensor):
                    output = _alias(output)
                elif type(output) is tuple:
                    output = tuple(_alias(o) for o in output)
                    self.tracer.tag(output[1:], frozenset({f"{path} (other outputs)"}))
                    self.tracer.tag(output[0], frozenset({path}))
                    return output
                self.tracer.tag(output, frozenset({path}))
                return output
            return hook

        for path in [*self.points, *self.layers]:
            m = twin.get_submodule(path)
            m.register_forward_pre_hook(pre(path), with_kwargs=True)
            m.register_forward_hook(post(path), with_kwargs=True)

    def run(self, twin: nn.Module) -> None:
        """One forward of ``twin`` on fake ``input_ids`` (HF skips its data-dependent checks on
        fake tensors), then the check of its output (the logits)."""
        self.hooks(twin)
        with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True), self.tracer:
            ids = torch.zeros((2, 4), dtype=torch.long, device="meta")
            self.tracer.tag(ids, frozenset({IDS}))
            out = twin(input_ids=ids, use_cache=False)
        logits = out if isinstance(out, Tensor) else getattr(out, "logits", None)
        if logits is None and isinstance(out, (tuple, list)) and out:
            logits = out[0]
        got = self.tracer.of(logits)
        if self.zones(got) != {"last"}:
            self.refuse("output", got)
        self.found["last"].update(filter(_is_op, got))


def _stub(*args, **kwargs) -> Tensor:
    """A layer that returns a copy of its hidden states (the retry of a layer that fake tensors
    cannot run: the root's operations are traced, not the layers')."""
    return _stream(args, kwargs).clone()


def trace_root(model: nn.Module, points: Sequence[str], layers_path: str) -> RootTrace:
    """Where ``model``'s forward calls the split ``points`` and computes (``RootTrace``), or a
    ``PlanError`` naming an operation or input a stage boundary would get wrong.  A layer that
    fake tensors cannot run (a kernel without a meta implementation at this dtype) is replaced by
    a copy of its hidden states and the trace run again.  ``model`` is only read."""
    name = type(model).__name__
    layers = [f"{layers_path}.{i}" for i in range(len(model.get_submodule(layers_path)))]
    for stub in (False, True):
        root, twin = _Root(name, points, layers), meta_copy(model)
        if stub:
            for path in layers:
                twin.get_submodule(path).forward = _stub
        try:
            root.run(twin)
            break
        except PlanError:
            raise
        except Exception as exc:  # reported below, or retried with the layers stubbed
            if not stub and root.stack and root.stack[0] in layers:
                continue
            raise PlanError(f"pipeline_split: could not trace {name}'s forward on fake tensors to check where its "
                            f"operations run ({type(exc).__name__}: {exc})") from exc
    at = list(points).index(layers_path)  # a point the forward never called: where the module order puts it
    first = [p for p in root.order if root.zone[p] == "first"] + [p for p in points[:at] if p not in root.order]
    last = [p for p in root.order if root.zone[p] == "last"] + [p for p in points[at + 1:] if p not in root.order]
    rank = {op: i for i, op in enumerate(root.tracer.ops)}
    ops = [tuple(op.rpartition(" #")[0] for op in sorted(root.found[z], key=rank.get)) for z in ("first", "last")]
    return RootTrace(tuple(first), tuple(last), *ops, tuple(root.args))
