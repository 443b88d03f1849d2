"""A tiny config of any HF model type: the config class's own defaults with every size field
shrunk consistently (hidden 64, 4 heads of 16, 2 or 4 KV heads, vocabulary 128, 2 to 4 layers,
4 experts of which 2 are routed, MLA ranks of 32 with rope/nope dims of 8), built through the
config class's ``__init__`` so that the family's own validation and derived fields apply.

Why generic: the support table (``benchmarks/models.py``) sweeps every causal-LM model type of
the installed transformers; a table of hand-written configs would go stale with each release.
Per-layer layouts (``layer_types``, hybrid block lists, index lists such as ``full_attn_idxs``)
keep one layer of each distinct kind, so hybrid linear-attention, sliding-window and MoE/dense
mixes are still exercised at 2 to 4 layers.  ``FAMILY`` holds the few per-family fix-ups (more of
them: ``model_configs_fixes``).
"""

from __future__ import annotations

__all__ = ["IMAGE", "VOCAB", "special_ids", "tiny_config_for"]

import functools
import math
from typing import Any

from .model_configs_fixes import family_fixes

HIDDEN, FFN, MOE_FFN, HEADS, HEAD_DIM, VOCAB, POSITIONS, WINDOW = 64, 128, 64, 4, 16, 128, 64, 4
EXPERTS, TOP_K, RANK, ROPE_DIM = 4, 2, 32, 8
IMAGE, PATCH = 32, 8

_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "num_decoder_layers",
           "depth", "layers")  # depth: a Qwen-VL-style vision tower's blocks; layers: Kosmos-2's text decoder
_ALSO_LAYERS = ("encoder_layers", "num_encoder_layers", "pred_num_hidden_layers")
_HIDDEN = ("hidden_size", "d_model", "reassemble_hidden_size", "n_embd", "n_embed", "model_dim", "emb_dim", "embedding_size",
           "word_embed_proj_dim", "input_embedding_size", "output_embedding_size", "lru_width",
           "attention_hidden_size", "backbone_hidden_size", "hidden_dim", "dim",
           "out_hidden_size", "vision_hidden_size", "projection_hidden_size",
           "hidden_size_global", "output_dim", "pred_hidden_size", "audio_hidden_size", "projector_hidden_size",
           "codebook_dim", "vector_quantization_hidden_dimension", "upsample_groups", "encoder_hidden_size",
           "cross_hidden_size", "pooler_output_size", "mit_hidden_size", "vit_dim", "output_proj_dims",
           # a vision tower's width, its merger's; a codec's; a neck's; a detector's encoder's
           "encoder_hidden_dim", "text_hidden_size", "condition_dim", "decoder_hidden_size")
_FFN = ("intermediate_size", "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "n_inner", "d_ff", "dff", "dim_ff",
        "d_inner", "ffn_hidden_size", "feed_forward_size", "intermediate_size_mlp", "dense_intermediate_size",
        "first_dense_intermediate_size", "mlp_only_intermediate_size", "mlp_dim", "alignment_intermediate_size",
        "mit_intermediate_size")
_MOE_FFN = ("moe_intermediate_size", "shared_expert_intermediate_size", "moe_shared_expert_intermediate_size",
            "shared_experts_intermediate_size", "shared_intermediate_size", "expert_ffn_hidden_size")
_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads", "encoder_attention_heads",
          "num_decoder_attention_heads", "num_encoder_attention_heads", "attention_heads", "swa_num_attention_heads",
          "index_n_heads", "linear_num_heads", "linear_num_value_heads", "pred_num_attention_heads")
_KV = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "num_query_groups",
       "swa_num_key_value_heads", "linear_num_key_heads")
_HEAD_DIM = ("head_dim", "d_head", "dim_head", "attention_head_size", "kv_channels", "swa_head_dim", "index_head_dim",
             "linear_head_dim", "linear_key_head_dim", "linear_value_head_dim", "v_head_dim", "qk_head_dim", "cross_head_dim",
             "attention_head_dim", "mamba_d_head", "mamba_head_dim", "mamba_headdim")
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k")
_SHARED = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
_RANKS = ("q_lora_rank", "kv_lora_rank", "o_lora_rank", "laurel_rank", "gated_norm_rank", "hc_lowrank",
          "loop_gate_rank", "adapter_rank")
