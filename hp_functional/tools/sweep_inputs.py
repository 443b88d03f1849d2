"""Tiny inputs and the loss of one support-table row (``sweep_tasks`` picks the head).

``reference(model, config, task, gen)`` builds the inputs of ``task`` from the config and the
forward's signature and runs the unsharded model once: the first candidate whose loss is finite
wins.  Inputs per modality: token ids that avoid every special id (``input_ids``; a seq2seq head's
``labels`` are other ids, which the model shifts into its decoder inputs), ``pixel_values`` at the
tiny config's ``image_size`` and ``num_channels`` (video: ``num_frames`` more), ``input_values``
(``SAMPLES`` of raw audio) or ``input_features`` (Whisper's ``(batch, mel bins, 2 x positions)``,
else ``(batch, frames, features)``).  A vision- or audio-language model gets its image/audio
placeholder tokens in the ids: as many as the model says it has features for (its own mismatch
message), else the text alone.  Labels per ``Task.labels`` (``LABELS``).  The loss is the model's
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
from .sweep_tasks import Task

BATCH, SEQ, SAMPLES, FRAMES, NUM_LABELS = 2, 8, 400, 16, 3
#: tokens: labels are the input ids; target: other ids (a seq2seq decoder's); class: one of NUM_LABELS
#: per sample; ctc: a short transcript per sample; contrastive: return_loss=True; none: no labels.
LABELS = ("none", "tokens", "target", "class", "ctc", "contrastive")
_MISMATCH = re.compile(r"tokens\D{0,12}?(\d+)\D{0,16}?features\D{0,12}?(\d+)", re.IGNORECASE)
_PLACEHOLDER = {"image": ("image_token_id", "image_token_index", "image_token"),
                "audio": ("audio_token_id", "audio_token_index", "audio_token")}


def config_overrides(task: Task) -> dict[str, Any]:
    """The keywords of ``tiny_config_for`` for ``task``: ``NUM_LABELS`` classes for a classifier;
    the image/audio front ends shrunk except for a causal LM (its rows feed text only and keep the
    configs they had when the table covered causal LMs alone)."""
    return {"media": task.name != "causal-lm", **({"num_labels": NUM_LABELS} if task.labels == "class" else {})}


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


def _find(config, *keys: str) -> Any:
    """The first of ``keys`` set on ``config`` or, failing that, on one of its sub-configs."""
    for key in keys:
        if getattr(config, key, None) is not None:
            return getattr(config, key)
    for name in sorted(vars(config)):
        sub = getattr(config, name, None)
        if name.endswith("config") and hasattr(sub, "to_dict") and (found := _find(sub, *keys)) is not None:
            return found
    return None


def _token_ids(model, config, gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """Random ids below the model's vocabulary (at most ``VOCAB``) that avoid every special id."""
    try:
        emb = model.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        emb = None
    rows = getattr(getattr(emb, "weight", None), "shape", (VOCAB,))[0]
    vocab = min(VOCAB, rows) if emb is not None else min(VOCAB, _find(config, "vocab_size") or VOCAB)
    allowed = torch.tensor([i for i in range(3, vocab) if i not in special_ids(config)])
    return allowed[torch.randint(0, len(allowed), shape, generator=gen)]


def _pixels(config, gen: torch.Generator, video: bool) -> torch.Tensor:
    size = _find(config, "image_size", "img_size", "input_size") or 32
    h, w = (size, size) if isinstance(size, int) else tuple(size)[-2:]
    channels = _find(config, "num_channels", "in_channels", "in_chans") or 3
    frames = (_find(config, "num_frames", "frames_per_clip") or 2,) if video else ()
    return torch.randn((BATCH, *frames, channels, h, w), generator=gen)


def _audio(config, name: str, gen: torch.Generator) -> Iterator[torch.Tensor]:
    """Candidate audio tensors for the forward argument ``name``."""
    if name == "input_values":
        yield torch.randn((BATCH, SAMPLES), generator=gen)
        return
    mel = _find(config, "num_mel_bins", "n_mels", "feature_size", "input_feat_per_channel")
    positions = _find(config, "max_source_positions")
    if mel and positions:
        yield torch.randn((BATCH, mel, 2 * positions), generator=gen)
    feat = _find(config, "input_feat_per_channel")
    feat = feat * (_find(config, "input_channels") or 1) if feat else mel or _find(config, "hidden_size") or 80
    yield torch.randn((BATCH, FRAMES, feat), generator=gen)
    if mel:
        yield torch.randn((BATCH, mel, FRAMES), generator=gen)


