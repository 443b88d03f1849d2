"""Trace one forward of a meta copy of a model: who consumes whose output, and which integer
attributes of which module fed a ``view``/``reshape``/``split``.

``trace_model`` replaces every integer attribute of the copy by a ``TracedInt`` (an ``int`` that
remembers the attribute it came from) and records each tensor's source modules and every shape
call — provenance, not a comparison of values.  The user's model is only read; nothing here
communicates.  See docs/auto-plan.md#the-trace.
"""

from __future__ import annotations

__all__ = [
    "INPUT", "ModelTrace", "ModuleCall", "RESHAPES", "ShapeCall", "TracedInt", "_leaves", "_plain", "example_call",
    "fake_mode", "trace_model"
]

import contextlib
import inspect
import logging
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode

from ..core.errors import PlanError
from .copies import meta_copy, snapshot, to_meta

INPUT = "<input>"  # the source of the example inputs

SHAPE_OPS = {
    Tensor.view: "view", Tensor.reshape: "reshape", torch.reshape: "reshape", Tensor.unflatten: "unflatten",
    torch.unflatten: "unflatten", Tensor.split: "split", torch.split: "split", Tensor.split_with_sizes: "split",
    Tensor.chunk: "chunk", torch.chunk: "chunk", Tensor.__getitem__: "getitem",
}
#: ops that select by a learned score: a mixture of experts routes tokens with one of them (``ModelTrace.routes``).
ROUTING_OPS = {torch.topk: "topk", Tensor.topk: "topk", torch.argmax: "argmax", Tensor.argmax: "argmax",
               torch.argsort: "argsort", Tensor.argsort: "argsort", torch.sort: "sort", Tensor.sort: "sort"}
#: factories whose ints are a shape (``torch.zeros((1, self.n_heads, q, k))``: T5's position bias).
FACTORIES = {torch.zeros: "zeros", torch.ones: "ones", torch.empty: "empty", torch.full: "full", torch.arange: "arange"}
#: ops that combine the entries of a dim (by name: where its ``dim`` argument sits, None: always the last
#: dim): a colwise projection's output split there cannot pass through one (Granite Speech's CTC head:
#: ``softmax(out(h))`` fed to ``out_mid``).  Normalisation ops always combine the last dim.
MIXING_OPS = {
    **{f: ("softmax", 1) for f in (torch.softmax, Tensor.softmax, torch.nn.functional.softmax, torch.log_softmax,
                                   Tensor.log_softmax, torch.nn.functional.log_softmax)},
    **{f: ("reduce", 1) for f in (torch.sum, Tensor.sum, torch.mean, Tensor.mean, torch.amax, Tensor.amax,
                                  torch.logsumexp, Tensor.logsumexp, torch.cumsum, Tensor.cumsum, torch.var,
                                  Tensor.var, torch.std, Tensor.std)},
    torch.nn.functional.normalize: ("normalize", 2),
    **{f: ("norm", None) for f in (torch.nn.functional.layer_norm, torch.nn.functional.rms_norm,
                                   torch.nn.functional.group_norm)},
}
#: ops whose output features are new ones, contracted from two operands (a ``MIXING_OPS`` op after them
#: combines those, not a projection's)
CONTRACTIONS = {torch.matmul, Tensor.matmul, Tensor.__matmul__, Tensor.__rmatmul__, torch.bmm, Tensor.bmm, torch.mm,
                Tensor.mm, torch.einsum, torch.baddbmm, Tensor.baddbmm, torch.nn.functional.scaled_dot_product_attention}
RESHAPES = ("view", "reshape", "unflatten")  # calls whose ints are a shape
SPLITS = RESHAPES + ("split", "chunk")  # calls whose attribute ints must be local on the skeleton


