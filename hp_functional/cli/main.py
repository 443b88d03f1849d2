"""The hp-functional command line.

  hp-functional demo
      shard a tiny HF Llama with TP=2 and train it beside the unsharded model;
  hp-functional plan MODEL --tp 2
      the resolved plan (per-parameter placements and local shapes), lint findings, the
      communication schedule of one training step and per-rank memory, simulated in this
      process (fake process group, meta model), so any world size works;
  hp-functional check MODEL --tp 2
      spawn gloo ranks and print validate's report (the sharded model against the unsharded one).

MODEL is a built-in tiny config (llama, qwen2, qwen3, mistral, gemma, phi3) or the path of a
local HF config.json; nothing is downloaded.  The plan is the model's HF plan unless
--plan module:name names a ShardingPlan, a dict of styles, or a function returning one (called
with the model if it takes a required argument), e.g. --plan hp_functional:llama_sp_plan.

This module imports nothing heavy at module level (no torch, rich or transformers), so
--help and argument errors are fast; each command imports what it needs.
"""

from __future__ import annotations

__all__ = ["main"]

import argparse
import dataclasses
import importlib
import inspect
import math
import os
import sys
import traceback
import warnings
from collections.abc import Mapping

_AXES = ("dp", "cp", "ep", "tp")
_PROG = "hp-functional"


class UsageError(Exception):
    """A bad command-line argument (model, --plan, --dtype): one line, exit status 2."""


def _backend(device: str) -> str:
    """torch's default process-group backend for a device type (cpu → gloo, cuda → nccl, ...;
    torch-npu registers npu → hccl); an unknown device type is an error, not a silent gloo."""
    import torch.distributed as dist

    backend = dist.Backend.default_device_backend_map.get(device)
    if backend is None:
        raise UsageError(f"no process-group backend is registered for device type {device!r} "
                         f"(known: {', '.join(sorted(dist.Backend.default_device_backend_map))})")
    return backend


