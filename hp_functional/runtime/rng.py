"""``hpf.rng(seed)``: random ops that draw by *global* element index, whatever the layout.

``with hpf.rng(seed):`` pushes an ``Rng``, a ``TorchFunctionMode``.  Inside the block every
dropout (``F.dropout``, ``nn.Dropout``, the ``dropout_p`` of ``scaled_dot_product_attention``)
and every ``torch.rand``/``randn``/``rand_like``/``randn_like``/``bernoulli``/``normal`` and
``Tensor.uniform_``/``normal_``/``bernoulli_`` draws from the counter-based generator of
``core.counter_rng``: the k-th random op of the block reads stream ``(seed, k)`` at the global
index of each element, so the unsharded model and ``apply_fn`` at any layout draw the same
values.  Any other random op raises ``PlanError`` inside the block (its values would come from
torch's per-rank generator).

The mapping from a local element to its global index: outside an ``apply_fn`` call every tensor
is whole (a plain module call).  An ``apply_fn`` call (``ApplyFn.__call__`` hands itself to the
active ``Rng``: torch's mode stack is the one channel) opens a scope; its random ops are matched
in order with a layout table computed once per (runtime, argument shapes) from two meta runs of
the skeleton on the call's own argument shapes: at global shapes, and at local shapes with every
planned module's boundaries applied (the shape audit's ``Handoff``).  A dim the local op divides
by ``f`` over the plan's one split axis is that axis's contiguous chunk ``coord // (n // f)``
(Colwise heads and features, sequence parallelism, KV-head groups).  Data axes (``hpf.fsdp``'s,
or ``data_axes=``) add the batch convention: dim 0 is the batch, rank ``i`` of the data axes holds
global examples ``[i * b, (i + 1) * b)``; a third meta run at twice the batch checks that each
random op's dim 0 is that batch.  What cannot be mapped is refused by name when drawn: context
parallelism (zigzag sequence chunks), several split axes, a division on two dims, random ops
inside blocks recomputed in the backward, a meta run that fails.  See docs/randomness.md.
"""

from __future__ import annotations

__all__ = ["Rng", "active_rng", "rng"]

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from ..core.counter_rng import global_index, keep_mask, normal, stream_key, uniform
from ..core.errors import PlanError
from ..core.facets import flat_index
from ..core.signature import arg_slots, map_arguments
from ..plan.auto_audit import boundaries, handoff
from ..plan.context import ContextParallel
from ..plan.trace import _snapshot, _to_meta, meta_copy


class _Draw(NamedTuple):
    """One random op about to draw: its name, the shape of the values it draws, and why
    ``hpf.rng`` refuses it ("" when it does not)."""

    name: str
    shape: tuple[int, ...]
    refused: str = ""


class _Source:
    """The values of one draw: stream ``key`` at the global indices of a local box."""

    def __init__(self, key: int, local: Sequence[int], glob: Sequence[int], offset: Sequence[int]):
        self.key, self.local, self.glob, self.offset = key, tuple(local), tuple(glob), tuple(offset)

    def index(self, device) -> Tensor:
        return global_index(self.local, self.glob, self.offset, device)

    def uniform(self, dtype: torch.dtype, device) -> Tensor:
        return uniform(self.key, self.index(device), dtype)

    def normal(self, dtype: torch.dtype, device) -> Tensor:
        return normal(self.key, self.index(device), dtype)

    def keep(self, p: float, device) -> Tensor:
        return keep_mask(self.key, self.index(device), p)


Run = Callable[[_Source], object]
Handler = Callable[[tuple, dict], tuple[_Draw | None, Run | None]]


# ---------------------------------------------------------------- the random ops
def _bind(stub: Callable, args: tuple, kwargs: dict) -> list:
    bound = inspect.signature(stub).bind(*args, **kwargs)
    bound.apply_defaults()
    return list(bound.arguments.values())


