"""The shard-time numeric probe: the plan, run on a small private copy of the model, against the
same copy unsharded — loss and every gradient — on the real ranks, before ``shard()`` returns.

The copy (``runtime.probe_copy``) keeps the model's structure with each stack of blocks reduced to one
block of each distinct kind (structure and layer type), seeded random values (meta-built models
included), buffers recomputed by their modules' init; nothing of the user's weights is used.
``run_probe`` shards it with the same plan on the same mesh, feeds both a tiny synthetic batch (or
the user's ``shard(..., example_inputs=)``) and compares.  A mismatch raises ``PlanError`` on every
rank (every rank compares the same gathered numbers), naming the worst parameter.  The probe also lends its real copy to
``compile.dataflow`` when the model's forward cannot run on meta tensors.
"""

from __future__ import annotations

__all__ = ["ProbeCache", "Verdict", "own_draws", "probe_key", "probe_varying_uses", "run_probe"]

from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..compile.agree import checksum
from ..compile.build import varying_uses
from ..compile.dataflow import synthesize_inputs
from ..compile.lint_heads import fingerprint
from ..compile.reduced_copy import Reduced
from ..core.errors import PlanError
from ..core.facets import SummedOver
from ..core.gather import unshard
from ..core.placement import splits
from ..core.signature import arg_slots
from .loss import scalar_loss

#: relative tolerance of the comparison (fp32; the sharded sums run in another order)
TOLERANCE = 1e-4
#: the same in float64, where a float32 mismatch is judged again (``_rejudged_in_float64``)
TOLERANCE64 = 1e-9
#: a float32 gradient mismatch (the same gathered numbers on every rank) is judged again only below this
#: (relative): rounding a model amplifies is a near miss (Dory's 2e-3), a wrong plan usually far off
#: (Bros 0.76); the rest is refused at once
REJUDGE_BELOW = 1e-2


@dataclass(frozen=True)
class Verdict:
    """What the shard-time probe found: whether it ``compared`` the loss and every gradient (and
    they agreed: a mismatch raises instead), and its ``text``, what ``apply_fn.runtime.checks["probe"]``
    says (``str(verdict)``).  A probe that compared only the loss, or could not run, says why."""

    compared: bool
    text: str

    def __str__(self) -> str:
        return self.text

    def remembered(self) -> Verdict:
        """This verdict, read back from a ``ProbeCache`` instead of probed again."""
        return replace(self, text=f"{self.text} (probed before in this process: same structure, plan and mesh)")


#: the verdict of a probe that compared the loss and every gradient
EXACT = Verdict(True, "exact on the probe copy")


class ProbeCache:
    """The verdicts of probes that passed, by ``probe_key``: the same structure, plan and mesh
    sharded again (a notebook, a test suite, a sweep) is not probed again.  Bounded: the least
    recently used verdict goes first beyond ``size``.

    Owned by its caller and passed: ``shard(..., probe_cache=cache)`` reads and records it, and the
    caller keeps one per process-group world it shards on (what it remembers, a proof that a plan
    computes a model's function on a mesh, holds while that world does; the key names the mesh's
    ranks).  No cache (``probe_cache=None``, the default) always probes.  Read and written only
    through ``lookup`` and ``record``; whether every rank may skip the probe is decided in
    ``shard()``'s agreement, so one rank's cache never makes the others wait."""

    def __init__(self, size: int = 64):
        self.size = size
        self._verdicts: OrderedDict[Hashable, Verdict] = OrderedDict()

    def lookup(self, key: Hashable) -> Verdict | None:
        """The verdict recorded for ``key``, or None if it was never probed (or has been dropped)."""
        verdict = self._verdicts.get(key)
        if verdict is not None:
            self._verdicts.move_to_end(key)
        return verdict

    def record(self, key: Hashable, verdict: Verdict) -> None:
        """Remember that the probe of ``key`` passed with ``verdict``."""
        self._verdicts[key] = verdict
        self._verdicts.move_to_end(key)
        while len(self._verdicts) > self.size:
            self._verdicts.popitem(last=False)

    def __len__(self) -> int:
        return len(self._verdicts)

    def __repr__(self) -> str:
        return f"ProbeCache({len(self)} of {self.size} verdicts)"


