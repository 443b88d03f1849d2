"""``explain``: what ``shard()`` decided — placements, the communication schedule and memory.

``render_program`` lists per planned module its parameters' placements and lowered steps;
``explain`` also *measures* one training step's collectives (forward and backward, on fake
tensors, recorded by ``tools.record``) and per-rank parameter memory.  What is attributed to
which module, and how bytes count: docs/tools.md#explain (and ``record.ScheduleRow``).
"""

from __future__ import annotations

__all__ = ["Explanation", "Memory", "Schedule", "explain"]

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..core.placement import ShardInfo, fmt_placements as _fmt
from ..core.program import Program
from ..plan.plan import ShardingPlan
from ..runtime.loss import scalar_loss
from ..runtime.remat import Remat
from ..runtime.shard import shard
from ..train.fsdp import fsdp as fsdp_transform
from ..train.optim import Optimizer
from .estimate import StepMemory, block_paths, measure_step, optimizer_named
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
    """Bytes held by each rank: the parameters from the compiled layout (``sharded``, ``replicated``;
    under ``fsdp=`` this rank's rows), and, when ``explain`` ran a step (``batch=``/``seq=`` or inputs),
    ``step``: gradients, optimizer state, activations and the peak measured on fake tensors
    (``tools.estimate.StepMemory``; docs/tools.md#memory)."""

    sharded: int  # local shards of parameters sharded on some mesh axis
    replicated: int  # parameters replicated on every axis
    unsharded: int  # the whole model's parameters (tied weights once)
    world: int
    step: StepMemory | None = None  # one training step's memory (None: no step ran)
    optimizer: str = "adamw"  # what the optimizer-state row counts

    @property
    def per_rank(self) -> int:
        """Parameter bytes per rank."""
        return self.sharded + self.replicated

    @property
    def peak(self) -> int | None:
        """The step's peak bytes per rank (None without a step)."""
        return None if self.step is None else self.step.peak

    def rows(self) -> list[tuple[str, int]]:
        """(label, bytes) per line of the memory table."""
        rows = [("parameters: sharded (local shards)", self.sharded), ("parameters: replicated", self.replicated),
                ("parameters per rank", self.per_rank)]
        s = self.step
        if s is not None:
            rows += [("gradients", s.gradients), (f"optimizer state ({self.optimizer})", s.optimizer),
                     ("inputs", s.inputs), ("activations at the end of the forward", s.activations)]
            if s.blocks:
                largest = max(n for _, n in s.blocks)
                rows += [(f"  of which each block (largest of {len(s.blocks)})", largest),
                         ("  of which outside the blocks", s.activations - sum(n for _, n in s.blocks))]
            rows += [
                     ("transient (the rest of the peak)", s.transient),
                     ("peak in forward + backward", s.peak_backward), ("peak in the optimizer update", s.peak_update),
                     ("peak per rank", s.peak)]
        return rows + [("unsharded model (parameters)", self.unsharded)]

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
    memory_error: str | None = None  # why the step's memory could not be measured (the schedule still was)

    def __str__(self) -> str:
        parts = [render_program(self.program), ""]
        if self.schedule is not None:
            parts.append(str(self.schedule))
        else:
            parts.append(f"no schedule: {self.schedule_error or 'pass example inputs (or batch=, seq=) to explain()'}\n")
        parts.append(str(self.memory))
        if self.memory_error:
            parts.append(f"no step memory: {self.memory_error}")
        return "\n".join(parts)


def memory(infos: Mapping[str, ShardInfo], dtypes: Mapping[str, torch.dtype], world: int) -> Memory:
    """Per-rank parameter bytes from the layouts ``infos`` (this rank's local shapes), in ``dtypes``."""
    sharded = replicated = total = 0
    for key, info in infos.items():
        size = dtypes[key].itemsize
        local = info.local_shape.numel() * size
        total += info.global_shape.numel() * size
        if info.is_sharded:
            sharded += local
        else:
            replicated += local
    return Memory(sharded, replicated, total, world)


