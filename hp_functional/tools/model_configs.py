"""A tiny config of any HF model type: the config class's own defaults with every size field
shrunk consistently (hidden 64, 4 heads of 16, 2 or 4 KV heads, vocabulary 128, 2 to 4 layers,
4 experts of which 2 are routed, MLA ranks of 32 with rope/nope dims of 8), built through the
config class's ``__init__`` so that the family's own validation and derived fields apply.

Why generic: the support table (``benchmarks/models.py``) sweeps every causal-LM model type of
the installed transformers; a table of hand-written configs would go stale with each release.
Per-layer layouts (``layer_types``, hybrid block lists, index lists such as ``full_attn_idxs``)
keep one layer of each distinct kind, so hybrid linear-attention, sliding-window and MoE/dense
mixes are still exercised at 2 to 4 layers.  ``FAMILY`` holds the few per-family fix-ups.
"""

from __future__ import annotations

__all__ = ["VOCAB", "special_ids", "tiny_config_for"]

import functools
import math
from typing import Any

HIDDEN, FFN, MOE_FFN, HEADS, HEAD_DIM, VOCAB, POSITIONS, WINDOW = 64, 128, 64, 4, 16, 128, 64, 4
EXPERTS, TOP_K, RANK, ROPE_DIM = 4, 2, 32, 8
IMAGE, PATCH = 32, 8

_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "num_decoder_layers",
           "depth", "layers")  # depth: a Qwen-VL-style vision tower's blocks; layers: Kosmos-2's text decoder
_ALSO_LAYERS = ("encoder_layers", "num_encoder_layers")
_HIDDEN = ("hidden_size", "d_model", "n_embd", "n_embed", "model_dim", "emb_dim", "embedding_size",
           "word_embed_proj_dim", "input_embedding_size", "output_embedding_size", "lru_width",
           "attention_hidden_size", "backbone_hidden_size", "hidden_dim", "dim",
           "out_hidden_size", "vision_hidden_size", "projection_hidden_size")  # a vision tower's width, its merger's
_FFN = ("intermediate_size", "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "n_inner", "d_ff", "dff", "dim_ff",
        "d_inner", "ffn_hidden_size", "feed_forward_size", "intermediate_size_mlp", "dense_intermediate_size",
        "first_dense_intermediate_size", "mlp_only_intermediate_size")
_MOE_FFN = ("moe_intermediate_size", "shared_expert_intermediate_size", "moe_shared_expert_intermediate_size",
            "shared_experts_intermediate_size", "shared_intermediate_size", "expert_ffn_hidden_size")
_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads", "encoder_attention_heads",
          "num_decoder_attention_heads", "num_encoder_attention_heads", "attention_heads", "swa_num_attention_heads",
          "index_n_heads", "linear_num_heads", "linear_num_value_heads")
_KV = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "num_query_groups",
       "swa_num_key_value_heads", "linear_num_key_heads")
_HEAD_DIM = ("head_dim", "d_head", "dim_head", "attention_head_size", "kv_channels", "swa_head_dim", "index_head_dim",
             "linear_head_dim", "linear_key_head_dim", "linear_value_head_dim", "v_head_dim", "qk_head_dim",
             "attention_head_dim", "mamba_d_head", "mamba_head_dim", "mamba_headdim")
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k")
_SHARED = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
_RANKS = ("q_lora_rank", "kv_lora_rank", "o_lora_rank", "laurel_rank", "gated_norm_rank", "hc_lowrank",
          "loop_gate_rank", "adapter_rank")
_ROPE_DIMS = ("qk_rope_head_dim", "qk_nope_head_dim")
_POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_target_positions",
              "max_source_positions", "context_length", "model_max_length")
_WINDOWS = ("sliding_window", "sliding_window_size", "attention_window_size", "local_attention_window_len",
            "attention_chunk_size")
