"""The ``hp-functional`` command line.

* ``hp-functional demo``: shard a tiny HF Llama with TP=2 and train it beside the unsharded model;
* ``hp-functional plan MODEL --tp 2``: the resolved plan (per-parameter placements and local
  shapes), lint findings, the communication schedule and per-rank memory — simulated in this
  process (fake process group, meta model), so any world size works;
* ``hp-functional check MODEL --tp 2``: spawn gloo ranks and print ``validate``'s report
  (the sharded model against the unsharded one).

MODEL is a built-in tiny config (llama, qwen2, qwen3, mistral, gemma, phi3) or the path of a
local HF ``config.json``; nothing is downloaded.  The plan is the model's HF plan unless
``--plan module:function`` names a function returning one (called with the model if it takes an
argument).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import math
import os
import sys
import warnings

_AXES = ("dp", "cp", "ep", "tp")
def _backend(device: str) -> str:
    """torch's default process-group backend for a device type (cpu → gloo, cuda → nccl, ...;
    torch-npu registers npu → hccl); an unknown device type is an error, not a silent gloo."""
    import torch.distributed as dist

    backend = dist.Backend.default_device_backend_map.get(device)
    if backend is None:
        raise SystemExit(f"hp-functional: no process-group backend is registered for device type {device!r} "
                         f"(known: {sorted(dist.Backend.default_device_backend_map)})")
    return backend


def _mesh_spec(args) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Mesh shape and dim names from --dp/--cp/--ep/--tp (size-1 axes left out, tp always in)."""
    chosen = [(a, getattr(args, a)) for a in _AXES if getattr(args, a) > 1 or a == "tp"]
    return tuple(n for _, n in chosen), tuple(a for a, _ in chosen)


def _load_plan(spec: str | None, model, loss_parallel: bool):
    """The model's HF plan, or the plan ``module:function`` returns."""
    from ..plan.plan import ShardingPlan

    if spec is None:
        return ShardingPlan.from_hf(model, loss_parallel=loss_parallel)
    module, _, attr = spec.partition(":")
    fn = getattr(importlib.import_module(module), attr)
    plan = fn(model) if inspect.signature(fn).parameters else fn()
    return plan if isinstance(plan, ShardingPlan) else ShardingPlan(plan)


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
def _simulated(args):
    """Runs inside ``simulate``: the plan, its lint findings and (without errors) its explanation."""
    import torch

    from ..compile.build import lint
    from ..core.errors import PlanWarning
    from ..tools.explain import explain
    from ..tools.models import build_model, load_config

    model = build_model(load_config(args.model), device="meta")
    dtype = getattr(torch, args.dtype) if args.dtype else None

    def run(mesh):
        plan = _load_plan(args.plan, model, args.loss_parallel)
        findings = lint(model, plan, mesh)
        if any(f.level == "error" for f in findings):
            return model, plan, findings, None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PlanWarning)  # printed below as findings
            return model, plan, findings, explain(model, plan, mesh, batch=args.batch, seq=args.seq, dtype=dtype)

    return run


def plan_command(args) -> int:
    """Print the resolved plan, findings, schedule and memory; 1 when lint finds errors."""
    from rich.table import Table

    from ..compile.lint import collapse
    from ..tools.simulate import simulate
    from ..tools.tables import memory_table, params_table, schedule_table, totals_table

    shape, names = _mesh_spec(args)
    model, plan, findings, exp = simulate(_simulated(args), world_size=math.prod(shape), mesh_shape=shape,
                                          mesh_dim_names=names, rank=args.rank)
    console = _console()
    cfg = model.config
    console.print(f"[bold]{type(model).__name__}[/bold] ({args.model}): {cfg.num_hidden_layers} layers, hidden "
                  f"{cfg.hidden_size}, vocab {cfg.vocab_size}; mesh {dict(zip(names, shape, strict=True))}, "
                  f"shown as rank {args.rank}")
    counts: dict[str, int] = {}
    for b in exp.program.boundaries if exp else ():
        counts[b.planned.pattern] = counts.get(b.planned.pattern, 0) + 1
    table = Table(title="plan", title_justify="left")
    for col in ("pattern", "style", "axis", "modules"):
        table.add_column(col)
    for pattern, style in plan.entries.items():
        table.add_row(pattern or "(root)", _short(style), getattr(style, "axis", None) or plan.tp_axis,
                      str(counts.get(pattern, "-")))
    console.print(table)
    for line in collapse(findings):
        console.print(line, style="red" if line.startswith("error") else "yellow", markup=False)
    if exp is None:
        return 1
    console.print(params_table(exp.program))
    if exp.schedule is None:
        console.print(f"no schedule: {exp.schedule_error}", markup=False)
    else:
        if not args.brief:
            console.print(schedule_table(exp.schedule))
        console.print(totals_table(exp.schedule))
    console.print(memory_table(exp.memory))
    return 0


