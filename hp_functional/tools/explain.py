"""``explain``: what ``shard()`` decided — placements, the communication schedule and memory.

* ``render_program(program)``: per planned module, its parameters' placements and the lowered steps.
* ``schedule``: every collective one training step issues, in execution order, forward and
  backward, attributed to the planned module that issues it.  It is *measured*, not derived:
  ``shard()`` and one forward + backward of ``apply_fn`` run under ``FakeTensorMode`` (no memory
  is allocated, nothing is communicated, so it works on meta models, on any rank alone and under
  the fake process group of ``simulate``), while a dispatch mode records every
  ``torch.ops._c10d_functional`` collective.  Forward collectives belong to the innermost
  planned module running; backward ones to the module whose forward created the autograd node
  that runs them (autograd sequence numbers).  Parameter-gradient reductions are listed under
  the module that owns the parameter; those after the forward under ``(loss)`` (a loss-parallel
  plan's loss is a ``Local`` on the root module: under ``""``).
* ``memory``: per-rank parameter bytes, sharded vs replicated (shards are even, so every rank
  holds the same amounts).

``bytes`` of a collective is the size of the unsharded buffer it moves (NCCL-tests' "size"):
an all-reduce's tensor, an all-gather's output, a reduce-scatter's input, an all-to-all's
input.  On a ring each rank sends (n-1)/n of it for all-gather/reduce-scatter, 2(n-1)/n for
an all-reduce.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..core.placement import fmt_placements as _fmt
from ..core.program import Program
from ..plan.plan import ShardingPlan
from ..runtime.loss import scalar_loss
from ..runtime.shard import shard
from .record import CollectiveRecorder, ModuleClock, ScheduleRow


def render_program(program: Program) -> str:
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
        from .tables import schedule_table, to_text, totals_table  # rich: only when printed

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
        from .tables import memory_table, to_text  # rich: only when printed

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
        parts = [render_program(self.program), ""]
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


def explain(
    model: nn.Module, plan: ShardingPlan | Mapping, mesh: DeviceMesh, *args, batch: int | None = None,
    seq: int | None = None, dtype: torch.dtype | None = None, backward: bool = True, **kwargs,
) -> Explanation:
    """Compile ``plan`` for ``model`` on ``mesh`` and, given example inputs (``*args, **kwargs``
    as ``apply_fn`` takes them, this rank's local data; or ``batch=``/``seq=`` for HF
    ``input_ids``/``labels``), measure one step's communication schedule on fake tensors (the
    model is not touched).  Without a process group, or under ``simulate``, nothing is allocated
    or communicated; under a real one ``shard()`` agrees across ranks once (call ``explain`` on
    every rank, as ``shard``) and allocates the local shards (build the model on meta to avoid
    that).  ``dtype`` casts the parameters (and so the activations) for the byte counts.  The
    backward starts from ``scalar_loss`` of the output (HF's ``loss``, else the first output
    tensor's sum).  ``str()`` of the result is the readable report."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    # shard() agrees across ranks with one real collective unless there is no (or a fake) process group
    local_only = not dist.is_initialized() or dist.get_backend() == "fake"
    with fake if local_only else contextlib.nullcontext():
        apply_fn, params, _ = shard(model, plan, mesh, seed=None)  # a meta model stays shapes only
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
        bucketed = {k for b in program.param_buckets for k in b.keys}
        flat = [(key.rpartition(".")[0], s.backward) for key in program.infos if params[key].requires_grad
                and key not in bucketed for s in program.param_steps.get(key, ())]
        flat += [("(parameters)", "all_reduce") for _ in program.param_buckets]  # then one node per bucketed group
        clock = ModuleClock({b.planned.fqn for b in program.boundaries})
        recorder = CollectiveRecorder(clock, axes, flat, torch._C._autograd._get_sequence_nr())
        try:
            with clock, recorder:
                out = apply_fn(params, *args, **kwargs)
                loss = scalar_loss(out, who="apply_fn") if backward else None
                if loss is not None and loss.requires_grad:
                    loss.backward()
        except Exception as exc:  # noqa: BLE001 - reported: the static parts stay useful
            result.schedule_error = f"the forward could not run on these shapes: {type(exc).__name__}: {exc}"
            return result
    result.schedule = Schedule(recorder.rows)
    return result
