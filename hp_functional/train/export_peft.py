"""``export_peft``: the trained adapters of a sharded peft model, written as peft's ``save_pretrained``
writes them (``adapter_model.safetensors`` + ``adapter_config.json``), so that
``PeftModel.from_pretrained(base_model, out_dir)`` loads them.  The inverse: that load, then
``shard()`` of the loaded model.

Which tensors peft saves, and under which names, is peft's own answer
(``get_peft_model_state_dict`` on the model's parameters, by identity), never a key mapping of
ours.  As ``export_hf``: the adapters are gathered through the mesh's first rank bucket by bucket
(``core.gather.iter_full``), written into ``<out_dir>.hpf-partial`` with a checksum manifest
(``hpf_checksums.json``), then renamed onto ``out_dir``; a writer's failure raises on every rank.
The user's model and its peft config are only read (the config written is a copy).
See docs/adapters.md#export.
"""

from __future__ import annotations

__all__ = ["export_peft"]

import copy
import os
from collections.abc import Mapping
from pathlib import Path

import torch.distributed as dist
from torch import Tensor, nn

from ..core.errors import PlanError, ShapeError
from ..core.gather import check_gatherable, iter_full, plan_buckets
from ..core.placement import ShardInfo
from ..runtime.weight_sums import MANIFEST, write_manifest
from ..sources.peft import is_peft_model
from .ckpt_files import SCRATCH, check_targets, prepare_scratch, replace_dir, untag
from .export import agree_writer, parse_size

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"  # peft's file names


def saved_names(peft_model: nn.Module, adapter_name: str, save_embedding_layers: bool | str) -> dict[str, str]:
    """peft's saved key → the model's parameter (or buffer) name, for ``adapter_name``: what
    ``get_peft_model_state_dict`` returns of the model's own tensors, matched back by identity."""
    from peft import get_peft_model_state_dict

    if not is_peft_model(peft_model):
        raise PlanError(f"export_peft: {type(peft_model).__name__} is not a peft PeftModel (pass the PeftModel the "
                        "params were sharded from; a plain model: hpf.export_hf)")
    if adapter_name not in peft_model.peft_config:
        raise PlanError(f"export_peft: no adapter {adapter_name!r}; the model has {sorted(peft_model.peft_config)}")
    state = peft_model.state_dict(keep_vars=True)
    first: dict[int, str] = {}
    for name, tensor in state.items():
        first.setdefault(id(tensor), name)
    saved = get_peft_model_state_dict(peft_model, state_dict=state, adapter_name=adapter_name,
                                      save_embedding_layers=save_embedding_layers)
    return {key: first[id(tensor)] for key, tensor in saved.items()}


def _leaves(names: Mapping[str, str], params: Mapping[str, Tensor], shard_info: Mapping[str, ShardInfo],
            model: nn.Module) -> dict[str, str]:
    """Each saved model name → the params key that holds it (itself, or the tied group it aliases);
    a ``PlanError`` naming what params lack, a ``ShapeError`` where the layouts disagree with the model."""
    owner = {a: k for k, i in shard_info.items() for a in (k, *i.aliases)}
    own = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for name in names.values():
        key = owner.get(name)
        if name not in own:
            raise PlanError(f"export_peft: peft saves {name!r}, which is not a parameter of {type(model).__name__}")
        if key is None or key not in params:
            raise PlanError(f"export_peft: params lack {name!r}, which peft saves (pass the params and shard_info of "
                            "this model's shard(), or of hpf.fsdp over it)")
        if tuple(shard_info[key].global_shape) != tuple(own[name].shape):
            raise ShapeError(f"export_peft: {key} is {tuple(shard_info[key].global_shape)} in shard_info but "
                             f"{tuple(own[name].shape)} in {type(model).__name__}")
        out[name] = key
    return out


