"""Cross-rank agreement: every rank must have resolved the same plan for the same model.

``shard()`` runs its local checks first (so bad input raises on every rank before any
collective), then hashes what it decided — library versions, the mesh, the resolved plan and
every parameter's global shape, dtype and placements — and all-gathers the digests once.  A
difference raises ``PlanMismatchError`` on every rank, naming what differs and on which ranks,
instead of a hang or silently wrong numbers several thousand steps later.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import re
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .errors import PlanMismatchError

if TYPE_CHECKING:
    from .apply import Program

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # object addresses differ per process, not per plan
COMPONENTS = ("library", "mesh", "plan", "parameters")


def _version(dist_name: str) -> str:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def describe(program: Program) -> dict[str, dict[str, str]]:
    """Per component, item → a printable description (what the fingerprint hashes)."""
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
        | {"loss_parallel": repr(program.loss_parallel is not None)},
        "parameters": {
            key: f"{tuple(info.global_shape)} {program.dtypes[key]} {tuple(map(str, info.placements))}"
            + (f" blocks {info.blocks}" if info.blocks else "")
            for key, info in program.infos.items()
        },
    }


def digest(text: str) -> int:
    """A stable (cross-process) 63-bit hash of ``text``, to all-gather as an int64."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def _digest(items: dict[str, str]) -> int:
    return digest("\n".join(f"{k}={v}" for k, v in sorted(items.items())))


def _gather(value, mesh, timeout: timedelta | None):
    """All-gather a small int64 tensor (or, with ``value`` a list, Python objects) over the mesh.

    One collective over the default group when the mesh spans the world, else one per mesh dim
    (each stage gathers what the previous one collected).  Returns (values, ranks) in one order."""
    world = dist.get_world_size()
    device = torch.device(mesh.device_type, torch.accelerator.current_device_index()) if mesh.device_type != "cpu" else "cpu"
    if mesh.size() == world:
        groups, order = [None], list(range(world))
    else:
        groups = [mesh.get_group(d) for d in range(mesh.ndim)]
        order = mesh.mesh.permute(*reversed(range(mesh.ndim))).flatten().tolist()
    if isinstance(value, list):  # the slow path, only after a mismatch: full descriptions
        for group in groups:
            out = [None] * dist.get_world_size(group)
            dist.all_gather_object(out, value, group=group)
            value = [v for chunk in out for v in chunk]
        return value, order
    x = value.to(device)
    for group in groups:
        out = x.new_empty((dist.get_world_size(group) * x.numel(),))
        work = dist.all_gather_into_tensor(out, x, group=group, async_op=True)
        if timeout is None:
            work.wait()
        else:
            try:
                work.wait(timeout=timeout)
            except RuntimeError as exc:
                raise PlanMismatchError(
                    f"shard(): not every rank of the mesh reached the plan agreement within {timeout.total_seconds():g}s "
                    "(another rank probably failed before it: see that rank's error); the process group may be "
                    "unusable now"
                ) from exc
        x = out
    return x.view(-1, len(COMPONENTS)).cpu(), order


def agree(program: Program, timeout: timedelta | None = timedelta(minutes=5)) -> None:
    """Raise ``PlanMismatchError`` on every rank unless all ranks of the mesh decided the same."""
    if not dist.is_initialized() or dist.get_backend() == "fake":  # nothing to agree with (simulate)
        return
    described = describe(program)
    mine = torch.tensor([_digest(described[c]) for c in COMPONENTS], dtype=torch.int64)
    digests, order = _gather(mine, program.mesh, timeout)
    if bool((digests == digests[0]).all()):
        return
    everyone, _ = _gather([described], program.mesh, None)
    by_rank = dict(zip(order, everyone, strict=True))
    raise PlanMismatchError(_explain_mismatch(by_rank))


def _explain_mismatch(by_rank: dict[int, dict[str, dict[str, str]]]) -> str:
    """Which components and items differ, and the ranks holding each variant."""
    lines = ["shard(): ranks disagree on the sharding (same model, plan, mesh and library are needed on every rank):"]
    ranks = sorted(by_rank)
    for comp in COMPONENTS:
        items = sorted(set().union(*(by_rank[r][comp] for r in ranks)))
        shown = 0
        for item in items:
            variants: dict[str, list[int]] = {}
            for r in ranks:
                variants.setdefault(by_rank[r][comp].get(item, "<absent>"), []).append(r)
            if len(variants) > 1:
                if shown < 5:
                    seen = "; ".join(f"{v} on ranks {rs}" for v, rs in variants.items())
                    lines.append(f"  {comp} {item}: {seen}")
                shown += 1
        if shown > 5:
            lines.append(f"  ... and {shown - 5} more {comp} differences")
    return "\n".join(lines)
