"""hp_functional: JAX-style functional sharding for PyTorch.

``apply_fn, params, shard_info = shard(model, plan, mesh)`` — the model is never mutated;
``apply_fn`` is a ``torch.func.functional_call`` forward whose parallelism is explicit
collectives that compose with ``torch.func`` (grad, vmap, jvp/vjp).

The package is layered (each imports only from those before it): ``core`` → ``plan`` →
``compile`` → ``runtime`` → ``train`` → ``tools`` → ``cli``; ``docs/architecture.md`` has the diagram.

The public names are imported lazily (PEP 562): ``import hp_functional`` imports neither torch
nor anything else until a name is first used, so the ``hp-functional`` command line (whose
module lives under this package) starts fast.  ``_LAZY`` is the one place that says which
submodule defines each name, and ``__all__`` is derived from it; the ``TYPE_CHECKING`` block
repeats it for static tools (``tests/cli/test_cli.py`` checks that the two agree).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `name as name`: an explicit re-export for static tools (PEP 484)
    from .compile.build import build_program as build_program, lint as lint
    from .compile.lint import Finding as Finding
    from .core import collectives as collectives
    from .core.counter_rng import gaussian_like as gaussian_like
    from .core.cp_layout import cp_positions as cp_positions, cp_shard as cp_shard, cp_unshard as cp_unshard
    from .core.errors import (
        CheckpointError as CheckpointError,
        CollectiveError as CollectiveError,
        InputMismatchError as InputMismatchError,
        PlanError as PlanError,
        PlanMismatchError as PlanMismatchError,
        PlanWarning as PlanWarning,
        ReentrancyError as ReentrancyError,
        ReplicationError as ReplicationError,
        ShapeError as ShapeError,
    )
    from .core.facets import Facet as Facet, ReducedOver as ReducedOver, RowSplit as RowSplit, SummedOver as SummedOver
    from .core.gather import unshard as unshard
    from .core.placement import ShardInfo as ShardInfo, slice_local as slice_local, to_dtensor as to_dtensor
    from .core.program import Program as Program
    from .core.raw_collectives import set_timeout as set_timeout
    from .core.style import (
        ModuleSpec as ModuleSpec,
        ParamRule as ParamRule,
        Style as Style,
        default_handlers as default_handlers,
    )
    from .parallel.context.inputs import ContextInputs as ContextInputs
    from .parallel.context.styles import ContextParallel as ContextParallel
    from .parallel.experts.calls import ExpertsCall as ExpertsCall
    from .parallel.experts.styles import Experts as Experts, expert_mesh as expert_mesh
    from .parallel.local import Local as Local
    from .parallel.tensor.channels import Channels as Channels
    from .parallel.tensor.styles import (
        Colwise as Colwise,
        Heads as Heads,
        NoParallel as NoParallel,
        PrepareInput as PrepareInput,
        PrepareOutput as PrepareOutput,
        Rowwise as Rowwise,
        SequenceParallel as SequenceParallel,
    )
    from .parallel.tensor.vocab import (
        VocabEmbedding as VocabEmbedding,
        vocab_parallel_cross_entropy as vocab_parallel_cross_entropy,
    )
    from .parallel.ulysses.styles import Ulysses as Ulysses
    from .plan.plan import ShardingPlan as ShardingPlan
    from .plan.recipes import llama_sp_plan as llama_sp_plan, megatron_plan as megatron_plan
    from .planner.auto import auto_plan as auto_plan
    from .runtime.apply_fn import ApplyFn as ApplyFn
    from .runtime.buffers import buffers as buffers
    from .runtime.meta_init import init_weights as init_weights
    from .runtime.pretrained import from_pretrained as from_pretrained
    from .runtime.remat import Remat as Remat
    from .runtime.rng import Rng as Rng, rng as rng
    from .runtime.shard import shard as shard
    from .tools.emulate import emulate as emulate
    from .tools.explain import Explanation as Explanation, Memory as Memory, Schedule as Schedule, explain as explain
    from .tools.explain_stage import StageExplanation as StageExplanation, explain_stage as explain_stage
    from .tools.record import ScheduleRow as ScheduleRow
    from .tools.simulate import simulate as simulate
    from .tools.validate import validate as validate
    from .tools.validate_dtensor import validate_placements as validate_placements
    from .tools.validation_report import (
        PlacementMismatchError as PlacementMismatchError,
        ValidationError as ValidationError,
        ValidationReport as ValidationReport,
    )
    from .train import optim as optim
    from .train.clip import clip_grad_norm as clip_grad_norm
    from .train.clip_per_example import clip_per_example as clip_per_example
    from .train.data_parallel import reduce_gradients as reduce_gradients
    from .train.dcp import Loaded as Loaded, SaveHandle as SaveHandle, latest as latest, load as load, save as save
    from .train.export import export_hf as export_hf
    from .train.export_peft import export_peft as export_peft
    from .train.fsdp import fsdp as fsdp
    from .train.generate import generate as generate
    from .train.module import as_module as as_module
    from .train.pipeline import (
        Stage as Stage,
        pipeline_split as pipeline_split,
        shard_stage as shard_stage,
        stage_module as stage_module,
        sum_tied as sum_tied,
    )
    from .train.pipeline_fn import gpipe as gpipe
    from .train.reshard import reshard as reshard

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
    "gaussian_like": ".core.counter_rng",
    "ShardInfo": ".core.placement",
    "Facet": ".core.facets",
    "RowSplit": ".core.facets",
    "SummedOver": ".core.facets",
    "ReducedOver": ".core.facets",
    "slice_local": ".core.placement",
    "to_dtensor": ".core.placement",
    "unshard": ".core.gather",
    "Program": ".core.program",
    "ShardingPlan": ".plan.plan",
    "auto_plan": ".planner.auto",
    "ContextParallel": ".parallel.context.styles",
    "ContextInputs": ".parallel.context.inputs",
    "Ulysses": ".parallel.ulysses.styles",
    "Experts": ".parallel.experts.styles",
    "expert_mesh": ".parallel.experts.styles",
    "ExpertsCall": ".parallel.experts.calls",
    "llama_sp_plan": ".plan.recipes",
    "megatron_plan": ".plan.recipes",
    "Channels": ".parallel.tensor.channels",
    "Colwise": ".parallel.tensor.styles",
    "Heads": ".parallel.tensor.styles",
    "ModuleSpec": ".core.style",
    "NoParallel": ".parallel.tensor.styles",
    "ParamRule": ".core.style",
    "PrepareInput": ".parallel.tensor.styles",
    "PrepareOutput": ".parallel.tensor.styles",
    "Rowwise": ".parallel.tensor.styles",
    "SequenceParallel": ".parallel.tensor.styles",
    "Style": ".core.style",
    "Local": ".parallel.local",
    "buffers": ".runtime.buffers",
    "VocabEmbedding": ".parallel.tensor.vocab",
    "default_handlers": ".core.style",
    "Remat": ".runtime.remat",
    "ApplyFn": ".runtime.apply_fn",
    "vocab_parallel_cross_entropy": ".parallel.tensor.vocab",
    "shard": ".runtime.shard",
    "init_weights": ".runtime.meta_init",
    "from_pretrained": ".runtime.pretrained",
    "rng": ".runtime.rng",
    "Rng": ".runtime.rng",
    "export_hf": ".train.export",
    "export_peft": ".train.export_peft",
    "save": ".train.dcp",
    "load": ".train.dcp",
    "latest": ".train.dcp",
    "Loaded": ".train.dcp",
    "SaveHandle": ".train.dcp",
    "clip_grad_norm": ".train.clip",
    "clip_per_example": ".train.clip_per_example",
    "reduce_gradients": ".train.data_parallel",
    "fsdp": ".train.fsdp",
    "generate": ".train.generate",
    "as_module": ".train.module",
    "gpipe": ".train.pipeline_fn",
    "reshard": ".train.reshard",
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
    "emulate": ".tools.emulate",
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

__all__ = sorted([*_LAZY, *_SUBMODULES])  # derived: _LAZY is the one export table


#: earlier public names -> their names now (a FutureWarning on use; not in ``__all__``).
_RENAMED: dict[str, str] = {  # beside CheckpointError (DCP) "checkpoint" misled: activation recompute is remat
    "Checkpoint": "Remat", "ActivationCheckpoint": "Remat"}


def __getattr__(name: str):
    """Import the submodule that defines ``name`` on first use and cache the name here."""
    if name in _RENAMED:
        import warnings

        warnings.warn(f"hp_functional.{name} is now hp_functional.{_RENAMED[name]}", FutureWarning, stacklevel=2)
        return __getattr__(_RENAMED[name])
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