class TracedInt(int):
    """An ``int`` that remembers the ``(module path, attribute)`` pairs it was computed from."""

    tags: frozenset[tuple[str, str]]

    def __new__(cls, value: int, tags) -> TracedInt:
        obj = int.__new__(cls, value)
        obj.tags = frozenset(tags)
        return obj

    def __reduce__(self):
        return TracedInt, (int(self), self.tags)


def _arith(name: str):
    def op(self, *other):
        out = getattr(int, name)(self, *other)
        if type(out) is not int:  # NotImplemented, a float, a bool
            return out
        return TracedInt(out, self.tags.union(*(getattr(o, "tags", ()) for o in other)))
    return op


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__floordiv__", "__rfloordiv__",
              "__mod__", "__rmod__", "__neg__", "__abs__", "__pos__"):
    setattr(TracedInt, _name, _arith(_name))


def _leaves(obj):
    """The leaves of nested tuples, lists, dicts and slices."""
    if isinstance(obj, (tuple, list)):
        return [x for o in obj for x in _leaves(o)]
    if isinstance(obj, dict):
        return [x for o in obj.values() for x in _leaves(o)]
    if isinstance(obj, slice):
        return [obj.start, obj.stop, obj.step]
    return [obj]


def _plain(obj):
    """``obj`` with every ``TracedInt`` as a plain int (what torch is given)."""
    if isinstance(obj, TracedInt):
        return int(obj)
    if isinstance(obj, (tuple, list)) and not isinstance(obj, torch.Size):
        return type(obj)(_plain(o) for o in obj) if type(obj) in (tuple, list) else obj
    if isinstance(obj, dict) and type(obj) is dict:
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, slice):
        return slice(_plain(obj.start), _plain(obj.stop), _plain(obj.step))
    return obj


@dataclass(frozen=True)
class ShapeCall:
    """One shape call: the innermost running ``module``, the ``op``, the ``(owner, attribute)``
    pairs whose traced ints were among its arguments, the sources of its input, its input shape
    and its output shapes (one per output tensor)."""

    module: str
    op: str
    attrs: frozenset[tuple[str, str]]
    sources: frozenset[str]
    shape_in: tuple[int, ...]
    shapes_out: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class RouteOp:
    """A routing op (``ROUTING_OPS``) on a module-computed score: the innermost running
    ``module``, the ``op`` and the ``sources`` of the scores."""

    module: str
    op: str
    sources: frozenset[str]


@dataclass
class ModuleCall:
    """What a module's calls saw: ``producers`` of all its tensor inputs, ``first`` those of its
    first tensor argument, the first call's ``args``/``kwargs`` (meta tensors, for ``auto_audit.record``) and
    the sources of its outputs (before they are re-tagged as its own)."""

    producers: set[str] = field(default_factory=set)
    first: set[str] = field(default_factory=set)
    outputs: set[str] = field(default_factory=set)
    main: set[str] = field(default_factory=set)  # those of its first output tensor (hidden states, not extras)
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    count: int = 0
    routed: bool = False  # an input derives from a routing op's result (a token-to-expert dispatch)
    opaque: bool = False  # its forward failed on routed data; the trace went on with a stand-in output


