"""``explain_stage``: one pipeline stage's communication per training step.

A step of ``microbatches`` micro-batches runs the stage's forward and backward once per
micro-batch, so its collectives (TP, FSDP, ... inside the stage, as ``explain`` records them on
fake tensors for one micro-batch) come ``microbatches`` times; between stages every micro-batch
sends its activation forward and receives its gradient back (torch's schedules issue these as
``isend``/``irecv`` on the ``pp`` group, GPipe and 1F1B alike: the schedule changes their order
and the memory held, not their number).
"""

from __future__ import annotations

__all__ = ["StageExplanation", "explain_stage"]

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..core.errors import PlanError
from ..plan.plan import ShardingPlan
from ..train.pipeline import Stage, stage_mesh, stage_plan, stage_view
from .explain import Explanation, Schedule, explain
from .record import ScheduleRow


@dataclass
class StageExplanation:
    """``explain_stage``'s result: ``per_microbatch`` (the stage's ``Explanation`` for one
    micro-batch), ``p2p`` (the stage's sends and receives of a whole step) and ``step`` (every
    collective and p2p transfer of one step, as ``(pass, op, axis) → (count, bytes)``)."""

    stage: Stage
    microbatches: int
    per_microbatch: Explanation
    p2p: Schedule

    @property
    def step(self) -> dict[tuple[str, str, str], tuple[int, int]]:
        out = {k: (n * self.microbatches, b * self.microbatches)
               for k, (n, b) in (self.per_microbatch.schedule.totals().items() if self.per_microbatch.schedule else ())}
        for k, (n, b) in self.p2p.totals().items():
            out[k] = (out.get(k, (0, 0))[0] + n, out.get(k, (0, 0))[1] + b)
        return out

    def __str__(self) -> str:
        from .tables import to_text, totals_table

        head = (f"pipeline stage {self.stage.index} of {self.stage.num_stages}: layers {list(self.stage.layers)}, "
                f"{self.microbatches} micro-batches per step\n\none micro-batch:\n")
        steps = Schedule([r for _ in range(self.microbatches) for r in (self.per_microbatch.schedule or Schedule()).rows]
                         + self.p2p.rows)
        return head + str(self.per_microbatch) + "\none step (all micro-batches, p2p included):\n" + to_text(
            totals_table(steps.totals()))


def _p2p(stage: Stage, microbatches: int, nbytes: int, axis: str, dtype: torch.dtype) -> Schedule:
    """Per micro-batch: the activation from the previous stage and to the next (forward), its
    gradient back (backward)."""
    i, rows = stage.index, []
    for _ in range(microbatches):
        if not stage.is_first:
            rows.append(ScheduleRow(f"(stage {i - 1} -> {i})", "fwd", "recv", axis, nbytes, str(dtype)))
        if not stage.is_last:
            rows.append(ScheduleRow(f"(stage {i} -> {i + 1})", "fwd", "send", axis, nbytes, str(dtype)))
    for _ in range(microbatches):
        if not stage.is_last:
            rows.append(ScheduleRow(f"(stage {i + 1} -> {i})", "bwd", "recv", axis, nbytes, str(dtype)))
        if not stage.is_first:
            rows.append(ScheduleRow(f"(stage {i} -> {i - 1})", "bwd", "send", axis, nbytes, str(dtype)))
    return Schedule(rows)


def explain_stage(model: nn.Module, stage: Stage, plan: ShardingPlan | Mapping, mesh: DeviceMesh, *, batch: int,
                  seq: int, microbatches: int, pp_axis: str = "pp", dtype: torch.dtype | None = None) -> StageExplanation:
    """The communication of ``stage`` in one step of ``batch`` sequences of ``seq`` tokens cut into
    ``microbatches`` (see the module docstring); the model is not touched.  Call it on every rank,
    as ``shard_stage``.  The activation between stages is the hidden state
    ``[batch / microbatches, seq, config.hidden_size]``.

    Args:
        model: the whole unsharded HF model; only read.
        stage: this rank's stage (from ``pipeline_split``; its index must be this rank's on ``pp_axis``).
        plan: the whole model's plan (``ShardingPlan`` or ``{pattern: style}``), cut to the stage here.
        mesh: the mesh including ``pp_axis``; the stage is sharded over the other axes.
        batch, seq: sequences per step and tokens per sequence.
        microbatches: micro-batches per step; must divide ``batch``.
        pp_axis: the pipeline mesh axis (the one the p2p transfers are attributed to).
        dtype: the parameters' and activations' dtype for the byte counts; None: the model's.
    Returns:
        a ``StageExplanation``: one micro-batch's ``Explanation``, the step's p2p transfers and the step totals."""
    if not (isinstance(microbatches, int) and microbatches > 0 and batch % microbatches == 0):
        raise PlanError(f"explain_stage: microbatches={microbatches!r} must divide batch={batch}")
    sub = stage_mesh(mesh, stage, pp_axis)
    view = stage_view(model, stage)
    mb, hidden = batch // microbatches, model.config.hidden_size
    first = next(model.parameters())
    act = dtype or first.dtype
    x = (torch.zeros(mb, seq, dtype=torch.long, device=first.device) if stage.is_first
         else torch.zeros(mb, seq, hidden, dtype=act, device=first.device))
    name = "input_ids" if stage.is_first else "inputs_embeds"
    one = explain(view, stage_plan(plan, view), sub, dtype=dtype, use_cache=False, **{name: x})
    nbytes = mb * seq * hidden * act.itemsize
    return StageExplanation(stage, microbatches, one, _p2p(stage, microbatches, nbytes, pp_axis, act))
