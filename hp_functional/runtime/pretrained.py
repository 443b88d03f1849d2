"""``from_pretrained``: a saved Hugging Face model straight to its shards, never whole on any rank.

It reads ``config.json``, builds the model on the meta device (no memory), takes the plan the
model declares (``ShardingPlan.from_hf``) unless one is given, and calls ``shard(...,
weights=path)``, so each rank reads only its slices of the safetensors files.  Nothing is
downloaded: ``path`` is a local folder (``save_pretrained``'s or ``export_hf``'s output); only
files inside it are read, and ``export_hf``'s checksum manifest, when present, is verified
(``config.json`` here, every tensor in ``open_weights``) before anything is used.
"""

from __future__ import annotations

__all__ = ["from_pretrained"]

import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ..core.errors import PlanError
from ..core.placement import ShardInfo
from ..plan.plan import ShardingPlan
from .apply_fn import ApplyFn
from .shard import shard
from .weight_sums import verify_files


def from_pretrained(
    path: str | os.PathLike, plan: ShardingPlan | Mapping | None = None, mesh: DeviceMesh | None = None,
    torch_dtype: torch.dtype | None = None, *, tp_axis: str | None = None, model_class=None, **shard_kwargs,
) -> tuple[ApplyFn, dict[str, Tensor], dict[str, ShardInfo], object]:
    """``shard(model, plan, mesh, weights=path)`` for the HF model saved in folder ``path``.

    Args:
        path: a local ``save_pretrained``/``export_hf`` folder.
        plan: None for the plan the model declares (``ShardingPlan.from_hf``).
        mesh: the device mesh (required).
        torch_dtype: the parameters' dtype (None: the config's ``dtype``, else float32); the
            checkpoint's values are cast to it.
        tp_axis: the mesh axis of ``from_hf``'s plan (None: ``"tp"``, or the mesh's only axis).
        model_class: default ``AutoModelForCausalLM``.
        shard_kwargs: go to ``shard`` (``remat``, ``agree_timeout``, ...).

    Returns:
        ``(apply_fn, params, shard_info, config)``: ``shard()``'s three results and the model's
        config (the model itself is built here, on meta, and not returned).
    """
    if not isinstance(mesh, DeviceMesh):
        given = " (the plan's place holds one: the order is shard's, pass mesh=mesh)" if isinstance(plan, DeviceMesh) else ""
        raise TypeError(f"from_pretrained(path, plan, mesh): mesh must be a DeviceMesh, got {type(mesh).__name__}{given}")
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise PlanError(f"from_pretrained: {folder} has no config.json (expected a save_pretrained folder)")
    verify_files(folder, ["config.json"])
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    dtype = torch_dtype or _config_dtype(config)
    with torch.device("meta"):
        model = (model_class or AutoModelForCausalLM).from_config(config, dtype=dtype)
    if plan is None:
        names = mesh.mesh_dim_names or ()
        axis = tp_axis or ("tp" if "tp" in names or len(names) != 1 else names[0])
        plan = ShardingPlan.from_hf(model, tp_axis=axis)
    apply_fn, params, shard_info = shard(model, plan, mesh, weights=folder, **shard_kwargs)
    return apply_fn, params, shard_info, model.config


def _config_dtype(config) -> torch.dtype:
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else torch.float32
