"""``shard(model, plan, mesh)``: compile once, agree across ranks, slice, build the skeleton.

Phases (hyper_parallel's ``apply_sharding_plan`` without touching the model):
1. ``build_program`` — resolve, lint, place, analyse, lower (local: bad input raises on every
   rank before any collective);
2. ``agree`` — one small all-gather of a fingerprint of the program and the weights' checksums;
3. slice the local shards into the params pytree (inverse: ``unshard``);
4. build the private skeleton and install the local forwards on it, then the checkpointed
   blocks (``runtime.checkpoint``) around them.
"""

from __future__ import annotations

__all__ = ["shard"]

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ..compile.agree import agree
from ..compile.build import build_program
from ..compile.reduce import plan_marks, reduced_plan
from ..core.placement import ShardInfo
from ..core.program import Program
from ..core.raw_collectives import mesh_device
from ..plan.plan import ShardingPlan, as_plan
from .apply_fn import ApplyFn, make_apply_fn
from .boundary import ConversionCache, install_boundary
from .checkpoint import (
    ActivationCheckpoint,
    CheckpointPlan,
    check_recorded_outputs,
    install_checkpoints,
    neutralise_hf_checkpointing,
    resolve_checkpoint,
)
from .probe import VERDICTS, probe_copy_or_reason, probe_key, probe_varying_uses, run_probe
from .skeleton import build_skeleton
from .values import Values

#: ``install(skeleton, cache)``: a transform's last word on a freshly built skeleton (see ``Runtime``).
Installer = Callable[[nn.Module, ConversionCache], None]


@dataclass(frozen=True)
class Runtime:
    """What an ``apply_fn`` is built from, kept on it as ``apply_fn.runtime`` so that transforms
    (``hpf.fsdp``) build another ``apply_fn`` over the same program without the user's model:
    ``template`` is a pristine skeleton (meta placeholders, owned buffers, nothing installed)."""

    template: nn.Module
    program: Program
    checkpoint: CheckpointPlan | None
    checks: Mapping[str, str] = field(default_factory=dict)  # shard-time proof: what ran, what was skipped and why

    def build(self, program: Program | None = None, install: Installer | None = None) -> Callable:
        """A new ``apply_fn`` on a fresh skeleton (``program`` replaces this one's, e.g. with
        fewer parameter conversions); ``install`` runs after the boundaries and checkpoints."""
        return build_runtime(self.template, program or self.program, self.checkpoint, install)


