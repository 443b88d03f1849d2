"""How DCP sees this library's local shards: ``Boxed`` (a local shard with its boxes, as DTensor's
``_Checkpointable`` hooks present one), the save and load planners over flat dicts of them (extra's
bytes written and read raw), and async_save's stager (a CPU copy taken before ``save`` returns)."""

from __future__ import annotations

__all__ = ["Boxed", "LoadPlanner", "SavePlanner", "Stager"]

import io
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager

from ..core.placement import Box


class Boxed:
    """A local shard with its boxes and global shape, implementing DCP's ``_Checkpointable`` hooks
    (as DTensor does) so that every box is one chunk of the global tensor.  Not a Tensor, so DCP's
    ``find_state_dict_object`` (which calls the hooks of Tensors only) is bypassed: our planners
    look the boxes up themselves."""

    def __init__(self, local: Tensor, bxs: list[Box], global_shape: torch.Size):
        self.local, self.boxes, self.global_shape = local, bxs, torch.Size(global_shape)
        self._by_start = {b.start: b for b in bxs}

    def size(self) -> torch.Size:  # DCP's load plan compares it with the saved size
        return self.global_shape

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        props = TensorProperties.create_from_tensor(self.local)
        return [WriteItem(index=MetadataIndex(fqn, b.start), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(b.start), torch.Size(b.size)),
                                                      properties=props, size=self.global_shape))
                for b in self.boxes]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(b.start), torch.Size(b.size)) for b in self.boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> Tensor:
        return self._by_start[tuple(index.offset)].of_local(self.local)


class SavePlanner(DefaultSavePlanner):
    """The default planner (deduplication included) over a flat dict of ``Boxed`` and extra's bytes."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Boxed) else obj  # else: extra's bytes

    def transform_object(self, write_item: WriteItem, obj: Any) -> Any:
        # the default one pickles byte items (torch.save): extra's bytes are written as they are
        return io.BytesIO(obj) if write_item.type == WriteItemType.BYTE_IO else obj


class LoadPlanner(DefaultLoadPlanner):
    """The default planner over a flat dict of ``Boxed``; reads land in views of the local shards."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # the default one runs _init_state_dict, which replaces every non-tensor value with None
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        return self.state_dict[index.fqn].__get_tensor_shard__(index)

    def load_bytes(self, read_item, value) -> None:
        # the default one unpickles them (weights_only=False): kept raw, decoded by ckpt_extra
        self.state_dict[read_item.dest_index.fqn] = value.read()


class Stager(AsyncStager):
    """async_save's staging: a CPU copy of every local shard, taken before ``save`` returns, so
    training may write to its tensors while the thread writes the copy."""

    # AsyncStager's own switch (a class attribute): False, so async_save does not call the deprecated
    # synchronize_staging; stage() is synchronous anyway
    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {k: Boxed(v.local.detach().to("cpu", copy=True), v.boxes, v.global_shape) if isinstance(v, Boxed) else v
                for k, v in state_dict.items()}

    def close(self) -> None:
        pass
