"""Which directories ``save`` and ``export_hf`` may replace or delete: only the ones they made.

A finished checkpoint or export is a directory whose marker file (``hpf_complete.json`` /
``hpf_checksums.json``) lists every file in it; while being written it is a scratch directory
``<path>.hpf-partial`` tagged with ``.hpf-scratch`` (written first, so a crashed attempt's
leftovers are recognisably ours); while replacing ``path`` the previous one is moved to
``<path>.hpf-old``.  Anything else at those names (a user's folder, a user's file, a directory
holding a file no marker lists) is never deleted: ``check_targets`` refuses it, on every rank,
before anything is written and before any collective.
"""

from __future__ import annotations

__all__ = ["OLD", "SCRATCH", "check_targets", "prepare_scratch", "replace_dir", "untag"]

import json
import os
import shutil

from ..core.errors import CheckpointError

SCRATCH, OLD = ".hpf-partial", ".hpf-old"  # <path>.hpf-partial while writing; <path>.hpf-old while replacing <path>
TAG = ".hpf-scratch"  # the first file of a scratch directory


def listed_files(path: str, marker: str) -> set[str] | None:
    """The names ``path``'s marker file lists (the marker included), or None without a readable marker."""
    try:
        with open(os.path.join(path, marker)) as f:
            files = json.load(f).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    return {*files, marker} if isinstance(files, dict) else None


def _foreign(path: str, marker: str, scratch: bool = False) -> list[str] | None:
    """None when the directory ``path`` may be deleted (empty, a scratch directory of ours, or every
    entry a plain file its marker lists), else the entries that make it someone else's."""
    entries = sorted(os.listdir(path))
    if not entries or (scratch and TAG in entries):
        return None
    listed = listed_files(path, marker) or set()
    foreign = [e for e in entries if e not in listed or not os.path.isfile(os.path.join(path, e))
               or os.path.islink(os.path.join(path, e))]
    return foreign or None


def check_targets(path: str, marker: str, what: str, where: str) -> None:
    """Raise ``CheckpointError`` unless ``path``, ``<path>.hpf-partial`` and ``<path>.hpf-old`` are
    absent or ours to replace (``what``: "checkpoint" / "export", for the message).  Local reads
    only: every rank calls it before anything is written or deleted."""
    for name, scratch in ((path, False), (path + SCRATCH, True), (path + OLD, False)):
        if not os.path.lexists(name):
            continue
        if os.path.islink(name) or not os.path.isdir(name):
            raise CheckpointError(f"{where}: {name!r} exists and is not a directory this library wrote; refusing to "
                                  "replace it: choose another path, or move it away yourself")
        foreign = _foreign(name, marker, scratch)
        if foreign is not None:
            raise CheckpointError(f"{where}: {name!r} is a non-empty directory that is not an hp_functional {what} "
                                  f"(its {marker} does not list {foreign[:3]}); refusing to replace or delete it: "
                                  "choose a new or empty directory, or move it away yourself")


def prepare_scratch(tmp: str, marker: str, where: str) -> None:
    """Create the scratch directory ``tmp`` with its tag, deleting a crashed attempt's (ours only)."""
    if os.path.lexists(tmp):
        if os.path.islink(tmp) or not os.path.isdir(tmp) or _foreign(tmp, marker, scratch=True) is not None:
            raise CheckpointError(f"{where}: {tmp!r} is not a scratch directory of this library; refusing to delete it")
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    with open(os.path.join(tmp, TAG), "w") as f:
        f.write("hp_functional scratch directory: deleted by the next save or export to the same path\n")


def untag(tmp: str) -> None:
    """Drop the scratch tag before the marker lists the files (the marker then makes it ours)."""
    os.remove(os.path.join(tmp, TAG))


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(tmp: str | os.PathLike, path: str | os.PathLike, marker: str, what: str, where: str) -> None:
    """Make the finished directory ``tmp`` visible as ``path`` (a rename, synced); an existing
    ``path`` (ours: checked again here) is moved to ``<path>.hpf-old`` first (``os.replace``
    cannot replace a non-empty directory) and deleted after."""
    tmp, path = os.fspath(tmp), os.fspath(path)
    check_targets(path, marker, what, where)
    fsync_dir(tmp)
    old = path + OLD
    if os.path.exists(path):
        if os.path.exists(old):
            shutil.rmtree(old)
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    if os.path.exists(old):
        shutil.rmtree(old)