def _labels(task: Task, model, config, ids: torch.Tensor | None, gen: torch.Generator) -> dict[str, Any]:
    params = inspect.signature(model.forward).parameters
    if task.labels == "tokens" and ids is not None:
        return {"labels": ids}
    if task.labels == "target" and ids is not None and "decoder_input_ids" not in params:  # a decoder-only audio LM
        return {"labels": ids}
    if task.labels == "target":
        return {"labels": _token_ids(model, config, gen, (BATCH, SEQ))}
    if task.labels == "class":
        return {"labels": torch.randint(0, NUM_LABELS, (BATCH,), generator=gen)}
    if task.labels == "ctc":
        vocab = min(VOCAB, _find(config, "vocab_size") or VOCAB)
        pad = _find(config, "pad_token_id")
        allowed = torch.tensor([i for i in range(1, vocab) if i != pad])
        return {"labels": allowed[torch.randint(0, len(allowed), (BATCH, 3), generator=gen)]}
    if task.labels == "contrastive":
        return {"return_loss": True}
    return {}


def _candidates(model, config, task: Task, gen: torch.Generator, placeholders: dict[str, int]
                ) -> Iterator[tuple[dict[str, Any], tuple[str, ...]]]:
    """``(inputs, modalities with placeholder tokens)`` to try, the fullest first."""
    params = inspect.signature(model.forward).parameters
    main = getattr(model, "main_input_name", "input_ids")
    wants = {"text": "input_ids" in params and (main == "input_ids" or "text" in task.modalities)}
    image = next((k for k in ("pixel_values", "pixel_values_videos") if k in params), None)
    wants["image"] = image is not None and (main == image or "image" in task.modalities)
    audio = next((k for k in ("input_features", "input_values") if k in params), None)
    wants["audio"] = audio is not None and (main == audio or "audio" in task.modalities)
    if not any(wants.values()):
        raise TypeError(f"{type(model).__name__}'s forward takes none of input_ids, pixel_values, input_features, "
                        f"input_values (main input: {main})")
    media = [m for m in ("image", "audio") if wants[m]]
    for keep in ([*media], []) if wants["text"] and media else ([*media],):
        inputs: dict[str, Any] = {}
        tokens = [m for m in keep if _placeholder(config, m) is not None and task.labels != "contrastive"]
        ids = None
        if wants["text"]:
            lead = sum(placeholders.get(m, 1) for m in tokens)
            ids = _token_ids(model, config, gen, (BATCH, SEQ + lead))
            at = 0
            for m in tokens:
                ids[:, at:at + placeholders.get(m, 1)] = _placeholder(config, m)
                at += placeholders.get(m, 1)
            inputs["input_ids"] = ids
            if tokens and "attention_mask" in params:  # some merge placeholders by the mask (Qwen2-Audio)
                inputs["attention_mask"] = torch.ones_like(ids)
            if "decoder_input_ids" in params and task.labels != "target":  # a bare encoder-decoder
                inputs["decoder_input_ids"] = ids[:, :SEQ]
        for m in keep:
            if m == "image":
                inputs[image] = _pixels(config, gen, video=image.endswith("videos") or _is_video(config, model))
                if "noise" in params:  # ViT-MAE draws its patch mask from torch.rand unless given the noise
                    patches = (getattr(config, "image_size", 32) // getattr(config, "patch_size", 8)) ** 2
                    inputs["noise"] = torch.rand(BATCH, patches, generator=gen)
        inputs.update(_required(params, inputs, model, config, gen))
        if "audio" in keep:
            for tensor in _audio(config, audio, gen):
                mask = {}
                if "feature_attention_mask" in params and audio == "input_features":  # Qwen2-Audio: frames kept
                    mask["feature_attention_mask"] = torch.ones(BATCH, tensor.shape[-1], dtype=torch.long)
                yield {**inputs, audio: tensor, **mask, **_labels(task, model, config, ids, gen)}, tuple(tokens)
            continue
        yield {**inputs, **_labels(task, model, config, ids, gen)}, tuple(tokens)


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
    return "Video" in type(model).__name__ or _find(config, "num_frames", "frames_per_clip") is not None and \
        "image" not in type(model).__name__.lower()


def _placeholder(config, modality: str) -> int | None:
    value = _find(config, *_PLACEHOLDER[modality])
    return value if isinstance(value, int) else None


def reference(model, config, task: Task, gen: torch.Generator) -> tuple[dict[str, Any], torch.Tensor]:
    """The inputs of ``task`` the unsharded ``model`` runs on, and its loss there (``.backward()``
    already called).  Raises the last candidate's error if none runs to a finite loss."""
    placeholders: dict[str, int] = {}
    tried: set[tuple[str, int]] = set()
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
                    modality = _mismatched(str(exc), tokens)
                    # the message counts feature rows, or (some models) rows times the hidden size
                    hidden = getattr(config.get_text_config(), "hidden_size", None) or 1
                    counts = [max(1, -(-int(m.group(2)) // d // BATCH)) for d in (1, hidden)]
                    count = next((c for c in counts if (modality, c) not in tried), None)
                    if count is not None:
                        tried.add((modality, count))
                        placeholders[modality] = count
                        retry = True
                        break
                continue
            return inputs, loss.detach()
        if not retry:
            break
    assert error is not None
    raise error


def _mismatched(message: str, tokens: tuple[str, ...]) -> str:
    low = message.lower()
    return next((m for m in tokens if low.startswith(m) or f"{m} " in low[:40]), tokens[0])
