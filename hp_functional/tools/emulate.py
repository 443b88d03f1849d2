"""``emulate``: every rank of a mesh in this process, with real numbers.

``emulate(fn, (2, 2), ("dp", "tp"))`` starts one thread per rank on torch's threaded process group
(``torch.testing._internal.distributed.multi_threaded_pg``, the one torch's own DTensor tests run
on): each thread initialises its rank, builds the mesh and calls ``fn(mesh)``, so ``shard()``,
``apply_fn``, ``torch.func.grad``, ``hpf.fsdp`` and the agreements run per rank exactly as on
spawned processes, and the results come back in rank order.  See docs/tools.md#emulate.
"""

from __future__ import annotations

__all__ = ["emulate"]

import math
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.autograd.forward_ad as forward_ad
import torch.distributed as dist
from torch._C._functorch import TransformType
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.overrides import TorchFunctionMode

from ..core.errors import PlanError

T = TypeVar("T")

_DEFAULT_NAMES = {1: ("tp",), 2: ("dp", "tp"), 3: ("dp", "cp", "tp")}
#: only one emulation at a time: the threaded group replaces torch.distributed's world for the process.
_ONE_AT_A_TIME = threading.Lock()


#: what torch raises when a c10d op the threaded group does not implement is dispatched to it (send, recv).
_NO_BACKEND = "No backend type associated with device type"


def _lacks_point_to_point(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what it was raised from) is the threaded group refusing send/recv."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if _NO_BACKEND in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _names(shape: tuple[int, ...], names: Sequence[str] | None) -> tuple[str, ...]:
    if names is None:
        if len(shape) not in _DEFAULT_NAMES:
            raise PlanError(f"emulate: mesh_dim_names is required for a {len(shape)}-dim mesh_shape {shape}")
        return _DEFAULT_NAMES[len(shape)]
    names = tuple(names)
    if len(names) != len(shape) or len(set(names)) != len(names):
        raise PlanError(f"emulate: mesh_dim_names {names} must name every dim of mesh_shape {shape} once")
    return names


def emulate(
    fn: Callable[[DeviceMesh], T],
    mesh_shape: Sequence[int],
    mesh_dim_names: Sequence[str] | None = None,
    device: str = "cpu",
    *,
    timeout: float = 300.0,
) -> list[T]:
    """Run ``fn(mesh)`` once per rank of a ``mesh_shape`` mesh, all in this process, with real
    numbers, and return the results in rank order.

    Each rank is a thread of torch's threaded process group: it calls ``init_process_group``,
    ``init_device_mesh`` and ``fn`` on its own, so everything ``fn`` does (``shard()`` and its
    agreement, ``apply_fn``, reverse-mode ``torch.func`` transforms (forward mode is refused:
    ``_NoForwardMode``), ``hpf.fsdp``, ``hpf.save``) runs per rank as
    on spawned processes; a collective waits for its peers' threads.  An exception on any rank
    stops the others' collectives and is re-raised here (the lowest failing rank's).  ``fn`` must
    take what it needs from its arguments, not from the global random generator (the ranks run at
    once).  Refuses to start while a process group is initialised.

    Args:
        fn: called once per rank with that rank's mesh.
        mesh_shape: the mesh's shape; its product is the number of ranks.
        mesh_dim_names: its dim names; None: ``("tp",)``, ``("dp", "tp")`` or ``("dp", "cp", "tp")``
            by its rank (required for 4 or more dims).
        device: the mesh's device type (every rank computes on the same device).
        timeout: seconds to wait for every rank to finish before raising ``TimeoutError``.
    Returns:
        the list of what ``fn`` returned on each rank, in rank order."""
    shape = tuple(int(s) for s in mesh_shape)
    if not shape or any(s < 1 for s in shape):
        raise PlanError(f"emulate: mesh_shape {shape} must be one or more positive sizes")
    names = _names(shape, mesh_dim_names)
    world = math.prod(shape)
    if dist.is_initialized():
        raise RuntimeError("emulate() needs no process group initialised: it starts one thread per rank on a "
                           "threaded process group of its own; call it outside torchrun/spawned ranks")
    if not _ONE_AT_A_TIME.acquire(blocking=False):
        raise RuntimeError("emulate() is already running in this process (one emulation at a time)")
    try:
        return _run(fn, shape, names, world, device, timeout)
    finally:
        _ONE_AT_A_TIME.release()


