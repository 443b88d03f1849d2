"""``apply_fn``: the per-call path — check the params pytree, convert, bind, run the skeleton.

Everything here runs on every step, so it does no plan or placement work: ``shard()`` decided
all of it and hands over a ``Program``.  Binding is ``torch.func.functional_call``'s swap with its
per-call walk done once: the tied groups (``Program.leaf_of``) and the (submodule ``_parameters``
dict, name) slots are resolved in ``make_apply_fn``, so a call is one dict store per slot, the
forward, and one store per slot to put the meta placeholders back.  See
docs/performance.md#the-per-call-path and, for threads, docs/guarantees.md#re-entrancy-threads.
"""

from __future__ import annotations

__all__ = ["ApplyFn", "ThreadGuard", "make_apply_fn"]

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from ..core.buckets import copy_to_many, gather_many
from ..core.collectives import AxisGroup
from ..core.errors import PlanError, ReentrancyError
from ..core.program import Program
from ..core.raw_collectives import Gate
from .boundary import ConversionCache
from .buffers import BufferSlots
from .inputs import InputAgreement
from .rng import active_rng


@dataclass(frozen=True, eq=False, init=False)
class ApplyFn:
    """The ``apply_fn`` that ``hpf.shard`` (and a transform over it) returns: called as
    ``apply_fn(params, *args, buffers=None, **kwargs)``, it runs ``call``.  The other fields are
    read-only records: ``program`` (explain, validate), ``buffer_slots`` (``hpf.buffers``),
    ``input_check`` (``.values = True`` compares values too), ``remat_blocks`` (block path → its
    recompute, ``shard(remat=...)``),
    ``runtime`` (what a transform rebuilds from: ``runtime.shard.Runtime``), ``fsdp``
    (``hpf.fsdp``'s layout) and ``transforms``: what made it, in the order applied — ``"shard"``,
    then at most one ``"fsdp"`` (the one composition order; ``then`` refuses another).
    ``binder``: what ``bound`` runs (None where a transform's leaves cannot be bound once)."""

    call: Callable
    program: Program
    buffer_slots: BufferSlots
    input_check: InputAgreement | None = None
    remat_blocks: Mapping[str, object] = field(default_factory=dict)
    runtime: object | None = None
    fsdp: object | None = None
    transforms: tuple[str, ...] = ("shard",)
    binder: Callable[[Mapping[str, Tensor]], contextlib.AbstractContextManager[nn.Module]] | None = None

    def __init__(self, call: Callable, program: Program, buffer_slots: BufferSlots,
                 input_check: InputAgreement | None = None, remat_blocks: Mapping[str, object] | None = None,
                 runtime: object | None = None, fsdp: object | None = None, transforms: tuple[str, ...] = ("shard",),
                 binder: Callable | None = None):
        for name, value in (("call", call), ("program", program), ("buffer_slots", buffer_slots),
                            ("input_check", input_check), ("remat_blocks", {} if remat_blocks is None else remat_blocks),
                            ("runtime", runtime), ("fsdp", fsdp), ("transforms", transforms), ("binder", binder)):
            object.__setattr__(self, name, value)

    def __call__(self, params: Mapping[str, Tensor], *args, **kwargs):
        rng = active_rng()  # an open `with hpf.rng(seed):` maps this call's random ops (runtime.rng)
        if rng is not None:
            return rng.call(self, params, *args, **kwargs)
        return self.call(params, *args, **kwargs)

    def bound(self, params: Mapping[str, Tensor]) -> contextlib.AbstractContextManager[nn.Module]:
        """``with apply_fn.bound(params) as module:`` the private skeleton with ``params`` converted and
        bound once, for many forwards of ``module`` (or of its methods: ``module.generate``) until the
        block ends; each forward's boundaries still communicate, and the per-call conversion cache is
        emptied after each root forward.  No input agreement runs: the caller agrees once
        (``hpf.generate``).  Not for a transform's apply_fn whose leaves are gathered per call
        (``hpf.fsdp``): a ``PlanError`` says so."""
        if self.binder is None:
            raise PlanError(f"apply_fn.bound: this apply_fn ({' + '.join(self.transforms)}) binds its leaves per call; "
                            "bind the apply_fn that hpf.shard() returned")
        return self.binder(params)

    def then(self, transform: str, call: Callable, **fields) -> ApplyFn:
        """A new ``ApplyFn`` over ``call`` with ``transform`` recorded after this one's (and
        ``fields`` replaced); ``PlanError`` for a transform applied twice."""
        if transform in self.transforms:
            raise PlanError(f"{transform}: apply_fn is already {' + '.join(self.transforms)}; apply {transform} once, "
                            "to the apply_fn that hpf.shard() returned")
        return replace(self, call=call, transforms=(*self.transforms, transform), **fields)


