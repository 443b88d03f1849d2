"""The raw (non-differentiable) communication under ``core.collectives``: one function per
collective over one mesh axis, on ``torch.ops._c10d_functional`` (traceable by ``torch.compile``,
any backend: gloo, nccl, hccl).  ``core.collectives`` pairs each with its transpose as an
``autograd.Function``; code that needs no gradient (checks, split sizes, checksums) calls these.
"""

from __future__ import annotations

__all__ = [
    "Gate", "Replicas", "all_gather_rows", "check_perm", "get_timeout", "mesh_device", "raw_all_gather",
    "raw_all_reduce", "raw_all_to_all", "raw_all_to_all_v", "raw_exchange", "raw_ppermute", "raw_recv",
    "raw_reduce_scatter", "raw_replica_sum", "raw_send", "raw_split", "ring", "set_timeout", "start_all_reduce",
    "start_ppermute", "wait"
]

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from .errors import CollectiveError

_funcol = torch.ops._c10d_functional


class Group(Protocol):
    """What a raw op needs of its mesh axis (``collectives.AxisGroup`` is one); ``gate``: the
    ``Gate`` of the program whose axis it is, passed in when the group was made (None: no check
    waits on it)."""

    axis: str
    group_name: str
    size: int
    rank: int
    gate: Gate | None


def mesh_device(mesh) -> torch.device:
    """The device this rank computes on for ``mesh``: its device type, the current accelerator index."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.accelerator.current_device_index())


def set_timeout(seconds: float, mesh=None) -> None:
    """Every collective issued from now on over this rank's process groups fails after ``seconds``
    instead of the group's timeout (torch's default: 30 min for gloo, 10 min for NCCL), as does
    ``apply_fn``'s input agreement.  Call on every rank after building the meshes (groups created
    later keep the timeout they were created with).  A failure raises ``CollectiveError`` naming
    the collective, the mesh axis and the module; on NCCL the watchdog may abort the process
    instead, as torch documents for its timeout.

    Args:
        seconds: the new timeout, a positive number (else ``ValueError``).
        mesh: only that ``DeviceMesh``'s axes; None: every group this rank is in (the default
            group, every mesh axis, DCP's).
    """
    if isinstance(seconds, bool) or not (isinstance(seconds, (int, float)) and seconds > 0):
        raise ValueError(f"set_timeout: seconds must be a positive number, got {seconds!r}")
    timeout = timedelta(seconds=float(seconds))
    if not dist.is_initialized():
        raise RuntimeError("set_timeout: torch.distributed is not initialised (call init_process_group first)")
    groups = list(dist.distributed_c10d._world.pg_map) if mesh is None else [mesh.get_group(d) for d in range(mesh.ndim)]
    for group in groups:
        if dist.get_backend(group) != "fake":
            dist.distributed_c10d._set_pg_timeout(timeout, group)


def get_timeout(group_name: str | None = None) -> timedelta:
    """The timeout of the process group named ``group_name`` (None: the default group), as
    ``set_timeout`` or ``init_process_group`` set it; torch's default where it cannot be read."""
    from torch.distributed.constants import default_pg_timeout

    group = dist.distributed_c10d._resolve_process_group(group_name) if group_name else dist.group.WORLD
    for device in group._device_types:
        try:
            return group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return default_pg_timeout


class Gate:
    """Where a check waits for the next collective over the axes that share this gate: one
    ``Gate`` per program (``shard()``'s axis groups are made with it, ``hpf.fsdp``'s too), owned by
    the program and passed to its groups when they are made.  ``apply_fn`` hands it its input
    agreement for a new signature (``hold``): the first collective over any of those axes runs it
    (``open``), so every local check of the call before it has run first; the call takes it back
    when it ends (``release``).  Empty between calls: it carries no value from one call to the next."""

    __slots__ = ("_check",)

    def __init__(self):
        self._check: Callable[[], None] | None = None

    def hold(self, check: Callable[[], None]) -> None:
        """Make ``check`` what the next collective over this gate's axes runs first."""
        self._check = check

    def open(self) -> None:
        """Run the held check, if any, and let it go (the first collective of the call does)."""
        check, self._check = self._check, None
        if check is not None:
            check()

    def release(self, check: Callable[[], None]) -> None:
        """Drop ``check`` if this gate still holds it (no collective ran it: the call ended or raised)."""
        if self._check is check:
            self._check = None


def _issue(g: Group) -> None:
    """Before a collective over ``g``: the check its gate holds, if any (not under ``torch.compile``)."""
    if not torch.compiler.is_compiling():
        gate = getattr(g, "gate", None)
        if gate is not None and gate._check is not None:  # a held check: the call's first collective (once a call)
            gate.open()


def wait(x: Tensor, op: str, g: Group, where: str = "") -> Tensor:
    """``wait_tensor(x)``; a failure (a timeout, a peer gone) is a ``CollectiveError`` naming ``op``,
    the axis and ``where``.  Under ``torch.compile`` the plain wait (traced into the graph)."""
    if torch.compiler.is_compiling():
        return _funcol.wait_tensor(x)
    try:
        return _funcol.wait_tensor(x)
    except RuntimeError as exc:
        raise collective_error(exc, op, g, where) from exc


