"""Image and audio inputs built from a model's config and a forward's signature: what its image
processor or feature extractor would have produced, at the config's sizes, random values.

``auto_plan`` traces a vision or audio tower the example batch did not reach on these
(``analysis.towers``); the support table's rows feed them to the whole model
(``tools.sweep_inputs``).  Nothing here runs a model except ``image_inputs``' tile count, which
asks the model's own module for it.

**Images** — ``image_inputs`` yields the candidates, the most specific first, each the keyword
arguments of one layout (the caller keeps the first the model runs on):

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

**Audio** — ``audio_inputs`` yields the candidates of the audio argument, the most specific first,
each with the masks its feature extractor returns alongside:

- ``input_values``: ``SAMPLES`` of raw audio per sample, ``(batch, samples)`` (wav2vec2) then
  ``(batch, 1, samples)`` (OmniASR's single channel);
- ``input_features``: Whisper's ``(batch, mel bins, 2 x max_source_positions)`` (the length its
  encoder insists on), a length that is a multiple of the encoder's chunk (``2 x n_window``:
  Qwen3-ASR), then ``(batch, frames, features)`` and ``(batch, mel bins, frames)`` (a CTC head
  gets ``4 x`` the frames: its labels need more frames than tokens after the subsampling);
- ``audio_input_ids``: an audio codec's codes, ``(batch, frames, codebooks)`` below its
  ``codebook_size`` (Higgs Audio).

Each first with the masks of ones the forward takes: ``feature_attention_mask`` (Qwen2-Audio) or
``input_features_mask`` (GLM-ASR, AudioFlamingo3, Qwen3-ASR) over the frames, ``padding_mask``
over the raw samples (OmniASR; an audio LM's with its features: MOSS), a boolean
``audio_input_ids_mask``; then without the optional ones (Granite Speech's ``input_features_mask``
selects projected features, not frames); then, for a speech model without token ids, with an
``attention_mask`` over the frames too (the feature extractor's, which Parakeet's CTC loss reads
its lengths from).
"""

from __future__ import annotations

__all__ = ["AUDIO_KEYS", "AUDIO_MASKS", "BATCH", "IMAGE_KEYS", "audio_inputs", "find", "image_inputs"]

import inspect
from collections.abc import Iterator
from typing import Any

import torch

BATCH, SAMPLES, FRAMES, CODE_FRAMES = 2, 400, 16, 4
#: a forward's pixel argument, the first it takes (Video-LLaVA: images before videos)
IMAGE_KEYS = ("pixel_values", "pixel_values_images", "pixel_values_videos", "flattened_patches")
#: a forward's audio argument, the first it takes
AUDIO_KEYS = ("input_features", "input_values", "audio_input_ids")
#: the masks over an audio argument's frames a forward may take, per argument
AUDIO_MASKS = {"input_features": ("feature_attention_mask", "input_features_mask"), "input_values": ("padding_mask",),
               "audio_input_ids": ("audio_input_ids_mask",)}
#: masks that select by boolean indexing (a long mask would gather rows 0 and 1 instead)
_BOOL = ("audio_input_ids_mask",)
_GRID = ("image_grid_thw", "image_grid_hw", "grid_thw")  # grid_thw: a Qwen-VL-style tower's own forward
_MERGE = ("spatial_merge_size", "merge_kernel_size", "merge_size")


def find(config, *keys: str) -> Any:
    """The first of ``keys`` set on ``config`` or, failing that, on one of its sub-configs."""
    for key in keys:
        if (value := _get(config, key)) is not None:
            return value
    for name in sorted(n for n in vars(config) if n.endswith("config")):
        sub = _get(config, name)
        if hasattr(sub, "to_dict") and (found := find(sub, *keys)) is not None:
            return found
    return None


def _get(config, key: str) -> Any:
    """``config.key`` (its ``attribute_map`` aliases included), else None; a per-layer field of a
    heterogeneous config refuses a global read with its own error: None too."""
    try:
        return getattr(config, key, None)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError
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
    if key in ("pixel_values", "hidden_states") and any(g in params for g in _GRID):  # hidden_states: a tower's own
        yield from _grid(config, params, gen, key)
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


