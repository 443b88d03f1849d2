"""The random ops ``hpf.rng`` draws (``runtime.rng``): for each torch function, a handler that
binds its arguments and says what it draws (``Draw``: name, shape, why refused) and how to
compute it from a ``Source`` (stream key and the global index of each local element).  Ops
whose values would come from torch's per-rank generator are refused by name."""

from __future__ import annotations

__all__ = ["Draw", "Source", "drawn"]

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.counter_rng import draw


class Draw(NamedTuple):
    """One random op about to draw: its name, the shape of the values it draws, and why
    ``hpf.rng`` refuses it ("" when it does not)."""

    name: str
    shape: tuple[int, ...]
    refused: str = ""


class Source:
    """The values of one draw: stream ``key`` at the global index of each local element (per dim, an
    offset or a vector of global positions: ``core.counter_rng.global_index``)."""

    def __init__(self, key: int, local: Sequence[int], glob: Sequence[int], offset: Sequence[int | Tensor]):
        self.key, self.local, self.glob, self.offset = key, tuple(local), tuple(glob), tuple(offset)

    def uniform(self, dtype: torch.dtype, device) -> Tensor:
        return draw("uniform", self.key, self.local, self.glob, self.offset, device, dtype)

    def normal(self, dtype: torch.dtype, device) -> Tensor:
        return draw("normal", self.key, self.local, self.glob, self.offset, device, dtype)

    def keep(self, p: float, device) -> Tensor:
        return draw("keep", self.key, self.local, self.glob, self.offset, device, p=p)

    def dropout(self, p: float, dtype: torch.dtype, device) -> Tensor:
        """Dropout's multiplier: ``keep(p).to(dtype).div_(1 - p)``, drawn piece by piece."""
        return draw("dropout", self.key, self.local, self.glob, self.offset, device, dtype, p=p)


Run = Callable[[Source], object]
Handler = Callable[[tuple, dict], tuple[Draw | None, Run | None]]


# ---------------------------------------------------------------- the random ops
def _bind(stub: Callable, args: tuple, kwargs: dict) -> list:
    bound = inspect.signature(stub).bind(*args, **kwargs)
    bound.apply_defaults()
    return list(bound.arguments.values())


def _no_generator(name: str, kwargs: Mapping) -> str:
    if kwargs.get("generator") is not None:
        return f"{name}(generator=...) draws from that generator, not by global index; drop generator="
    if kwargs.get("out") is not None:
        return f"{name}(out=...) is not supported under hpf.rng; assign the result instead"
    return ""


def _dropout_stub(input, p=0.5, training=True, inplace=False):
    """``F.dropout``'s signature (for binding its arguments)."""


def _torch_dropout_stub(input, p, train):
    """``torch.dropout``'s signature."""


def _dropout(stub: Callable, torch_form: bool) -> Handler:
    def handler(args, kwargs):
        x, p, training, *rest = _bind(stub, args, kwargs)
        inplace = bool(rest and rest[0]) and not torch_form
        if not training or not isinstance(x, Tensor) or not 0 < p < 1:
            return None, None  # eval, p 0 (identity) or 1 (zeros), or torch's own error: torch's dropout

        def run(src: Source):
            noise = src.dropout(p, x.dtype, x.device)
            return x.mul_(noise) if inplace else x * noise
        return Draw("dropout", tuple(x.shape)), run
    return handler


def _sdpa_stub(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention``'s signature."""


def _sdpa(args, kwargs):
    """``scaled_dot_product_attention`` with ``dropout_p > 0``: its math, the dropout on the
    probabilities ``[..., L, S]`` drawn here (torch's fused kernels draw from their own generator)."""
    q, k, v, mask, p, causal, scale, gqa = _bind(_sdpa_stub, args, kwargs)
    if not p:
        return None, None
    heads = (*k.shape[:-3], q.shape[-3]) if gqa else k.shape[:-2]
    shape = (*torch.broadcast_shapes(q.shape[:-2], heads), q.shape[-2], k.shape[-2])

    def run(src: Source):
        kk, vv = k, v
        if gqa:
            kk = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
            vv = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
        scores = (q @ kk.transpose(-2, -1)) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
        if causal:
            tril = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~tril, float("-inf"))
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        probs = torch.softmax(scores, -1)
        probs = probs * src.dropout(p, probs.dtype, q.device)
        return probs @ vv
    return Draw("scaled_dot_product_attention", shape), run


