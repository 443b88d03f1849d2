"""The support table's tiny configs, inputs and proof column (``tools.model_configs``,
``tools.sweep_inputs``, ``tools.sweep``, ``benchmarks/models.py``): the rules that made the types
which did not build tiny build (backbone outputs within the tiny layers, nested configs shrunk, codec
ratios, a Qwen-VL tower's own patches and grid, per-type inputs, the loss of a detector, a type built
in train mode), how a row's proof is labelled, and the goal counted over every type.  Mostly configs;
the few that build a tiny model (a tenth of a second each, once transformers' modules are loaded) are
marked slow."""

import importlib.util
import inspect
import math
from pathlib import Path

import pytest
import torch

from hp_functional.analysis.media import image_inputs
from hp_functional.tools.model_configs import FAMILY, HEADS, HIDDEN, VOCAB, tiny_config_for
from hp_functional.tools.model_configs_fixes import family_fixes
from hp_functional.tools.sweep import EXACT, UNBUILDABLE, UNPROVED, build, first_line, proof_label, unbuildable
from hp_functional.tools.sweep_inputs import EXTRA_INPUTS, loss_of
from hp_functional.tools.sweep_tasks import NOT_TINY, TRAIN_MODE, instantiate, task_for

_SPEC = importlib.util.spec_from_file_location("support_table", Path(__file__).resolve().parents[2] / "benchmarks" / "models.py")
_TABLE = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_TABLE)
goal, proofs = _TABLE.goal, _TABLE.proofs


@pytest.fixture
def one_thread():
    """One intra-op thread while tiny models build, as in the rank pool's ranks (two threads on a busy
    2-core machine spin: a build then takes seconds instead of a tenth of one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_row_is_labelled_by_what_proved_it_and_anything_else_is_unproved():
    """``shard()``'s ``checks["proof"]`` -> the table's ``proof`` column; an accepted plan that
    nothing proved (``allow_unproved``, ``verify=False``) is never labelled as proved."""
    assert proof_label("the probe and the dataflow pass") == "both"
    assert proof_label("the probe") == "probe"
    assert proof_label("the dataflow pass") == "dataflow"
    assert proof_label("nothing to prove: no module is planned") == "nothing to prove"
    for text in ("unproved (allow_unproved=True): the dataflow pass did not run", "not asked (skipped: verify=False)", ""):
        assert proof_label(text) == UNPROVED, text


def test_the_goal_counts_every_type_and_the_unproved_rows():
    """A type not buildable (or not run at tp 4) counts against the goal; a rank holding 65 % or
    more misses it; a row that ran with no proof is counted as unproved."""
    row = {"outcome": EXACT, "share": 0.5, "category": "decoder LM", "proof": "both"}
    table = {"a": {2: row, 4: {**row, "proof": "dataflow"}}, "b": {2: {**row, "share": 0.7}},
             "c": {2: {"outcome": UNBUILDABLE, "share": None, "category": "vision"}},
             "d": {2: {**row, "proof": UNPROVED}}}
    assert goal(table, 2) == (2, 4) and goal(table, 4) == (1, 4)
    assert goal(table, 2, "vision") == (0, 1)
    by, unproved = proofs(table, 2)
    assert by == {"both": 2, UNPROVED: 1} and unproved == 1
    assert proofs(table, 4) == ({"dataflow": 1}, 0)


@pytest.mark.slow
def test_a_backbone_keeps_as_many_outputs_as_its_default_within_the_tiny_layers():
    """Depth Anything's DINOv2 reads layers 9-12 of 12 (a DPT neck takes four): the tiny backbone
    keeps four layers and reads them all; VitPose's one output is its last layer."""
    backbone = tiny_config_for("depth_anything").backbone_config
    assert backbone.num_hidden_layers == 4 and backbone.out_indices == [1, 2, 3, 4]
    assert backbone.out_features == ["stage1", "stage2", "stage3", "stage4"]
    vitpose = tiny_config_for("vitpose").backbone_config
    assert vitpose.out_indices == [vitpose.num_hidden_layers]


def test_nested_configs_and_codecs_are_shrunk():
    """ColPali's VLM (a config inside a config) is tiny; DAC downsamples by at most 2 per stage,
    its hop the product, its first width doubling up to the tiny width; Mimi's SEANet likewise."""
    colpali = tiny_config_for("colpali").vlm_config
    assert colpali.text_config.hidden_size == HIDDEN and colpali.vision_config.hidden_size == HIDDEN
    dac = tiny_config_for("dac")
    assert max(dac.downsampling_ratios) <= 2 and dac.hop_length == math.prod(dac.downsampling_ratios)
    assert dac.encoder_hidden_size * 2 ** len(dac.downsampling_ratios) == HIDDEN
    mimi = tiny_config_for("mimi")
    assert mimi.num_filters * 2 ** len(mimi.upsampling_ratios) == HIDDEN