class _NoForwardMode(TorchFunctionMode):
    """Refuses forward-mode differentiation in a rank's thread: torch keeps its forward-AD state
    (the dual level, functorch's jvp nesting) per process, not per thread, so ranks running
    ``jvp``/``jacfwd``/``hessian`` at once corrupt each other — errors, or a wrong number."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if forward_ad._current_level >= 0 or any(
                i.key() == TransformType.Jvp for i in retrieve_all_functorch_interpreters()):
            raise _forward_mode_refused()
        return func(*args, **(kwargs or {}))


def _forward_mode_refused() -> PlanError:
    return PlanError("emulate: forward-mode differentiation (torch.func.jvp, jacfwd, hessian, "
                     "torch.autograd.forward_ad) cannot run on emulate's threads: torch keeps its state per "
                     "process, so the ranks would corrupt each other's; run it on real ranks (torchrun, gloo)")


def _is_forward_mode(exc: BaseException) -> bool:
    """The refusal, or torch's own forward-AD error when another rank's thread moved the shared dual
    level first (a rank can fail that way before any of its ops reaches the refusing mode)."""
    if isinstance(exc, PlanError):
        return str(exc).startswith("emulate: forward-mode differentiation")
    return isinstance(exc, RuntimeError) and "forward AD" in str(exc)


def _run(fn, shape, names, world: int, device: str, timeout: float) -> list:
    from torch.testing._internal.distributed import multi_threaded_pg as threaded  # registers "threaded"

    results: list = [None] * world
    errors: dict[int, BaseException] = {}
    store = dist.HashStore()
    hook = sys.excepthook  # init_process_group prefixes tracebacks with "[rank0]:" and never undoes it

    def rank_main(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
        try:
            with _NoForwardMode():
                results[rank] = fn(init_device_mesh(device, shape, mesh_dim_names=names))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors[rank] = exc
            threaded.ProcessLocalGroup.exception_handle(exc)  # wakes the peers waiting in a collective
        finally:
            dist.destroy_process_group()

    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # group names resolve per thread
    threaded._install_threaded_pg()
    try:
        threads = [threading.Thread(target=rank_main, args=(r,), name=f"emulate-rank{r}", daemon=True)
                   for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        hung = [r for r, t in enumerate(threads) if t.is_alive()]
        if hung:
            threaded.ProcessLocalGroup.exception_handle(TimeoutError())
            for t in threads:
                t.join(5)
    finally:
        threaded.ProcessLocalGroup.reset()
        threaded._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        sys.excepthook = hook
    real = {r: e for r, e in errors.items() if not isinstance(e, SystemExit)}  # peers stopped by the failure
    if real:
        rank = min(real)
        if any(_is_forward_mode(e) for e in real.values()):
            raise _forward_mode_refused() from real[rank]
        if _lacks_point_to_point(real[rank]):
            raise PlanError(
                "emulate: the pipeline (hpf.gpipe, and stage_module under torch's schedules) cannot run here: it "
                "sends activations point to point (send/recv), which torch's threaded process group does not "
                "implement; run pipelines on real ranks (torchrun, hp-functional's launcher)") from real[rank]
        raise real[rank]
    if hung:
        raise TimeoutError(f"emulate: ranks {hung} did not finish in {timeout}s (a collective some rank never "
                           "issued?); the others finished or were stopped")
    if errors:
        raise RuntimeError(f"emulate: ranks {sorted(errors)} stopped without an error of their own")
    return results