_ROPE_DIMS = ("qk_rope_head_dim", "qk_nope_head_dim")
_POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_target_positions",
              "max_source_positions", "context_length", "model_max_length", "max_encoder_position_embeddings",
              "max_decoder_position_embeddings")
_WINDOWS = ("sliding_window", "sliding_window_size", "attention_window_size", "local_attention_window_len",
            "attention_chunk_size")
_FIXED = {  # name -> tiny value, where the default is larger
    "index_topk": 4, "state_size": 16, "ssm_state_size": 16, "mamba_d_state": 16, "mamba_d_conv": 4, "conv_kernel": 4,
    "linear_conv_kernel_dim": 4, "mamba_expand": 2, "expand": 2, "mamba_chunk_size": 8, "time_step_rank": 8,
    "mamba_dt_rank": 8, "mamba_n_heads": 8, "n_mamba_heads": 8,
    "mamba_num_heads": 8, "mamba_d_ssm": 128, "rotary_dim": 8, "hidden_size_per_layer_input": 16,
    "vocab_size_per_layer_input": VOCAB, "num_kv_shared_layers": 0, "pretraining_tp": 1,
    "latent_query_num": 16,  # Kosmos-2(.5): the image's placeholder tokens
    # a dense-prediction neck and head (DPT, Depth Anything, ZoeDepth, VitMatte) and a detector's queries (DETR family)
    "fusion_hidden_size": 32, "head_hidden_size": 16, "bottleneck_features": 32, "bin_embedding_dim": 16,
    "number_output_channels": 32, "num_depth_bins": 16, "num_queries": 8, "num_relative_features": 8,
    "fpn_hidden_size": 32, "encoder_hash_byte_group_vocab": VOCAB, "upsample_initial_channel": 32,
    "context_size": 32,  # a conformer's attention context (Granite Speech 5), within the tiny positions
    # a vision tower's learned position grid, sized by the largest image it takes (RADIO, HunYuan-VL,
    # Gemma 4): within twice the tiny image's side, so the grid does not outweigh the tiny tower
    "max_img_size": 64, "max_image_size": 64, "position_embedding_size": 64,
    "num_bpe_labels": VOCAB, "num_wordpiece_labels": VOCAB,  # MGP-STR's subword heads: vocabularies
    "head_out_channels": VOCAB,  # a text recogniser's characters (PP-OCR)
    "index_kpool": 2, "num_windows": 4,  # GLM-5-Next's index pooling (divides index_topk); LW-DETR's windows
    "codebook_size": 64, "num_embeddings": VOCAB,  # an audio codec's or an image VQ's codebook
    "base_channels": 32, "latent_channels": 32,  # (GroupNorm of 32) an image VQ-VAE's convolutions (Janus, Chameleon)
}
#: a neck's per-stage widths (DPT's ``neck_hidden_sizes``): 16, 32, 64, ... (at most the default)
#: a ConvNet's chained per-stage channel lists (HGNet-v2, the D-FINE family's encoder inputs): all divided by 16
_CHANNEL_LISTS = ("stage_in_channels", "stage_mid_channels", "stage_out_channels", "encoder_in_channels")
_WIDTH_LISTS = ("neck_hidden_sizes", "post_process_channels", "convstream_hidden_sizes", "fusion_hidden_sizes",
                "scaled_images_feature_dims", "intermediate_feature_dims", "downsample_channels", "enc_channels")
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
          "pos_emb_height": 8, "pos_emb_width": 8,  # Kimi-K2.5's position grid
          "pretrain_image_size": IMAGE, "crop_size": IMAGE,
          "frames_per_clip": 4, "image_embedding_size": IMAGE // PATCH,  # (SAM: its prompt encoder's grid)
          "num_pos_feats": HIDDEN // 2, "iou_head_hidden_dim": HIDDEN}  # (SAM: its positional features, IoU head)
#: a wav2vec2-style convolutional feature extractor: two layers (downsampling 10x)
_CONV_STACK = {"conv_dim": [32, 32], "conv_kernel": [10, 3], "conv_stride": [5, 2]}

#: per-stage lists of a hierarchical vision model (Swin, ConvNeXt, ResNet, PVT): see ``_stage_list``
_STAGE_LISTS = ("depths", "hidden_sizes", "embed_dims", "num_heads", "num_attention_heads")

