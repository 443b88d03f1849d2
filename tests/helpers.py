"""Helpers that run inside the ranks: meshes (created once per process), tiny models, comparisons."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


@functools.cache
def mesh(shape: tuple[int, ...] | None = None, names: tuple[str, ...] = ("tp",)):
    """A cached CPU mesh over all ranks (new_group is a collective: create each shape once)."""
    return init_device_mesh("cpu", shape or (dist.get_world_size(),), mesh_dim_names=names)


def rank() -> int:
    return dist.get_rank()


def world() -> int:
    return dist.get_world_size()


def assert_close(actual, expected, what: str, atol: float = 1e-5, rtol: float = 1e-5) -> float:
    """assert_close that names ``what`` and returns the max abs difference."""
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")
    return (actual - expected).abs().max().item() if actual.numel() else 0.0


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False, attn_implementation="eager",
    )
    kw.update(overrides)
    return LlamaConfig(**kw)
