"""``shard(model, plan, mesh)``: compile once, agree across ranks, prove, materialise.

``shard`` composes four steps, each a function of this module (docs/architecture.md#the-passes):

1. ``compile_sharding`` — ``build_program`` (resolve, lint, place, analyse, lower: bad input raises
   on every rank before any collective) and the proof's local preparation: the probe copy
   (``runtime.probe``), on whose real forward the dataflow pass is re-run when the meta trace could not;
2. ``agree_on`` — the values' and recompute's local checks, then one small all-gather of a
   fingerprint of the program, the runtime and the weights' checksums (and whether every rank
   proved this before: ``ProbeCache``);
3. ``prove`` — the probe: the plan run on the copy against the copy unsharded, on the real ranks
   (collectives: after the agreement, so ranks that disagree raise before it);
4. ``materialise`` — slice this rank's shards (inverse: ``unshard``), build the private skeleton,
   install the local forwards and the recomputed blocks (``runtime.remat``) on it.
"""

from __future__ import annotations

__all__ = ["shard"]

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ..analysis.trace import example_call
from ..compile.agree import agree
from ..compile.build import build_program
from ..compile.dataflow import Unchecked, synthesize_inputs, unchecked_in_regions
from ..compile.reduced_copy import Reduced, plan_marks, reduced_plan
from ..core.collectives import AxisGroup
from ..core.errors import PlanError
from ..core.placement import ShardInfo
from ..core.program import Program
from ..core.raw_collectives import mesh_device
from ..plan.plan import ShardingPlan, as_plan
from ..planner.report import AutoPlan
from .apply_fn import ApplyFn, make_apply_fn
from .boundary import ConversionCache, install_boundary
from .initial_values import InitialValues
from .probe import ProbeCache, Verdict, own_draws, probe_key, probe_varying_uses, run_probe
from .probe_copy import probe_copy_or_reason, probe_inputs
from .remat import (
    Remat,
    RematPlan,
    check_recorded_outputs,
    install_remat,
    neutralise_hf_checkpointing,
    resolve_remat,
)
from .skeleton import build_skeleton

#: ``install(skeleton, cache)``: a transform's last word on a freshly built skeleton (see ``Runtime``).
Installer = Callable[[nn.Module, ConversionCache], None]

#: ``shard()``'s result: ``(apply_fn, params, shard_info)``
Sharded = tuple[Callable, dict[str, Tensor], dict[str, ShardInfo]]


@dataclass(frozen=True)
class Runtime:
    """What an ``apply_fn`` is built from, kept on it as ``apply_fn.runtime`` so that transforms
    (``hpf.fsdp``) build another ``apply_fn`` over the same program without the user's model:
    ``template`` is a pristine skeleton (meta placeholders, owned buffers, nothing installed);
    ``remat``: the blocks recomputed in the backward."""

    template: nn.Module
    program: Program
    remat: RematPlan | None
    checks: Mapping[str, str] = field(default_factory=dict)  # shard-time proof: what ran, what was skipped and why
    #: ``hpf.rng``'s layout tables by (data axes, argument signature): each a function of this runtime and those
    #: shapes alone, kept so that every ``with hpf.rng(seed):`` over this apply_fn reuses them (``runtime.rng``)
    rng_tables: dict = field(default_factory=dict, compare=False, repr=False)
    #: ``hpf.clip_per_example``'s ghost runs (a tapped skeleton each) by (owned leaves, layout), kept for the
    #: next call (``train.clip_per_example``)
    ghost_runs: dict = field(default_factory=dict, compare=False, repr=False)

    def build(self, program: Program | None = None, install: Installer | None = None, *,
              axes: Sequence[AxisGroup] = (), local_shapes: Mapping[str, torch.Size] | None = None) -> Callable:
        """A new ``apply_fn`` on a fresh skeleton (``program`` replaces this one's, e.g. with
        fewer parameter conversions); ``install`` runs after the boundaries and recomputed blocks,
        and its forwards communicate over ``axes`` besides the program's; ``local_shapes``: the
        leaves' shapes where they are not the program's (``make_apply_fn``)."""
        return build_runtime(self.template, program or self.program, remat=self.remat, install=install, axes=axes,
                             local_shapes=local_shapes)


