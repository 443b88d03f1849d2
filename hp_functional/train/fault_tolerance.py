"""Fault tolerance across data-parallel replica groups, on torchft's own machinery (its Manager,
Lighthouse, managed process groups and checkpoint transports; nothing home-made).

A *replica group* is one torch.distributed world, sharded inside by ``shard()`` (TP) and
``hpf.fsdp``; the groups together are a data-parallel dimension that torchft manages: every step
the Lighthouse forms a quorum of the live groups, the gradients are averaged over the quorum by
torchft's managed all-reduce (one per bucket, not per parameter), and the optimizer step commits
only where torchft's ``should_commit`` agrees.  A dead group is dropped from the next quorum; a
group that joins (restarted or new) receives params, optimizer state and step from a live peer
through torchft's recovery path, at its own layout (``hpf.reshard`` inside the group where the
peer's differs), and from then on holds bitwise its peers' state.  The state a peer sends is plain
data (the local shards, the optimizer state's leaves and each leaf's layout with its mesh as data),
checked against the receiver's before it is used.  Groups at different layouts average their
gradients at one layout every group shares (dim 0 of each tensor chunked over the group's ranks).
See docs/fault-tolerance.md.
"""

from __future__ import annotations

__all__ = ["FaultTolerant"]

import dataclasses
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

import optree
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ReduceOp
from torch.distributed.device_mesh import DeviceMesh

from ..compile.agree import digest
from ..core.buckets import BUCKET_BYTES, plan_buckets
from ..core.errors import PlanError, ShapeError
from ..core.exchange import Exchange, exchange_over
from ..core.facets import RowSplit
from ..core.host_comm import broadcast_objects
from ..core.placement import ShardInfo, fmt_placements
from ..core.raw_collectives import mesh_device
from .fsdp import split_info
from .optim import Optimizer, replicated_info
from .reshard import reshard

if TYPE_CHECKING:
    from torchft import Manager

Params = Mapping[str, Tensor]

#: the axis of the layout groups at different layouts average their gradients at (``canonical_info``)
_ROWS = "ft_rows"


def _torchft():
    """The torchft package, or an ImportError that says how to install it (an optional extra)."""
    try:
        import torchft
        import torchft.coordination
    except ImportError as exc:
        raise ImportError("hp_functional's fault tolerance runs on torchft: pip install 'hp-functional[torchft]' "
                          f"(torchft>=0.2): {exc}") from exc
    return torchft


# ---------------------------------------------------------------- layouts as data
class MeshSpec(NamedTuple):
    """A mesh as plain data, what a peer's layout names: its axis names and its rank tensor (nested tuples)."""

    names: tuple[str, ...]
    ranks: Any

    @property
    def flat(self) -> tuple[int, ...]:
        """Its ranks, sorted."""
        return tuple(sorted(torch.tensor(self.ranks).reshape(-1).tolist()))


def _mesh_spec(mesh) -> MeshSpec:
    def nested(x):
        return tuple(nested(v) for v in x) if isinstance(x, list) else x

    return MeshSpec(tuple(mesh.mesh_dim_names or ()), nested(mesh.mesh.tolist()))


def portable(info: ShardInfo) -> ShardInfo:
    """``info`` with its mesh, and its row split's inner layout's, as a ``MeshSpec``: data a healing peer is
    sent (pickled by torchft's transport).  Inverse: ``placed``."""
    out = dataclasses.replace(info, mesh=_mesh_spec(info.mesh))
    split = info.facet(RowSplit)
    return out if split is None else out.with_facet(RowSplit, RowSplit(split.axis, portable(split.inner)))


def placed(info: ShardInfo, mesh: DeviceMesh) -> ShardInfo:
    """``portable``'s inverse: ``info`` on ``mesh`` (a mesh with its ``MeshSpec``'s axes and ranks), a row
    split's inner layout on the sub-mesh of the inner layout's axes (it is read by axis name only)."""
    out = dataclasses.replace(info, mesh=mesh)
    split = info.facet(RowSplit)
    if split is None:
        return out
    names = tuple(split.inner.mesh.names)
    inner = mesh if names == tuple(mesh.mesh_dim_names) else mesh[names]
    return out.with_facet(RowSplit, RowSplit(split.axis, placed(split.inner, inner)))