_FIXED = {  # name -> tiny value, where the default is larger
    "index_topk": 4, "state_size": 16, "ssm_state_size": 16, "mamba_d_state": 16, "mamba_d_conv": 4, "conv_kernel": 4,
    "linear_conv_kernel_dim": 4, "mamba_expand": 2, "expand": 2, "mamba_chunk_size": 8, "time_step_rank": 8,
    "mamba_dt_rank": 8, "mamba_n_heads": 8, "n_mamba_heads": 8,
    "mamba_num_heads": 8, "mamba_d_ssm": 128, "rotary_dim": 8, "hidden_size_per_layer_input": 16,
    "vocab_size_per_layer_input": VOCAB, "num_kv_shared_layers": 0, "pretraining_tp": 1,
    "latent_query_num": 16,  # Kosmos-2(.5): the image's placeholder tokens
}
_INDEX_LISTS = ("full_attn_idxs", "mlp_only_layers", "hybrid_layer_ids", "moe_layers", "attn_layers", "index_layers",
                "ple_layer_ids", "no_rope_layers_idx", "attn_layer_indices", "global_attn_indexes",
                "fullatt_block_indexes", "deepstack_visual_indexes")
_SOURCE_LISTS = ("kv_source_layers",)
_ZERO = ("router_jitter_noise", "input_jitter_noise", "layerdrop", "decoder_layerdrop", "encoder_layerdrop")
_PERIODS = {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
            "first_k_dense_replace": 1, "decoder_sparse_step": 1, "num_dense_layers": 1, "moe_layer_start_index": 1,
            "global_attn_every_n_layers": 2, "global_attention_every_n_layers": 2, "sliding_window_pattern": 2,
            "_sliding_window_pattern": 2, "interleave_moe_layer_step": 1, "no_rope_layer_interval": 2,
            "moe_layer_interval": 1, "layer_group_size": 2, "num_nextn_predict_layers": 0}

#: images, video and audio front ends: name -> the largest tiny value
_MEDIA = {"image_size": IMAGE, "img_size": IMAGE, "patch_size": PATCH, "num_frames": 4, "num_mel_bins": 16,
          "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4, "embed_dim": 32, "groups_width": 8,
          "projection_dim": HIDDEN, "projection_size": HIDDEN,
          "subsampling_conv_channels": 32,  # a conformer's conv subsampling (Parakeet, Canary): a quarter of its width
          "num_position_embeddings": 64,  # a Qwen3-VL tower's position grid (8 x 8, interpolated to the image's)
          "max_num_patches": 64, "patch_embed_hidden_size": 3 * PATCH * PATCH,  # Kosmos-2.5's patches
          "output_channels": HIDDEN, "post_conv_in_channels": HIDDEN,  # a SAM-style vision neck (GOT-OCR2, SLANeXt)
          "pos_emb_height": 8, "pos_emb_width": 8}  # Kimi-K2.5's position grid
#: a wav2vec2-style convolutional feature extractor: two layers (downsampling 10x)
_CONV_STACK = {"conv_dim": [32, 32], "conv_kernel": [10, 3], "conv_stride": [5, 2]}

#: per-stage lists of a hierarchical vision model (Swin, ConvNeXt, ResNet, PVT): see ``_stage_list``
_STAGE_LISTS = ("depths", "hidden_sizes", "embed_dims", "num_heads", "num_attention_heads")

_NONE = {"head_dim": HEAD_DIM, "num_experts_per_tok": TOP_K, "n_routed_experts": EXPERTS, "n_shared_experts": 1}
_PATTERNS = ("layer_types", "layers_block_type", "block_types", "hybrid_override_pattern", "mlp_layer_types",
             "attention_types", "layers_block_types", "segment_types", "prompt_types", "indexer_types",
             "attn_type_list", "layer_block_types")

_QWEN4_INDEXER = {"indexer_n_heads": HEADS, "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM, "indexer_budget": 4,
                  "indexer_compress_ratio": 2}
