"""Distributed checkpoints through ``torch.distributed.checkpoint`` (DCP), DTensor-free: ``save`` / ``load`` /
``latest``.  Each rank writes its local shard's boxes as chunks of the *global* tensor, and ``load`` reads them
into any target layout.  Helpers: ``ckpt_files`` (crash-safe directories), ``ckpt_integrity`` (checksums,
nothing executed from disk), ``ckpt_extra`` (``extra`` as JSON plus tensors).  See docs/checkpoints.md.
"""

from __future__ import annotations

__all__ = ["AsyncSaves", "Loaded", "SaveHandle", "latest", "load", "save"]

import json
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any, NamedTuple

import optree
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..core.errors import CheckpointError, PlanError, ShapeError
from ..core.host_comm import broadcast_objects, new_group
from ..core.placement import ShardInfo, boxes
from ..core.raw_collectives import mesh_device
from . import ckpt_extra
from .ckpt_files import OLD, SCRATCH, check_targets, prepare_scratch, replace_dir, untag
from .ckpt_integrity import SummingWriter, VerifyingReader, as_checkpoint_error, marker_sums, parse_sums, read_metadata
from .dcp_planners import Boxed, LoadPlanner, SavePlanner, Stager
from .optim import state_info

MARKER = "hpf_complete.json"  # written last, by rank 0: a directory without it is not a checkpoint
EXTRA = "extra"  # rank r's extra is the byte item "extra/<r>" (ckpt_extra's encoding)
FORMAT = 2  # 1: pickled extra, no checksums (refused by load)


class Loaded(NamedTuple):
    """``load``'s result: the params, the optimizer state (None without a template) and ``extra``."""

    params: dict[str, Tensor]
    opt_state: Any
    extra: Any


# ---------------------------------------------------------------- what is stored under which key
def _opt_entries(opt_state: Any, shard_info: Mapping[str, ShardInfo], where: str) -> tuple[list[str], list[Any], Any, list]:
    """(keys ``optim/<path>``, leaves, treespec, ShardInfos) of an optimizer state pytree."""
    accessors, leaves, spec = optree.tree_flatten_with_accessor(opt_state)
    keys = []
    for acc, leaf in zip(accessors, leaves, strict=True):
        parts = [e.field if isinstance(getattr(e, "field", None), str) else str(e.entry) for e in acc]
        keys.append("/".join(["optim", *parts]))
        if not isinstance(leaf, Tensor):
            raise TypeError(f"{where}: opt_state leaf {keys[-1]!r} is a {type(leaf).__name__}, not a tensor")
    if len(set(keys)) != len(keys):
        raise PlanError(f"{where}: opt_state paths {sorted(k for k in keys if keys.count(k) > 1)[:3]} name one key twice")
    return keys, leaves, spec, optree.tree_leaves(state_info(opt_state, shard_info))


def _check_keys(where: str, params: Mapping[str, Tensor], shard_info: Mapping[str, ShardInfo]) -> None:
    missing, extra = sorted(set(shard_info) - set(params)), sorted(set(params) - set(shard_info))
    if missing or extra:
        raise PlanError(f"{where}: params and shard_info have different keys: missing from params {missing[:5]}, "
                        f"not in shard_info {extra[:5]}")


def _check_mesh(where: str, shard_info: Mapping[str, ShardInfo]) -> None:
    """Every leaf's mesh holds this rank.  A leaf may live on a sub-mesh (a pipeline stage's
    ``(tp,)`` of a ``(pp, tp)`` mesh): every rank of the default group still calls, each with its
    own leaves, and the checkpoint is their union."""
    for name, info in shard_info.items():
        if info.mesh.get_coordinate() is None:
            raise PlanError(f"{where}: {name}'s mesh {info.mesh.mesh.tolist()} does not hold rank {dist.get_rank()}; "
                            "every rank takes part in a checkpoint with the leaves on its own meshes")


