"""Tiny models of the optional extras for the support sweep: diffusers' diffusion transformers
(DiT, PixArt-α, SD3's MMDiT, Flux) and timm's ViT, each with its inputs and a loss.

``extra_families()`` lists the builders whose library imports here (computed when called, never
at import: this module imports neither diffusers nor timm itself).  A builder is
``builder(tp, seed) -> Extra``: a tiny model in eval mode with random weights (nothing is
downloaded), the keyword arguments of one forward, a category and ``loss_of(output) -> scalar``
(the diffusion MSE against a fixed noise target, or cross-entropy over a ViT's logits).  ``tp``
is the axis size the model must divide over (its head counts are 4: tp 2 and 4).
``hand_plan(name)`` is the plan a user writes by hand for it (docs/diffusion-and-timm.md).
"""

from __future__ import annotations

__all__: list[str] = []

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

HEADS, HEAD_DIM, BATCH = 4, 8, 2
DIM = HEADS * HEAD_DIM


@dataclass(frozen=True)
class Extra:
    """One tiny model of an extra: the model, one forward's keyword arguments, its category and
    the loss of its output."""

    model: nn.Module
    inputs: dict[str, Any]
    category: str
    loss_of: Callable[[Any], Tensor]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _diffusion(model: nn.Module, inputs: dict[str, Any], seed: int) -> Extra:
    def loss_of(output) -> Tensor:
        target = torch.randn(output.sample.shape, generator=_gen(seed + 7))  # the noise to predict, drawn alike each call
        return F.mse_loss(output.sample, target.to(output.sample))
    return Extra(model.eval(), inputs, "diffusion transformer", loss_of)


def _seeded(seed: int) -> None:
    torch.manual_seed(seed)  # diffusers and timm initialise from the global generator


def dit(tp: int, seed: int) -> Extra:
    """diffusers' ``DiTTransformer2DModel``: adaLN-Zero modulation from the timestep and class."""
    from diffusers import DiTTransformer2DModel

    _seeded(seed)
    model = DiTTransformer2DModel(num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=4, num_layers=2,
                                  sample_size=8, patch_size=2, norm_num_groups=4)
    g = _gen(seed + 1)
    inputs = {"hidden_states": torch.randn(BATCH, 4, 8, 8, generator=g), "timestep": torch.tensor([3, 500]),
              "class_labels": torch.tensor([1, 7])}
    return _diffusion(model, inputs, seed)


def pixart(tp: int, seed: int) -> Extra:
    """diffusers' ``PixArtTransformer2DModel``: adaLN-single, cross-attention to a caption."""
    from diffusers import PixArtTransformer2DModel

    _seeded(seed)
    model = PixArtTransformer2DModel(num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=4,
                                     out_channels=8, num_layers=2, cross_attention_dim=DIM, sample_size=8, patch_size=2,
                                     caption_channels=16, norm_num_groups=4)
    g = _gen(seed + 1)
    inputs = {"hidden_states": torch.randn(BATCH, 4, 8, 8, generator=g),
              "encoder_hidden_states": torch.randn(BATCH, 6, 16, generator=g), "timestep": torch.tensor([3, 500]),
              "added_cond_kwargs": {"resolution": None, "aspect_ratio": None}}
    return _diffusion(model, inputs, seed)


def sd3(tp: int, seed: int) -> Extra:
    """diffusers' ``SD3Transformer2DModel`` (MMDiT): joint attention over image and text tokens."""
    from diffusers import SD3Transformer2DModel

    _seeded(seed)
    model = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=HEAD_DIM,
                                  num_attention_heads=HEADS, joint_attention_dim=16, caption_projection_dim=DIM,
                                  pooled_projection_dim=16, out_channels=4, pos_embed_max_size=8)
    g = _gen(seed + 1)
    inputs = {"hidden_states": torch.randn(BATCH, 4, 8, 8, generator=g),
              "encoder_hidden_states": torch.randn(BATCH, 6, 16, generator=g),
              "pooled_projections": torch.randn(BATCH, 16, generator=g), "timestep": torch.tensor([3, 500])}
    return _diffusion(model, inputs, seed)


def flux(tp: int, seed: int) -> Extra:
    """diffusers' ``FluxTransformer2DModel``: joint (double-stream) and single-stream blocks, RoPE."""
    from diffusers import FluxTransformer2DModel

    _seeded(seed)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                   attention_head_dim=HEAD_DIM, num_attention_heads=HEADS, joint_attention_dim=16,
                                   pooled_projection_dim=16, guidance_embeds=False, axes_dims_rope=(2, 2, 4))
    g = _gen(seed + 1)
    image, text = 16, 6
    ids = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij"), -1).reshape(image, 2)
    inputs = {"hidden_states": torch.randn(BATCH, image, 16, generator=g),
              "encoder_hidden_states": torch.randn(BATCH, text, 16, generator=g),
              "pooled_projections": torch.randn(BATCH, 16, generator=g), "timestep": torch.tensor([0.1, 0.7]),
              "img_ids": torch.cat([torch.zeros(image, 1), ids.float()], 1), "txt_ids": torch.zeros(text, 3)}
    return _diffusion(model, inputs, seed)


