"""hp_functional: JAX-style functional sharding for PyTorch.

``apply_fn, params, shard_info = shard(model, plan, mesh)`` — the model is never mutated;
``apply_fn`` is a ``torch.func.functional_call`` forward whose parallelism is explicit
collectives that compose with ``torch.func`` (grad, vmap, jvp/vjp).

The package is layered (each imports only from those before it): ``core`` → ``plan`` →
``compile`` → ``runtime`` → ``train`` → ``tools`` → ``cli``; ``docs/architecture.md`` has the diagram.

The public names are imported lazily (PEP 562): ``import hp_functional`` imports neither torch
nor anything else until a name is first used, so the ``hp-functional`` command line (whose
module lives under this package) starts fast.  ``_LAZY`` is the one place that says which
submodule defines each name; the ``TYPE_CHECKING`` block repeats it for static tools.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .compile.build import build_program, lint
    from .compile.lint import Finding
    from .core import collectives
    from .core.cp_layout import cp_positions, cp_shard, cp_unshard
    from .core.errors import (
        CheckpointError,
        CollectiveError,
        InputMismatchError,
        PlanError,
        PlanMismatchError,
        PlanWarning,
        ReentrancyError,
        ReplicationError,
        ShapeError,
    )
    from .core.gather import unshard
    from .core.placement import ShardInfo, slice_local, to_dtensor
    from .core.program import Program
    from .core.raw_collectives import set_timeout
    from .plan.auto import auto_plan
    from .plan.context import ContextParallel
    from .plan.context_inputs import ContextInputs
    from .plan.experts import Experts, expert_mesh
    from .plan.experts_calls import ExpertsCall
    from .plan.local import Local
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
        default_handlers,
    )
    from .plan.vocab import VocabEmbedding, vocab_parallel_cross_entropy
    from .runtime.checkpoint import Checkpoint
    from .runtime.meta_init import init_weights
    from .runtime.pretrained import from_pretrained
    from .runtime.shard import shard
    from .runtime.state import buffers
    from .tools.explain import Explanation, Memory, Schedule, explain
    from .tools.explain_stage import StageExplanation, explain_stage
    from .tools.record import ScheduleRow
    from .tools.simulate import simulate
    from .tools.validate import validate
    from .tools.validate_dtensor import validate_placements
    from .tools.validation_report import PlacementMismatchError, ValidationError, ValidationReport
    from .train import optim
    from .train.clip import clip_grad_norm
    from .train.data_parallel import reduce_gradients
    from .train.dcp import Loaded, SaveHandle, latest, load, save
    from .train.export import export_hf
    from .train.fsdp import fsdp
    from .train.module import as_module
    from .train.pipeline import Stage, pipeline_split, shard_stage, stage_module, sum_tied
    from .train.pipeline_fn import gpipe

#: public name -> the submodule (relative to this package) that defines it.
_LAZY: dict[str, str] = {
    "build_program": ".compile.build",
    "lint": ".compile.build",
    "Finding": ".compile.lint",
    "CheckpointError": ".core.errors",
    "PlanError": ".core.errors",
    "PlanMismatchError": ".core.errors",
    "PlanWarning": ".core.errors",
    "ReplicationError": ".core.errors",
    "ShapeError": ".core.errors",
    "cp_positions": ".core.cp_layout",
    "cp_shard": ".core.cp_layout",
    "cp_unshard": ".core.cp_layout",
    "ShardInfo": ".core.placement",
    "slice_local": ".core.placement",
    "to_dtensor": ".core.placement",
    "unshard": ".core.gather",
    "Program": ".core.program",
    "ShardingPlan": ".plan.plan",
    "auto_plan": ".plan.auto",
    "ContextParallel": ".plan.context",
    "ContextInputs": ".plan.context_inputs",
    "Experts": ".plan.experts",
    "expert_mesh": ".plan.experts",
    "ExpertsCall": ".plan.experts_calls",
    "llama_sp_plan": ".plan.recipes",
    "megatron_plan": ".plan.recipes",
    "Colwise": ".plan.styles",
    "Heads": ".plan.styles",
    "ModuleSpec": ".plan.styles",
    "NoParallel": ".plan.styles",
    "ParamRule": ".plan.styles",
    "PrepareInput": ".plan.styles",
    "PrepareOutput": ".plan.styles",
    "Rowwise": ".plan.styles",
    "SequenceParallel": ".plan.styles",
    "Style": ".plan.styles",
    "Local": ".plan.local",
    "buffers": ".runtime.state",
    "VocabEmbedding": ".plan.vocab",
    "default_handlers": ".plan.styles",
    "Checkpoint": ".runtime.checkpoint",
    "vocab_parallel_cross_entropy": ".plan.vocab",
    "shard": ".runtime.shard",
    "init_weights": ".runtime.meta_init",
    "from_pretrained": ".runtime.pretrained",
    "export_hf": ".train.export",
    "save": ".train.dcp",
    "load": ".train.dcp",
    "latest": ".train.dcp",
    "Loaded": ".train.dcp",
    "SaveHandle": ".train.dcp",
    "clip_grad_norm": ".train.clip",
    "reduce_gradients": ".train.data_parallel",
    "fsdp": ".train.fsdp",
    "as_module": ".train.module",
    "gpipe": ".train.pipeline_fn",
    "explain_stage": ".tools.explain_stage",
    "StageExplanation": ".tools.explain_stage",
    "Stage": ".train.pipeline",
    "pipeline_split": ".train.pipeline",
    "shard_stage": ".train.pipeline",
    "stage_module": ".train.pipeline",
    "sum_tied": ".train.pipeline",
    "Explanation": ".tools.explain",
    "Memory": ".tools.explain",
    "Schedule": ".tools.explain",
    "explain": ".tools.explain",
    "ScheduleRow": ".tools.record",
    "simulate": ".tools.simulate",
    "validate": ".tools.validate",
    "validate_placements": ".tools.validate_dtensor",
    "CollectiveError": ".core.errors",
    "InputMismatchError": ".core.errors",
    "ReentrancyError": ".core.errors",
    "set_timeout": ".core.raw_collectives",
    "PlacementMismatchError": ".tools.validation_report",
    "ValidationError": ".tools.validation_report",
    "ValidationReport": ".tools.validation_report",
}
#: public names that are submodules themselves.
_SUBMODULES: dict[str, str] = {"collectives": ".core.collectives", "optim": ".train.optim"}

__all__ = [
    "CollectiveError",
    "InputMismatchError",
    "ReentrancyError",
    "set_timeout",
    "Checkpoint",
    "CheckpointError",
    "Colwise",
    "ContextParallel",
    "ContextInputs",
    "Experts",
    "ExpertsCall",
    "Explanation",
    "Finding",
    "Heads",
    "Loaded",
    "Local",
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
    "ReplicationError",
    "Rowwise",
    "SaveHandle",
    "Schedule",
    "ScheduleRow",
    "SequenceParallel",
    "ShapeError",
    "ShardInfo",
    "ShardingPlan",
    "Stage",
    "StageExplanation",
    "Style",
    "ValidationError",
    "ValidationReport",
    "VocabEmbedding",
    "as_module",
    "auto_plan",
    "buffers",
    "build_program",
    "clip_grad_norm",
    "collectives",
    "cp_positions",
    "cp_shard",
    "cp_unshard",
    "default_handlers",
    "expert_mesh",
    "explain",
    "explain_stage",
    "export_hf",
    "from_pretrained",
    "fsdp",
    "gpipe",
    "init_weights",
    "latest",
    "lint",
    "llama_sp_plan",
    "load",
    "megatron_plan",
    "optim",
    "pipeline_split",
    "reduce_gradients",
    "save",
    "shard",
    "shard_stage",
    "simulate",
    "slice_local",
    "stage_module",
    "sum_tied",
    "to_dtensor",
    "unshard",
    "validate",
    "validate_placements",
    "vocab_parallel_cross_entropy",
]


def __getattr__(name: str):
    """Import the submodule that defines ``name`` on first use and cache the name here."""
    if name in _SUBMODULES:
        value = importlib.import_module(_SUBMODULES[name], __name__)
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
