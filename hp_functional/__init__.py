"""hp_functional: JAX-style functional sharding for PyTorch.

``apply_fn, params, shard_info = shard(model, plan, mesh)`` — the model is never mutated;
``apply_fn`` is a ``torch.func.functional_call`` forward whose parallelism is explicit
collectives that compose with ``torch.func`` (grad, vmap, jvp/vjp).

The package is layered (each imports only from those before it): ``core`` → ``plan`` →
``compile`` → ``runtime`` → ``tools`` → ``cli``; ``docs/architecture.md`` has the diagram.
"""

from .compile.build import build_program, lint
from .compile.lint import Finding
from .core import collectives
from .core.errors import PlanError, PlanMismatchError, PlanWarning, ShapeError
from .core.placement import ShardInfo, slice_local, to_dtensor, unshard
from .core.program import Program
from .plan.plan import ShardingPlan
from .plan.recipes import llama_sp_plan, megatron_plan
from .plan.styles import (
    Colwise,
    Heads,
    ModuleSpec,
    NoParallel,
    ParamRule,
    PrepareInput,
    PrepareOutput,
    Rowwise,
    SequenceParallel,
    Style,
    VocabEmbedding,
    default_handlers,
)
from .runtime.loss import vocab_parallel_cross_entropy
from .runtime.shard import shard
from .tools.explain import Explanation, Memory, Schedule, explain
from .tools.record import ScheduleRow
from .tools.simulate import simulate
from .tools.validate import validate
from .tools.validate_dtensor import validate_placements
from .tools.validation_report import PlacementMismatchError, ValidationError, ValidationReport

__all__ = [
    "Colwise",
    "Explanation",
    "Finding",
    "Heads",
    "Memory",
    "ModuleSpec",
    "NoParallel",
    "ParamRule",
    "PlacementMismatchError",
    "PlanError",
    "PlanMismatchError",
    "PlanWarning",
    "PrepareInput",
    "PrepareOutput",
    "Program",
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
    "build_program",
    "collectives",
    "default_handlers",
    "explain",
    "lint",
    "llama_sp_plan",
    "megatron_plan",
    "shard",
    "simulate",
    "slice_local",
    "to_dtensor",
    "unshard",
    "validate",
    "validate_placements",
    "vocab_parallel_cross_entropy",
]