def test_a_vision_tower_of_its_own_gets_patches_and_their_grid():
    """A Qwen-VL-style tower's forward takes ``hidden_states`` (flattened patches) and ``grid_thw``:
    its first layout is the patch grid, one row of channels x temporal x patch² values per patch."""
    config = tiny_config_for("qwen2_5_vl_vision")
    params = {n: inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in ("hidden_states", "grid_thw")}
    first = next(image_inputs(None, config, params, "hidden_states", torch.Generator().manual_seed(0), False))
    assert set(first) == {"hidden_states", "grid_thw"}
    t, h, w = first["grid_thw"][0].tolist()
    width = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
    assert first["hidden_states"].shape == (2 * t * h * w, width) and h % config.spatial_merge_size == 0


def test_per_type_inputs_are_built_from_the_config():
    """A time-series model's past values, a decision transformer's trajectory: from the config's sizes."""
    gen = torch.Generator().manual_seed(0)
    series = EXTRA_INPUTS["patchtst"](tiny_config_for("patchtst"), gen)
    assert series["past_values"].shape[0] == 2 and series["past_values"].dim() == 3
    config = tiny_config_for("decision_transformer")
    trajectory = EXTRA_INPUTS["decision_transformer"](config, gen)
    assert trajectory["states"].shape[-1] == config.state_dim and trajectory["actions"].shape[-1] == config.act_dim


def test_a_family_fix_is_merged_into_its_sub_config_key_by_key():
    """ERNIE 4.5-VL's fix sets only the rope sections of its text config: the rope theta and the
    rest of the shrunk text config stay."""
    text = tiny_config_for("ernie4_5_vl_moe").text_config
    assert text.rope_parameters["mrope_section"] == [3, 3, 2] and text.rope_parameters["rope_theta"] > 0
    assert text.hidden_size == HIDDEN


def test_a_validator_error_names_its_cause_and_a_known_limit_says_why():
    """A config validator's error announces its cause (``...: ``): the row's reason carries the
    cause too; a type no tiny model can run (a composite with no forward) says so first."""
    try:
        try:
            raise ValueError("hidden_size should be equal to the last value in out_features")
        except ValueError as cause:
            raise RuntimeError("Class validation error for validator 'validate_architecture':") from cause
    except RuntimeError as exc:
        line = first_line(exc)
    assert line.startswith("RuntimeError: Class validation") and "ValueError: hidden_size should be" in line
    assert first_line(RuntimeError("plain")) == "RuntimeError: plain"
    reason = unbuildable("qwen3_omni_moe", TypeError("no forward"))
    assert reason.startswith(NOT_TINY["qwen3_omni_moe"]) and reason.endswith("(TypeError: no forward)")
    assert unbuildable("llama", TypeError("no forward")) == "TypeError: no forward"


def test_a_merged_table_names_the_rows_each_rerun_brought():
    """``--update``'s rows carry their run's label: the header lists each rerun with its types; a
    table of one run says how long it took."""
    row = {"outcome": EXACT, "share": 0.5, "category": "decoder LM", "reason": "", "plan": "auto_plan", "proof": "both"}
    rerun = {**row, "run": "rerun of X"}
    table = {"a": {2: row}, "b": {2: rerun, 4: rerun}, "c": {}, "d": {2: rerun}, "e": {2: rerun}, "f": {2: rerun}}
    text = _TABLE._provenance(table, 0.0)
    assert "rerun of X: 4 types (b, d … f (3 in a row))" in text and "every row comes from it except these" in text
    assert "**Not run** (no run reached them: `–` in every column, counted as missed): 1 types (c)" in text
    assert _TABLE._provenance({"a": {2: row}}, 120.0) == "2 min on this machine."
    assert _TABLE._type_line("c", {}, [2, 4]).startswith("| c |  |  | – | – |")  # never run: shown, not dropped


@pytest.mark.slow
def test_a_composite_head_is_built_from_its_part_with_the_labels_it_takes():
    """MusicGen's causal LM takes its decoder's config (not the composite's) and labels per codebook
    (``EXTRA_INPUTS`` over the task's own): built and run unsharded."""
    config = tiny_config_for("musicgen")
    model = instantiate("musicgen", task_for("musicgen"), config)
    assert type(model.config) is type(config.decoder)
    _, inputs, loss, _ = build("musicgen", 2)
    assert inputs["labels"].shape == (2, 8, config.decoder.num_codebooks) and torch.isfinite(loss)


