"""Models for the command line and examples: built-in tiny configs of HF causal-LM families
(random weights, nothing downloaded) and local ``config.json`` files."""

from __future__ import annotations

__all__ = ["build_model", "load_config"]

import json
from pathlib import Path

import torch
from torch import nn

#: HF architecture names with a built-in tiny config (``tiny_config``).
TINY = ("llama", "qwen2", "qwen3", "mistral", "gemma", "phi3")


def tiny_config(family: str = "llama", **overrides):
    """A small config of an HF causal-LM family: 2 layers, hidden 64, 8 heads (4 KV heads) of 8,
    vocabulary 128, eager attention.  ``overrides`` replace any field."""
    from transformers import AutoConfig

    if family not in TINY:
        raise ValueError(f"no built-in tiny config for {family!r} (have {', '.join(TINY)})")
    kw = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
        attn_implementation="eager", pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    kw.update(overrides)
    attn = kw.pop("attn_implementation")
    config = AutoConfig.for_model(family, **kw)
    config._attn_implementation = attn
    return config


def load_config(model: str, **overrides):
    """``model`` is a name in ``TINY`` (its tiny config) or the path of a local HF ``config.json``
    (or of the folder holding it); nothing is downloaded."""
    from transformers import AutoConfig

    if model in TINY:
        return tiny_config(model, **overrides)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"{model!r} is neither a built-in tiny model ({', '.join(TINY)}) nor a config.json path")
    fields = json.loads(path.read_text())
    if "model_type" not in fields:
        raise ValueError(f"{path} has no 'model_type'")
    fields.update(overrides)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def build_model(config, *, device: str | torch.device | None = None, seed: int = 0) -> nn.Module:
    """``AutoModelForCausalLM.from_config(config)`` on ``device`` (``"meta"``: no memory), with
    weights seeded by ``seed`` so every rank builds the same model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        return AutoModelForCausalLM.from_config(config)