def vit_tiny(tp: int, seed: int) -> Extra:
    """timm's ``vit_tiny_patch16_224`` made tiny (32 px images, 8 px patches, 2 blocks, 5 classes)."""
    import timm

    _seeded(seed)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                              num_classes=5, embed_dim=DIM, num_heads=HEADS)
    g = _gen(seed + 1)
    labels = torch.randint(0, 5, (BATCH,), generator=g)

    def loss_of(logits) -> Tensor:
        return F.cross_entropy(logits, labels)
    return Extra(model.eval(), {"x": torch.randn(BATCH, 3, 32, 32, generator=g)}, "vision transformer", loss_of)


#: name → (the package it needs, its builder)
_BUILDERS: dict[str, tuple[str, Callable[[int, int], Extra]]] = {
    "diffusers:DiT": ("diffusers", dit),
    "diffusers:PixArt": ("diffusers", pixart),
    "diffusers:SD3": ("diffusers", sd3),
    "diffusers:Flux": ("diffusers", flux),
    "timm:vit_tiny_patch16_224": ("timm", vit_tiny),
}


def _importable(package: str) -> bool:
    """Whether ``package`` is installed and imports (timm imports torchvision, whose wheel must
    match the installed torch: docs/diffusion-and-timm.md)."""
    if importlib.util.find_spec(package) is None:
        return False
    try:
        importlib.import_module(package)
    except Exception:  # noqa: BLE001 - any failure to import means the extra is not usable here
        return False
    return True


def extra_families() -> dict[str, Callable[[int, int], Extra]]:
    """The builders of the extras whose library imports in this environment, by name
    (``"diffusers:DiT"``, ``"timm:vit_tiny_patch16_224"``, ...).

    Returns:
        name → ``builder(tp, seed) -> Extra``; empty when neither diffusers nor timm imports.
    """
    ok = {package: _importable(package) for package in {p for p, _ in _BUILDERS.values()}}
    return {name: build for name, (package, build) in _BUILDERS.items() if ok[package]}


def hand_plan(name: str) -> dict[str, Any]:
    """The plan a user writes by hand for extra ``name``: attention projections colwise (timm's fused
    ``qkv`` packed in three), output projections rowwise, the attention's head counts divided, the
    feed-forward colwise/rowwise; adaLN modulation, embeddings and the final layer left replicated.

    Args:
        name: a key of ``extra_families()``.
    Returns:
        the plan's entries (a plain dict: a plan on the mesh axis ``"tp"``).
    """
    from ..parallel.tensor.styles import Colwise, Heads, Rowwise

    if name.startswith("timm:"):
        return {"blocks.*.attn.qkv": Colwise(packed=3), "blocks.*.attn.proj": Rowwise(),
                "blocks.*.attn": Heads(attrs=("num_heads", "attn_dim")),
                "blocks.*.mlp.fc1": Colwise(), "blocks.*.mlp.fc2": Rowwise()}
    blocks = "transformer_blocks.*"
    plan: dict[str, Any] = {}
    attentions = ["attn1"] + (["attn2"] if name == "diffusers:PixArt" else [])
    if name in ("diffusers:SD3", "diffusers:Flux"):
        attentions = ["attn"]
    for attn in attentions:
        plan |= {f"{blocks}.{attn}.to_q": Colwise(), f"{blocks}.{attn}.to_k": Colwise(),
                 f"{blocks}.{attn}.to_v": Colwise(), f"{blocks}.{attn}.to_out.0": Rowwise(),
                 f"{blocks}.{attn}": Heads(attrs=("heads",))}
    if name in ("diffusers:SD3", "diffusers:Flux"):  # the text stream's projections of the joint attention
        plan |= {f"{blocks}.attn.add_q_proj": Colwise(), f"{blocks}.attn.add_k_proj": Colwise(),
                 f"{blocks}.attn.add_v_proj": Colwise(), f"{blocks}.attn.to_add_out": Rowwise()}
        plan |= {f"{blocks}.ff_context.net.0.proj": Colwise(), f"{blocks}.ff_context.net.2": Rowwise()}
    plan |= {f"{blocks}.ff.net.0.proj": Colwise(), f"{blocks}.ff.net.2": Rowwise()}
    return plan