#: per-family fix-ups applied last (the family's own validation rules the generic pass misses).
FAMILY: dict[str, Any] = {  # a dict of fields, or a function of the KV head count returning one
    "bamba": {"attn_layer_indices": [1]},  # its default is all Mamba: keep one attention layer
    "granitemoehybrid": {"layer_types": ["mamba", "attention"]},
    "recurrent_gemma": {"num_hidden_layers": 3},  # block_types cycles (recurrent, recurrent, attention)
    "mamba2": {"num_heads": 8},  # hidden * expand == num_heads * head_dim
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [HIDDEN // 2, HIDDEN // 2], "axial_pos_shape": [4, 2],
                 "lsh_attn_chunk_length": 4, "local_attn_chunk_length": 4, "num_buckets": 2, "num_hashes": 1,
                 "attn_layers": ["local", "lsh"], "attention_head_size": HEAD_DIM, "max_position_embeddings": 8},
    "zamba2": {"attention_hidden_size": 2 * HIDDEN, "attention_head_dim": 2 * HIDDEN // HEADS},  # attends over [h, emb]
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}},
    "xlstm": {"mode": "train", "chunk_size": 8, "qk_dim_factor": 1.0, "use_cache": False},  # its cached step is in-place
    "rwkv": {"use_cache": False},
    # an audio LM's speech encoder feeds its projector, which feeds the text model: widths the generic pass misses
    "granite_speech": {"projector_config": {"encoder_hidden_size": HIDDEN}},
    "granite_speech_plus": {"projector_config": {"encoder_hidden_size": HIDDEN}},
    "qwen3_asr": {"audio_config": {"output_dim": HIDDEN, "downsample_hidden_size": 32}},  # its conv front end too
    "qwen3_asr_encoder": {"output_dim": HIDDEN, "downsample_hidden_size": 32},
    "mimo_v2_flash": lambda kv: {"num_attention_heads": 2 * kv},  # its sliding layers have 2 * kv KV heads
    "dory": {"use_cache": False, "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "cohere_compass_text": {"layer_types": ["sliding_attention", "full_attention"], "rope_parameters": {
        t: {"rope_type": "default", "rope_theta": 10000.0} for t in ("sliding_attention", "full_attention")}},
    "qwen4_exp_text": _QWEN4_INDEXER,
    "qwen4_exp": {"text_config": _QWEN4_INDEXER},
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
    # their M-RoPE reads vision_start_token_id, which checkpoints carry but the classes do not declare
    "qwen3_omni_moe_thinker": {"vision_start_token_id": VOCAB - 30, "vision_end_token_id": VOCAB - 31},
    "qwen2_5_omni_thinker": {"vision_start_token_id": VOCAB - 30, "vision_end_token_id": VOCAB - 31},
    "zamba": {"num_hidden_layers": 5, "layers_block_type": None,  # two hybrid layers share one transformer
              "attention_hidden_size": 2 * HIDDEN, "attention_head_dim": 2 * HIDDEN // HEADS},
}


