"""Where ``shard()`` takes each local shard's values from: the model, a safetensors checkpoint,
or the module's own init (a meta model without weights).

``InitialValues.prepare`` does every local check (the checkpoint's headers, missing tensors, shapes,
buffers recomputed) before ``shard()``'s one collective; ``local_shards`` reads or computes the
shards after it.  ``fingerprint`` joins the agreement, so ranks that read different checkpoints
or seed differently raise ``PlanMismatchError`` rather than train different models.
"""

from __future__ import annotations

__all__ = ["InitialValues"]

import os
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..core.placement import slice_local
from ..core.program import Program
from ..core.raw_collectives import mesh_device
from .meta_init import init_values
from .weights import WeightSource, open_weights, read_buffers, read_local, stored_names


@dataclass
class InitialValues:
    """Where one ``shard()`` call takes its leaves' initial values from (see the module docstring)."""

    model: nn.Module
    program: Program
    device: torch.device
    seed: int | None
    source: WeightSource | None
    names: dict[str, str] | None  # leaf key -> its name in the checkpoint
    buffers: dict[str, Tensor] | None  # materialised buffers for the skeleton (None: the model's own)
    fingerprint: dict[str, str]

    @classmethod
    def prepare(cls, model: nn.Module, program: Program, weights: str | os.PathLike | None, seed: int | None) -> InitialValues:
        """The local checks and the buffers; ``seed`` None keeps meta tensors on meta (shapes only)."""
        source = open_weights(weights) if weights is not None else None
        names = stored_names(source, program) if source is not None else None
        meta = seed is not None and (any(b.device.type == "meta" for b in model.buffers()) or any(
            model.get_parameter(k).device.type == "meta" for k in program.infos))
        device = mesh_device(program.mesh)
        buffers = read_buffers(source, model, device) if source is not None or meta else None
        if source is not None:
            fingerprint = {"weights": source.fingerprint()}
        else:
            fingerprint = {"init": f"seed {seed}"} if meta else {}
        return cls(model, program, device, seed, source, names, buffers, fingerprint)

    @property
    def checked(self) -> dict[str, Tensor]:
        """The tensors whose checksums ranks agree on: the model's own values (meta ones have
        none and are skipped) unless a checkpoint replaces them, and the materialised buffers."""
        own = {} if self.source is not None else dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        return own | (self.buffers or {})

    def local_shards(self) -> dict[str, Tensor]:
        """This rank's shard of every leaf, in ``program.infos`` order, ``requires_grad`` as the model's."""
        infos, model = self.program.infos, self.model
        if self.source is not None:
            local = read_local(self.source, self.names, infos, self.program.dtypes, self.device)
        else:  # sliced from the model; meta leaves initialised per module unless seed is None (kept on meta)
            init = self.seed is not None
            local = {k: slice_local(model.get_parameter(k), i) for k, i in infos.items()
                     if not (init and model.get_parameter(k).device.type == "meta")}
            if init:
                leaf_of = self.program.leaf_of
                kept = init_values(model, self.seed, lambda name, full: slice_local(full, infos[leaf_of[name]]).to(self.device))
                local |= {leaf_of[name]: t for name, t in kept.items()}
        return {k: local[k].requires_grad_(model.get_parameter(k).requires_grad) for k in infos}