def collective_error(exc: BaseException, op: str, g: Group, where: str = "") -> CollectiveError:
    """The ``CollectiveError`` for ``exc`` raised by ``op`` over ``g``'s mesh axis."""
    axis, size = g.axis, g.size
    timeout = get_timeout(g.group_name).total_seconds()
    at = f" in {where}" if where else ""
    return CollectiveError(
        f"{op} over mesh axis {axis!r} ({size} ranks){at} failed: {exc}. Another rank of the axis did not take part "
        f"within the timeout ({timeout:g}s, hpf.set_timeout): it is stuck, has failed (see its error) or issued other "
        "collectives (ranks out of step); the process group may be unusable now")


def raw_all_reduce(x: Tensor, g: Group) -> Tensor:
    _issue(g)
    return wait(_funcol.all_reduce(x.contiguous(), "sum", g.group_name), "all_reduce", g)


def start_all_reduce(x: Tensor, g: Group) -> Tensor:
    """A sum over ``g`` issued without waiting: ``wait`` the result later, so that several
    buckets in flight can overlap (``reduce_gradients``)."""
    return _funcol.all_reduce(x.contiguous(), "sum", g.group_name)


def all_gather_rows(x: Tensor, g: Group, where: str = "") -> Tensor:
    """Every rank's 1-D ``x`` concatenated in rank order (checks that gather a few numbers)."""
    return wait(_funcol.all_gather_into_tensor(x.contiguous(), g.size, g.group_name), "all_gather", g, where)


