"""The torch functions the model trace (``analysis.trace``) reads by kind: shape calls, routing ops,
factories of a shape, ops that combine a dim's entries and contractions — a table each.
"""

from __future__ import annotations

__all__ = ["CONTRACTIONS", "FACTORIES", "MIXING_OPS", "RESHAPES", "ROUTING_OPS", "SHAPE_OPS", "SPLITS", "mixes_last"]

import torch
from torch import Tensor

SHAPE_OPS = {
    Tensor.view: "view", Tensor.reshape: "reshape", torch.reshape: "reshape", Tensor.unflatten: "unflatten",
    torch.unflatten: "unflatten", Tensor.split: "split", torch.split: "split", Tensor.split_with_sizes: "split",
    Tensor.chunk: "chunk", torch.chunk: "chunk", Tensor.__getitem__: "getitem",
}
#: ops that select by a learned score: a mixture of experts routes tokens with one of them (``ModelTrace.routes``).
ROUTING_OPS = {torch.topk: "topk", Tensor.topk: "topk", torch.argmax: "argmax", Tensor.argmax: "argmax",
               torch.argsort: "argsort", Tensor.argsort: "argsort", torch.sort: "sort", Tensor.sort: "sort"}
#: factories whose ints are a shape (``torch.zeros((1, self.n_heads, q, k))``: T5's position bias).
FACTORIES = {torch.zeros: "zeros", torch.ones: "ones", torch.empty: "empty", torch.full: "full", torch.arange: "arange"}
#: ops that combine the entries of a dim (by name: where its ``dim`` argument sits, None: always the last
#: dim): a colwise projection's output split there cannot pass through one (Granite Speech's CTC head:
#: ``softmax(out(h))`` fed to ``out_mid``).  Normalisation ops always combine the last dim.
MIXING_OPS = {
    **{f: ("softmax", 1) for f in (torch.softmax, Tensor.softmax, torch.nn.functional.softmax, torch.log_softmax,
                                   Tensor.log_softmax, torch.nn.functional.log_softmax)},
    **{f: ("reduce", 1) for f in (torch.sum, Tensor.sum, torch.mean, Tensor.mean, torch.amax, Tensor.amax,
                                  torch.logsumexp, Tensor.logsumexp, torch.cumsum, Tensor.cumsum, torch.var,
                                  Tensor.var, torch.std, Tensor.std)},
    torch.nn.functional.normalize: ("normalize", 2),
    **{f: ("norm", None) for f in (torch.nn.functional.layer_norm, torch.nn.functional.rms_norm,
                                   torch.nn.functional.group_norm)},
}
#: ops whose output features are new ones, contracted from two operands (a ``MIXING_OPS`` op after them
#: combines those, not a projection's)
CONTRACTIONS = {torch.matmul, Tensor.matmul, Tensor.__matmul__, Tensor.__rmatmul__, torch.bmm, Tensor.bmm, torch.mm,
                Tensor.mm, torch.einsum, torch.baddbmm, Tensor.baddbmm, torch.nn.functional.scaled_dot_product_attention}
RESHAPES = ("view", "reshape", "unflatten")  # calls whose ints are a shape
SPLITS = RESHAPES + ("split", "chunk")  # calls whose attribute ints must be local on the skeleton


def mixes_last(func, args: tuple, kwargs: dict) -> bool:
    """Whether a ``MIXING_OPS`` call combines its input's last dim (its ``dim``: None or the last)."""
    position = MIXING_OPS[func][1]
    if position is None:
        return True
    dim = kwargs.get("dim", args[position] if len(args) > position else None)
    if dim is None and func is torch.nn.functional.normalize:
        dim = 1  # its default
    if dim is None:
        return True  # a reduction over every dim
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    ndim = args[0].dim()
    return any(isinstance(d, int) and ndim and d % ndim == ndim - 1 for d in dims)
