"""One row of the support table: a tiny model of one HF model type with its main head, sharded
over a 1-D ``tp`` mesh with the plan a new user would reach for, against the unsharded model in
the same process.  ``benchmarks/models.py`` runs it for every type (one process group per type);
``tests/models/test_model_sweep.py`` runs it for a fixed few inside the rank pools.

``check_family`` runs on every rank of the mesh and returns a plain dict (picklable):
``outcome`` is one of ``OUTCOMES``; ``reason`` the first line of the error (with its site for a
crash) or the largest differences for ``wrong``; ``category`` and ``task`` (the head) name the
row (``sweep_tasks``); ``inputs`` the keyword arguments it ran on (``sweep_inputs``).
Classification: ``refused`` is the library's own error (``PlanError`` and its ``ShapeError``,
``ReplicationError``, ``CheckpointError``), ``hang`` a ``CollectiveError`` or a timeout, ``crash``
anything else (a raw torch error from inside the library is a bug, with its site).

Families outside transformers (diffusers, timm) come from ``hp_functional.tools.sweep_extras``
where it exists: its ``extra_families()`` (or a dict ``EXTRA_FAMILIES``) maps a name to
``builder(tp: int, seed: int)``, which returns an object with ``model``, ``inputs`` (the keyword
arguments of one forward), ``category`` and ``loss_of(output) -> scalar``, or a tuple
``(model, inputs, category)`` (the loss then ``loss_of``); ``check_extra(name, builder)`` is its
row.  ``benchmarks/models.py`` reads that registry when it runs (``--no-extras`` leaves it out):
nothing registers itself at import.
"""

from __future__ import annotations

__all__: list[str] = []

import time
import traceback
import warnings
from typing import Any

import torch

from .sweep_inputs import FORWARD_SEED, loss_of

EXACT, LITTLE, REFUSED, CRASH, WRONG, HANG, UNBUILDABLE = (
    "exact", "ran, sharded little", "refused", "crash", "wrong", "hang", "not buildable tiny")
#: worst first: how per-rank outcomes that disagree are combined.
OUTCOMES = (HANG, CRASH, WRONG, REFUSED, UNBUILDABLE, LITTLE, EXACT)
TOL = 1e-5
#: the tolerance of a row rerun in float64 where float32 exceeds ``TOL`` (``rejudged_in_float64``)
TOL64 = 1e-9
#: the reason of a row whose rank ran out of the sweep's per-rank memory (``benchmarks/models.py`` caps it).
MEMORY_CAP = "over the sweep's per-rank memory cap"
#: a rank holding at least this share of the model's parameters has "sharded little".
LITTLE_SHARE = 0.8
BATCH, SEQ = 2, 8


#: ``apply_fn.runtime.checks["proof"]`` (``shard()``'s proof obligation) -> the row's short ``proof``
PROOFS = {"the probe and the dataflow pass": "both", "the probe": "probe", "the dataflow pass": "dataflow",
          "nothing to prove": "nothing to prove"}
#: the ``proof`` of a row that ran with no proof (``unproved``, ``not asked``): never accepted by the table
UNPROVED = "unproved"


def proof_label(proof: str) -> str:
    """The short label of what proved an accepted plan (``PROOFS``): ``both``, ``probe``,
    ``dataflow``, ``nothing to prove``; anything else (``unproved (allow_unproved=True): ...``,
    ``not asked ...``, an empty string) is ``UNPROVED``."""
    return next((label for text, label in PROOFS.items() if proof == text or proof.startswith(text + ":")), UNPROVED)


