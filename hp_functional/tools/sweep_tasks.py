"""The support table's model types, the main head of each and its category.

Every model type that has a PyTorch model in the installed transformers (the union of
``MODEL_MAPPING_NAMES`` and every head mapping of ``transformers.models.auto.modeling_auto``)
gets one row.  Its head is the first task of ``TASKS`` whose mapping lists the type (causal LM
first, so the decoder rows keep their causal-LM head); a type no task lists gets the first other
head mapping that does (``fallback``).  Its category (one of ``CATEGORIES``) is decided by the
mappings that list it (``category_of``).  What each task feeds the model and how its loss is
made is ``sweep_inputs``.
"""

from __future__ import annotations

__all__ = ["NOT_TINY", "TRAIN_MODE", "Task", "category_of", "instantiate", "task_for"]

import inspect
from dataclasses import dataclass, replace
from functools import cache

from torch import nn


@dataclass(frozen=True)
class Task:
    """One head: ``mapping`` (an attribute of ``modeling_auto``) lists the types that have it;
    ``labels`` says which labels its inputs carry (``sweep_inputs.LABELS``); ``modalities``
    the inputs besides the model's main one (``"text"``, ``"image"``, ``"audio"``)."""
    name: str
    mapping: str
    labels: str = "none"
    modalities: tuple[str, ...] = ()