def _mesh_spec(args) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Mesh shape and dim names from --dp/--cp/--ep/--tp (size-1 axes left out, tp always in)."""
    for a in _AXES:
        if getattr(args, a) < 1:
            raise UsageError(f"--{a} must be at least 1, not {getattr(args, a)}")
    chosen = [(a, getattr(args, a)) for a in _AXES if getattr(args, a) > 1 or a == "tp"]
    return tuple(n for _, n in chosen), tuple(a for a, _ in chosen)


def _plan_source(spec: str):
    """The object ``module:name`` names (imported here, so a bad spec fails before any work)."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise UsageError(f"--plan {spec!r}: expected module:name (e.g. hp_functional:llama_sp_plan)")
    if os.getcwd() not in sys.path and "" not in sys.path:  # a console script: let --plan name a module here
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
            raise UsageError(f"--plan {spec!r}: no module named {exc.name!r}") from None
        raise UsageError(f"--plan {spec!r}: importing {module!r} failed: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the user's module raised while importing
        raise UsageError(f"--plan {spec!r}: importing {module!r} failed: {type(exc).__name__}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"--plan {spec!r}: {getattr(obj, '__name__', module)!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    return obj


def _required_params(fn) -> int | None:
    """How many positional arguments ``fn`` requires (None when its signature is unknown)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in params if p.kind in kinds and p.default is inspect.Parameter.empty)


def _load_plan(spec: str | None, model, loss_parallel: bool):
    """The model's HF plan, or the plan ``module:name`` gives: a ShardingPlan, a dict of styles,
    or a function returning either (called with the model when it requires one argument, with
    none when it requires none, e.g. ``llama_sp_plan(tp_axis="tp")``)."""
    from ..plan.plan import ShardingPlan

    if spec is None:
        return ShardingPlan.from_hf(model, loss_parallel=loss_parallel)
    source = _plan_source(spec)
    if isinstance(source, ShardingPlan | Mapping):
        plan = source
    elif callable(source) and not inspect.isclass(source):
        plan = _call_plan_function(spec, source, model)
    else:
        what = (f"the class {source.__name__}" if inspect.isclass(source)
                else f"{_clip(repr(source))} ({type(source).__name__})")
        raise UsageError(f"--plan {spec!r} is {what}, not a ShardingPlan, a dict of styles or a function returning one")
    if isinstance(plan, ShardingPlan):
        return plan
    if isinstance(plan, Mapping):
        return ShardingPlan(plan)
    raise UsageError(f"--plan {spec!r} returned {_clip(repr(plan))} ({type(plan).__name__}), "
                     "not a ShardingPlan or a dict of styles")


def _call_plan_function(spec: str, fn, model):
    """``fn(model)`` or ``fn()``; an exception other than PlanError becomes one line naming where."""
    from ..core.errors import PlanError

    name = getattr(fn, "__name__", spec)
    required = _required_params(fn)
    if required not in (None, 0, 1):
        raise UsageError(f"--plan {spec!r}: {name} requires {required} arguments; a plan function takes the model "
                         "or nothing")
    call = f"{name}(model)" if required == 1 else f"{name}()"
    try:
        return fn(model) if required == 1 else fn()
    except PlanError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's plan function raised: a usage error naming it
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        raise UsageError(f"--plan {spec!r}: {call} raised {type(exc).__name__}: {_one_line(exc)} "
                         f"({frame.filename}:{frame.lineno})") from None


def _clip(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _load_model_config(name: str):
    try:
        from ..tools.models import load_config

        return load_config(name)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _dtype(name: str | None):
    import torch

    if name is None:
        return None
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise UsageError(f"--dtype {name!r} is not a torch dtype (e.g. float32, bfloat16, float16)")
    return dtype


def _short(style) -> str:
    """A style with only its non-default fields."""
    if not dataclasses.is_dataclass(style):
        return repr(style)
    parts = []
    for f in dataclasses.fields(style):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        value = getattr(style, f.name)
        if value != default:
            parts.append(f"{f.name}={value!r}")
    return f"{type(style).__name__}({', '.join(parts)})"


def _console():
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=160, no_color=True, highlight=False)


# ---------------------------------------------------------------- plan
def _simulated(model, plan, args, dtype):
    """Runs inside ``simulate``: the plan's lint findings and (without errors) its explanation."""

    def run(mesh):
        from ..compile.build import lint
        from ..core.errors import PlanWarning
        from ..tools.explain import explain

        findings = lint(model, plan, mesh)
        if any(f.level == "error" for f in findings):
            return findings, None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PlanWarning)  # printed below as findings
            return findings, explain(model, plan, mesh, batch=args.batch, seq=args.seq, dtype=dtype,
                                     fsdp=args.fsdp, remat=args.remat or None,
                                     optimizer=None if args.optimizer == "none" else args.optimizer)

    return run


def plan_command(args) -> int:
    """Print the resolved plan, findings, schedule and memory; 1 when lint finds errors, the step
    cannot run, or its peak exceeds ``--fit`` GiB."""
    from ..compile.lint import collapse
    from ..tools.models import build_model
    from ..tools.simulate import simulate

    shape, names, dtype = _plan_arguments(args)
    # the model and the plan are made before the fake process group starts: their errors are plain
    model = build_model(_load_model_config(args.model), device="meta")
    plan = _load_plan(args.plan, model, args.loss_parallel)
    findings, exp = simulate(_simulated(model, plan, args, dtype), world_size=math.prod(shape), mesh_shape=shape,
                             mesh_dim_names=names, rank=args.rank)
    console = _console()
    _print_header(console, model, args, dict(zip(names, shape, strict=True)), dtype)
    console.print(_plan_table(plan, exp))
    for line in collapse(findings):
        console.print(line, style="red" if line.startswith("error") else "yellow", markup=False)
    if exp is None:
        return 1
    fits = _print_step(console, exp, args)
    _print_unused_axes(console, plan, names, args, exp.memory.per_rank)
    return 1 if exp.schedule is None or not fits else 0  # the forward could not run (said above), or too big


def _plan_arguments(args) -> tuple[tuple[int, ...], tuple[str, ...], object]:
    """``plan``'s mesh (shape, names) and dtype, once its options agree (else ``UsageError``)."""
    shape, names = _mesh_spec(args)
    if not 0 <= args.rank < math.prod(shape):
        raise UsageError(f"--rank {args.rank} is not in [0, {math.prod(shape)})")
    dtype = _dtype(args.dtype)
    if args.fsdp and args.dp < 2:
        raise UsageError("--fsdp shards over the dp axis: give --dp 2 or more")
    if args.fit is not None and not args.fit > 0:
        raise UsageError(f"--fit must be a positive number of GiB, not {args.fit}")
    return shape, names, dtype


def _print_header(console, model, args, mesh: Mapping[str, int], dtype) -> None:
    """The model, the mesh and the step that ``plan`` shows."""
    cfg = model.config
    dtype_name = str(dtype or model.dtype).removeprefix("torch.")
    console.print(f"[bold]{type(model).__name__}[/bold] ({args.model}): {cfg.num_hidden_layers} layers, hidden "
                  f"{cfg.hidden_size}, vocab {cfg.vocab_size}; mesh {dict(mesh)}, shown as rank {args.rank}")
    extras = "".join(f", {w}" for w, on in (("fsdp over dp", args.fsdp), ("remat", args.remat)) if on)
    console.print(f"one training step (forward + backward + {args.optimizer} update) of batch {args.batch} x seq "
                  f"{args.seq} (this rank's input_ids), parameters in {dtype_name}{extras}", markup=False)


def _plan_table(plan, exp):
    """The plan's entries: pattern, style, axis and how many modules each matched (``-`` without a program)."""
    from rich.table import Table

    counts: dict[str, int] = {}
    for b in exp.program.boundaries if exp else ():
        counts[b.planned.pattern] = counts.get(b.planned.pattern, 0) + 1
    table = Table(title="plan", title_justify="left")
    for col in ("pattern", "style", "axis", "modules"):
        table.add_column(col)
    for pattern, style in plan.entries.items():
        table.add_row(pattern or "(root)", _short(style), plan.axis_of(style) or "-",
                      str(counts.get(pattern, "-")))
    return table


def _print_step(console, exp, args) -> bool:
    """The parameters, the step's schedule (or why there is none) and memory; whether its peak fits ``--fit``."""
    from ..tools.tables import human, memory_table, params_table, schedule_table, totals_table

    console.print(params_table(exp.program, merge_layers=args.brief))
    if exp.schedule is None:
        console.print(f"no schedule: {exp.schedule_error}", markup=False)
    else:
        if not args.brief:
            console.print(schedule_table(exp.schedule.rows))
        console.print(totals_table(exp.schedule.totals()))
    console.print(memory_table(exp.memory.rows(), exp.memory.world))
    if args.fit is None or exp.memory.peak is None:
        return True
    fits = exp.memory.peak <= args.fit * 2**30
    console.print(f"{'fits' if fits else 'does not fit'}: peak {human(exp.memory.peak)} per rank "
                  f"{'<=' if fits else '>'} {args.fit:g} GiB", markup=False)
    return fits


def _print_unused_axes(console, plan, names: tuple[str, ...], args, per_rank: int) -> None:
    """A note per mesh axis the plan does not act on: what the totals leave out there (``per_rank``: the
    parameter bytes per rank, about the gradients a dp reduction would carry)."""
    from ..tools.tables import human

    for axis in [a for a in names if a not in plan.axes_used()]:
        if axis == "dp" and args.fsdp:
            continue  # fsdp's all-gathers and reduce-scatters over dp are in the schedule
        if axis == "dp":
            console.print(f"note: not in these totals: the data-parallel gradient reduction over dp={args.dp} "
                          f"(about {human(per_rank)} of gradients per rank per step). A plan acts only on "
                          f"its own axes ({', '.join(sorted(plan.axes_used() & set(names)))}); dp is applied around "
                          "it (fsdp or a gradient all-reduce).", markup=False)
        else:
            console.print(f"note: the plan does not use mesh axis {axis!r}: parameters are replicated over it and "
                          "nothing on it is in these totals.", markup=False)


# ---------------------------------------------------------------- check
def check_rank(model_name: str, shape: tuple[int, ...], names: tuple[str, ...], plan_spec: str | None,
               loss_parallel: bool, batch: int, seq: int, device: str) -> tuple[bool, str]:
    """Runs on every spawned rank: ``validate`` the plan on the seeded model; (ok, report text).
    A plan error (raised on every rank before any collective) comes back as ``"error: ..."``."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from ..core.errors import PlanError
    from ..tools.models import build_model
    from ..tools.validate import validate

    try:
        mesh = init_device_mesh(device, shape, mesh_dim_names=names)
        config = _load_model_config(model_name)
        model = build_model(config, seed=0).to(device)  # the same seed: the same weights on every rank
        plan = _load_plan(plan_spec, model, loss_parallel)
        ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
        report = validate(model, plan, mesh, input_ids=ids, labels=ids, raise_on_failure=False)
    except (PlanError, UsageError) as exc:
        return False, f"error: {_one_line(exc)}"
    return report.ok, str(report)


def check_command(args) -> int:
    """Spawn the ranks (or run under torchrun), print rank 0's report; 1 unless every rank is ok."""
    from .launch import run_ranks

    shape, names = _mesh_spec(args)
    _load_model_config(args.model)  # argument errors here, before any rank is spawned
    os.environ.setdefault("HPF_BACKEND", _backend(args.device))
    results = run_ranks(check_rank, math.prod(shape), args.model, shape, names, args.plan, args.loss_parallel,
                        args.batch, args.seq, args.device)
    first = results[min(results)]
    if first[1].startswith("error: "):
        print(f"{_PROG}: {first[1]}", file=sys.stderr)
        return 1
    print(first[1])
    return 0 if all(ok for ok, _ in results.values()) else 1


# ---------------------------------------------------------------- demo
def demo_command(args) -> int:
    from .demo import train
    from .launch import run_ranks

    os.environ.setdefault("HPF_BACKEND", _backend(args.device))
    results = run_ranks(train, args.nproc, args.steps, 0.2, args.device)
    history = next(iter(results.values()))
    worst = max(abs(a - b) for a, b in history)
    return 0 if worst < 1e-4 else 1


# ---------------------------------------------------------------- entry point
def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _model_args(p: argparse.ArgumentParser, batch: int, seq: int) -> None:
    p.add_argument("model", help="llama, qwen2, qwen3, mistral, gemma, phi3, or a local config.json path (or its folder)")
    for axis in _AXES:
        p.add_argument(f"--{axis}", type=int, default=2 if axis == "tp" else 1, metavar="N",
                       help=f"size of the {axis!r} mesh axis (default: %(default)s)")
    p.add_argument("--plan", metavar="MODULE:NAME",
                   help="a ShardingPlan, dict of styles, or function returning one, e.g. hp_functional:llama_sp_plan "
                        "(default: the model's HF plan)")
    p.add_argument("--loss-parallel", action="store_true", help="keep the logits vocab-sharded (HF plan only)")
    p.add_argument("--batch", type=int, default=batch, metavar="B",
                   help="sequences in this rank's example input_ids (default: %(default)s)")
    p.add_argument("--seq", type=int, default=seq, metavar="S",
                   help="tokens per sequence in this rank's example input_ids (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=_PROG, description=__doc__.split("\n\nThis module")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="shard a tiny HF Llama with TP and train it beside the unsharded model",
                          description="Shard a tiny HF Llama with TP on spawned local ranks and train it beside the "
                                      "unsharded model; exit status 1 if any step's losses differ by 1e-4 or more.")
    demo.add_argument("--nproc", type=int, default=2, help="local ranks to spawn (ignored under torchrun; default: 2)")
    demo.add_argument("--steps", type=int, default=8, help="training steps (default: %(default)s)")
    demo.add_argument("--device", default="cpu", help="mesh device type: cpu (gloo), cuda (nccl), npu (hccl)")
    plan = sub.add_parser("plan", help="the resolved plan, lint, communication schedule and memory (simulated)",
                          description="The resolved plan, lint findings, one training step's communication schedule "
                                      "and per-rank memory (parameters, gradients, optimizer state, activations, the "
                                      "step's peak), simulated in this process (fake process group, meta model, fake "
                                      "tensors). Exit status 1 when lint finds errors, the step cannot run on "
                                      "--batch/--seq, or its peak exceeds --fit GiB; 2 on a bad argument.")
    _model_args(plan, batch=1, seq=128)
    plan.add_argument("--dtype", help="parameter dtype for the byte counts (e.g. bfloat16; default: the model's)")
    plan.add_argument("--rank", type=int, default=0, help="which rank's local shapes to show (default: 0)")
    plan.add_argument("--fsdp", action="store_true",
                      help="also shard parameters, gradients and optimizer state over dp with hpf.fsdp (needs --dp)")
    plan.add_argument("--remat", action="store_true", help="recompute the decoder layers in the backward "
                                                           "(shard(remat=True))")
    plan.add_argument("--optimizer", choices=("adamw", "sgd", "none"), default="adamw",
                      help="whose state and update the memory counts (default: %(default)s, hpf.optim.adamw)")
    plan.add_argument("--fit", type=float, metavar="GiB",
                      help="exit 1 unless the step's peak per rank is at most this many GiB")
    plan.add_argument("--brief", action="store_true",
                      help="merge parameters that differ only in layer index into one row, totals instead of "
                           "every collective")
    check = sub.add_parser("check", help="spawn gloo ranks and validate the plan against the unsharded model",
                           description="Spawn one local rank per mesh position and validate the plan against the "
                                       "unsharded model (outputs, loss, every gradient). Exit status 1 unless every "
                                       "rank is ok, 2 on a bad argument.")
    _model_args(check, batch=2, seq=16)
    check.add_argument("--device", default="cpu", help="mesh device type: cpu (gloo), cuda (nccl), npu (hccl)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The console script: 0 ok, 1 a failed check or plan error, 2 a bad argument."""
    parser = build_parser()
    args = parser.parse_args(argv)
    commands = {"plan": plan_command, "check": check_command, "demo": demo_command}
    # init_process_group (the fake one of ``plan`` included) replaces sys.excepthook with one that
    # prefixes every line of a traceback with "[rank0]:" and destroy_process_group leaves it there;
    # the command line puts the interpreter's hook back when it is done.
    hook = sys.excepthook
    try:
        if getattr(args, "plan", None) is not None:
            _plan_source(args.plan)  # a bad --plan fails first, before torch or any model is loaded
        return commands[args.command](args)
    except UsageError as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        from ..core.errors import PlanError

        if not isinstance(exc, PlanError):
            raise
        print(f"{_PROG}: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    finally:
        sys.excepthook = hook


if __name__ == "__main__":
    sys.exit(main())
