"""One training step (forward, backward, clip, optimizer) of ``hpf.fsdp`` over TP against torch's
FSDP2 ``fully_shard`` over ``parallelize_module`` (DTensor TP) on the same model, batch and mesh.

    python benchmarks/train_step.py                  # tiny Llama, world 4 (dp 2 x tp 2) and 2 (dp 2 alone), CPU/gloo
    python benchmarks/train_step.py --quick          # fewer steps (a smoke run)
    python benchmarks/train_step.py --sizes tiny,large
    torchrun --nproc-per-node 8 benchmarks/train_step.py --device cuda --tp 2     # one world size, dp 4 x tp 2

A world of 2 ranks is dp 2 alone (a 1-D ``("dp",)`` mesh, ``hpf.ShardingPlan({})`` against
``fully_shard`` alone); a larger one is dp (world / tp) x tp (``--tp``, default 2) on a
``("dp", "tp")`` mesh, with HF's Llama plan on both sides (``ShardingPlan.from_hf`` and the same
plan in DTensor styles, ``bench_models.dtensor_plan``).  The global batch has ``batch`` rows per
dp rank; each dp rank steps its slice (every tp rank of one dp group the same slice), so
gradients are the mean over dp on both sides (FSDP2's reduce-scatter averages, as ``hpf.fsdp``'s).

Variants, each from the same weights (the seeded model of ``bench_models``) with its own
optimizer state, taking turns within every step (``bench_measure.time_interleaved``):

(a ) ``hpf.fsdp(apply_fn, ..., reshard_after_forward=True)``: ``.backward()``,
     ``hpf.clip_grad_norm`` (one all-reduce), the optimizer (``hpf_optimizer``: the swap point);
(a') the same with ``reshard_after_forward=False`` (no re-gather in the backward);
(b ) ``parallelize_module(copy, mesh["tp"], HF's plan)`` then ``fully_shard`` on ``mesh["dp"]`` of
     every decoder layer and of the root (FSDP2's defaults: layers reshard after forward, the root
     does not), ``torch.nn.utils.clip_grad_norm_``, ``torch.optim.AdamW(foreach=True)``.  Over TP,
     ``clip_grad_norm_`` raises in torch 2.13 (HF's plan leaves the norms' weights TP-replicated, so
     FSDP2 puts them on the 1-D dp mesh and the rest on dp x tp, and DTensor refuses to stack norms
     across meshes): there the same algorithm runs per mesh (``dtensor_clip``) and the row's note
     prints torch's error.

The table gives the median step time (slowest rank per step), the ratio to (a) (median of
per-step ratios), the largest |loss - unsharded| over every step taken (the dp-mean loss against
one unsharded model trained on the global batch by the same recipe, on rank 0 after the timing),
from profiled steps the host time and the process-group backend's collectives and bytes
(``bench_measure.profile_step``; peak MiB: the largest over the ranks of the memory added during
the step), and from one more step the collectives by kind and mesh axis as issued
(``CountCollectives``: gloo runs a reduce-scatter as an all-reduce, so the backend's own events
cannot tell them apart).  Under the table: hpf / FSDP2, and ``apply_fn.fsdp.collectives_per_step()``
(the closed form on the dp axis) next to what was counted on it.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
from collections import Counter
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from bench_measure import (
    StepProfile,
    median_ms,
    profile_step,
    ratio,
    ratio_value,
    run_and_report,
    slowest_rank,
    time_interleaved,
)
from bench_models import SIZES, Size, Variant, build_llama, dtensor_plan
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

import hp_functional as hpf
from hp_functional.cli.launch import under_torchrun

ORDER = ("a", "a'", "b")


# ---------------------------------------------------------------- the optimizer (the swap point)
# ``make(params) -> update``; ``update(params, grads) -> params`` (the same dict, stepped in place, or
# new leaves: the step rebinds whatever it returns, so a functional optimizer drops in here).
Update = Callable[[Mapping[str, Tensor], Mapping[str, Tensor]], Mapping[str, Tensor]]


def hpf_optimizer(params: Mapping[str, Tensor], opts: argparse.Namespace) -> Update:
    """AdamW over the hpf params pytree.  For now ``torch.optim.AdamW(foreach=True)`` with the
    clipped gradients set on ``.grad``; swap in ``hpf.optim.adamw`` here."""
    opt = torch.optim.AdamW(params.values(), lr=opts.lr, weight_decay=opts.weight_decay, foreach=True)

    def update(params: Mapping[str, Tensor], grads: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        for k, p in params.items():
            p.grad = grads[k]
        opt.step()
        return params

    return update


def hpf_functional_adamw(params: Mapping[str, Tensor], opts: argparse.Namespace) -> Update:
    """``--hpf-optim functional``: ``hpf.optim.adamw`` (pure: new params and state per update; run
    under ``no_grad`` and the new params made leaves again, since the step uses ``.backward()``)."""
    opt = hpf.optim.adamw(opts.lr, weight_decay=opts.weight_decay)
    box = {"state": opt.init({k: p.detach() for k, p in params.items()})}

    def update(params: Mapping[str, Tensor], grads: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        with torch.no_grad():
            new, box["state"] = opt.update(grads, box["state"], params)
        return {k: v.detach().requires_grad_(True) for k, v in new.items()}

    return update


HPF_OPTIMIZERS = {"torch": hpf_optimizer, "functional": hpf_functional_adamw}


def torch_adamw(parameters, opts: argparse.Namespace) -> torch.optim.Optimizer:
    """The torch side's (and the unsharded reference's) optimizer: the same hyperparameters."""
    return torch.optim.AdamW(parameters, lr=opts.lr, weight_decay=opts.weight_decay, foreach=True)


# ---------------------------------------------------------------- the variants
def _recording(step: Callable[[], Tensor], losses: list[float]) -> Callable[[], Tensor]:
    """``step`` that also keeps every loss it returns (the |Δloss| columns compare them per step)."""

    def run() -> Tensor:
        loss = step()
        losses.append(loss.item())
        return loss

    return run


def hpf_variant(key: str, label: str, model, mesh: DeviceMesh, ids: Tensor, opts: argparse.Namespace,
                reshard: bool) -> tuple[Variant, list[float], Callable]:
    """(a)/(a'): ``hpf.shard`` (HF's plan over tp, none on a dp-only mesh), ``hpf.fsdp`` on dp; a
    step is zero grads, forward + ``.backward()``, ``hpf.clip_grad_norm``, the optimizer."""
    plan = hpf.ShardingPlan.from_hf(model) if "tp" in mesh.mesh_dim_names else hpf.ShardingPlan({})
    apply_fn, params, info = hpf.shard(model, plan, mesh)
    f_apply, f_params, f_info = hpf.fsdp(apply_fn, params, info, mesh, dp_axis="dp", reshard_after_forward=reshard)
    update = HPF_OPTIMIZERS[opts.hpf_optim](f_params, opts)
    state = {"params": f_params}

    def step() -> Tensor:
        params = state["params"]
        for p in params.values():
            p.grad = None
        loss = f_apply(params, input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        grads, _ = hpf.clip_grad_norm({k: p.grad for k, p in params.items()}, f_info, opts.max_norm)
        state["params"] = update(params, grads)
        return loss.detach()

    losses: list[float] = []
    return Variant(key, label, _recording(step, losses)), losses, f_apply


def _mesh_of(t: Tensor):
    return getattr(t, "device_mesh", None)


def dtensor_clip(parameters: list[Tensor], max_norm: float) -> tuple[Callable[[], None], str]:
    """``torch.nn.utils.clip_grad_norm_`` where torch can run it on these parameters; where it
    cannot, the same algorithm per device mesh, and the note says why (FSDP2 over TP puts the
    parameters TP leaves replicated — the norms — on the 1-D dp mesh, the rest on dp x tp, and
    DTensor refuses ops across meshes).  The check (a norm of the parameters themselves) fails
    before any collective, or succeeds without one."""
    try:
        torch.nn.utils.get_total_norm([p.detach() for p in parameters], 2.0, foreach=True)
    except Exception as exc:  # noqa: BLE001 - the reason is printed under the table
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
    else:
        return lambda: torch.nn.utils.clip_grad_norm_(parameters, max_norm, foreach=True), ""
    groups: dict[object, list[Tensor]] = {}
    for p in parameters:
        groups.setdefault(_mesh_of(p), []).append(p)

    def clip() -> None:
        norms = []
        for ps in groups.values():
            n = torch.nn.utils.get_total_norm([p.grad for p in ps if p.grad is not None], 2.0, foreach=True)
            norms.append(n.full_tensor() if hasattr(n, "full_tensor") else n)
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        for ps in groups.values():
            torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total, foreach=True)

    return clip, reason


def fsdp2_variant(model, mesh: DeviceMesh, ids: Tensor, opts: argparse.Namespace) -> tuple[Variant, list[float]]:
    """(b): a deep copy of ``model``, ``parallelize_module`` on tp (if the mesh has it), then
    ``fully_shard`` on dp of every decoder layer and of the root; a step is ``zero_grad``,
    forward + backward, clip, ``AdamW.step``.  A failure to build becomes ``error``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    tp = "tp" in mesh.mesh_dim_names
    label = "FSDP2 fully_shard + DTensor TP" if tp else "FSDP2 fully_shard"
    losses: list[float] = []
    try:
        m = copy.deepcopy(model)
        if tp:
            parallelize_module(m, mesh["tp"], dtensor_plan(model))
        for layer in m.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(m, mesh=mesh["dp"])
    except Exception as exc:  # noqa: BLE001 - reported in the table, verbatim
        return Variant("b", label, error=f"{type(exc).__name__}: {exc}".splitlines()[0]), losses
    parameters = list(m.parameters())
    opt = torch_adamw(parameters, opts)
    clip, reason = dtensor_clip(parameters, opts.max_norm)

    def step() -> Tensor:
        opt.zero_grad(set_to_none=True)
        loss = m(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        clip()
        opt.step()
        return loss.detach()

    note = f"clip per mesh: clip_grad_norm_ raises {reason}" if reason else ""
    return Variant("b", label, _recording(step, losses), note=note), losses


def reference_losses(model, ids: Tensor, opts: argparse.Namespace, steps: int) -> list[float]:
    """``steps`` losses of the unsharded model trained on the global batch by the same recipe."""
    ref = copy.deepcopy(model)
    opt = torch_adamw(ref.parameters(), opts)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = ref(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), opts.max_norm, foreach=True)
        opt.step()
        losses.append(loss.item())
    return losses


