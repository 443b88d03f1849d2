"""Tiny inputs and the loss of one support-table row (``sweep_tasks`` picks the head).

``reference(model, config, task, gen)`` builds the inputs of ``task`` from the config and the
forward's signature and runs the unsharded model once: the first candidate whose loss is finite
wins.  Inputs per modality: token ids that avoid every special id (``input_ids``; a seq2seq head's
``labels`` are other ids, which the model shifts into its decoder inputs), pixels at the tiny
config's ``image_size`` and ``num_channels`` in each layout of ``sweep_media`` (a patch grid,
any-resolution tiles, images per sample, plain ``pixel_values``; video: ``num_frames`` more),
audio in each layout of ``sweep_audio`` (raw ``input_values``, ``input_features`` at the length
its encoder takes, codec codes) with the masks its feature extractor returns.  A vision- or
audio-language model gets its image/audio placeholder tokens in the ids, between the start and
end ids its config names: as many as the model makes features of the image or audio (its
``get_image_features``, ``get_audio_features``), else as its own mismatch message says, else the
text alone; the per-token arguments a processor returns with
them (``mm_token_type_ids``, Gemma 3's ``token_type_ids``, Kosmos-2's
``image_embeds_position_mask``) mark them.  Labels per ``Task.labels`` (``LABELS``).  The loss is the model's
own (``out.loss``), else the mean square of its main output (``loss_of``).
"""

from __future__ import annotations

__all__ = ["FORWARD_SEED", "config_overrides", "loss_of", "reference"]

import inspect
import math
import re
from collections.abc import Iterator
from typing import Any

import torch

from .model_configs import VOCAB, special_ids
from .sweep_audio import AUDIO_INPUTS, audio_count, audio_inputs
from .sweep_media import IMAGE_INPUTS, feature_count, find, image_inputs, token_inputs
from .sweep_tasks import Task

#: the ids that open and close a modality's placeholders, per modality, the first pair the config names
_BOUNDARIES = {"image": (("image_start_token_id", "image_end_token_id"), ("vision_start_token_id", "vision_end_token_id"))}
BATCH, SEQ, SAMPLES, FRAMES, NUM_LABELS, IMAGE_SIDE = 2, 8, 400, 16, 3, 32
#: tokens: labels are the input ids; target: other ids (a seq2seq decoder's); class: one of NUM_LABELS
#: per sample; ctc: a short transcript per sample; contrastive: return_loss=True; none: no labels.
#: torch's global generator is seeded with this before every forward the sweep compares: a model that
#: draws from it (VibeVoice's diffusion noise) draws the same values unsharded and sharded
FORWARD_SEED = 1234
LABELS = ("none", "tokens", "target", "class", "ctc", "contrastive")
_MISMATCH = re.compile(r"tokens\D{0,12}?(\d+)\D{0,16}?features\D{0,12}?(\d+)", re.IGNORECASE)
#: the pixel argument of a forward, the first it takes (Video-LLaVA: images before videos)
_PIXELS = ("pixel_values", "pixel_values_images", "pixel_values_videos", "flattened_patches")
_PLACEHOLDER = {"image": ("image_token_id", "image_token_index", "image_token"),
                "audio": ("audio_token_id", "audio_token_index", "audio_token")}


def config_overrides(task: Task) -> dict[str, Any]:
    """The keywords of ``tiny_config_for`` for ``task``: ``NUM_LABELS`` classes for a classifier;
    the image/audio front ends shrunk except for a text-only causal LM (its rows keep the configs
    they had when the table covered causal LMs alone; one whose class takes images gets them)."""
    media = task.name != "causal-lm" or "image" in task.modalities
    return {"media": media, **({"num_labels": NUM_LABELS} if task.labels == "class" else {})}