# ---------------------------------------------------------------- save
class SaveHandle:
    """A save in progress.  ``wait()`` (every rank must call it, in the same order as other
    collectives) finishes it: the checkpoint is visible at ``path`` when it returns.  A sync save's
    handle is already finished.  ``lane``: the ``AsyncLane`` an async save runs on (it holds the
    handle as its pending save until ``wait()``); ``close_lane``: the lane is this save's alone
    (``save(async_save=True)``), closed once the save is complete."""

    def __init__(self, path: str, future: Future | None = None, commit: Callable[[], None] | None = None,
                 lane: AsyncLane | None = None, *, close_lane: bool = False):
        self.path, self._future, self._commit, self._lane = path, future, commit, lane
        self._close_lane = close_lane
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether ``wait()`` has finished, with success or not (never, for an async save before it is called)."""
        return self._commit is None

    def wait(self) -> str:
        """Block until the checkpoint is visible; returns its path.  Idempotent: a save that failed
        raises its error again on every later call, never returns the path of what is not there."""
        if self._error is not None:
            raise self._error
        if self._commit is not None:
            commit, self._commit = self._commit, None
            if self._lane is not None:
                self._lane.release(self)
            try:
                try:
                    self._future.result()
                except CheckpointException as exc:
                    raise as_checkpoint_error(exc, "save") from None
                commit()  # every rank is past its lane's collectives once the commit's broadcast returns
            except BaseException as exc:
                self._error = exc
                raise
            finally:
                if self._close_lane:
                    self._lane.close()
        return self.path


class AsyncLane:
    """One world's lane for async saves: the gloo process group of their thread and the save on
    it not yet waited for (one at a time: two saves' collectives on one group from two threads
    would interleave differently on different ranks)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.pending: SaveHandle | None = None

    def close(self) -> None:
        """Destroy the lane's process group (a lane of one save, after it completed on every rank)."""
        if self.group is not None:
            dist.destroy_process_group(self.group)  # local: no collective (every rank closes its own end)
            self.group = None

    def finish_pending(self) -> None:
        """Wait for the save still pending on this lane, if any (``SaveHandle.wait`` releases it)."""
        if self.pending is not None:
            self.pending.wait()

    def hold(self, handle: SaveHandle) -> SaveHandle:
        """Make ``handle`` this lane's pending save; returns it."""
        self.pending = handle
        return handle

    def release(self, handle: SaveHandle) -> None:
        """``handle`` is being waited for: it no longer blocks the next save."""
        if self.pending is handle:
            self.pending = None


class AsyncSaves:
    """The lanes async saves run on, owned by the caller and passed to every ``save``
    (``save(..., async_save=saves)``): keep one per process-group world.  Each lane is keyed by its
    world (the default process group and the ranks): its gloo group is created collectively (every
    rank, same order) on the first save and reused by the next ones, and a save still pending on it
    is finished before the next one starts (``finish_pending``)."""

    def __init__(self):
        self._lanes: dict[tuple, AsyncLane] = {}

    def finish_pending(self) -> None:
        """Wait for every lane's pending save (a collective, as ``SaveHandle.wait``)."""
        for lane in list(self._lanes.values()):
            lane.finish_pending()

    def lane(self, ranks: tuple[int, ...]) -> AsyncLane:
        """The lane of ``ranks`` in the current world, its gloo group created on first use (a collective)."""
        key = (dist.group.WORLD, ranks)  # the world's group itself: a new world after a re-init is another key
        if key not in self._lanes:
            self._lanes[key] = AsyncLane(new_group(ranks, backend="gloo"))
        return self._lanes[key]


def _on_rank0(fn: Callable[[], None], what: str) -> None:
    """Run ``fn`` on rank 0 and tell every rank how it went (one broadcast): an error raises everywhere."""
    status = [None]
    if dist.get_rank() == 0:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported to every rank, so none waits forever
            status[0] = f"{what}: {type(exc).__name__}: {exc}"
    broadcast_objects(status, src=0)
    if status[0] is not None:
        raise CheckpointError(status[0])