# ---------------------------------------------------------------- collectives by kind and axis
_KINDS = {
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce", "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce", "broadcast_": "broadcast", "broadcast": "broadcast",
    "all_to_all_single": "all_to_all", "alltoall_base_": "all_to_all",
}


class CountCollectives(TorchDispatchMode):
    """Collectives as issued, by kind and mesh axis: the functional ops (``_c10d_functional``,
    which name their group) and the ``c10d`` ops that ``torch.distributed`` calls dispatch to
    (which carry the ``ProcessGroup``), each counted once per call.  A dispatch mode does not see
    the ops run *inside* another op's dispatch — a DTensor's implicit redistributions during
    sharding propagation — so each group's sequence number (one per collective on it) is read
    too, and what it counted beyond the mode is ``hidden`` (by axis; its kind is not known)."""

    def __init__(self, axes: Mapping[str, str]):
        super().__init__()
        self.axes = axes  # process-group name -> mesh axis
        self.counts: Counter = Counter()
        self.hidden: Counter = Counter()
        self._groups = {}
        for name in axes:
            try:
                self._groups[name] = dist.distributed_c10d._resolve_process_group(name)
            except (RuntimeError, ValueError, KeyError):
                pass

    def _sequence(self) -> dict[str, int] | None:
        try:
            return {name: g._get_sequence_number_for_group() for name, g in self._groups.items()}
        except (RuntimeError, AttributeError):  # a backend without sequence numbers
            return None

    def __enter__(self):
        self._before = self._sequence()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        after = self._sequence()
        if self._before is not None and after is not None:
            for name, n in after.items():
                axis = self.axes[name]
                seen = sum(c for (_, a), c in self.counts.items() if a == axis)
                if n - self._before[name] > seen:
                    self.hidden[axis] = n - self._before[name] - seen
        return out

    def _axis(self, args) -> str:
        for a in args:
            if isinstance(a, torch.ScriptObject):  # a c10d op's ProcessGroup (or ReduceOp), boxed
                try:
                    a = dist.ProcessGroup.unbox(a)
                except (RuntimeError, TypeError):
                    continue
            name = a if isinstance(a, str) else getattr(a, "group_name", None)
            if isinstance(name, str) and name in self.axes:
                return self.axes[name]
        return "?"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns = func.namespace
        kind = _KINDS.get(func.overloadpacket.__name__) if ns in ("_c10d_functional", "c10d") else None
        if kind is not None:
            self.counts[(kind, self._axis(list(args) + list((kwargs or {}).values())))] += 1
        return func(*args, **(kwargs or {}))