def describe(info: ShardInfo, outer: bool = True) -> str:
    """Where a portable layout stores a tensor, as text alike on every rank: global shape, placements, mesh
    (axes and ranks; an inner layout's by axis name, as it is read), packed blocks, row split.  Equal texts:
    equal shards on every rank."""
    m = info.mesh
    text = f"{tuple(info.global_shape)} {fmt_placements(info.placements)} on {m.names}" + (f" {m.ranks}" if outer else "")
    text += f" blocks {info.blocks}" if info.blocks else ""
    split = info.facet(RowSplit)
    return text + (f" rows over {split.axis} of ({describe(split.inner, False)})" if split else "")


def canonical_info(shape: Sequence[int], mesh: DeviceMesh) -> ShardInfo:
    """The layout every replica group averages a gradient at when the groups' layouts differ: alike in every
    group whatever its own layout, dim 0 chunked over the group's ranks (``mesh``, 1-D over them), as
    ``hpf.fsdp`` chunks it; a scalar whole on every rank."""
    whole = replicated_info(shape, mesh)
    return split_info(whole, mesh, (_ROWS,)) if len(shape) else whole


def fingerprints(infos: Mapping[str, ShardInfo], params: Params, ranks: int) -> tuple[int, int]:
    """(this group's layout, its model and number of ranks) as two 63-bit digests, alike on its every rank:
    groups with equal first digests hold the same elements at each group rank and average their gradients as
    they are; groups with equal second ones can average at ``canonical_info``; other groups cannot train together."""
    keys = sorted(infos)
    layout = digest("\n".join(f"{k} {params[k].dtype} {describe(portable(infos[k]))}" for k in keys))
    model = digest(f"{ranks} ranks\n" + "\n".join(f"{k} {params[k].dtype} {tuple(infos[k].global_shape)}" for k in keys))
    return layout, model


# ---------------------------------------------------------------- the local checks
def _check_params(params: Params, opt_state: Any, shard_info: Mapping[str, ShardInfo]) -> None:
    """``params`` keyed exactly like ``shard_info`` at its local shapes, and the optimizer state made of tensors."""
    missing, extra = [k for k in shard_info if k not in params], [k for k in params if k not in shard_info]
    if missing or extra:
        raise PlanError(f"FaultTolerant: params and shard_info have different keys: missing from params {missing[:5]}, "
                        f"not in shard_info {extra[:5]}")
    _same_shapes("FaultTolerant: params", params, {k: i.local_shape for k, i in shard_info.items()}, "its local shape")
    paths, leaves, _ = optree.tree_flatten_with_path(opt_state)
    bad = next((p for p, leaf in zip(paths, leaves, strict=True) if not isinstance(leaf, Tensor)), None)
    if bad is not None:
        raise PlanError(f"FaultTolerant: opt_state{_path(bad)} is not a tensor: the state a "
                        "healing replica receives is tensors only (hpf.optim's states are)")


def _check_grads(grads: Mapping[str, Tensor | None], params: Params) -> None:
    """Every parameter has a gradient of its shape (every replica must all-reduce the same buckets)."""
    missing, extra = [k for k in params if grads.get(k) is None], [k for k in grads if k not in params]
    if missing or extra:
        raise PlanError(f"FaultTolerant.commit: every parameter needs a gradient (the replicas all-reduce the same "
                        f"buckets; pass zeros for a frozen one): none for {missing[:5]}, not a parameter {extra[:5]}")
    _same_shapes("FaultTolerant.commit: grads", grads, {k: p.shape for k, p in params.items()}, "params' shape")


def _same_shapes(what: str, tensors: Mapping[str, Tensor], shapes: Mapping[str, Any], whose: str) -> None:
    """A ``ShapeError`` naming the first of ``tensors`` whose shape is not ``shapes[key]``."""
    for k, t in tensors.items():
        if tuple(t.shape) != tuple(shapes[k]):
            raise ShapeError(f"{what}[{k!r}] has shape {tuple(t.shape)} but {whose} is {tuple(shapes[k])}")


def _path(path: tuple) -> str:
    return "".join(f"[{e!r}]" for e in path)


# ---------------------------------------------------------------- a peer's state, checked where it arrives
#: what a rank holds of a peer's state after torchft's recovery: nothing, its state at this replica's
#: layout or at another one, or a state refused (the kinds of ``_KINDS``)
_NONE, _SAME, _OTHER = 0, 1, 2
_KINDS = {3: "other params", 4: "other global shapes", 5: "other dtypes", 6: "another number of ranks",
          7: "another optimizer state", 8: "shards that do not match the peer's own layout", 9: "a state it cannot read"}