def _size_of(args, kwargs) -> tuple[int, ...]:
    size = kwargs.get("size", args)
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = size[0]
    return tuple(int(s) for s in size)


def _factory(name: str, gaussian: bool, like: bool) -> Handler:
    def handler(args, kwargs):
        refused = _no_generator(name, kwargs)
        if like:
            x = args[0] if args else kwargs["input"]
            shape, dtype, device = tuple(x.shape), kwargs.get("dtype") or x.dtype, kwargs.get("device") or x.device
        else:
            shape = _size_of(args, kwargs)
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            device = kwargs.get("device") or torch.get_default_device()
        grad = bool(kwargs.get("requires_grad", False))

        def run(src: Source):
            t = src.normal(dtype, device) if gaussian else src.uniform(dtype, device)
            return t.requires_grad_(grad) if grad else t
        return Draw(name, shape, refused), run
    return handler


def _inplace(name: str) -> Handler:
    def handler(args, kwargs):
        x, rest = args[0], list(args[1:])
        refused = _no_generator(name, kwargs) or ("" if x.is_floating_point() else
                                                  f"{name} on a {x.dtype} tensor (floating point only)")

        def arg(i: int, key: str, default):
            return rest[i] if i < len(rest) else kwargs.get(key, default)

        def run(src: Source):
            if name == "uniform_":
                lo, hi = arg(0, "from", 0.0), arg(1, "to", 1.0)
                values = src.uniform(x.dtype, x.device) * (hi - lo) + lo
            elif name == "normal_":
                values = src.normal(x.dtype, x.device) * arg(1, "std", 1.0) + arg(0, "mean", 0.0)
            else:  # bernoulli_
                p = arg(0, "p", 0.5)
                values = (src.uniform(torch.float64, x.device) < (p.double() if isinstance(p, Tensor) else p)).to(x.dtype)
            return x.copy_(values)
        return Draw(name, tuple(x.shape), refused), run
    return handler


def _bernoulli(args, kwargs):
    x, rest = args[0] if args else kwargs["input"], list(args[1:])
    p = rest[0] if rest else kwargs.get("p")
    refused = _no_generator("bernoulli", kwargs)

    def run(src: Source):
        probs = x if p is None else p
        u = src.uniform(torch.float64, x.device)
        return (u < (probs.double() if isinstance(probs, Tensor) else probs)).to(x.dtype)
    return Draw("bernoulli", tuple(x.shape), refused), run


def _normal(args, kwargs):
    a = list(args) + [kwargs[k] for k in ("mean", "std", "size") if k in kwargs][len(args):]
    mean, std = a[0], a[1] if len(a) > 1 else 1.0
    refused = _no_generator("normal", kwargs)
    tensors = [t for t in (mean, std) if isinstance(t, Tensor)]
    if tensors:
        shape = tuple(torch.broadcast_shapes(*(t.shape for t in tensors)))
        dtype, device = tensors[0].dtype, tensors[0].device
    else:
        shape = _size_of((a[2],) if len(a) > 2 else (), {})
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        device = kwargs.get("device") or torch.get_default_device()

    def run(src: Source):
        return src.normal(dtype, device) * std + mean
    return Draw("normal", shape, refused), run


def _multinomial_stub(input, num_samples, replacement=False, *, generator=None, out=None):
    """``torch.multinomial``'s signature."""


