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
    """A causal LM feeds text only: its image/audio front ends keep their defaults (its row stays
    what it was), while every other head gets them tiny."""
    assert config_overrides(task_for("gemma3")) == {"media": False}
    assert config_overrides(task_for("vit")) == {"media": True, "num_labels": NUM_LABELS}
    full, tiny = tiny_config_for("gemma3", media=False), tiny_config_for("gemma3")
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
}


@pytest.mark.parametrize("model_type", [t if t == "vit" else pytest.param(t, marks=pytest.mark.slow) for t in INPUTS])
def test_inputs_run_the_unsharded_model(model_type):
    model, inputs, loss, grads = build(model_type, tp=2)
    keys, reached = INPUTS[model_type]
    assert set(inputs) == keys, inputs.keys()
    assert torch.isfinite(loss)
    for v in inputs.values():
        assert not isinstance(v, torch.Tensor) or v.shape[0] == BATCH
    for part in reached:  # every modality's parameters are on the loss's path
        assert any(part in k and g is not None and g.abs().sum() > 0 for k, g in grads.items()), part
    if "labels" in inputs and inputs["labels"].dim() == 1:  # a classifier: one of NUM_LABELS per sample
        assert int(inputs["labels"].max()) < NUM_LABELS
    again = build(model_type, tp=2)  # the same seed: the same inputs and loss
    assert torch.equal(again[2], loss) and all(
        torch.equal(v, again[1][k]) for k, v in inputs.items() if isinstance(v, torch.Tensor))
