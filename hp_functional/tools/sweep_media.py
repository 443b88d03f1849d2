"""The image side of a vision-language row of the support table (``sweep_inputs`` builds the rest).

The image layouts themselves (a patch grid, NaFlex and NaViT patches, any-resolution tiles, images
per sample, plain pixels, flattened patches: ``image_inputs``) are built from the config in
``analysis.media``, where ``auto_plan`` builds a tower's input from them too; they are re-exported
here for ``sweep_inputs``.  ``feature_count`` asks the model how many placeholder tokens one
sample's image fills (its ``get_image_features`` on those inputs), so the ids carry exactly that
many; ``token_inputs`` builds the per-token arguments a processor returns with them.
``IMAGE_INPUTS``: the image inputs of the types no layout fits (``sweep_inputs.EXTRA_INPUTS`` adds them).
"""

from __future__ import annotations

__all__ = ["IMAGE_INPUTS", "feature_count", "feature_rows", "find", "image_inputs", "token_inputs"]

import inspect
from typing import Any

import torch

from ..analysis.media import BATCH, find, image_inputs
from .model_configs import IMAGE, special_ids

_RENAMED = {"pixel_values_images": "pixel_values"}


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


def _merged_patches(config, gen: torch.Generator) -> dict[str, Any]:
    """Inkling 2's vision tower: a row per language-model token, its ``(merge x patch)²`` pixels by
    channels (its processor's layout), and each image's grid in those tokens (``1 x side x side``)."""
    side = config.spatial_merge_size * config.patch_size
    n = IMAGE // side
    return {"pixel_values": torch.randn((BATCH * n * n, side, side, config.num_channels), generator=gen),
            "image_grid_thw": torch.tensor([[1, n, n]] * BATCH)}


def _one_video(config, gen: torch.Generator) -> dict[str, Any]:
    """TVP: one sample (it views its column position embeddings with the batch size, so only a batch of
    one runs), ``num_frames`` frames at its ``max_img_size`` and 8 token ids."""
    allowed = torch.tensor([i for i in range(3, config.vocab_size) if i not in special_ids(config)])
    size = config.max_img_size
    return {"pixel_values": torch.randn((1, config.num_frames, 3, size, size), generator=gen),
            "input_ids": allowed[torch.randint(0, len(allowed), (1, 8), generator=gen)]}


#: model type -> ``(config, gen) -> image inputs`` where no layout of ``image_inputs`` fits
IMAGE_INPUTS: dict[str, Any] = {
    "efficientloftr": lambda c, g: {"pixel_values": torch.randn((BATCH, 2, 3, IMAGE, IMAGE), generator=g)},  # a pair
    "inkling2_vision": _merged_patches,
    "tvp": _one_video,
    # UVDoc's backbone downsamples 16x: twice the tiny side leaves 4 x 4 for its reflect-padded 5 x 5 head
    "uvdoc": lambda c, g: {"pixel_values": torch.randn((BATCH, 3, 2 * IMAGE, 2 * IMAGE), generator=g)},
}