def unbuildable(model_type: str, exc: BaseException) -> str:
    """The reason a type's tiny model cannot be built: why, where ``sweep_tasks.NOT_TINY`` knows, then the error."""
    from .sweep_tasks import NOT_TINY

    known = NOT_TINY.get(model_type)
    return f"{known} ({first_line(exc)})"[:300] if known else first_line(exc)


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (at most 200 characters); where that line only announces
    its cause (a config validator's ``...: ``), the cause's first line after it."""
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0] if text else ''}"
    if line.endswith(":") and exc.__cause__ is not None:
        return f"{line} {first_line(exc.__cause__)}"[:200]
    return line[:200]


def site(exc: BaseException) -> str:
    """Where ``exc`` was raised (``file:line`` of the innermost frame) and, where that is outside
    hp_functional, the innermost hp_functional frame it passed through."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"

    def short(f) -> str:
        name = f.filename.split("/hp_functional/", 1)[1] if "/hp_functional/" in f.filename else f.filename.rsplit("/", 1)[-1]
        return f"{name}:{f.lineno}"

    ours = [f for f in frames if "/hp_functional/" in f.filename and "/tools/sweep.py" not in f.filename]
    if not ours or ours[-1] is frames[-1]:
        return short(frames[-1])
    return f"{short(frames[-1])} via {short(ours[-1])}"


def _is_hang(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return "timed out" in text or "timeout" in text or "connection closed by peer" in text


def hf_declares_plan(model) -> bool:
    """Whether HF declares a TP plan for ``model`` (what ``ShardingPlan.from_hf`` reads)."""
    return bool(getattr(model, "_tp_plan", None) or getattr(getattr(model, "config", None), "base_model_tp_plan", None))


def build(model_type: str, tp: int, seed: int = 0, task=None):
    """The tiny model of ``task`` (default: the type's main head, ``sweep_tasks.task_for``; eval
    mode: no dropout, except the few ``sweep_tasks.TRAIN_MODE`` types; weights perturbed so no parameter
    sits at its symmetric init), its inputs (a dict of keyword arguments: token ids avoid every special
    token) and the unsharded loss and gradients."""
    from .model_configs import tiny_config_for
    from .sweep_inputs import config_overrides, reference
    from .sweep_tasks import TRAIN_MODE, instantiate, task_for

    task = task or task_for(model_type)
    config = tiny_config_for(model_type, tp=tp, **config_overrides(task))
    torch.manual_seed(seed)
    model = instantiate(model_type, task, config).train(model_type in TRAIN_MODE)
    if hasattr(model, "set_default_language") and getattr(config, "languages", None):  # X-MOD: adapters per language
        model.set_default_language(config.languages[0])
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.02)
    inputs, ref = reference(model, config, task, g)
    grads = {k: p.grad for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return model, inputs, ref, grads


def plan_for(model, mesh, inputs: dict[str, Any] | None = None) -> tuple[Any, str]:
    """The plan a new user would reach for, and its source: a ConvNet (half its parameters or more in
    convolutions) by ``auto_plan(split_convolutions=True)``; where HF declares a TP plan,
    ``auto_plan(base=ShardingPlan.from_hf(model))`` (HF's entries kept, what they leave out — a
    vision tower, a projector — planned by dataflow), else ``from_hf`` alone where ``auto_plan``
    refuses the rest (or, in ``_check``, where ``shard()`` refuses the combined plan, then
    ``auto_plan`` alone where ``shard()`` refuses HF's: ``plans_in_turn``); ``auto_plan`` where HF
    declares none.  ``auto_plan`` traces ``inputs`` (the keyword arguments the row runs
    ``apply_fn`` on), without ``labels`` where a model's own label check cannot run on meta tensors
    (CTC's ``labels <= vocab_size``)."""
    from ..core.errors import PlanError
    from ..plan.plan import ShardingPlan

    if not hf_declares_plan(model):
        if conv_share(model) >= CONV_SHARE:  # a ConvNet: the user asks for its channels split
            return _auto(model, mesh, inputs, None, split_convolutions=True), "auto_plan(split_convolutions=True)"
        return _auto(model, mesh, inputs, None), "auto_plan"
    try:
        hf = ShardingPlan.from_hf(model)
    except PlanError:  # a plan of another library's styles (diffusers' own): auto_plan plans it all
        return _auto(model, mesh, inputs, None), "auto_plan"
    try:
        return _auto(model, mesh, inputs, hf), "from_hf+auto_plan"
    except PlanError:
        return hf, "from_hf"


def plans_in_turn(model, mesh, inputs: dict[str, Any], first, source: str):
    """``(plan, source)`` in the order a user tries them when ``shard()`` refuses one: ``plan_for``'s,
    then HF's alone (after ``from_hf+auto_plan``), then ``auto_plan`` alone (after HF's: a plan HF
    declares that is not exact under TP, Gemma 3n's activation sparsity over the split features)."""
    from ..core.errors import PlanError
    from ..plan.plan import ShardingPlan

    yield first, source
    if source == "from_hf+auto_plan":
        yield ShardingPlan.from_hf(model), "from_hf"
    if source in ("from_hf+auto_plan", "from_hf"):
        try:
            alone = _auto(model, mesh, inputs, None)
        except PlanError:  # auto_plan refuses it too: HF's refusal stands
            return
        yield alone, "auto_plan"


def _auto(model, mesh, inputs: dict[str, Any] | None, base, split_convolutions: bool = False):
    """``auto_plan`` on ``inputs``, retried without ``labels`` where the model's own label check
    cannot run on meta tensors."""
    from ..core.errors import PlanError
    from ..planner.auto import auto_plan

    try:
        return auto_plan(model, mesh, example_inputs=inputs, base=base, split_convolutions=split_convolutions)
    except PlanError as exc:
        if not inputs or "labels" not in inputs or "on meta tensors failed" not in str(exc):
            raise
        return auto_plan(model, mesh, example_inputs={k: v for k, v in inputs.items() if k != "labels"}, base=base,
                         split_convolutions=split_convolutions)


#: the share of a model's parameters in convolutions from which the sweep plans it with ``split_convolutions``
CONV_SHARE = 0.5


def conv_share(model) -> float:
    """The share of ``model``'s parameters held by convolutions that ``Colwise``/``Rowwise`` can split (groups 1)."""
    from torch import nn

    total = sum(p.numel() for p in model.parameters())
    convs = sum(p.numel() for m in model.modules() if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and m.groups == 1
                for p in m.parameters(recurse=False))
    return convs / total if total else 0.0


def plan_source(model) -> str:
    """``"from_hf"`` or ``"auto_plan"``: whose plan the row starts from (``plan_for`` says which ran)."""
    return "from_hf" if hf_declares_plan(model) else "auto_plan"


def compare(model, inputs: dict[str, Any], ref_loss, ref_grads, mesh, plan, functional: bool,
            loss_fn=loss_of, tol: float = TOL) -> dict[str, Any]:
    """Shard, run ``.backward()`` (and ``torch.func.grad``), gather every gradient; the largest
    differences and this rank's share of the parameters.  ``loss_fn``: the loss of one output;
    every forward starts from torch's global generator seeded with ``FORWARD_SEED``, as the reference's."""
    from ..core.gather import unshard
    from ..runtime.shard import shard

    apply_fn, params, info = shard(model, plan, mesh, example_inputs=inputs)
    proof = apply_fn.runtime.checks.get("proof", "")
    torch.manual_seed(FORWARD_SEED)
    out = apply_fn(params, **inputs)
    loss = loss_fn(out)
    loss.backward()
    runs = [("backward", loss.detach(), {k: p.grad for k, p in params.items()})]
    note = ""
    if functional:
        try:
            # only what trains: a frozen parameter (Whisper's sinusoidal positions) has no reference gradient
            frozen = {k: p.detach() for k, p in params.items() if not p.requires_grad}
            torch.manual_seed(FORWARD_SEED)
            grads, value = torch.func.grad_and_value(lambda p: loss_fn(apply_fn({**frozen, **p}, **inputs)))(
                {k: p.detach() for k, p in params.items() if p.requires_grad})
            runs.append(("func.grad", value.detach(), {k: grads.get(k) for k in params}))
        except Exception as exc:
            if _functional_works(model, inputs, loss_fn):
                raise
            note = f"; torch.func.grad not checked: the unsharded model fails under it too ({first_line(exc)[:80]})"
    worst = {"loss": 0.0, "grad": 0.0, "where": "", "note": note}
    ok = True
    for label, value, grads in runs:
        full = unshard({k: (g if g is not None else torch.zeros_like(params[k])) for k, g in grads.items()}, info)
        d = (value.float() - ref_loss.float()).abs().item()
        ok &= d <= tol + tol * ref_loss.abs().item()
        worst["loss"] = max(worst["loss"], d)
        for k, ref in ref_grads.items():
            got = full.get(k)
            ref = torch.zeros_like(got) if ref is None and got is not None else ref
            if got is None or ref is None or got.shape != ref.shape:
                ok = False
                shape = None if got is None else tuple(got.shape)
                worst["where"] = worst["where"] or f"{label} grad {k}: missing or shape {shape}"
                continue
            diff = (got.float() - ref.float()).abs()
            d = diff.max().item() if diff.numel() else 0.0
            scale = ref.float().abs().max() if ref.numel() else 0.0  # relative to the tensor's scale
            if not bool((diff <= tol * (1 + scale)).all()):
                ok = False
                if d >= worst["grad"]:
                    worst["where"] = f"{label} grad {k}"
            worst["grad"] = max(worst["grad"], d)
    held = sum(p.numel() for p in params.values())
    total = sum(p.numel() for p in model.parameters())
    return {"ok": ok, **worst, "share": held / max(total, 1), "proof": proof}


def rejudged_in_float64(model, inputs: dict[str, Any], mesh, plan, functional: bool,
                        loss_fn=loss_of) -> dict[str, Any] | None:
    """``compare`` rerun with the model and its floating inputs in float64 (tolerance ``TOL64``),
    for a row whose float32 difference exceeds ``TOL``: a loss that amplifies rounding (CTC's
    hundreds, a contrastive loss's temperature) agrees there to 1e-15, a wrong plan does not.
    ``model`` (the sweep's own) is cast in place; None where it does not run in float64."""
    try:
        model = model.double()
        inputs = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}
        model.zero_grad(set_to_none=True)
        torch.manual_seed(FORWARD_SEED)
        ref = loss_fn(model(**inputs))
        ref.backward()
    except Exception:  # noqa: BLE001 - a model with a float32-only path: the float32 verdict stands
        return None
    grads = {k: p.grad for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return compare(model, inputs, ref.detach(), grads, mesh, plan, functional, loss_fn, tol=TOL64)


def _functional_works(model, inputs: dict[str, Any], loss_fn=loss_of) -> bool:
    """Whether ``torch.func.grad`` runs on the unsharded model (HF's Bloom, e.g., has an
    ``autograd.Function`` without ``setup_context``)."""
    params = {k: p.detach() for k, p in model.named_parameters()}
    try:
        torch.func.grad(lambda p: loss_fn(torch.func.functional_call(model, p, (), inputs)))(params)
    except Exception:  # noqa: BLE001 - any failure: the transform does not apply to this model
        return False
    return True


def check_family(model_type: str, mesh=None, *, functional: bool = True, seed: int = 0, task=None) -> dict[str, Any]:
    """The support-table row of ``model_type`` on this rank (call on every rank of ``mesh``, a
    1-D mesh named ``tp``; default: one over the whole default process group).  ``task``: the head
    (a ``sweep_tasks.Task``; default: the type's main head)."""
    from .sweep_tasks import category_of, task_for

    def make(tp: int):
        row["category"] = category_of(model_type)
        row["task"] = (task or task_for(model_type)).name
        return build(model_type, tp, seed, task or task_for(model_type))

    row: dict[str, Any] = {"model_type": model_type}
    return _check(row, make, mesh, functional)


def check_extra(name: str, builder, mesh=None, *, functional: bool = True, seed: int = 0) -> dict[str, Any]:
    """``check_family`` for a family outside transformers (``sweep_extras``, module docstring):
    ``builder(tp, seed)`` returns an object with ``model``, ``inputs``, ``category`` and
    ``loss_of(output)``, or a tuple ``(model, inputs, category)`` (the loss then ``loss_of``)."""
    loss_fn = [loss_of]

    def make(tp: int):
        made = builder(tp, seed)
        if hasattr(made, "model"):
            model, inputs, row["category"], loss_fn[0] = made.model, made.inputs, made.category, made.loss_of
        else:
            model, inputs, row["category"] = made
        row["task"] = "extra"
        model = model.eval()
        torch.manual_seed(FORWARD_SEED)
        ref = loss_fn[0](model(**inputs))
        if not torch.isfinite(ref):
            raise ValueError(f"unsharded loss is {ref.item()}")
        ref.backward()
        grads = {k: p.grad for k, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return model, inputs, ref.detach(), grads

    row: dict[str, Any] = {"model_type": name}
    return _check(row, make, mesh, functional, lambda out: loss_fn[0](out))


def _first_accepted(model, inputs: dict[str, Any], ref: tuple, mesh, functional: bool, loss_fn) -> tuple[dict, Any, str]:
    """``compare`` on the first plan of ``plans_in_turn`` that ``shard()`` accepts: (its result, the
    plan, its source); the last refusal where it accepts none."""
    from ..core.errors import PlanError

    first, source = plan_for(model, mesh, inputs)
    refusal = None
    for plan, name in plans_in_turn(model, mesh, inputs, first, source):
        try:
            return compare(model, inputs, *ref, mesh, plan, functional, loss_fn), plan, name
        except PlanError as exc:
            refusal = exc
    raise refusal


def _check(row: dict[str, Any], make, mesh, functional: bool, loss_fn=loss_of) -> dict[str, Any]:
    """Build (``make(tp)`` -> model, inputs, loss, gradients; it may fill the row's category and
    task), plan, shard and compare (``loss_fn``: the loss of one output); the row with its outcome."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ..core.errors import CheckpointError, CollectiveError, PlanError, ReplicationError

    t0 = time.perf_counter()
    row.update(plan="", reason="", share=None, proof="")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if mesh is None:
            mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
        row["tp"] = mesh.size()
        try:
            model, inputs, ref_loss, ref_grads = make(mesh.size())
        except Exception as exc:  # noqa: BLE001 - the family cannot be built or run unsharded at tiny size
            return {**row, "outcome": UNBUILDABLE, "reason": unbuildable(row["model_type"], exc),
                    "seconds": time.perf_counter() - t0}
        row["plan"] = plan_source(model)
        row["inputs"] = ", ".join(inputs)
        try:
            res, plan, row["plan"] = _first_accepted(model, inputs, (ref_loss, ref_grads), mesh, functional, loss_fn)
        except (PlanError, ReplicationError, CheckpointError) as exc:  # the library's own refusal, by name
            row.update(outcome=REFUSED, reason=first_line(exc))
        except CollectiveError as exc:  # a collective that did not complete: a rank stuck or out of step
            row.update(outcome=HANG, reason=f"{first_line(exc)} @ {site(exc)}")
        except Exception as exc:  # noqa: BLE001 - classified: a timeout is a hang, anything else a crash
            row.update(outcome=HANG if _is_hang(exc) else CRASH, reason=f"{first_line(exc)} @ {site(exc)}")
            if isinstance(exc, MemoryError) or "can't allocate memory" in str(exc):  # the sweep's own cap, not a bug
                row.update(outcome=UNBUILDABLE, reason=f"{MEMORY_CAP} ({first_line(exc)[:80]})")
        else:
            row["share"], row["proof"] = res["share"], proof_label(res["proof"])
            if not res["ok"] and (again := rejudged_in_float64(model, inputs, mesh, plan, functional, loss_fn)):
                res = {**res, "ok": again["ok"], "note": res["note"] + (
                    f"; float32 rounding (loss {res['loss']:.1g}, grad {res['grad']:.1g}): exact in float64 to "
                    f"{max(again['loss'], again['grad']):.0e}" if again["ok"] else
                    f"; wrong in float64 too (loss {again['loss']:.2g}, grad {again['grad']:.2g})")}
            if not res["ok"]:
                row.update(outcome=WRONG, reason=f"loss {res['loss']:.2g}, grad {res['grad']:.2g} ({res['where']})")
            elif row["proof"] == UNPROVED:  # shard()'s obligation broken (verify=True, allow_unproved=False): a bug
                row.update(outcome=CRASH, reason=f"shard() accepted the plan unproved ({res['proof'][:120]})")
            elif res["share"] >= LITTLE_SHARE:
                row.update(outcome=LITTLE, reason=f"a rank holds {res['share']:.0%} of the parameters")
            else:
                row.update(outcome=EXACT, reason=f"a rank holds {res['share']:.0%}; max diff loss {res['loss']:.1g}, "
                                                 f"grad {res['grad']:.1g}")
            row["reason"] += res["note"]
    row["seconds"] = time.perf_counter() - t0
    return row


def build_only(model_type: str, tp: int = 2, seed: int = 0) -> dict[str, Any]:
    """The row of ``model_type`` without sharding (``benchmarks/models.py --build-only``): whether
    its tiny model of its main head builds and runs forward and backward unsharded, on which inputs."""
    from .sweep_tasks import category_of, task_for

    t0 = time.perf_counter()
    row: dict[str, Any] = {"model_type": model_type, "tp": tp, "plan": "", "reason": "", "share": None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            row["category"] = category_of(model_type)
            row["task"] = task_for(model_type).name
            model, inputs, ref_loss, _ = build(model_type, tp, seed)
        except Exception as exc:  # noqa: BLE001 - not buildable: its reason is the row
            return {**row, "outcome": UNBUILDABLE, "reason": unbuildable(model_type, exc), "seconds": time.perf_counter() - t0}
    total = sum(p.numel() for p in model.parameters())
    return {**row, "outcome": "built", "plan": plan_source(model), "inputs": ", ".join(inputs),
            "reason": f"loss {ref_loss.item():.3g}, {total} parameters", "seconds": time.perf_counter() - t0}


def combine(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from the per-rank rows: the worst outcome; a note where the ranks disagree."""
    capped = [r for r in rows if r["outcome"] == UNBUILDABLE and r["reason"].startswith(MEMORY_CAP)]
    if capped:  # a rank out of the sweep's memory leaves its peers waiting: the cap, not a hang
        return {**capped[0], "reason": f"{capped[0]['reason']} (rank {rows.index(capped[0])}; its peers then stopped)"}
    worst = min(rows, key=lambda r: OUTCOMES.index(r["outcome"]))
    outcomes = sorted({r["outcome"] for r in rows})
    if len(outcomes) > 1:
        return {**worst, "reason": f"{worst['reason']} (ranks disagree: {', '.join(outcomes)})"}
    return worst


def heads_allow(model_type: str, tp: int) -> bool:
    """Whether the tiny config at ``tp`` has attention heads divisible by ``tp``, or none to divide
    (a ConvNet, a codec: its channels are what a plan splits)."""
    from .model_configs import tiny_config_for

    try:
        config = tiny_config_for(model_type, tp=tp)
    except Exception:  # noqa: BLE001 - not buildable: nothing to run at this tp
        return False
    config = getattr(config, "text_config", None) or config
    heads = next((getattr(config, k) for k in ("num_attention_heads", "n_head", "num_heads", "decoder_attention_heads",
                                                "n_heads") if isinstance(getattr(config, k, None), int)), None)
    return heads is None or heads % tp == 0