def build_runtime(model: nn.Module, program: Program, *, remat: RematPlan | None = None,
                  install: Installer | None = None, axes: Sequence[AxisGroup] = (),
                  local_shapes: Mapping[str, torch.Size] | None = None) -> ApplyFn:
    """The private skeleton of ``model`` with every boundary of ``program`` installed, and the
    blocks of ``remat`` recomputed in the backward, as ``apply_fn``.  Hugging Face's own
    checkpointing is turned off on the skeleton (``neutralise_hf_checkpointing``): ``shard()``
    decided what replaces it.  ``install``, if given, then adds a transform's forwards (``Runtime.build``),
    which communicate over ``axes`` besides the program's (``make_apply_fn``)."""
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
    blocks = install_remat(skeleton, remat, program.leaf_of, cache, program.mesh.device_type) if remat else {}
    if install is not None:
        install(skeleton, cache)
    rebuild = functools.partial(build_runtime, model, program, remat=remat, install=install, axes=axes,
                                local_shapes=local_shapes)
    apply_fn = make_apply_fn(skeleton, program, cache, rebuild, axes=axes, local_shapes=local_shapes)
    return dataclasses.replace(apply_fn, remat_blocks=blocks)


def shard(
    model: nn.Module, plan: ShardingPlan | Mapping, mesh: DeviceMesh, *, weights: str | os.PathLike | None = None,
    seed: int | None = 0, agree_timeout: float | None = 300.0, verify_values: bool = True,
    remat: bool | Sequence[str] | Remat | None = None, verify: bool = True,
    probe_cache: ProbeCache | None = None, example_inputs=None, allow_unproved: bool = False,
) -> Sharded:
    """Shard ``model`` by ``plan`` over ``mesh`` without mutating it.

    All checks are local and raise on every rank before any collective; then one small all-gather agrees on a
    fingerprint of the result and (``verify_values``) on a checksum of every parameter and buffer, so ranks holding
    different weights raise ``PlanMismatchError`` naming the tensors that differ (steps: docs/architecture.md#the-passes).

    Args:
        model: the ``nn.Module`` to shard (on the mesh's device type, or on meta); only read.
        plan: a ``ShardingPlan`` or a plain ``{pattern: style}`` dict.
        mesh: a ``DeviceMesh`` with named dims that holds this rank.
        weights: a safetensors file, a folder with ``model.safetensors`` or a sharded checkpoint's index: the values
            come from there, each rank reading only its slices (build ``model`` under ``torch.device("meta")`` so no
            rank ever holds it whole; docs/weights.md).
        seed: without ``weights``, meta parameters are initialised by their module's own init with generators seeded
            by ``(seed, module path)`` (``runtime.meta_init``; meta buffers are recomputed by their module's init
            either way); None: keep meta tensors on meta (shapes only, as ``explain`` and ``simulate`` use them; no probe).
        agree_timeout: seconds to wait for every rank at the agreement before raising; None: the process group's timeout.
        verify_values: include the value checksums in the agreement (False: fingerprint only).
        remat: activation recompute (a block keeps no activations in the forward and is recomputed in the backward;
            works under ``.backward()`` and ``torch.func``): None — follow the model (the decoder layers on which
            Hugging Face's ``gradient_checkpointing_enable()`` was called, else none); False — none; True — every
            Hugging Face decoder layer; module-path patterns (``["model.layers.*"]``); or a ``Remat``.  A pattern
            that matches no module raises ``PlanError``.
        verify: the shard-time proof — the plan run on a small private copy of the model (one block of each kind, random
            init, a synthetic batch) against the same copy unsharded, loss and every gradient, on the real ranks; a
            mismatch raises ``PlanError`` (``runtime.probe``; ``apply_fn.runtime.checks`` says what ran).  False skips it.
        probe_cache: where passed proofs are remembered, so the same structure, plan and mesh is probed once: a
            ``runtime.probe.ProbeCache`` the caller keeps (one per process-group world) and passes to each
            ``shard()``; None (the default): always probe.
        example_inputs: what one forward of ``model`` takes — a tensor, a tuple of positional arguments or a dict
            of keyword arguments (as ``auto_plan``'s) — for the dataflow pass (traced on meta) and the probe (fed to
            its copy) instead of the token ids they synthesize only for a model whose first layer is an embedding
            or a linear layer; None with an ``auto_plan`` plan: the batch it was given.  Without any, such a
            model's plan is refused unless ``allow_unproved`` (docs/guarantees.md#exact-or-refused).
        allow_unproved: accept a plan that nothing of the proof could check (the dataflow pass could not trace the
            forward, or cannot see inside a style that runs its own function, and the probe did not compare the
            gradients), knowingly: ``apply_fn.runtime.checks["proof"]`` then says ``unproved``.  False (the
            default): such a plan is refused with ``PlanError``, saying what could not be seen (``example_inputs``
            usually lets both run).
    Returns:
        ``(apply_fn, params, shard_info)``: ``apply_fn(params, *args, **kwargs)`` returns what ``model(*args,
        **kwargs)`` returns; ``params`` maps each parameter FQN (tied groups once) to this rank's local shard;
        ``shard_info`` says where each shard sits (a ``ShardInfo`` per key)."""
    with own_draws(getattr(mesh, "device_type", "cpu")):  # the checks' forwards leave the caller's generator as it was
        program, checks, proof = _compile_locally(model, plan, mesh, seed=seed, verify=verify,
                                                  example_inputs=example_inputs, allow_unproved=allow_unproved)
        proved = None if proof is None or probe_cache is None else probe_cache.lookup(proof.key)
        agreed = agree_on(model, program, weights=weights, seed=seed, agree_timeout=agree_timeout,
                          verify_values=verify_values, remat=remat, proved_before=proved is not None)
        if proof is not None:  # agreed, and before the weights are read: the copy is freed before they are taken
            _run_proof(model, program, proof, checks, mesh=mesh, proved=proved if agreed.proved_before else None,
                       probe_cache=probe_cache, agree_timeout=agree_timeout, allowed=allow_unproved)
            del proof
        return materialise(model, program, agreed, checks=checks)