def peer_state(params: Params, opt_state: Any, layout: Mapping[str, ShardInfo]) -> dict[str, Any]:
    """What this rank sends a healing peer's rank of the same group rank (torchft's ``state_dict``): its shards,
    the optimizer state's leaves and their paths, and every leaf's layout (``portable``: data).  Checked where it
    arrives by ``_verdict``."""
    paths, leaves, _ = optree.tree_flatten_with_path(opt_state)
    return {"layout": layout, "params": params, "opt_state": leaves, "opt_paths": paths}


class _Pending(NamedTuple):
    """What torchft's recovery handed this rank: the peer's state, its code (``_SAME``, ``_OTHER`` or a
    refusal's kind) and, for a refusal, the error naming the parameter."""

    sent: Mapping[str, Any]
    code: int
    message: str


def _verdict(sent: Mapping[str, Any], mine: Mapping[str, ShardInfo], params: Params, opt_state: Any) -> tuple[int, str]:
    """A peer's state (``FaultTolerant``'s ``state_dict``) against this replica's portable layout ``mine``:
    ``_SAME`` layout, ``_OTHER`` (to reshard), or a refusal's kind and error.  Local, and alike on every rank of
    the group for anything but a peer whose shards contradict its own layout."""
    problem = _refusal(sent, mine, params) or _optimizer_refusal(sent, opt_state)
    if problem is not None:
        return problem
    theirs = sent["layout"]
    return (_SAME if all(describe(theirs[k]) == describe(mine[k]) for k in mine) else _OTHER), ""


def _refusal(sent: Mapping[str, Any], mine: Mapping[str, ShardInfo], params: Params) -> tuple[int, str] | None:
    """What ``hpf.reshard`` cannot move into this replica's layout: other keys, global shapes or dtypes, meshes
    over another number of ranks, or shards that are not the sizes the peer's layout gives them."""
    theirs, got = sent.get("layout"), sent.get("params")
    if not isinstance(theirs, Mapping) or not isinstance(got, Mapping) or set(theirs) != set(mine) or set(got) != set(mine):
        keys = set(theirs) if isinstance(theirs, Mapping) else set()
        return 3, (f"FaultTolerant: the peer this replica heals from has params {sorted(keys - set(mine))[:5]} that this "
                   f"replica has not, and lacks {sorted(set(mine) - keys)[:5]}: another model?")
    for k in sorted(mine):
        here, there, t = mine[k], theirs[k], got[k]
        if tuple(there.global_shape) != tuple(here.global_shape):
            return 4, (f"FaultTolerant: params[{k!r}] has global shape {tuple(there.global_shape)} at the peer this "
                       f"replica heals from, {tuple(here.global_shape)} here: another model?")
        if not isinstance(t, Tensor) or t.dtype != params[k].dtype:
            return 5, (f"FaultTolerant: the peer this replica heals from sent params[{k!r}] as "
                       f"{getattr(t, 'dtype', type(t).__name__)}, this replica holds {params[k].dtype}")
        if there.mesh.flat != here.mesh.flat:
            return 6, (f"FaultTolerant: the peer this replica heals from lays out params[{k!r}] over ranks "
                       f"{list(there.mesh.flat)}, this replica group over {list(here.mesh.flat)}: healing needs groups "
                       "of the same number of ranks")
        if tuple(t.shape) != tuple(there.local_shape):
            return 8, (f"FaultTolerant: the peer this replica heals from sent params[{k!r}] of shape {tuple(t.shape)}, "
                       f"but its layout gives this rank {tuple(there.local_shape)}")
    return None


def _optimizer_refusal(sent: Mapping[str, Any], opt_state: Any) -> tuple[int, str] | None:
    """A peer's optimizer state with other leaves (paths) or dtypes than this replica's."""
    paths, leaves, _ = optree.tree_flatten_with_path(opt_state)
    theirs, got = list(sent.get("opt_paths", ())), list(sent.get("opt_state", ()))
    if theirs != list(paths) or len(got) != len(leaves):
        return 7, (f"FaultTolerant: the peer this replica heals from has {len(got)} optimizer state leaves "
                   f"{[_path(p) for p in theirs[:3]]}..., this replica {len(leaves)} {[_path(p) for p in paths[:3]]}...: "
                   "another optimizer?")
    for p, t, here in zip(paths, got, leaves, strict=True):
        if not isinstance(t, Tensor) or t.dtype != here.dtype:
            return 7, (f"FaultTolerant: the peer's opt_state{_path(p)} is {getattr(t, 'dtype', type(t).__name__)}, "
                       f"this replica's {here.dtype}")
    return None