def probe_key(probe: Reduced, plan, mesh, uses: Mapping[str, frozenset[str]] | None, program,
              inputs: tuple[tuple, dict] | None = None) -> tuple:
    """What a probe's verdict depends on: the copy's module classes, scalar attributes, shapes,
    dtypes and config (``compile.lint_heads.fingerprint``), the bits of its buffers (the model's
    own constants), the plan restated on it, the mesh, the varying uses, the conversions the
    compiled ``program`` gives the parameters (what the dataflow pass decided) and the batch given
    (``inputs``: the bits of its tensors, the rest by ``repr``; None: the synthesized one)."""
    steps = tuple(sorted((k, tuple((s.collective.name, s.axis) for s in v)) for k, v in program.param_steps.items()))
    settings = (tuple(sorted(plan.axes.items())), tuple(sorted((k, repr(v)) for k, v in plan.settings.items())),
                tuple(sorted(plan.optional_roles)),
                tuple(sorted(plan.special_handlers.items())), tuple(sorted((k, id(h)) for k, h in plan.handlers.items())))
    return (fingerprint(probe.model), tuple((n, checksum(b)) for n, b in probe.model.named_buffers()),
            tuple(sorted((k, repr(v)) for k, v in plan.entries.items())), settings,
            tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape), mesh.mesh_dim_names, mesh.device_type,
            tuple(sorted((k, tuple(sorted(v))) for k, v in (uses or {}).items())), steps,
            None if inputs is None else _signature(inputs))


def _signature(inputs: tuple[tuple, dict]) -> tuple:
    leaves, spec = tree_flatten(inputs)
    return (str(spec), tuple((tuple(x.shape), x.dtype, checksum(x)) if isinstance(x, Tensor) else repr(x)
                             for x in leaves))


def probe_varying_uses(probe: Reduced, plan, mesh, inputs: tuple[tuple, dict] | None = None
                       ) -> tuple[dict[str, frozenset[str]], dict[str, frozenset[str]], str | None, dict[str, str]]:
    """``compile.dataflow`` on the probe's real copy (fed ``inputs``, on its device; None: synthesized
    token ids): (its varying uses by the copy's FQNs, the same by the original FQNs, why not if that
    forward failed too: None when it ran, the modules the copy's own code recomputes in the backward)."""
    uses, skipped, recomputed = varying_uses(probe.model, plan, mesh, inputs)
    return uses, {o: axes for k, axes in uses.items() for o in probe.names.get(k, [k])}, skipped, recomputed


def _batch(model: nn.Module, mesh) -> tuple[tuple, dict] | None:
    """A tiny random batch the model's first layer takes (``compile.dataflow.synthesize_inputs``),
    its sequence long enough for every context-parallel layout, on the copy's device."""
    inputs = synthesize_inputs(model, rows=2, length=8 * mesh.size(), generator=torch.Generator().manual_seed(0))
    if inputs is None:
        return None
    device = next(model.parameters()).device
    return tree_map(lambda x: x.to(device) if isinstance(x, Tensor) else x, inputs)


def run_probe(probe: Reduced, plan, mesh, shard_fn: Callable, varying: Mapping[str, frozenset[str]] | None,
              inputs: tuple[tuple, dict] | None = None) -> Verdict:
    """Shard the probe copy (``shard_fn``: ``shard`` without the probe), run both on one batch —
    ``inputs`` (``(args, kwargs)`` on the copy's device: ``shard(..., example_inputs=)``), else a
    synthesized one — and compare loss and every gradient; returns the ``Verdict`` (``EXACT``, or
    why the comparison was skipped or partial) and raises ``PlanError`` on a mismatch.  Collective:
    every rank calls it.  Gradients are taken even where ``shard`` is called under
    ``torch.no_grad()``; where the unsharded model has no backward here (flex attention on the
    CPU), only the loss is compared."""
    with torch.enable_grad():  # inside shard()'s own_draws: the seeds below leave the caller's stream alone
        try:
            why = _run_probe(probe, plan, mesh, shard_fn, varying, inputs)
        except PlanError as exc:
            if not _is_mismatch(exc) or exc.probe_mismatch > REJUDGE_BELOW:
                raise  # not numbers, or too far off to be rounding: refused without a second look
            return _rejudged_in_float64(exc, probe, plan, mesh, shard_fn, varying, inputs)
    return Verdict(False, why) if why else EXACT