def _write_synced(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _commit(tmp: str, path: str, world: int, writer: SummingWriter) -> None:
    """Rank 0, after every rank's data and DCP's .metadata are on disk: the marker (file sizes and
    every chunk's checksum), then the rename."""
    untag(tmp)
    files = {n: os.path.getsize(os.path.join(tmp, n)) for n in sorted(os.listdir(tmp))}
    marker = {"format": FORMAT, "time_ns": time.time_ns(), "world_size": world, "files": files,
              "checksums": marker_sums(writer, tmp)}
    _write_synced(os.path.join(tmp, MARKER), json.dumps(marker, indent=1).encode())
    replace_dir(tmp, path, MARKER, "checkpoint", "save")


def save(path: str | os.PathLike, params: Mapping[str, Tensor], shard_info: Mapping[str, ShardInfo], *,
         opt_state: Any = None, extra: Any = None, async_save: bool | AsyncSaves = False) -> SaveHandle:
    """Write ``params`` (and ``opt_state``, and this rank's ``extra``) as a checkpoint of global tensors
    at ``path``; a collective (every rank calls it).  Each rank writes its own boxes, nothing is
    gathered; the checkpoint appears at ``path`` only once complete.  Inverse: ``load``.

    Args:
        path: the checkpoint directory: new, empty or an earlier checkpoint (anything else: ``CheckpointError``,
            before anything is written).
        params: FQN -> this rank's local shard, with ``shard_info``'s keys and local shapes.
        shard_info: each leaf's layout; every leaf's mesh must hold this rank.
        opt_state: an optimizer state pytree of tensors (``opt.init(params)``'s), each leaf stored under
            ``optim/<its pytree path>`` (None: no state).
        extra: this rank's own JSON-like data and tensors (step, RNG state; see ``ckpt_extra``), encoded now, so a
            later change to it is not saved.
        async_save: False: write now.  An ``AsyncSaves`` (the caller's, one per process-group world, passed to
            every save): copy the shards to CPU memory, write them in a thread on its lane and return at once; a
            save still pending there is finished first.  True: the same on a lane of this save alone (a gloo
            group made for it and closed by ``wait()``).

    Returns:
        A ``SaveHandle``: every rank must call its ``wait()`` (a sync save's is already finished), which returns
        ``path`` once the checkpoint is visible.
    """
    path = _save_target(os.fspath(path))
    _check_keys("save", params, shard_info)
    _check_mesh("save", shard_info)
    if async_save is not False and dist.get_backend() == "threaded":  # hpf.emulate's ranks are threads of one process
        raise PlanError("save: async_save=True cannot run under hpf.emulate (its writer thread and lane would be shared "
                        "by every emulated rank); save with async_save=False there")
    entries = _entries(params, shard_info, opt_state)
    extra_bytes = ckpt_extra.encode(extra)  # now: an unstorable extra fails before any collective, a later change is not saved
    saves = async_save if isinstance(async_save, AsyncSaves) else AsyncSaves() if async_save else None
    if saves is not None:
        saves.finish_pending()  # one async save at a time on a lane: finish the previous one first
    rank, world = dist.get_rank(), dist.get_world_size()
    tmp = path + SCRATCH
    _on_rank0(lambda: prepare_scratch(tmp, MARKER, "save"), f"save: cannot create {tmp!r}")  # before any rank's DCP does
    state: dict[str, Any] = {k: Boxed(t.detach(), boxes(info), info.global_shape) for k, (t, info) in entries.items()}
    state[f"{EXTRA}/{rank}"] = extra_bytes  # a DCP byte item of this rank's own: its write errors are DCP's
    writer = SummingWriter(tmp)

    def commit() -> None:
        _on_rank0(lambda: _commit(tmp, path, world, writer), f"save: cannot complete {path!r}")

    if saves is None:
        try:
            dcp.save(state, storage_writer=writer, planner=SavePlanner())
        except CheckpointException as exc:
            raise as_checkpoint_error(exc, "save") from None
        commit()
        return SaveHandle(path)
    lane = saves.lane(tuple(range(world)))
    try:
        future = dcp.async_save(state, storage_writer=writer, planner=SavePlanner(), process_group=lane.group,
                                async_stager=Stager())
    except CheckpointException as exc:
        raise as_checkpoint_error(exc, "save") from None
    return lane.hold(SaveHandle(path, future, commit, lane, close_lane=async_save is True))


def _save_target(path: str) -> str:
    """``path`` if a checkpoint may be written there (new, empty or an earlier checkpoint), else the error."""
    if path.endswith(SCRATCH) or path.endswith(OLD):
        raise PlanError(f"save: {path!r} ends with {SCRATCH!r} or {OLD!r}, names reserved for checkpoints being written")
    if os.path.exists(path) and not os.path.isdir(path):
        raise PlanError(f"save: {path!r} exists and is not a directory")
    check_targets(path, MARKER, "checkpoint", "save")
    return path


def _entries(params: Mapping[str, Tensor], shard_info: Mapping[str, ShardInfo],
             opt_state: Any) -> dict[str, tuple[Tensor, ShardInfo]]:
    """Every key the checkpoint stores (the params', then the optimizer state's ``optim/...``) with
    its local tensor and layout; a ShapeError for a parameter not shaped as its ``shard_info`` says."""
    entries: dict[str, tuple[Tensor, ShardInfo]] = {}
    for name, info in shard_info.items():
        t = params[name]
        if not isinstance(t, Tensor) or tuple(t.shape) != tuple(info.local_shape):
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ShapeError(f"save: parameter {name} has local shape {shape} but its shard_info expects "
                             f"{tuple(info.local_shape)} (global {tuple(info.global_shape)}): from another mesh or plan?")
        entries[name] = (t, info)
    if opt_state is not None:
        keys, leaves, _, infos = _opt_entries(opt_state, shard_info, "save")
        for key, leaf, info in zip(keys, leaves, infos, strict=True):
            if key in entries:
                raise PlanError(f"save: optimizer key {key!r} collides with a parameter's name")
            entries[key] = (leaf, info)
    return entries


# ---------------------------------------------------------------- finding and checking checkpoints
def _marker(path: str) -> dict | None:
    try:
        with open(os.path.join(path, MARKER)) as f:
            marker = json.load(f)
        return marker if isinstance(marker, dict) and "time_ns" in marker else None
    except (OSError, ValueError):
        return None


def latest(root: str | os.PathLike) -> str | None:
    """The newest complete checkpoint directly under ``root`` (newest by its marker's time); directories
    being written (``*.hpf-partial``) and without a marker are ignored.  No collective.

    Args:
        root: the folder holding checkpoint directories (one that does not exist holds none).

    Returns:
        The checkpoint's path, or None when there is none.
    """
    root = os.fspath(root)
    if not os.path.isdir(root):
        return None
    found = []
    for name in os.listdir(root):
        full = os.path.join(root, name)
        if not name.endswith(SCRATCH) and os.path.isdir(full) and (m := _marker(full)) is not None:
            found.append((m["time_ns"], full))
    return max(found)[1] if found else None


def _check_sizes(path: str, marker: dict) -> None:
    """The marker is this version's, and every file it lists has its recorded size."""
    if marker.get("format") != FORMAT:
        raise CheckpointError(f"load: {path} was saved in checkpoint format {marker.get('format')!r}; this version reads "
                              f"format {FORMAT} (checksummed, extra without pickle) only: load it with the version that "
                              "wrote it and save it again with this one")
    for name, size in marker.get("files", {}).items():
        full = os.path.join(path, name)
        actual = os.path.getsize(full) if os.path.isfile(full) else None
        if actual != size:
            raise CheckpointError(f"load: {full} is {'missing' if actual is None else f'{actual} bytes'} but the checkpoint "
                                  f"recorded {size} bytes: a corrupt or partial copy")


def _check_extents(path: str, metadata) -> None:
    """Every chunk .metadata references fits in its file."""
    need: dict[str, int] = {}
    for info in metadata.storage_data.values():  # FileSystemWriter's (relative_path, offset, length) records
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, end in need.items():
        full = os.path.join(path, name)
        actual = os.path.getsize(full) if os.path.isfile(full) else None
        if actual is None or actual < end:
            raise CheckpointError(f"load: {full} is {'missing' if actual is None else f'{actual} bytes'} but .metadata "
                                  f"references {end} bytes of it: a corrupt or partial checkpoint")


def _check_saved(path: str, metadata, key: str, info: ShardInfo, dtype: torch.dtype | None) -> torch.dtype:
    """The saved dtype of ``key``, after checking that it exists with ``info``'s global shape (and ``dtype``)."""
    md = metadata.state_dict_metadata.get(key)
    if not isinstance(md, TensorStorageMetadata):
        raise CheckpointError(f"load: {path} has no tensor {key!r}")
    if tuple(md.size) != tuple(info.global_shape):
        raise CheckpointError(f"load: {key} has global shape {tuple(md.size)} in {path} but {tuple(info.global_shape)} "
                              "in shard_info: a checkpoint of another model?")
    if dtype is not None and md.properties.dtype != dtype:
        raise CheckpointError(f"load: {key} is {md.properties.dtype} in {path} but the template has {dtype}")
    return md.properties.dtype


# ---------------------------------------------------------------- load
def load(path: str | os.PathLike, shard_info: Mapping[str, ShardInfo], *, opt_state: Any = None,
         params: Mapping[str, Tensor] | None = None) -> Loaded:
    """Read the checkpoint at ``path`` into fresh local shards laid out by ``shard_info``; a collective.
    Every chunk is verified before use.  Inverse: ``save``.

    Args:
        path: a complete checkpoint directory (``latest(root)`` finds the newest).
        shard_info: the target layout: any mesh, plan or world size.
        opt_state: a template (``opt.init(params)``) giving the state's structure, dtypes (the saved ones) and
            devices; None loads no optimizer state.  Not written to.
        params: a template (the target ``shard()``'s params) whose devices the loaded params take, its dtypes the
            saved ones (None: the saved dtype, on the mesh's device).  Not written to.

    Returns:
        ``Loaded(params, opt_state, extra)``: new local shards, the state (None without a template), and this
        rank's ``extra`` when the world size is the saved one, else rank 0's.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"load: {path!r} is not a directory")
    marker = _marker(path)
    if marker is None:
        raise CheckpointError(f"load: {path} is an incomplete checkpoint (no marker {MARKER}): a save that did not "
                              "finish; use hpf.latest(root) to find the newest complete one")
    _check_sizes(path, marker)  # local file reads from here to dcp.load, no collective
    metadata = read_metadata(path, (marker.get("checksums") or {}).get("metadata"))
    _check_extents(path, metadata)
    sums = parse_sums(path, marker, metadata)
    if params is not None:
        _check_keys("load", params, shard_info)
    _check_mesh("load", shard_info)
    # (key, layout, template or None) of every tensor to read: the params, then the optimizer state's leaves
    wanted = [(name, info, None if params is None else params[name]) for name, info in shard_info.items()]
    opt = None
    if opt_state is not None:
        keys, leaves, spec, infos = _opt_entries(opt_state, shard_info, "load")
        wanted += list(zip(keys, infos, leaves, strict=True))
        opt = (keys, spec)
    missing = [k for k, _, _ in wanted if k not in metadata.state_dict_metadata]
    if missing:
        raise CheckpointError(f"load: {path} has no tensors {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                              f"({len(missing)} of the {len(wanted)} wanted are missing)")
    state: dict[str, Boxed] = {}
    for key, info, like in wanted:
        dtype = _check_saved(path, metadata, key, info, None if like is None else like.dtype)
        device = like.device if like is not None else mesh_device(info.mesh)
        state[key] = Boxed(torch.empty(info.local_shape, dtype=dtype, device=device), boxes(info), info.global_shape)
    src = dist.get_rank() if marker.get("world_size") == dist.get_world_size() else 0
    extra_key = f"{EXTRA}/{src}"
    if extra_key not in metadata.state_dict_metadata:
        raise CheckpointError(f"load: {path} has no {extra_key!r} (saved by {marker.get('world_size')} ranks)")
    state_dict: dict[str, Any] = {**state, extra_key: None}
    try:  # every chunk is verified before it is used; a failure on any rank raises on every rank
        dcp.load(state_dict, storage_reader=VerifyingReader(path, metadata, sums), planner=LoadPlanner())
    except CheckpointException as exc:
        raise as_checkpoint_error(exc, "load") from None
    extra = ckpt_extra.decode(state_dict[extra_key], f"load: {path}")
    loaded = {name: state[name].local for name in shard_info}
    new_opt = None if opt is None else optree.tree_unflatten(opt[1], [state[k].local for k in opt[0]])
    return Loaded(loaded, new_opt, extra)