_NONE = {"vocab_size": VOCAB, "head_dim": HEAD_DIM, "num_experts_per_tok": TOP_K, "n_routed_experts": EXPERTS,
         "n_shared_experts": 1}
_PATTERNS = ("layer_types", "layers_block_type", "block_types", "hybrid_override_pattern", "mlp_layer_types",
             "attention_types", "layers_block_types", "segment_types", "prompt_types", "indexer_types",
             "attn_type_list", "layer_block_types")

_QWEN4_INDEXER = {"indexer_n_heads": HEADS, "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM, "indexer_budget": 4,
                  "indexer_compress_ratio": 2}
_COMPASS_TEXT = {"layer_types": ["sliding_attention", "full_attention"], "rope_parameters": {
    t: {"rope_type": "default", "rope_theta": 10000.0} for t in ("sliding_attention", "full_attention")}}


def _resnet(*outs: str):
    """A tiny ResNet backbone config (basic blocks, one per stage, 16 to 64 wide) with the stages ``outs``
    out: the DETR family's default backbone is timm's, a library not installed here."""
    from transformers import ResNetConfig

    return ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 64], depths=[1, 1, 1, 1], layer_type="basic",
                        out_features=list(outs))


#: SAM 2's Hiera at the tiny sizes: one block per stage (the global-attention one unpooled), widths 16 to 128
_HIERA = {"hidden_size": 16, "num_attention_heads": 1, "blocks_per_stage": [1, 1, 1, 1], "global_attention_blocks": [0],
          "embed_dim_per_stage": [16, 32, 64, 128], "num_attention_heads_per_stage": [1, 1, 2, 4],
          "window_size_per_stage": [4, 4, 4, 4]}
