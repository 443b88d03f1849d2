"""``export_hf``: the sharded params back to a Hugging Face folder, one bucket at a time through rank 0.

The inverse of ``hpf.from_pretrained``: full safetensors (``model.safetensors``, or parts plus
``model.safetensors.index.json`` past ``max_shard_size``) and the config, so
``AutoModelForCausalLM.from_pretrained(out_dir)`` reloads the unsharded model.  Each part is one
bucket of ``core.gather.iter_full`` (a few collectives per part, never one per tensor), written
by the mesh's first rank and dropped before the next: no rank holds the whole model.  It writes into
``<out_dir>.hpf-partial``, then a checksum manifest of every file and tensor
(``hpf_checksums.json``, verified by ``from_pretrained``), and renames it onto ``out_dir``, so a
crash leaves no half-written export; every rank returns once it is visible, and a failure of the
writer (a full disk) raises on every rank instead of leaving them waiting.  An existing
``out_dir`` is replaced only when it is empty or an earlier export (``ckpt_files``).
"""

from __future__ import annotations

__all__ = ["agree_writer", "export_hf", "parse_size"]

import copy
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..core.errors import CheckpointError, PlanError, ShapeError
from ..core.gather import check_gatherable, iter_full, plan_buckets
from ..core.host_comm import gather_objects
from ..core.placement import ShardInfo
from ..runtime.weight_sums import MANIFEST, write_manifest
from ..runtime.weights import read_buffers
from .ckpt_files import SCRATCH, check_targets, prepare_scratch, replace_dir, untag

_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}