def _mismatch(message: str, size: float) -> PlanError:
    """The ``PlanError`` of a probe whose numbers differ (the sharded loss or a gradient) by ``size``
    (relative), marked so that ``run_probe`` judges a near miss again in float64; to the caller it
    is a plain ``PlanError``."""
    exc = PlanError(message)
    exc.probe_mismatch = size
    return exc


def _is_mismatch(exc: BaseException) -> bool:
    return isinstance(getattr(exc, "probe_mismatch", None), float)


def _rejudged_in_float64(mismatch: PlanError, probe: Reduced, plan, mesh, shard_fn: Callable, varying,
                         inputs) -> Verdict:
    """A float32 ``mismatch`` probed again on the copy in float64 (alike on every rank): rounding that
    the model amplifies (nGPT's query scale of 40,000 saturating the softmax: Dory) agrees there within
    ``TOLERANCE64`` and the verdict says so; a wrong plan differs there too and ``mismatch`` is raised
    (also where the copy does not run in float64, or compares less there: only the loss, or nothing)."""
    model = probe.model
    if not any(p.dtype == torch.float32 for p in model.parameters()):
        raise mismatch
    model.double()  # the probe's private copy
    wide = None if inputs is None else tree_map(
        lambda x: x.double() if isinstance(x, Tensor) and x.dtype == torch.float32 else x, inputs)
    try:
        why = _run_probe(probe, plan, mesh, shard_fn, varying, wide, tolerance=TOLERANCE64)
    except Exception as exc:  # noqa: BLE001 - a mismatch there too, or float32-only code: the float32 verdict stands
        raise mismatch from (None if _is_mismatch(exc) else exc)
    if why:  # float64 compared less than float32 did (its batch skipped, no backward): the mismatch stands
        raise mismatch
    first = str(mismatch).split(";")[0].removeprefix("shard-time probe: ")
    return Verdict(True, f"{EXACT.text} in float64 (in float32 {first}: rounding the model amplifies)")


#: the seed of torch's global generators before each forward the probe compares
DRAW_SEED = 0


@contextmanager
def own_draws(device_type: str):
    """torch's global generators (the CPU's and the mesh device's current one) forked, and restored
    on exit: ``shard()``'s private forwards (the probe's, its copy's checks) leave the caller's stream
    where it was, and a model that draws from them (VibeVoice's diffusion noise) draws the same
    values in both forwards the probe compares (``_seed_draws`` before each)."""
    devices = [] if device_type == "cpu" else [torch.get_device_module(device_type).current_device()]
    with torch.random.fork_rng(devices=devices, device_type=device_type if devices else None):
        yield


def _seed_draws(device: torch.device) -> None:
    torch.default_generator.manual_seed(DRAW_SEED)
    if device.type not in ("cpu", "meta"):
        torch.get_device_module(device.type).manual_seed(DRAW_SEED)


def _run_probe(probe: Reduced, plan, mesh, shard_fn: Callable, varying, inputs, tolerance: float = TOLERANCE) -> str:
    model = probe.model
    batch = inputs if inputs is not None else _batch(model, mesh)
    which = "example_inputs" if inputs is not None else "synthesized batch"
    if batch is None:
        return (f"{type(model).__name__} does not start with an embedding or a linear layer: no batch to probe with "
                "(shard(..., example_inputs=...) gives one)")
    reference = _reference(model, batch, which)
    if isinstance(reference, str):
        return reference
    ref_out, no_backward, calls = reference
    # a root that computes the loss from labels the model's forward does not take (a non-HF model's CP root)
    declared = next((d for p in plan.parallelisms if (d := p.loss_labels(plan)) is not None), None)
    first = next((x for x in tree_flatten(batch)[0] if isinstance(x, Tensor)), None)
    labels = {declared.labels: first} if declared is not None else {}
    apply_fn, params, info = shard_fn(model, plan, mesh, varying)
    args, kwargs = _laid_out(batch, apply_fn.program, calls, mesh)
    out = _sharded_run(apply_fn, params, args, {**kwargs, **labels}, no_backward is None, which)
    if isinstance(out, str):
        return out
    if declared is not None:
        loss, ref = out[1], declared.reference_loss(ref_out, *labels.values())
    elif getattr(out, "loss", None) is None and first_shape(out) != first_shape(ref_out):
        return "the output is laid out differently per rank and the model takes no labels: nothing to compare"
    else:
        loss, ref = probe_loss(out), probe_loss(ref_out)
    return _compare_all(model, probe, mesh, (loss, ref), params, info, no_backward, tolerance)


