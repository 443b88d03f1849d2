"""The image inputs of a vision-language row of the support table (``sweep_inputs`` builds the rest).

A vision-language model takes its pixels in one of a few layouts, which its ``forward``'s
signature and its config tell apart; ``image_inputs`` yields the candidates, the most specific
first, each the keyword arguments the model's image processor would have produced (``sweep_inputs``
keeps the first the unsharded model runs on):

- a patch grid (Qwen2-VL and its many descendants, GLM-4V, Kimi-K2.5, Ovis2.5, VideoLLaMA3,
  MiniMax-M3, Nemotron-H Omni): ``image_grid_thw`` (or ``image_grid_hw``) per image and the
  flattened patches, one row of ``channels x temporal_patch_size x patch_size²`` values per patch
  (or ``channels x patch_size²``, or ``(channels, patch, patch)`` for a per-patch ``Conv2d``), the
  grid a multiple of the spatial merge;
- NaFlex patches (SigLIP2: LFM2-VL): ``(batch, patches, channels x patch_size²)`` with
  ``spatial_shapes`` and a ``pixel_attention_mask`` per patch; NaViT-packed patches (MiniCPM-V):
  ``(1, channels, patch, patches x patch)`` with ``target_sizes``;
- any-resolution tiles (LLaVA-NeXT, LLaVA-OneVision): ``(batch, tiles, channels, H, W)`` with
  ``image_sizes``, the tile count the model's own ``image_size_to_num_patches``; a model that takes
  ``image_sizes`` with one image (Pixtral: Mistral3, LightOnOCR) gets ``(batch, channels, H, W)``;
- images per sample (Idefics2/3, SmolVLM, Idefics): ``(batch, 1, channels, H, W)`` (and its
  ``pixel_attention_mask``);
- plain ``(batch, channels, H, W)`` (a video: ``(batch, frames, channels, H, W)``); a second,
  high-resolution tower (DeepSeek-VL hybrid) gets ``high_res_pixel_values`` at its own size;
- ``flattened_patches`` (Pix2Struct, Kosmos-2.5): row and column (from 1), then the patch's values;
- last, a row of ``channels x patch_size²`` values per patch (Fuyu) and a token per
  ``(temporal_patch_size, patch, patch, channels)`` volume (Inkling).

``feature_count`` asks the model how many placeholder tokens one sample's image fills (its
``get_image_features`` on those inputs), so the ids carry exactly that many; ``token_inputs``
builds the per-token arguments a processor returns with them.
"""

from __future__ import annotations

__all__ = ["feature_count", "feature_rows", "find", "image_inputs", "token_inputs"]

import inspect
from collections.abc import Iterator
from typing import Any

import torch

BATCH = 2
_GRID = ("image_grid_thw", "image_grid_hw")
_MERGE = ("spatial_merge_size", "merge_kernel_size", "merge_size")
_RENAMED = {"pixel_values_images": "pixel_values"}


def find(config, *keys: str) -> Any:
    """The first of ``keys`` set on ``config`` or, failing that, on one of its sub-configs."""
    for key in keys:
        if getattr(config, key, None) is not None:
            return getattr(config, key)
    for name in sorted(n for n in vars(config) if n.endswith("config")):  # (a per-layer attribute refuses a read)
        sub = getattr(config, name, None)
        if hasattr(sub, "to_dict") and (found := find(sub, *keys)) is not None:
            return found
    return None


def _vision(config):
    """The vision tower's config (the config itself for a model without one)."""
    for key in ("vision_config", "vision_tower_config", "visual_config", "image_config"):
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            return sub
    return config


def _int(value: Any) -> int | None:
    """An int, the first of a pair (``merge_kernel_size: [2, 2]``), else None."""
    if isinstance(value, (list, tuple)) and value:
        value = value[0]
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _image_size(config) -> tuple[int, int]:
    size = find(config, "image_size", "img_size", "input_size") or 32
    return (size, size) if isinstance(size, int) else tuple(size)[-2:]


def _channels(config) -> int:
    return find(config, "num_channels", "in_channels", "in_chans") or 3


def _patch(config) -> int:
    return _int(find(_vision(config), "patch_size")) or 8


