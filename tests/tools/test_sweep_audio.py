"""The support table's audio rows (``sweep_audio``): an audio-language model runs on real audio
(features, the masks its feature extractor returns, as many placeholder tokens as its audio tower
makes features), so its tower is on the loss's path and ``auto_plan`` traces and shards it."""

import inspect
from types import SimpleNamespace

import pytest
import torch

from hp_functional.tools.sweep import build
from hp_functional.tools.sweep_audio import audio_inputs


def _params(*names: str, required: str = ""):
    """A forward's parameters: ``required`` without a default, the rest optional."""
    return {n: inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY,
                                 default=inspect.Parameter.empty if n == required else None) for n in names}


def test_audio_candidates_carry_the_masks_the_forward_takes():
    """Whisper's length first with a mask of ones over its frames, then the same features without
    the optional mask; OmniASR's single channel after wav2vec2's plain samples; codec codes below
    the codebook size with a boolean mask."""
    config = SimpleNamespace(audio_config=SimpleNamespace(num_mel_bins=16, max_source_positions=64, to_dict=dict))
    params = _params("input_features", "feature_attention_mask", "input_ids", required="input_features")
    first, bare = list(audio_inputs(config, params, "input_features", torch.Generator().manual_seed(0)))[:2]
    assert first["input_features"].shape == (2, 16, 128)
    assert first["feature_attention_mask"].shape == (2, 128) and bool(first["feature_attention_mask"].all())
    assert set(bare) == {"input_features"} and torch.equal(bare["input_features"], first["input_features"])
    values = list(audio_inputs(SimpleNamespace(), _params("input_values", "padding_mask"), "input_values",
                               torch.Generator().manual_seed(0)))
    assert [tuple(c["input_values"].shape) for c in values][::2] == [(2, 400), (2, 1, 400)]
    assert all(c["padding_mask"].shape == (2, 400) for c in values[::2])
    ctc = SimpleNamespace(num_mel_bins=16, ctc_loss_reduction="mean")  # a CTC head: 4 x the frames
    speech = list(audio_inputs(ctc, _params("input_features", "attention_mask", "labels"), "input_features",
                               torch.Generator().manual_seed(0)))
    assert speech[0]["input_features"].shape == (2, 64, 16) and speech[1]["attention_mask"].shape == (2, 64)
    higgs = SimpleNamespace(num_codebooks=8, codebook_size=16)
    codes = next(audio_inputs(higgs, _params("audio_input_ids", "audio_input_ids_mask"), "audio_input_ids",
                              torch.Generator().manual_seed(0)))
    assert codes["audio_input_ids"].shape == (2, 4, 8) and int(codes["audio_input_ids"].max()) < 16
    assert codes["audio_input_ids_mask"].dtype == torch.bool


#: type -> (input keys, parameter name parts that must get a gradient: the audio tower and what it feeds)
AUDIO = {
    "qwen2_audio": ({"input_ids", "attention_mask", "input_features", "feature_attention_mask", "labels"},
                    ("audio_tower", "multi_modal_projector", "language_model")),
    "parakeet_ctc": ({"input_features", "attention_mask", "labels"}, ("encoder.subsampling", "ctc_head")),
}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(AUDIO))  # the other audio rows: the on-demand sweep
def test_audio_rows_reach_the_audio_tower(model_type):
    """The row's inputs reach every audio parameter group, its ids carry one placeholder per
    audio feature (the model checks it, else the row would be text-only), and the loss depends on
    the audio (a CTC loss with too few frames for its labels would be zero: it is not)."""
    model, inputs, loss, grads = build(model_type, tp=2)
    keys, reached = AUDIO[model_type]
    assert set(inputs) == keys, inputs.keys()
    assert torch.isfinite(loss) and loss > 0
    for part in reached:
        assert any(part in k and g is not None and g.abs().sum() > 0 for k, g in grads.items()), part
