"""The support table's rows before any sharding: every model type with a PyTorch model is listed,
each gets its main head and a category, and the inputs built for it from its tiny config are ones
the unsharded model runs on, reaching the parameters of every modality (one type per category)."""

import pytest
import torch

from hp_functional.tools.model_configs import tiny_config_for
from hp_functional.tools.sweep import build
from hp_functional.tools.sweep_inputs import BATCH, NUM_LABELS, config_overrides, loss_of
from hp_functional.tools.sweep_tasks import CATEGORIES, TASKS, category_of, model_types, task_for


def test_every_type_with_a_pytorch_model_is_listed_once():
    from transformers.models.auto import modeling_auto as ma

    types = model_types()
    assert len(types) == len(set(types))
    for mapping in ("MODEL_MAPPING_NAMES", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
                    "MODEL_FOR_CTC_MAPPING_NAMES", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES"):
        assert set(getattr(ma, mapping)) <= set(types), mapping
    assert "trocr" in types and "trocr" not in ma.MODEL_MAPPING_NAMES  # a type that has a head but no base model


#: type -> (its main head, its category)
HEADS = {
    "llama": ("causal-lm", "decoder LM"),
    "bert": ("causal-lm", "encoder"),  # a causal-LM head keeps its earlier row
    "deberta-v2": ("masked-lm", "encoder"),
    "t5": ("seq2seq-lm", "encoder-decoder"),
    "bart": ("seq2seq-lm", "encoder-decoder"),  # the seq2seq head before the decoder-only BartForCausalLM
    "whisper": ("speech-seq2seq", "encoder-decoder"),
    "vit": ("image-classification", "vision"),
    "wav2vec2": ("ctc", "speech"),
    "clip": ("contrastive", "dual encoder"),
    "llava": ("image-text-to-text", "vision-language"),
}


@pytest.mark.parametrize("model_type", list(HEADS))
def test_main_head_and_category(model_type):
    task = task_for(model_type)
    assert (task.name, category_of(model_type)) == HEADS[model_type]
    assert task in TASKS and category_of(model_type) in CATEGORIES


def test_an_unknown_type_is_named():
    with pytest.raises(KeyError, match="not_a_model_type"):
        task_for("not_a_model_type")


def test_the_causal_lm_rows_keep_their_configs():
    """A text-only causal LM keeps its image/audio front ends at their defaults (its row stays what
    it was), while a causal LM whose class takes pixels (Gemma 3) and every other head get them tiny;
    the text config is the same either way."""
    assert config_overrides(task_for("llama4")) == {"media": False}
    assert config_overrides(task_for("vit")) == {"media": True, "num_labels": NUM_LABELS}
    assert task_for("gemma3").modalities == ("text", "image") and config_overrides(task_for("gemma3"))["media"]
    full, tiny = tiny_config_for("llama4", media=False), tiny_config_for("llama4")
    assert full.vision_config.image_size > tiny.vision_config.image_size == 32
    assert full.text_config.to_dict() == tiny.text_config.to_dict()


def test_loss_without_a_loss_is_the_mean_square_of_the_main_output():
    class Out(dict):
        pass

    h = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(loss_of(Out(last_hidden_state=h, pooler_output=h[:, 0])), h.pow(2).mean())
    assert torch.equal(loss_of((None, h)), h.pow(2).mean())
    with pytest.raises(TypeError, match="no floating-point tensor"):
        loss_of((torch.ones(2, dtype=torch.long),))


#: one type per category -> (input keys, parameter name parts that must get a gradient: one per modality)
INPUTS = {
    "llama": ({"input_ids", "labels"}, ("embed_tokens",)),
    "deberta-v2": ({"input_ids", "labels"}, ("embeddings.word_embeddings",)),
    "t5": ({"input_ids", "labels"}, ("encoder.block.0", "decoder.block.0")),
    "vit": ({"pixel_values", "labels"}, ("patch_embeddings", "classifier")),
    "wav2vec2": ({"input_values", "labels"}, ("feature_extractor", "lm_head")),
    "clip": ({"input_ids", "pixel_values", "return_loss"}, ("text_model", "vision_model")),
    "llava": ({"input_ids", "attention_mask", "pixel_values", "labels"}, ("vision_tower", "multi_modal_projector",
                                                                           "language_model")),
    # vision-language layouts (sweep_media): any-resolution tiles, a patch grid, images per sample
    "llava_next": ({"input_ids", "attention_mask", "pixel_values", "image_sizes", "labels"},
                   ("vision_tower", "image_newline", "language_model")),
    "qwen2_vl": ({"input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw", "labels"},
                 ("visual.patch_embed", "visual.merger", "language_model")),
    "idefics3": ({"input_ids", "attention_mask", "pixel_values", "pixel_attention_mask", "labels"},
                 ("vision_model", "connector", "text_model")),
    "gemma3": ({"input_ids", "attention_mask", "token_type_ids", "pixel_values", "labels"},  # a causal LM with images
               ("vision_tower.encoder", "multi_modal_projector", "language_model")),
}


@pytest.mark.parametrize("model_type", [t if t == "vit" else pytest.param(t, marks=pytest.mark.slow) for t in INPUTS])
def test_inputs_run_the_unsharded_model(model_type):
    model, inputs, loss, grads = build(model_type, tp=2)
    keys, reached = INPUTS[model_type]
    assert set(inputs) == keys, inputs.keys()
    assert torch.isfinite(loss)
    for k, v in inputs.items():  # per sample, but a patch grid's flattened patches (its grid says how many)
        if k == "pixel_values" and "image_grid_thw" in inputs:
            assert v.shape[0] == int(inputs["image_grid_thw"].prod(-1).sum())
        else:
            assert not isinstance(v, torch.Tensor) or v.shape[0] == BATCH, k
    for part in reached:  # every modality's parameters are on the loss's path
        assert any(part in k and g is not None and g.abs().sum() > 0 for k, g in grads.items()), part
    if "labels" in inputs and inputs["labels"].dim() == 1:  # a classifier: one of NUM_LABELS per sample
        assert int(inputs["labels"].max()) < NUM_LABELS
    again = build(model_type, tp=2)  # the same seed: the same inputs and loss
    assert torch.equal(again[2], loss) and all(
        torch.equal(v, again[1][k]) for k, v in inputs.items() if isinstance(v, torch.Tensor))


def test_tiny_vision_language_configs_follow_their_tower():
    """Fields a vision-language model derives from its full-size tower are made tiny with it: the
    M-RoPE sections a Qwen2-VL text model splits its rotary half by (its code's default when the
    config names none), LLaVA-NeXT's any-resolution pinpoints in tiles of the tiny image, the
    vision layers VipLLaVA's projector reads, Gemma 3's image tokens, a Qwen-VL tower's depth."""
    qwen = tiny_config_for("qwen2_vl")
    text = qwen.get_text_config()
    assert sum(text.rope_parameters["mrope_section"]) == text.hidden_size // text.num_attention_heads // 2
    assert qwen.vision_config.depth == 2
    next_ = tiny_config_for("llava_next")
    size = next_.vision_config.image_size
    assert all(h % size == 0 and w % size == 0 and max(h, w) <= 3 * size for h, w in next_.image_grid_pinpoints)
    vip = tiny_config_for("vipllava")
    layers = vip.vision_config.num_hidden_layers
    assert len(vip.vision_feature_layers) == 5 and all(-(layers + 1) <= i <= layers for i in vip.vision_feature_layers)
    gemma = tiny_config_for("gemma3")
    side = gemma.vision_config.image_size // gemma.vision_config.patch_size
    assert side % int(gemma.mm_tokens_per_image ** 0.5) == 0


def test_feature_rows_count_rows_over_the_last_dim():
    """The placeholder count of an image comes from the rows its tower returns, tensors or lists of them."""
    from hp_functional.tools.sweep_media import feature_rows

    assert feature_rows(torch.zeros(2, 3, 8)) == 6
    assert feature_rows([torch.zeros(4, 8), torch.zeros(5, 8)]) == 9
    assert feature_rows(None) == 0
