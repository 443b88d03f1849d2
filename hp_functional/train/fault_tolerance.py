"""Fault tolerance across data-parallel replica groups, on torchft's own machinery (its Manager,
Lighthouse, managed process groups and checkpoint transports; nothing home-made).

A *replica group* is one torch.distributed world, sharded inside by ``shard()`` (TP) and
``hpf.fsdp``; the groups together are a data-parallel dimension that torchft manages: every step
the Lighthouse forms a quorum of the live groups, the gradients are averaged over the quorum by
torchft's managed all-reduce (one per bucket, not per parameter), and the optimizer step commits
only where torchft's ``should_commit`` agrees.  A dead group is dropped from the next quorum; a
group that joins (restarted or new) receives params, optimizer state and step from a live peer
through torchft's recovery path and from then on holds bitwise its peers' state.  The state a peer
sends is plain data (the local shards, the optimizer state's leaves and the layout of each leaf),
checked against the receiver's own layout before it is used.  See docs/fault-tolerance.md.
"""

from __future__ import annotations

__all__ = ["FaultTolerant"]

import os
import socket
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import optree
import torch
import torch.distributed as dist
from torch import Tensor

from ..core.buckets import BUCKET_BYTES, plan_buckets
from ..core.errors import PlanError, ShapeError
from ..core.host_comm import broadcast_objects
from ..core.placement import ShardInfo, fmt_placements
from .optim import Optimizer

if TYPE_CHECKING:
    from torchft import Manager

Params = Mapping[str, Tensor]


def _torchft():
    """The torchft package, or an ImportError that says how to install it (an optional extra)."""
    try:
        import torchft
        import torchft.coordination
    except ImportError as exc:
        raise ImportError("hp_functional's fault tolerance runs on torchft: pip install 'hp-functional[torchft]' "
                          f"(torchft>=0.2): {exc}") from exc
    return torchft


def layout(shard_info: Mapping[str, ShardInfo]) -> dict[str, tuple]:
    """Each leaf's layout as plain data (global and local shape, offset, placements, mesh axes and
    sizes): what a healing peer's state must match, key for key."""
    return {k: (tuple(i.global_shape), tuple(i.local_shape), tuple(i.offset), fmt_placements(i.placements),
                tuple(i.mesh.mesh_dim_names or ()), tuple(i.mesh.mesh.shape), i.blocks)
            for k, i in shard_info.items()}


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
        raise PlanError(f"FaultTolerant: opt_state{''.join(f'[{e!r}]' for e in bad)} is not a tensor: the state a "
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


class FaultTolerant:
    """One replica group's training state under torchft: params, optimizer state and step, kept here
    because torchft's recovery reads and writes them from its own thread (a peer asks for them).

    ``start_step()`` joins this step's quorum (healing from a peer first if this group is behind);
    ``commit(grads)`` averages the gradients over the quorum's groups with torchft's managed all-reduce
    (one per bucket of ``bucket_bytes``), asks torchft whether the step commits, and only then applies
    the optimizer; ``params`` / ``opt_state`` are the current state.  The quorum is computed before the
    step's forward (torchft's ``use_async_quorum=False``), so a group that healed computes its step from
    the healed state and its gradient counts.  Call everything on every rank of the replica group.

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
            params, shard_info: ``shard()``'s (or ``hpf.fsdp``'s) local shards and layouts; not mutated.
            replica_id: this group's name (the same after a restart; torchft adds a unique suffix).
            lighthouse: the Lighthouse's address (default: ``TORCHFT_LIGHTHOUSE``).
            min_replicas: the fewest groups a step commits with.
            timeout: torchft's timeout for its collectives, RPCs and the recovery transfer.
            quorum_timeout: how long a step waits for its quorum (default: ``timeout``).
            connect_timeout: how long to wait for the Lighthouse and the managers.
            hostname: the address the group's manager advertises (default: this host's name).
            store_addr, store_port: a TCPStore of this group's start for torchft (default: rank 0 starts one).
            bucket_bytes: the most bytes one managed all-reduce carries.
            init_sync: at step 0 every group takes the first group's state (False: they start equal by seed).
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
        mesh = next(iter(shard_info.values())).mesh
        group = process_group if process_group is not None else _managed_group(mesh.device_type, timeout)
        self._optimizer, self._bucket_bytes, self._layout = optimizer, bucket_bytes, layout(shard_info)
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
        """What a healing peer receives (torchft's ``state_dict`` callback, called from its thread)."""
        params, opt_state = self._state
        return {"layout": self._layout, "params": params, "opt_state": optree.tree_leaves(opt_state)}

    def _load(self, sent: dict[str, Any]) -> None:
        """Take a peer's state (torchft's ``load_state_dict`` callback; see ``received``)."""
        self._state = received(sent, self._layout, *self._state)

    # ------------------------------------------------------------ the step
    def start_step(self) -> None:
        """Join this step's quorum (torchft's ``start_quorum``); a group behind its peers heals here, before
        the forward.  Raises what torchft raises when no quorum forms within ``quorum_timeout``."""
        self._manager.start_quorum()

    def commit(self, grads: Mapping[str, Tensor | None]) -> bool:
        """Average ``grads`` (this rank's local gradients, keyed like ``params``; not mutated) over the quorum's
        replica groups, then apply the optimizer if torchft commits the step.  Returns whether it committed;
        an uncommitted step changes nothing (retry it: ``step`` did not advance)."""
        params, opt_state = self._state
        _check_grads(grads, params)
        averaged = self._average(grads)
        if not self._manager.should_commit():
            return False
        self._state = self._optimizer.update(averaged, opt_state, params)
        return True

    def _average(self, grads: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``grads`` averaged over the quorum by torchft's managed all-reduce: one per bucket (device, dtype,
        at most ``bucket_bytes``), all issued before the first wait, into fresh buffers.  A failed all-reduce
        is reported to the Manager (the step then does not commit), not raised."""
        items = ((k, (g.device, g.dtype), g.numel() * g.element_size()) for k, g in grads.items())
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


def received(sent: Mapping[str, Any], mine: Mapping[str, tuple], params: Params, opt_state: Any) -> tuple[dict, Any]:
    """A peer's state (``FaultTolerant``'s ``state_dict``) as this replica's ``(params, opt_state)``, refused by
    name unless it has this replica's layout ``mine`` (``layout()``), keys, shapes and dtypes; the tensors move
    to this rank's devices.  Pure."""
    theirs = sent["layout"]
    for k, here in mine.items():
        if theirs.get(k) != here:
            raise PlanError(f"FaultTolerant: the peer this replica heals from lays out params[{k!r}] as "
                            f"{theirs.get(k)!r}, this replica as {here!r}: healing across different layouts is "
                            "not supported (give every replica group the same mesh and plan)")
    if set(theirs) != set(mine):
        raise PlanError(f"FaultTolerant: the peer has params {sorted(set(theirs) - set(mine))[:5]} that this "
                        "replica has not")
    leaves, spec = optree.tree_flatten(opt_state)
    if len(sent["opt_state"]) != len(leaves):
        raise PlanError(f"FaultTolerant: the peer's optimizer state has {len(sent['opt_state'])} leaves, this "
                        f"replica's {len(leaves)} (a different optimizer)")
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