# ---------------------------------------------------------------- the group's one agreement per step
def agree_step(pending: _Pending | None, errored: bool, mixed: bool, group: Exchange | None) -> tuple[str, bool]:
    """This step's heal and how the group averages, decided alike on every rank of the replica group from one
    all-gather of four int64 per rank (what it received of a peer, whether torchft reported an error, the peer
    layout's digest, whether it saw the groups' layouts differ).  Right after ``start_quorum``, where every rank
    of the group is, whatever torchft did on it: torchft hands a peer's state only to the ranks whose transfer
    succeeded, and at step 0 (``init_sync``) to some ranks of a group and not others.  Returns the heal
    (``decide``) and whether to average at ``canonical_info``; a refused peer is a ``PlanError`` on every rank."""
    code = pending.code if pending is not None else _NONE
    peer = digest("\n".join(f"{k} {describe(v)}" for k, v in sorted(pending.sent["layout"].items()))) \
        if code in (_SAME, _OTHER) else 0
    row = [code, int(errored), peer, int(mixed)]
    rows = [row] if group is None or group.size == 1 else group.all_gather(torch.tensor(row)).cpu().tolist()
    action = decide(rows, pending.message if pending is not None else "")
    return action, any(r[3] for r in rows) or action == "reshard"


def decide(rows: Sequence[Sequence[int]], mine: str = "") -> str:
    """The heal every rank of the group takes from every rank's ``(code, errored, peer layout digest, ...)``:
    ``"none"``; ``"copy"`` (each rank that received a state at this layout takes it); ``"reshard"`` (every rank
    received the same peer layout, another one: ``hpf.reshard`` inside the group); ``"retry"`` (some rank's
    transfer failed: nobody takes anything, and the group heals again at the next quorum).  A ``PlanError``
    (``mine``: this rank's own, naming the parameter) when a rank refused the state, or what was received cannot
    be put together at this layout."""
    got = [i for i, r in enumerate(rows) if r[0] != _NONE]
    if not got:
        return "none"
    refused = [(i, r[0]) for i, r in enumerate(rows) if r[0] not in (_NONE, _SAME, _OTHER)]
    if refused:
        raise PlanError(mine or f"FaultTolerant: rank {refused[0][0]} of this replica group refused the state of the "
                        f"peer it heals from ({_KINDS.get(refused[0][1], 'unknown')}; its own error names the parameter)")
    missing = [i for i, r in enumerate(rows) if r[0] == _NONE]
    if any(rows[i][1] for i in missing):
        return "retry"
    if all(rows[i][0] == _SAME for i in got):
        return "copy"
    if missing:
        raise PlanError(f"FaultTolerant: ranks {got} of this replica group received a peer's step-0 state at another "
                        f"layout and ranks {missing} none: torchft syncs step 0 (init_sync) rank by rank, each group rank "
                        "from a group of its own, which cannot be put together across layouts; start every group from "
                        "the same weights (the same seed) and pass init_sync=False")
    if len({rows[i][2] for i in got}) > 1:
        raise PlanError("FaultTolerant: the ranks of this replica group received their shards from peers at different "
                        "layouts (torchft picks each group rank's peer among the groups that are up to date): healing at "
                        "another layout needs the up-to-date groups at one layout")
    return "reshard"


def probe_lighthouse(address: str, connect_timeout: timedelta) -> None:
    """Connect to the torchft Lighthouse at ``address`` or raise ``ConnectionError`` naming it, within
    ``connect_timeout``.  Every rank of a replica group probes for itself before the Manager exists, so an
    unreachable Lighthouse is a clear error on every rank, not a hang on the ranks that wait for rank 0."""
    from torchft.coordination import LighthouseClient

    try:
        LighthouseClient(address, connect_timeout=connect_timeout)
    except RuntimeError as exc:
        raise ConnectionError(f"fault tolerance: the torchft Lighthouse at {address!r} is not reachable within "
                              f"{connect_timeout.total_seconds():g} s; start it first (`torchft_lighthouse "
                              f"--min_replicas 1`) and pass its address (lighthouse= or TORCHFT_LIGHTHOUSE): {exc}") from None


def _managed_group(device_type: str, timeout: timedelta):
    """torchft's reconfigurable process group for the mesh's device type (gloo on CPU, NCCL on CUDA)."""
    torchft = _torchft()
    if device_type == "cpu":
        return torchft.ProcessGroupGloo(timeout=timeout)
    if device_type == "cuda":
        return torchft.ProcessGroupNCCL(timeout=timeout)
    raise PlanError(f"FaultTolerant: no torchft process group is chosen for device type {device_type!r}; pass "
                    "process_group= (a torchft.process_group.ProcessGroup)")