def explain(
    model: nn.Module, plan: ShardingPlan | Mapping, mesh: DeviceMesh, *args, batch: int | None = None,
    seq: int | None = None, dtype: torch.dtype | None = None, backward: bool = True,
    fsdp: bool | str | tuple[str, ...] = False, remat: bool | Sequence[str] | Remat | None = None,
    optimizer: str | Optimizer | None = "adamw", **kwargs,
) -> Explanation:
    """Compile ``plan`` for ``model`` on ``mesh`` and, given example inputs, measure one training step on
    fake tensors: its communication schedule and its per-rank memory (the model is not touched).
    Without a process group, or under ``simulate``, nothing is allocated or communicated; under a real
    one ``shard()`` agrees across ranks once (call ``explain`` on every rank, as ``shard``) and
    allocates the local shards (build the model on meta to avoid that).

    Args:
        model: the unsharded model; only read.
        plan: a ``ShardingPlan`` or a ``{pattern: style}`` dict.
        mesh: the device mesh.
        args, kwargs: example inputs as ``apply_fn`` takes them (this rank's local data).
        batch, seq: instead (or on top), HF ``input_ids``/``labels`` of zeros, ``[batch, seq]`` (defaults 1 and 16
            when only one is given); ``kwargs`` win over them.
        dtype: cast the parameters (and so the activations) to it for the byte counts; None: their own.
        backward: also run the backward, from ``scalar_loss`` of the output (HF's ``loss``, else the first
            output tensor's sum), and the optimizer's update.
        fsdp: also shard over a data-parallel axis with ``hpf.fsdp`` (True: ``"dp"``; or the axis, or axes),
            as the step and the memory then are.
        remat: ``shard(remat=...)``: the blocks recomputed in the backward.
        optimizer: whose state and update the memory counts: ``"adamw"`` (``hpf.optim.adamw``: two moments
            per leaf in the leaf's dtype), ``"sgd"`` (none), an ``hpf.optim.Optimizer``, or None.
    Returns:
        an ``Explanation`` (program, memory, and the schedule when inputs were given); its ``str()`` is the
        readable report."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    opt = optimizer_named(optimizer)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    apply_fn, params, infos, program, blocks = _sharded(model, plan, mesh, fake, fsdp=fsdp, remat=remat)
    dtypes = {k: dtype or program.dtypes[k] for k in infos}
    # the leaves as shard() made them (fake without a process group, real under one: a module that
    # converts its own parameters in its forward, Switch's router, needs them as they are), in ``dtypes``
    params = {k: v.detach().to(dtypes[k]).requires_grad_(v.requires_grad) for k, v in params.items()}
    with fake:
        name = optimizer if isinstance(optimizer, str) or optimizer is None else "custom"
        result = Explanation(program, dataclasses.replace(memory(infos, dtypes, program.mesh.size()),
                                                          optimizer=str(name)))
        kwargs = _token_batch(model, batch, seq, kwargs)
        if not args and not kwargs:
            return result
        rows = _record_step(apply_fn, params, args, kwargs, result, program=program, opt=opt, blocks=blocks,
                            backward=backward)
    if rows is not None:
        result.schedule = Schedule(rows)
    return result


def _sharded(model: nn.Module, plan: ShardingPlan | Mapping, mesh: DeviceMesh, fake, *,
             fsdp: bool | str | tuple[str, ...], remat) -> tuple[Callable, dict, dict[str, ShardInfo], Program, tuple[str, ...]]:
    """``shard()`` with ``seed=None`` (a meta model stays shapes only), then ``hpf.fsdp`` where asked: the
    ``apply_fn``, params and infos, ``shard()``'s program (the one ``explain`` renders and whose conversions
    the recorders attribute) and the recomputable blocks' paths.  Under ``fake`` where there is no (or a fake)
    process group; under a real one ``shard()`` agrees across ranks with one real collective."""
    local_only = not dist.is_initialized() or dist.get_backend() == "fake"
    with fake if local_only else contextlib.nullcontext():
        apply_fn, params, infos = shard(model, plan, mesh, seed=None, remat=remat)
        program = apply_fn.program
        blocks = block_paths(apply_fn.runtime.template)
        if fsdp is not False:
            apply_fn, params, infos = fsdp_transform(apply_fn, params, infos, mesh, "dp" if fsdp is True else fsdp)
    return apply_fn, params, infos, program, blocks


def _token_batch(model: nn.Module, batch: int | None, seq: int | None, kwargs: dict) -> dict:
    """``kwargs`` over HF ``input_ids``/``labels`` of zeros ``[batch, seq]`` when ``batch`` or ``seq`` is given
    (on the model's device; a model without parameters: the CPU), else ``kwargs`` as they are.  A training
    step builds no KV cache: ``use_cache=False`` where the forward takes it (so remat has none to drop)."""
    if batch is None and seq is None:
        return kwargs
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    ids = torch.zeros(batch or 1, seq or 16, dtype=torch.long, device=device)
    no_cache = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    return {"input_ids": ids, "labels": ids, **no_cache, **kwargs}


def _recorders(program: Program, params: Mapping[str, torch.Tensor]) -> Callable[[], tuple[ModuleClock, CollectiveRecorder]]:
    """A maker of a fresh (module clock, collective recorder) pair for one step of ``program``, which knows
    the parameter conversions' backward nodes: they run first, one autograd node per step of a parameter
    needing grad, then one node per bucketed group."""
    axes = {g.group_name: axis for axis, g in program.groups.items()}
    bucketed = {k for b in program.param_buckets for k in b.keys}
    flat = [(key.rpartition(".")[0], s.backward) for key in program.infos if params[key].requires_grad
            and key not in bucketed for s in program.param_steps.get(key, ())]
    flat += [("(parameters)", "all_reduce") for b in program.param_buckets if not b.gather]
    flat += [("(parameters)", program.param_steps[b.keys[0]][0].backward) for b in program.param_buckets if b.gather
             for _ in b.buckets]  # ShardedParams: one gather node per bucket

    def recorder() -> tuple[ModuleClock, CollectiveRecorder]:
        clock = ModuleClock({b.planned.fqn for b in program.boundaries})
        return clock, CollectiveRecorder(clock, axes, flat, torch._C._autograd._get_sequence_nr())

    return recorder


def _record_step(apply_fn, params: dict, args: tuple, kwargs: dict, result: Explanation, *, program: Program, opt,
                 blocks: tuple[str, ...], backward: bool) -> list[ScheduleRow] | None:
    """Run one step (forward; with ``backward``, the backward and ``opt``'s update, measuring its memory into
    ``result.memory``) under the recorders, and return the collectives recorded.  Where the step's accounting
    fails, the forward and backward are recorded alone (``result.memory_error`` says why); where the forward
    cannot run, None (``result.schedule_error`` says why): the static parts stay useful."""
    recorder = _recorders(program, params)
    clock, rec = recorder()

    @contextlib.contextmanager
    def recording():
        with clock, rec:
            yield

    try:
        if backward:
            try:
                step = measure_step(apply_fn, params, args, kwargs, opt, blocks, around=recording)
                result.memory = dataclasses.replace(result.memory, step=step)
            except Exception as exc:  # noqa: BLE001 - the step's accounting failed: record the schedule alone
                result.memory_error = f"{type(exc).__name__}: {str(exc)[:200]}"
                clock, rec = recorder()
                with recording():
                    loss = scalar_loss(apply_fn(params, *args, **kwargs), who="apply_fn")
                    if loss.requires_grad:
                        loss.backward()
        else:
            with recording():
                apply_fn(params, *args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - reported: the static parts stay useful
        result.schedule_error = f"the forward could not run on these shapes: {type(exc).__name__}: {exc}"
        return None
    return rec.rows