def _compile_locally(model: nn.Module, plan: ShardingPlan | Mapping, mesh: DeviceMesh, *, seed: int | None,
                     verify: bool, example_inputs, allow_unproved: bool) -> tuple[Program, dict[str, str], Proof | None]:
    """``shard()``'s steps before any collective: ``compile_sharding`` (on the batch ``auto_plan`` traced where
    ``example_inputs`` is None) and, where no proof will run, what proves the program (``checks["proof"]``), or the
    ``PlanError`` that refuses it, raised on every rank before the agreement."""
    if example_inputs is None and isinstance(plan, AutoPlan):  # the batch auto_plan traced
        example_inputs = plan.example_inputs
    program, checks, proof = compile_sharding(model, plan, mesh, seed=seed, verify=verify, example_inputs=example_inputs)
    if proof is None:  # local: refused before any collective
        checks["proof"] = _require_proof(model, program, checks, asked=not _why_not_proved(verify=verify, seed=seed),
                                        allowed=allow_unproved, compared=False)
    return program, checks, proof


def _run_proof(model: nn.Module, program: Program, proof: Proof, checks: dict[str, str], *, mesh: DeviceMesh,
               proved: Verdict | None, probe_cache: ProbeCache | None, agree_timeout: float | None,
               allowed: bool) -> None:
    """``shard()``'s proof once the ranks agreed: the probe's verdict (``prove``) as ``checks["probe"]``, then what
    proves ``program`` as ``checks["proof"]`` (``_require_proof``); a ``PlanError``, the same on every rank, where
    the probe did not compare the gradients that only it could check (``proof.unchecked``) or nothing proves it."""
    verdict = prove(proof, mesh=mesh, proved=proved, probe_cache=probe_cache, agree_timeout=agree_timeout)
    checks["probe"] = verdict.text
    if proof.unchecked and not verdict.compared:  # the same verdict on every rank
        raise _unchecked_error(proof.unchecked, f"the probe did not compare the gradients ({verdict})")
    checks["proof"] = _require_proof(model, program, checks, asked=True, allowed=allowed, compared=verdict.compared)


