"""Weights from safetensors, read slice by slice: each rank reads only the boxes of its shards.

``open_weights(path)`` reads the headers of a single file, a folder with ``model.safetensors``
or a sharded checkpoint (``model.safetensors.index.json`` + parts) — every rank reads every
header, so a missing tensor, a wrong shape or a truncated file raises on every rank before any
collective; files are read only from inside the given folder (an index naming ``../x`` or an
absolute path is refused), and a folder with ``export_hf``'s checksum manifest is verified
tensor by tensor first (``weight_sums``).  ``read_local`` then reads each leaf's boxes (``core.placement.boxes``) through
``safe_open(...).get_slice``: a packed or vocab-parallel leaf is read as its slices, never whole,
and a tied group is read once.  Why safetensors' own reader: it memory-maps the file and reads a
slice without the rest, which is what makes a rank's peak its shards plus one slice.
"""

from __future__ import annotations

__all__ = [
    "WeightSource", "_fresh_copy", "init_fn_of", "open_weights", "read_buffers", "read_local", "recompute_buffers",
    "stored_names"
]

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ..core.errors import PlanError, ShapeError
from ..core.placement import ShardInfo, boxes
from ..core.program import Program
from .weight_sums import inside, verify_safetensors

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@dataclass(frozen=True)
class WeightSource:
    """The tensors of a safetensors checkpoint: name → (file, global shape, dtype)."""

    path: Path
    files: dict[str, Path]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]

    def fingerprint(self) -> str:
        """A digest of the names, shapes, dtypes and file sizes (ranks must read the same checkpoint)."""
        h = hashlib.sha256()
        for name in sorted(self.files):
            h.update(f"{name} {self.shapes[name]} {self.dtypes[name]} {os.path.getsize(self.files[name])}\n".encode())
        return h.hexdigest()[:16]


