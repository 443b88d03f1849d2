"""The layout tables of ``hpf.rng`` (``runtime.rng``): where each random op of an ``apply_fn``
call sits in the unsharded model's tensor of the same op.

A table is computed from meta runs of the skeleton (``Runtime.template``) on the call's own
argument shapes, their random ops paired in order:

* **global**: the whole model, parameters at their global shapes;
* **local**: every planned module's boundaries applied by shape (the shape audit's ``Handoff``),
  sizes localised (``divide_attrs``).  A dim the local op divides by ``f`` over the plan's one
  split axis of size ``n`` is that axis's contiguous chunk ``coord // (n / f)``;
* under **context parallelism** the sequence is cut by the plan's own root (the root entry whose
  style states its ``sequence_split``, on an axis whose entries state ``splits_sequence``:
  ``core.style``), run at the axis's size 1 for the global run and at its real size and this
  rank's coordinate for a third run (global parameters, local sequence) between the two: a dim it
  divides by the CP size whose global length is the sequence's holds the root's
  ``positions(rank, seq, cp)`` — an explicit vector of global positions (the zigzag layout is not
  affine), composed with a TP split of the same dim;
* with **data axes**, a run at twice the batch checks that each op's dim 0 is the batch.

What cannot be placed is an entry's ``refused`` (raised by name when the op draws).
"""

from __future__ import annotations

__all__ = ["Table", "layout_table"]

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ..analysis.audit import boundaries, divided, handoff, record_or_resize
from ..analysis.copies import meta_copy, snapshot, to_meta
from ..core.collectives import AxisGroup
from ..core.signature import arg_slots, map_arguments, named_arguments
from ..core.style import SequenceSplit
from .rng_ops import Draw, drawn

Forward = Callable[[nn.Module], object]  # one forward of a meta twin of the template


@dataclass(frozen=True, eq=False)
class Entry:
    """One random op of the meta runs: its name, module path, global shape, the dims the local
    run divides as ``(dim, factor, this rank's chunk)``, the dims whose global positions are
    listed ``(dim, global length, this rank's positions in local order)``, and why it cannot be
    mapped ("")."""

    name: str
    path: str
    shape: tuple[int, ...]
    dims: tuple[tuple[int, int, int], ...] = ()
    refused: str = ""
    index: tuple[tuple[int, int, Tensor], ...] = ()


@dataclass(frozen=True)
class Table:
    entries: tuple[Entry, ...] = ()
    refused: str = ""


class _Recorder(TorchFunctionMode):
    """Records every random op of a meta run (its module path from ``stack``); a one-element
    boolean asked for its value on meta is taken as True (as ``analysis.trace`` does)."""

    def __init__(self, stack: list[str]):
        super().__init__()
        self.stack, self.draws = stack, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (Tensor.__bool__, Tensor.item) and args and isinstance(args[0], Tensor) \
                and args[0].device.type == "meta" and args[0].dtype == torch.bool and args[0].numel() == 1:
            return True
        draw, _ = drawn(func, args, kwargs)
        if draw is not None:
            self.draws.append((draw, self.stack[-1] if self.stack else ""))
        return func(*args, **kwargs)


def _meta_draws(template: nn.Module, forward: Forward, shapes: Mapping[str, torch.Size] | None,
                attrs: Mapping[str, int], opaque: Mapping[str, tuple | None], outputs: dict,
                ins: Mapping[str, Mapping] | None = None) -> list[tuple[Draw, str]]:
    """The random ops of ``forward`` of a meta copy of ``template`` (parameters at ``shapes``,
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
            return record_or_resize(outputs, seen[rel], rel, out, None if layout is None else layout[0], out.device)
        handles += [sub.register_forward_pre_hook(pre, with_kwargs=True), sub.register_forward_hook(post)]
    recorder = _Recorder(stack)
    try:
        with torch.no_grad(), recorder:
            forward(twin)
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


def _plain(args: tuple, kwargs: dict) -> Forward:
    """The twin called on meta copies of ``args`` and ``kwargs``."""
    return lambda twin: twin(*snapshot(to_meta(args)), **snapshot(to_meta(kwargs)))


@dataclass(frozen=True)
class _SequenceRoot:
    """The plan's root entry that cuts the sequence, through its ``SequenceSplit`` (context
    parallelism's root ``Local`` fn, which keeps this rank's positions of the sequence arguments and
    calls the model's forward on them), the axis's size and this rank's coordinate on it."""

    split: SequenceSplit
    size: int
    rank: int

    @property
    def axis(self) -> str:
        return self.split.axis

    def arguments(self, template: nn.Module, args: tuple, kwargs: dict) -> tuple[dict, dict, bool, int]:
        """(the global call's arguments by name, the call's own, ``cp_sharded``, the sequence
        length), as meta tensors.  The labels are left out (the loss draws nothing, and its
        collectives do not run on meta); ``cp_sharded`` chunks are lengthened to the sequence."""
        labels, sequence = self.split.sequence_keys()
        kwargs = {k: v for k, v in kwargs.items() if k not in labels}
        sharded = bool(kwargs.pop("cp_sharded", False))
        named = {k: v for k, v in to_meta(named_arguments(template, args, kwargs)).items() if k not in labels}
        whole = dict(named)
        for k, d in sequence.items():
            if sharded and isinstance(t := named.get(k), Tensor) and t.dim():
                d %= t.dim()
                whole[k] = torch.empty((*t.shape[:d], t.shape[d] * self.size, *t.shape[d + 1:]), dtype=t.dtype,
                                       device="meta")
        seq = next((whole[k].shape[d] for k, d in sequence.items() if isinstance(whole.get(k), Tensor)
                    and whole[k].dim()), 0)
        return whole, named, sharded, seq

    def forward(self, named: dict, size: int, rank: int, sharded: bool) -> Forward:
        """The root's forward of the twin on ``named`` as rank ``rank`` of ``size`` on the axis."""
        axes = {self.axis: AxisGroup(self.axis, "", size, rank)}
        return lambda twin: self.split(twin, axes, cp_sharded=sharded, **snapshot(named))