def axis_names(mesh: DeviceMesh) -> dict[str, str]:
    """Process-group name -> the mesh axis it spans (``world`` for the default group unless an
    axis spans the world on that very group)."""
    names = {dist.group.WORLD.group_name: "world"}
    for i, axis in enumerate(mesh.mesh_dim_names):
        names[mesh.get_group(i).group_name] = axis
    return names


def count_collectives(variant: Variant, axes: Mapping[str, str]) -> tuple[Counter, Counter]:
    """One step under ``CountCollectives``: (kind, axis) -> count, and axis -> hidden count."""
    with CountCollectives(axes) as counted:
        variant.step()
    return counted.counts, counted.hidden


def describe(counts: Mapping[tuple[str, str], int], hidden: Mapping[str, int]) -> str:
    text = " ".join(f"{kind}@{axis}x{n}" for (kind, axis), n in sorted(counts.items())) or "none"
    if hidden:
        text += " + inside DTensor ops: " + " ".join(f"?@{axis}x{n}" for axis, n in sorted(hidden.items()))
    return text


# ---------------------------------------------------------------- one launch
def global_batch(size: Size, dp: int, device: str) -> Tensor:
    """``size.batch`` rows per dp rank (the same per-rank work as ``tp_step``'s batch)."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, size.vocab, (size.batch * dp, size.seq), generator=g).to(device)


def make_mesh(device: str, world: int, tp: int) -> DeviceMesh:
    if tp == 1:
        return init_device_mesh(device, (world,), mesh_dim_names=("dp",))
    if world % tp:
        raise SystemExit(f"world size {world} is not a multiple of --tp {tp}")
    return init_device_mesh(device, (world // tp, tp), mesh_dim_names=("dp", "tp"))


def measure_size(size: Size, mesh: DeviceMesh, opts: argparse.Namespace) -> dict | None:
    """Every variant of one size on this launch's ranks; rank 0's view of the results."""
    device, world = opts.device, dist.get_world_size()
    dp_mesh = mesh["dp"]
    dp = dp_mesh.size()
    model = build_llama(size, device)
    ids = global_batch(size, dp, device)
    local = ids.chunk(dp)[dp_mesh.get_local_rank()]
    a, a_losses, a_apply = hpf_variant("a", "hpf.fsdp (reshard after forward)", model, mesh, local, opts, True)
    a2, a2_losses, a2_apply = hpf_variant("a'", "hpf.fsdp, reshard_after_forward=False", model, mesh, local, opts, False)
    b, b_losses = fsdp2_variant(model, mesh, local, opts)
    variants = [a, a2, b]
    losses = {"a": a_losses, "a'": a2_losses, "b": b_losses}
    closed = {"a": a_apply.fsdp.collectives_per_step(), "a'": a2_apply.fsdp.collectives_per_step()}
    runnable = [v for v in variants if v.step is not None]
    warmup, steps = opts.warmup or (2 if size.name == "large" else 5), opts.steps or (12 if size.name == "large" else 30)
    if opts.quick:
        warmup, steps = 1, max(3, steps // 4)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, time_interleaved(runnable, warmup, steps, device))
    times = slowest_rank(per_rank)
    profiles = {v.key: profile_step(v, device, dist.get_backend()) for v in runnable}
    axes = axis_names(mesh)
    counts = {v.key: count_collectives(v, axes) for v in runnable}
    gathered = [None] * world
    dist.all_gather_object(gathered, {"profiles": profiles, "losses": {k: losses[k] for k in losses}})
    if dist.get_rank() != 0:
        dist.barrier()
        return None
    taken = len(a_losses)
    reference = reference_losses(model, ids, opts, taken)
    dist.barrier()  # the other ranks wait here while rank 0 trains the reference
    mean_losses = {k: [statistics.fmean(g["losses"][k][i] for g in gathered) for i in range(len(losses[k]))]
                   for k in losses if losses[k]}
    rows = {}
    for v in variants:
        row = {"label": v.label, "error": v.error, "note": v.note}
        if v.step is not None:
            p: StepProfile = profiles[v.key]
            p.peak_mib = max(g["profiles"][v.key].peak_mib for g in gathered)
            row.update(ms=median_ms(times[v.key]), times=times[v.key], profile=p, counts=counts[v.key][0],
                       hidden=counts[v.key][1],
                       loss_delta=max(abs(x - r) for x, r in zip(mean_losses[v.key], reference, strict=True)))
        rows[v.key] = row
    pair = None
    if "a" in mean_losses and "b" in mean_losses:
        d = [abs(x - y) for x, y in zip(mean_losses["a"], mean_losses["b"], strict=True)]
        pair = {"max": max(d), "first": d[0], "last": d[-1]}
    return {"rows": rows, "steps": steps, "taken": taken, "closed": closed, "pair": pair, "mesh": dict(
        zip(mesh.mesh_dim_names, mesh.shape, strict=True)), "loss": (reference[0], reference[-1])}


def rank_main(opts: argparse.Namespace) -> dict | None:
    world = dist.get_world_size()
    mesh = make_mesh(opts.device, world, 1 if world <= 2 else opts.tp)
    results = {name: measure_size(SIZES[name], mesh, opts) for name in opts.sizes}
    return results if dist.get_rank() == 0 else None


# ---------------------------------------------------------------- the report
# (_ratio_value, _ratio and _machine as in tp_step.py, kept here so that file can change freely)
def _fmt_row(key: str, rows: dict) -> str:
    row = rows[key]
    head = f"({key:<2}) {row['label']:<37}"
    if row["error"]:
        return f"{head} not run: {row['error']}"
    p: StepProfile = row["profile"]
    r = ratio_value(rows, key, "a")
    ratio = f"{r:6.2f}x" if r is not None else "      -"
    return (f"{head} {row['ms']:9.2f} {ratio} {row['loss_delta']:9.1e} {p.host_ms:8.2f} {p.peak_mib:8.1f} "
            f"{sum(p.collectives.values()):5d} {p.bytes / 2**10:9.1f}  {describe(row['counts'], row['hidden'])}")


def _dp_counts(counts: Mapping[tuple[str, str], int]) -> dict[str, int]:
    return {kind: counts.get((kind, "dp"), 0) for kind in ("all_gather", "reduce_scatter")}


def report(results: dict[int, dict], opts: argparse.Namespace) -> None:
    columns = (f"{'variant':<42} {'median ms':>9} {'vs (a)':>7} {'|dloss|':>9} {'host ms':>8} {'peak MiB':>8} "
               f"{'colls':>5} {'KiB/step':>9}  collectives per step (kind@axis, as issued)")
    for name in opts.sizes:
        for world in sorted(results, reverse=True):
            res = results[world][name]
            rows = res["rows"]
            layout = " x ".join(f"{axis} {n}" for axis, n in res["mesh"].items())
            print(f"\n== {name}: {SIZES[name].describe()} per dp rank | world size {world} ({layout}) | {opts.device} | "
                  f"median of {res['steps']} steps ==")
            print(columns)
            for key in ORDER:
                if key in rows:
                    print(_fmt_row(key, rows))
            for key in ORDER:
                if rows.get(key, {}).get("note"):
                    print(f"({key}) {rows[key]['note']}")
            peer = "FSDP2 + DTensor TP" if "tp" in res["mesh"] else "FSDP2"
            goal = " (goal <= 0.6)" if name == "tiny" and "tp" in res["mesh"] else ""  # the goal is against DTensor TP
            print(f"hpf.fsdp / {peer} = {ratio(rows, 'a', 'b')}{goal}")
            keep = ratio(rows, "a'", "b")
            print(f"hpf.fsdp reshard_after_forward=False / {peer} = {keep}")
            for key in ORDER:
                row = rows.get(key, {})
                if "counts" not in row:
                    continue
                got = _dp_counts(row["counts"])
                line = f"({key:<2}) collectives on dp counted {got}"
                if row["hidden"].get("dp"):
                    line += f" + {row['hidden']['dp']} inside DTensor ops"
                if key in res["closed"]:
                    want = res["closed"][key]
                    verdict = "equal" if got == want else "DIFFER"
                    line += f"; closed form apply_fn.fsdp.collectives_per_step() {want}: {verdict}"
                print(line)
            pair = res["pair"]
            if pair:
                print(f"|loss (a) - loss (b)| over {res['taken']} steps: max {pair['max']:.1e} (first step {pair['first']:.1e}, "
                      f"last {pair['last']:.1e}); unsharded loss {res['loss'][0]:.4f} -> {res['loss'][1]:.4f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="mesh device type: cpu (gloo), cuda (nccl), ...")
    parser.add_argument("--sizes", default="tiny", help=f"comma-separated, of {sorted(SIZES)}")
    parser.add_argument("--worlds", default="4,2", help="world sizes to launch: 2 = dp 2 alone, larger = dp x tp")
    parser.add_argument("--tp", type=int, default=2, help="tp size at world sizes above 2")
    parser.add_argument("--steps", type=int, default=0, help="timed steps (default: 30 tiny, 12 large)")
    parser.add_argument("--warmup", type=int, default=0, help="untimed steps first (default: 5 tiny, 2 large)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping norm")
    parser.add_argument("--hpf-optim", default="torch", choices=sorted(HPF_OPTIMIZERS),
                        help="hpf side's AdamW: torch.optim.AdamW(foreach=True) over the leaves, or hpf.optim.adamw")
    parser.add_argument("--quick", action="store_true", help="1 warm-up and a quarter of the steps")
    opts = parser.parse_args(argv)
    opts.sizes = opts.sizes.split(",")
    worlds = [int(os.environ["WORLD_SIZE"])] if under_torchrun() else [int(w) for w in opts.worlds.split(",")]
    return run_and_report(rank_main, report, opts, worlds)


if __name__ == "__main__":
    sys.exit(main())
