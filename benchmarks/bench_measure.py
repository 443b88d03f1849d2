"""Measuring steps: interleaved wall-clock timing, and a few profiled steps per variant.

The profiled steps give, the same way for every variant (so the numbers compare):

* collectives: the process-group backend's own events (``gloo:all_reduce``, ``nccl:all_gather``…),
  which every API ends in — our ``_c10d_functional`` calls, DTensor's redistributions and
  ``torch.distributed`` calls alike — with the bytes of each one's input (per rank);
* host overhead: the step's wall time minus the time inside aten ops and collective calls —
  Python, module calls, hooks, DTensor's sharding propagation (an aten op dispatched to a tensor
  subclass counts only through the plain aten ops inside it), autograd bookkeeping; it includes
  the profiler's own cost per op, so compare it between variants rather than with the medians
  (and Inductor's fused kernels are not aten ops: there it counts kernels too);
* peak memory: the highest total of the allocator's alloc/free events on the mesh's device
  during the step, above what was allocated when it began (activations, gradients, temporaries).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from bench_models import Variant
from torch.profiler import ProfilerActivity, profile, record_function

STEP = "tp_step::step"
_COLLECTIVE_CALLS = ("_c10d_functional::", "c10d::")
_DTYPE_BYTES = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4, "bool": 1}


def sync(device: str) -> None:
    """Wait for the device's queued work (nothing to wait for on CPU)."""
    if device != "cpu":
        torch.accelerator.synchronize()


def reset(variant: Variant) -> None:
    """Drop the gradients of the previous step (outside the timed region)."""
    for t in variant.leaves:
        t.grad = None


def time_interleaved(variants: Sequence[Variant], warmup: int, steps: int, device: str) -> dict[str, list[float]]:
    """Seconds per step per variant on this rank.  The variants take turns within every step
    (after a barrier each), so a change in machine load hits all of them alike."""
    times: dict[str, list[float]] = {v.key: [] for v in variants}
    for i in range(warmup + steps):
        for v in variants:
            reset(v)
            dist.barrier()
            start = time.perf_counter()
            v.step()
            sync(device)
            if i >= warmup:
                times[v.key].append(time.perf_counter() - start)
    return times