def _reference(model: nn.Module, batch: tuple[tuple, dict], which: str):
    """The unsharded copy's output on ``batch``, why it has no backward here (None: it has one) and
    where each planned-to-be module met a tensor of the batch (``_Calls``); or why it does not run."""
    args, kwargs = batch
    calls = _Calls(model, batch)
    device = next(model.parameters(), torch.empty(0)).device
    try:
        with calls:
            _seed_draws(device)
            return model(*args, **kwargs), None, calls
    except Exception as exc:  # noqa: BLE001 - the model itself does not take this batch (a pipeline stage's view)
        try:  # or only not with gradients (flex attention on the CPU)
            with torch.no_grad(), calls:
                _seed_draws(device)
                return model(*args, **kwargs), exc, calls
        except Exception:  # noqa: BLE001
            return f"skipped: the model does not take the {which} ({type(exc).__name__}: {str(exc)[:120]})"


def _sharded_run(apply_fn, params, args: tuple, kwargs: dict, grad: bool, which: str):
    """``apply_fn``'s output on this rank's part of the batch, or why the plan refuses it."""
    try:
        with torch.set_grad_enabled(grad):
            _seed_draws(next(iter(params.values()), torch.empty(0)).device)
            return apply_fn(params, *args, **kwargs)
    except PlanError as exc:  # a refusal of this batch (raised alike on every rank, before any collective)
        return f"skipped: the plan refuses the probe's {which} ({str(exc).splitlines()[0][:160]})"
    except Exception as exc:  # the unsharded copy ran this batch: the plan is what cannot run
        raise PlanError(f"shard-time probe: the plan cannot run on a random copy of the model that runs unsharded "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}); a shape the "
                        "plan gives some module is not one its forward accepts (shard(..., verify=False) skips this "
                        "check; docs/guarantees.md#exact-or-refused)") from exc


def _compare_all(model: nn.Module, probe: Reduced, mesh, losses: tuple[Tensor, Tensor], params, info,
                 no_backward: Exception | None, tolerance: float = TOLERANCE) -> str:
    """The losses and every gradient compared (``_compare``); "" when they were, else what was not."""
    loss, ref = losses
    keys = [k for k, v in params.items() if v.requires_grad]
    ref_grads = {}
    if no_backward is None:
        try:
            ref_grads = dict(zip(keys, torch.autograd.grad(ref, [model.get_parameter(k) for k in keys], allow_unused=True),
                                 strict=True))
        except Exception as exc:  # noqa: BLE001 - the unsharded model has no backward here: the loss alone is compared
            no_backward = exc
    if no_backward is not None:
        _compare(loss.detach(), ref.detach(), {}, {}, probe.names, tolerance)
        why = str(no_backward).splitlines()[0][:120] if str(no_backward) else ""
        return (f"the loss agrees; gradients not compared: the unsharded model has no backward here "
                f"({type(no_backward).__name__}: {why})")
    grads = dict(zip(keys, torch.autograd.grad(loss, [params[k] for k in keys], allow_unused=True), strict=True))
    grads = {k: torch.zeros_like(params[k]) if g is None else g for k, g in grads.items()}
    full = unshard(grads, info)
    for k, i in info.items():  # every rank fed the same batch through leaves summed over an axis (experts on dp ranks)
        for axis in i.axes_of(SummedOver):
            full[k] = full[k] / mesh.size(mesh.mesh_dim_names.index(axis))
    _compare(loss.detach(), ref.detach(), full, ref_grads, probe.names, tolerance)
    return ""


