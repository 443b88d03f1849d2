"""``hpf.rng(seed)``: random ops that draw by *global* element index, whatever the layout.

``with hpf.rng(seed):`` pushes an ``Rng``, a ``TorchFunctionMode``.  Inside the block every
dropout (``F.dropout``, ``nn.Dropout``, the ``dropout_p`` of ``scaled_dot_product_attention``)
and every ``torch.rand``/``randn``/``rand_like``/``randn_like``/``bernoulli``/``normal`` and
``Tensor.uniform_``/``normal_``/``bernoulli_`` draws from the counter-based generator of
``core.counter_rng`` (the ops: ``runtime.rng_ops``): the k-th random op of the block reads stream
``(seed, k)`` at the global index of each element, so the unsharded model and ``apply_fn`` at any
layout draw the same values.  Any other random op raises ``PlanError`` inside the block (its
values would come from torch's per-rank generator).

The mapping from a local element to its global index: outside an ``apply_fn`` call every tensor
is whole (a plain module call).  An ``apply_fn`` call (``ApplyFn.__call__`` hands itself to the
active ``Rng``: torch's mode stack is the one channel) opens a scope; its random ops are matched
in order with a layout table (``runtime.rng_layout``) computed once per (runtime, argument
signature) from meta runs of the skeleton: per op and dim, an offset (a TP chunk, the data axes'
examples) or a vector of global positions (context parallelism's sequence chunks, zigzag
included).  What cannot be mapped is refused by name when drawn: several split axes, a division
on two dims, attention probabilities of a CP-sharded sequence, random ops inside blocks
recomputed in the backward, a meta run that fails.  See docs/randomness.md.
"""

from __future__ import annotations

__all__ = ["Rng", "active_rng", "rng"]

import inspect
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from ..core.counter_rng import stream_key
from ..core.errors import PlanError
from ..core.facets import flat_index
from .rng_layout import Table, layout_table
from .rng_ops import Draw, Source, drawn

#: the layout tables kept per runtime (argument signatures: a generation loop's growing lengths drop the oldest)
TABLES_KEPT = 16


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
        self.table: Table | None = None

    def layout(self, draw: Draw) -> tuple[list[int], list[int | Tensor]]:
        """(global shape, offset or global positions per dim) of this call's next draw, or a
        PlanError naming it."""
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
            raise PlanError(f"{where}) runs in {block!r}, which is recomputed in the backward (shard(remat=...), "
                            "or hpf.fsdp's resharded blocks under torch.func): the recompute would draw again; shard "
                            "with remat=False (fsdp: reshard_after_forward=False)")
        glob, off = list(draw.shape), [0] * len(draw.shape)
        for d, f, chunk in e.dims:
            glob[d], off[d] = draw.shape[d] * f, chunk * draw.shape[d]
        for d, length, positions in e.index:
            if len(positions) != draw.shape[d]:
                raise PlanError(f"{where}) has {draw.shape[d]} elements on dim {d} where the meta run's has "
                                f"{len(positions)}: the forward takes another path on real values")
            glob[d], off[d] = length, positions
        if self.data is not None and draw.shape:
            size, index = self.data
            off[0] += index * glob[0]
            glob[0] *= size
        return glob, off


class Rng(TorchFunctionMode):
    """The active generator of a ``with hpf.rng(seed):`` block (see the module docstring).
    ``count`` is how many random ops the block has drawn; ``fold_in(i)`` is a generator for
    another stream (a step, a micro-batch)."""

    def __init__(self, seed: int, data_axes: str | Sequence[str] | None = None):
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

    def fold_in(self, data: int) -> Rng:
        """A generator over stream ``(seed, data)`` (JAX's ``fold_in``): per-step or per-micro-batch seeds.

        Args:
            data: an int (the step, the micro-batch index).
        Returns:
            A new ``Rng`` to enter with ``with``.
        """
        return Rng(stream_key(self.seed, int(data)) >> 1, self.data_axes)

    def __enter__(self):
        if self.active:
            raise PlanError("hpf.rng: this generator is already active; enter a fresh hpf.rng(seed) (or fold_in) instead")
        self.active, self.count, self.scope = True, 0, None
        return super().__enter__()

    def __exit__(self, *exc):
        self.active, self.scope = False, None
        return super().__exit__(*exc)

    @staticmethod
    def table(apply_fn, args: tuple, kwargs: dict, data: bool) -> Table:
        """The layout table of ``apply_fn`` on arguments shaped like these: computed once per runtime
        and argument signature (``Runtime.rng_tables``), whichever ``Rng`` asks (a new
        ``hpf.rng(seed)`` per step does not redo the meta runs)."""
        memo = getattr(getattr(apply_fn, "runtime", None), "rng_tables", None)
        key = (data, _signature((args, kwargs)))
        if memo is not None and key in memo:
            return memo[key]
        with temporarily_clear_interpreter_stack():  # the meta runs are no part of a torch.func transform
            table = layout_table(apply_fn, args, kwargs, data)
        if memo is not None:
            if len(memo) >= TABLES_KEPT:
                del memo[next(iter(memo))]  # the oldest signature
            memo[key] = table
        return table

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
        # an axis that splits the sequence among them (context parallelism; fsdp's dp_shard_cp): its ranks share
        # their examples
        cp = {b.planned.axis for b in apply_fn.program.boundaries if b.planned.style.splits_sequence}
        axes = tuple(a for a in axes if a not in cp)
        if not axes:
            return None
        return flat_index(mesh, axes[0] if len(axes) == 1 else axes)

    @staticmethod
    def _recomputed(apply_fn) -> tuple[str, ...]:
        blocks = tuple(getattr(apply_fn, "remat_blocks", None) or ())
        layout = getattr(apply_fn, "fsdp", None)
        if layout is not None and layout.reshard_after_forward and (
                torch._C._functorch.maybe_current_level() is not None or torch.compiler.is_compiling()):
            blocks += tuple(g.block for g in layout.groups if g.block is not None)
        return blocks

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        draw, run = drawn(func, args, kwargs)
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
        return run(Source(key, draw.shape, glob, off))


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
