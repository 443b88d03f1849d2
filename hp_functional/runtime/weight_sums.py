"""The checksum manifest of a safetensors folder: ``export_hf`` writes it, ``open_weights`` checks it.

``hpf_checksums.json`` lists every file of the folder (its size; the checksum of a safetensors
file's header, or of a whole other file) and every tensor (its file and the checksum of its data
bytes), so a mismatch names the file and the tensor.  A folder without one (``save_pretrained``'s)
is read unverified.  Also here: ``inside``, which keeps an index's file names within its folder.
"""

from __future__ import annotations

__all__ = ["MANIFEST", "inside", "verify_files", "verify_safetensors", "write_manifest"]

import json
import os
import struct
from pathlib import Path

from ..core.checksum import ALGORITHM, file_digest
from ..core.errors import CheckpointError

MANIFEST = "hpf_checksums.json"


def inside(folder: Path, name: object, where: str) -> Path:
    """``folder / name`` for a plain relative file name that stays inside ``folder`` (no absolute
    path, no ``..``); anything else is refused by name.  Symlinks inside the folder are followed,
    as Hugging Face's cache folders use them."""
    if not isinstance(name, str) or not name or os.path.isabs(name) or Path(name).drive \
            or ".." in Path(name).parts or ".." in Path(name.replace("\\", "/")).parts:
        raise CheckpointError(f"{where}: the file name {name!r} points outside the folder {folder}; refused "
                              "(weights are read only from inside the given folder)")
    return folder / name


def header_length(file: Path) -> int:
    """Bytes before a safetensors file's data: the 8-byte length and the JSON header."""
    with open(file, "rb") as f:
        head = f.read(8)
    if len(head) != 8:
        raise CheckpointError(f"weights {file}: shorter than a safetensors header: a corrupt or partial file")
    return 8 + struct.unpack("<Q", head)[0]


def tensor_ranges(file: Path) -> dict[str, tuple[int, int]]:
    """Each tensor's (start, end) byte range in ``file``, from its header."""
    start = header_length(file)
    try:
        with open(file, "rb") as f:
            f.seek(8)
            header = json.loads(f.read(start - 8))
        return {name: (start + int(v["data_offsets"][0]), start + int(v["data_offsets"][1]))
                for name, v in header.items() if name != "__metadata__"}
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise CheckpointError(f"weights {file}: not a safetensors header ({type(exc).__name__}): a corrupt file") from None


def write_manifest(folder: Path) -> None:
    """Checksum every file of ``folder`` (each tensor's data separately) into ``hpf_checksums.json``."""
    files, tensors = {}, {}
    for name in sorted(os.listdir(folder)):
        full = folder / name
        if name.endswith(".safetensors"):
            files[name] = {"size": full.stat().st_size, "header": file_digest(full, 0, header_length(full))}
            for tensor, (b, e) in tensor_ranges(full).items():
                tensors[tensor] = {"file": name, "digest": file_digest(full, b, e - b)}
        else:
            files[name] = {"size": full.stat().st_size, "digest": file_digest(full)}
    manifest = {"format": 1, "algorithm": ALGORITHM, "files": files, "tensors": tensors}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))


def _manifest(folder: Path) -> dict | None:
    file = folder / MANIFEST
    if not file.is_file():
        return None
    try:
        manifest = json.loads(file.read_text())
        ok = manifest.get("algorithm") == ALGORITHM and isinstance(manifest["files"], dict) \
            and isinstance(manifest["tensors"], dict)
    except (ValueError, KeyError, AttributeError):
        ok = False
    if not ok:
        raise CheckpointError(f"weights {file}: not a checksum manifest of this library ({ALGORITHM}): a corrupt file")
    return manifest


def verify_files(folder: Path, names: list[str]) -> None:
    """Check the non-safetensors ``names`` (e.g. ``config.json``) against ``folder``'s manifest, if it has one."""
    manifest = _manifest(folder)
    for name in names if manifest is not None else ():
        entry, full = manifest["files"].get(name), folder / name
        if isinstance(entry, dict) and full.is_file() and file_digest(full) != entry.get("digest"):
            raise CheckpointError(f"weights {full} does not match its checksum in {MANIFEST}: a corrupt or altered file")


def verify_safetensors(folder: Path, files: list[Path]) -> None:
    """Check each of ``files`` (safetensors in ``folder``) against ``folder``'s manifest, if it has
    one: size, header and every tensor's data.  A ``CheckpointError`` names the file and tensor.
    Local reads only (every rank reads every file once)."""
    manifest = _manifest(folder)
    if manifest is None:
        return
    for file in files:
        entry = manifest["files"].get(file.relative_to(folder).as_posix())
        if not isinstance(entry, dict):
            raise CheckpointError(f"weights {file}: not listed in {folder / MANIFEST}: a file the export did not write")
        if file.stat().st_size != entry.get("size") or file_digest(file, 0, header_length(file)) != entry.get("header"):
            raise CheckpointError(f"weights {file}: its size or header does not match {MANIFEST}: a corrupt or partial file")
        for tensor, (b, e) in tensor_ranges(file).items():
            want = manifest["tensors"].get(tensor)
            if not isinstance(want, dict) or want.get("file") != file.name or file_digest(file, b, e - b) != want.get("digest"):
                raise CheckpointError(f"weights {file}: the bytes of tensor {tensor!r} do not match its checksum in "
                                      f"{MANIFEST}: a corrupt file")