def parse_size(size: int | str) -> int:
    """Bytes of ``5GB`` / ``500MiB`` / an int (HF's ``max_shard_size`` convention: 1 GB = 10^9 B)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)\s*", size.upper())
    if not m:
        raise PlanError(f"export_hf: max_shard_size {size!r} is not a size such as '5GB', '500MiB' or an int of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _stored_name(key: str, info: ShardInfo, model: nn.Module) -> str:
    """The name HF stores a tied group under (``_tied_weights_keys`` maps a tied copy to its
    source; only a group that is tied in this model, i.e. has aliases, is renamed)."""
    tied = getattr(model, "_tied_weights_keys", None)
    return tied[key] if isinstance(tied, Mapping) and tied.get(key) in info.aliases else key


def _check(params: Mapping[str, Tensor], shard_info: Mapping[str, ShardInfo], model: nn.Module) -> None:
    if not shard_info:
        raise PlanError(f"export_hf: shard_info is empty: nothing to export of {type(model).__name__}")
    check_gatherable(params, shard_info, "export_hf")
    own = dict(model.named_parameters(remove_duplicate=False))
    for key, info in shard_info.items():
        if key not in params:
            raise PlanError(f"export_hf: parameter {key} has a shard_info but is not in params")
        if key not in own:
            raise PlanError(f"export_hf: {key} is not a parameter of {type(model).__name__} (pass the model they came from)")
        if tuple(own[key].shape) != tuple(info.global_shape):
            raise ShapeError(f"export_hf: {key} is {tuple(info.global_shape)} in shard_info but {tuple(own[key].shape)} "
                             f"in {type(model).__name__}")
    covered = {a for k in params for a in (k, *shard_info[k].aliases)}
    missing = sorted(set(own) - covered)
    if missing:
        raise PlanError(f"export_hf: params lack parameters {missing[:5]} of {type(model).__name__}")


def export_hf(params: Mapping[str, Tensor], shard_info: Mapping[str, ShardInfo], model: nn.Module,
              out_dir: str | os.PathLike, *, max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None) -> Path:
    """Write the full model to ``out_dir`` as Hugging Face safetensors plus ``model.config``
    (a collective: call on every rank), so ``AutoModelForCausalLM.from_pretrained(out_dir)``
    reloads it.  The inverse of ``hpf.from_pretrained``.

    Args:
        params, shard_info: the sharded pytree and its layouts (``shard()``'s or ``fsdp``'s), covering every
            parameter of ``model``.
        model: the model they came from, for the names, tied keys, persistent buffers and config; it may be
            on the meta device (meta persistent buffers are recomputed by their module's init).
        out_dir: the folder to write: new, empty or an earlier export (anything else: ``CheckpointError`` on
            every rank, before anything is written).
        max_shard_size: the size cap of one safetensors part, in the params' own dtype (``"5GB"``, ``"500MiB"`` or
            bytes; 1 GB = 10^9 B, as HF; a larger tensor is a part alone); past it, parts plus an index.
        dtype: the dtype floating tensors are cast to on the way out, also written in the config (None: theirs).

    Returns:
        ``out_dir`` as a ``Path``, once the export is visible there.
    """
    out = Path(out_dir)
    _check(params, shard_info, model)
    check_targets(str(out), MANIFEST, "export", "export_hf")
    limit = parse_size(max_shard_size)
    buckets = plan_buckets(params, shard_info, limit)
    mesh = next(iter(shard_info.values())).mesh
    persistent = set(model.state_dict()) - {n for n, _ in model.named_parameters(remove_duplicate=False)}
    buffers = {n: b for n, b in read_buffers(None, model, torch.device("cpu")).items() if n in persistent}
    writer = _Writer(out, len(buckets) + bool(buffers), dtype) if dist.get_rank() == int(mesh.mesh.min()) else None
    if writer is not None:
        writer.run(writer.prepare)
    agree_writer(writer.error if writer else None, mesh)
    for i, full in enumerate(iter_full(params, shard_info, buckets)):  # the others gather with it, even after a failure
        if writer is not None and writer.error is None:
            writer.run(writer.write, i, {_stored_name(k, shard_info[k], model): t for k, t in full.items()})
        del full
    if writer is not None and writer.error is None:
        writer.run(writer.finish, buffers, model)
    agree_writer(writer.error if writer else None, mesh)
    return out


class _Writer:
    """The mesh's first rank's side of an export: the parts into ``<out>.hpf-partial``, then the
    index, configs and manifest, then the rename onto ``out``.  A failure is kept (``error``), not
    raised, until every rank has heard of it (``agree_writer``)."""

    def __init__(self, out: Path, parts: int, dtype: torch.dtype | None):
        self.out, self.parts, self.dtype = out, parts, dtype
        self.tmp = out.with_name(out.name + SCRATCH)
        self.weight_map: dict[str, str] = {}
        self.total = 0
        self.error: Exception | None = None

    def run(self, step, *args) -> None:
        try:
            step(*args)
        except Exception as exc:  # noqa: BLE001 - kept and told to every rank, so none waits for a writer that gave up
            self.error = exc

    def prepare(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        prepare_scratch(str(self.tmp), MANIFEST, "export_hf")

    def write(self, i: int, tensors: dict[str, Tensor]) -> None:
        from safetensors.torch import save_file

        file = "model.safetensors" if self.parts == 1 else f"model-{i + 1:05d}-of-{self.parts:05d}.safetensors"
        cast = {n: (t.to(self.dtype) if self.dtype is not None and t.is_floating_point() else t).contiguous().cpu()
                for n, t in tensors.items()}
        save_file(cast, str(self.tmp / file), metadata={"format": "pt"})
        self.weight_map.update(dict.fromkeys(cast, file))
        self.total += sum(t.numel() * t.element_size() for t in cast.values())

    def finish(self, buffers: dict[str, Tensor], model: nn.Module) -> None:
        if buffers:
            self.write(self.parts - 1, buffers)
        if self.parts > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(self.weight_map.items()))}
            (self.tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        _write_configs(model, self.tmp, self.dtype)
        untag(str(self.tmp))
        write_manifest(self.tmp)
        replace_dir(self.tmp, self.out, MANIFEST, "export", "export_hf")


def agree_writer(error: Exception | None, mesh, where: str = "export_hf") -> None:
    """Every rank of ``mesh`` learns whether the writer failed (one object gather, also the
    barrier): the writer raises its own error, every other rank a ``CheckpointError`` naming it
    (``where``: the exporting function, for the message)."""
    reports = gather_objects(None if error is None else f"{type(error).__name__}: {error}", mesh)
    failed = next((r for r in reports if r is not None), None)
    if error is not None:
        raise error
    if failed is not None:
        raise CheckpointError(f"{where}: the writing rank failed, nothing was exported: {failed}")


def _write_configs(model: nn.Module, folder: Path, dtype: torch.dtype | None) -> None:
    """The model's config (a copy with ``dtype`` if given: the user's is not touched) and generation config."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config = copy.deepcopy(config)
        if dtype is not None:
            config.dtype = dtype
        config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