# ---------------------------------------------------------------- check
def check_rank(model_name: str, shape: tuple[int, ...], names: tuple[str, ...], plan_spec: str | None,
               loss_parallel: bool, batch: int, seq: int, device: str) -> tuple[bool, str]:
    """Runs on every spawned rank: ``validate`` the plan on the seeded model; (ok, report text)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from ..tools.models import build_model, load_config
    from ..tools.validate import validate

    mesh = init_device_mesh(device, shape, mesh_dim_names=names)
    config = load_config(model_name)
    model = build_model(config, seed=0).to(device)  # the same seed: the same weights on every rank
    plan = _load_plan(plan_spec, model, loss_parallel)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    report = validate(model, plan, mesh, input_ids=ids, labels=ids)
    return report.ok, str(report)


def check_command(args) -> int:
    """Spawn the ranks (or run under torchrun), print rank 0's report; 1 unless every rank is ok."""
    from .launch import run_ranks

    shape, names = _mesh_spec(args)
    os.environ.setdefault("HPF_BACKEND", _backend(args.device))
    results = run_ranks(check_rank, math.prod(shape), args.model, shape, names, args.plan, args.loss_parallel,
                        args.batch, args.seq, args.device)
    first = results[min(results)]
    print(first[1])
    return 0 if all(ok for ok, _ in results.values()) else 1


# ---------------------------------------------------------------- entry point
def _model_args(p: argparse.ArgumentParser, batch: int, seq: int) -> None:
    p.add_argument("model", help="llama, qwen2, qwen3, mistral, gemma, phi3, or a local config.json path")
    for axis in _AXES:
        p.add_argument(f"--{axis}", type=int, default=2 if axis == "tp" else 1, help=f"size of the {axis!r} mesh axis")
    p.add_argument("--plan", help="module:function returning the plan (default: the model's HF plan)")
    p.add_argument("--loss-parallel", action="store_true", help="keep the logits vocab-sharded (HF plan only)")
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--seq", type=int, default=seq)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hp-functional", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="shard a tiny HF Llama with TP and train it beside the unsharded model")
    demo.add_argument("--nproc", type=int, default=2, help="local ranks to spawn (ignored under torchrun)")
    demo.add_argument("--steps", type=int, default=8)
    demo.add_argument("--device", default="cpu", help="mesh device type: cpu (gloo), cuda (nccl), npu (hccl)")
    plan = sub.add_parser("plan", help="the resolved plan, lint, communication schedule and memory (simulated)")
    _model_args(plan, batch=1, seq=128)
    plan.add_argument("--dtype", help="parameter dtype for the byte counts (e.g. bfloat16; default: the model's)")
    plan.add_argument("--rank", type=int, default=0, help="which rank's local shapes to show")
    plan.add_argument("--brief", action="store_true", help="totals only, not every collective")
    check = sub.add_parser("check", help="spawn gloo ranks and validate the plan against the unsharded model")
    _model_args(check, batch=2, seq=16)
    check.add_argument("--device", default="cpu", help="mesh device type: cpu (gloo), cuda (nccl), npu (hccl)")
    args = parser.parse_args(argv)

    if args.command == "plan":
        return plan_command(args)
    if args.command == "check":
        return check_command(args)
    if args.command == "demo":
        from .demo import train
        from .launch import run_ranks

        os.environ.setdefault("HPF_BACKEND", _backend(args.device))
        results = run_ranks(train, args.nproc, args.steps, 0.2, args.device)
        history = next(iter(results.values()))
        worst = max(abs(a - b) for a, b in history)
        return 0 if worst < 1e-4 else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
