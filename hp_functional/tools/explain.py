"""``explain``: what ``shard()`` decided — placements, the communication schedule and memory.

``render_program`` lists per planned module its parameters' placements and lowered steps;
``explain`` also *measures* one training step's collectives (forward and backward, on fake
tensors, recorded by ``tools.record``) and per-rank parameter memory.  What is attributed to
which module, and how bytes count: docs/tools.md#explain (and ``record.ScheduleRow``).
"""

from __future__ import annotations

__all__ = ["Explanation", "Memory", "Schedule", "explain"]

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

        return to_text(schedule_table(self.rows)) + to_text(totals_table(self.totals()))


@dataclass(frozen=True)
class Memory:
    """Parameter bytes held by each rank (gradients take as much again); shards are even, so every
    rank holds the same amounts."""

    sharded: int  # local shards of parameters sharded on some mesh axis
    replicated: int  # parameters replicated on every axis
    unsharded: int  # the whole model's parameters (tied weights once)
    world: int

    @property
    def per_rank(self) -> int:
        return self.sharded + self.replicated

    def rows(self) -> list[tuple[str, int]]:
        """(label, bytes) per line of the memory table."""
        return [("sharded (local shards)", self.sharded), ("replicated", self.replicated), ("per rank", self.per_rank),
                ("unsharded model", self.unsharded)]

    def __str__(self) -> str:
        from .tables import memory_table, to_text  # rich: only when printed

        return to_text(memory_table(self.rows(), self.world))


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
    """Compile ``plan`` for ``model`` on ``mesh`` and, given example inputs, measure one step's
    communication schedule on fake tensors (the model is not touched).  Without a process group, or
    under ``simulate``, nothing is allocated or communicated; under a real one ``shard()`` agrees
    across ranks once (call ``explain`` on every rank, as ``shard``) and allocates the local shards
    (build the model on meta to avoid that).

    Args:
        model: the unsharded model; only read.
        plan: a ``ShardingPlan`` or a ``{pattern: style}`` dict.
        mesh: the device mesh.
        args, kwargs: example inputs as ``apply_fn`` takes them (this rank's local data).
        batch, seq: instead (or on top), HF ``input_ids``/``labels`` of zeros, ``[batch, seq]`` (defaults 1 and 16
            when only one is given); ``kwargs`` win over them.
        dtype: cast the parameters (and so the activations) to it for the byte counts; None: their own.
        backward: also run the backward, from ``scalar_loss`` of the output (HF's ``loss``, else the first
            output tensor's sum).
    Returns:
        an ``Explanation`` (program, memory, and the schedule when inputs were given); its ``str()`` is the
        readable report."""
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
            first = next(model.parameters(), None)  # a model without parameters: ids on the CPU
            device = first.device if first is not None else torch.device("cpu")
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