@dataclass(frozen=True)
class Proof:
    """What the shard-time proof runs on (``runtime.probe``): the private ``copy`` of the model,
    the ``plan`` restated on its paths, the varying uses traced on it (None: the meta trace's),
    the ``key`` its verdict is remembered by (``probe_key``), the batch it is fed (``inputs`` on
    the copy's device; None: synthesized) and what only it can clear (``unchecked``: the dataflow
    pass did not run; unless it compares every gradient, ``shard()`` refuses)."""

    copy: Reduced
    plan: ShardingPlan
    uses: Mapping[str, frozenset[str]] | None
    key: tuple
    inputs: tuple[tuple, dict] | None = None
    unchecked: tuple[Unchecked, ...] = ()
    example_inputs: object = None  # as given to shard(): the copy's own dataflow pass traces it


def compile_sharding(model: nn.Module, plan: ShardingPlan | Mapping, mesh: DeviceMesh, *, seed: int | None,
                     verify: bool, example_inputs=None) -> tuple[Program, dict[str, str], Proof | None]:
    """``build_program`` and the proof's local preparation (no collective): the program, the
    checks so far (how the dataflow was traced; why there is no proof) and the ``Proof`` to run.
    Where neither the dataflow pass nor the probe can see the data (no batch to synthesize and no
    ``example_inputs``), a plan with an unplanned module holding parameters inside a planned region
    raises ``PlanError`` here, on every rank (``compile.dataflow.unchecked_in_regions``)."""
    inputs = None if example_inputs is None else example_call(model, example_inputs)
    program = build_program(model, plan, mesh, example_inputs=example_inputs)
    given = " (example_inputs)" if inputs is not None else ""
    checks = {"dataflow": program.dataflow_skipped or f"traced on meta tensors{given}"}
    skipped = _why_not_proved(verify=verify, seed=seed)
    copy = None
    if not skipped:
        marks = plan_marks(program.boundaries, program.infos, program.leaf_of)
        copy, skipped = probe_copy_or_reason(model, seed, mesh_device(mesh), marks, inputs)
    fed = None
    if copy is not None and inputs is not None:
        fed, skipped = probe_inputs(inputs, next(copy.model.parameters(), torch.empty(0)).device)
        if fed is None:
            copy = None
    if copy is None:
        checks["probe"] = skipped
        _refuse_unchecked(model, program, checks["dataflow"], f"no probe ({skipped})")
        return program, checks, None
    copy_plan = reduced_plan(as_plan(plan), model, copy, mesh.mesh_dim_names or ())  # its blocks are renumbered
    uses = None
    if program.dataflow_skipped:  # trace the real copy instead (local, no collective)
        uses, original_uses, failed, recomputed = probe_varying_uses(copy, copy_plan, mesh, fed)
        if not failed:
            program = build_program(model, plan, mesh, varying_uses=original_uses)
            checks["dataflow"] = f"traced on the probe's real copy{given}"
        program = dataclasses.replace(program, recomputed={**recomputed, **program.recomputed})
    unchecked: tuple[Unchecked, ...] = ()
    if program.dataflow_skipped:
        if fed is None and synthesize_inputs(copy.model) is None:  # the probe has no batch either
            _refuse_unchecked(model, program, checks["dataflow"], "no batch to probe with")
        unchecked = tuple(unchecked_in_regions(model, program.boundaries, program.infos, program.leaf_of,
                                               program.param_steps))
    key = probe_key(copy, copy_plan, mesh, uses, program, fed)
    return program, checks, Proof(copy, copy_plan, uses, key, fed, unchecked, example_inputs if fed else None)


