"""``explain``: what ``shard()`` decided — placements, the communication schedule and memory.

* ``render(program)``: per planned module, its parameters' placements and the lowered steps.
* ``schedule``: every collective one training step issues, in execution order, forward and
  backward, attributed to the planned module that issues it.  It is *measured*, not derived:
  ``shard()`` and one forward + backward of ``apply_fn`` run under ``FakeTensorMode`` (no memory
  is allocated, nothing is communicated, so it works on meta models, on any rank alone and under
  the fake process group of ``simulate``), while a dispatch mode records every
  ``torch.ops._c10d_functional`` collective.  Forward collectives belong to the innermost
  planned module running; backward ones to the module whose forward created the autograd node
  that runs them (autograd sequence numbers).  Parameter-gradient reductions are listed under
  the module that owns the parameter; loss-parallel collectives under ``(loss)``.
* ``memory``: per-rank parameter bytes, sharded vs replicated (shards are even, so every rank
  holds the same amounts).

``bytes`` of a collective is the size of the unsharded buffer it moves (NCCL-tests' "size"):
an all-reduce's tensor, an all-gather's output, a reduce-scatter's input, an all-to-all's
input.  On a ring each rank sends (n-1)/n of it for all-gather/reduce-scatter, 2(n-1)/n for
an all-reduce.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .placement import fmt_placements as _fmt

if TYPE_CHECKING:
    from .apply import Program
    from .plan import ShardingPlan

_OPS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all"}


def render(program: Program) -> str:
    """Per planned module: its parameters' placements and the lowered collectives."""
    mesh = program.mesh
    lines = [f"mesh {dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True))}"]
    for b in program.boundaries:
        p = b.planned
        lines.append(f"{p.fqn}  [{type(p.style).__name__} on {p.axis!r}]")
        prefix = f"{p.fqn}."
        for key, info in program.infos.items():
            if key.startswith(prefix) and "." not in key[len(prefix):]:
                conv = " ; ".join(f"{s.forward}/{s.backward}" for s in program.param_steps.get(key, []))
                lines.append(
                    f"    param {key[len(prefix):]:<10} {_fmt(info.placements)} global {tuple(info.global_shape)}"
                    f" local {tuple(info.local_shape)}" + (f"  use: {conv}" if conv else "")
                )
        for kind, steps in (("in ", b.in_steps), ("out", b.out_steps)):
            for key, ss in steps.items():
                for s in ss:
                    lines.append(f"    {kind} {key!s:<10} {s.axis}: fwd {s.forward}, bwd {s.backward}")
    return "\n".join(lines)


# ---------------------------------------------------------------- results
@dataclass(frozen=True)
class ScheduleRow:
    """One collective of the schedule: who issues it, in which pass, on which axis, how big."""

    module: str  # planned module FQN, "(loss)", "(parameters)" or "(unplanned)"
    direction: str  # "fwd" or "bwd"
    op: str  # all_reduce, all_gather, reduce_scatter, all_to_all
    axis: str
    bytes: int  # size of the unsharded buffer (see the module docstring)
    dtype: str


@dataclass
class Schedule:
    """The collectives of one step (forward and backward) in execution order."""

    rows: list[ScheduleRow] = field(default_factory=list)

    def select(self, op: str | None = None, direction: str | None = None, axis: str | None = None) -> list[ScheduleRow]:
        """Rows matching every given field."""
        return [r for r in self.rows if (op is None or r.op == op) and (direction is None or r.direction == direction)
                and (axis is None or r.axis == axis)]

    def count(self, op: str | None = None, direction: str | None = None, axis: str | None = None) -> int:
        return len(self.select(op, direction, axis))

    def total_bytes(self, op: str | None = None, direction: str | None = None, axis: str | None = None) -> int:
        return sum(r.bytes for r in self.select(op, direction, axis))

    def totals(self) -> dict[tuple[str, str, str], tuple[int, int]]:
        """(direction, op, axis) → (count, bytes)."""
        out: dict[tuple[str, str, str], tuple[int, int]] = {}
        for r in self.rows:
            n, b = out.get((r.direction, r.op, r.axis), (0, 0))
            out[(r.direction, r.op, r.axis)] = (n + 1, b + r.bytes)
        return out

    def __str__(self) -> str:
        return to_text(schedule_table(self)) + to_text(totals_table(self))


@dataclass(frozen=True)
class Memory:
    """Parameter bytes held by each rank (gradients take as much again)."""

    sharded: int  # local shards of parameters sharded on some mesh axis
    replicated: int  # parameters replicated on every axis
    unsharded: int  # the whole model's parameters (tied weights once)
    world: int

    @property
    def per_rank(self) -> int:
        return self.sharded + self.replicated

    def __str__(self) -> str:
        return to_text(memory_table(self))