def _files_of(path: Path) -> list[Path]:
    """The safetensors files ``path`` names (a file, a folder, an index)."""
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.is_file():
            path = index
        elif (path / "model.safetensors").is_file():
            return [path / "model.safetensors"]
        else:
            raise PlanError(f"weights {path}: no model.safetensors or model.safetensors.index.json in this folder")
    if not path.is_file():
        raise PlanError(f"weights {path}: no such file or folder")
    if path.name.endswith(".index.json"):
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise PlanError(f"weights {path}: not a safetensors index (a JSON object with 'weight_map'): {exc}") from exc
        if not isinstance(weight_map, dict):
            raise PlanError(f"weights {path}: its weight_map is not a JSON object")
        files = sorted({inside(path.parent, f, f"weights {path}: weight_map entry {t!r}") for t, f in weight_map.items()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise PlanError(f"weights {path}: the index names files that do not exist: {missing[:3]}")
        return files
    return [path]


def open_weights(path: str | os.PathLike) -> WeightSource:
    """Read the headers of every file of a safetensors checkpoint (no tensor data); a PlanError
    naming the file when one is missing, not safetensors, or truncated."""
    from safetensors import SafetensorError, safe_open

    files, shapes, dtypes = {}, {}, {}
    found = _files_of(Path(path))
    verify_safetensors(Path(path) if Path(path).is_dir() else Path(path).parent, found)
    for file in found:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # safe_open is not a mapping
                    sl = f.get_slice(name)
                    files[name], shapes[name], dtypes[name] = file, tuple(sl.get_shape()), _DTYPES[sl.get_dtype()]
        except (SafetensorError, OSError) as exc:
            raise PlanError(f"weights {file}: cannot read it as safetensors (corrupt or partial file?): {exc}") from exc
    return WeightSource(Path(path), files, shapes, dtypes)


def stored_names(source: WeightSource, program: Program) -> dict[str, str]:
    """Leaf key → the name it is stored under: the key itself or one of its tied aliases (HF
    drops ``lm_head.weight`` when it is tied).  Raises naming every parameter the checkpoint
    lacks and every global shape that differs."""
    names, missing = {}, []
    for key, info in program.infos.items():
        found = next((n for n in (key, *info.aliases) if n in source.files), None)
        if found is None:
            missing.append(key)
            continue
        if source.shapes[found] != tuple(info.global_shape):
            raise ShapeError(f"weights {source.path}: {found} has shape {source.shapes[found]} in the checkpoint but the "
                             f"model's parameter {key} is {tuple(info.global_shape)}")
        _check_dtype(source, found, program.dtypes[key])
        names[key] = found
    if missing:
        raise PlanError(f"weights {source.path}: no tensor for parameters {missing[:5]}"
                        + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
                        + f"; the checkpoint has e.g. {sorted(source.files)[:3]}")
    return names


def _check_dtype(source: WeightSource, name: str, want: torch.dtype) -> None:
    have = source.dtypes[name]
    if have.is_floating_point != want.is_floating_point:
        raise PlanError(f"weights {source.path}: {name} is {have} in the checkpoint but {want} in the model")


def read_local(source: WeightSource, names: Mapping[str, str], infos: Mapping[str, ShardInfo],
               dtypes: Mapping[str, torch.dtype], device: torch.device) -> dict[str, Tensor]:
    """Each leaf's local shard, read box by box from its file and cast to the model's dtype."""
    from safetensors import safe_open

    out: dict[str, Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for key, name in names.items():
        by_file.setdefault(source.files[name], []).append(key)
    for file, keys in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for key in keys:
                info, stored = infos[key], f.get_slice(names[key])
                local = torch.empty(info.local_shape, dtype=dtypes[key], device=device)
                for box in boxes(info):
                    box.of_local(local).copy_(box.of_global(stored))
                out[key] = local
    return {key: out[key] for key in infos}


def read_buffers(source: WeightSource | None, model: nn.Module, device: torch.device) -> dict[str, Tensor]:
    """Every buffer of ``model`` with values: those in the checkpoint read whole (buffers are
    replicated), the meta ones it lacks recomputed by their module's own init (``recompute_buffers``)."""
    from safetensors import safe_open

    out, missing = {}, []
    for name, b in model.named_buffers():
        if source is not None and name in source.files:
            if source.shapes[name] != tuple(b.shape):
                raise ShapeError(f"weights {source.path}: buffer {name} has shape {source.shapes[name]} in the "
                                 f"checkpoint but {tuple(b.shape)} in the model")
            with safe_open(str(source.files[name]), framework="pt") as f:
                out[name] = f.get_tensor(name).to(device=device, dtype=b.dtype)
        elif b.device.type == "meta":
            missing.append(name)
        else:
            out[name] = b.detach().clone().to(device)
    return out | recompute_buffers(model, missing, device)


def init_fn_of(model: nn.Module, fqn: str):
    """The init that owns module ``fqn``: the nearest Hugging Face ``PreTrainedModel`` above it
    (its ``_init_weights(module)``, as HF's ``initialize_weights`` dispatches), else None."""
    parts = fqn.split(".") if fqn else []
    for i in range(len(parts), -1, -1):
        owner = model.get_submodule(".".join(parts[:i]))
        if hasattr(owner, "_init_weights") and hasattr(owner, "config"):
            return owner._init_weights
    return None


def recompute_buffers(model: nn.Module, names: list[str], device: torch.device) -> dict[str, Tensor]:
    """Values for meta buffers (rotary ``inv_freq`` and the like) from their module's own init,
    run on a private shallow copy of the module: HF's ``_init_weights``, else ``reset_parameters``
    (torch's convention for re-initialising a module).  A buffer that neither sets raises."""
    out: dict[str, Tensor] = {}
    by_owner: dict[str, list[str]] = {}
    for name in names:
        by_owner.setdefault(name.rpartition(".")[0], []).append(name.rpartition(".")[2])
    for fqn, attrs in by_owner.items():
        module = model.get_submodule(fqn)
        copy = _fresh_copy(module, {a: getattr(module, a) for a in attrs}, torch.device("cpu"))
        init = init_fn_of(model, fqn)
        with torch.no_grad():
            if init is not None:
                init(copy)
            elif hasattr(copy, "reset_parameters"):
                copy.reset_parameters()
        for a in attrs:
            value = copy._buffers[a]
            if value.is_floating_point() and bool(value.isnan().any()):
                raise PlanError(f"buffer {fqn + '.' + a if fqn else a} is on the meta device, not in the weights, and "
                                f"{type(module).__name__}'s init does not set it: pass weights= that hold it, or build "
                                "the model with buffers on a real device")
            out[f"{fqn}.{a}" if fqn else a] = value.to(device)
    return out


def _fresh_copy(module: nn.Module, tensors: Mapping[str, Tensor], device: torch.device) -> nn.Module:
    """A shallow copy of ``module`` whose ``tensors`` (its own params/buffers by name) are fresh
    NaN-filled tensors on ``device`` (an init that leaves one unset shows); the original and its
    children are untouched (the copy's dicts are new, its children shared and never written)."""
    import copy as _copy

    fresh = _copy.copy(module)
    fresh._parameters, fresh._buffers = dict(module._parameters), dict(module._buffers)
    for name, t in tensors.items():
        value = torch.empty(t.shape, dtype=t.dtype, device=device)
        if value.is_floating_point():
            value.fill_(float("nan"))
        if name in module._parameters:
            fresh._parameters[name] = nn.Parameter(value, requires_grad=t.requires_grad)
        else:
            fresh._buffers[name] = value
    return fresh