def slowest_rank(per_rank: Sequence[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Per step, the slowest rank's time (a step ends when its last rank does)."""
    return {k: [max(r[k][i] for r in per_rank) for i in range(len(per_rank[0][k]))] for k in per_rank[0]}


def median_ms(times: list[float]) -> float:
    return 1e3 * statistics.median(times)


@dataclass
class StepProfile:
    """What one profiled step did (see the module docstring)."""

    wall_ms: float
    host_ms: float
    peak_mib: float
    collectives: Counter = field(default_factory=Counter)  # backend op name → count
    bytes: int = 0

    def describe_collectives(self) -> str:
        return " ".join(f"{op}x{n}" for op, n in sorted(self.collectives.items())) or "none"


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    """Total length (us in, ms out) covered by possibly overlapping intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e3


def _peak_mib(prof, device: str) -> float:
    """Highest running total of the allocator's events on ``device`` during the profile."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    kind = "privateuse1" if device == torch._C._get_privateuse1_backend_name() else device
    running = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        if e.device_type().name.lower() == kind:
            running += e.nbytes()
            peak = max(peak, running)
    return peak / 2**20


def _has_subclass_dispatch(e) -> bool:
    return any(c.name == "PythonSubclass" or _has_subclass_dispatch(c) for c in e.cpu_children)


def _kernel_intervals(e, out: list[tuple[float, float]]) -> None:
    """The time ranges under ``e`` spent in aten ops and collective calls.  An aten op that
    dispatches to a tensor subclass (DTensor) is not a kernel: its own time is the subclass's
    Python, so only the plain aten ops inside it count."""
    if e.name.startswith(_COLLECTIVE_CALLS) or (e.name.startswith("aten::") and not _has_subclass_dispatch(e)):
        out.append((e.time_range.start, e.time_range.end))
    else:
        for c in e.cpu_children:
            _kernel_intervals(c, out)


def profile_step(variant: Variant, device: str, backend: str, repeat: int = 3) -> StepProfile:
    """Profile ``repeat`` steps; collectives and memory from the last, host overhead the least
    of them (preemption by other processes only ever adds to it)."""
    profiles = [_profile_once(variant, device, backend) for _ in range(repeat)]
    return replace(profiles[-1], host_ms=min(p.host_ms for p in profiles))


def profile_interleaved(variants: Sequence[Variant], device: str, backend: str, repeat: int = 5) -> dict[str, StepProfile]:
    """``profile_step`` of every variant (call it on every rank), the variants taking turns in
    each of ``repeat`` rounds after a barrier each, as in ``time_interleaved``: a busy spell of
    the machine then hits every variant's profiled steps alike, not all of one variant's."""
    profiles: dict[str, list[StepProfile]] = {v.key: [] for v in variants}
    for _ in range(repeat):
        for v in variants:
            dist.barrier()
            profiles[v.key].append(_profile_once(v, device, backend))
    return {k: replace(p[-1], host_ms=min(q.host_ms for q in p)) for k, p in profiles.items()}


def _profile_once(variant: Variant, device: str, backend: str) -> StepProfile:
    reset(variant)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True) as prof:
        with record_function(STEP):
            variant.step()
            sync(device)
    events = prof.events()
    step = next(e for e in events if e.name == STEP)
    lo, hi = step.time_range.start, step.time_range.end
    result = StepProfile(wall_ms=(hi - lo) / 1e3, host_ms=0.0, peak_mib=_peak_mib(prof, device))
    busy: list[tuple[float, float]] = []
    for e in events:
        if e.name.startswith(f"{backend}:"):
            result.collectives[e.name.split(":", 1)[1]] += 1
            if e.input_shapes and e.input_shapes[0]:
                result.bytes += _DTYPE_BYTES[e.input_dtypes[0]] * int(torch.Size(e.input_shapes[0]).numel())
        elif e.cpu_parent is None and lo <= e.time_range.start and e.time_range.end <= hi:  # roots on every thread
            _kernel_intervals(e, busy)
    result.host_ms = result.wall_ms - _union_ms(busy)
    return result


def count_calls(variant: Variant) -> tuple[int, int]:
    """(Python function calls, aten ops) of one step of ``variant``: counts, not times, so they
    are the same on a busy machine and a quiet one, and growth of the per-call path shows in them
    before it shows in the medians.  The Python calls are every ``call`` and ``c_call`` event of
    ``sys.setprofile`` (the variant's own code, the modelling code, torch's Python wrappers); the
    aten ops every op the dispatcher reaches below autograd (forward and backward)."""
    import sys

    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Ops.count += 1
            return func(*args, **(kwargs or {}))

    calls = [0]

    def tally(frame, event, arg):
        if event in ("call", "c_call"):
            calls[0] += 1
    reset(variant)
    sys.setprofile(tally)
    try:
        variant.step()
    finally:
        sys.setprofile(None)
    reset(variant)
    with Ops():
        variant.step()
    return calls[0], Ops.count


# ---------------------------------------------------------------- the reports
def ratio_value(rows: dict, num: str, den: str) -> float | None:
    """``num``'s time over ``den``'s: the median of per-step ratios when both ran in the same
    rounds (paired, so load that changes during the run cancels), else the ratio of medians."""
    if "ms" not in rows.get(num, {}) or "ms" not in rows.get(den, {}):
        return None
    a, b = rows[num]["times"], rows[den]["times"]
    if a is not None and b is not None:
        return statistics.median(x / y for x, y in zip(a, b, strict=True))
    return rows[num]["ms"] / rows[den]["ms"]


def ratio(rows: dict, num: str, den: str) -> str:
    """``ratio_value`` as the tables print it (or why there is none)."""
    r = ratio_value(rows, num, den)
    if r is None:
        return "n/a (" + (rows.get(den, {}).get("error") or rows.get(num, {}).get("error") or "not measured") + ")"
    return f"{r:.2f}" + (f" ({1 / r:.2f}x faster)" if r < 1 else "")


def machine() -> str:
    """The host, its CPU, cores and load, and the torch version: the line above every table."""
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    load = "load avg " + " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else ""
    return f"{platform.node()}: {cpu}, {os.cpu_count()} cores, {load}; torch {torch.__version__}"


def run_and_report(rank_main, report, opts, worlds: Sequence[int]) -> int:
    """Launch ``rank_main(opts)`` on each world size in turn (torch's elastic launcher, or the
    ranks of an outer torchrun), then ``report`` rank 0's results with the machine before and after."""
    from hp_functional.cli.launch import run_ranks

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's start/stop lines
    os.environ.setdefault("HPF_BACKEND", dist.Backend.default_device_backend_map.get(opts.device, "gloo"))
    if os.environ.get("RANK", "0") == "0":
        print(f"machine {machine()}; one thread per rank (HPF_THREADS)", flush=True)
    start = time.time()
    results = {world: run_ranks(rank_main, world, opts).get(0) for world in worlds}  # None on other ranks under torchrun
    if results and all(r is not None for r in results.values()):
        report(results, opts)
        print(f"\ntotal {time.time() - start:.0f} s; machine after: {machine()}")
    return 0
