"""``auto_plan`` plans a vision tower that the example batch does not reach: a vision-language
model fine-tuned on text (no images in the batch) gets its vision tower and projector planned from
a trace of the model's own ``get_image_features`` on pixels built from the config
(``analysis.towers``), entry for entry as a batch with images plans them.  Checked on Qwen2-VL
(a patch grid whose values the tower reads), LLaVA (CLIP and a projector) and Gemma 3 (SigLIP
and its soft-token projector) at tp 2 against the unsharded model: no rank holds 65 % of the
parameters, and a text batch and an image batch through the same ``shard()`` give the unsharded
loss and every gradient."""

from __future__ import annotations

import pytest
import torch

import hp_functional as hpf
from hp_functional.tools.model_configs import special_ids
from hp_functional.tools.sweep import build
from tests.analysis.test_towers import VisionLM, vision_config
from tests.conftest import get_pool
from tests.support.helpers import mesh

FAMILIES = ("qwen2_vl", "llava", "gemma3")


def _text_batch(model) -> dict[str, torch.Tensor]:
    """Token ids (labels too) that avoid every special id: no image placeholder, so no tower runs."""
    vocab = model.config.get_text_config().vocab_size
    allowed = torch.tensor(sorted(set(range(3, vocab)) - special_ids(model.config)))
    ids = allowed[torch.randint(0, len(allowed), (2, 8), generator=torch.Generator().manual_seed(3))]
    return {"input_ids": ids, "labels": ids}


def _grads(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(**batch).loss
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _worst(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest difference relative to the reference's largest value (Gemma 3's projector
    gradients reach 1e9 at this tiny size: an elementwise tolerance would call rounding wrong)."""
    return ((got - ref).abs().max() / (1 + ref.abs().max())).item()


def case_towers(family: str):
    model, images, image_loss, image_grads = build(family, tp=2)
    text = _text_batch(model)
    text_loss, text_grads = _grads(model, text)
    m, base = mesh(), hpf.ShardingPlan.from_hf(model)
    plan = hpf.auto_plan(model, m, example_inputs={"input_ids": text["input_ids"]}, base=base)
    with_images = hpf.auto_plan(model, m, example_inputs=images, base=base)
    apply_fn, params, info = hpf.shard(model, plan, m, example_inputs=text)  # the text batch is all shard() sees
    out = {"same plan": (plan.entries == with_images.entries, plan.special_handlers == with_images.special_handlers),
           "notes": [n for n in plan.notes if "not reached by the example batch" in n],
           "share": sum(p.numel() for p in params.values()) / sum(p.numel() for p in model.parameters())}
    for label, batch, ref_loss, ref_grads in (("text", text, text_loss, text_grads),
                                              ("images", images, image_loss, image_grads)):
        loss = apply_fn(params, **batch).loss
        grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()), allow_unused=True), strict=True))
        full = hpf.unshard({k: torch.zeros_like(params[k]) if g is None else g for k, g in grads.items()}, info)
        out[label] = (abs(loss.item() - ref_loss.item()),
                      {k: _worst(full[k], g) for k, g in ref_grads.items() if g is not None})
    return out


@pytest.mark.slow
def test_a_text_only_batch_shards_the_vision_tower_exactly():
    """Before, a text-only batch left the whole tower on every rank (71 %, 75 %, 80 %); the tower's
    entries are exact with images (those gradients are checked) and harmless without (zero)."""
    pool = get_pool(2)
    for family in FAMILIES:
        for out in pool.run(case_towers, family):
            assert out["same plan"] == (True, True), (family, out["same plan"])
            assert out["notes"] and "get_image_features(pixel_values=...)" in out["notes"][0], (family, out["notes"])
            assert out["share"] < 0.65, (family, out["share"])
            for label in ("text", "images"):
                loss_diff, grads = out[label]
                wrong = {k: d for k, d in grads.items() if d > 1e-5}
                assert loss_diff < 1e-5 and not wrong, (family, label, loss_diff, list(wrong.items())[:4])
            towers = [k for k in out["images"][1] if "vision" in k or "visual" in k or "projector" in k]
            assert len(towers) > 10, (family, towers)  # the image batch's gradients reach the tower


def test_an_unreached_tower_is_planned_and_one_that_cannot_be_traced_is_left_replicated():
    """The hand-written model of ``tests/analysis/test_towers.py`` fed token ids only: the tower's MLP
    and the projector pair as with pixels in the batch; a tower no input layout runs keeps its
    projections replicated (unplanned, as before) and the plan says why."""
    ids = {"input_ids": torch.zeros(2, 8, dtype=torch.long)}
    plan = hpf.simulate(lambda m: hpf.auto_plan(VisionLM(), m, example_inputs=ids), world_size=2)
    pixels = hpf.simulate(lambda m: hpf.auto_plan(VisionLM(), m, example_inputs={
        **ids, "pixel_values": torch.zeros(2, 3, 16, 16)}), world_size=2)
    assert plan.entries == pixels.entries, (plan.entries, pixels.entries)
    assert (plan.entries["tower.mlp.up"], plan.entries["tower.mlp.down"]) == (hpf.Colwise(), hpf.Rowwise())
    assert (plan.entries["projector.0"], plan.entries["projector.2"]) == (hpf.Colwise(), hpf.Rowwise())
    broken = hpf.simulate(lambda m: hpf.auto_plan(VisionLM(vision_config(image_size=18)), m, example_inputs=ids),
                          world_size=2)
    # computed whole: replicated, or stored split and gathered before the forward (rule 8), never split in compute
    assert not any(k.startswith(("tower", "projector")) and v not in (hpf.NoParallel(), hpf.ShardedParams())
                   for k, v in broken.entries.items()), broken.entries
    assert any("tracing it on its own failed" in n for n in broken.notes), broken.notes
