"""Tiny torchtitan 0.3.0 models (the ``titan3`` extra), with the sharding torchtitan declares,
for ``tests/models/test_torchtitan3.py``.

torchtitan 0.3.0 builds a model from a ``Model.Config`` and declares its sharding on that config
(``set_llama3_sharding_config`` etc., called from ``update_from_config``); ``config.build()``
copies each ``sharding_config`` onto its module (``module._sharding_config``), where
``ShardingPlan.from_torchtitan`` reads it.  The models here are built with torchtitan's own
layer builders at tiny sizes (CPU, random weights), with torch's SDPA as the inner attention:
torchtitan's language-model backends are FlexAttention (compiled, no backward on the CPU) and
varlen (CUDA), and its ``get_attention_config("sdpa")`` refuses SDPA for language models, but
``ScaledDotProductAttention`` is torchtitan's own module and is causal when the model is called
without attention masks.  ``attn="flex"`` keeps torchtitan's default.
"""

from __future__ import annotations

import torch
from torch import nn

try:
    import spmd_types  # noqa: F401
    import torchtitan
    from torchtitan.protocols.sharding import ShardingConfig  # noqa: F401  (0.3.0's declarative sharding)

    HAVE_TITAN3, WHY = True, ""
except ImportError as exc:  # the titan3 extra is not installed (or torchtitan 0.2.x is)
    HAVE_TITAN3, WHY = False, f"torchtitan 0.3.0 is not installed ({exc}): pip install -e '.[titan3]'"
else:
    if not torchtitan.__version__.startswith("0.3"):  # pragma: no cover - a newer release
        HAVE_TITAN3, WHY = False, f"torchtitan {torchtitan.__version__} is installed; these tests are for 0.3.0"

VOCAB, SEQ = 64, 8


def _sdpa(layers, attn: str) -> None:
    """Every layer's inner attention torch's SDPA (``attn="sdpa"``), else torchtitan's choice."""
    if attn != "sdpa":
        return
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()


def _build(config, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = config.build()
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
        for name, p in model.named_parameters():  # non-trivial norms, so their gradients are checked for real
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "experts" in name or "router" in name:  # routed experts large enough to be far from rounding
                p.normal_(std=0.3)
    return model


def llama3(seed: int = 0, *, enable_sp: bool = True, attn: str = "sdpa", n_heads: int = 4, n_kv_heads: int = 4,
           fuse_qkv: bool = True) -> nn.Module:
    """A 2-layer Llama 3 (dim 32) with ``set_llama3_sharding_config(enable_sp=)``."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    dim = 32
    layers = _build_llama3_layers(n_layers=2, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, hidden_dim=48,
                                  fuse_qkv=fuse_qkv, attn_backend="flex",
                                  rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=64, theta=500000))
    _sdpa(layers, attn)
    init = {"weight": nn.init.ones_}
    config = Llama3Model.Config(
        dim=dim, vocab_size=VOCAB, layers=layers, norm=RMSNorm.Config(normalized_shape=dim, param_init=init),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim,
                                        param_init={"weight": nn.init.normal_}),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB,
                              param_init={"weight": lambda t: nn.init.normal_(t, std=dim ** -0.5)}))
    set_llama3_sharding_config(config, enable_sp=enable_sp)
    return _build(config, seed)


def qwen3(seed: int = 0, *, enable_sp: bool = True, attn: str = "sdpa") -> nn.Module:
    """A 2-layer dense Qwen 3 (q/k norms, head_dim 8, tied embeddings) with ``set_qwen3_sharding_config``."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_layers, _qwen3_norm
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    dim, head_dim = 32, 8
    layers = _build_qwen3_layers(n_layers=2, dim=dim, n_heads=4, n_kv_heads=2, head_dim=head_dim, hidden_dim=48,
                                 attn_backend="flex", rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=64, theta=1e6))
    _sdpa(layers, attn)
    config = Qwen3Model.Config(
        vocab_size=VOCAB, dim=dim, norm=_qwen3_norm(dim), layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim,
                                        param_init={"weight": nn.init.normal_}),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB,
                              param_init={"weight": lambda t: nn.init.normal_(t, std=dim ** -0.5)}))
    set_qwen3_sharding_config(config, enable_sp=enable_sp, enable_ep=False)
    return _build(config, seed)


def deepseek_v3(seed: int = 0, *, enable_sp: bool = True, enable_ep: bool = False, attn: str = "sdpa",
                n_heads: int = 4) -> nn.Module:
    """A 2-layer DeepSeek-V3 (MLA, 1 dense + 1 MoE layer: 4 experts, top 2, a shared expert) with
    ``set_deepseek_v3_sharding_config``."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, _build_dsv3_layers
    from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

    dim = 32
    layers = _build_dsv3_layers(
        n_layers=2, n_dense_layers=1, dim=dim, n_heads=n_heads, q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, mscale=1.0, dense_hidden_dim=48, moe_hidden_dim=16, num_experts=4,
        num_shared_experts=1, router_top_k=2, router_score_func="softmax", attn_backend="flex",
        moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=4, max_seq_len=64, theta=10000.0))
    _sdpa(layers, attn)
    init = {"weight": nn.init.ones_}
    config = DeepSeekV3Model.Config(
        vocab_size=VOCAB, dim=dim, layers=layers, norm=RMSNorm.Config(normalized_shape=dim, param_init=init),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim,
                                        param_init={"weight": nn.init.normal_}),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB,
                              param_init={"weight": lambda t: nn.init.normal_(t, std=dim ** -0.5)}))
    set_deepseek_v3_sharding_config(config, enable_sp=enable_sp, enable_ep=enable_ep)
    return _build(config, seed)
