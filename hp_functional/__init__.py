"""hp_functional: JAX-style functional sharding for PyTorch.

``apply_fn, params, shard_info = shard(model, plan, mesh)`` — the model is never mutated;
``apply_fn`` is a ``torch.func.functional_call`` forward whose parallelism is explicit
collectives that compose with ``torch.func`` (grad, vmap, jvp/vjp).

The package is layered (each imports only from those before it): ``core`` → ``analysis`` →
``parallel`` → ``sources`` → ``plan`` → ``compile`` → ``planner`` → ``runtime`` → ``train`` →
``tools`` → ``cli``; the root only re-exports (``tests/test_layers.py``; the diagram:
``docs/architecture.md``).

The public names are imported lazily (PEP 562): ``import hp_functional`` imports neither torch
nor anything else until a name is first used, so the ``hp-functional`` command line (whose
module lives under this package) starts fast.  The imports of the ``TYPE_CHECKING`` block are the
one export table: static tools read them as imports, and ``_exports`` reads them (never running
them) for ``__all__`` and the lazy ``__getattr__``.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the one export table (`name as name`: an explicit re-export for static tools, PEP 484)
    from .compile.build import build_program as build_program, lint as lint
    from .core import collectives as collectives
    from .core.counter_rng import gaussian_like as gaussian_like
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
    from .core.findings import Finding as Finding
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
    from .parallel.context.cp_layout import cp_positions as cp_positions, cp_shard as cp_shard, cp_unshard as cp_unshard
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
        ShardedParams as ShardedParams,
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
    from .train.dcp import (
        AsyncSaves as AsyncSaves,
        Loaded as Loaded,
        SaveHandle as SaveHandle,
        latest as latest,
        load as load,
        save as save,
    )
    from .train.export import export_hf as export_hf
    from .train.export_peft import export_peft as export_peft
    from .train.fault_tolerance import FaultTolerant as FaultTolerant
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

def _exports() -> MappingProxyType[str, tuple[str, str]]:
    """Public name -> (submodule relative to this package, name there), read from the imports of
    the ``TYPE_CHECKING`` block above: the one export table, which static tools read as imports."""
    import ast

    source = __spec__.loader.get_source(__name__)  # type: ignore[union-attr]
    block = next(node for node in ast.parse(source).body
                 if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    return MappingProxyType({alias.asname or alias.name: ("." * stmt.level + (stmt.module or ""), alias.name)
                             for stmt in block.body for alias in stmt.names})


_EXPORTS = _exports()
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """Import the submodule that defines ``name`` on first use and cache the name here."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    parent = importlib.import_module(module, __name__)
    try:
        value = getattr(parent, attribute)
    except AttributeError:  # a submodule (`from .core import collectives`) not imported by its package yet
        value = importlib.import_module(f"{module}.{attribute}", __name__)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
