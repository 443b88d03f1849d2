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

__all__ = ["config_overrides", "loss_of", "reference"]

import inspect
import re
from collections.abc import Iterator
from typing import Any

import torch

from .model_configs import VOCAB, special_ids
from .sweep_audio import audio_count, audio_inputs
from .sweep_media import feature_count, find, image_inputs, token_inputs
from .sweep_tasks import Task

#: the ids that open and close a modality's placeholders, per modality, the first pair the config names
_BOUNDARIES = {"image": (("image_start_token_id", "image_end_token_id"), ("vision_start_token_id", "vision_end_token_id"))}
BATCH, SEQ, SAMPLES, FRAMES, NUM_LABELS = 2, 8, 400, 16, 3
#: tokens: labels are the input ids; target: other ids (a seq2seq decoder's); class: one of NUM_LABELS
#: per sample; ctc: a short transcript per sample; contrastive: return_loss=True; none: no labels.
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
    return loss


def _first_tensor(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor) and out.is_floating_point():
        return out
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
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
    main = getattr(model, "main_input_name", "input_ids")
    wants = {"text": "input_ids" in params and (main == "input_ids" or "text" in task.modalities)}
    image = next((k for k in _PIXELS if k in params), None)
    wants["image"] = image is not None and (main == image or "image" in task.modalities)
    audio = next((k for k in ("input_features", "input_values", "audio_input_ids") if k in params), None)
    wants["audio"] = audio is not None and (main == audio or "audio" in task.modalities or (
        not wants["image"] and _placeholder(config, "audio") is not None))  # an audio LM's head: MOSS, Higgs
    if not any(wants.values()):
        raise TypeError(f"{type(model).__name__}'s forward takes none of input_ids, pixel_values, input_features, "
                        f"input_values (main input: {main})")
    media = [m for m in ("image", "audio") if wants[m]]
    # a model with an argument of its own for videos takes images in the other (LLaVA-NeXT-Video)
    video = wants["image"] and (image.endswith("videos") or "pixel_values_videos" not in params and
                                _is_video(config, model))
    for keep in ([*media], []) if wants["text"] and media else ([*media],):
        layouts = list(image_inputs(model, config, params, image, gen, video)) if "image" in keep else [{}]
        if "audio" in keep:  # each image layout with each audio layout (sweep_audio), the audio's masks with it
            layouts = [{**p, **a} for p in layouts for a in audio_inputs(config, params, audio, gen)]
        for layout, pixels in enumerate(layouts):
            inputs: dict[str, Any] = {}
            tokens = [m for m in keep if task.labels != "contrastive" and (_placeholder(config, m) is not None or (
                m == "image" and "image_embeds_position_mask" in params))]
            runs = {m: (m, layout) for m in tokens}
            counts = {m: placeholders.get(runs[m]) or (feature_count if m == "image" else audio_count)(model, pixels)
                      or 1 for m in tokens}
            ids = None
            if wants["text"]:
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
                inputs["input_ids"] = ids
                if tokens and "attention_mask" in params:  # some merge placeholders by the mask (Qwen2-Audio)
                    inputs["attention_mask"] = torch.ones_like(ids)
                if "decoder_input_ids" in params and task.labels != "target":  # a bare encoder-decoder
                    inputs["decoder_input_ids"] = ids[:, :SEQ]
                shown = pixels.get(image)
                count = 0 if shown is None else shown.shape[1] if shown.dim() == 5 and not video else 1
                inputs.update(token_inputs(model, params, ids, spans, count))
            inputs.update(pixels)
            if "image" in keep and "noise" in params:  # ViT-MAE draws its patch mask from torch.rand unless given it
                patches = (getattr(config, "image_size", 32) // getattr(config, "patch_size", 8)) ** 2
                inputs["noise"] = torch.rand(BATCH, patches, generator=gen)
            inputs.update(_required(params, inputs, model, config, gen))
            found = tuple(runs[m] for m in tokens)
            yield {**inputs, **_labels(task, model, config, ids, gen)}, found


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
    already called).  Raises the last candidate's error if none runs to a finite loss."""
    placeholders: dict[tuple[str, int], int] = {}
    tried: set[tuple[tuple[str, int], int]] = set()
    error: Exception | None = None
    for _ in range(5):  # a placeholder count the model corrects: rebuild with its count
        retry = False
        for inputs, tokens in _candidates(model, config, task, gen, placeholders):
            try:
                loss = loss_of(model(**inputs))
                if not torch.isfinite(loss):
                    raise ValueError(f"unsharded loss is {loss.item()}")
                loss.backward()
            except Exception as exc:  # noqa: BLE001 - the next candidate, or the reason it is not buildable
                model.zero_grad(set_to_none=True)
                error = exc
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
