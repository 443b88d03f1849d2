"""Cross-rank agreement: every rank must have resolved the same plan for the same model.

After its local checks ``shard()`` hashes what it decided (library versions, mesh, resolved plan,
parameter layouts, and optionally a checksum of every tensor's values) and all-gathers the digests
once; a difference raises ``PlanMismatchError`` on every rank, naming what differs and where.
See docs/guarantees.md#cross-rank-agreement and docs/performance.md#the-value-check-in-shard.
"""

from __future__ import annotations

__all__ = ["agree", "checksum", "digest"]

import hashlib
import importlib.metadata
import re
import zlib
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from ..core.errors import PlanMismatchError
from ..core.host_comm import gather_flat, gather_objects, mesh_groups
from ..core.program import Program
from ..core.raw_collectives import mesh_device

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # object addresses differ per process, not per plan
COMPONENTS = ("library", "mesh", "plan", "parameters", "values")


def _version(dist_name: str) -> str:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def checksum(t: Tensor) -> str:
    """An exact, position-sensitive checksum of ``t``'s bits, without a host copy: on the CPU the
    CRC-32 of its bytes (zlib, over a zero-copy view of a contiguous tensor); elsewhere ``device_checksum``."""
    data = t.detach().contiguous().view(-1)
    data = data.view(torch.uint8) if data.numel() else data.to(torch.uint8)
    if data.device.type == "cpu":  # zero-copy: CRC-32 over the tensor's own bytes
        return f"crc{zlib.crc32(memoryview(data.numpy()))}"
    return device_checksum(data)


def device_checksum(data: Tensor) -> str:
    """The checksum where the bytes live (an accelerator), without a host copy: the bytes as
    int32 words (or bytes), summed plainly and weighted by position along a (rows, 4093) view —
    row sums by row index, column sums by column index — in int64, whose wrap-around is exact."""
    words = data.view(torch.int32) if data.numel() % 4 == 0 else data
    k = 4093
    n = words.numel() // k * k
    plain = words.sum(dtype=torch.int64)
    grid = words[:n].view(-1, k)
    rows = torch.arange(1, grid.shape[0] + 1, device=words.device, dtype=torch.int64)
    cols = torch.arange(1, k + 1, device=words.device, dtype=torch.int64)
    tail = words[n:].to(torch.int64) * cols[: words.numel() - n]
    weighted = (grid.sum(1, dtype=torch.int64) * rows).sum() + (grid.sum(0, dtype=torch.int64) * cols).sum() + tail.sum()
    return f"sum{int(plain)}:{int(weighted)}"


def value_checksums(tensors: Mapping[str, Tensor]) -> dict[str, str]:
    """Name → ``checksum`` of every tensor that has values (meta tensors are skipped)."""
    return {name: checksum(t) for name, t in tensors.items() if t.device.type != "meta"}


def describe(program: Program, values: Mapping[str, str] | None = None,
             runtime: Mapping[str, str] | None = None) -> dict[str, dict[str, str]]:
    """Per component, item → a printable description (what the fingerprint hashes); ``values``
    are the tensors' checksums (empty: not verified); ``runtime`` what ``shard()`` decided
    beyond the program (activation checkpointing), hashed with the plan."""
    mesh = program.mesh
    return {
        "library": {"hp_functional": _version("hp_functional"), "torch": torch.__version__},
        "mesh": {
            "device_type": mesh.device_type,
            "dims": repr(dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True))),
            "ranks": repr(mesh.mesh.tolist()),
        },
        "plan": {
            b.planned.fqn: _ADDRESS.sub("", f"{b.planned.style!r} on {b.planned.axis!r}") for b in program.boundaries
        }
        | dict(runtime or {}),
        "parameters": {
            key: f"{tuple(info.global_shape)} {program.dtypes[key]} {tuple(map(str, info.placements))}"
            + (f" blocks {info.blocks}" if info.blocks else "")
            for key, info in program.infos.items()
        },
        "values": dict(values or {}),
    }


def digest(text: str) -> int:
    """A stable (cross-process) 63-bit hash of ``text``, to all-gather as an int64."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def _digest(items: dict[str, str]) -> int:
    return digest("\n".join(f"{k}={v}" for k, v in sorted(items.items())))


def _gather(value, mesh, timeout: timedelta | None):
    """All-gather a small int64 tensor (or, with ``value`` a list, Python objects) over the mesh
    (``core.host_comm``'s staged gather).  Returns (values, ranks) in one order."""
    order = mesh_groups(mesh)[1]
    if isinstance(value, list):  # the slow path, only after a mismatch: full descriptions
        return [v for chunk in gather_objects(value, mesh) for v in chunk], order
    try:
        rows = gather_flat(value.to(mesh_device(mesh)), mesh, timeout)
    except RuntimeError as exc:
        if timeout is None:
            raise
        raise PlanMismatchError(
            f"shard(): not every rank of the mesh reached the plan agreement within {timeout.total_seconds():g}s "
            "(another rank probably failed before it: see that rank's error); the process group may be "
            "unusable now"
        ) from exc
    return rows.view(-1, len(COMPONENTS) + 1).cpu(), order


def agree(program: Program, timeout: timedelta | None = timedelta(minutes=5),
          values: Mapping[str, Tensor] | None = None, runtime: Mapping[str, str] | None = None,
          flag: bool = False) -> bool:
    """Raise ``PlanMismatchError`` on every rank unless all ranks of the mesh decided the same
    (and, given ``values``, hold the same values in those tensors).  Returns whether every rank
    raised ``flag`` (carried in the same all-gather: a decision every rank must take alike)."""
    if not dist.is_initialized() or dist.get_backend() == "fake":  # nothing to agree with (simulate)
        return flag
    described = describe(program, value_checksums(values) if values is not None else None, runtime)
    mine = torch.tensor([*(_digest(described[c]) for c in COMPONENTS), int(flag)], dtype=torch.int64)
    gathered, order = _gather(mine, program.mesh, timeout)
    digests, flags = gathered[:, :-1], gathered[:, -1]
    if bool((digests == digests[0]).all()):
        return bool(flags.all())
    everyone, _ = _gather([described], program.mesh, None)
    by_rank = dict(zip(order, everyone, strict=True))
    raise PlanMismatchError(_explain_mismatch(by_rank))


def _explain_mismatch(by_rank: dict[int, dict[str, dict[str, str]]]) -> str:
    """Which components and items differ, and the ranks holding each variant."""
    lines = ["shard(): ranks disagree on the sharding (same model, plan, mesh and library are needed on every rank):"]
    ranks = sorted(by_rank)
    for comp in COMPONENTS:
        items = list(dict.fromkeys(k for r in ranks for k in by_rank[r][comp]))  # the first rank's (model) order
        if comp != "values":
            items.sort()
        shown = 0
        for item in items:
            variants: dict[str, list[int]] = {}
            for r in ranks:
                variants.setdefault(by_rank[r][comp].get(item, "<absent>"), []).append(r)
            if len(variants) > 1:
                if shown < 5:
                    seen = "; ".join(f"{v} on ranks {rs}" for v, rs in variants.items())
                    if comp == "values":
                        seen = f"checksums {seen} (seed every rank alike, or load the same weights on every rank)"
                    lines.append(f"  {comp} {item}: {seen}")
                shown += 1
        if shown > 5:
            lines.append(f"  ... and {shown - 5} more {comp} differences")
    return "\n".join(lines)
