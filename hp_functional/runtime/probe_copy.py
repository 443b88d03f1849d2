"""The shard-time probe's private copy (``runtime.probe``): the model reduced to one block of each
kind (``compile.reduced_copy``, checked against the whole model's forward), seeded unit-scale values,
buffers from the model or recomputed by their modules' init, a small vocabulary; and the batch it is
fed.  Nothing of the user's weights is used.
"""

from __future__ import annotations

__all__ = ["probe_copy_or_reason", "probe_inputs"]

import math
from collections.abc import Mapping

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from ..compile.dataflow import synthesize_inputs
from ..compile.reduced_copy import Reduced, reduced_copy
from ..core.errors import PlanError
from ..core.module_kinds import CONVS
from .weights import recompute_buffers

#: the probe copy's vocabulary (``shrink_vocab``): divides every mesh size up to 64
PROBE_VOCAB = 128


def probe_copy(model: nn.Module, seed: int, device: torch.device, marks: Mapping[str, str],
               vocab: int | None = PROBE_VOCAB, inputs: tuple[tuple, dict] | None = None,
               keep: int | None = 1) -> Reduced:
    """``compile.reduce.reduced_copy`` of ``model`` (``marks``: how the plan treats each path) on
    ``device`` with seeded random values (unit-scale activations; no module init needed) and its
    buffers recomputed by their modules' init; its vocabulary shrunk to ``vocab`` (None: kept).
    ``inputs``: the batch the probe is fed (None: a synthesized one), on which the reduction is checked;
    ``keep``: the blocks of each kind it starts from (``compile.reduced_copy``; None: every block)."""
    probe = reduced_copy(model, marks, inputs if inputs is not None else synthesize_inputs(model, rows=2, length=8),
                         keep)
    twin = probe.model.eval()  # dropout off: the probe compares functions, not random draws
    if vocab is not None:
        shrink_vocab(twin, vocab)
    originals = dict(model.named_buffers())
    buffers, missing = {}, []
    for name, _ in twin.named_buffers():  # the model's own constants where it has them, else recomputed
        b = originals.get(probe.original(name))
        if b is not None and b.device.type != "meta":
            buffers[name] = b.detach().clone().to(device)
        else:
            missing.append(name)
    buffers |= recompute_buffers(twin, missing, device)
    twin = twin.to_empty(device=device)
    gen = torch.Generator().manual_seed(seed)
    convolved = {id(m.weight) for m in twin.modules() if isinstance(m, CONVS)}
    with torch.no_grad():
        for p in twin.parameters():
            p.copy_(_unit_scale(p, gen, id(p) in convolved).to(p.dtype))
            p.requires_grad_(True)
        for name, b in buffers.items():
            owner, _, attr = name.rpartition(".")
            twin.get_submodule(owner)._buffers[attr] = b
    return Reduced(twin, probe.names, probe.renames)


def _unit_scale(p: Tensor, gen: torch.Generator, convolution: bool) -> Tensor:
    """Random values that keep activations at unit scale: a vector (norms, biases) in [0.5, 1.5), a
    matrix normal over the square root of its fan-in: the last dim (a Linear's inputs), or a
    convolution's every dim but the first (in-channels per group times the kernel's size; its last
    dim alone, the kernel's width, would let a deep ConvNet's activations grow past what float32
    resolves, and rounding then differs between the sharded and the unsharded copy)."""
    if p.dim() < 2:
        return torch.rand(p.shape, generator=gen) + 0.5
    fan_in = math.prod(p.shape[1:]) if convolution else p.shape[-1]
    return torch.randn(p.shape, generator=gen) / max(fan_in, 1) ** 0.5


def probe_inputs(inputs: tuple[tuple, dict], device: torch.device) -> tuple[tuple[tuple, dict] | None, str]:
    """``shard(..., example_inputs=)``'s ``(args, kwargs)`` on the probe copy's ``device`` (detached
    copies), or why not: meta tensors carry no values to compare."""
    if any(isinstance(x, Tensor) and x.device.type == "meta" for x in tree_flatten(inputs)[0]):
        return None, "example_inputs are meta tensors: no values to probe with"
    return tree_map(lambda x: x.detach().to(device) if isinstance(x, Tensor) else x, inputs), ""


def _fits_vocab(inputs: tuple[tuple, dict] | None, vocab: int) -> bool:
    """Whether every integer tensor of ``inputs`` indexes below ``vocab`` (the shrunk copy takes it)."""
    ints = [x for x in tree_flatten(inputs)[0] if isinstance(x, Tensor) and not x.is_floating_point()
            and not x.is_complex() and x.dtype != torch.bool and x.numel() and x.device.type != "meta"]
    return all(int(x.max()) < vocab for x in ints)


