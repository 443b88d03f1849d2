"""More per-family fix-ups of the tiny configs (``model_configs.FAMILY`` lays them over the shrunk
defaults): the types whose defaults leave a size the generic shrink cannot derive — a width that
must equal another field's, a field only a checkpoint carries (None by default), a derived field
that the shrunk defaults pass back stale.  Each is the type's own default with its dims reduced.

Why a function of the tiny sizes (``family_fixes(hidden, heads, vocab)``): ``model_configs`` owns
those sizes and calls it once when it builds ``FAMILY``; importing them from there would be a cycle.
"""

from __future__ import annotations

__all__ = ["family_fixes"]

from typing import Any

_KERNELS = (("long", 7), ("mid", 5), ("short", 3))
#: PP-OCR's detection neck (LKPAN): the intra-class blocks' convolutions, ``(kernel, stride, padding)`` each, as
#: PaddleOCR's IntraCLBlock (a checkpoint carries them; the default is None), the four levels upsampled to
#: the finest (strides 4 to 32) and its head's kernels (the documented default)
_PPOCR_NECK: dict[str, Any] = {
    "intraclass_block_config": {
        "reduce_channel": [1, 1, 0], "return_channel": [1, 1, 0],
        **{f"vertical_long_to_small_conv_{r}ratio": [[k, 1], 1, [k // 2, 0]] for r, k in _KERNELS},
        **{f"horizontal_small_to_long_conv_{r}ratio": [[1, k], 1, [0, k // 2]] for r, k in _KERNELS},
        **{f"symmetric_conv_long_{r}ratio": [k, 1, k // 2] for r, k in _KERNELS}},
    "scale_factor_list": [1, 2, 4, 8], "kernel_list": [3, 2, 2]}
#: PP-LCNetV4 as a detector's backbone: four stages at strides 4 to 32 (its default halves the height only
#: after the second: a recogniser's), 16 to 128 wide; its derived fields (the stale shrunk defaults) restated
_LCNET_V4_DET: dict[str, Any] = {
    "block_configs": [[[3, 16, 16, 1, True]], [[3, 16, 32, 2, False]], [[3, 32, 64, 2, False], [3, 64, 64, 1, True]],
                      [[3, 64, 128, 2, False]]],
    "stem_channels": [3, 8, 16], "stage_out_channels": [16, 32, 64, 128], "depths": [1, 1, 2, 1],
    "out_features": ["stage1", "stage2", "stage3", "stage4"], "out_indices": [1, 2, 3, 4]}
#: UVDoc: its ResNet and dilated bridge a quarter as wide (the same blocks and dilations), every bridge stage
#: out (its head concatenates all six; the default reads the last alone)
_UVDOC: dict[str, Any] = {
    "backbone_config": {
        "resnet_head": [[3, 8], [8, 8]],
        "resnet_configs": [[[8, 8, 1, False], [8, 8, 3, False], [8, 8, 3, False]],
                           [[8, 16, 1, True]] + [[16, 16, 3, False]] * 3, [[16, 32, 1, True]] + [[32, 32, 3, False]] * 5],
        "stage_configs": [[[32, d] for d in s] for s in ((1,), (2,), (5,), (8, 3, 2), (12, 7, 4), (18, 12, 6))],
        "out_features": [f"stage{i}" for i in range(1, 7)], "out_indices": list(range(1, 7))},
    "bridge_connector": [32, 32], "out_point_positions2D": [[32, 8], [8, 2]]}


def family_fixes(hidden: int, heads: int, vocab: int) -> dict[str, Any]:
    """``{model type: fields}`` at the tiny width ``hidden``, ``heads`` attention heads and vocabulary ``vocab``."""
    return {
        # HTSAT: the spectrogram folded (spec_size // num_mel_bins) into a square of spec_size (a quarter of 256),
        # the fold within the last stage's grid (spec_size / 32); patches of its stride; its four stages double
        # the patch width up to the model width
        "clap": {"audio_config": {"spec_size": 64, "num_mel_bins": 32, "patch_size": 4,
                                  "patch_embeds_hidden_size": hidden // 8}},
        # its stages end at the model width (its validator); its 2-D rope's hidden / 4 frequencies are
        # 2 x hidden / heads: its default 8 heads, without grouped KV
        "efficientloftr": {"out_features": [hidden // 4, hidden // 4, hidden // 2, hidden], "stage_num_blocks": [1, 1, 1, 1],
                           "num_attention_heads": 8, "num_key_value_heads": 8},
        "inkling2_vision": {"projection_hidden_dim": 2 * hidden},  # its merger's (4096 by default)
        # two codebooks of the tiny vocabulary; the padding id is the embedding's last row (text vocabulary plus
        # every codebook's), the audio BOS the codebook's last id, as its defaults (69569, 2048)
        "kyutai_speech_to_text": {"num_codebooks": 2, "audio_pad_token_id": 3 * vocab, "audio_bos_token_id": vocab - 1},
        "lw_detr": {"projector_scale_factors": [1.0]},  # its default projects no level: one, at the backbone's scale
        # per-class thresholds and the reading order of its classes (a checkpoint's; None by default), one per
        # label; its reading-order LayoutLM's box embeddings narrower (its boxes stay in 0..1000)
        "pp_doclayout_v2": {"class_thresholds": [0.5, 0.5], "class_order": [0, 1], "reading_order_config": {
            "coordinate_size": 16, "shape_size": 16, "global_pointer_head_size": 16}},
        "pp_doclayout_v3": {"x4_feat_dim": 128 // 16},  # its backbone's first stage, divided by 16 as every stage
        "pp_ocrv5_server_det": {**_PPOCR_NECK, "neck_out_channels": hidden},
        "pp_ocrv6_medium_det": {**_PPOCR_NECK, "neck_out_channels": hidden, "backbone_config": _LCNET_V4_DET},
        "pp_ocrv6_small_det": {"backbone_config": _LCNET_V4_DET,  # its neck reads the four stages
                               "layer_list_out_channels": _LCNET_V4_DET["stage_out_channels"]},
        "superpoint": {"encoder_hidden_sizes": [16, 16, 32, 32], "descriptor_decoder_dim": hidden},  # a quarter
        # its frames 64 wide (its ResNet's 32x leaves 2 x 2, which it pools to 1), the prompt's pad a quarter
        # of the frame as its default's 96 of 448
        "tvp": {"max_img_size": 64, "visual_prompt_size": 16},
        # SAM's last downsampling feeds the CLIP tower as its patches: the tower's width; its text attention
        # has no grouped KV
        "unlimited_ocr": {"vision_config": {"sam_config": {"downsample_channels": [hidden // 2, hidden]}},
                          "text_config": {"num_key_value_heads": heads}},
        "uvdoc": _UVDOC,
        # the semantic HuBERT's frames at the acoustic DAC's tiny hop (2^4; both 320 by default): kernel = stride;
        # 50 frames a second as its default (sample rate 16000 x 16 / 320), so its bandwidth leaves quantizers;
        # the codebook's width is the acoustic and semantic widths side by side
        "xcodec": {"codebook_dim": 2 * hidden, "sample_rate": 800,
                   "semantic_model_config": {"conv_kernel": [8, 2], "conv_stride": [8, 2]}},
    }