def _multinomial(args, kwargs):
    """``multinomial`` (what sampling in ``generate()`` draws with): one uniform per sample by inverse
    CDF where the samples are independent (``num_samples == 1`` or ``replacement``), else the
    Gumbel top-k over one uniform per category (sampling without replacement).  Categories of zero
    probability are never drawn."""
    probs, n, replacement, *_ = _bind(_multinomial_stub, args, kwargs)
    refused = _no_generator("multinomial", kwargs)
    by_cdf = n == 1 or bool(replacement)
    shape = (*probs.shape[:-1], n) if by_cdf else tuple(probs.shape)

    def run(src: Source):
        weights = probs.detach().double()
        u = src.uniform(torch.float64, probs.device)
        if not by_cdf:  # Gumbel top-k: argsort of log p - log(-log u), the first n
            return (weights.log() - (-u.clamp_min(1e-300).log()).log()).topk(n, dim=-1).indices
        cdf = weights.cumsum(-1)
        drawn = torch.searchsorted(cdf, (u * cdf[..., -1:]).contiguous(), right=True)
        last = (weights > 0).long().cumsum(-1).argmax(-1, keepdim=True)  # the last category that can be drawn
        return torch.minimum(drawn, last)
    return Draw("multinomial", shape, refused), run


def _refuse(name: str, when: Callable[[tuple, dict], bool] | None = None) -> Handler:
    def handler(args, kwargs):
        if when is not None and not when(args, kwargs):
            return None, None
        return Draw(name, (), f"{name} is not covered by hpf.rng (it would draw from torch's per-rank generator); "
                               "use a covered op (dropout, rand, randn, bernoulli, uniform_, normal_) or draw it "
                               "outside the block"), None
    return handler


def _training(default: bool):
    def when(args, kwargs) -> bool:
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        training = args[2] if len(args) > 2 else kwargs.get("training", default)
        return bool(training) and p > 0
    return when


_HANDLERS: dict[object, Handler] = {
    F.dropout: _dropout(_dropout_stub, False),
    torch.dropout: _dropout(_torch_dropout_stub, True),
    F.scaled_dot_product_attention: _sdpa,
    torch.rand: _factory("rand", False, False),
    torch.randn: _factory("randn", True, False),
    torch.rand_like: _factory("rand_like", False, True),
    torch.randn_like: _factory("randn_like", True, True),
    Tensor.uniform_: _inplace("uniform_"),
    Tensor.normal_: _inplace("normal_"),
    Tensor.bernoulli_: _inplace("bernoulli_"),
    torch.bernoulli: _bernoulli,
    Tensor.bernoulli: _bernoulli,
    torch.normal: _normal,
    torch.multinomial: _multinomial,
    Tensor.multinomial: _multinomial,
    **{f: _refuse(n, _training(d)) for f, n, d in (
        (F.dropout1d, "dropout1d", True), (F.dropout2d, "dropout2d", True), (F.dropout3d, "dropout3d", True),
        (F.alpha_dropout, "alpha_dropout", False), (F.feature_alpha_dropout, "feature_alpha_dropout", False))},
    F.rrelu: _refuse("rrelu", lambda a, k: bool(a[3] if len(a) > 3 else k.get("training", False))),
    **{f: _refuse(n) for f, n in (
        (torch.randint, "randint"), (torch.randint_like, "randint_like"), (torch.randperm, "randperm"),
        (torch.poisson, "poisson"),
        (Tensor.random_, "random_"), (Tensor.exponential_, "exponential_"), (Tensor.cauchy_, "cauchy_"),
        (Tensor.log_normal_, "log_normal_"), (Tensor.geometric_, "geometric_"), (torch.rrelu, "rrelu"),
        (torch.alpha_dropout, "alpha_dropout"), (torch.feature_dropout, "feature_dropout"),
        (torch.feature_alpha_dropout, "feature_alpha_dropout"))},
}


def drawn(func, args: tuple, kwargs: dict) -> tuple[Draw | None, Run | None]:
    handler = _HANDLERS.get(func)
    return (None, None) if handler is None else handler(args, kwargs)