@pytest.mark.slow
def test_a_field_only_a_checkpoint_carries_and_a_stale_derived_field_get_tiny_values(one_thread):
    """PP-OCRv6's detectors: PP-LCNetV4 restated as a detector's backbone (its stage widths those of its
    blocks, not the stale shrunk defaults; four stages out, as its neck reads); PP-OCRv5's neck
    convolutions (None by default); X-Codec's semantic frames at its acoustic hop, with quantizers left
    at its bandwidth: each built and run unsharded.  (These fixes live in ``model_configs_fixes``: each is
    the one ``FAMILY`` applies.)"""
    fixes = family_fixes(HIDDEN, HEADS, VOCAB)
    assert "pp_ocrv6_small_det" in fixes and all(FAMILY[t] == fix for t, fix in fixes.items())
    small = tiny_config_for("pp_ocrv6_small_det")
    backbone = small.backbone_config
    assert backbone.stage_out_channels == [blocks[-1][2] for blocks in backbone.block_configs] == small.layer_list_out_channels
    assert backbone.out_features == ["stage1", "stage2", "stage3", "stage4"]
    server = tiny_config_for("pp_ocrv5_server_det")
    assert server.intraclass_block_config and len(server.scale_factor_list) == len(server.backbone_config.stage_out_channels)
    xcodec = tiny_config_for("xcodec")
    assert math.prod(xcodec.semantic_model_config.conv_stride) == xcodec.hop_length and xcodec.num_quantizers >= 1
    for model_type in ("pp_ocrv6_small_det", "pp_ocrv5_server_det", "xcodec"):
        _, _, loss, grads = build(model_type, 2)
        assert torch.isfinite(loss) and any(g is not None for g in grads.values()), model_type


@pytest.mark.slow
def test_a_type_whose_forward_takes_no_generic_layout_gets_inputs_of_its_own(one_thread):
    """CLAP's spectrogram (batch, 1, frames, mel bins); Kyutai STT's ids, a text token and a code per
    codebook per frame, its padding id the embedding's last row; Dia's codes per channel and labels per
    channel; TVP's one video (its forward runs a batch of one only); Inkling 2's tower's patches per
    language-model token: each built and run unsharded."""
    _, inputs, loss, _ = build("clap", 2)
    assert inputs["input_features"].dim() == 4 and torch.isfinite(loss)
    model, inputs, loss, _ = build("kyutai_speech_to_text", 2)
    table = model.model.embed_tokens.embed_tokens
    assert inputs["input_ids"].shape[-1] == 1 + model.config.num_codebooks and table.padding_idx == table.num_embeddings - 1
    model, inputs, loss, _ = build("dia", 2)
    channels = model.config.decoder_config.num_channels
    assert inputs["labels"].shape[0] == 2 * channels and inputs["decoder_input_ids"].shape[-1] == channels
    _, inputs, loss, _ = build("tvp", 2)
    assert inputs["pixel_values"].shape[0] == inputs["input_ids"].shape[0] == 1 and torch.isfinite(loss)
    model, inputs, loss, _ = build("inkling2_vision", 2)
    side = model.config.spatial_merge_size * model.config.patch_size
    assert inputs["pixel_values"].shape[1:3] == (side, side) and torch.isfinite(loss)


def test_a_detector_loss_is_not_taken_from_its_keypoints():
    """SuperPoint's first output is its keypoints, coordinates picked by thresholds (no gradient): the
    loss is the mean square of its scores, the next output."""
    scores = torch.tensor([[0.5, 2.0]], requires_grad=True)
    out = {"keypoints": torch.tensor([[[0.1, 0.2], [0.3, 0.4]]]), "scores": scores}
    assert torch.equal(loss_of(out), scores.pow(2).mean())


@pytest.mark.slow
def test_superpoint_and_reformer_build_reformer_in_train_mode(one_thread):
    """SuperPoint's loss reaches its encoder and keypoint decoder.  Reformer's reversible layers run their
    backward in train mode only: it is built in train mode, deterministic there (every dropout 0; its
    LSH buckets cannot change what a token attends), so two forwards from different seeds agree."""
    _, _, loss, grads = build("superpoint", 2)
    assert grads["encoder.conv_blocks.0.conv_a.weight"] is not None and grads["keypoint_decoder.conv_score_b.weight"] is not None
    model, inputs, loss, grads = build("reformer", 2)
    assert model.training and "reformer" in TRAIN_MODE and "reformer" not in NOT_TINY
    assert grads["reformer.embeddings.word_embeddings.weight"] is not None
    again = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        again.append(model(**inputs).loss.detach())
    assert torch.allclose(again[0], loss) and torch.allclose(again[1], loss)