def _no_generator(name: str, kwargs: Mapping) -> str:
    if kwargs.get("generator") is not None:
        return f"{name}(generator=...) draws from that generator, not by global index; drop generator="
    if kwargs.get("out") is not None:
        return f"{name}(out=...) is not supported under hpf.rng; assign the result instead"
    return ""


def _dropout_stub(input, p=0.5, training=True, inplace=False):
    """``F.dropout``'s signature (for binding its arguments)."""


def _torch_dropout_stub(input, p, train):
    """``torch.dropout``'s signature."""


def _dropout(stub: Callable, torch_form: bool) -> Handler:
    def handler(args, kwargs):
        x, p, training, *rest = _bind(stub, args, kwargs)
        inplace = bool(rest and rest[0]) and not torch_form
        if not training or not isinstance(x, Tensor) or not 0 < p < 1:
            return None, None  # eval, p 0 (identity) or 1 (zeros), or torch's own error: torch's dropout

        def run(src: _Source):
            noise = src.keep(p, x.device).to(x.dtype).div_(1 - p)
            return x.mul_(noise) if inplace else x * noise
        return _Draw("dropout", tuple(x.shape)), run
    return handler


def _sdpa_stub(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention``'s signature."""


def _sdpa(args, kwargs):
    """``scaled_dot_product_attention`` with ``dropout_p > 0``: its math, the dropout on the
    probabilities ``[..., L, S]`` drawn here (torch's fused kernels draw from their own generator)."""
    q, k, v, mask, p, causal, scale, gqa = _bind(_sdpa_stub, args, kwargs)
    if not p:
        return None, None
    heads = (*k.shape[:-3], q.shape[-3]) if gqa else k.shape[:-2]
    shape = (*torch.broadcast_shapes(q.shape[:-2], heads), q.shape[-2], k.shape[-2])

    def run(src: _Source):
        kk, vv = k, v
        if gqa:
            kk = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
            vv = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
        scores = (q @ kk.transpose(-2, -1)) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
        if causal:
            tril = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~tril, float("-inf"))
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        probs = torch.softmax(scores, -1)
        probs = probs * src.keep(p, q.device).to(probs.dtype).div_(1 - p)
        return probs @ vv
    return _Draw("scaled_dot_product_attention", shape), run


def _size_of(args, kwargs) -> tuple[int, ...]:
    size = kwargs.get("size", args)
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = size[0]
    return tuple(int(s) for s in size)


def _factory(name: str, gaussian: bool, like: bool) -> Handler:
    def handler(args, kwargs):
        refused = _no_generator(name, kwargs)
        if like:
            x = args[0] if args else kwargs["input"]
            shape, dtype, device = tuple(x.shape), kwargs.get("dtype") or x.dtype, kwargs.get("device") or x.device
        else:
            shape = _size_of(args, kwargs)
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            device = kwargs.get("device") or torch.get_default_device()
        grad = bool(kwargs.get("requires_grad", False))

        def run(src: _Source):
            t = src.normal(dtype, device) if gaussian else src.uniform(dtype, device)
            return t.requires_grad_(grad) if grad else t
        return _Draw(name, shape, refused), run
    return handler


def _inplace(name: str) -> Handler:
    def handler(args, kwargs):
        x, rest = args[0], list(args[1:])
        refused = _no_generator(name, kwargs) or ("" if x.is_floating_point() else
                                                  f"{name} on a {x.dtype} tensor (floating point only)")

        def arg(i: int, key: str, default):
            return rest[i] if i < len(rest) else kwargs.get(key, default)

        def run(src: _Source):
            if name == "uniform_":
                lo, hi = arg(0, "from", 0.0), arg(1, "to", 1.0)
                values = src.uniform(x.dtype, x.device) * (hi - lo) + lo
            elif name == "normal_":
                values = src.normal(x.dtype, x.device) * arg(1, "std", 1.0) + arg(0, "mean", 0.0)
            else:  # bernoulli_
                p = arg(0, "p", 0.5)
                values = (src.uniform(torch.float64, x.device) < (p.double() if isinstance(p, Tensor) else p)).to(x.dtype)
            return x.copy_(values)
        return _Draw(name, tuple(x.shape), refused), run
    return handler