def _require_proof(model: nn.Module, program: Program, checks: Mapping[str, str], *, asked: bool, allowed: bool,
                   compared: bool) -> str:
    """What proves ``program`` (``checks["proof"]``): the probe (loss and every gradient compared on
    a copy: ``compared``, the probe's ``Verdict``), the dataflow pass (traced, with no planned module
    running a function of its own that it cannot see into), both, or nothing to prove; else a
    ``PlanError`` naming what could not be seen, unless ``allowed`` (then "unproved ...").
    ``asked``: the proof was to run (not ``verify=False``, a shapes-only or simulated ``shard()``),
    else it says why not."""
    if not asked:
        return f"not asked ({checks.get('probe', 'no probe')})"
    if not program.boundaries and not any(i.is_sharded for i in program.infos.values()):
        return "nothing to prove: no module is planned"
    traced = program.dataflow_skipped is None
    opaque = [b.planned.fqn or "<root module>" for b in program.boundaries if not b.planned.style.own_forward]
    if compared:
        return "the probe and the dataflow pass" if traced else "the probe"
    if traced and not opaque:
        return "the dataflow pass"
    unseen = (f"the dataflow pass cannot see inside {', '.join(opaque[:3])}{' ...' if len(opaque) > 3 else ''} (a style that "
              "runs a function of its own)" if traced else f"the dataflow pass did not run ({checks['dataflow']})")
    unseen += f" and the probe did not compare the gradients ({checks.get('probe', 'no probe')})"
    if allowed:
        return f"unproved (allow_unproved=True): {unseen}"
    raise PlanError(f"shard: nothing proves that this plan computes {type(model).__name__}'s function: {unseen}. Pass "
                    "shard(..., example_inputs=...) with a batch its forward takes so that both can run, or accept the plan "
                    "unproved knowingly with shard(..., allow_unproved=True) (docs/guarantees.md#exact-or-refused)")


def _refuse_unchecked(model: nn.Module, program: Program, dataflow: str, probe: str) -> None:
    """``PlanError`` (local, before any collective) where the dataflow pass did not run and an
    unplanned module with replicated parameters sits inside a planned region; else nothing."""
    if not program.dataflow_skipped:
        return
    found = unchecked_in_regions(model, program.boundaries, program.infos, program.leaf_of, program.param_steps)
    if found:
        raise _unchecked_error(found, f"{dataflow}; {probe}")


def _unchecked_error(found, why: str) -> PlanError:
    first = found[0]
    more = f" (and {', '.join(u.module for u in found[1:4])}{', ...' if len(found) > 4 else ''})" if found[1:] else ""
    where = ("sits inside" if first.module.startswith(first.region + ".") or not first.region
             else "is or encloses")
    return PlanError(
        f"{first.module or '<root module>'} is not planned, {where} the planned region {first.region!r} and holds parameters "
        f"replicated on mesh axis {first.axis!r} ({', '.join(first.params)}){more}; neither the dataflow pass nor the "
        f"probe could see what data it receives ({why}), so if it sees each rank's share of the heads its gradient "
        "would be a per-rank share that nothing reduces. Plan it NoParallel(reduce_grads=True) if it sees each rank's "
        "share of the heads (a per-head norm), NoParallel() if it sees only replicated data, or pass "
        "shard(..., example_inputs=...) so the data it sees is traced (docs/guarantees.md#exact-or-refused)")


