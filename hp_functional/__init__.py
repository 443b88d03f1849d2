"""hp_functional: JAX-style functional sharding for PyTorch.

``apply_fn, params, shard_info = shard(model, plan, mesh)`` — the model is never mutated;
``apply_fn`` is a ``torch.func.functional_call`` forward whose parallelism is explicit
collectives that compose with ``torch.func`` (grad, vmap, jvp/vjp).
"""

from . import collectives
from .apply import compile_plan, shard
from .errors import PlanError, PlanMismatchError, PlanWarning, ShapeError
from .loss import vocab_parallel_cross_entropy
from .placement import ShardInfo, to_dtensor, unshard
from .plan import ShardingPlan
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
    "Heads",
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
    "shard",
    "to_dtensor",
    "unshard",
    "validate",
    "validate_placements",
    "vocab_parallel_cross_entropy",
]


def explain(model, plan, mesh) -> str:
    """The resolved plan: per planned module, parameter placements and lowered collectives."""
    return compile_plan(model, plan, mesh).explain()