def build_runtime(model: nn.Module, program: Program, checkpoint: CheckpointPlan | None = None,
                  install: Installer | None = None) -> ApplyFn:
    """The private skeleton of ``model`` with every boundary of ``program`` installed, and the
    blocks of ``checkpoint`` checkpointed, as ``apply_fn``.  Hugging Face's own checkpointing is
    turned off on the skeleton (``neutralise_hf_checkpointing``): ``shard()`` decided what replaces it.
    ``install``, if given, then adds a transform's forwards (``Runtime.build``)."""
    skeleton = build_skeleton(model, {k: i.local_shape for k, i in program.infos.items()}, program.leaf_of)
    neutralise_hf_checkpointing(skeleton)
    cache: ConversionCache = {}  # input conversions shared within one apply_fn call
    for b in program.boundaries:
        module = skeleton.get_submodule(b.planned.fqn)
        size = program.groups[b.planned.axis].size
        for attr in b.spec.divide_attrs:
            setattr(module, attr, getattr(module, attr) // size)
        for attr, value in b.spec.set_attrs.items():
            setattr(module, attr, value)
        inner = b.planned.style.local_forward(module, module.forward, fqn=b.planned.fqn, axis=b.planned.axis,
                                              axes=program.groups)
        install_boundary(module, b.planned.fqn, inner, b.in_steps, b.out_steps, cache)
    blocks = install_checkpoints(skeleton, checkpoint, program.leaf_of, cache, program.mesh.device_type) if checkpoint else {}
    if install is not None:
        install(skeleton, cache)
    apply_fn = make_apply_fn(skeleton, program, cache, lambda: build_runtime(model, program, checkpoint, install))
    return dataclasses.replace(apply_fn, checkpointed=blocks)


def shard(
    model: nn.Module, plan: ShardingPlan | Mapping, mesh: DeviceMesh, *, weights: str | os.PathLike | None = None,
    seed: int | None = 0, agree_timeout: float | None = 300.0, verify_values: bool = True,
    checkpoint: bool | Sequence[str] | ActivationCheckpoint | None = None, verify: bool = True,
) -> tuple[Callable, dict[str, Tensor], dict[str, ShardInfo]]:
    """Shard ``model`` by ``plan`` over ``mesh`` without mutating it.

    All checks are local and raise on every rank before any collective; then one small
    all-gather agrees on a fingerprint of the result and (``verify_values``) on a checksum of every
    parameter and buffer, so ranks holding different weights raise ``PlanMismatchError`` naming
    the tensors that differ.  docs/architecture.md#the-passes lists the steps.

    Args:
        model: the ``nn.Module`` to shard (on the mesh's device type, or on meta); only read.
        plan: a ``ShardingPlan`` or a plain ``{pattern: style}`` dict.
        mesh: a ``DeviceMesh`` with named dims that holds this rank.
        weights: a safetensors file, a folder with ``model.safetensors`` or a sharded checkpoint's
            index: the values come from there, each rank reading only its slices (build ``model``
            under ``torch.device("meta")`` so no rank ever holds it whole; docs/weights.md).
        seed: without ``weights``, meta parameters are initialised by their module's own init with
            generators seeded by ``(seed, module path)`` (``runtime.meta_init``; meta buffers are
            recomputed by their module's init either way); None: keep meta tensors on meta
            (shapes only, as ``explain`` and ``simulate`` use them; no probe).
        agree_timeout: seconds to wait for every rank at the agreement before raising; None: the
            process group's timeout.
        verify_values: include the value checksums in the agreement (False: fingerprint only).
        checkpoint: activation checkpointing (a block keeps no activations in the forward and is
            recomputed in the backward; works under ``.backward()`` and ``torch.func``): None —
            follow the model (the decoder layers on which Hugging Face's
            ``gradient_checkpointing_enable()`` was called, else none); False — none; True — every
            Hugging Face decoder layer; module-path patterns (``["model.layers.*"]``); or an
            ``ActivationCheckpoint``.  A pattern that matches no module raises ``PlanError``.
        verify: the shard-time proof — the plan run on a small private copy of the model (one
            block of each kind, random init, a synthetic batch) against the same copy unsharded,
            loss and every gradient, on the real ranks; a mismatch raises ``PlanError``
            (``runtime.probe``; ``apply_fn.runtime.checks`` says what ran).  False skips it.
    Returns:
        ``(apply_fn, params, shard_info)``: ``apply_fn(params, *args, **kwargs)`` returns what
        ``model(*args, **kwargs)`` returns; ``params`` maps each parameter FQN (tied groups once)
        to this rank's local shard; ``shard_info`` says where each shard sits (a ``ShardInfo`` per key).
    """
    program = build_program(model, plan, mesh)
    checks = {"dataflow": program.dataflow_skipped or "traced on meta tensors"}
    probe, probe_uses = None, None
    fake = dist.is_initialized() and dist.get_backend() == "fake"  # simulate(): collectives carry no numbers
    if verify and seed is not None and not fake:
        marks = plan_marks(program.boundaries, program.infos, program.leaf_of)
        probe, why = probe_copy_or_reason(model, seed, mesh_device(mesh), marks)
        checks["probe"] = why
        if probe is not None:  # the plan restated on the copy's paths (its blocks are renumbered)
            probe_plan = reduced_plan(as_plan(plan), model, probe, mesh.mesh_dim_names or ())
        if probe is not None and program.dataflow_skipped:  # trace the real copy instead (local, no collective)
            probe_uses, uses, skipped = probe_varying_uses(probe, probe_plan, mesh)
            if not skipped:
                program = build_program(model, plan, mesh, varying_uses=uses)
                checks["dataflow"] = "traced on the probe's real copy"
    key = probe_key(probe, probe_plan, mesh, probe_uses, program) if probe is not None else None
    values, blocks, cached = _agreed(model, program, weights, seed, agree_timeout, verify_values, checkpoint,
                                     key is not None and key in VERDICTS.items)  # probed before on every rank?
    if probe is not None and cached:
        checks["probe"] = f"{VERDICTS.get(key, str)} (probed before in this process: same structure, plan and mesh)"
    elif probe is not None:  # agreed, and before the weights are read: its memory is freed before theirs is taken
        def shard_probe(m, p, msh, uses):
            prog = build_program(m, p, msh, varying_uses=uses)
            return _shard(m, p, msh, prog, None, 0, agree_timeout, False, False)
        checks["probe"] = run_probe(probe, probe_plan, mesh, shard_probe, probe_uses) or "exact on the probe copy"
        VERDICTS.get(key, lambda: checks["probe"])
        del probe, shard_probe
    elif "probe" not in checks:
        checks["probe"] = ("skipped: verify=False" if not verify else "skipped: seed=None (shapes only)" if seed is None
                           else "skipped: a simulated (fake) process group carries no numbers")
    apply_fn, params, infos = _materialised(model, program, values, blocks)
    return dataclasses.replace(apply_fn, runtime=dataclasses.replace(apply_fn.runtime, checks=checks)), params, infos


def _shard(model: nn.Module, plan, mesh: DeviceMesh, program: Program, weights, seed: int | None,
           agree_timeout: float | None, verify_values: bool, checkpoint) -> tuple[Callable, dict[str, Tensor],
                                                                                  dict[str, ShardInfo]]:
    """``shard()`` after compiling: agree, slice, build the runtime."""
    values, blocks, _ = _agreed(model, program, weights, seed, agree_timeout, verify_values, checkpoint)
    return _materialised(model, program, values, blocks)


def _agreed(model: nn.Module, program: Program, weights, seed: int | None, agree_timeout: float | None,
            verify_values: bool, checkpoint, flag: bool = False) -> tuple[Values, tuple | None, bool]:
    """The local checks of the values and checkpointing, then the ranks' agreement (one small
    all-gather: the plan, the runtime and the values' checksums; and whether every rank raised
    ``flag``)."""
    blocks = resolve_checkpoint(model, checkpoint)
    if blocks is not None:
        check_recorded_outputs(model, "shard(checkpoint=...)", "drop checkpoint=")
    values = Values.prepare(model, program, weights, seed)
    runtime = {"checkpoint": repr(blocks), **values.fingerprint}  # ranks that recompute different blocks would hang
    everyone = agree(program, None if agree_timeout is None else timedelta(seconds=agree_timeout),
                     values.checked if verify_values else None, runtime, flag)
    return values, blocks, everyone


def _materialised(model: nn.Module, program: Program, values: Values, blocks) -> tuple[Callable, dict[str, Tensor],
                                                                                           dict[str, ShardInfo]]:
    """This rank's shards and the runtime over its skeleton."""
    params = values.local_shards()
    template = build_skeleton(model, {k: i.local_shape for k, i in program.infos.items()}, program.leaf_of, values.buffers)
    apply_fn = dataclasses.replace(build_runtime(template, program, blocks), runtime=Runtime(template, program, blocks))
    return apply_fn, params, program.infos