@dataclass
class Explanation:
    """``explain``'s result: the compiled program, its schedule (None without example inputs,
    ``schedule_error`` when the forward could not run) and per-rank memory."""

    program: Program
    memory: Memory
    schedule: Schedule | None = None
    schedule_error: str | None = None

    def __str__(self) -> str:
        parts = [render(self.program), ""]
        if self.schedule is not None:
            parts.append(str(self.schedule))
        else:
            parts.append(f"no schedule: {self.schedule_error or 'pass example inputs (or batch=, seq=) to explain()'}\n")
        parts.append(str(self.memory))
        return "\n".join(parts)


def memory(program: Program, model: nn.Module, dtype: torch.dtype | None = None) -> Memory:
    """Per-rank parameter bytes from ``program.infos`` (``dtype`` overrides the parameters')."""
    sharded = replicated = total = 0
    for key, info in program.infos.items():
        size = (dtype or model.get_parameter(key).dtype).itemsize
        local = info.local_shape.numel() * size
        total += info.global_shape.numel() * size
        if info.is_sharded:
            sharded += local
        else:
            replicated += local
    return Memory(sharded, replicated, total, program.mesh.size())


# ---------------------------------------------------------------- recording
class _Clock:
    """Global module hooks: which planned module runs (forward) and which autograd sequence
    numbers each planned module's forward allocated (to attribute backward nodes)."""

    def __init__(self, planned: set[str]):
        self.planned = planned
        self.names: dict[int, str] | None = None  # id(skeleton module) → FQN, from the first (root) call
        self.stack: list[tuple[str, int]] = []  # (fqn, first sequence nr) of running planned modules
        self.spans: list[tuple[int, int, str]] = []
        self.root_span: tuple[int, int] | None = None
        self.depth = 0

    def __enter__(self) -> _Clock:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self._handles = [register_module_forward_pre_hook(self._pre),
                         register_module_forward_hook(self._post, always_call=True)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()

    def _pre(self, module, args) -> None:
        if self.names is None:
            self.names = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
            self.root_start = torch._C._autograd._get_sequence_nr()
        self.depth += 1
        fqn = self.names.get(id(module))
        if fqn in self.planned:
            self.stack.append((fqn, torch._C._autograd._get_sequence_nr()))

    def _post(self, module, args, output) -> None:
        self.depth -= 1
        now = torch._C._autograd._get_sequence_nr()
        if self.stack and self.names is not None and self.stack[-1][0] == self.names.get(id(module)):
            fqn, start = self.stack.pop()
            self.spans.append((start, now, fqn))
        if self.depth == 0 and self.root_span is None:
            self.root_span = (self.root_start, now)

    def forward_owner(self) -> str:
        if self.stack:
            return self.stack[-1][0]
        return "(parameters)" if self.names is None else "(loss)" if self.root_span else "(unplanned)"

    def backward_owner(self, seq: int) -> str:
        inside = [(end - start, fqn) for start, end, fqn in self.spans if start <= seq < end]
        if inside:
            return min(inside)[1]
        if self.root_span and seq >= self.root_span[1]:
            return "(loss)"
        return "(parameters)" if self.root_span is None or seq < self.root_span[0] else "(unplanned)"


class _Recorder(TorchDispatchMode):
    """Records every ``_c10d_functional`` collective with its owner, pass, axis and size."""

    def __init__(self, clock: _Clock, axes: dict[str, str], params: list[tuple[str, str]], first_seq: int):
        super().__init__()
        self.clock, self.axes, self.params, self.first_seq = clock, axes, params, first_seq
        self.rows: list[ScheduleRow] = []

    def _owner(self, op: str) -> tuple[str, str]:
        if torch._C._current_graph_task_id() == -1:
            return self.clock.forward_owner(), "fwd"
        node = torch._C._current_autograd_node()
        seq = node._sequence_nr() if node is not None else -1
        owner = self.clock.backward_owner(seq)
        index = seq - self.first_seq
        if owner == "(parameters)" and 0 <= index < len(self.params) and self.params[index][1].startswith(op):
            owner = self.params[index][0]  # the module owning the converted parameter
        return owner, "bwd"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "_c10d_functional" and name != "wait_tensor":
            x, op = args[0], _OPS.get(name, name)
            size = x.numel() * x.element_size() * (args[1] if op == "all_gather" else 1)
            module, direction = self._owner(op)
            self.rows.append(ScheduleRow(module, direction, op, self.axes.get(str(args[-1]), str(args[-1])), size,
                                        str(x.dtype).removeprefix("torch.")))
        return func(*args, **(kwargs or {}))


def _scalar(out) -> torch.Tensor | None:
    """What to call ``backward`` on: the output's ``loss`` if it has one, else the sum of its
    floating-point tensors (the collectives do not depend on the gradient's values)."""
    loss = getattr(out, "loss", None) if not isinstance(out, torch.Tensor) else None
    if isinstance(loss, torch.Tensor):
        return loss
    leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    return sum(t.sum() for t in leaves) if leaves else None


def explain(
    model: nn.Module, plan: ShardingPlan | dict, mesh: DeviceMesh, *args, batch: int | None = None, seq: int | None = None,
    dtype: torch.dtype | None = None, backward: bool = True, **kwargs,
) -> Explanation:
    """Compile ``plan`` for ``model`` on ``mesh`` and, given example inputs (``*args, **kwargs``
    as ``apply_fn`` takes them, this rank's local data; or ``batch=``/``seq=`` for HF
    ``input_ids``/``labels``), measure one step's communication schedule on fake tensors (the
    model is not touched).  Without a process group, or under ``simulate``, nothing is allocated
    or communicated; under a real one ``shard()`` agrees across ranks once (call ``explain`` on
    every rank, as ``shard``) and allocates the local shards (build the model on meta to avoid
    that).  ``dtype`` casts the parameters (and so the activations) for the byte counts."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .apply import shard

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    # shard() agrees across ranks with one real collective unless there is no (or a fake) process group
    local_only = not dist.is_initialized() or dist.get_backend() == "fake"
    with fake if local_only else contextlib.nullcontext():
        apply_fn, params, _ = shard(model, plan, mesh)
    with fake:
        program = apply_fn.program
        result = Explanation(program, memory(program, model, dtype))
        if batch is not None or seq is not None:
            device = next(model.parameters()).device
            ids = torch.zeros(batch or 1, seq or 16, dtype=torch.long, device=device)
            kwargs = {"input_ids": ids, "labels": ids, **kwargs}
        if not args and not kwargs:
            return result
        if dtype is not None:
            params = {k: v.detach().to(dtype).requires_grad_(v.requires_grad) for k, v in params.items()}
        axes = {g.group_name: axis for axis, g in program.groups.items()}
        # the parameter conversions run first, one autograd node per step of a parameter needing grad
        flat = [(key.rpartition(".")[0], s.backward) for key in program.infos if params[key].requires_grad
                for s in program.param_steps.get(key, ())]
        clock = _Clock({b.planned.fqn for b in program.boundaries})
        recorder = _Recorder(clock, axes, flat, torch._C._autograd._get_sequence_nr())
        try:
            with clock, recorder:
                out = apply_fn(params, *args, **kwargs)
                loss = _scalar(out) if backward else None
                if loss is not None:
                    loss.backward()
        except Exception as exc:  # noqa: BLE001 - reported: the static parts stay useful
            result.schedule_error = f"the forward could not run on these shapes: {type(exc).__name__}: {exc}"
            return result
    result.schedule = Schedule(recorder.rows)
    return result


# ---------------------------------------------------------------- tables
def human(n: int) -> str:
    """Bytes as B/KiB/MiB/GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def to_text(renderable, width: int = 120) -> str:
    """A rich renderable as plain text."""
    buf = io.StringIO()
    Console(file=buf, width=width, no_color=True, highlight=False).print(renderable)
    return buf.getvalue()


def _label(module: str) -> str:
    return "(root)" if module == "" else module


def schedule_table(schedule: Schedule) -> Table:
    """One row per collective, in execution order."""
    table = Table(title="communication schedule (one step)", title_justify="left")
    for col in ("#", "module", "pass", "collective", "axis", "bytes"):
        table.add_column(col, justify="right" if col in ("#", "bytes") else "left")
    for i, r in enumerate(schedule.rows):
        table.add_row(str(i), _label(r.module), r.direction, r.op, r.axis, human(r.bytes))
    return table


def totals_table(schedule: Schedule) -> Table:
    """Count and bytes per (pass, collective, axis)."""
    table = Table(title="totals per step", title_justify="left")
    for col in ("pass", "collective", "axis", "count", "bytes"):
        table.add_column(col, justify="right" if col in ("count", "bytes") else "left")
    for (direction, op, axis), (n, b) in sorted(schedule.totals().items()):
        table.add_row(direction, op, axis, str(n), human(b))
    return table


def memory_table(mem: Memory) -> Table:
    """Per-rank parameter memory."""
    table = Table(title=f"parameter memory per rank ({mem.world} ranks)", title_justify="left")
    table.add_column("")
    table.add_column("bytes", justify="right")
    for label, value in (("sharded (local shards)", mem.sharded), ("replicated", mem.replicated),
                         ("per rank", mem.per_rank), ("unsharded model", mem.unsharded)):
        table.add_row(label, human(value))
    return table


def params_table(program: Program) -> Table:
    """Per parameter: global shape, placement on each mesh axis, local shape."""
    axes = list(program.mesh.mesh_dim_names)
    table = Table(title="parameters", title_justify="left")
    for col in ("parameter", "global shape", *axes, "local shape"):
        table.add_column(col)
    for key in program.infos:
        info = program.infos[key]
        aliases = f" (= {', '.join(info.aliases)})" if info.aliases else ""
        table.add_row(key + aliases, str(tuple(info.global_shape)), *(str(p) for p in info.placements),
                      str(tuple(info.local_shape)))
    return table