def shrink_vocab(twin: nn.Module, vocab: int) -> None:
    """Give the (meta) copy a vocabulary of ``vocab`` tokens: its embeddings and output heads of the
    vocabulary's size are the copy's largest tensors and say nothing a small vocabulary does not, so
    the probe's memory stays a block's, not the model's.  Left alone where the vocabulary's size is
    also another dim of the model (which dims are the vocabulary's would be a guess).  Ties stay."""
    try:  # the model's own token table where it names one (Qwen3-VL's first table is the vision's positions)
        emb = twin.get_input_embeddings() if hasattr(twin, "get_input_embeddings") else None
    except (NotImplementedError, AttributeError):
        emb = None
    if not isinstance(emb, nn.Embedding):
        emb = next((m for m in twin.modules() if isinstance(m, nn.Embedding)), None)
    if emb is None or emb.num_embeddings <= vocab:
        return
    big = emb.num_embeddings
    heads = [m for m in twin.modules() if isinstance(m, nn.Linear) and m.out_features == big]
    vocab_params = {id(m.weight) for m in twin.modules() if isinstance(m, nn.Embedding) and m.num_embeddings == big}
    vocab_params |= {id(p) for m in heads for p in (m.weight, m.bias) if p is not None}
    others = {d for p in [*twin.parameters(), *twin.buffers()] if id(p) not in vocab_params for d in p.shape}
    if big in others:
        return
    new: dict[int, nn.Parameter] = {}
    for m in twin.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and id(p) in vocab_params:
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(torch.empty((vocab, *p.shape[1:]), dtype=p.dtype, device=p.device),
                                              requires_grad=p.requires_grad)
                m._parameters[name] = new[id(p)]
        if isinstance(m, nn.Embedding) and m.num_embeddings == big:
            m.num_embeddings = vocab
            if m.padding_idx is not None and m.padding_idx >= vocab:
                m.padding_idx = vocab - 1
        elif isinstance(m, nn.Linear) and m.out_features == big:
            m.out_features = vocab
    config = getattr(twin, "config", None)  # HF's loss views logits by config.vocab_size
    for c in {id(c): c for c in (config, getattr(config, "get_text_config", lambda: None)())}.values():
        if c is not None and getattr(c, "vocab_size", None) == big:
            c.vocab_size = vocab


def probe_copy_or_reason(model: nn.Module, seed: int, device: torch.device, marks: Mapping[str, str],
                         inputs: tuple[tuple, dict] | None = None) -> tuple[Reduced | None, str]:
    """``probe_copy``, or why the model cannot be copied and initialised for the probe; ``inputs``:
    the batch it will be fed.  Where the copy does not take that batch, the next of: its vocabulary
    kept (an integer input indexes beyond ``PROBE_VOCAB``, or CPM-Ant offsets its ids by the
    vocabulary size it was built with), then every block kept (a stack whose blocks of one kind the
    forward chains at different widths: EoMT's upscale blocks; its meta check could not run there)."""
    tries = [(PROBE_VOCAB, 1), (None, 1), (None, None)] if _fits_vocab(inputs, PROBE_VOCAB) else [(None, 1), (None, None)]
    try:
        for i, (vocab, keep) in enumerate(tries):
            copy = probe_copy(model, seed, device, marks, vocab, inputs, keep)
            if inputs is None or i == len(tries) - 1 or _takes(copy.model, inputs, device):
                return copy, ""
    except PlanError as exc:
        return None, f"no probe copy: {exc}"
    except Exception as exc:  # noqa: BLE001 - a model whose init cannot run privately: reported, not probed
        return None, f"no probe copy: {type(exc).__name__}: {str(exc)[:160]}"
    raise AssertionError("unreachable: the last try returns")


def _takes(model: nn.Module, inputs: tuple[tuple, dict], device: torch.device) -> bool:
    """Whether ``model`` runs one forward on ``inputs`` (no gradients; meta inputs: assumed)."""
    fed, _ = probe_inputs(inputs, device)
    if fed is None:
        return True
    fed = tree_map(lambda x: x.clone() if isinstance(x, Tensor) else x, fed)  # a forward may write its inputs
    try:
        with torch.no_grad():
            model(*fed[0], **fed[1])
    except Exception:  # noqa: BLE001 - any failure: the copy does not take this batch at its shrunk size
        return False
    return True