def image_inputs(model, config, params, key: str, gen: torch.Generator, video: bool) -> Iterator[dict[str, Any]]:
    """Candidate image arguments of ``model`` (its forward's ``params``; ``key``: the pixel argument),
    the most specific layout first (module docstring)."""
    vision = _vision(config)
    channels, patch, (h, w) = _channels(config), _patch(config), _image_size(config)
    if key == "flattened_patches":  # Pix2Struct, Kosmos-2.5: (row, column, patch values) per patch, from 1
        rows, cols = h // patch, w // patch
        width = find(vision, "patch_embed_hidden_size") or channels * patch * patch
        index = torch.tensor([[r + 1, c + 1] for r in range(rows) for c in range(cols)], dtype=torch.float)
        values = torch.randn((BATCH, rows * cols, width), generator=gen)
        yield {key: torch.cat([index.expand(BATCH, -1, -1), values], dim=-1)}
        return
    if key == "pixel_values" and any(g in params for g in _GRID):
        yield from _grid(model, config, params, gen)
    if key == "pixel_values" and "target_sizes" in params:  # MiniCPM-V: NaViT-packed, every patch side by side
        rows, cols = h // patch, w // patch
        yield {key: torch.randn((1, channels, patch, BATCH * rows * cols * patch), generator=gen),
               "target_sizes": torch.tensor([[rows, cols]] * BATCH)}
    if key == "pixel_values" and "spatial_shapes" in params:  # SigLIP2 NaFlex patches
        rows, cols = h // patch, w // patch
        yield {key: torch.randn((BATCH, rows * cols, channels * patch * patch), generator=gen),
               "spatial_shapes": torch.tensor([[rows, cols]] * BATCH),
               "pixel_attention_mask": torch.ones(BATCH, rows * cols, dtype=torch.bool)}
    sizes = torch.tensor([[h, w]] * BATCH) if "image_sizes" in params and not video else None
    tiles = _anyres_tiles(model, config, (h, w)) if sizes is not None else None
    if tiles:
        yield {key: torch.randn((BATCH, tiles, channels, h, w), generator=gen), "image_sizes": sizes}
    if "pixel_attention_mask" in params or "image_attention_mask" in params:  # images per sample
        extra = {"pixel_attention_mask": torch.ones(BATCH, 1, h, w, dtype=torch.bool)} \
            if "pixel_attention_mask" in params else {}
        yield {key: torch.randn((BATCH, 1, channels, h, w), generator=gen), **extra}
        if extra:  # Granite-Docling: a mask per tile, not per pixel
            yield {key: torch.randn((BATCH, 1, channels, h, w), generator=gen),
                   "pixel_attention_mask": torch.ones(BATCH, 1, dtype=torch.bool)}
    frames = (find(config, "num_frames", "frames_per_clip") or 2,) if video else ()
    plain = {key: torch.randn((BATCH, *frames, channels, h, w), generator=gen)}
    if "high_res_pixel_values" in params:  # DeepSeek-VL hybrid: a second tower at its own resolution
        hi = getattr(config, "high_res_vision_config", None)
        size = find(hi, "image_size") if hi is not None else None
        size = (size, size) if isinstance(size, int) else (2 * h, 2 * w)
        plain["high_res_pixel_values"] = torch.randn((BATCH, channels, *size), generator=gen)
    yield plain
    if sizes is not None:  # Pixtral (Mistral3, LightOnOCR) takes each image's size; LLaVA's CLIP tower does not
        yield {key: torch.randn((BATCH, channels, h, w), generator=gen), "image_sizes": sizes}
    if not video and "pixel_attention_mask" not in params:
        yield {key: torch.randn((BATCH, 1, channels, h, w), generator=gen)}
    if not video and key == "pixel_values":  # Fuyu: a row of channels x patch_size² values per patch
        yield {key: torch.randn((BATCH, (h // patch) * (w // patch), channels * patch * patch), generator=gen)}
    temporal = _int(find(vision, "temporal_patch_size"))
    if temporal and not any(g in params for g in _GRID):  # Inkling: a token per (time, patch, patch, channels) volume
        yield {key: torch.randn((BATCH * (h // patch) * (w // patch), temporal, patch, patch, channels), generator=gen)}


def _grid(model, config, params, gen: torch.Generator) -> Iterator[dict[str, Any]]:
    """Flattened patches and their grid: one image per sample, ``side x side`` patches (a multiple
    of the spatial merge), each row ``channels x temporal_patch_size x patch_size²`` values."""
    vision = _vision(config)
    channels, patch, (h, w) = _channels(config), _patch(config), _image_size(config)
    temporal = _int(find(vision, "temporal_patch_size")) or 1
    merge = _int(find(vision, *_MERGE)) or _int(find(config, *_MERGE)) or 2
    rows, cols = (-(-max(h // patch, merge) // merge) * merge, -(-max(w // patch, merge) // merge) * merge)
    grid_key = next(g for g in _GRID if g in params)
    grid = [1, rows, cols] if grid_key.endswith("thw") else [rows, cols]
    out: dict[str, Any] = {"image_grid_thw" if grid_key.endswith("thw") else grid_key: torch.tensor([grid] * BATCH)}
    if "image_merge_sizes" in params:  # VideoLLaMA3: the merge per image
        out["image_merge_sizes"] = torch.tensor([merge] * BATCH)
    n = BATCH * rows * cols
    for width in dict.fromkeys((channels * temporal * patch * patch, channels * patch * patch)):
        yield {"pixel_values": torch.randn((n, width), generator=gen), **out}
    yield {"pixel_values": torch.randn((n, channels, patch, patch), generator=gen), **out}  # a Conv2d per patch


def _anyres_tiles(model, config, size: tuple[int, int]) -> int | None:
    """The tile count of one image of ``size`` for an any-resolution model (LLaVA-NeXT's
    ``image_size_to_num_patches`` over its ``image_grid_pinpoints``), else None."""
    pinpoints = getattr(config, "image_grid_pinpoints", None)
    if not pinpoints:
        return None
    module = inspect.getmodule(type(model))
    count = getattr(module, "image_size_to_num_patches", None)
    if count is None:
        return None
    try:
        return int(count(image_size=size, grid_pinpoints=pinpoints, patch_size=_image_size(config)[0]))
    except Exception:  # noqa: BLE001 - pinpoints the tiny image size does not divide: no tiles
        return None


def feature_count(model, media: dict[str, Any]) -> int | None:
    """How many placeholder tokens one sample's image fills: the rows of ``model.get_image_features``
    on ``media`` over the batch, else None (no such method, or it fails on these inputs)."""
    get = getattr(model, "get_image_features", None)
    if get is None:
        return None
    try:
        names = inspect.signature(get).parameters
        # Video-LLaVA's forward names its images pixel_values_images, its get_image_features pixel_values
        kwargs = {k: v for k, v in ((_RENAMED.get(k, k), v) for k, v in media.items()) if k in names}
        if not any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in kwargs.values()):
            return None
        with torch.no_grad():
            out = get(**kwargs)
    except Exception:  # noqa: BLE001 - the mismatch message of a full forward corrects the count instead
        return None
    feats = getattr(out, "pooler_output", None)
    if feats is None:
        feats = out[0] if isinstance(out, tuple) and out and not isinstance(out[0], torch.Tensor) else out
    rows = feature_rows(feats)
    return rows // BATCH if rows and rows % BATCH == 0 else None


def feature_rows(feats) -> int:
    """Feature rows: a tensor's elements over its last dim, summed over a list of tensors."""
    if isinstance(feats, torch.Tensor):
        return feats.numel() // feats.shape[-1] if feats.dim() else 0
    if isinstance(feats, (list, tuple)):
        return sum(feature_rows(f) for f in feats)
    return 0


def token_inputs(model, params, ids: torch.Tensor, spans: dict[str, tuple[int, int]], image_count: int
                 ) -> dict[str, Any]:
    """Per-token arguments a processor returns with the ids: ``mm_token_type_ids`` (Qwen-VL's M-RoPE:
    1 on image tokens, 2 on video tokens), ``token_type_ids`` where they mark the image tokens
    (Gemma 3: 1 on image tokens, which attend each other both ways; PaliGemma's mark a prefix),
    ``image_embeds_position_mask`` (Kosmos-2) and ``image_attention_mask`` (Idefics: the images
    each token attends, ``(batch, seq, images)``); ``spans``: each modality's placeholder positions,
    ``image_count``: the images per sample (none: no images)."""
    out: dict[str, Any] = {}
    start, stop = spans.get("image", (0, 0))
    marks = torch.zeros_like(ids)
    marks[:, start:stop] = 1
    if "mm_token_type_ids" in params and spans:
        out["mm_token_type_ids"] = marks.clone()
    if "token_type_ids" in params and "image" in spans and _types_mark_images(model):
        out["token_type_ids"] = marks.clone()
    if "image_embeds_position_mask" in params and "image" in spans:
        out["image_embeds_position_mask"] = marks.clone()
    if "image_attention_mask" in params and image_count:
        out["image_attention_mask"] = torch.ones(*ids.shape, image_count, dtype=torch.long)
    return out


def _types_mark_images(model) -> bool:
    """Whether ``model``'s ``token_type_ids`` mark its image tokens with 1 (Gemma 3's modeling code
    builds its bidirectional image blocks from them: ``get_block_sequence_ids_for_mask``)."""
    return hasattr(inspect.getmodule(type(model)), "get_block_sequence_ids_for_mask")