class _Leaves:
    """How one params pytree goes into a skeleton, laid out once by ``make_apply_fn``: the keys and
    local shapes it must have, each leaf's conversions (one by one, or bucketed ``copy_to``), and
    the (submodule ``_parameters`` dict, name, placeholder) slots it is bound to."""

    def __init__(self, skeleton: nn.Module, program: Program, local_shapes: Mapping[str, torch.Size] | None):
        self.keys = tuple(program.infos)
        self.key_set = frozenset(self.keys)
        self.shapes = tuple(torch.Size((local_shapes or {}).get(k, program.infos[k].local_shape)) for k in self.keys)
        self.shape_list = list(self.shapes)
        self.steps = tuple(tuple(program.param_steps.get(k, ())) for k in self.keys)
        index = {k: i for i, k in enumerate(self.keys)}
        slots = []  # (leaf index, the owning skeleton module's _parameters, attribute name, placeholder)
        for fqn, key in program.leaf_of.items():
            mod, _, name = fqn.rpartition(".")
            store = skeleton.get_submodule(mod)._parameters
            slots.append((index[key], store, name, store[name]))
        self.slots = tuple(slots)
        self.bucketed = tuple((tuple(index[k] for k in b.keys), b.buckets, tuple(program.groups[a] for a in b.axes))
                              for b in program.param_buckets if not b.gather)
        self.gathered = tuple((tuple(tuple(index[b.keys[j]] for j in bucket) for bucket in b.buckets),
                               self.steps[index[b.keys[0]]][0], program.groups[b.axes[0]].size)
                              for b in program.param_buckets if b.gather)  # (buckets of leaf indices, gather, size)
        in_bucket = {i for b in program.param_buckets for i in (index[k] for k in b.keys)}
        self.converted = tuple(i for i, s in enumerate(self.steps) if s and i not in in_bucket)
        self.devices = frozenset({program.mesh.device_type, "meta"})  # meta: shapes only (explain, simulate)
        self.no_gradient = _recompute_refusal(program.recomputed)

    def values(self, params: Mapping[str, Tensor]) -> tuple[Tensor, ...]:
        """``params``' leaves in key order, or a PlanError naming the key, shape or device that is off
        (or the model's own recompute, run with a gradient)."""
        if self.no_gradient is not None and torch.is_grad_enabled():
            raise PlanError(self.no_gradient)
        keys, shapes = self.keys, self.shapes
        values = tuple(params.values()) if tuple(params) == keys else _reordered(params, keys, self.key_set)
        if [v.shape for v in values] != self.shape_list:  # a list comprehension: one call, not one per leaf
            _raise_shape(values, keys, shapes)
        if not {v.device.type for v in values} <= self.devices:
            _raise_device(values, keys, self.devices)
        return values

    def convert(self, values: tuple[Tensor, ...]) -> Sequence[Tensor]:
        """Every leaf through its conversions (the ``copy_to``-only ones: one all-reduce per bucket backward;
        the gathers of ``ShardedParams``: one all-gather per bucket)."""
        if not (self.converted or self.bucketed or self.gathered):
            return values
        values = list(values)
        for i in self.converted:
            for step in self.steps[i]:
                values[i] = step(values[i])
        for idx, buckets, groups in self.bucketed:
            for i, v in zip(idx, copy_to_many([values[i] for i in idx], buckets, groups), strict=True):
                values[i] = v
        for buckets, gather, size in self.gathered:  # ShardedParams: one all-gather per bucket
            for bucket in buckets:
                for i, v in zip(bucket, gather_many([values[i] for i in bucket], gather, size), strict=True):
                    values[i] = v
        return values

    def bind(self, values: Sequence[Tensor]) -> None:
        for i, store, name, _ in self.slots:
            store[name] = values[i]

    def unbind(self) -> None:
        """The placeholders back: the skeleton never keeps the caller's tensors alive."""
        for _, store, name, placeholder in self.slots:
            store[name] = placeholder