class _Tracer(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.sources: dict[int, frozenset[str]] = {}
        self.keep: list[Tensor] = []  # pins every tensor seen, so ids stay unique
        self.stack: list[str] = []
        self.shape_calls: list[ShapeCall] = []
        self.assumed: list[str] = []  # data-dependent checks taken as True (see ``ModelTrace.assumed``)
        self.routed: set[int] = set()  # ids of tensors derived from a routing op's result
        self.routes: list[RouteOp] = []
        self.dispatch: set[str] = set()  # modules in which an op took routed data
        self.failed_routed: str | None = None  # where the last op that raised took routed data
        self.mixes: list[ShapeCall] = []  # ops that combined the entries of their input's last dim
        #: id of a tensor -> the modules whose output features reach it with no contraction on the way
        #: (a matmul with another tensor makes new features: GroupViT's ``attn = q @ k^T`` is no q_proj output)
        self.direct: dict[int, frozenset[str]] = {}
        self.param_names: dict[int, list[str]] = {}  # id of each traced parameter -> its FQNs (set by ``_trace``)
        self.param_users: dict[str, set[str]] = {}  # parameter FQN -> the innermost modules of the ops that took it

    def src(self, obj) -> frozenset[str]:
        return frozenset().union(*(self.sources.get(id(t), ()) for t in _leaves(obj) if isinstance(t, Tensor)))

    def tag(self, obj, sources: frozenset[str]) -> None:
        for t in _leaves(obj):
            if isinstance(t, Tensor):
                self.keep.append(t)
                self.sources[id(t)] = sources
                self.direct[id(t)] = sources

    def features_of(self, obj) -> frozenset[str]:
        """The modules whose output features reach ``obj`` with no contraction on the way (``direct``)."""
        return frozenset().union(*(self.direct.get(id(t), ()) for t in _leaves(obj) if isinstance(t, Tensor)))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (Tensor.__bool__, Tensor.item) and _meta_flag(args[0] if args else None):
            self.assumed.append(self.stack[-1] if self.stack else "")
            return True  # a one-element boolean on meta: "no padding", "all positions valid"
        routed = [t for t in _leaves((args, kwargs)) if isinstance(t, Tensor) and id(t) in self.routed]
        try:
            out = func(*_plain(args), **_plain(kwargs))
        except Exception:
            self.failed_routed = (self.stack[-1] if self.stack else "") if routed else None
            raise
        sources = self.src((args, kwargs))
        for t in _leaves((args, kwargs)):
            for name in self.param_names.get(id(t), ()) if isinstance(t, nn.Parameter) else ():
                self.param_users.setdefault(name, set()).add(self.stack[-1] if self.stack else "")
        outs = [t for t in _leaves(out) if isinstance(t, Tensor)]
        direct = frozenset() if func in CONTRACTIONS else self.features_of((args, kwargs))
        for t in outs:
            self.keep.append(t)
            self.sources[id(t)] = sources | self.sources.get(id(t), frozenset())
            self.direct[id(t)] = direct | self.direct.get(id(t), frozenset())
        route = ROUTING_OPS.get(func)
        selects = any(not t.is_floating_point() for t in routed)  # routed indices or masks select data
        if route and sources - {INPUT}:  # a selection by a score some module computed (not by the input ids)
            self.routes.append(RouteOp(self.stack[-1] if self.stack else "", route, sources))
            selects = True
        if selects:  # values computed from routed values are not routed themselves: the taint stays local
            self.routed.update(id(t) for t in outs)
            if self.stack:
                self.dispatch.add(self.stack[-1])
        if func in FACTORIES and outs:
            attrs = frozenset().union(*(x.tags for x in _leaves((args, kwargs)) if isinstance(x, TracedInt)))
            if attrs:
                self.shape_calls.append(ShapeCall(self.stack[-1] if self.stack else "", FACTORIES[func], attrs,
                                                  frozenset(), (), (tuple(outs[0].shape),)))
        if func in MIXING_OPS and args and isinstance(args[0], Tensor) and _mixes_last(func, args, kwargs):
            self.mixes.append(ShapeCall(self.stack[-1] if self.stack else "", MIXING_OPS[func][0], frozenset(),
                                        self.features_of(args[0]), tuple(args[0].shape),
                                        tuple(tuple(t.shape) for t in outs)))
        op = SHAPE_OPS.get(func)
        if op and args and isinstance(args[0], Tensor):
            attrs = frozenset().union(*(x.tags for x in _leaves((args[1:], kwargs)) if isinstance(x, TracedInt)))
            self.shape_calls.append(ShapeCall(self.stack[-1] if self.stack else "", op, attrs, self.src(args[0]),
                                              tuple(args[0].shape), tuple(tuple(t.shape) for t in outs)))
        return out


def _mixes_last(func, args: tuple, kwargs: dict) -> bool:
    """Whether a ``MIXING_OPS`` call combines its input's last dim (its ``dim``: None or the last)."""
    position = MIXING_OPS[func][1]
    if position is None:
        return True
    dim = kwargs.get("dim", args[position] if len(args) > position else None)
    if dim is None and func is torch.nn.functional.normalize:
        dim = 1  # its default
    if dim is None:
        return True  # a reduction over every dim
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    ndim = args[0].dim()
    return any(isinstance(d, int) and ndim and d % ndim == ndim - 1 for d in dims)


def _meta_flag(t) -> bool:
    return (isinstance(t, Tensor) and (t.device.type == "meta" or isinstance(t, FakeTensor)) and t.dtype == torch.bool
            and t.numel() == 1)


@dataclass
class ModelTrace:
    """One traced forward: ``calls`` per module path (in call order), every ``ShapeCall``, the
    model's meta ``output``, and ``assumed``: the modules in which a one-element boolean was
    asked for its value (``bool(mask.sum() == mask.numel())``, ``flag.item()``) — a meta tensor
    has none, so the trace takes it as True (no padding, every position valid: the input it
    synthesizes has none); any other value (``.item()`` of a number) still stops the trace.
    ``routes`` are the routing ops on module-computed scores (top-k of a router) and ``dispatch``
    the modules in which an op took indices or masks derived from one (the per-expert dispatch):
    a mixture of experts is found from these, never from a name."""

    calls: dict[str, ModuleCall]
    shape_calls: list[ShapeCall]
    output: object = None
    assumed: list[str] = field(default_factory=list)
    routes: list[RouteOp] = field(default_factory=list)
    dispatch: set[str] = field(default_factory=set)
    #: the ops that combined the entries of their input's last dim (``MIXING_OPS``), as shape calls
    mixes: list[ShapeCall] = field(default_factory=list)
    #: parameter FQN -> the innermost modules running the ops that took it (its own module's forward,
    #: or another module reading it: a weight read outside its layer cannot be split by its module's style)
    param_users: dict[str, set[str]] = field(default_factory=dict)

    def shape_attrs(self) -> dict[str, frozenset[str]]:
        """Per module path, its integer attributes that fed a view/reshape/unflatten/split/chunk."""
        out: dict[str, set[str]] = {}
        for c in self.shape_calls:
            if c.op in SPLITS:
                for owner, attr in c.attrs:
                    out.setdefault(owner, set()).add(attr)
        return {k: frozenset(v) for k, v in out.items()}

    @cached_property
    def consumers(self) -> dict[str, set[str]]:
        """Per module path, the modules that took (something derived from) its output as input."""
        out: dict[str, set[str]] = {}
        for path, call in self.calls.items():
            for p in call.producers:
                out.setdefault(p, set()).add(path)
        return out

    def producers(self, path: str) -> set[str]:
        """The modules whose outputs ``path``'s inputs derive from (``INPUT``: the example inputs)."""
        return self.calls[path].producers if path in self.calls else set()


#: the most parameter and buffer bytes ``trace_model``'s last fallback copies onto the CPU with values
REAL_TRACE_BYTES = 1 << 30


def trace_model(model: nn.Module, inputs: tuple[tuple, dict], entry: str = "") -> ModelTrace:
    """One forward of a meta copy of ``model`` on ``inputs`` (``(args, kwargs)``, moved to meta)
    with the recording described in docs/auto-plan.md#the-trace; ``entry``: what of the copy to
    call instead of its forward, by attribute path (a submodule, ``"model.visual"``, or a method,
    ``"get_image_features"``: a tower the example batch did not reach, ``analysis.towers``), its
    modules recorded under their paths in ``model``.  Code that refuses meta tensors (flex
    attention checks the device) is traced again on fake CPU tensors (``FakeTensorMode``: shapes
    and devices, no storage, nothing computed).  Code whose control flow reads values
    (``lengths.max().item()``, ``mask.nonzero()``) is traced last on a CPU copy with values (the
    model's own, zeros for meta ones), when its parameters and buffers take at most
    ``REAL_TRACE_BYTES``; the meta error is raised if every trace fails."""
    try:
        return _trace(model, inputs, "meta", entry=entry)
    except Exception as meta_error:
        if "meta" in str(meta_error):  # a refusal of the meta device: fake tensors may run
            try:
                with fake_mode(True) as device:
                    return _trace(model, inputs, device, entry=entry)
            except Exception:  # noqa: BLE001 - the meta failure is the one to report
                pass
        if _nbytes(model) <= REAL_TRACE_BYTES:
            try:
                return _trace(model, inputs, "cpu", values=True, entry=entry)
            except Exception:  # noqa: BLE001 - the meta failure is the one to report
                pass
        raise meta_error from None


def _nbytes(model: nn.Module) -> int:
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


@contextlib.contextmanager
def fake_mode(fake: bool):
    """The device to trace on: "meta", or with ``fake`` "cpu" under a ``FakeTensorMode`` (tensors
    without storage whose device is real), torch.compile'd code run eagerly (Dynamo would
    otherwise trace the recording mode: HF's flex attention is compiled).  The mode's dispatch cache
    is off: it is shared across modes, and an entry from an earlier trace at other shapes made a
    later replay fail."""
    if not fake:
        yield "meta"
        return
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    mode.cache_enabled = False
    log = logging.getLogger("torch._subclasses.fake_tensor")  # it logs an op's failure before raising it
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        with torch.compiler.set_stance("force_eager"), mode:
            yield "cpu"
    finally:
        log.setLevel(level)


def _trace(model: nn.Module, inputs: tuple[tuple, dict], device: str, values: bool = False,
           entry: str = "") -> ModelTrace:
    twin = meta_copy(model, device=device, values=values)
    for path, m in twin.named_modules():
        for attr, value in list(vars(m).items()):
            if type(value) is int:
                setattr(m, attr, TracedInt(value, {(path, attr)}))
    tracer, calls = _Tracer(), {}
    for name, prm in twin.named_parameters(remove_duplicate=False):
        tracer.param_names.setdefault(id(prm), []).append(name)
    aliases: dict[int, list[str]] = {}  # a parameterless module registered under several paths (XLM's one act)
    for path, m in twin.named_modules(remove_duplicate=False):
        if next(m.parameters(), None) is None:
            aliases.setdefault(id(m), []).append(path)

    def pre(registered):
        def hook(module, args, kwargs):
            caller = tracer.stack[-1] if tracer.stack else None
            path = next((p for p in aliases.get(id(module), ()) if p.rpartition(".")[0] == caller), registered)
            call = calls.setdefault(path, ModuleCall())
            first = next((t for t in _leaves((args, kwargs)) if isinstance(t, Tensor)), None)
            call.routed |= any(id(t) in tracer.routed for t in _leaves((args, kwargs)) if isinstance(t, Tensor))
            call.producers |= tracer.src((args, kwargs))
            call.first |= tracer.src(first)
            if not call.count:  # a snapshot: a cache the call updates is replayed as it was
                call.args, call.kwargs = snapshot((args, dict(kwargs)))
            call.count += 1
            tracer.stack.append(path)
        return hook

    def post():
        def hook(module, args, kwargs, output):
            path = tracer.stack.pop()
            calls[path].outputs |= tracer.src(output)
            calls[path].main |= tracer.src(next((t for t in _leaves(output) if isinstance(t, Tensor)), None))
            if _transparent(module):  # its output keeps its ops' sources: the flow runs through it
                return output
            if isinstance(output, Tensor):
                output = output.view_as(output)  # a fresh alias: the producer's own tag stays on the original
            elif type(output) is tuple:
                output = tuple(o.view_as(o) if isinstance(o, Tensor) else o for o in output)
            tracer.tag(output, frozenset({path}))
            return output
        return hook

    handles = []
    for path, m in twin.named_modules():
        handles.append(m.register_forward_pre_hook(pre(path), with_kwargs=True))
        handles.append(m.register_forward_hook(post(), with_kwargs=True))
        if _holds_experts(m):
            m.forward = _stand_in_on_routed_failure(m.forward, path, tracer, calls)
    args, kwargs = to_meta(inputs[0], device, values), to_meta(inputs[1], device, values)
    tracer.tag((args, kwargs), frozenset({INPUT}))
    run = operator.attrgetter(entry)(twin) if entry else twin
    with torch.no_grad(), tracer:
        output = run(*args, **kwargs)
    for h in handles:
        h.remove()
    return ModelTrace(calls, tracer.shape_calls, output, tracer.assumed, tracer.routes, tracer.dispatch, tracer.mixes,
                      tracer.param_users)


def _transparent(module: nn.Module) -> bool:
    """A leaf module without parameters or buffers (an activation, dropout, ``Identity``, DropPath):
    a function of its inputs alone, so its output is traced as its ops' output rather than as a
    node of its own.  One such module run twice in a block (dropout after the activation and after
    the MLP) would otherwise join two flows into one node, and stop both."""
    return (next(module.children(), None) is None and next(module.parameters(), None) is None
            and next(module.buffers(), None) is None)


def _holds_experts(module: nn.Module) -> bool:
    """Whether ``module`` could hold experts: stacked (3-D or larger, not convolution) weights of
    its own, or an ``nn.ModuleList`` child of at least two modules of one type with parameters."""
    if not isinstance(module, nn.modules.conv._ConvNd) and any(p.dim() >= 3 for p in module.parameters(recurse=False)):
        return True
    return any(isinstance(c, nn.ModuleList) and len(c) > 1 and len({type(x) for x in c}) == 1
               and any(True for _ in c.parameters()) for c in module.children())


def _stand_in_on_routed_failure(forward, path: str, tracer: _Tracer, calls: dict):
    """``forward`` of a module of the meta copy that may hold experts: when it fails on data a
    router selected (the per-expert dispatch reads the routing on the host: ``nonzero``, grouped
    matmuls without meta kernels), the trace goes on with an empty stand-in shaped like its first
    tensor argument (the tokens the experts return), and the call is marked ``opaque``."""
    def run(*args, **kwargs):
        depth = len(tracer.stack)
        try:
            return forward(*args, **kwargs)
        except Exception:
            first = next((t for t in _leaves((args, kwargs)) if isinstance(t, Tensor)), None)
            failed, call = tracer.failed_routed, calls[path]
            if failed is None or first is None or not (call.routed or failed == path):
                raise
            del tracer.stack[depth:]
            call.opaque, tracer.failed_routed = True, None
            return torch.zeros_like(first)
    return run



def example_call(model: nn.Module, example_inputs=None) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of one forward: ``example_inputs`` (a tensor, a tuple of arguments or a
    dict of keyword arguments), else ``input_ids`` of shape (1, 8) when the model starts with an
    ``nn.Embedding`` (and as ``decoder_input_ids`` too where the forward takes them: an
    encoder-decoder); a ``PlanError`` otherwise."""
    if example_inputs is None:
        first = next((m for m in model.modules() if any(True for _ in m.parameters(recurse=False))), None)
        if not isinstance(first, nn.Embedding):
            raise PlanError(f"auto_plan: {type(model).__name__} does not start with an nn.Embedding; pass "
                            "example_inputs=(...) that its forward takes")
        ids = torch.zeros(1, 8, dtype=torch.long)
        params = inspect.signature(model.forward).parameters
        if "input_ids" not in params:
            return (ids,), {}
        if "decoder_input_ids" in params:  # an encoder-decoder: run both stacks
            return (), {"input_ids": ids, "decoder_input_ids": ids}
        return (), {"input_ids": ids}
    if isinstance(example_inputs, Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    return tuple(example_inputs), {}
