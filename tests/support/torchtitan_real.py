"""torchtitan's own model definitions and parallelize plans, from the installed package (the
``titan`` extra: torchtitan 0.2.2), for the tests and the example.

``parallelize_plans(fn, model, ...)`` runs one of torchtitan's plan functions (``apply_tp``,
``apply_non_moe_tp``, ``apply_moe_ep_tp``) with ``parallelize_module`` replaced by a recorder in
that function's module: nothing is parallelized, and every ``{pattern: style}`` the function
hands over is returned under the model's module paths, keyed by the mesh argument it came
with (the tests pass mesh names as strings).  torchtitan's models are built from tiny
``*ModelArgs`` (1–2 layers, CPU, ``use_grouped_mm=False``: the for-loop experts)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

try:
    import torchtitan  # noqa: F401

    HAVE_TITAN, WHY = True, ""
except ImportError as exc:  # the titan extra is not installed
    HAVE_TITAN, WHY = False, f"torchtitan is not installed ({exc}): pip install -e '.[titan]'"

VOCAB, SEQ = 64, 8


def parallelize_plans(fn: Callable, model: nn.Module, *args, **kwargs) -> dict[str, dict[str, object]]:
    """``{mesh argument: {module path pattern: style}}`` of every ``parallelize_module`` call ``fn`` makes."""
    home = importlib.import_module(fn.__module__)
    paths = {id(m): n for n, m in model.named_modules()}
    plans: dict[str, dict[str, object]] = {}

    def record(module, device_mesh=None, parallelize_plan=None, **_):
        prefix = paths[id(module)]
        entries = parallelize_plan if isinstance(parallelize_plan, dict) else {"": parallelize_plan}
        for pattern, style in entries.items():
            path = ".".join(p for p in (prefix, pattern) if p)
            plans.setdefault(device_mesh, {})[path] = style
        return module

    old = home.parallelize_module
    home.parallelize_module = record
    try:
        fn(model, *args, **kwargs)
    finally:
        home.parallelize_module = old
    return plans


class CpuHistc(TorchFunctionMode):
    """torchtitan's MoE router counts expert ids with ``torch.histc`` on int64, which CPU torch
    does not implement ("histogram_cpu" not implemented for 'Long'); under this mode such a call
    counts in float and returns the input's dtype, as CUDA's does.  Everything else is untouched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.histc and not args[0].is_floating_point():
            return func(args[0].float(), *args[1:], **kwargs).to(args[0].dtype)
        return func(*args, **kwargs)


def _init(model: nn.Module, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
        for name, p in model.named_parameters():  # non-trivial norms, so their gradients are checked for real
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def llama3(seed: int = 0, **overrides) -> nn.Module:
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    args = TransformerModelArgs(**{**dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=VOCAB, multiple_of=16,
                                          max_seq_len=16), **overrides})
    return _init(Transformer(args), seed)


def qwen3(seed: int = 0, **overrides) -> nn.Module:
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
    from torchtitan.models.qwen3.model.model import Qwen3Model

    args = Qwen3ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=8, hidden_dim=48, vocab_size=VOCAB,
                          max_seq_len=16, **overrides)
    return _init(Qwen3Model(args), seed)


def deepseek_v3(seed: int = 0, **overrides) -> nn.Module:
    from torchtitan.models.deepseek_v3.model.args import DeepSeekV3ModelArgs
    from torchtitan.models.deepseek_v3.model.model import DeepSeekV3Model
    from torchtitan.models.moe import MoEArgs

    moe = MoEArgs(num_experts=4, num_shared_experts=1, top_k=2, use_grouped_mm=False, score_func="softmax",
                  score_before_experts=False)  # the scores weight the experts' (partial, under TP) outputs
    kwargs = dict(dim=32, inter_dim=48, moe_inter_dim=16, n_layers=2, n_dense_layers=1, n_heads=4, vocab_size=VOCAB,
                  max_seq_len=16, original_seq_len=16, q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=8,
                  qk_rope_head_dim=4, v_head_dim=8, moe_args=moe)
    args = DeepSeekV3ModelArgs(**{**kwargs, **overrides})
    args.moe_impl = "standard"  # set from the job config in torchtitan (update_from_config)
    model = _init(DeepSeekV3Model(args), seed)
    with torch.no_grad():  # routed experts and router large enough that their gradients are far from rounding
        for name, p in model.named_parameters():
            if ".moe.experts." in name or ".moe.router." in name:
                p.normal_(std=0.3)
    return model