def _bernoulli(args, kwargs):
    x, rest = args[0] if args else kwargs["input"], list(args[1:])
    p = rest[0] if rest else kwargs.get("p")
    refused = _no_generator("bernoulli", kwargs)

    def run(src: _Source):
        probs = x if p is None else p
        u = src.uniform(torch.float64, x.device)
        return (u < (probs.double() if isinstance(probs, Tensor) else probs)).to(x.dtype)
    return _Draw("bernoulli", tuple(x.shape), refused), run


def _normal(args, kwargs):
    a = list(args) + [kwargs[k] for k in ("mean", "std", "size") if k in kwargs][len(args):]
    mean, std = a[0], a[1] if len(a) > 1 else 1.0
    refused = _no_generator("normal", kwargs)
    tensors = [t for t in (mean, std) if isinstance(t, Tensor)]
    if tensors:
        shape = tuple(torch.broadcast_shapes(*(t.shape for t in tensors)))
        dtype, device = tensors[0].dtype, tensors[0].device
    else:
        shape = _size_of((a[2],) if len(a) > 2 else (), {})
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        device = kwargs.get("device") or torch.get_default_device()

    def run(src: _Source):
        return src.normal(dtype, device) * std + mean
    return _Draw("normal", shape, refused), run


def _refuse(name: str, when: Callable[[tuple, dict], bool] | None = None) -> Handler:
    def handler(args, kwargs):
        if when is not None and not when(args, kwargs):
            return None, None
        return _Draw(name, (), f"{name} is not covered by hpf.rng (it would draw from torch's per-rank generator); "
                               "use a covered op (dropout, rand, randn, bernoulli, uniform_, normal_) or draw it "
                               "outside the block"), None
    return handler


def _training(default: bool):
    def when(args, kwargs) -> bool:
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        training = args[2] if len(args) > 2 else kwargs.get("training", default)
        return bool(training) and p > 0
    return when


_HANDLERS: dict[object, Handler] = {
    F.dropout: _dropout(_dropout_stub, False),
    torch.dropout: _dropout(_torch_dropout_stub, True),
    F.scaled_dot_product_attention: _sdpa,
    torch.rand: _factory("rand", False, False),
    torch.randn: _factory("randn", True, False),
    torch.rand_like: _factory("rand_like", False, True),
    torch.randn_like: _factory("randn_like", True, True),
    Tensor.uniform_: _inplace("uniform_"),
    Tensor.normal_: _inplace("normal_"),
    Tensor.bernoulli_: _inplace("bernoulli_"),
    torch.bernoulli: _bernoulli,
    Tensor.bernoulli: _bernoulli,
    torch.normal: _normal,
    **{f: _refuse(n, _training(d)) for f, n, d in (
        (F.dropout1d, "dropout1d", True), (F.dropout2d, "dropout2d", True), (F.dropout3d, "dropout3d", True),
        (F.alpha_dropout, "alpha_dropout", False), (F.feature_alpha_dropout, "feature_alpha_dropout", False))},
    F.rrelu: _refuse("rrelu", lambda a, k: bool(a[3] if len(a) > 3 else k.get("training", False))),
    **{f: _refuse(n) for f, n in (
        (torch.randint, "randint"), (torch.randint_like, "randint_like"), (torch.randperm, "randperm"),
        (torch.multinomial, "multinomial"), (Tensor.multinomial, "multinomial"), (torch.poisson, "poisson"),
        (Tensor.random_, "random_"), (Tensor.exponential_, "exponential_"), (Tensor.cauchy_, "cauchy_"),
        (Tensor.log_normal_, "log_normal_"), (Tensor.geometric_, "geometric_"), (torch.rrelu, "rrelu"),
        (torch.alpha_dropout, "alpha_dropout"), (torch.feature_dropout, "feature_dropout"),
        (torch.feature_alpha_dropout, "feature_alpha_dropout"))},
}