def loss_of(out) -> torch.Tensor:
    """The model's own loss, else the mean square of its logits (else of its first output tensor)."""
    loss = getattr(out, "loss", None)
    if loss is None:
        logits = getattr(out, "logits", None)
        if not isinstance(logits, torch.Tensor):
            logits = _first_tensor(out)
        loss = logits.float().pow(2).mean()
    return loss.mean() if loss.dim() else loss  # a loss per sample (DAC's): their mean


def _first_tensor(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor) and out.is_floating_point():
        return out
    # (a detector's keypoints: coordinates picked by thresholds, no gradient; SuperPoint's come first)
    items = [v for k, v in out.items() if k != "keypoints"] if isinstance(out, dict) else \
        out if isinstance(out, (tuple, list)) else ()
    for item in items:
        if item is not None and (t := _first_tensor_or_none(item)) is not None:
            return t
    raise TypeError(f"the model's output {type(out).__name__} holds no floating-point tensor to make a loss of")


def _first_tensor_or_none(out) -> torch.Tensor | None:
    try:
        return _first_tensor(out)
    except TypeError:
        return None


def _token_ids(model, config, gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """Random ids below the model's vocabulary (at most ``VOCAB``) that avoid every special id."""
    try:
        emb = model.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        emb = None
    rows = getattr(getattr(emb, "weight", None), "shape", (VOCAB,))[0]
    vocab = min(VOCAB, rows) if emb is not None else min(VOCAB, find(config, "vocab_size") or VOCAB)
    allowed = torch.tensor([i for i in range(3, vocab) if i not in special_ids(config)])
    return allowed[torch.randint(0, len(allowed), shape, generator=gen)]


def _labels(task: Task, model, config, ids: torch.Tensor | None, gen: torch.Generator) -> dict[str, Any]:
    params = inspect.signature(model.forward).parameters
    if task.labels == "tokens" and ids is not None:
        return {"labels": ids}
    if task.labels == "target" and ids is not None and "decoder_input_ids" not in params:  # a decoder-only audio LM
        return {"labels": ids}
    if task.labels == "target" or task.labels == "tokens" and ids is None and "decoder_input_ids" in params:
        return {"labels": _token_ids(model, config, gen, (BATCH, SEQ))}  # (an image-to-text decoder: Pix2Struct)
    if task.labels == "class":
        return {"labels": torch.randint(0, NUM_LABELS, (BATCH,), generator=gen)}
    if task.labels == "ctc":
        vocab = min(VOCAB, find(config, "vocab_size") or VOCAB)
        pad = find(config, "pad_token_id")
        allowed = torch.tensor([i for i in range(1, vocab) if i != pad])
        return {"labels": allowed[torch.randint(0, len(allowed), (BATCH, 3), generator=gen)]}
    if task.labels == "contrastive":
        return {"return_loss": True}
    return {}


def _candidates(model, config, task: Task, gen: torch.Generator, placeholders: dict[tuple[str, int], int]
                ) -> Iterator[tuple[dict[str, Any], tuple[tuple[str, int], ...]]]:
    """``(inputs, (modality, layout) of each placeholder run in the ids)`` to try, the fullest first:
    every image layout of ``sweep_media.image_inputs``, then the text alone.  A run's length is
    ``placeholders[(modality, layout)]`` (the model's own mismatch message) where set, else the
    features the model makes of the image (``feature_count``), else 1."""
    params = inspect.signature(model.forward).parameters
    wants, image, audio, video = _wants(model, config, task, params)
    media = [m for m in ("image", "audio") if wants[m]]
    for keep in ([*media], []) if wants["text"] and media else ([*media],):
        layouts = list(image_inputs(model, config, params, image, gen, video)) if "image" in keep else [{}]
        if "audio" in keep:  # each image layout with each audio layout (sweep_audio), the audio's masks with it
            layouts = [{**p, **a} for p in layouts for a in audio_inputs(config, params, audio, gen)]
        for layout, pixels in enumerate(layouts):
            tokens = [m for m in keep if task.labels != "contrastive" and (_placeholder(config, m) is not None or (
                m == "image" and "image_embeds_position_mask" in params))]
            runs = {m: (m, layout) for m in tokens}
            counts = {m: placeholders.get(runs[m]) or (feature_count if m == "image" else audio_count)(model, pixels)
                      or 1 for m in tokens}
            inputs: dict[str, Any] = {}
            ids = None
            if wants["text"]:
                shown = pixels.get(image)
                count = 0 if shown is None else shown.shape[1] if shown.dim() == 5 and not video else 1
                inputs, ids = _text_inputs(model, config, task, params, gen, counts, count)
            inputs.update(pixels)
            inputs.update(_more_inputs(model, config, params, "image" in keep, inputs, gen))
            found = tuple(runs[m] for m in tokens)
            labels = _labels(task, model, config, ids, gen)  # a type's EXTRA_INPUTS may bring labels of its own
            yield {**inputs, **labels, **{k: inputs[k] for k in labels if k in inputs}}, found


def _wants(model, config, task: Task, params) -> tuple[dict[str, bool], str | None, str | None, bool]:
    """(which of text, image, audio to feed ``model``, its image argument, its audio argument, whether
    the images go in as videos).  Raises ``TypeError`` where its forward takes none of them."""
    main = getattr(model, "main_input_name", "input_ids")
    wants = {"text": "input_ids" in params and (main == "input_ids" or "text" in task.modalities)}
    image = next((k for k in _PIXELS if k in params), None) or (
        "hidden_states" if "grid_thw" in params else None)  # a Qwen-VL-style tower's own forward: patches and grid
    wants["image"] = image is not None and (main == image or "image" in task.modalities or not wants["text"])
    encoder = getattr(getattr(model, "encoder", None), "main_input_name", None)  # SpeechEncoderDecoder's main: inputs
    audio = next((k for k in (encoder, "input_features", "input_values", "audio_input_ids") if k in params and k in (
        "input_features", "input_values", "audio_input_ids")), None)
    wants["audio"] = audio is not None and (main == audio or "audio" in task.modalities or (
        not wants["image"] and _placeholder(config, "audio") is not None))  # an audio LM's head: MOSS, Higgs
    if not any(wants.values()) and getattr(config, "model_type", "") not in EXTRA_INPUTS:
        raise TypeError(f"{type(model).__name__}'s forward takes none of input_ids, pixel_values, input_features, "
                        f"input_values (main input: {main})")
    # a model with an argument of its own for videos takes images in the other (LLaVA-NeXT-Video)
    video = wants["image"] and (image.endswith("videos") or "pixel_values_videos" not in params and
                                _is_video(config, model))
    return wants, image, audio, video


def _text_inputs(model, config, task: Task, params, gen: torch.Generator, counts: dict[str, int], images: int
                 ) -> tuple[dict[str, Any], torch.Tensor]:
    """(the token inputs, the ids): ``SEQ`` tokens after a run of ``counts[m]`` placeholders per
    modality ``m`` (between its start and end ids where the config names them), with the masks and
    per-token inputs (``token_inputs``) of ``images`` images."""
    tokens = list(counts)
    edges = {m: _boundaries(config, m) for m in tokens}
    ids = _token_ids(model, config, gen, (BATCH, SEQ + sum(counts[m] + len(edges[m]) for m in tokens)))
    at, spans = 0, {}
    for m in tokens:  # [start] placeholder * count [end], as the processor writes them
        if edges[m]:
            ids[:, at], ids[:, at + counts[m] + 1] = edges[m]
            at += 1
        if _placeholder(config, m) is not None:
            ids[:, at:at + counts[m]] = _placeholder(config, m)
        spans[m] = (at, at + counts[m])
        at += counts[m] + (1 if edges[m] else 0)
    inputs: dict[str, Any] = {"input_ids": ids}
    if tokens and "attention_mask" in params:  # some merge placeholders by the mask (Qwen2-Audio)
        inputs["attention_mask"] = torch.ones_like(ids)
    if "decoder_input_ids" in params and task.labels != "target":  # a bare encoder-decoder
        inputs["decoder_input_ids"] = ids[:, :SEQ]
    inputs.update(token_inputs(model, params, ids, spans, images))
    return inputs, ids


def _more_inputs(model, config, params, image: bool, inputs: dict[str, Any], gen: torch.Generator) -> dict[str, Any]:
    """What ``inputs`` still lack: ViT-MAE's noise, a transducer's decoder ids, the type's
    ``EXTRA_INPUTS``, a layout model's boxes, then the required ids and masks (``_required``)."""
    more: dict[str, Any] = {}
    if image and "noise" in params:  # ViT-MAE draws its patch mask from torch.rand unless given it
        patches = (getattr(config, "image_size", 32) // getattr(config, "patch_size", 8)) ** 2
        more["noise"] = torch.rand(BATCH, patches, generator=gen)
    # a transducer's (RNN-T, TDT) prediction net
    if "decoder_cache" in params and "labels" in params and "decoder_input_ids" not in inputs:
        more["decoder_input_ids"] = _token_ids(model, config, gen, (BATCH, SEQ))
    extra = EXTRA_INPUTS.get(getattr(config, "model_type", ""))
    more.update(extra(config, gen) if extra else {})
    if "bbox" in params and "input_ids" in inputs:  # a layout model (LiLT, BROS, UDOP): a box per token
        more["bbox"] = _boxes(inputs["input_ids"], gen)
    more.update(_required(params, {**inputs, **more}, model, config, gen))
    return more


def _series(config, gen: torch.Generator, padding: str | None = None) -> dict[str, Any]:
    """A time-series model's past values: ``(batch, context)`` (or ``(batch, context, channels)``
    where the config names input channels), and its padding mask of zeros."""
    length = min(find(config, "context_length") or 32, 32)
    channels = find(config, "num_input_channels")
    shape = (BATCH, length, channels) if isinstance(channels, int) else (BATCH, length)
    out: dict[str, Any] = {"past_values": torch.randn(shape, generator=gen)}
    if padding:
        out[padding] = torch.zeros(BATCH, length)
    return out


def _float(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=gen)


def _forecast(config, gen: torch.Generator) -> dict[str, Any]:
    """A probabilistic forecaster's (Autoformer, Informer): the past (context plus the largest lag)
    and the future values with a time feature each and the observed mask."""
    past, future = config.context_length + max(config.lags_sequence), config.prediction_length
    return {"past_values": _float(gen, BATCH, past), "past_time_features": _float(gen, BATCH, past, config.num_time_features),
            "past_observed_mask": torch.ones(BATCH, past), "future_values": _float(gen, BATCH, future),
            "future_time_features": _float(gen, BATCH, future, config.num_time_features)}


#: model type -> the arguments its forward needs that no modality of ``_candidates`` builds (``(config, gen) ->
#: dict``): a time series, a Q-Former's queries, a decision transformer's trajectory, a prompt image, ...
EXTRA_INPUTS: dict[str, Any] = {
    "decision_transformer": lambda c, g: {
        "states": _float(g, BATCH, SEQ, c.state_dim), "actions": _float(g, BATCH, SEQ, c.act_dim),
        "rewards": _float(g, BATCH, SEQ, 1), "returns_to_go": _float(g, BATCH, SEQ, 1),
        "timesteps": torch.arange(SEQ).expand(BATCH, SEQ), "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long)},
    "timesfm": lambda c, g: {**_series(c, g, "past_values_padding"), "freq": torch.zeros(BATCH, 1, dtype=torch.long)},
    "timesfm2_5": lambda c, g: _series(c, g, "past_values_padding"),
    # a text-line recogniser (PP-OCR's): a line of text 48 high, wider than tall
    **{t: lambda c, g: {"pixel_values": _float(g, BATCH, 3, 48, 160)} for t in (
        "pp_ocrv5_server_rec", "pp_ocrv6_small_rec", "pp_ocrv6_tiny_rec")},
    "pp_ocrv5_mobile_rec": lambda c, g: {"pixel_values": _float(g, BATCH, 3, 96, 320)},  # it downsamples more
    # audio decoders and codec halves: latents per frame (Mimi's codebook_dim, the model width)
    "mimi_decoder": lambda c, g: {"latents": _float(g, BATCH, c.codebook_dim, 4)},
    "pocket_tts_audio_tokenizer_decoder": lambda c, g: {"latents": _float(g, BATCH, c.hidden_size, 4)},
    "vibevoice_acoustic_tokenizer_encoder": lambda c, g: {"hidden_states": _float(g, BATCH, c.channels, SAMPLES)},
    "vibevoice_acoustic_tokenizer_decoder": lambda c, g: {"hidden_states": _float(g, BATCH, c.hidden_size, 4)},
    "nemotron3_5_transcribe_word_timestamp": lambda c, g: {"inputs_embeds": _float(g, BATCH, SEQ, c.hidden_size)},
    # keypoint matching: a pair of images per sample
    **{t: lambda c, g: {"pixel_values": _float(g, BATCH, 2, 3, IMAGE_SIDE, IMAGE_SIDE)} for t in ("superglue", "lightglue")},
    # Moonshine's raw-audio front end downsamples 384x: a second of audio at 16 kHz
    **{t: lambda c, g: {"input_values": _float(g, BATCH, 16000)} for t in ("moonshine", "moonshine_streaming")},
    # Muse Spark's audio tower patches the waveform by the product of its patch sizes (16 x 6 x 5 x 4)
    "muse_spark_audio": lambda c, g: {"input_values": _float(g, BATCH, math.prod(c.patch_sizes))},
    # labels per codebook: (batch, sequence, codebooks)
    **{t: lambda c, g: {"labels": torch.randint(3, c.decoder.vocab_size, (BATCH, SEQ, c.decoder.num_codebooks),
                                                generator=g)} for t in ("musicgen", "musicgen_melody")},
    # Granite Speech 5: mel frames delta-expanded (x2) and stacked in pairs (x2); its CTC head wants more frames
    "granite_speech5_encoder": lambda c, g: {"input_features": _float(g, BATCH, FRAMES, 4 * c.num_mel_bins)},
    "granite_speech5_ctc": lambda c, g: {"input_features": _float(g, BATCH, 4 * FRAMES, 4 * c.encoder_config.num_mel_bins)},
    # NeMo's streaming conformers subsample 8x: with 16 frames every position of their windows is masked (NaN)
    **{t: lambda c, g: {"input_features": _float(g, BATCH, 8 * FRAMES, find(c, "num_mel_bins"))} for t in (
        "nemotron_asr_streaming_encoder", "nemotron_asr_streaming", "nemotron3_5_asr")},
    # AST's input_values: a spectrogram (frames x mel bins), not a waveform
    "audio-spectrogram-transformer": lambda c, g: {"input_values": _float(g, BATCH, c.max_length, c.num_mel_bins)},
    "gemma4_vision": lambda c, g: _positioned_patches(c, g),
    # Gemma 4's audio tower: 128 mel bins (its projection's width is fixed by them), a frame mask
    "gemma4_audio": lambda c, g: {"input_features": _float(g, BATCH, 4 * FRAMES, 128),
                                  "input_features_mask": torch.ones(BATCH, 4 * FRAMES, dtype=torch.bool)},
    "pi0": lambda c, g: _actions(c, g), "pi05": lambda c, g: _actions(c, g),
    # Fun-ASR's encoder: num_stacked_frames mel frames side by side per position
    "fun_asr_nano_encoder": lambda c, g: {"input_features": _float(g, BATCH, FRAMES, c.num_stacked_frames * c.num_mel_bins)},
    "clvp": lambda c, g: {"input_features": _float(g, BATCH, find(c, "feature_size"), FRAMES)},  # (mel bins, frames)
    # Depth Pro: the image 4 crops wide at its smallest scale (patch_size / 0.25)
    "depth_pro": lambda c, g: {"pixel_values": _float(g, BATCH, 3, 4 * c.patch_size, 4 * c.patch_size)},
    "wavtokenizer_encoder": lambda c, g: {"input_values": _float(g, BATCH, 1, SAMPLES)},  # mono: (batch, 1, samples)
    # Voxtral Realtime adds one audio embedding per text token: 8x the frames (its encoder's downsampling) of SEQ
    "voxtral_realtime": lambda c, g: {"input_features": _float(g, BATCH, find(c, "num_mel_bins"), 8 * SEQ)},
    # JEV scores a prompt's questions (its first sample): each at a mark (1-based), with its options and type
    "jev": lambda c, g: {"marks": torch.tensor([[SEQ // 2, SEQ]]), "num_options": torch.tensor([[2, 3]]),
                         "question_type_ids": torch.tensor([[0, 0]])},
    # X-Codec 2, NeuCodec: the waveform (mono) and its semantic features, one feature frame per acoustic frame
    **{t: lambda c, g: {"input_values": _float(g, BATCH, 1, FRAMES * math.prod(c.downsampling_ratios)),
                        "input_features": _float(g, BATCH, FRAMES, find(c, "feature_projection_input_dim"))}
       for t in ("xcodec2", "neucodec")},
    "autoformer": _forecast, "informer": _forecast, "time_series_transformer": _forecast,
    "patchtst": lambda c, g: _series(c, g),
    "patchtsmixer": lambda c, g: _series(c, g),
    "blip_2_qformer": lambda c, g: {"query_embeds": _float(g, BATCH, 4, c.hidden_size),
                                    "encoder_hidden_states": _float(g, BATCH, 4, c.encoder_hidden_size)},
    "gemma3n_audio": lambda c, g: {"audio_mel": _float(g, BATCH, 4 * FRAMES, c.input_feat_size),
                                   "audio_mel_mask": torch.zeros(BATCH, 4 * FRAMES, dtype=torch.bool)},
    "lxmert": lambda c, g: {"visual_feats": _float(g, BATCH, 4, c.visual_feat_dim),
                            "visual_pos": torch.rand((BATCH, 4, c.visual_pos_dim), generator=g)},
    "oneformer": lambda c, g: {"task_inputs": torch.randint(3, VOCAB, (BATCH, c.task_seq_len), generator=g)},
    # SegGPT stacks the image over its prompt: each half the height of its image_size
    "seggpt": lambda c, g: {k: _float(g, BATCH, c.num_channels, _pair(c.image_size)[0] // 2, _pair(c.image_size)[1])
                            for k in ("pixel_values", "prompt_pixel_values", "prompt_masks")},
    **IMAGE_INPUTS, **AUDIO_INPUTS,  # more images and audio (sweep_media, sweep_audio)
}


def _positioned_patches(config, gen: torch.Generator) -> dict[str, Any]:
    """Gemma 4's vision tower: flattened patches and their (x, y) positions, a square of twice its
    pooling kernel on a side (pooled to 2 x 2)."""
    side, patch = 2 * config.pooling_kernel_size, config.patch_size
    grid = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="xy"), dim=-1).reshape(1, -1, 2)
    return {"pixel_values": _float(gen, BATCH, side * side, 3 * patch * patch),
            "pixel_position_ids": grid.expand(BATCH, -1, -1).contiguous()}


def _actions(config, gen: torch.Generator) -> dict[str, Any]:
    """A vision-language-action policy's (PI0) action chunk, its flow-matching noise and time (given:
    drawn inside, they would differ between the unsharded and the sharded run) and the robot state."""
    chunk = (BATCH, config.chunk_size, config.max_action_dim)
    out = {"actions": _float(gen, *chunk), "noise": _float(gen, *chunk), "timestep": torch.rand(BATCH, generator=gen)}
    if hasattr(config, "max_state_dim"):  # PI0 (PI0.5 has the state in its prompt)
        out["state"] = _float(gen, BATCH, config.max_state_dim)
    return out


def _pair(size) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else tuple(size)[-2:]


def _boxes(ids: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A layout model's word boxes, ``(x0, y0, x1, y1)`` in 0..1000 with ``x0 <= x1``, ``y0 <= y1``."""
    corners = torch.randint(0, 1000, (*ids.shape, 2, 2), generator=gen).sort(dim=-2).values
    return corners.reshape(*ids.shape, 4)  # (x0, y0) the smaller of each coordinate, (x1, y1) the larger


def _required(params, inputs: dict[str, Any], model, config, gen: torch.Generator) -> dict[str, Any]:
    """Required forward arguments not built yet that are more token ids (InstructBLIP's
    ``qformer_input_ids``) or their attention masks."""
    out: dict[str, Any] = {}
    for name, p in params.items():
        if p.default is not inspect.Parameter.empty or name in inputs or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) \
                or name == "self":
            continue
        if name.endswith("input_ids"):
            out[name] = _token_ids(model, config, gen, (BATCH, SEQ))
        elif name.endswith("attention_mask"):
            out[name] = torch.ones(BATCH, SEQ, dtype=torch.long)
    return out


def _is_video(config, model) -> bool:
    return "Video" in type(model).__name__ or find(config, "num_frames", "frames_per_clip") is not None and \
        "image" not in type(model).__name__.lower()


def _placeholder(config, modality: str) -> int | None:
    value = find(config, *_PLACEHOLDER[modality])
    return value if isinstance(value, int) else None


def _boundaries(config, modality: str) -> tuple[int, int] | tuple[()]:
    """The ids that open and close a placeholder run where the config names both (Qwen-VL's
    ``vision_start``/``vision_end``, Ovis2.5's ``image_start``/``image_end``), else ``()``."""
    for start, end in _BOUNDARIES.get(modality, ()):
        pair = (find(config, start), find(config, end))
        if all(isinstance(v, int) and not isinstance(v, bool) for v in pair):
            return pair
    return ()


def reference(model, config, task: Task, gen: torch.Generator) -> tuple[dict[str, Any], torch.Tensor]:
    """The inputs of ``task`` the unsharded ``model`` runs on, and its loss there (``.backward()``
    already called).  Raises the first candidate's error (the fullest layout's) if none runs to a finite loss."""
    placeholders: dict[tuple[str, int], int] = {}
    tried: set[tuple[tuple[str, int], int]] = set()
    error: Exception | None = None
    for _ in range(5):  # a placeholder count the model corrects: rebuild with its count
        retry = False
        for inputs, tokens in _candidates(model, config, task, gen, placeholders):
            try:
                torch.manual_seed(FORWARD_SEED)
                loss = loss_of(model(**inputs))
                if not torch.isfinite(loss):
                    raise ValueError(f"unsharded loss is {loss.item()}")
                loss.backward()
            except Exception as exc:  # noqa: BLE001 - the next candidate, or the reason it is not buildable
                model.zero_grad(set_to_none=True)
                error = error or exc
                if tokens and (m := _MISMATCH.search(str(exc))):
                    run = _mismatched(str(exc), tokens)
                    # the message counts feature rows, or (some models) rows times the hidden size
                    hidden = getattr(config.get_text_config(), "hidden_size", None) or 1
                    counts = [max(1, -(-int(m.group(2)) // d // BATCH)) for d in (1, hidden)]
                    count = next((c for c in counts if (run, c) not in tried), None)
                    if count is not None:
                        tried.add((run, count))
                        placeholders[run] = count
                        retry = True
                        break
                continue
            return inputs, loss.detach()
        if not retry:
            break
    assert error is not None
    raise error


def _mismatched(message: str, runs: tuple[tuple[str, int], ...]) -> tuple[str, int]:
    """The placeholder run (modality, layout) the model's mismatch message is about."""
    low = message.lower()
    return next((r for r in runs if low.startswith(r[0]) or f"{r[0]} " in low[:40]), runs[0])