def make_apply_fn(skeleton: nn.Module, program: Program, cache: ConversionCache | None = None,
                  rebuild: Callable[[], Callable] | None = None, *, axes: Sequence[AxisGroup] = (),
                  local_shapes: Mapping[str, torch.Size] | None = None) -> ApplyFn:
    """``apply_fn(params, *args, buffers=None, **kwargs)``: check, convert, bind into the skeleton,
    forward; with ``buffers`` (``runtime.buffers``) it returns ``(output, buffers after the call)``.
    ``cache``: the boundaries' per-call conversion cache, emptied after every call; ``rebuild``:
    a new ``apply_fn`` on a fresh skeleton, for another thread; ``axes``: the groups a transform's
    forwards communicate over besides the program's (``hpf.fsdp``'s); ``local_shapes``: the shapes
    of the leaves it binds where they are not the program's (``hpf.fsdp``'s rows, which its
    installed forwards gather from the slots they are bound to).

    Binding writes the skeleton's slots, so two calls at once on one skeleton would read each
    other's parameters.  On a one-rank mesh a call from another thread runs on a skeleton of its
    own (``rebuild`` on that thread's first call, kept for the thread's life); on a multi-rank mesh
    (or without ``rebuild``) only the building thread may call (``ThreadGuard``).  The inputs are agreed (``runtime.inputs``)
    just before the call's first collective, so every local check of the call raises before it: the
    check is handed to the gates of the groups it communicates over (``raw_collectives.Gate``, the
    program's and ``axes``'), whose first collective runs it, and taken back when the call ends.
    ``bound(params)`` (``ApplyFn.bound``) binds once for many forwards of the skeleton itself (``hpf.generate``)."""
    leaves = _Leaves(skeleton, program, local_shapes)
    elsewhere = _thread_router(program, rebuild)
    agreement = InputAgreement.for_program(program, skeleton)
    gates = tuple({id(g.gate): g.gate for g in (*program.groups.values(), *axes) if g.gate is not None}.values())
    buffer_slots = BufferSlots(skeleton, program.mesh)

    def apply_fn(params: Mapping[str, Tensor], *args, buffers: Mapping[str, Tensor] | None = None, **kwargs):
        private = elsewhere()
        if private is not None:
            return private(params, *args, buffers=buffers, **kwargs)
        values = leaves.values(params)
        state = None if buffers is None else buffer_slots.check(buffers, leaves.devices)
        agree = None if agreement is None or torch.compiler.is_compiling() else _held(agreement, gates, args, kwargs)
        saved = None
        try:
            leaves.bind(leaves.convert(values))
            if state is not None:
                saved = buffer_slots.bind(state)
            out = skeleton(*args, **kwargs)
            if state is not None:
                out = (out, buffer_slots.collect(state))
            if agree is not None:  # a forward without collectives: agree before the backward can issue any
                agree()
        except RuntimeError as exc:  # failure path only: torch's refusal of an in-place buffer update under torch.func
            named = buffer_slots.update_error(exc, state)
            if named is None:
                raise
            raise named from exc
        finally:  # the skeleton never keeps the caller's tensors alive
            if agree is not None:
                for gate in gates:
                    gate.release(agree)
            leaves.unbind()
            if saved:
                buffer_slots.restore(saved)
            if cache:
                cache.clear()
        return out

    return ApplyFn(apply_fn, program, buffer_slots, agreement, binder=_binder(skeleton, leaves, cache, elsewhere))


def _held(agreement: InputAgreement, gates: Sequence[Gate], args: tuple, kwargs: dict) -> Callable[[], None] | None:
    """The input check this call needs, held by ``gates`` until the first collective over one of
    them runs it (once: the others then find it done); None when the signature was agreed before."""
    check = agreement.pending(args, kwargs)
    if check is None:
        return None
    todo = [check]

    def once() -> None:
        if todo:
            todo.pop()()

    for gate in gates:
        gate.hold(once)
    return once


def _thread_router(program: Program, rebuild: Callable[[], Callable] | None) -> Callable[[], ApplyFn | None]:
    """``elsewhere()``: the calling thread's own apply_fn where the call comes from another thread
    than the building one (a one-rank mesh with ``rebuild``), None on the building thread; a
    ``ReentrancyError`` where another thread may not call (``ThreadGuard``)."""
    owner = threading.get_ident()
    guard = ThreadGuard(program.mesh.size(), "apply_fn") if program.mesh.size() > 1 or rebuild is None else None
    mine = threading.local()  # another thread's own apply_fn (one-rank meshes)

    def elsewhere() -> ApplyFn | None:
        if torch.compiler.is_compiling() or threading.get_ident() == owner:
            return None
        if guard is not None:
            guard.refuse()
        private = getattr(mine, "apply_fn", None)
        if private is None:
            private = mine.apply_fn = rebuild()
        return private

    return elsewhere