def _drawn(func, args: tuple, kwargs: dict) -> tuple[_Draw | None, Run | None]:
    handler = _HANDLERS.get(func)
    return (None, None) if handler is None else handler(args, kwargs)


# ---------------------------------------------------------------- the layout table
@dataclass(frozen=True)
class _Entry:
    """One random op of the meta runs: its name, module path, global shape, the dims the local
    run divides as ``(dim, factor, this rank's chunk)``, and why it cannot be mapped ("")."""

    name: str
    path: str
    shape: tuple[int, ...]
    dims: tuple[tuple[int, int, int], ...] = ()
    refused: str = ""


@dataclass(frozen=True)
class _Table:
    entries: tuple[_Entry, ...] = ()
    refused: str = ""


class _Recorder(TorchFunctionMode):
    """Records every random op of a meta run (its module path from ``stack``); a one-element
    boolean asked for its value on meta is taken as True (as ``plan.trace`` does)."""

    def __init__(self, stack: list[str]):
        super().__init__()
        self.stack, self.draws = stack, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (Tensor.__bool__, Tensor.item) and args and isinstance(args[0], Tensor) \
                and args[0].device.type == "meta" and args[0].dtype == torch.bool and args[0].numel() == 1:
            return True
        draw, _ = _drawn(func, args, kwargs)
        if draw is not None:
            self.draws.append((draw, self.stack[-1] if self.stack else ""))
        return func(*args, **kwargs)


def _meta_draws(template: nn.Module, args: tuple, kwargs: dict, shapes: Mapping[str, torch.Size] | None,
                attrs: Mapping[str, int], opaque: Mapping[str, tuple | None], outputs: dict,
                ins: Mapping[str, Mapping] | None = None) -> list[tuple[_Draw, str]]:
    """The random ops of one forward of a meta copy of ``template`` (parameters at ``shapes``,
    ``attrs`` set), with their module paths.  Each planned module of ``opaque`` converts its
    planned arguments and its output as its boundaries would, by shape: ``(Handoff, {argument
    key: placement})``; None: the global run, which records in ``outputs`` the shapes of the
    arguments named by ``ins[module]`` and of the output, per call."""
    ins = ins or {}
    twin = meta_copy(template, shapes)
    for path, value in attrs.items():
        owner, _, attr = path.rpartition(".")
        setattr(twin.get_submodule(owner), attr, value)
    stack: list[str] = []
    handles = []
    for path, m in twin.named_modules():
        handles.append(m.register_forward_pre_hook(lambda mod, a, path=path: stack.append(path)))
        handles.append(m.register_forward_hook(lambda mod, a, out: None if stack.pop() else None, always_call=True))
    seen: dict[str, int] = {}
    for rel, layout in opaque.items():
        sub = twin.get_submodule(rel)
        places = layout[1] if layout is not None else {}
        slots = arg_slots(sub.forward, list(places if layout is not None else ins.get(rel, {})), rel)

        def pre(mod, a, kw, rel=rel, layout=layout, slots=slots, places=places):
            i = seen[rel] = seen.get(rel, -1) + 1
            if layout is None:  # the global run: each planned argument's shape, per call
                shapes = {}
                map_arguments(slots, a, dict(kw), lambda slot, t: shapes.setdefault(
                    slot.key, tuple(t.shape) if isinstance(t, Tensor) else None))
                outputs.setdefault(rel, []).append([shapes, None])
                return None
            calls = outputs.get(rel, [])
            glob = calls[i][0] if i < len(calls) else {}

            def enter(slot, t):  # the boundary's conversion of this argument, by shape
                if not isinstance(t, Tensor) or glob.get(slot.key) is None:
                    return t
                return replace(layout[0], dst=places[slot.key]).input((t,), glob[slot.key])[0]
            args, kwargs = map_arguments(slots, a, dict(kw), enter)
            return tuple(args), kwargs

        def post(mod, a, out, rel=rel, layout=layout):
            if not isinstance(out, Tensor):
                return out
            calls, i = outputs.setdefault(rel, []), seen[rel]
            if layout is None:
                if i < len(calls):
                    calls[i][1] = tuple(out.shape)
                return out
            glob = calls[i][1] if i < len(calls) and calls[i][1] is not None else tuple(out.shape)
            shape = layout[0].output(tuple(out.shape), glob)
            return out if shape == tuple(out.shape) else torch.empty(shape, dtype=out.dtype, device=out.device)
        handles += [sub.register_forward_pre_hook(pre, with_kwargs=True), sub.register_forward_hook(post)]
    recorder = _Recorder(stack)
    try:
        with torch.no_grad(), recorder:
            twin(*_snapshot(_to_meta(args)), **_snapshot(_to_meta(kwargs)))
    finally:
        for h in handles:
            h.remove()
    return recorder.draws


