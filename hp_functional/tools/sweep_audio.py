"""The audio inputs of a speech or audio-language row of the support table (``sweep_inputs`` builds the rest).

``audio_inputs`` yields the candidate keyword arguments of the model's audio argument, the most
specific first, each with the masks its feature extractor returns alongside:

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
over the raw samples (OmniASR; an audio LM's with its features: MOSS), a boolean ``audio_input_ids_mask``; then without the
optional ones (Granite Speech's ``input_features_mask`` selects projected features, not frames);
then, for a speech model without token ids, with an ``attention_mask`` over the frames too (the
feature extractor's, which Parakeet's CTC loss reads its lengths from).

``audio_count`` asks the model how many placeholder tokens one sample's audio fills (the rows of
its ``get_audio_features``, else its audio tower's ``_get_feat_extract_output_lengths``; one per
frame of codes), so the ids carry exactly that many, as the processor writes them.
"""

from __future__ import annotations

__all__ = ["audio_count", "audio_inputs"]

import inspect
from collections.abc import Iterator
from typing import Any

import torch

from .sweep_media import feature_rows

BATCH, SAMPLES, FRAMES, CODE_FRAMES = 2, 400, 16, 4
#: the masks over an audio argument's frames a forward may take, per argument
_MASKS = {"input_features": ("feature_attention_mask", "input_features_mask"), "input_values": ("padding_mask",),
          "audio_input_ids": ("audio_input_ids_mask",)}
#: masks that select by boolean indexing (a long mask would gather rows 0 and 1 instead)
_BOOL = ("audio_input_ids_mask",)


def _find(config, *keys: str) -> Any:
    """The first of ``keys`` set on ``config`` or, failing that, on one of its sub-configs."""
    for key in keys:
        if (value := _get(config, key)) is not None:
            return value
    for name in sorted(vars(config)):
        sub = vars(config)[name]
        if name.endswith("config") and hasattr(sub, "to_dict") and (found := _find(sub, *keys)) is not None:
            return found
    return None


def _get(config, key: str) -> Any:
    """``config.key`` (its ``attribute_map`` aliases included), else None; a per-layer field of a
    heterogeneous config refuses a global read with its own error: None too."""
    try:
        return getattr(config, key, None)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError
        return None


def audio_inputs(config, params, key: str, gen: torch.Generator) -> Iterator[dict[str, Any]]:
    """Candidate audio arguments for the forward argument ``key`` (a forward's ``params``), each
    with its frame masks (module docstring), the most specific first."""
    for tensor, frames in _tensors(config, key, gen):
        masks = {name: torch.ones(BATCH, tensor.shape[frames], dtype=torch.bool if name in _BOOL else torch.long)
                 for name in _MASKS.get(key, ()) if name in params}
        if key == "input_features" and "padding_mask" in params and "input_ids" in params:  # MOSS: the raw audio
            masks["padding_mask"] = torch.ones(BATCH, SAMPLES, dtype=torch.long)
        yield {key: tensor, **masks}
        if masks and all(params[name].default is not inspect.Parameter.empty for name in masks):
            yield {key: tensor}
        if "attention_mask" in params and "input_ids" not in params:  # a speech model's frames (Parakeet CTC's lengths)
            yield {key: tensor, **masks, "attention_mask": torch.ones(BATCH, tensor.shape[frames], dtype=torch.long)}


def _tensors(config, key: str, gen: torch.Generator) -> Iterator[tuple[torch.Tensor, int]]:
    """``(audio tensor, the dim of its frames)`` candidates for ``key``."""
    if key == "audio_input_ids":  # an audio codec's codes per frame and codebook (Higgs Audio)
        codebooks, size = _find(config, "num_codebooks", "audio_num_codebooks"), _find(config, "codebook_size")
        if isinstance(codebooks, int) and isinstance(size, int):
            yield torch.randint(0, size, (BATCH, CODE_FRAMES, codebooks), generator=gen), 1
        return
    if key == "input_values":
        yield torch.randn((BATCH, SAMPLES), generator=gen), 1
        yield torch.randn((BATCH, 1, SAMPLES), generator=gen), 2
        return
    mel = _find(config, "num_mel_bins", "n_mels", "feature_size", "input_feat_per_channel")
    positions = _find(config, "max_source_positions")
    if mel and positions:
        yield torch.randn((BATCH, mel, 2 * positions), generator=gen), 2
    window = _find(config, "n_window")
    if mel and isinstance(window, int) and not isinstance(window, bool) and window > 0:
        yield torch.randn((BATCH, mel, 2 * window), generator=gen), 2
    feat = _find(config, "input_feat_per_channel")
    feat = feat * (_find(config, "input_channels") or 1) if feat else mel or _find(config, "hidden_size") or 80
    # a CTC head needs more frames left after the encoder's subsampling (Parakeet's 8x) than label tokens
    frames = FRAMES * (4 if _find(config, "ctc_loss_reduction") is not None else 1)
    yield torch.randn((BATCH, frames, feat), generator=gen), 1
    if mel:
        yield torch.randn((BATCH, mel, frames), generator=gen), 2


def audio_count(model, media: dict[str, Any]) -> int | None:
    """How many placeholder tokens one sample's audio fills: the rows of the model's
    ``get_audio_features`` on ``media`` over the batch, else its audio tower's output length for
    the frames the mask keeps, else None (the mismatch message of a full forward corrects it)."""
    if "audio_input_ids" in media:  # a placeholder per frame of codes
        return media["audio_input_ids"].shape[1]
    rows = _feature_rows(model, media)
    if rows is None:
        rows = _tower_rows(model, media)
    return rows // BATCH if rows and rows % BATCH == 0 else None


def _feature_rows(model, media: dict[str, Any]) -> int | None:
    """The rows of ``get_audio_features`` (its ``pooler_output``, the projected features), the inner
    model's where the head has one (the head's only forwards to it, some arguments through ``**kwargs``)."""
    get = getattr(getattr(model, "model", None), "get_audio_features", None) or getattr(
        model, "get_audio_features", None)
    if get is None:
        return None
    names = inspect.signature(get).parameters
    kwargs = {k: v for k, v in media.items() if k in names}
    if not kwargs:
        return None
    try:
        with torch.no_grad():
            out = get(**kwargs)
    except Exception:  # noqa: BLE001 - the tower's lengths, or the forward's own mismatch message, instead
        return None
    feats = getattr(out, "pooler_output", None)
    if feats is None:
        feats = out[0] if isinstance(out, tuple) and out else out
    return feature_rows(feats) or None


def _tower_rows(model, media: dict[str, Any]) -> int | None:
    """The audio tower's output lengths over the batch (``_get_feat_extract_output_lengths`` of the
    frames the mask keeps; the last of a pair: Qwen2-Audio's after its pooling)."""
    mask = next((media[k] for names in _MASKS.values() for k in names if k in media), None)
    tower = next((m for name, m in model.named_modules() if "audio" in name.split(".")[-1]
                  and hasattr(m, "_get_feat_extract_output_lengths")), None)
    if mask is None or tower is None:
        return None
    try:
        lengths = tower._get_feat_extract_output_lengths(mask.sum(-1))
    except Exception:  # noqa: BLE001 - a tower whose lengths need more than the frames
        return None
    lengths = lengths[-1] if isinstance(lengths, tuple) else lengths
    return int(lengths.sum()) if isinstance(lengths, torch.Tensor) else None