def _sequence_root(program, sizes: Mapping[str, int]) -> _SequenceRoot | None:
    """The plan's root entry that cuts the sequence (its style's ``sequence_split``) over an axis on
    which its entries split the sequence (``Style.splits_sequence``), or None."""
    cp = {b.planned.axis for b in program.boundaries if b.planned.style.splits_sequence}
    for b in program.boundaries:
        split = b.planned.style.sequence_split
        if not b.planned.fqn and split is not None and split.axis in cp:
            return _SequenceRoot(split, sizes[split.axis], program.mesh.get_local_rank(split.axis))
    return None


@dataclass(frozen=True)
class _LocalView:
    """What the local meta run applies: the attributes the skeleton localises, the planned modules
    whose boundaries convert by shape (``opaque``: path → (``Handoff``, argument key → placement)),
    and the planned modules whose style runs a function of its own (``own``), the root's cut of the
    sequence excepted."""

    attrs: dict[str, int]
    opaque: dict[str, tuple]
    own: list[str]

    @staticmethod
    def of(program, template: nn.Module, sizes: Mapping[str, int], root: _SequenceRoot | None) -> _LocalView:
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
            if not b.planned.style.own_forward and (root is None or fqn or b.planned.style.sequence_split is not root.split):
                own.append(fqn)
        return _LocalView(attrs, opaque, own)


def _runs(template: nn.Module, shapes: Mapping[str, torch.Size], view: _LocalView, root: _SequenceRoot | None,
          call: tuple[tuple, dict], data: bool) -> tuple[list, list, list, list | None, int]:
    """The random ops of the meta runs — global, this rank's sequence at global parameters (the
    global run again without a sequence root), local and, with ``data``, the global one on twice the
    examples (None without) — and the sequence length (0 without a sequence root)."""
    args, kwargs = call
    outputs: dict = {}
    ins = {fqn: layout[1] for fqn, layout in view.opaque.items()}
    if root is None:
        run, twice_run, seq = _plain(args, kwargs), _plain(_doubled(args), _doubled(kwargs)), 0
        glob = mid = _meta_draws(template, run, shapes, {}, dict.fromkeys(view.opaque), outputs, ins)
    else:  # the global run through the root at cp 1; the sequence cut at global parameters, then locally
        whole, named, sharded, seq = root.arguments(template, args, kwargs)
        glob = _meta_draws(template, root.forward(whole, 1, 0, False), shapes, {}, {}, {})
        run = root.forward(named, root.size, root.rank, sharded)
        mid = _meta_draws(template, run, shapes, {}, dict.fromkeys(view.opaque), outputs, ins)
        twice_run = root.forward(_doubled(whole), 1, 0, False)
    local = _meta_draws(template, run, None, view.attrs, view.opaque, outputs)
    twice = _meta_draws(template, twice_run, shapes, {}, {}, {}) if data else None
    return glob, mid, local, twice, seq