_SAM2_VISION = {"backbone_config": _HIERA, "backbone_channel_list": [128, 64, 32, 16]}
#: per-family fix-ups applied last (the family's own validation rules the generic pass misses).
FAMILY: dict[str, Any] = {  # a dict of fields, or a function of the KV head count returning one
    # the DETR family: a tiny ResNet backbone instead of timm's (the last stage; Deformable DETR's three levels)
    **{t: lambda kv: {"backbone_config": _resnet("stage4")} for t in (
        "detr", "conditional_detr", "dab-detr", "table-transformer")},
    "deformable_detr": lambda kv: {"backbone_config": _resnet("stage2", "stage3", "stage4")},
    # 4 codebooks, not 32: its audio tables and codebook heads are one per codebook
    "csm": {"num_codebooks": 4, "depth_decoder_config": {"num_codebooks": 4}, "codec_config": {"num_quantizers": 4}},
    "led": {"attention_window": 8},  # its encoder pads the input to the window: within the tiny positions
    # one tag and one subscript table per XPath depth: 4 depths, not 50; a subscript vocabulary of 128
    "markuplm": {"max_depth": 4, "max_xpath_subs_unit_embeddings": VOCAB, "subs_pad_id": VOCAB - 1},
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
    "cohere_compass_text": _COMPASS_TEXT,
    "cohere_compass": {"text_config": _COMPASS_TEXT},
    "qwen4_exp_text": _QWEN4_INDEXER,
    "qwen4_exp": {"text_config": _QWEN4_INDEXER},
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
    # their M-RoPE reads vision_start_token_id, which checkpoints carry but the classes do not declare
    "qwen3_omni_moe_thinker": {"vision_start_token_id": VOCAB - 30, "vision_end_token_id": VOCAB - 31},
    "qwen2_5_omni_thinker": {"vision_start_token_id": VOCAB - 30, "vision_end_token_id": VOCAB - 31},
    # composites of two configs: the ids their labels are shifted with
    "encoder-decoder": {"pad_token_id": 0, "decoder_start_token_id": 2},
    "speech-encoder-decoder": {"pad_token_id": 0, "decoder_start_token_id": 2},
    "vision-encoder-decoder": {"pad_token_id": 0, "decoder_start_token_id": 2},
    "moonshine": {"pad_token_id": 0},
    # probabilistic time-series transformers: no default horizon; one time feature (their inputs: sweep_inputs)
    **{t: {"prediction_length": 4, "context_length": 8, "lags_sequence": [1, 2], "num_time_features": 1}
       for t in ("autoformer", "informer", "time_series_transformer")},
    # Autoformer's decoder starts from the context's last label_length steps (its default 10: more than the context)
    "autoformer": {"prediction_length": 4, "context_length": 8, "lags_sequence": [1, 2], "num_time_features": 1,
                   "label_length": 4},
    "esm": {"vocab_size": VOCAB, "pad_token_id": 0, "mask_token_id": VOCAB - 1},  # its defaults leave both unset
    "step3p7": {"text_config": {"sliding_window": WINDOW}},
    # its masked-LM decoder answers at every position: ids of that length; its latents at the tiny width
    "perceiver": {"max_position_embeddings": 8, "d_latents": HIDDEN, "num_latents": 16, "num_self_attends_per_block": 2},
    "lilt": {"hidden_size": 96},  # its layout stream: six box embeddings of hidden / channel_shrink_ratio (4) / 6
    "esmc": lambda kv: {"num_key_value_heads": HEADS},  # no grouped-query attention
    # NeMo's conformers: no grouped-query attention
    "nemotron3_diarization_audio": {"num_key_value_heads": HEADS},
    "nemotron3_diarization": {"audio_config": {"num_key_value_heads": HEADS}},
    "nemotron3_5_transcribe_asr_audio": {"num_key_value_heads": HEADS},
    "nemotron3_5_transcribe_word_timestamp": {"num_key_value_heads": HEADS},
    "nemotron3_5_transcribe_audio": {"asr_config": {"num_key_value_heads": HEADS},
                                     "diarization_config": {"audio_config": {"num_key_value_heads": HEADS}}},
    "fun_asr_nano": {"adaptor_config": {"intermediate_size": HIDDEN // 4}},  # its adaptor: a quarter of the text width
    "molmo2": {"adapter_config": {"vision_feature_layer": [-1, -2]}},  # within the tiny tower
    "fastspeech2_conformer_with_hifigan": {"vocoder_config": {"model_in_dim": 16}},  # the tiny mel bins (_MEDIA)
    # EfficientNet's widths scale by width_coefficient, its head is round_filters(1280) wide: both to the tiny width
    "efficientnet": {"width_coefficient": HIDDEN / 1280, "hidden_dim": HIDDEN},
    "align": {"vision_config": {"width_coefficient": HIDDEN / 320}},  # its image embedding: the last block's 320
    # HunYuan-VL's text rope: four multimodal axes (sequence, width, height, image) over half the tiny head dim
    "hunyuan_vl_text": {"rope_parameters": {"mrope_section": [2, 2, 2, 2]}},
    "hunyuan_vl": {"text_config": {"rope_parameters": {"mrope_section": [2, 2, 2, 2]}}},
    # Granite 4 Vision: vision layer -> LLM layer injections, spatial targets, within the tiny layers
    "granite4_vision": {"deepstack_layer_map": [[0, 0], [1, 1]], "spatial_target_layers": [0, 1, 0, 1],
                        "downsample_rate": "1/2"},
    # LayoutLMv3's 2-D position embeddings: x0, y0, x1, y1 (coordinate_size) and h, w (shape_size) make the width
    "layoutlmv3": {"coordinate_size": 12, "shape_size": 8, "input_size": IMAGE},
    "superglue": {"keypoint_encoder_sizes": [16, 32], "gnn_layers_types": ["self", "cross"], "sinkhorn_iterations": 4,
                  "keypoint_detector_config": {"descriptor_decoder_dim": HIDDEN}},
    "lightglue": {"descriptor_dim": HIDDEN},
    "bit": {"num_groups": 2},  # its GroupNorms over the tiny bottleneck widths (a quarter of 16)
    "textnet": {"stem_out_channels": 16},  # its first stage's width
    "mobilevitv2": {"image_size": 64},  # it downsamples 32x, then unfolds patches of 2
    "vitmatte": {"backbone_config": {"patch_size": 16}},  # its detail stream meets the ViT's features at 1/16
    # Apertus 1.5: image then audio codebook ranges (64 each) after the text tokens, within the vocabulary
    "apertus1p5": {"image_token_offset": 64, "audio_token_offset": 128, "text_config": {"vocab_size": 256}},
    "dots3_note_text": {"head_dim": 2 * ROPE_DIM},  # its sliding layers: qk_nope_head_dim + qk_rope_head_dim
    "dots3_note": {"text_config": {"head_dim": 2 * ROPE_DIM},  # its towers' adapters: from the tiny widths
                   "vision_config": {"adapter_in_dim": HIDDEN, "adapter_out_dim": HIDDEN},
                   "audio_config": {"adapter_input_size": HIDDEN, "adapter_out_dim": HIDDEN, "downsample_hidden_size": 32}},
    "glm5_next_text": {"qk_rope_head_dim": 0},  # its DSA layers are NoPE (the default's 0)
    "glm5_next": {"text_config": {"qk_rope_head_dim": 0}},
    # one patch size, width and depth per layer (4 stages, its default count); input_values: sweep_inputs
    "muse_spark_audio": {"num_hidden_layers": 4, "hidden_sizes": [16, 32, 64, 64]},
    "muse_spark": {"audio_config": {"num_hidden_layers": 4, "hidden_sizes": [16, 32, 64, 64]}},
    # MusicGen's causal LM (its decoder): one codebook (ids batch x codebooks flat; labels per codebook: sweep_inputs)
    "musicgen": {"decoder": {"num_codebooks": 1}},
    "musicgen_melody": {"decoder": {"num_codebooks": 1}},
    # fields the classes read that their default configs do not carry
    "moonshine_streaming": {"num_key_value_heads": HEADS},
    "blt": {"num_hidden_layers": 2},
    "t5gemma2_encoder": {"text_config": {"dropout_rate": 0.0}},
    # Granite Speech 5's conformer: no grouped-query attention (its input features: sweep_inputs)
    "granite_speech5_encoder": {"num_key_value_heads": HEADS},
    "granite_speech5_ctc": {"encoder_config": {"num_key_value_heads": HEADS}},
    "nemotron_asr_streaming_encoder": {"num_key_value_heads": HEADS},  # NeMo's conformers: no grouped-query attention
    "nemotron_asr_streaming": {"encoder_config": {"num_key_value_heads": HEADS}},
    "nemotron3_5_asr": {"encoder_config": {"num_key_value_heads": HEADS}},
    "audio-spectrogram-transformer": {"max_length": 32},  # its spectrogram's frames (its position grid)
    # EoMT: its last num_blocks layers take the queries (the default 4 is more than the tiny layers)
    **{t: {"num_blocks": 1, "num_hidden_layers": 3} for t in ("eomt", "eomt_dinov3")},
    # LeViT: its convolutional stem downsamples 16x whatever patch_size says; attention biases per resolution
    "levit": {"patch_size": 16, "image_size": 64},
    "pi0": {"chunk_size": 4}, "pi05": {"chunk_size": 4},  # the action chunk (its inputs: sweep_inputs)
    "deepseek_ocr2": {"text_config": {"mlp_layer_types": ["dense", "sparse"]}},  # its default is None
    # Diffusion Gemma's MoE: its defaults leave the experts unset
    "diffusion_gemma": {"text_config": {"num_experts": EXPERTS, "moe_intermediate_size": FFN // 4, "top_k_experts": TOP_K}},
    "instructblipvideo": {"video_token_index": VOCAB - 8},  # its placeholder id (the default leaves it unset)
    "mistral4": {"head_dim": 2 * ROPE_DIM},  # its rotary dims: head_dim x partial_rotary_factor (1/2) = qk_rope_head_dim
    # Pix2Struct: heads x d_kv must be the width (its attention output maps the width, not heads x d_kv)
    "pix2struct": {"vision_config": {"d_kv": HEAD_DIM}, "text_config": {"d_kv": HEAD_DIM}},
    # Sapiens 2: a KV head count per layer (its default's 24 entries) and one for its attention heads
    "sapiens2": lambda kv: {"num_key_value_heads_per_layer": [kv, kv], "num_key_value_attention_heads": kv},
    # CLVP's rotary embedding is at least 32 wide: heads of 32 (width 128) in its text and speech encoders
    "clvp": {"text_config": {"hidden_size": 2 * HIDDEN}, "speech_config": {"hidden_size": 2 * HIDDEN}},
    # Depth Pro: crops of patch_size (its default 384) at 1/4, 1/2 and 1 of the image; hooks within the tiny layers
    "depth_pro": {"patch_size": 4 * PATCH, "intermediate_hook_ids": [1, 0]},
    # SAM 3: its FPN at the model width (its DETR encoder adds them); the tracker's feature maps at 4x, 2x, 1x the
    # tiny ViT's 4 x 4 grid
    **{t: {"vision_config": {"fpn_hidden_size": HIDDEN}} for t in ("sam3", "sam3_lite_text")},
    "sam3_tracker": {"vision_config": {"fpn_hidden_size": HIDDEN, "backbone_feature_sizes": [[16, 16], [8, 8], [4, 4]]}},
    "sam2_hiera_det_model": _HIERA,
    "sam2_vision_model": _SAM2_VISION,
    # SAM 2: its FPN at the model width, feature maps of the 32 x 32 image at strides 4, 8, 16; prompts at stride 16
    "sam2": {"vision_config": {**_SAM2_VISION, "fpn_hidden_size": HIDDEN, "backbone_feature_sizes": [[8, 8], [4, 4], [2, 2]]},
             "prompt_encoder_config": {"patch_size": 16}},
    # ERNIE 4.5-VL's 3-D rope: its default sections (22, 22, 20) over the tiny head dim's 8 frequencies
    "ernie4_5_vl_moe": {"text_config": {"rope_parameters": {"mrope_section": [3, 3, 2]}}},
    # X-Codec 2 and NeuCodec: the quantizer's projection at the tiny width; their transformers without grouped KV
    **{t: {"quantization_dim": FFN, "num_key_value_heads": HEADS} for t in ("xcodec2", "neucodec")},
    "zamba": {"num_hidden_layers": 5, "layers_block_type": None,  # two hybrid layers share one transformer
              "attention_hidden_size": 2 * HIDDEN, "attention_head_dim": 2 * HIDDEN // HEADS},
    **family_fixes(HIDDEN, HEADS, VOCAB),  # more, in their own module (model_configs_fixes)
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


def _rope(params: Any, head: int = HEAD_DIM) -> Any:
    """Rope parameters at the tiny sizes: positions within ``POSITIONS``, per-frequency factor
    lists (longrope) and ``mrope_section`` (sums to half the rotary dim) resized to the tiny rotary
    ``head`` dim (MLA's: its ``qk_rope_head_dim``)."""
    if not isinstance(params, dict):
        return params
    if any(isinstance(v, dict) for v in params.values()):  # per layer type
        return {k: _rope(v, head) for k, v in params.items()}
    out = dict(params)
    half = int(head * out.get("partial_rotary_factor", 1.0)) // 2
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


#: a rule's answer where the key is not its own (the next rule decides); ``_SKIP``: leave the key unset
_PASS, _SKIP = object(), object()


def shrink(fields: dict[str, Any], kv: int = 2, sub_configs: tuple[str, ...] = (), media: bool = True) -> dict[str, Any]:
    """The overrides that make the config ``fields`` (a ``to_dict()``) tiny; sub-configs recursively;
    with ``media`` also the image, video and audio front ends (``_MEDIA``, ``_CONV_STACK``).  Each key
    goes through ``_layer_value``, ``_media_value``, ``_other_value`` in turn (the first that knows it
    decides), else ``_shrink_int``."""
    out: dict[str, Any] = {}
    depths = fields.get("depths")
    stages = media and isinstance(depths, list) and bool(depths) and all(isinstance(d, int) for d in depths)
    n = None if stages else next((fields[k] for k in _LAYERS if isinstance(fields.get(k), int)), None)
    pick = _layer_pick(fields, n) if n else None
    for key, value in fields.items():
        new = _layer_value(key, value, fields, kv, sub_configs, media, pick, n)
        if new is _PASS:
            new = _media_value(key, value, fields, media, stages)
        if new is _PASS:
            new = _other_value(key, value, fields, media)
        if new is _PASS:
            new = _shrink_int(key, value, kv)
            if new is value:
                continue
        if new is not _SKIP:
            out[key] = new
    if not stages:
        out.update(_backbone_outputs(fields, out))
    out.update(_codec_ratios(fields))
    return out


def _layer_value(key: str, value: Any, fields: dict[str, Any], kv: int, sub_configs: tuple[str, ...], media: bool,
                 pick: list[int] | None, n: int | None) -> Any:
    """``key``'s tiny value where it is a nested config, a layer count, a KV head count or a per-layer
    list or dict (kept at the ``pick``ed layers of ``n``); else ``_PASS``."""
    per_index = isinstance(value, dict) and bool(value) and all(str(k).isdigit() for k in value)
    # a nested config (ColPali's VLM's, a diarization head's), not a per-layer dict
    if isinstance(value, dict) and (key in sub_configs or value.get("model_type") or key.endswith("_config")) and \
            not key.startswith("rope_") and not per_index:
        return {**value, **shrink(value, kv, _sub_configs(value), media)}
    if (key in _LAYERS or key in _ALSO_LAYERS) and (isinstance(value, int) or key not in ("depth", "layers")):
        return len(pick) if pick and key in _LAYERS else min(value, 2) if isinstance(value, int) else value
    if key in _KV and (isinstance(value, int) or value is None):
        return HEADS if "kv_lora_rank" in fields else _kv_value(value, kv)  # MLA: one latent, K/V per head
    if key in ("head_dim",) and "kv_lora_rank" in fields:  # MLA: rope over qk_rope_head_dim
        return ROPE_DIM
    if not pick:
        return _PASS
    if per_index:  # per layer index
        return {pick.index(int(k)): {**v, **shrink(v, kv, media=media)} if isinstance(v, dict) else v
                for k, v in value.items() if int(k) in pick}
    if key in _PATTERNS and isinstance(value, list) and len(value) % n == 0 and len(value) > n:
        m = len(value) // n  # several entries per layer (e.g. attention, mlp)
        return [value[i * m + j] for i in pick for j in range(m)]
    if key in _SOURCE_LISTS and isinstance(value, list) and len(value) == n:  # per layer: a layer index
        return [pick.index(value[i]) if value[i] in pick else j for j, i in enumerate(pick)]
    if key in _INDEX_LISTS and isinstance(value, list) and all(isinstance(i, int) for i in value):
        return [pick.index(i) for i in value if i in pick]
    if n and isinstance(value, (list, str)) and len(value) == n and (isinstance(value, list) or key in _PATTERNS):
        kept = [FFN if key in _FFN and isinstance(value[i], int) else value[i] for i in pick]  # Gemma 3n's widths
        return "".join(kept) if isinstance(value, str) else kept
    return _PASS


def _ints(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _media_value(key: str, value: Any, fields: dict[str, Any], media: bool, stages: bool) -> Any:
    """``key``'s tiny value where it sizes a hierarchical model's stages or (with ``media``) an
    image, video or audio front end, a neck or a ConvNet's channels; else ``_PASS``."""
    if stages and key in _STAGE_LISTS and isinstance(value, list) and _ints(value):
        return _stage_list(key, value)
    if stages and key in _LAYERS:  # a hierarchical model derives its layer count from depths
        return _SKIP
    if stages and key in ("patch_size", "window_size") and isinstance(value, int):  # 16, 8, 4, 2 in windows of 2
        return min(value, 2)
    if not media:
        return _PASS
    if key in _MEDIA and isinstance(value, int) and not isinstance(value, bool):
        return min(value, _MEDIA[key])
    if key in _CONV_STACK and isinstance(value, (list, tuple)) and all(
            isinstance(fields.get(k), (list, tuple)) and len(fields[k]) == len(value) for k in _CONV_STACK):
        return _CONV_STACK[key]
    if key == "num_feat_extract_layers" and all(isinstance(fields.get(k), (list, tuple)) for k in _CONV_STACK):
        return len(_CONV_STACK["conv_dim"])  # a derived field its to_dict() carries
    if key in ("image_size", "img_size") and isinstance(value, (list, tuple)) and len(value) == 2:
        return [min(v, IMAGE) for v in value]
    if (key in _WIDTH_LISTS or stages and key == "embed_dim") and _ints(value):
        return [min(v, 16 * 2 ** i) for i, v in enumerate(value)]
    if key in _CHANNEL_LISTS and isinstance(value, list) and _ints(value):
        return [max(1, v // 16) for v in value]
    if key == "stem_channels" and isinstance(fields.get("stage_in_channels"), list) and isinstance(
            value, list) and len(value) > 1:  # HGNet-v2's stem: the image's channels, then as the stages
        return [value[0], *(max(1, v // 16) for v in value[1:])]
    if key == "decoder_in_channels" and isinstance(value, list) and isinstance(
            fields.get("encoder_hidden_dim"), int):  # the D-FINE family: the encoder's width per level
        return [HIDDEN] * len(value)
    if key == "patch_size" and isinstance(value, (list, tuple)) and len(value) == 2:
        return [min(v, PATCH) for v in value]
    return _PASS


def _other_value(key: str, value: Any, fields: dict[str, Any], media: bool) -> Any:
    """``key``'s tiny value where it is rope parameters, a dropout or a special token id; else ``_PASS``."""
    if key.startswith("rope_") and isinstance(value, dict) or key == "rope_scaling":
        sections = _split_mrope(fields.get("model_type")) if isinstance(value, dict) and value and not any(
            isinstance(v, dict) for v in value.values()) and "mrope_section" not in value else None
        head = ROPE_DIM if "qk_rope_head_dim" in fields else HEAD_DIM  # MLA rotates its rope dims only
        return _rope({**value, "mrope_section": sections} if sections else value, head)
    if isinstance(value, float) and ("dropout" in key or key.endswith("pdrop") or key in _ZERO):
        return 0.0
    if key.endswith(("token_id", "token_index")) and not key.startswith("decoder_start"):
        return _token(key, VOCAB if media and value is None and key in _MEDIA_TOKENS else value)
    if key == "decoder_start_token_id" and isinstance(value, int) and value >= VOCAB:
        return 2
    return _PASS


def _codec_ratios(fields: dict[str, Any]) -> dict[str, Any]:
    """An audio codec's down/upsampling ratios at 2 each (DAC's 512x would leave ``SAMPLES`` one frame),
    its ``hop_length`` their product."""
    down = fields.get("downsampling_ratios")
    if not isinstance(down, list) or not down or not all(isinstance(v, int) for v in down):
        up = fields.get("upsampling_ratios")  # Mimi's SEANet: num_filters doubled per ratio
        if isinstance(up, list) and up and isinstance(fields.get("num_filters"), int):
            return {"num_filters": max(1, HIDDEN // 2 ** len(up))}
        return {}
    out: dict[str, Any] = {"downsampling_ratios": [min(v, 2) for v in down]}
    up = fields.get("upsampling_ratios")
    if isinstance(up, list) and all(isinstance(v, int) for v in up):
        out["upsampling_ratios"] = [min(v, 2) for v in up]
    if isinstance(fields.get("hop_length"), int):
        out["hop_length"] = math.prod(out["downsampling_ratios"])
    for key in ("encoder_hidden_size", "num_filters"):  # the first stage's width, doubled per ratio up to hidden
        if isinstance(fields.get(key), int):
            out[key] = max(1, HIDDEN // 2 ** len(down))
    if isinstance(fields.get("decoder_hidden_size"), int):
        out["decoder_hidden_size"] = HIDDEN
    return out


def _backbone_outputs(fields: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """A plain (not hierarchical) backbone's ``out_indices`` within its tiny layers: as many outputs as
    its default (a DPT neck reads four), the last layers, its layer count raised to that many."""
    indices = fields.get("out_indices")
    key = next((k for k in _LAYERS if isinstance(out.get(k), int)), None)
    if key is None or not isinstance(indices, list) or not indices or not all(isinstance(i, int) for i in indices):
        return {}
    layers = max(out[key], min(len(indices), 4))
    kept = list(range(layers - min(len(indices), 4) + 1, layers + 1))
    return {key: layers, "out_indices": kept, "out_features": [f"stage{i}" for i in kept],
            **({"stage_names": ["stem", *(f"stage{i}" for i in range(1, layers + 1))]} if "stage_names" in fields else {})}


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
    kw = _merged(kw, fix(max(2, tp)) if callable(fix) else fix)
    kw.update(overrides)
    config = cls(**kw)
    if media and getattr(config, "is_encoder_decoder", False) and getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0  # T5: labels shifted right from pad
    config._attn_implementation = "eager"
    if getattr(config, "architectures", []) is None:  # an Auto class over a tuple of heads iterates it (DeiT, LeViT)
        config.architectures = []
    for sub in getattr(cls, "sub_configs", {}) or {}:
        child = getattr(config, sub, None)
        if child is not None and hasattr(child, "_attn_implementation"):
            child._attn_implementation = "eager"
    return config


def _merged(base: dict[str, Any], fix: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``fix`` laid over it, nested dicts (sub-configs) merged key by key."""
    out = dict(base)
    for key, value in fix.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


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