def export_peft(params: Mapping[str, Tensor], shard_info: Mapping[str, ShardInfo], peft_model: nn.Module,
                out_dir: str | os.PathLike, *, adapter_name: str = "default", save_embedding_layers: bool | str = "auto",
                bucket_size: int | str = "1GB") -> Path:
    """Write ``adapter_name``'s trained adapters of ``peft_model`` to ``out_dir`` in peft's format (a
    collective: call on every rank), so ``PeftModel.from_pretrained(base_model, out_dir)`` loads them.

    Args:
        params, shard_info: the sharded pytree and its layouts (``shard()``'s or ``fsdp``'s) of ``peft_model``;
            only the tensors peft saves are gathered.
        peft_model: the ``PeftModel`` they came from (only read: names, its peft config).
        out_dir: the adapter's folder: new, empty or an earlier export (anything else: ``CheckpointError`` on every
            rank, before anything is written).  One adapter per folder; peft's ``save_pretrained`` puts an adapter
            other than ``"default"`` in a subfolder of its own name.
        adapter_name: the adapter to write.
        save_embedding_layers: as peft's ``save_pretrained`` (``"auto"``: the embeddings too where LoRA targets them).
        bucket_size: the most bytes gathered at once (the writer holds every adapter tensor until the one file is
            written, as peft does).

    Returns:
        ``out_dir`` as a ``Path``, once the export is visible there.
    """
    out = Path(out_dir)
    names = saved_names(peft_model, adapter_name, save_embedding_layers)
    leaves = _leaves(names, params, shard_info, peft_model)
    keys = list(dict.fromkeys(leaves.values()))
    sub, infos = {k: params[k] for k in keys}, {k: shard_info[k] for k in keys}
    check_gatherable(sub, infos, "export_peft")
    check_targets(str(out), MANIFEST, "export", "export_peft")
    mesh = next(iter(shard_info.values())).mesh
    writer = _Writer(out) if dist.get_rank() == int(mesh.mesh.min()) else None
    if writer is not None:
        writer.run(writer.prepare)
    agree_writer(writer.error if writer else None, mesh, "export_peft")
    for full in iter_full(sub, infos, plan_buckets(sub, infos, parse_size(bucket_size))):
        if writer is not None and writer.error is None:
            writer.tensors.update({k: t.detach().cpu() for k, t in full.items()})
        del full
    if writer is not None and writer.error is None:
        writer.run(writer.finish, {key: leaves[name] for key, name in names.items()}, peft_model, adapter_name)
    agree_writer(writer.error if writer else None, mesh, "export_peft")
    return out


class _Writer:
    """The mesh's first rank's side: the gathered adapters kept, then written under peft's names
    with a copy of the adapter's config into ``<out>.hpf-partial``, checksummed, renamed onto ``out``.
    A failure is kept (``error``) until every rank has heard of it (``agree_writer``)."""

    def __init__(self, out: Path):
        self.out, self.tmp = out, out.with_name(out.name + SCRATCH)
        self.tensors: dict[str, Tensor] = {}
        self.error: Exception | None = None

    def run(self, step, *args) -> None:
        try:
            step(*args)
        except Exception as exc:  # noqa: BLE001 - kept and told to every rank, so none waits for a writer that gave up
            self.error = exc

    def prepare(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        prepare_scratch(str(self.tmp), MANIFEST, "export_peft")

    def finish(self, keys: Mapping[str, str], peft_model: nn.Module, adapter_name: str) -> None:
        from safetensors.torch import save_file

        # one tensor per saved name (peft clones the ones that share storage, safetensors refuses shared ones)
        tensors = {key: self.tensors[leaf].clone().contiguous() for key, leaf in keys.items()}
        save_file(tensors, str(self.tmp / WEIGHTS), metadata={"format": "pt"})
        _write_config(peft_model, adapter_name, self.tmp)
        untag(str(self.tmp))
        write_manifest(self.tmp)
        replace_dir(self.tmp, self.out, MANIFEST, "export", "export_peft")


def _write_config(peft_model: nn.Module, adapter_name: str, folder: Path) -> None:
    """``adapter_config.json`` as peft's ``save_pretrained`` writes it, from a copy of the adapter's
    config (the user's is not touched): the base model's name, ``inference_mode=True``, and the
    base model's class where the config has no task type."""
    config = copy.deepcopy(peft_model.peft_config[adapter_name])
    base = peft_model.base_model if config.is_prompt_learning else peft_model.base_model.model
    if config.base_model_name_or_path is None:
        config.base_model_name_or_path = base.__dict__.get("name_or_path", None) or None
    config.inference_mode = True
    mapping = None if config.task_type is not None else {
        "base_model_class": type(base).__name__, "parent_library": type(base).__module__}
    config.save_pretrained(str(folder), auto_mapping_dict=mapping)