def _group_store(store_addr: str | None, store_port: int | None, host: str) -> tuple[str, int, Any, int, int]:
    """The TCPStore torchft's Manager of this replica group uses (address, port, the server if this rank hosts
    it), this rank and the group's size.  Without ``store_addr``/``store_port``, group rank 0 starts a fresh
    one on ``host`` and sends its port to the group: torchrun's agent store outlives a restart of the group,
    and the manager address a dead start left in it would be read by the next start's ranks."""
    initialised = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if initialised else int(os.environ.get("RANK", 0))
    world = dist.get_world_size() if initialised else int(os.environ.get("WORLD_SIZE", 1))
    if store_addr and store_port:
        return store_addr, int(store_port), None, rank, world
    if world > 1 and not initialised:
        raise PlanError("FaultTolerant: a replica group of several ranks needs torch.distributed initialised "
                        "(init_process_group) or store_addr= and store_port=")
    server = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False) if rank == 0 else None
    where = [(host, server.port) if server is not None else None]
    if world > 1:
        broadcast_objects(where, src=0)
    return where[0][0], where[0][1], server, rank, world




def _replica_group(meshes: Sequence[DeviceMesh]) -> Exchange | None:
    """The ranks of this replica group that ``shard_info``'s meshes span, for the group's agreement and a heal's
    ``hpf.reshard``: they must be its whole world (None: one process, torch.distributed not initialised)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    spans = sorted({r for m in meshes for r in m.mesh.reshape(-1).tolist()})
    if spans != list(range(dist.get_world_size())):
        raise PlanError(f"FaultTolerant: shard_info's mesh spans ranks {spans}, not the replica group's world of "
                        f"{dist.get_world_size()}: a replica group is one torch.distributed world, sharded over all its ranks")
    return exchange_over(meshes, "FaultTolerant")


class FaultTolerant:
    """One replica group's training state under torchft: params, optimizer state and step, kept here
    because torchft's recovery reads them from its own thread (a peer asks for them).

    ``start_step()`` joins this step's quorum and takes a peer's state if this group is behind (healing
    at its own layout); ``commit(grads)`` averages the gradients over the quorum's groups with torchft's
    managed all-reduce (one per bucket of ``bucket_bytes``), asks torchft whether the step commits, and only
    then applies the optimizer; ``params`` / ``opt_state`` are the current state.  The quorum is computed
    before the step's forward (torchft's ``use_async_quorum=False``), so a group that healed computes its
    step from the healed state and its gradient counts.  Call everything on every rank of the replica
    group; an exception from either ends the group's run (torchrun restarts it).

    >>> ft = FaultTolerant(opt, params, opt.init(params), shard_info, replica_id="replica_0")
    >>> while ft.step < steps:
    ...     ft.start_step()
    ...     grads = torch.func.grad(loss_fn)(ft.params, batch(ft.step, ft.replica_rank))
    ...     ft.commit(grads)
    """

    def __init__(
        self, optimizer: Optimizer, params: Params, opt_state: Any, shard_info: Mapping[str, ShardInfo], *,
        replica_id: str, lighthouse: str | None = None, min_replicas: int = 1, timeout: timedelta = timedelta(seconds=60),
        quorum_timeout: timedelta | None = None, connect_timeout: timedelta = timedelta(seconds=10),
        hostname: str | None = None, store_addr: str | None = None, store_port: int | None = None,
        bucket_bytes: int = BUCKET_BYTES, init_sync: bool = True, checkpoint_transport: Any = None,
        process_group: Any = None,
    ) -> None:
        """Check everything locally, probe the Lighthouse, then start torchft's Manager for this group.

        Args:
            optimizer: an ``hpf.optim`` optimizer; ``opt_state`` its state for ``params``.
            params, shard_info: ``shard()``'s (or ``hpf.fsdp``'s) local shards and layouts, over the whole group; not mutated.
            replica_id: this group's name (the same after a restart; torchft adds a unique suffix).
            lighthouse: the Lighthouse's address (default: ``TORCHFT_LIGHTHOUSE``).
            min_replicas: the fewest groups a step commits with.
            timeout: torchft's timeout for its collectives, RPCs and the recovery transfer.
            quorum_timeout: how long a step waits for its quorum (default: ``timeout``).
            connect_timeout: how long to wait for the Lighthouse and the managers.
            hostname: the address the group's manager advertises (default: this host's name).
            store_addr, store_port: a TCPStore of this group's start for torchft (default: rank 0 starts one).
            bucket_bytes: the most bytes one managed all-reduce (and a heal's all-to-all) carries.
            init_sync: at step 0 every group takes the first group's state (False: they start equal by seed;
                groups at different layouts need False).
            checkpoint_transport: torchft's transport for healing (default: its ``HTTPTransport``).
            process_group: the managed group across replicas (default: torchft's gloo on CPU, NCCL on CUDA).
        """
        torchft = _torchft()
        if not shard_info:
            raise PlanError("FaultTolerant: shard_info is empty")
        if not (isinstance(bucket_bytes, int) and bucket_bytes > 0):
            raise ValueError(f"FaultTolerant: bucket_bytes must be a positive int, got {bucket_bytes!r}")
        _check_params(params, opt_state, shard_info)
        address = lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        if not address:
            raise PlanError("FaultTolerant: no Lighthouse address: pass lighthouse= or set TORCHFT_LIGHTHOUSE")
        self._set_layouts(shard_info, params)
        group = process_group if process_group is not None else _managed_group(self._device_type, timeout)
        self._optimizer, self._bucket_bytes = optimizer, bucket_bytes
        self._state: tuple[dict[str, Tensor], Any] = (dict(params), opt_state)
        probe_lighthouse(address, connect_timeout)  # every rank, before the group's first collective
        host = hostname or socket.gethostname()
        addr, port, self._store, rank, world = _group_store(store_addr, store_port, host)
        self._manager: Manager = torchft.Manager(
            pg=group, load_state_dict=self._load, state_dict=self._state_dict, min_replica_size=min_replicas,
            use_async_quorum=False, timeout=timeout, quorum_timeout=quorum_timeout or timeout,
            connect_timeout=connect_timeout, rank=rank, world_size=world, store_addr=addr, store_port=port,
            lighthouse_addr=address, replica_id=replica_id, hostname=host,
            checkpoint_transport=checkpoint_transport, init_sync=init_sync)

    def _set_layouts(self, shard_info: Mapping[str, ShardInfo], params: Params) -> None:
        """This group's layouts as sent to peers, its ranks, its meshes by ``MeshSpec`` and its fingerprints
        (local: a mesh that is not over the whole group is refused here, before any collective)."""
        meshes = list({id(i.mesh): i.mesh for i in shard_info.values()}.values())
        self._infos = dict(shard_info)
        self._portable = {k: portable(i) for k, i in shard_info.items()}
        self._group = _replica_group(meshes)
        self._device_type, self._device = meshes[0].device_type, mesh_device(meshes[0])
        self._meshes = {_mesh_spec(m): m for m in meshes}
        self._fingerprints = fingerprints(shard_info, params, self._group.size if self._group else 1)
        self._canonical: dict[str, ShardInfo] | None = None
        self._pending: _Pending | None = None
        self._check: tuple[Tensor, Any] | None = None
        self._mixed = self._at_canonical = False  # seen the quorum's layouts differ; average at canonical_info

    # ------------------------------------------------------------ the state
    @property
    def params(self) -> dict[str, Tensor]:
        """The current params (this rank's local shards), after the last committed step or heal."""
        return dict(self._state[0])

    @property
    def opt_state(self) -> Any:
        """The current optimizer state."""
        return self._state[1]

    @property
    def step(self) -> int:
        """Steps committed so far (torchft's step: a healed group takes its peer's)."""
        return self._manager.current_step()

    @property
    def participants(self) -> int:
        """How many replica groups take part in this step's quorum (after ``start_step``)."""
        return self._manager.num_participants()

    @property
    def replica_rank(self) -> int | None:
        """This group's rank in this step's quorum (None: not taking part), e.g. to pick its data."""
        return self._manager.participating_rank()

    @property
    def manager(self) -> Manager:
        """torchft's Manager of this group (its metrics, ``batches_committed``, ``errored``)."""
        return self._manager

    def _state_dict(self) -> dict[str, Any]:
        """What a healing peer receives (torchft's ``state_dict`` callback, called from its thread): this rank's
        shards, the optimizer state's leaves and paths, and every leaf's layout as data (``portable``)."""
        return peer_state(*self._state, self._portable)

    def _load(self, sent: dict[str, Any]) -> None:
        """torchft's ``load_state_dict`` callback: a peer's state, checked and kept, not applied.  torchft calls it
        in ``start_quorum`` only on the ranks whose transfer succeeded (and at step 0 on some ranks of a group),
        so nothing here may wait for the group: ``start_step`` applies it once the group agreed."""
        try:
            verdict = _verdict(sent, self._portable, *self._state)
        except Exception as exc:  # noqa: BLE001 - refused on every rank by the agreement, not raised on this one alone
            verdict = 9, f"FaultTolerant: the state the peer sent this rank cannot be read: {type(exc).__name__}: {exc}"
        self._pending = _Pending(sent, *verdict)

    # ------------------------------------------------------------ the step
    def start_step(self) -> None:
        """Join this step's quorum (torchft's ``start_quorum``); a group behind its peers heals here, before the
        forward, once its ranks agreed (``agree_step``): the peer's state copied at this layout, or resharded
        inside the group from the peer's (``hpf.reshard``: params and optimizer state bit for bit).  Raises what
        torchft raises when no quorum forms within ``quorum_timeout``, and a ``PlanError`` on every rank of the
        group for a peer's state that cannot be taken (another model, number of ranks or optimizer)."""
        before = self._manager.state_dict()
        self._pending = None
        self._manager.start_quorum()
        pending, self._pending = self._pending, None
        action, self._at_canonical = agree_step(pending, self._manager.errored() is not None, self._mixed, self._group)
        if action == "retry":  # torchft set the step of the ranks that received: set it back, heal again next quorum
            self._manager.load_state_dict(before)
            self._manager.report_error(RuntimeError("FaultTolerant: a rank of this group did not receive its peer's state"))
        elif action == "copy" and pending is not None:
            self._state = _copied(pending.sent, *self._state)
        elif action == "reshard" and pending is not None:
            self._state = resharded(pending.sent, *self._state, self._infos, self._mesh_for, self._bucket_bytes)
        self._check = self._start_check()

    def _mesh_for(self, spec: MeshSpec) -> DeviceMesh:
        """A mesh over this group's ranks laid out as ``spec``: one of this replica's own when it is, else one
        made once (its process groups made on every rank alike, as every rank of the group gets here alike)."""
        if spec not in self._meshes:
            self._meshes[spec] = DeviceMesh(self._device_type, torch.tensor(spec.ranks), mesh_dim_names=spec.names)
        return self._meshes[spec]

    def _start_check(self) -> tuple[Tensor, Any]:
        """This step's check that the quorum's groups average their gradients alike: one managed all-reduce (max)
        of this group's two fingerprints and its mode, negated too (so the max says whether all are equal); waited
        for in ``commit``, after the forward and backward it overlaps."""
        layout, model = self._fingerprints
        mode = int(self._at_canonical)
        values = torch.tensor([layout, -layout, model, -model, mode, -mode], dtype=torch.int64, device=self._device)
        return values, self._manager.allreduce(values, reduce_op=ReduceOp.MAX)

    def commit(self, grads: Mapping[str, Tensor | None]) -> bool:
        """Average ``grads`` (this rank's local gradients, keyed like ``params``; not mutated) over the quorum's
        replica groups, then apply the optimizer if torchft commits the step.  Returns whether it committed;
        an uncommitted step changes nothing (retry it: ``step`` did not advance)."""
        params, opt_state = self._state
        _check_grads(grads, params)
        self._finish_check()
        averaged = self._averaged(grads)
        if not self._manager.should_commit():
            return False
        self._state = self._optimizer.update(averaged, opt_state, params)
        return True

    def _finish_check(self) -> None:
        """Wait for this step's check.  The groups of the quorum read the same maxima: where they do not all average
        alike (another layout averaged as it is, or another mode), every group reports an error to torchft (its
        managed all-reduces become no-ops and the step commits nowhere) and the next step averages at
        ``canonical_info`` wherever the layouts differ.  Another model or number of ranks is a ``PlanError``."""
        if self._check is None:
            raise PlanError("FaultTolerant.commit: call start_step() first, every step")
        (values, work), self._check = self._check, None
        work.wait()
        if self._manager.errored() is not None:  # the step commits nowhere; the maxima may be this rank's own
            return
        top, (layout, model) = values.cpu().tolist(), self._fingerprints
        if (top[2], -top[3]) != (model, model):
            raise PlanError("FaultTolerant: the replica groups of this quorum train different models (params, global "
                            "shapes or dtypes) or have different numbers of ranks: they cannot average their gradients")
        self._mixed = (top[0], -top[1]) != (layout, layout)
        if top[4] != -top[5] or (self._mixed and not self._at_canonical):
            self._manager.report_error(RuntimeError("FaultTolerant: the replica groups of this quorum have different "
                                                    "layouts; they average at one layout from the next step on"))

    def _averaged(self, grads: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``grads`` averaged over the quorum's groups: as they are where every group has this layout, else at
        ``canonical_info`` (``hpf.reshard`` there and back inside the group, bit for bit), alike in every group."""
        if not self._at_canonical:
            return self._average(grads)
        if self._canonical is None:
            ranks = tuple(self._group.ranks) if self._group is not None else (0,)
            mesh = self._mesh_for(MeshSpec((_ROWS,), ranks))
            self._canonical = {k: canonical_info(i.global_shape, mesh) for k, i in self._infos.items()}
        there = reshard(dict(grads), self._infos, self._canonical, bucket_bytes=self._bucket_bytes)
        return reshard(self._average(there), self._canonical, self._infos, bucket_bytes=self._bucket_bytes)

    def _average(self, grads: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``grads`` averaged over the quorum by torchft's managed all-reduce: one per bucket (device, dtype,
        at most ``bucket_bytes``, keys in sorted order: alike in every group), all issued before the first wait,
        into fresh buffers.  A failed all-reduce is reported to the Manager (the step then does not commit), not
        raised."""
        items = ((k, (grads[k].device, grads[k].dtype), grads[k].numel() * grads[k].element_size()) for k in sorted(grads))
        pending = []
        for bucket in plan_buckets(items, self._bucket_bytes):
            flat = torch.cat([grads[k].reshape(-1) for k in bucket])  # a copy: the all-reduce works in place
            pending.append((bucket, flat, self._manager.allreduce(flat)))
        out: dict[str, Tensor] = {}
        for bucket, flat, work in pending:
            work.wait()
            for k, piece in zip(bucket, flat.split([grads[k].numel() for k in bucket]), strict=True):
                out[k] = piece.view_as(grads[k])
        return {k: out[k] for k in grads}

    def shutdown(self) -> None:
        """Stop this group's manager and its checkpoint server."""
        self._manager.shutdown(wait=False)


def resharded(sent: Mapping[str, Any], params: Params, opt_state: Any, infos: Mapping[str, ShardInfo],
              mesh_for: Callable[[MeshSpec], DeviceMesh], bucket_bytes: int) -> tuple[dict[str, Tensor], Any]:
    """A peer's state that the replica group's ranks hold together at the peer's layout (rank r the peer's rank
    r's shards, ``sent``) as this replica's ``(params, opt_state)`` at its layout ``infos``: one ``hpf.reshard``
    of the params and the optimizer state together inside the group (one agreement, one all-to-all per bucket),
    bit for bit.  ``mesh_for``: a mesh over the group's ranks for each ``MeshSpec`` of the peer's layout."""
    layout = sent["layout"]
    theirs = {k: placed(layout[k], mesh_for(layout[k].mesh)) for k in infos}
    got = {k: sent["params"][k].to(p.device) for k, p in params.items()}
    leaves, spec = optree.tree_flatten(opt_state)
    state = optree.tree_unflatten(spec, [t.to(here.device) for t, here in zip(sent["opt_state"], leaves, strict=True)])
    new_params, new_state = reshard((got, state), theirs, infos, bucket_bytes=bucket_bytes)
    return dict(new_params), new_state


def _copied(sent: Mapping[str, Any], params: Params, opt_state: Any) -> tuple[dict[str, Tensor], Any]:
    """A peer's state at this replica's own layout as its ``(params, opt_state)``: the tensors moved to this
    rank's devices, the optimizer state rebuilt with this replica's structure.  Pure."""
    leaves, spec = optree.tree_flatten(opt_state)
    new_params = {k: _like(sent["params"][k], p, f"params[{k!r}]") for k, p in params.items()}
    new_leaves = [_like(t, here, f"optimizer state leaf {i}")
                  for i, (t, here) in enumerate(zip(sent["opt_state"], leaves, strict=True))]
    return new_params, optree.tree_unflatten(spec, new_leaves)


def _like(t: Tensor, mine: Tensor, what: str) -> Tensor:
    """``t`` (a peer's) checked against this rank's ``mine`` and moved to its device."""
    if not isinstance(t, Tensor) or tuple(t.shape) != tuple(mine.shape) or t.dtype != mine.dtype:
        got = (tuple(t.shape), t.dtype) if isinstance(t, Tensor) else type(t).__name__
        raise PlanError(f"FaultTolerant: the peer's {what} is {got}, this replica's {(tuple(mine.shape), mine.dtype)}")
    return t.to(mine.device)
