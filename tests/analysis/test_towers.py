"""``analysis.towers``: the modules a traced batch did not reach, traced on their own on an input
built from the config (``analysis.media``) and merged into the batch's trace; on a hand-written
vision-language model (a patch tower, a projector, a text path), on meta tensors."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from hp_functional.analysis.media import BATCH, image_inputs
from hp_functional.analysis.towers import trace_towers, unreached
from hp_functional.analysis.trace import example_call, trace_model


def vision_config(image_size: int = 16, patch_size: int = 4):
    return SimpleNamespace(image_size=image_size, patch_size=patch_size, num_channels=3, to_dict=dict)


class MLP(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Tower(nn.Module):
    """A ViT-like tower: patches by reshape (a size the patch does not divide fails), one MLP block."""

    def __init__(self, config, d: int = 32):
        super().__init__()
        self.config, self.patch = config, config.patch_size
        self.embed = nn.Linear(config.num_channels * self.patch ** 2, d)
        self.mlp = MLP(d)

    def forward(self, pixel_values):
        b, c, h, w = pixel_values.shape
        p = self.patch
        x = pixel_values.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).flatten(3).flatten(1, 2)
        return self.mlp(self.embed(x))


class VisionLM(nn.Module):
    """Image features (the tower, then a two-layer projector) before the text's embeddings."""

    def __init__(self, config=None, d: int = 32):
        super().__init__()
        self.config = SimpleNamespace(vision_config=config or vision_config())
        self.embed = nn.Embedding(32, d)
        self.tower = Tower(self.config.vision_config, d)
        self.projector = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.head = nn.Linear(d, 32)

    def forward(self, input_ids, pixel_values=None):
        h = self.embed(input_ids)
        if pixel_values is not None:
            h = torch.cat([self.get_image_features(pixel_values), h], dim=1)
        return self.head(h + self.down(F.gelu(self.up(h))))

    def get_image_features(self, pixel_values):
        return self.projector(self.tower(pixel_values))


class TowerOnly(VisionLM):
    """No ``get_image_features``: the tower is traced through its own forward, the projector not."""

    get_image_features = None

    def forward(self, input_ids, pixel_values=None):
        h = self.embed(input_ids)
        if pixel_values is not None:
            h = torch.cat([self.projector(self.tower(pixel_values)), h], dim=1)
        return self.head(h + self.down(F.gelu(self.up(h))))


def _text_trace(model):
    return trace_model(model, example_call(model, {"input_ids": torch.zeros(2, 8, dtype=torch.long)}))


def test_an_unreached_tower_is_traced_through_the_models_getter():
    """The tower and the projector (outermost, in order; a skipped one left out) are traced through
    ``get_image_features`` on (batch, channels, image_size, image_size) pixels, and the merged
    trace keeps the batch's calls first and adds the tower's flow (``up`` feeds ``down``)."""
    model = VisionLM()
    text = _text_trace(model)
    assert unreached(model, text) == ["tower", "projector"]
    assert unreached(model, text, skip={"tower"}) == ["projector"]
    merged, notes = trace_towers(model, text)
    assert list(merged.calls)[:len(text.calls)] == list(text.calls)
    assert "tower.mlp.up" in merged.calls["tower.mlp.down"].producers
    assert "projector.0" in merged.calls["projector.2"].producers
    assert "tower" in merged.calls["projector.0"].producers  # the projector takes the tower's output
    assert merged.calls["tower"].args[0].shape == (BATCH, 3, 16, 16)
    assert notes == ["tower, projector: not reached by the example batch; traced on its own through "
                     "get_image_features(pixel_values=...) on an input built from the config, and planned from that "
                     "trace"], notes
    assert unreached(model, merged) == [] and trace_towers(model, merged) == (merged, [])


def test_a_tower_without_a_getter_is_traced_alone_and_a_failure_is_noted():
    """Without a getter the tower's own forward is traced (the projector, which takes features, stays
    unreached, without a note); a tower no layout runs (16 pixels do not split into 5-pixel patches)
    stays unreached, and the note names the first layout's error."""
    model = TowerOnly()
    merged, notes = trace_towers(model, _text_trace(model))
    assert "tower.mlp.down" in merged.calls and "projector.0" not in merged.calls
    assert len(notes) == 1 and notes[0].startswith("tower: not reached") and "tower(pixel_values=...)" in notes[0]
    broken = VisionLM(vision_config(image_size=18, patch_size=4))
    merged, notes = trace_towers(broken, _text_trace(broken))
    assert "tower.mlp.down" not in merged.calls
    assert len(notes) == 2 and all("tracing it on its own failed (RuntimeError: shape" in n for n in notes), notes


def test_image_layouts_follow_the_config_and_the_signature():
    """Plain pixels at the config's size first; a forward that takes a grid gets flattened patches."""
    gen = torch.Generator().manual_seed(0)
    config = SimpleNamespace(vision_config=SimpleNamespace(image_size=16, patch_size=4, num_channels=3,
                                                           temporal_patch_size=2, spatial_merge_size=2, to_dict=dict))
    plain = next(image_inputs(None, config, {"pixel_values": None}, "pixel_values", gen, video=False))
    assert plain["pixel_values"].shape == (BATCH, 3, 16, 16)
    grid = next(image_inputs(None, config, {"pixel_values": None, "image_grid_thw": None}, "pixel_values", gen, False))
    assert grid["pixel_values"].shape == (BATCH * 16, 3 * 2 * 4 * 4)
    assert grid["image_grid_thw"].tolist() == [[1, 4, 4]] * BATCH