TASKS: tuple[Task, ...] = (
    Task("causal-lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "tokens"),
    Task("seq2seq-lm", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "target", ("text", "audio")),
    Task("masked-lm", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", "tokens", ("text",)),  # ("text": Perceiver's main is inputs)
    Task("image-text-to-text", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "tokens", ("text", "image")),
    Task("multimodal-lm", "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES", "tokens", ("text", "image", "audio")),
    Task("speech-seq2seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "target", ("audio",)),  # (SpeechEncoderDecoder's: inputs)
    # a dual encoder's own objective (CLIP, SigLIP, CLAP): the base model where its forward takes return_loss
    Task("contrastive", "MODEL_MAPPING_NAMES", "contrastive", ("text", "image", "audio")),
    Task("image-classification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "class"),
    Task("ctc", "MODEL_FOR_CTC_MAPPING_NAMES", "ctc"),
    Task("audio-classification", "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", "class"),
    Task("sequence-classification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "class"),
    Task("base", "MODEL_MAPPING_NAMES", "none", ("text",)),
)

#: types no tiny model of the sweep can run, and why (the row's reason starts with it; the error follows)
NOT_TINY: dict[str, str] = {
    "bark": "generation only: BarkModel has no forward (its three sub-models are generated in turn)",
    **{t: f"generation only: its composite has no forward (its thinker is the row {t}_thinker)" for t in (
        "qwen2_5_omni", "qwen3_omni_moe")},
    **{t: "its forward tracks objects through a video inference session, not a batch of tensors" for t in (
        "sam2_video", "sam3_video", "sam3_tracker_video", "edgetam_video")},
    "voxtral_realtime_text": "its auto mapping names a class transformers does not define",
    "chameleon": "its image-token vocabulary map comes with a checkpoint (the config's default is None)",
    **{t: "a drafter: its forward runs on the KV states its target model shares with it" for t in (
        "gemma4_assistant", "gemma4_unified_assistant")},
    "muse_glimmer_assistant": "a block drafter: its forward runs on its target model's hidden states and block masks",
    "glm_image_vqmodel": "no forward: GLM-Image's VQ-VAE runs through its encode/decode methods only",
    "wavtokenizer_encoder": "an encoder to discrete codes: its output holds no floating-point tensor to differentiate",
}

#: types the sweep builds in train mode (every other in eval mode), and why that is still deterministic
TRAIN_MODE: dict[str, str] = {
    "reformer": "its reversible layers' backward runs in train mode only; every dropout of the tiny config is 0, and "
                "its LSH attention's 8 tokens in 2 chunks of 4 each see the whole causal past whatever the hash",
}

CATEGORIES = ("decoder LM", "encoder", "encoder-decoder", "vision", "speech", "dual encoder", "vision-language",
              "other")

_VL = ("IMAGE_TEXT_TO_TEXT", "VISUAL_QUESTION_ANSWERING", "DOCUMENT_QUESTION_ANSWERING", "TEXT_RECOGNITION",
       "TABLE_RECOGNITION")
_SPEECH = ("SPEECH_SEQ_2_SEQ", "CTC", "AUDIO_CLASSIFICATION", "AUDIO_FRAME_CLASSIFICATION", "AUDIO_XVECTOR",
           "TEXT_TO_SPECTROGRAM", "TEXT_TO_WAVEFORM", "RNNT", "TDT", "MULTIMODAL_LM")
_VISION = ("IMAGE_CLASSIFICATION", "IMAGE", "OBJECT_DETECTION", "ZERO_SHOT_OBJECT_DETECTION", "SEMANTIC_SEGMENTATION",
           "INSTANCE_SEGMENTATION", "UNIVERSAL_SEGMENTATION", "IMAGE_SEGMENTATION", "DEPTH_ESTIMATION", "BACKBONE",
           "VIDEO_CLASSIFICATION", "MASKED_IMAGE_MODELING", "KEYPOINT_DETECTION", "KEYPOINT_MATCHING",
           "POSE_ESTIMATION", "IMAGE_MATTING", "IMAGE_TO_IMAGE", "MASK_GENERATION", "NORMAL_ESTIMATION",
           "POINTMAP_ESTIMATION", "CAUSAL_IMAGE_MODELING")
_TEXT_ENCODER = ("MASKED_LM", "SEQUENCE_CLASSIFICATION", "TOKEN_CLASSIFICATION", "QUESTION_ANSWERING",
                 "MULTIPLE_CHOICE", "NEXT_SENTENCE_PREDICTION", "TEXT_ENCODING")


def _mapping(name: str) -> dict:
    from transformers.models.auto import modeling_auto

    return getattr(modeling_auto, name)


def _in(model_type: str, *short: str) -> bool:
    """Whether ``MODEL_FOR_<s>_MAPPING_NAMES`` lists ``model_type`` for one of ``short``."""
    return any(model_type in _mapping(f"MODEL_FOR_{s}_MAPPING_NAMES") for s in short)


@cache
def _head_mappings() -> tuple[str, ...]:
    """Every head mapping of ``modeling_auto`` (sorted), ``MODEL_MAPPING_NAMES`` first."""
    from transformers.models.auto import modeling_auto

    heads = sorted(n for n in dir(modeling_auto) if n.startswith("MODEL_FOR_") and n.endswith("_MAPPING_NAMES"))
    return ("MODEL_MAPPING_NAMES", *heads)


def model_types() -> list[str]:
    """Every model type with a PyTorch model in the installed transformers (675 in 5.25): the
    union of ``MODEL_MAPPING_NAMES`` and every head mapping."""
    return sorted(set().union(*(_mapping(m) for m in _head_mappings())))


def _class_name(model_type: str, mapping: str) -> str:
    name = _mapping(mapping)[model_type]
    return name[0] if isinstance(name, (tuple, list)) else name


@cache
def _model_class(model_type: str, mapping: str) -> type[nn.Module] | None:
    import transformers

    try:
        return getattr(transformers, _class_name(model_type, mapping), None)
    except ImportError:  # the class needs a library that is not installed (timm, natten, torchaudio)
        return None


def _contrastive(model_type: str) -> bool:
    """Whether the base model of ``model_type`` computes its own contrastive loss (``return_loss``)."""
    if model_type not in _mapping("MODEL_MAPPING_NAMES"):
        return False
    cls = _model_class(model_type, "MODEL_MAPPING_NAMES")
    try:
        return cls is not None and "return_loss" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError, ImportError):  # ImportError: a placeholder class of a missing library
        return False


def task_for(model_type: str) -> Task:
    """The main head of ``model_type``: the first of ``TASKS`` that lists it (an encoder-decoder's
    seq2seq head before its decoder-only causal LM: BART, Whisper; a causal LM or base model whose
    class takes pixels, Gemma 3's or ViLT's, with images), else the first other head mapping that
    does (no labels: the loss is the mean square of its output)."""
    skip = {"causal-lm"} if _encoder_decoder(model_type) and _in(model_type, "SEQ_TO_SEQ_CAUSAL_LM",
                                                                     "SPEECH_SEQ_2_SEQ") else set()
    for task in TASKS:
        if task.name in skip:
            continue
        if model_type in _mapping(task.mapping) and (task.name != "contrastive" or _contrastive(model_type)):
            if task.name in ("causal-lm", "base") and _takes_pixels(model_type, task.mapping):  # Gemma 3, ViLT
                return replace(task, modalities=("text", "image"))
            return task
    for mapping in _head_mappings():
        if model_type in _mapping(mapping):
            short = mapping.removeprefix("MODEL_FOR_").removesuffix("_MAPPING_NAMES").lower().replace("_", "-")
            return Task(short, mapping, "none", ("text",))
    raise KeyError(f"{model_type!r} has no PyTorch model in the installed transformers (no auto mapping lists it)")


def _takes_pixels(model_type: str, mapping: str) -> bool:
    """Whether the class of ``mapping`` for ``model_type`` takes pixels (``pixel_values``) in its forward."""
    try:
        cls = _model_class(model_type, mapping)
        return cls is not None and "pixel_values" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError, ImportError):  # ImportError: a placeholder class of a missing library
        return False


@cache
def _encoder_decoder(model_type: str) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        return bool(CONFIG_MAPPING[model_type]().is_encoder_decoder)
    except Exception:  # noqa: BLE001 - a config whose defaults do not validate: its mappings decide
        return _in(model_type, "SEQ_TO_SEQ_CAUSAL_LM") and not _in(model_type, "MULTIMODAL_LM")


def category_of(model_type: str) -> str:
    """The row's category: the first that applies of dual encoder (a contrastive base model or a
    zero-shot image classifier), vision-language, encoder-decoder, speech, vision, decoder LM (a
    causal LM without a masked-LM head), encoder (a text encoder's heads), else other."""
    if _contrastive(model_type) or _in(model_type, "ZERO_SHOT_IMAGE_CLASSIFICATION"):
        return "dual encoder"
    if _in(model_type, *_VL):
        return "vision-language"
    if _encoder_decoder(model_type) or _in(model_type, "SEQ_TO_SEQ_CAUSAL_LM") and not _in(model_type, *_SPEECH):
        return "encoder-decoder"
    if _in(model_type, *_SPEECH):
        return "speech"
    if _in(model_type, *_VISION):
        return "vision"
    if _in(model_type, "CAUSAL_LM") and not _in(model_type, "MASKED_LM"):
        return "decoder LM"
    if _in(model_type, "CAUSAL_LM", *_TEXT_ENCODER):
        return "encoder"
    return _category_by_input(model_type)


def _category_by_input(model_type: str) -> str:
    """A type with a base model only (often a composite's part: ``*_vision``, ``*_text``): by what
    its base model takes first."""
    if model_type not in _mapping("MODEL_MAPPING_NAMES"):
        return "other"
    try:
        cls = _model_class(model_type, "MODEL_MAPPING_NAMES")
        main = getattr(cls, "main_input_name", None)
        params = inspect.signature(cls.forward).parameters if cls is not None else {}
    except (ImportError, TypeError, ValueError):  # a placeholder class of a missing library
        return "other"
    if "grid_thw" in params:  # a Qwen-VL-style vision tower: patches and their grid (main_input_name says input_ids)
        return "vision"
    if main in ("pixel_values", "pixel_values_videos"):
        return "vision"
    if main in ("input_features", "input_values", "audio_values"):
        return "speech"
    if main == "input_ids":
        return "decoder LM" if model_type.endswith("_text") else "encoder"
    return "other"


@cache
def _auto_classes() -> dict[str, type]:
    """``{mapping name: the Auto class over it}`` (``AutoModelForCausalLM`` for the causal-LM mapping)."""
    from transformers.models.auto import modeling_auto

    names = {id(_mapping(m)): m for m in _head_mappings()}
    out = {}
    for attr in dir(modeling_auto):
        cls = getattr(modeling_auto, attr)
        inner = getattr(getattr(cls, "_model_mapping", None), "_model_mapping", None)
        if isinstance(cls, type) and attr.startswith("AutoModel") and id(inner) in names:
            out[names[id(inner)]] = cls
    return out


def instantiate(model_type: str, task: Task, config) -> nn.Module:
    """The model of ``task`` for ``config``: through the mapping's Auto class (which picks the text
    sub-config where the class wants it), else the mapped class itself."""
    cls = _model_class(model_type, task.mapping)
    sub = _sub_config_for(cls, config)
    if sub is not None:  # a composite's head over one of its parts (MusicGen's causal LM: its decoder's config)
        return cls._from_config(sub)
    auto = _auto_classes().get(task.mapping)
    if auto is not None and (cls is None or type(config) in auto._model_mapping):  # else the Auto class refuses it
        return auto.from_config(config)
    if cls is None:
        raise KeyError(f"transformers has no class {_class_name(model_type, task.mapping)}")
    return cls._from_config(config)


def _sub_config_for(cls, config):
    """The sub-config of ``config`` that ``cls`` is made from, where ``cls`` takes not ``config``'s own
    class but one of its sub-configs' (else None)."""
    want = getattr(cls, "config_class", None)
    if not isinstance(want, type) or isinstance(config, want):
        return None
    children = (getattr(config, name, None) for name in getattr(config, "sub_configs", {}) or {})
    return next((child for child in children if type(child) is want), None)
