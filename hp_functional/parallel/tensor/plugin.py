"""Tensor parallelism as a plug-in (``core.parallelism``): the ``tp`` role, and loss parallel — the
output head keeps its logits vocab-sharded and a root entry computes the loss on them; its lint
check (sequence parallelism needs an entry that splits or gathers the sequence)."""

from __future__ import annotations

__all__ = ["PARALLELISM"]

from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType

from torch import nn
from torch.distributed.tensor import Shard

from ...core.errors import PlanError
from ...core.findings import Finding, Level
from ...core.parallelism import Parallelism, PlanView, Resolution
from ...core.paths import most_specific
from ...core.program import Planned
from ...core.style import ModuleSpec
from .styles import Colwise, SequenceParallel
from .vocab import loss_parallel_root


def loss_head(plan: PlanView, model: nn.Module) -> str:
    """The FQN of the output head whose logits stay vocab-sharded under ``loss_parallel``; a
    ``PlanError`` when the model has none or the plan does not plan it ``Colwise``."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get else None
    path = next((n for n, m in model.named_modules() if head is not None and m is head), None)
    if path is None:
        raise PlanError(f"loss_parallel: {type(model).__name__} has no output head (get_output_embeddings())")
    cands = plan.candidates(model).get(path)
    if not cands or not isinstance(most_specific(path, cands)[1], Colwise):  # the entry resolve() applies
        raise PlanError(f"loss_parallel: the output head {path!r} must be planned Colwise (vocab-sharded)")
    return path


def sequence_parallel_findings(planned: Mapping[str, Planned], specs: Mapping[str, ModuleSpec]) -> list[Finding]:
    """SequenceParallel modules need another entry that splits or gathers their sequence dim."""
    findings = []
    for p in planned.values():
        if not isinstance(p.style, SequenceParallel):
            continue
        seq = Shard(p.style.seq_dim)
        others = [
            q for q in planned.values() if not isinstance(q.style, SequenceParallel) and any(
                pl.get(p.axis) == seq for m in (specs[q.fqn].in_src, specs[q.fqn].in_dst, specs[q.fqn].out_src,
                                                specs[q.fqn].out_dst) for pl in m.values())
        ]
        if not others:
            findings.append(Finding(
                Level.WARNING, p.fqn, f"{p.fqn}: SequenceParallel, but no other plan entry splits or gathers dim "
                f"{p.style.seq_dim} on axis {p.axis!r} (e.g. Rowwise(output_layout=Shard(1)), PrepareInput to/from "
                "Shard(1)); its input must arrive sequence-sharded and its output is never gathered", "sequence-parallel"))
    return findings


class TensorParallelism(Parallelism):
    """Styles acting on the ``tp`` role; ``loss_parallel`` rewrites the head and adds the loss root."""

    name = "tensor"
    role = "tp"
    settings = MappingProxyType({"loss_parallel": False})

    def resolve(self, plan: PlanView, resolution: Resolution) -> Resolution:
        if not plan.settings.get("loss_parallel"):
            return resolution
        head = loss_head(plan, resolution.model)
        if head not in resolution.chosen:  # its entry was dropped (an optional tp axis the mesh lacks)
            return resolution
        pattern, style = resolution.chosen[head]
        axis = plan.axis_of(style, resolution.names)
        chosen = {**resolution.chosen, head: (pattern, replace(style, gather_output=False, output_layout=Shard(-1)))}
        root = Planned("", None, loss_parallel_root(axis), axis, "(loss_parallel)")
        return replace(resolution, chosen=chosen, root=root, vocab_axis=axis)

    def sharded_outputs(self, plan: PlanView, model: nn.Module) -> tuple[str, ...]:
        """Under ``loss_parallel``, the output head: its vocab-sharded logits are the loss's."""
        return (loss_head(plan, model),) if plan.settings.get("loss_parallel") else ()

    def lint(self, plan: PlanView, planned: Mapping[str, Planned], specs: Mapping[str, ModuleSpec]) -> list[Finding]:
        return sequence_parallel_findings(planned, specs)


PARALLELISM = TensorParallelism()