def _doubled(obj):
    """``obj`` with every tensor of one dim or more twice as long on dim 0 (meta)."""
    if isinstance(obj, Tensor):
        return torch.empty((2 * obj.shape[0], *obj.shape[1:]) if obj.dim() else (), dtype=obj.dtype, device="meta")
    if isinstance(obj, (tuple, list)):
        return type(obj)(_doubled(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _doubled(v) for k, v in obj.items()}
    return obj


def _divided(glob: Sequence[int], local: Sequence[int]) -> list[tuple[int, int]] | None:
    """(dim, factor) of each dim ``local`` divides; None: not a division of ``glob``."""
    if len(glob) != len(local):
        return None
    out = []
    for d, (g, m) in enumerate(zip(glob, local, strict=True)):
        if g != m:
            if m <= 0 or g % m:
                return None
            out.append((d, g // m))
    return out


def _layout_table(apply_fn, args: tuple, kwargs: dict, data: bool) -> _Table:
    """The layout of each random op of ``apply_fn``'s forward on arguments shaped like ``args``
    and ``kwargs`` (see the module docstring); local, no communication."""
    runtime = getattr(apply_fn, "runtime", None)
    if runtime is None:
        return _Table(refused="this apply_fn carries no runtime record (Runtime) to map its layouts from")
    program, template = runtime.program, runtime.template
    mesh = program.mesh
    names = list(mesh.mesh_dim_names or ())
    sizes = {a: mesh.size(i) for i, a in enumerate(names)}
    cp = sorted({b.planned.axis for b in program.boundaries
                 if isinstance(b.planned.style, ContextParallel) and sizes[b.planned.axis] > 1})
    split = sorted({b.planned.axis for b in program.boundaries if sizes[b.planned.axis] > 1})
    shapes = {fqn: program.infos[key].global_shape for fqn, key in program.leaf_of.items()}
    attrs, opaque, own = {}, {}, []
    for b in program.boundaries:
        fqn, axis = b.planned.fqn, b.planned.axis
        n = sizes[axis]
        module = template.get_submodule(fqn)
        for attr in b.spec.divide_attrs:
            attrs[f"{fqn}.{attr}" if fqn else attr] = getattr(module, attr) // n
        for attr, value in b.spec.set_attrs.items():
            attrs[f"{fqn}.{attr}" if fqn else attr] = value
        if fqn and boundaries(b.spec, axis):
            opaque[fqn] = (handoff(b.spec, axis, n), {k: v.get(axis) for k, v in b.spec.in_dst.items()})
        if not b.planned.style.own_forward:
            own.append(fqn)
    outputs: dict = {}
    try:
        if cp:  # refused: the global run names each random op
            why = (f"context parallelism over mesh axis {cp[0]!r} holds the sequence in zigzag chunks, which hpf.rng "
                   "does not map to global positions yet")
            return _Table(tuple(_Entry(g.name, path, tuple(g.shape), (), why) for g, path in
                                _meta_draws(template, args, kwargs, shapes, {}, {}, {})))
        ins = {fqn: layout[1] for fqn, layout in opaque.items()}
        glob = _meta_draws(template, args, kwargs, shapes, {}, dict.fromkeys(opaque), outputs, ins)
        local = _meta_draws(template, args, kwargs, None, attrs, opaque, outputs)
        twice = _meta_draws(template, _doubled(args), _doubled(kwargs), shapes, {}, {}, {}) if data else None
    except Exception as exc:  # noqa: BLE001 - the reason a random op is refused
        return _Table(refused=f"its forward could not be run on meta tensors to map the layouts "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''})")
    if len(glob) != len(local):
        return _Table(refused=f"the local forward draws {len(local)} random ops where the global one draws {len(glob)}")
    entries = []
    for j, ((g, path), (m, _)) in enumerate(zip(glob, local, strict=True)):
        why, dims = "", []
        parts = _divided(g.shape, m.shape)
        inside = next((o for o in own if path == o or path.startswith(o + ".") or not o), None)
        if g.name != m.name:
            why = f"the local forward draws {m.name} where the global one draws {g.name}"
        elif inside is not None:
            why = f"it runs inside {inside!r}, whose style runs a function of its own (Local, Experts)"
        elif parts is None:
            why = f"its local shape {list(m.shape)} is not its global shape {list(g.shape)} divided"
        elif len(parts) > 1:
            why = f"its local shape {list(m.shape)} divides its global shape {list(g.shape)} on several dims"
        elif parts and len(split) != 1:
            why = (f"its shape is divided on dim {parts[0][0]} over a mesh with {len(split) or 'no'} split axes "
                   f"{split}: the axis (and so the offset) is ambiguous")
        elif parts:
            (d, f), axis = parts[0], split[0]
            if sizes[axis] % f:
                why = f"dim {d} is divided by {f}, which does not divide mesh axis {axis!r} (size {sizes[axis]})"
            else:
                dims = [(d, f, mesh.get_local_rank(axis) // (sizes[axis] // f))]
        if not why and twice is not None:
            t = twice[j][0].shape if j < len(twice) and len(twice) == len(glob) else None
            if t is None or not g.shape or t != (2 * g.shape[0], *g.shape[1:]):
                why = ("its dim 0 is not the batch (a forward on twice the examples does not double it), so the data "
                       "axes' convention (rank i holds examples [i*b, (i+1)*b)) cannot place it")
            elif dims and dims[0][0] == 0:
                why = "its batch dim is divided by the plan too"
        entries.append(_Entry(g.name, path, tuple(g.shape), tuple(dims), why))
    return _Table(tuple(entries))


def _signature(obj) -> object:
    """What the layout table depends on in the call's arguments: shapes, dtypes, plain values."""
    if isinstance(obj, Tensor):
        return tuple(obj.shape), obj.dtype
    if isinstance(obj, (tuple, list)):
        return type(obj).__name__, tuple(_signature(o) for o in obj)
    if isinstance(obj, dict):
        return tuple((k, _signature(v)) for k, v in obj.items())
    if isinstance(obj, (int, float, str, bool, type(None))):
        return obj
    return type(obj).__name__


def _caller() -> str:
    """The class of the innermost module whose forward is running (for messages without a path)."""
    frame = inspect.currentframe()
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and frame.f_code.co_name == "forward":
            return f"{type(owner).__name__}.forward"
        frame = frame.f_back
    return "the forward"


# ---------------------------------------------------------------- the mode
class _Scope:
    """One ``apply_fn`` call in progress under an ``Rng``: where its draws start, the data
    axes' (size, this rank's index), the blocks its backward recomputes, its table (lazily)."""

    def __init__(self, owner: Rng, apply_fn, args: tuple, kwargs: dict, data: tuple[int, int] | None,
                 recomputed: tuple[str, ...]):
        self.owner, self.apply_fn, self.args, self.kwargs = owner, apply_fn, args, kwargs
        self.start, self.data, self.recomputed = owner.count, data, recomputed
        self.table: _Table | None = None

    def layout(self, draw: _Draw) -> tuple[list[int], list[int]]:
        """(global shape, offset) of this call's next draw, or a PlanError naming it."""
        j = self.owner.count - self.start
        if self.table is None:
            self.table = self.owner.table(self.apply_fn, self.args, self.kwargs, self.data is not None)
        table = self.table
        where = f"hpf.rng: random op #{j} of apply_fn's forward ({draw.name} in {_caller()}"
        if table.refused:
            raise PlanError(f"{where}): {table.refused}")
        if j >= len(table.entries):
            raise PlanError(f"{where}) has no counterpart in the meta run of the forward (it drew "
                            f"{len(table.entries)}): draw the same random ops on every call of the same shapes")
        e = table.entries[j]
        where = f"hpf.rng: {e.path or '<root module>'}: random op #{j} ({draw.name}"
        if e.name != draw.name or len(e.shape) != len(draw.shape):
            raise PlanError(f"{where}) differs from the meta run's op #{j} ({e.name} of {len(e.shape)} dims): the forward "
                            "takes another path on real values; hpf.rng cannot place it")
        if e.refused:
            raise PlanError(f"{where}): {e.refused}; set that dropout to 0 or run it unsharded")
        block = next((b for b in self.recomputed if e.path == b or e.path.startswith(b + ".") or not b), None)
        if block is not None:
            raise PlanError(f"{where}) runs in {block!r}, which is recomputed in the backward (shard(checkpoint=...), "
                            "or hpf.fsdp's resharded blocks under torch.func): the recompute would draw again; shard "
                            "with checkpoint=False (fsdp: reshard_after_forward=False)")
        glob, off = list(draw.shape), [0] * len(draw.shape)
        for d, f, chunk in e.dims:
            glob[d], off[d] = draw.shape[d] * f, chunk * draw.shape[d]
        if self.data is not None and draw.shape:
            size, index = self.data
            off[0] += index * glob[0]
            glob[0] *= size
        return glob, off


class Rng(TorchFunctionMode):
    """The active generator of a ``with hpf.rng(seed):`` block (see the module docstring).
    ``count`` is how many random ops the block has drawn; ``fold_in(i)`` is a generator for
    another stream (a step, a micro-batch) that shares this one's layout tables."""

    def __init__(self, seed: int, data_axes: str | Sequence[str] | None = None,
                 tables: dict | None = None):
        super().__init__()
        stream_key(seed)  # checks it is an int
        if data_axes is not None and not isinstance(data_axes, str) and not (
                isinstance(data_axes, (tuple, list)) and data_axes and all(isinstance(a, str) for a in data_axes)):
            raise PlanError(f"hpf.rng: data_axes must be a mesh axis name or a tuple of them, got {data_axes!r}")
        self.seed = seed
        self.data_axes = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes) if data_axes else None
        self.count = 0
        self.scope: _Scope | None = None
        self.active = False
        self.tables = {} if tables is None else tables  # (id(runtime), data, signature) -> (runtime, table)

    def fold_in(self, data: int) -> Rng:
        """A generator over stream ``(seed, data)`` (JAX's ``fold_in``): per-step seeds without
        recomputing the layout tables.

        Args:
            data: an int (the step, the micro-batch index).
        Returns:
            A new ``Rng`` to enter with ``with``.
        """
        return Rng(stream_key(self.seed, int(data)) >> 1, self.data_axes, self.tables)

    def __enter__(self):
        if self.active:
            raise PlanError("hpf.rng: this generator is already active; enter a fresh hpf.rng(seed) (or fold_in) instead")
        self.active, self.count, self.scope = True, 0, None
        return super().__enter__()

    def __exit__(self, *exc):
        self.active, self.scope = False, None
        return super().__exit__(*exc)

    def table(self, apply_fn, args: tuple, kwargs: dict, data: bool) -> _Table:
        """The layout table of ``apply_fn`` on arguments shaped like these (computed once)."""
        runtime = getattr(apply_fn, "runtime", None)
        key = (id(runtime), data, _signature((args, kwargs)))
        hit = self.tables.get(key)
        if hit is None or hit[0] is not runtime:
            with temporarily_clear_interpreter_stack():  # the meta runs are no part of a torch.func transform
                hit = self.tables[key] = (runtime, _layout_table(apply_fn, args, kwargs, data))
        return hit[1]

    def call(self, apply_fn, params, *args, **kwargs):
        """Run ``apply_fn(params, *args, **kwargs)`` as one scope of this generator (what
        ``ApplyFn.__call__`` does when an ``Rng`` is active); a call inside another's (a transform
        over ``apply_fn``) belongs to the outer one."""
        if self.scope is not None:
            return apply_fn.call(params, *args, **kwargs)
        self.scope = _Scope(self, apply_fn, args, kwargs, self._data(apply_fn), self._recomputed(apply_fn))
        try:
            return apply_fn.call(params, *args, **kwargs)
        finally:
            self.scope = None

    def _data(self, apply_fn) -> tuple[int, int] | None:
        layout = getattr(apply_fn, "fsdp", None)
        axes = self.data_axes
        if layout is not None:
            own = (layout.axis,) if isinstance(layout.axis, str) else tuple(layout.axis)
            if axes is not None and set(axes) != set(own):
                raise PlanError(f"hpf.rng: data_axes={list(axes)} but this apply_fn is hpf.fsdp over {list(own)}; "
                                "leave data_axes out (fsdp's axes are the data axes)")
            axes = own
        if axes is None:
            return None
        mesh = apply_fn.program.mesh
        missing = [a for a in axes if a not in (mesh.mesh_dim_names or ())]
        if missing:
            raise PlanError(f"hpf.rng: data axis {missing[0]!r} is not an axis of apply_fn's mesh "
                            f"{list(mesh.mesh_dim_names or ())}; shard() on the mesh that holds the data axes")
        return flat_index(mesh, axes[0] if len(axes) == 1 else axes)

    @staticmethod
    def _recomputed(apply_fn) -> tuple[str, ...]:
        blocks = tuple(getattr(apply_fn, "checkpointed", None) or ())
        layout = getattr(apply_fn, "fsdp", None)
        if layout is not None and layout.reshard_after_forward and (
                torch._C._functorch.maybe_current_level() is not None or torch.compiler.is_compiling()):
            blocks += tuple(g.block for g in layout.groups if g.block is not None)
        return blocks

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is None:
            return func(*args, **kwargs)
        draw, run = handler(args, kwargs)
        if draw is None:
            return func(*args, **kwargs)
        if draw.refused:
            raise PlanError(f"hpf.rng: {draw.refused}")
        if self.scope is None:
            glob, off = list(draw.shape), [0] * len(draw.shape)
        else:
            glob, off = self.scope.layout(draw)
        key = stream_key(self.seed, self.count)
        self.count += 1
        return run(_Source(key, draw.shape, glob, off))


def rng(seed: int, *, data_axes: str | Sequence[str] | None = None) -> Rng:
    """A counter-based generator for the random ops of a forward: ``with hpf.rng(seed):``, every
    dropout and ``rand``/``randn``/``bernoulli``-like op, in a plain module call or in any
    ``apply_fn``, draws by global element index, so the loss and the gradients are the same at
    any layout (docs/randomness.md says which ops, which layouts and what is refused).

    Args:
        seed: an int; the k-th random op inside the block reads stream ``(seed, k)``.
        data_axes: mesh axes over which each rank passes its own examples (plain data
            parallelism beside ``shard()``): rank ``i`` of them holds global examples
            ``[i * b, (i + 1) * b)`` of dim 0.  An ``hpf.fsdp`` apply_fn uses its own axes.
    Returns:
        An ``Rng`` (a ``TorchFunctionMode``) to enter with ``with``.
    """
    return Rng(seed, data_axes)


def active_rng() -> Rng | None:
    """The innermost ``Rng`` on torch's function-mode stack (an open ``with hpf.rng(...)``), or None."""
    if not torch._C._len_torch_function_stack():
        return None
    return next((m for m in reversed(_get_current_function_mode_stack()) if isinstance(m, Rng)), None)