def _grid(config, params, gen: torch.Generator, key: str = "pixel_values") -> Iterator[dict[str, Any]]:
    """Flattened patches and their grid: one image per sample, ``side x side`` patches (a multiple
    of the spatial merge), each row ``channels x temporal_patch_size x patch_size²`` values."""
    vision = _vision(config)
    channels, patch, (h, w) = _channels(config), _patch(config), _image_size(config)
    temporal = _int(find(vision, "temporal_patch_size", "patch_temporal")) or 1
    merge = _int(find(vision, *_MERGE)) or _int(find(config, *_MERGE)) or 2
    rows, cols = (-(-max(h // patch, merge) // merge) * merge, -(-max(w // patch, merge) // merge) * merge)
    grid_key = next(g for g in _GRID if g in params)
    grid = [1, rows, cols] if grid_key.endswith("thw") else [rows, cols]
    out: dict[str, Any] = {grid_key: torch.tensor([grid] * BATCH)}
    for name in ("image_merge_sizes", "merge_sizes"):  # VideoLLaMA3 (and its tower): the merge per image
        if name in params:
            out[name] = torch.tensor([merge] * BATCH)
    n = BATCH * rows * cols
    for width in dict.fromkeys((channels * temporal * patch * patch, channels * patch * patch)):
        yield {key: torch.randn((n, width), generator=gen), **out}
    yield {key: torch.randn((n, channels, patch, patch), generator=gen), **out}  # a Conv2d per patch


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


def audio_inputs(config, params, key: str, gen: torch.Generator) -> Iterator[dict[str, Any]]:
    """Candidate audio arguments for the forward argument ``key`` (a forward's ``params``), each
    with its frame masks (module docstring), the most specific first."""
    for tensor, frames in _audio_tensors(config, key, gen):
        masks = {name: torch.ones(BATCH, tensor.shape[frames], dtype=torch.bool if name in _BOOL else torch.long)
                 for name in AUDIO_MASKS.get(key, ()) if name in params}
        if key == "input_features" and "padding_mask" in params and "input_ids" in params:  # MOSS: the raw audio
            masks["padding_mask"] = torch.ones(BATCH, SAMPLES, dtype=torch.long)
        yield {key: tensor, **masks}
        if masks and all(params[name].default is not inspect.Parameter.empty for name in masks):
            yield {key: tensor}
        if "attention_mask" in params and "input_ids" not in params:  # a speech model's frames (Parakeet CTC's lengths)
            yield {key: tensor, **masks, "attention_mask": torch.ones(BATCH, tensor.shape[frames], dtype=torch.long)}


def _audio_tensors(config, key: str, gen: torch.Generator) -> Iterator[tuple[torch.Tensor, int]]:
    """``(audio tensor, the dim of its frames)`` candidates for ``key``."""
    if key == "audio_input_ids":  # an audio codec's codes per frame and codebook (Higgs Audio)
        codebooks, size = find(config, "num_codebooks", "audio_num_codebooks"), find(config, "codebook_size")
        if isinstance(codebooks, int) and isinstance(size, int):
            yield torch.randint(0, size, (BATCH, CODE_FRAMES, codebooks), generator=gen), 1
        return
    if key == "input_values":
        yield torch.randn((BATCH, SAMPLES), generator=gen), 1
        yield torch.randn((BATCH, 1, SAMPLES), generator=gen), 2
        return
    mel = find(config, "num_mel_bins", "n_mels", "feature_size", "input_feat_per_channel")
    positions = find(config, "max_source_positions")
    if mel and positions:
        yield torch.randn((BATCH, mel, 2 * positions), generator=gen), 2
    window = find(config, "n_window")
    if mel and isinstance(window, int) and not isinstance(window, bool) and window > 0:
        yield torch.randn((BATCH, mel, 2 * window), generator=gen), 2
    feat = find(config, "input_feat_per_channel")
    feat = feat * (find(config, "input_channels") or 1) if feat else mel or find(config, "hidden_size") or 80
    feat = find(config, "feature_projection_input_dim") or feat  # W2V-BERT: stacked mel frames
    # a CTC head needs more frames left after the encoder's subsampling (Parakeet's 8x) than label tokens
    frames = FRAMES * (4 if find(config, "ctc_loss_reduction") is not None else 1)
    yield torch.randn((BATCH, frames, feat), generator=gen), 1
    if mel:
        yield torch.randn((BATCH, mel, frames), generator=gen), 2
