"""hp_functional: JAX-style functional sharding for PyTorch.

``apply_fn, params, shard_info = shard(model, plan, mesh)`` — the model is never mutated;
``apply_fn`` is a ``torch.func.functional_call`` forward whose parallelism is explicit
collectives that compose with ``torch.func`` (grad, vmap, jvp/vjp).
"""

from . import collectives
from .apply import compile_plan, shard
from .errors import PlanError, PlanMismatchError, PlanWarning, ShapeError
from .explain import Explanation, Memory, Schedule, ScheduleRow
from .explain import explain as explain_plan  # loads the submodule first, so the def below keeps the name
from .lint import Finding, lint
from .loss import vocab_parallel_cross_entropy
from .placement import ShardInfo, to_dtensor, unshard
from .plan import ShardingPlan
from .simulate import simulate
from .styles import (
    Colwise,
    Heads,
    ModuleSpec,
    ParamRule,
    PrepareInput,
    PrepareOutput,
    Rowwise,
    SequenceParallel,
    Style,
    VocabEmbedding,
    default_handlers,
)
from .styles import Replicate_ as Replicate
from .validate import PlacementMismatchError, ValidationError, ValidationReport, validate
from .validate_dtensor import validate_placements

__all__ = [
    "Colwise",
    "Explanation",
    "Finding",
    "Heads",
    "Memory",
    "ModuleSpec",
    "ParamRule",
    "PlacementMismatchError",
    "PlanError",
    "PlanMismatchError",
    "PlanWarning",
    "PrepareInput",
    "PrepareOutput",
    "Replicate",
    "Rowwise",
    "Schedule",
    "ScheduleRow",
    "SequenceParallel",
    "ShapeError",
    "ShardInfo",
    "ShardingPlan",
    "Style",
    "ValidationError",
    "ValidationReport",
    "VocabEmbedding",
    "collectives",
    "compile_plan",
    "default_handlers",
    "explain",
    "explain_plan",
    "lint",
    "shard",
    "simulate",
    "to_dtensor",
    "unshard",
    "validate",
    "validate_placements",
    "vocab_parallel_cross_entropy",
]


def explain(model, plan, mesh, *args, **kwargs) -> str:
    """The plan as text: placements and lowered steps per module; with example inputs (or
    ``batch=``, ``seq=``) the measured communication schedule; per-rank parameter memory.
    ``explain_plan`` returns the structured ``Explanation``."""
    return str(explain_plan(model, plan, mesh, *args, **kwargs))