def raw_all_gather(x: Tensor, dim: int, g: Group) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim``; contiguous, as a module's ``view`` of its input
    may need (HF ``Conv1D``)."""
    _issue(g)
    moved = x.movedim(dim, 0).contiguous()
    out = wait(_funcol.all_gather_into_tensor(moved, g.size, g.group_name), "all_gather", g)
    return out.movedim(0, dim).contiguous()


def _check_divisible(x: Tensor, dim: int, g: Group, op: str) -> None:
    """Raise (before communicating) rather than let the backend abort on an uneven split."""
    if x.shape[dim] % g.size:
        raise ValueError(f"{op} on mesh axis {g.axis!r}: dim {dim} of shape {tuple(x.shape)} is not divisible by {g.size}")


def raw_reduce_scatter(x: Tensor, dim: int, g: Group) -> Tensor:
    _check_divisible(x, dim, g, "reduce_scatter")
    _issue(g)
    moved = x.movedim(dim, 0).contiguous()
    out = wait(_funcol.reduce_scatter_tensor(moved, "sum", g.size, g.group_name), "reduce_scatter", g)
    return out.movedim(0, dim)


def raw_split(x: Tensor, dim: int, g: Group) -> Tensor:
    _check_divisible(x, dim, g, "split")
    return x.chunk(g.size, dim)[g.rank].clone()


def raw_all_to_all(x: Tensor, split_dim: int, concat_dim: int, g: Group) -> Tensor:
    """Chunk ``split_dim`` into ``size`` pieces, send piece k to rank k, concat received on ``concat_dim``."""
    _check_divisible(x, split_dim, g, "all_to_all")
    _issue(g)
    nd = x.dim()
    split_dim, concat_dim = split_dim % nd, concat_dim % nd
    n = g.size
    pieces = x.movedim(split_dim, 0)
    pieces = pieces.reshape(n, pieces.shape[0] // n, *pieces.shape[1:]).contiguous()
    flat = pieces.reshape(-1)
    split = [flat.numel() // n] * n
    got = wait(_funcol.all_to_all_single(flat, split, split, g.group_name), "all_to_all", g)
    got = got.reshape(pieces.shape).movedim(1, split_dim + 1)  # (n, *x-shape with split_dim/n)
    got = got.movedim(0, concat_dim)
    return got.flatten(concat_dim, concat_dim + 1)


def raw_all_to_all_v(x: Tensor, dim: int, send: tuple[int, ...], recv: tuple[int, ...], g: Group) -> Tensor:
    """Variable-split all-to-all along ``dim``: the first ``send[0]`` slices go to rank 0, the
    next ``send[1]`` to rank 1, ...; ``recv[k]`` slices arrive from rank k, concatenated in rank
    order (MoE token dispatch: the split sizes are exchanged first, ``raw_all_to_all``)."""
    moved = x.movedim(dim, 0)
    if moved.shape[0] != sum(send) or len(send) != g.size or len(recv) != g.size:
        raise ValueError(f"all_to_all_v on mesh axis {g.axis!r} (size {g.size}): send splits {list(send)} do not cover "
                         f"dim {dim} of shape {tuple(x.shape)}, or a split list is not one entry per rank")
    _issue(g)
    got = wait(_funcol.all_to_all_single(moved.contiguous(), list(recv), list(send), g.group_name), "all_to_all_v", g)
    return got.movedim(0, dim)


def ring(size: int, offset: int = 1) -> tuple[tuple[int, int], ...]:
    """The permutation of a ring step: ``(i, (i + offset) % size)`` for every rank ``i``."""
    return tuple((i, (i + offset) % size) for i in range(size))


def check_perm(perm: Sequence[tuple[int, int]], g: Group) -> tuple[tuple[int, int], ...]:
    """``perm`` as a tuple of (src, dst) pairs; a ValueError (before communicating) unless every
    index is a rank of the axis and no rank sends or receives twice (JAX's ``ppermute`` rule)."""
    pairs = tuple((int(s), int(d)) for s, d in perm)
    ranks = [r for pair in pairs for r in pair]
    srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
    if any(not 0 <= r < g.size for r in ranks) or len(set(srcs)) < len(srcs) or len(set(dsts)) < len(dsts):
        raise ValueError(f"ppermute on mesh axis {g.axis!r} (size {g.size}): {list(pairs)} is not a partial "
                         "permutation of its ranks (each rank sends at most once and receives at most once)")
    return pairs


def start_ppermute(x: Tensor, perm: tuple[tuple[int, int], ...], g: Group) -> Callable[[], Tensor]:
    """Issue ``raw_ppermute`` and return its wait: compute placed between the two overlaps the
    transfer where the backend runs it asynchronously (ring attention's next K/V block)."""
    send = {s: d for s, d in perm}.get(g.rank)
    recv = {d: s for s, d in perm}.get(g.rank)
    _issue(g)
    flat = x.contiguous().reshape(-1)
    n = flat.numel()
    out_splits = [n if k == recv else 0 for k in range(g.size)]
    in_splits = [n if k == send else 0 for k in range(g.size)]
    work = _funcol.all_to_all_single(flat if send is not None else flat[:0], out_splits, in_splits, g.group_name)

    def finish() -> Tensor:
        got = wait(work, "ppermute", g)
        return got.reshape(x.shape) if recv is not None else torch.zeros_like(x)

    return finish


def raw_ppermute(x: Tensor, perm: tuple[tuple[int, int], ...], g: Group) -> Tensor:
    """Send ``x`` from each pair's src to its dst; a rank that receives nothing gets zeros.  One
    ``all_to_all_single`` with empty splits to everyone else (traceable on every backend)."""
    return start_ppermute(x, perm, g)()


def _process_group(g: Group):
    return dist.distributed_c10d._resolve_process_group(g.group_name)


def raw_send(x: Tensor, shape: tuple[int, ...], peer: int, g: Group) -> Tensor:
    """Blocking send of ``x`` to rank ``peer`` of ``g``'s axis (point to point: only ``peer``
    takes part); returns a zero token shaped like ``x``'s leading dims beyond ``shape`` (``()``,
    or the batch under vmap).  Not traceable: ``_c10d_functional`` has no send.  It does not run
    the pending input agreement (``Gate``): that is a collective of the whole mesh, which
    the peer, blocked in its receive, would not join."""
    try:
        dist.send(x.detach().contiguous(), group=_process_group(g), group_dst=peer)
    except RuntimeError as exc:
        raise collective_error(exc, "send", g) from exc
    return x.new_zeros(x.shape[: x.dim() - len(shape)])


def raw_recv(anchor: Tensor, shape: tuple[int, ...], peer: int, g: Group) -> Tensor:
    """Blocking receive of a ``(*anchor.shape, *shape)`` tensor of ``anchor``'s dtype and device
    from rank ``peer`` of ``g``'s axis (``raw_send``'s other end)."""
    x = anchor.new_empty((*anchor.shape, *shape))
    try:
        dist.recv(x, group=_process_group(g), group_src=peer)
    except RuntimeError as exc:
        raise collective_error(exc, "recv", g) from exc
    return x


def raw_exchange(x: Tensor, peer: int, g: Group, where: str = "") -> Tensor:
    """``x`` sent to rank ``peer`` of ``g``'s axis and the tensor of ``x``'s shape and dtype that
    ``peer`` sends back, both in flight at once (point to point: only the two ranks take part, the
    other ranks of the axis issue nothing).  The peer calls it with this rank as its ``peer``."""
    got = torch.empty_like(x)
    group = _process_group(g)
    ops = [dist.P2POp(dist.isend, x.detach().contiguous(), group=group, group_peer=peer),
           dist.P2POp(dist.irecv, got, group=group, group_peer=peer)]
    try:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    except RuntimeError as exc:
        raise collective_error(exc, "exchange", g, where) from exc
    return got


class Replicas(NamedTuple):
    """Groups of ``size`` consecutive ranks of an axis holding the same value (a ``GroupedShard``)."""

    size: int


def raw_replica_sum(x: Tensor, replicas: Replicas, g: Group) -> Tensor:
    """The sum of ``x`` over this rank's group of ``replicas.size`` consecutive ranks: one
    all-reduce of a buffer with a slot per group, each rank writing its own group's slot."""
    slots = x.new_zeros((g.size // replicas.size, *x.shape))
    slots[g.rank // replicas.size] = x
    return raw_all_reduce(slots, g)[g.rank // replicas.size]