def _why_not_proved(*, verify: bool, seed: int | None) -> str:
    """Why ``shard()`` runs no proof ("" when it does)."""
    if not verify:
        return "skipped: verify=False"
    if seed is None:
        return "skipped: seed=None (shapes only)"
    if dist.is_initialized() and dist.get_backend() == "fake":  # simulate(): collectives carry no numbers
        return "skipped: a simulated (fake) process group carries no numbers"
    return ""


@dataclass(frozen=True)
class Agreed:
    """What every rank agreed on: the ``values`` to slice, the blocks to recompute (``remat``)
    and whether every rank proved this sharding before (``proved_before``: the probe is skipped)."""

    values: InitialValues
    remat: RematPlan | None
    proved_before: bool


def agree_on(model: nn.Module, program: Program, *, weights: str | os.PathLike | None, seed: int | None,
             agree_timeout: float | None, verify_values: bool, remat, proved_before: bool = False) -> Agreed:
    """The local checks of the values and of ``remat``, then the ranks' agreement (one small
    all-gather: the plan, the runtime, the values' checksums and ``proved_before``, which
    holds only if it holds on every rank)."""
    blocks = resolve_remat(model, remat)
    if blocks is not None:
        check_recorded_outputs(model, "shard(remat=...)", "drop remat=")
    values = InitialValues.prepare(model, program, weights, seed)
    runtime = {"checkpoint": repr(blocks), **values.fingerprint}  # ranks that recompute different blocks would hang
    everyone = agree(program, None if agree_timeout is None else timedelta(seconds=agree_timeout),
                     values.checked if verify_values else None, runtime, proved_before)
    return Agreed(values, blocks, everyone)


def prove(proof: Proof, *, mesh: DeviceMesh, proved: Verdict | None, probe_cache: ProbeCache | None,
          agree_timeout: float | None) -> Verdict:
    """The proof's ``Verdict`` (its text: ``checks["probe"]``): ``proved``, the verdict every rank
    remembers, or the probe run now (a collective; a mismatch raises ``PlanError``) and recorded in
    ``probe_cache``."""
    if proved is not None:
        return proved.remembered()
    shard_copy = functools.partial(shard_unproved, agree_timeout=agree_timeout, example_inputs=proof.example_inputs)
    verdict = run_probe(proof.copy, proof.plan, mesh, shard_copy, proof.uses, proof.inputs)
    if probe_cache is not None:
        probe_cache.record(proof.key, verdict)
    return verdict


def shard_unproved(model: nn.Module, plan: ShardingPlan, mesh: DeviceMesh,
                   varying_uses: Mapping[str, frozenset[str]] | None = None, *,
                   agree_timeout: float | None, example_inputs=None) -> Sharded:
    """``shard()`` of the probe's copy (``run_probe``'s ``shard_fn``): compiled with ``varying_uses``
    (None: its own dataflow pass, on ``example_inputs`` where given), agreed on the fingerprint
    only, seed 0, nothing recomputed, no proof of its own."""
    program = build_program(model, plan, mesh, varying_uses=varying_uses, example_inputs=example_inputs)
    agreed = agree_on(model, program, weights=None, seed=0, agree_timeout=agree_timeout, verify_values=False,
                      remat=False)
    return materialise(model, program, agreed)


def materialise(model: nn.Module, program: Program, agreed: Agreed, *,
                checks: Mapping[str, str] | None = None) -> Sharded:
    """This rank's shards and the runtime over its skeleton (``checks``: what the proof did,
    kept as ``apply_fn.runtime.checks``)."""
    params = agreed.values.local_shards()
    template = build_skeleton(model, {k: i.local_shape for k, i in program.infos.items()}, program.leaf_of,
                              agreed.values.buffers)
    runtime = Runtime(template, program, agreed.remat, dict(checks or {}))
    apply_fn = dataclasses.replace(build_runtime(template, program, remat=agreed.remat), runtime=runtime)
    return apply_fn, params, program.infos
