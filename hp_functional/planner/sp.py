"""``auto_plan(sequence_parallel=True)``: Megatron-SP as ``llama_sp_plan`` writes it for HF Llama.

The residual stream is sequence-sharded from the first layer's input (not the embedding's output:
HF computes position ids and the causal mask from that shape), every norm on it is
``SequenceParallel``, every block (attention, MLP) is entered with ``PrepareInput`` Shard(1) →
Replicate (one all-gather; backward one reduce-scatter) and left by its rowwise projections'
reduce-scatter (``Rowwise(output_layout=Shard(1))``), and the head gathers the sequence
(``Colwise(input_layout=Shard(1))``).  Anything else with parameters on the sharded stream, or
blocks that are not children of the layers of one ``nn.ModuleList``, is a ``PlanError``.
"""

from __future__ import annotations

__all__ = ["sequence_parallel"]

import inspect
from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor import Replicate, Shard

from ..analysis.trace import ModelTrace
from ..core.errors import PlanError
from ..core.style import Style
from ..parallel.tensor.styles import Colwise, PrepareInput, Rowwise, SequenceParallel
from .blocks import Block, is_norm
from .heads import inside


def first_arg(module: nn.Module) -> str:
    """The name of ``module.forward``'s first positional parameter (the residual stream)."""
    params = [p for p in inspect.signature(module.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not params:
        raise PlanError(f"auto_plan: sequence_parallel: {type(module).__name__}.forward takes no positional argument")
    return params[0].name


def sequence_parallel(entries: dict[str, Style], roles: dict[str, str], blocks: Mapping[str, Block],
                      modules: Mapping[str, nn.Module], trace: ModelTrace, head: str | None) -> None:
    """Rewrite the tensor-parallel ``entries`` (and ``roles``) in place into the SP plan above."""
    stacks = {b.rpartition(".")[0].rpartition(".")[0] for b in blocks}
    if head is None or len(stacks) != 1 or not isinstance(modules.get(next(iter(stacks))), nn.ModuleList):
        raise PlanError("auto_plan: sequence_parallel needs an output head and every block (attention, MLP) as a direct "
                        f"child of a layer in one nn.ModuleList; found blocks {sorted(blocks)[:4]}")
    gathered = [b for b, blk in blocks.items() if blk.gathered]
    if gathered:
        raise PlanError(f"auto_plan: sequence_parallel: the heads of {gathered[0]} could not be localised, so its "
                        "projections gather their outputs, which a sequence-parallel block (a region entered "
                        "replicated) cannot split again; plan it with overrides={...} or drop sequence_parallel")
    stack, order = next(iter(stacks)), list(trace.calls)
    first = min((p for p in order if p.rpartition(".")[0] == stack), key=order.index)
    rep, seq = Replicate(), Shard(1)
    entries[first] = PrepareInput({first_arg(modules[first]): (rep, seq)})
    roles.setdefault(first, "first layer (the sequence is split at its input)")
    for path in order[order.index(first):]:
        m = modules.get(path)
        if m is None or path == head or path in blocks or any(inside(path, b) for b in blocks):
            continue
        if is_norm(m):
            entries[path], roles[path] = SequenceParallel(), "norm (SequenceParallel)"
        elif any(True for _ in m.parameters(recurse=False)):
            raise PlanError(f"auto_plan: sequence_parallel: {path} ({type(m).__name__}) runs on the sequence-sharded "
                            "residual stream and is neither a norm nor a block of projections")
    for path, blk in blocks.items():
        entries[path] = PrepareInput({first_arg(modules[path]): (seq, rep)}, divide_attrs=blk.heads.get(path, ()))
        roles[path] = "block (entered with an all-gather)"
        for p, s in blk.styles.items():
            if isinstance(s, Rowwise):
                entries[p] = Rowwise(input_layout=s.input_layout, output_layout=seq)
    entries[head] = Colwise(input_layout=seq, gather_output=True)
    last = _reshaped_after(trace, entries, head)
    if last is not None:  # the model reshapes the stream before the head (GPT-2: ``view(-1, seq, hidden)``)
        entries[last] = SequenceParallel(output_layout=rep)
        roles[last] = "last norm (SequenceParallel, gathers the sequence: the model reshapes after it)"
        entries[head] = Colwise(gather_output=True)


def _reshaped_after(trace: ModelTrace, entries: Mapping[str, Style], head: str) -> str | None:
    """The last SequenceParallel norm when a view/reshape outside the head takes its output:
    that reshape sees the local sequence, so the sequence is gathered at the norm instead."""
    norms = [p for p in trace.calls if isinstance(entries.get(p), SequenceParallel)]
    if not norms:
        return None
    last = norms[-1]
    after = [c for c in trace.shape_calls if last in c.sources and c.op in ("view", "reshape")
             and not (c.module == head or c.module.startswith(f"{head}."))]
    return last if after else None
