"""What ``hpf.load`` trusts of a checkpoint on disk: nothing it has not checked first.  ``read_metadata``
unpickles DCP's ``.metadata`` with DCP's metadata types only; ``SummingWriter`` checksums every chunk at
save; ``VerifyingReader`` checks each chunk before deserialising it; ``as_checkpoint_error`` turns DCP's
``CheckpointException`` into ``CheckpointError``.  See docs/checkpoints.md#trust-model.
"""

from __future__ import annotations

__all__ = ["SummingWriter", "VerifyingReader", "as_checkpoint_error", "marker_sums", "parse_sums", "read_metadata"]

import io
import os
import pickle
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, metadata as dcp_md
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..core.checksum import ALGORITHM, digest, file_digest
from ..core.errors import CheckpointError

METADATA = ".metadata"
_ALLOWED = {("torch.distributed.checkpoint.metadata", n) for n in (
    "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
    "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}


def chunk_key(index: dcp_md.MetadataIndex) -> tuple[str, tuple[int, ...] | None]:
    return index.fqn, None if index.offset is None else tuple(index.offset)


def chunk_name(index: dcp_md.MetadataIndex) -> str:
    fqn, offset = chunk_key(index)
    return f"{fqn!r}" if offset is None else f"tensor {fqn!r} (its chunk at {list(offset)})"


# ---------------------------------------------------------------- .metadata, never executed
class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        value = getattr(torch, name, None) if module == "torch" else None
        if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
            return value
        raise CheckpointError(f"it refers to {module}.{name}, which is not one of DCP's metadata types; refused "
                              "unexecuted (loading never runs code from a checkpoint)")

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError("it holds a persistent id, which DCP's metadata never does; refused")


def read_metadata(path: str, recorded: str | None) -> dcp_md.Metadata:
    """DCP's metadata of the checkpoint at ``path``, after checking its checksum against the
    marker's ``recorded`` one and unpickling it with DCP's metadata types only."""
    file = os.path.join(path, METADATA)
    try:
        with open(file, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise CheckpointError(f"load: cannot read {file}: {exc}") from None
    if recorded is None or digest(data) != recorded:
        raise CheckpointError(f"load: {file} does not match the checksum recorded in the marker at save: a corrupt "
                              "or replaced file")
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointError as exc:
        raise CheckpointError(f"load: {file}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - any malformed pickle is a corrupt file
        raise CheckpointError(f"load: {file} is not DCP metadata ({type(exc).__name__}): a corrupt file") from None
    _check_metadata(file, md)
    return md


def _check_metadata(file: str, md: Any) -> None:
    """The unpickled objects have DCP's shapes, and every chunk lives in a plain file of the directory."""
    if not isinstance(md, dcp_md.Metadata) or not isinstance(md.state_dict_metadata, dict) \
            or not isinstance(md.storage_data, dict):
        raise CheckpointError(f"load: {file} is not DCP metadata (a {type(md).__name__}): a corrupt file")
    for index, info in md.storage_data.items():
        name = getattr(info, "relative_path", None)
        if not isinstance(index, dcp_md.MetadataIndex) or not isinstance(info, _StorageInfo) or info.transform_descriptors \
                or not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", "..") \
                or not isinstance(info.offset, int) or not isinstance(info.length, int) or min(info.offset, info.length) < 0:
            raise CheckpointError(f"load: {file} places {getattr(index, 'fqn', index)!r} at {name!r}, not a plain file of "
                                  "this checkpoint directory: refused")


# ---------------------------------------------------------------- writing: every chunk hashed by its writer
@dataclass(frozen=True)
class _Summed:
    """A chunk's storage record and its checksum, on the way from its writer to rank 0."""

    info: _StorageInfo
    digest: str


class SummingWriter(FileSystemWriter):
    """DCP's file writer, plus a checksum of every chunk by the rank that wrote it, carried to rank 0 in
    DCP's own gathered write results; after ``finish`` (rank 0), ``sums`` maps ``chunk_key`` to the
    checksum of every rank's chunks (for the marker: ``marker_sums``)."""

    sums: dict | None = None

    def write_data(self, plan, planner) -> Future:
        summed = []
        for r in super().write_data(plan, planner).wait():
            info = r.storage_data  # read back from the page cache just written
            sum_ = file_digest(os.path.join(self.path, info.relative_path), info.offset, info.length)
            summed.append(WriteResult(index=r.index, size_in_bytes=r.size_in_bytes, storage_data=_Summed(info, sum_)))
        fut: Future = Future()
        fut.set_result(summed)
        return fut

    def finish(self, metadata, results) -> None:
        self.sums, plain = {}, []
        for per_rank in results:
            plain.append([WriteResult(index=r.index, size_in_bytes=r.size_in_bytes, storage_data=r.storage_data.info)
                          for r in per_rank])
            self.sums.update({chunk_key(r.index): r.storage_data.digest for r in per_rank})
        super().finish(metadata, plain)


def marker_sums(writer: SummingWriter, tmp: str) -> dict:
    """The marker's ``checksums`` entry: the algorithm, ``.metadata``'s and every chunk's."""
    return {"algorithm": ALGORITHM, "metadata": file_digest(os.path.join(tmp, METADATA)),
            "chunks": [[fqn, None if off is None else list(off), d] for (fqn, off), d in sorted(
                writer.sums.items(), key=lambda kv: (kv[0][0], kv[0][1] or ()))]}


def parse_sums(path: str, marker: dict, md: dcp_md.Metadata) -> dict:
    """``chunk_key`` → checksum from the marker, after checking that every chunk has one."""
    entry = marker.get("checksums")
    try:
        sums = {(fqn, None if off is None else tuple(off)): d for fqn, off, d in entry["chunks"]}
    except (TypeError, KeyError, ValueError):
        raise CheckpointError(f"load: {path}'s marker has no chunk checksums: a corrupt marker") from None
    missing = [chunk_name(i) for i in md.storage_data if chunk_key(i) not in sums]
    if missing:
        raise CheckpointError(f"load: {path}'s marker records no checksum for {missing[:3]}: a corrupt checkpoint")
    return sums


# ---------------------------------------------------------------- reading: every chunk verified before use
class VerifyingReader(FileSystemReader):
    """DCP's file reader over already checked ``metadata``: each chunk is read whole, its checksum
    compared, then deserialised once (tensors with ``weights_only=True``, bytes raw) for every
    read request that overlaps it."""

    def __init__(self, path: str, metadata: dcp_md.Metadata, sums: dict):
        super().__init__(path)
        self._metadata, self._sums = metadata, sums

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_md.Metadata:
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = dcp_md.StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan, planner) -> Future:
        by_chunk: dict[dcp_md.MetadataIndex, list] = {}
        for req in plan.items:
            by_chunk.setdefault(req.storage_index, []).append(req)
        by_file: dict[str, list] = {}
        for index in by_chunk:
            by_file.setdefault(self.storage_data[index].relative_path, []).append(index)
        for name, indices in by_file.items():
            file = os.path.join(self.path, name)
            with open(file, "rb") as f:
                for index in sorted(indices, key=lambda i: self.storage_data[i].offset):
                    self._read_chunk(f, file, index, by_chunk[index], planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_chunk(self, f, file: str, index: dcp_md.MetadataIndex, reqs: list, planner) -> None:
        info = self.storage_data[index]
        f.seek(info.offset)
        data = f.read(info.length)
        if len(data) != info.length or digest(data) != self._sums[chunk_key(index)]:
            raise CheckpointError(f"load: {file}: the bytes of {chunk_name(index)} do not match the checksum recorded at "
                                  "save: a corrupt file (nothing was loaded)")
        if reqs[0].type == LoadItemType.BYTE_IO:
            for req in reqs:
                planner.load_bytes(req, io.BytesIO(data))
            return
        try:
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - named, without torch's advice to unpickle it unrestricted
            raise CheckpointError(f"load: {file}: {chunk_name(index)} is not a plain tensor record "
                                  f"({type(exc).__name__}): a corrupt checkpoint") from None
        if not isinstance(tensor, Tensor):
            raise CheckpointError(f"load: {file}: {chunk_name(index)} holds a {type(tensor).__name__}, not a tensor")
        for req in reqs:
            part = tensor
            for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                part = part.narrow(dim, start, length)
            target = planner.resolve_tensor(req).detach()
            if target.shape != part.shape:
                raise CheckpointError(f"load: {file}: {chunk_name(index)} has shape {tuple(tensor.shape)}, which does not "
                                      "match .metadata: a corrupt checkpoint")
            target.copy_(part)
            planner.commit_tensor(req, target)


# ---------------------------------------------------------------- DCP's errors as ours
def as_checkpoint_error(exc: CheckpointException, where: str) -> CheckpointError:
    """DCP's ``CheckpointException`` (a ``BaseException``, gathered from every rank) as one
    ``CheckpointError`` naming each rank's failure; torch's advice to unpickle with
    ``weights_only=False`` is dropped from the text."""
    parts = []
    for rank, failure in sorted(exc.failures.items()):
        err = failure[0] if isinstance(failure, tuple) else failure
        first = (str(err).splitlines() or [""])[0]
        text = str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {first}"
        if "weights_only" in text:
            text = f"{type(err).__name__} (torch.load refused a record)"
        parts.append(f"rank {rank}: {text}")
    return CheckpointError(f"{where} failed: " + "; ".join(parts))