class _Calls:
    """Which of the batch's tensors each module of ``model`` was handed, by argument (position or
    name), recorded by forward pre-hooks while the context is open (the first call of each module)."""

    def __init__(self, model: nn.Module, batch: tuple[tuple, dict]):
        self.model = model
        self.leaves = {id(x): i for i, x in enumerate(tree_flatten(batch)[0]) if isinstance(x, Tensor)}
        self.seen: dict[str, dict[object, int]] = {}
        self.handles: list = []

    def __enter__(self):
        for path, module in self.model.named_modules():
            self.handles.append(module.register_forward_pre_hook(
                lambda _m, args, kwargs, path=path: self._record(path, args, kwargs), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _record(self, path: str, args: tuple, kwargs: dict) -> None:
        if path not in self.seen:
            found = {**{i: a for i, a in enumerate(args)}, **kwargs}
            self.seen[path] = {k: self.leaves[id(v)] for k, v in found.items() if id(v) in self.leaves}


def _laid_out(batch: tuple[tuple, dict], program, calls: _Calls, mesh) -> tuple[tuple, dict]:
    """``batch`` as the plan takes it on this rank: a tensor of the batch that a planned module
    receives as an argument it declares arriving sharded (``in_src``: sequence parallelism's first
    norm takes each rank's chunk of the sequence) is cut to this rank's chunk, in mesh-axis order."""
    leaves, spec = tree_flatten(batch)
    names = tuple(mesh.mesh_dim_names or ())
    coord = mesh.get_coordinate() or [0] * len(names)
    cut: dict[int, Mapping] = {}
    for b in program.boundaries:
        handed = calls.seen.get(b.planned.fqn, {})
        for slot in arg_slots(calls.model.get_submodule(b.planned.fqn).forward, list(b.spec.in_src), b.planned.fqn):
            leaf = handed.get(slot.position, handed.get(slot.name)) if slot.position is not None else handed.get(slot.name)
            if leaf is not None and any(splits(p) for p in b.spec.in_src[slot.key].values()):
                cut.setdefault(leaf, b.spec.in_src[slot.key])
    for leaf, placements in cut.items():
        x = leaves[leaf]
        for axis, c in zip(names, coord, strict=True):
            p = placements.get(axis)
            if splits(p):
                x = x.chunk(mesh.size(names.index(axis)), p.dim % x.dim())[c]
        leaves[leaf] = x
    return tree_unflatten(leaves, spec)


def probe_loss(out: object) -> Tensor:
    """The scalar the probe differentiates an output by: ``runtime.loss.scalar_loss``, a loss of
    several entries summed (DAC's per-example commitment loss: any scalar function of the same
    output compares two computations of it)."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, Tensor) and loss.numel() > 1:
        return loss.float().sum()
    return scalar_loss(out)


def first_shape(out: object) -> tuple | None:
    t = out if isinstance(out, Tensor) else getattr(out, "logits", None)
    if t is None and isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        t = out[0]
    return tuple(t.shape) if isinstance(t, Tensor) else None


def _compare(loss: Tensor, ref: Tensor, grads: Mapping[str, Tensor], ref_grads: Mapping[str, Tensor | None],
             names: Mapping[str, list[str]], tolerance: float = TOLERANCE) -> None:
    hint = ("shard(..., verify=False) skips this check, but the plan would then compute something other than the "
            "model; docs/guarantees.md#exact-or-refused")
    wide = torch.float64 if tolerance < TOLERANCE else torch.float32
    if not torch.allclose(loss.to(wide), ref.to(wide), rtol=tolerance, atol=tolerance):
        # judged again whatever its size: a wrong plan's loss may differ by rank, and every rank must take the same path
        raise _mismatch(f"shard-time probe: on a random copy of the model the sharded loss {loss.item():.6g} differs from "
                        f"the unsharded {ref.item():.6g}; the plan does not compute the model's function. {hint}", 0.0)
    worst, where = 0.0, ""
    # each gradient against its own largest entry, floored at 1% of the model's largest: a gradient
    # that is itself a near-cancellation (a LayerNorm over 2 features) is only its rounding noise
    floor = max([r.abs().max().item() for r in ref_grads.values() if r is not None and r.numel()] + [0.1]) * 1e-2
    for key, g in grads.items():
        r = ref_grads.get(key)
        r = torch.zeros_like(g) if r is None else r
        scale = max(r.abs().max().item() if r.numel() else 0.0, floor)
        err = (g.to(wide) - r.to(wide)).abs().max().item() / scale if g.numel() else 0.0
        if err > worst:
            worst, where = err, key
    if worst > tolerance * 10:
        original = names.get(where, [where])[0]
        raise _mismatch(f"shard-time probe: on a random copy of the model the gradient of {original} differs from the "
                        f"unsharded one by {worst:.2g} of its largest entry (the loss agrees); the plan gives that "
                        f"parameter a wrong gradient. {hint}", worst)