@dataclass(frozen=True)
class _Place:
    """How the random ops of one call are placed: the sequence root (None: none), the modules whose
    style runs a function of its own, the plan's split axes (the sequence's excepted), the mesh and
    its axis sizes, the sequence length."""

    root: _SequenceRoot | None
    own: list[str]
    split: list[str]
    mesh: object
    sizes: Mapping[str, int]
    seq: int

    def refusal(self, g: Draw, c: Draw, m: Draw, path: str) -> tuple[str, list, list | None]:
        """(why the op cannot be placed, "" when it can; its dims divided over the split axis as
        ``(dim, factor, chunk)``; the dims the sequence root divides, None: not a division)."""
        root, split, mesh, sizes = self.root, self.split, self.mesh, self.sizes
        why, dims = "", []
        seq_parts = divided(g.shape, c.shape) if root is not None else []
        parts = divided(c.shape, m.shape)
        inside = next((o for o in self.own if path == o or path.startswith(o + ".") or not o), None)
        if not g.name == c.name == m.name:
            why = f"the local forward draws {m.name} where the global one draws {g.name}"
        elif inside is not None:
            why = f"it runs inside {inside!r}, whose style runs a function of its own (Local, Experts)"
        elif parts is None or seq_parts is None:
            why = f"its local shape {list(m.shape)} is not its global shape {list(g.shape)} divided"
        elif len(seq_parts) > 1:
            why = (f"context parallelism over {root.axis!r} divides its dims {[d for d, _ in seq_parts]} (attention "
                   "probabilities of the sharded sequence: dropout inside ring/all-gather attention is not mapped)")
        elif seq_parts and (seq_parts[0][1] != root.size or g.shape[seq_parts[0][0]] != self.seq):
            why = (f"context parallelism over {root.axis!r} divides its dim {seq_parts[0][0]} (global length "
                   f"{g.shape[seq_parts[0][0]]}), which is not the sequence (length {self.seq}) cut into its positions")
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
        return why, dims, seq_parts

    def entry(self, g: Draw, c: Draw, m: Draw, path: str, doubled: tuple[bool, torch.Size | None]) -> Entry:
        """The ``Entry`` of one random op (global ``g``, this rank's sequence ``c``, local ``m``);
        ``doubled``: whether the data axes are checked, and the op's shape on twice the examples."""
        why, dims, seq_parts = self.refusal(g, c, m, path)
        index = []
        if seq_parts and not why:  # this rank's positions of the sequence, then a TP chunk of them
            d = seq_parts[0][0]
            positions = self.root.split.positions(self.root.rank, self.seq, self.root.size)
            chunk = next(((k, m.shape[d]) for dd, _, k in dims if dd == d), (0, m.shape[d]))
            index = [(d, self.seq, positions[chunk[0] * chunk[1]:(chunk[0] + 1) * chunk[1]])]
            dims = [x for x in dims if x[0] != d]
        checked, t = doubled
        if not why and checked:
            if t is None or not g.shape or t != (2 * g.shape[0], *g.shape[1:]):
                why = ("its dim 0 is not the batch (a forward on twice the examples does not double it), so the data "
                       "axes' convention (rank i holds examples [i*b, (i+1)*b)) cannot place it")
            elif (dims and dims[0][0] == 0) or (index and index[0][0] == 0):
                why = "its batch dim is divided by the plan too"
        return Entry(g.name, path, tuple(g.shape), tuple(dims), why, tuple(index))


def layout_table(apply_fn, args: tuple, kwargs: dict, data: bool) -> Table:
    """The layout of each random op of ``apply_fn``'s forward on arguments shaped like ``args``
    and ``kwargs`` (see the module docstring); local, no communication."""
    runtime = getattr(apply_fn, "runtime", None)
    if runtime is None:
        return Table(refused="this apply_fn carries no runtime record (Runtime) to map its layouts from")
    program, template = runtime.program, runtime.template
    mesh = program.mesh
    sizes = {a: mesh.size(i) for i, a in enumerate(mesh.mesh_dim_names or ())}
    root = _sequence_root(program, sizes)
    split = sorted({b.planned.axis for b in program.boundaries if sizes[b.planned.axis] > 1
                    and (root is None or b.planned.axis != root.axis)})
    shapes = {fqn: program.infos[key].global_shape for fqn, key in program.leaf_of.items()}
    view = _LocalView.of(program, template, sizes, root)
    try:
        glob, mid, local, twice, seq = _runs(template, shapes, view, root, (args, kwargs), data)
    except Exception as exc:  # noqa: BLE001 - the reason a random op is refused
        return Table(refused=f"its forward could not be run on meta tensors to map the layouts "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''})")
    if not len(glob) == len(mid) == len(local):
        return Table(refused=f"the local forward draws {len(local)} random ops where the global one draws {len(glob)}"
                             + (f" ({len(mid)} on this rank's sequence at global parameters)" if root else ""))
    place = _Place(root, view.own, split, mesh, sizes, seq)
    whole = twice is not None and len(twice) == len(glob)
    return Table(tuple(place.entry(g, c, m, path, (twice is not None, twice[j][0].shape if whole else None))
                       for j, ((g, path), (c, _), (m, _)) in enumerate(zip(glob, mid, local, strict=True))))