def _binder(skeleton: nn.Module, leaves: _Leaves, cache: ConversionCache | None,
            elsewhere: Callable[[], ApplyFn | None]) -> Callable[[Mapping[str, Tensor]], Iterator[nn.Module]]:
    """``ApplyFn.bound``: ``params`` converted and bound into the skeleton for many forwards."""

    @contextlib.contextmanager
    def bound(params: Mapping[str, Tensor]) -> Iterator[nn.Module]:
        private = elsewhere()
        if private is not None:
            with private.bound(params) as module:
                yield module
            return
        values = leaves.values(params)
        clear = skeleton.register_forward_hook(lambda *_: cache.clear(), always_call=True) if cache is not None else None
        try:
            leaves.bind(leaves.convert(values))
            yield skeleton
        finally:
            if clear is not None:
                clear.remove()
            leaves.unbind()
            if cache:
                cache.clear()

    return bound


class ThreadGuard:
    """Refuses calls from threads other than the one that created it, with a message saying why:
    an ``apply_fn`` whose collectives span several ranks must pair them with the same call's on
    every other rank, and two threads' calls cannot be ordered alike on every rank (a lock would
    serialise them in a different order per rank)."""

    def __init__(self, ranks: int, what: str):
        self.owner, self.ranks, self.what = threading.get_ident(), ranks, what

    def check(self) -> None:
        """Raise unless called from the creating thread (not traced by ``torch.compile``)."""
        if not torch.compiler.is_compiling() and threading.get_ident() != self.owner:
            self.refuse()

    def refuse(self) -> None:
        raise ReentrancyError(
            f"{self.what} was called from thread {threading.current_thread().name!r}, but its collectives span "
            f"{self.ranks} ranks and it belongs to the thread that built it (id {self.owner}): calls from two threads "
            "cannot be ordered alike on every rank, so they would pair with each other's collectives (wrong values or "
            "a hang). Call it from one thread on every rank: the one that called hpf.shard() (or hpf.fsdp())")


def _recompute_refusal(recomputed: Mapping[str, str]) -> str | None:
    """Why a call with a gradient is refused where the model's own code recomputes modules in the
    backward (``Program.recomputed``), else None."""
    if not recomputed:
        return None
    (path, code), more = next(iter(recomputed.items())), len(recomputed) - 1
    others = f" (and {more} more module{'s' * (more > 1)})" if more else ""
    return (f"{path or '<root module>'}{others}: its forward runs inside {code}, which recomputes it in the backward "
            "and reads its parameters then, after apply_fn has returned and the private skeleton holds none: this "
            "model's backward cannot run through apply_fn. Call apply_fn without a gradient (torch.no_grad(), "
            "hpf.generate), or use a model whose forward does not recompute itself and recompute with "
            "shard(remat=...) instead (docs/transforms.md#activation-recompute-remat)")


_PASS_PARAMS = "pass the params pytree that shard() returned (this rank's local shards), not model.state_dict()"


def _reordered(params: Mapping[str, Tensor], keys: tuple[str, ...], key_set: frozenset[str]) -> tuple[Tensor, ...]:
    """The slow path of the key check: ``params`` in ``keys`` order, or a PlanError naming the keys."""
    if not isinstance(params, Mapping):
        raise PlanError(f"apply_fn: params must be a dict of tensors, got {type(params).__name__}; {_PASS_PARAMS}")
    if params.keys() != key_set:
        missing, extra = sorted(key_set - params.keys()), sorted(params.keys() - key_set)
        raise PlanError(f"apply_fn: params pytree keys differ from shard(): missing {missing[:5]}, extra {extra[:5]}; "
                        f"{_PASS_PARAMS}")
    return tuple(params[k] for k in keys)


def _raise_shape(values: tuple[Tensor, ...], keys: tuple[str, ...], shapes: tuple[torch.Size, ...]) -> None:
    key, got, want = next((k, tuple(v.shape), tuple(s)) for k, v, s in zip(keys, values, shapes, strict=True) if v.shape != s)
    raise PlanError(f"apply_fn: params[{key!r}] has shape {got}, expected local {want}; {_PASS_PARAMS}")


def _raise_device(values: tuple[Tensor, ...], keys: tuple[str, ...], devices: frozenset[str]) -> None:
    key, got = next((k, v.device) for k, v in zip(keys, values, strict=True) if v.device.type not in devices)
    raise PlanError(f"apply_fn: params[{key!r}] is on {got}, but the mesh's device type is "
                    f"{sorted(devices - {'meta'})[0]}: move the params to the mesh's device")
