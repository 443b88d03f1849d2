"""The audio side of a speech or audio-language row of the support table (``sweep_inputs`` builds the rest).

The audio arguments themselves (raw ``input_values``, ``input_features`` at the length the encoder
takes, codec codes, each with the masks its feature extractor returns: ``audio_inputs``) are built
from the config in ``analysis.media``, where ``auto_plan`` builds an audio tower's input from them
too; they are re-exported here for ``sweep_inputs``.

``audio_count`` asks the model how many placeholder tokens one sample's audio fills (the rows of
its ``get_audio_features``, else its audio tower's ``_get_feat_extract_output_lengths``; one per
frame of codes), so the ids carry exactly that many, as the processor writes them.
``AUDIO_INPUTS``: the audio inputs of the types no layout fits (``sweep_inputs.EXTRA_INPUTS`` adds them).
"""

from __future__ import annotations

__all__ = ["AUDIO_INPUTS", "audio_count", "audio_inputs"]

import inspect
from typing import Any

import torch

from ..analysis.media import AUDIO_MASKS, BATCH, audio_inputs
from .sweep_media import feature_rows


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
    mask = next((media[k] for names in AUDIO_MASKS.values() for k in names if k in media), None)
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


#: the frames of codes (a codec's, a speech LM's) the per-type inputs carry
CODE_FRAMES = 4


def _folded_spectrogram(config, gen: torch.Generator) -> dict[str, Any]:
    """CLAP's (HTSAT's) log-mel features ``(batch, 1, frames, mel bins)``: as many frames as it folds into
    its square input (``spec_size x spec_size // num_mel_bins``)."""
    audio = config.audio_config
    frames = audio.spec_size * (audio.spec_size // audio.num_mel_bins)
    return {"input_features": torch.randn((BATCH, 1, frames, audio.num_mel_bins), generator=gen)}


def _text_and_codes(config, gen: torch.Generator) -> dict[str, Any]:
    """Kyutai STT's ids, per frame its text token and one code per codebook ``(batch, frames, 1 + codebooks)``
    (codes below the audio BOS, text above its special ids); its labels the text."""
    text = torch.randint(config.pad_token_id + 1, config.vocab_size, (BATCH, CODE_FRAMES, 1), generator=gen)
    codes = torch.randint(0, config.audio_bos_token_id, (BATCH, CODE_FRAMES, config.num_codebooks), generator=gen)
    return {"input_ids": torch.cat([text, codes], dim=-1), "labels": text[..., 0]}


def _channel_frames(config, gen: torch.Generator) -> dict[str, Any]:
    """Dia's decoder ids, a code per channel per frame ``(batch, frames, channels)``, and its labels with
    the channels flattened into the batch ``(batch x channels, frames)``, as its logits (above pad, BOS, EOS)."""
    decoder = config.decoder_config
    shape = (BATCH, CODE_FRAMES, decoder.num_channels)
    return {"decoder_input_ids": torch.randint(3, decoder.vocab_size, shape, generator=gen),
            "labels": torch.randint(3, decoder.vocab_size, (BATCH * decoder.num_channels, CODE_FRAMES), generator=gen)}


#: model type -> ``(config, gen) -> audio inputs`` where no layout of ``audio_inputs`` fits
AUDIO_INPUTS: dict[str, Any] = {"clap": _folded_spectrogram, "kyutai_speech_to_text": _text_and_codes,
                                "dia": _channel_frames}