def _shrink_int(key: str, value: Any, kv: int) -> Any:
    """The tiny value of one scalar field (``value`` unchanged where no rule applies)."""
    if value is None:  # "derive it": where HF reads the attribute as is, give it the tiny value
        return _NONE.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        return value
    if key in _HIDDEN:
        return HIDDEN
    if key in _FFN:
        return FFN
    if key in _MOE_FFN:
        return MOE_FFN
    if key in ("n_groups", "mamba_n_groups", "mamba_ngroups"):  # SSM B/C groups: one stays one, else one per rank
        return 1 if value == 1 else kv
    if key == "index_num_heads":  # at most the query heads of one key head (Kolibri)
        return max(1, HEADS // kv)
    if key in _HEADS:
        return HEADS
    if key in _HEAD_DIM:
        return HEAD_DIM
    if key in _EXPERTS:
        return EXPERTS if value > 1 else value
    if key in _TOP_K:
        return min(value, TOP_K)
    if key in _SHARED:
        return min(value, 1)
    if key in _RANKS:
        return RANK
    if key in _ROPE_DIMS:
        return ROPE_DIM
    if key in ("n_group", "num_expert_group"):
        return 2 if value > 1 else value
    if key == "topk_group":
        return 1
    if key in _POSITIONS:
        return min(value, POSITIONS)
    if key in _WINDOWS:
        return min(value, WINDOW)
    if key in _FIXED:
        return min(value, _FIXED[key]) if value > 0 else value
    if key in _PERIODS:
        return _PERIODS[key]
    if key.endswith("vocab_size") and key != "type_vocab_size" and value > VOCAB:
        return VOCAB
    return value


def _stage_list(key: str, value: list[int]) -> list[int]:
    """A hierarchical model's per-stage list: 2 blocks in the first stage and 1 after, widths 16, 32,
    64, ... (at most the default), heads a power of two of at most ``HEADS`` (so they divide the widths)."""
    if key == "depths":
        return [min(d, 2 if i == 0 else 1) for i, d in enumerate(value)]
    if key in ("hidden_sizes", "embed_dims"):
        return [min(v, 16 * 2 ** i) for i, v in enumerate(value)]
    return [min(HEADS, 2 ** int(math.log2(h))) if h > 0 else h for h in value]


def _kv_value(default_kv: int | None, kv: int) -> int:
    """Grouped-query attention with ``kv`` groups (a family's multi-query default stays multi-query)."""
    return 1 if default_kv == 1 else kv


def _layer_pick(fields: dict[str, Any], n: int) -> list[int]:
    """The layers kept: the first of each distinct kind over every per-layer list and index list
    (at most 4), at least 2."""
    lists = [v for k, v in fields.items()
             if (isinstance(v, list) or k in _PATTERNS and isinstance(v, str)) and len(v) == n and k not in _INDEX_LISTS]
    idx = [set(v) for k, v in fields.items() if k in _INDEX_LISTS and isinstance(v, list)]
    seen, pick = set(), []
    for i in range(n):
        sig = tuple(str(v[i]) for v in lists) + tuple(i in s for s in idx)
        if sig not in seen:
            seen.add(sig)
            pick.append(i)
    for i in range(n):
        if len(pick) >= 2:
            break
        if i not in pick:
            pick.append(i)
    return sorted(pick[:4])


def _rope(params: Any) -> Any:
    """Rope parameters at the tiny sizes: positions within ``POSITIONS``, per-frequency factor
    lists (longrope) and ``mrope_section`` (sums to half the rotary dim) resized to the tiny head dim."""
    if not isinstance(params, dict):
        return params
    if any(isinstance(v, dict) for v in params.values()):  # per layer type
        return {k: _rope(v) for k, v in params.items()}
    out = dict(params)
    half = int(HEAD_DIM * out.get("partial_rotary_factor", 1.0)) // 2
    for key in ("original_max_position_embeddings", "max_position_embeddings"):
        if isinstance(out.get(key), int):
            out[key] = POSITIONS // 2 if key.startswith("original") else POSITIONS
    for key in ("short_factor", "long_factor"):
        if isinstance(out.get(key), list):
            out[key] = (out[key] * half)[:half]
    sec = out.get("mrope_section")
    if isinstance(sec, list) and sec and sum(sec):
        scaled = [max(1, math.floor(s * half / sum(sec))) for s in sec]
        scaled[0] += half - sum(scaled)
        out["mrope_section"] = scaled
    return out


@functools.cache
def _split_mrope(model_type: str | None) -> list[int] | None:
    """The ``mrope_section`` a model type's modeling code falls back to when its rope parameters
    name none (Qwen2-VL: ``[16, 24, 24]``, half a 128 head dim), where that code splits the rotary
    frequencies by it (a tiny head dim then needs it scaled: ``_rope``), else None."""
    import importlib.util
    import re

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        return None
    module = CONFIG_MAPPING[model_type].__module__.replace(".configuration_", ".modeling_")
    try:
        spec = importlib.util.find_spec(module)
        source = open(spec.origin).read() if spec and spec.origin else ""
    except (ImportError, OSError, ValueError):
        return None
    found = re.search(r'get\("mrope_section",\s*\[([\d,\s]+)\]\)', source)
    if not found or not re.search(r"split\((self\.)?mrope_section", source):
        return None
    return [int(x) for x in found.group(1).split(",") if x.strip()]


def _sub_configs(fields: dict[str, Any]) -> tuple[str, ...]:
    """The sub-config keys of a nested config dict (by its ``model_type``)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING.get(fields.get("model_type", ""), None) if fields.get("model_type") in CONFIG_MAPPING else None
    return tuple(getattr(cls, "sub_configs", {}) or {}) if cls else ()


def shrink(fields: dict[str, Any], kv: int = 2, sub_configs: tuple[str, ...] = (), media: bool = True) -> dict[str, Any]:
    """The overrides that make the config ``fields`` (a ``to_dict()``) tiny; sub-configs recursively;
    with ``media`` also the image, video and audio front ends (``_MEDIA``, ``_CONV_STACK``)."""
    out: dict[str, Any] = {}
    depths = fields.get("depths")
    stages = media and isinstance(depths, list) and bool(depths) and all(isinstance(d, int) for d in depths)
    n = None if stages else next((fields[k] for k in _LAYERS if isinstance(fields.get(k), int)), None)
    pick = _layer_pick(fields, n) if n else None
    for key, value in fields.items():
        if key in sub_configs and isinstance(value, dict):
            out[key] = {**value, **shrink(value, kv, _sub_configs(value), media)}
        elif (key in _LAYERS or key in _ALSO_LAYERS) and (isinstance(value, int) or key not in ("depth", "layers")):
            out[key] = len(pick) if pick and key in _LAYERS else min(value, 2) if isinstance(value, int) else value
        elif key in _KV and (isinstance(value, int) or value is None):
            out[key] = HEADS if "kv_lora_rank" in fields else _kv_value(value, kv)  # MLA: one latent, K/V per head
        elif key in ("head_dim",) and "kv_lora_rank" in fields:  # MLA: rope over qk_rope_head_dim
            out[key] = ROPE_DIM
        elif isinstance(value, dict) and pick and value and all(str(k).isdigit() for k in value):  # per layer index
            out[key] = {pick.index(int(k)): {**v, **shrink(v, kv, media=media)} if isinstance(v, dict) else v
                        for k, v in value.items() if int(k) in pick}
        elif key in _PATTERNS and isinstance(value, list) and pick and len(value) % n == 0 and len(value) > n:
            m = len(value) // n  # several entries per layer (e.g. attention, mlp)
            out[key] = [value[i * m + j] for i in pick for j in range(m)]
        elif key in _SOURCE_LISTS and isinstance(value, list) and pick and len(value) == n:  # per layer: a layer index
            out[key] = [pick.index(value[i]) if value[i] in pick else j for j, i in enumerate(pick)]
        elif key in _INDEX_LISTS and isinstance(value, list) and pick and all(isinstance(i, int) for i in value):
            out[key] = [pick.index(i) for i in value if i in pick]
        elif pick and n and isinstance(value, (list, str)) and len(value) == n and (
                isinstance(value, list) or key in _PATTERNS):
            kept = [value[i] for i in pick]
            out[key] = "".join(kept) if isinstance(value, str) else kept
        elif stages and key in _STAGE_LISTS and isinstance(value, list) and all(isinstance(v, int) for v in value):
            out[key] = _stage_list(key, value)
        elif stages and key in _LAYERS:  # a hierarchical model derives its layer count from depths
            continue
        elif stages and key in ("patch_size", "window_size") and isinstance(value, int):  # 16, 8, 4, 2 in windows of 2
            out[key] = min(value, 2)
        elif media and key in _MEDIA and isinstance(value, int) and not isinstance(value, bool):
            out[key] = min(value, _MEDIA[key])
        elif media and key in _CONV_STACK and isinstance(value, (list, tuple)) and all(
                isinstance(fields.get(k), (list, tuple)) and len(fields[k]) == len(value) for k in _CONV_STACK):
            out[key] = _CONV_STACK[key]
        elif media and key in ("image_size", "img_size") and isinstance(value, (list, tuple)) and len(value) == 2:
            out[key] = [min(v, IMAGE) for v in value]
        elif key.startswith("rope_") and isinstance(value, dict) or key == "rope_scaling":
            sections = _split_mrope(fields.get("model_type")) if isinstance(value, dict) and value and not any(
                isinstance(v, dict) for v in value.values()) and "mrope_section" not in value else None
            out[key] = _rope({**value, "mrope_section": sections} if sections else value)
        elif isinstance(value, float) and ("dropout" in key or key.endswith("pdrop") or key in _ZERO):
            out[key] = 0.0
        elif key.endswith(("token_id", "token_index")) and not key.startswith("decoder_start"):
            out[key] = _token(key, VOCAB if media and value is None and key in _MEDIA_TOKENS else value)
        elif key == "decoder_start_token_id" and isinstance(value, int) and value >= VOCAB:
            out[key] = 2
        else:
            new = _shrink_int(key, value, kv)
            if new is not value:
                out[key] = new
    return out


#: placeholder ids a media config may leave unset (Nemotron-H Omni): given one in the tiny vocabulary
_MEDIA_TOKENS = ("image_token_id", "image_token_index", "video_token_id", "audio_token_id")
_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _token(key: str, value: Any) -> Any:
    """Special token ids inside the tiny vocabulary: pad/bos/eos 0/1/2, others from 127 down."""
    if isinstance(value, list):
        value = [v for v in value if isinstance(v, int) and v < VOCAB] or _TOKENS.get(key, VOCAB - 1)
        return value
    if not isinstance(value, int) or value < VOCAB:
        return value
    return _TOKENS.get(key, VOCAB - 1 - (sum(map(ord, key)) % 24))


def special_ids(config) -> set[int]:
    """Every token id the config names (inputs avoid them: an image token would ask for pixels)."""
    ids: set[int] = set()
    for key, value in config.to_dict().items():
        if key.endswith(("token_id", "token_index")) and key not in _TOKENS:
            ids.update(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
        if isinstance(value, dict) and key.endswith("config"):
            ids.update(v for k, v in value.items() if k.endswith(("token_id", "token_index")) and isinstance(v, int))
    return ids


def tiny_config_for(model_type: str, tp: int = 2, *, media: bool = True, **overrides):
    """The tiny config of ``model_type`` for ``tp`` ranks (4 heads; 2 KV heads at tp 2, 4 at tp 4),
    eager attention; ``media=False`` keeps the image/audio front ends at their defaults (the causal-LM
    rows of the support table, which feed text only).  Raises whatever the config class raises where
    it cannot be made tiny."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    subs = getattr(cls, "sub_configs", {}) or {}
    try:
        fields = cls().to_dict()
    except Exception:  # noqa: BLE001 - a class whose defaults do not validate: shrink the declared defaults
        fields = _declared_defaults(cls)
        for key, sub in subs.items():  # and its sub-configs' own defaults
            spec = (getattr(cls, "sub_configs_defaults", {}) or {}).get(key)
            sub_type = getattr(spec, "model_type", None) or getattr(sub, "model_type", None)
            if fields.get(key) is None and sub_type in CONFIG_MAPPING:
                fields[key] = CONFIG_MAPPING[sub_type]().to_dict()
    kw = shrink(fields, kv=max(2, tp), sub_configs=tuple(subs), media=media)
    if media:
        kw.update(_vision_fixups(fields, kw))
    fix = FAMILY.get(model_type, {})
    for key, value in (fix(max(2, tp)) if callable(fix) else fix).items():
        kw[key] = {**kw[key], **value} if isinstance(value, dict) and isinstance(kw.get(key), dict) else value
    kw.update(overrides)
    config = cls(**kw)
    if media and getattr(config, "is_encoder_decoder", False) and getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0  # T5: labels shifted right from pad
    config._attn_implementation = "eager"
    for sub in getattr(cls, "sub_configs", {}) or {}:
        child = getattr(config, sub, None)
        if child is not None and hasattr(child, "_attn_implementation"):
            child._attn_implementation = "eager"
    return config


def _vision_fixups(fields: dict[str, Any], kw: dict[str, Any]) -> dict[str, Any]:
    """A vision-language config's fields that follow its shrunk vision tower: LLaVA-NeXT's
    any-resolution ``image_grid_pinpoints`` in tiles of the tiny image size, the vision layers
    the projector reads (``vision_feature_layer``, VipLLaVA's list of five) within the tiny
    tower's layers, and Gemma 3's ``mm_tokens_per_image`` a square that divides its patch grid."""
    vision = kw.get("vision_config")
    if not isinstance(vision, dict):
        return {}
    out: dict[str, Any] = {}
    size, patch = vision.get("image_size"), vision.get("patch_size")
    pins = fields.get("image_grid_pinpoints")
    if isinstance(size, int) and isinstance(pins, list) and pins and all(
            isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(v, int) and v > 0 for v in p) for p in pins):
        base = min(min(p) for p in pins)
        out["image_grid_pinpoints"] = [[max(1, round(a / base)) * size, max(1, round(b / base)) * size] for a, b in pins]
    layers = next((vision[k] for k in _LAYERS if isinstance(vision.get(k), int)), None)
    for key in ("vision_feature_layer", "vision_feature_layers"):
        value = fields.get(key)
        if layers and isinstance(value, (int, list)) and not isinstance(value, bool):
            fit = [max(v, -(layers + 1)) if v < 0 else min(v, layers) for v in (value if isinstance(value, list) else [value])
                   if isinstance(v, int)]
            out[key] = fit if isinstance(value, list) else fit[0]
    if isinstance(fields.get("mm_tokens_per_image"), int) and isinstance(size, int) and isinstance(patch, int):
        side = size // patch
        out["mm_tokens_per_image"] = max(1, side // 2) ** 2
    return out


def _declared_defaults(cls) -> dict[str, Any]:
    """The class's declared field defaults (dataclass fields or ``__init__`` keyword defaults)."""
    import dataclasses
    import inspect

    if dataclasses.is_dataclass(cls):
        return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    sig = inspect.signature(cls.__init__)
    return {k: p.default for k, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}
