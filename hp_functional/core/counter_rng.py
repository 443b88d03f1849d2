"""A counter-based generator: random values that are a function of ``(key, global element index)``.

Every value is computed from its global index alone, with torch integer ops on the tensor's own
device (no generator state), so a shard draws exactly the values of its slice of the whole
tensor, whatever the layout, and any slice can be drawn without the rest (``gaussian_like``,
``hpf.rng``'s dropout).  The bits are SplitMix64's output at position ``index`` of the sequence
that starts at ``key`` (one round of its finalizer over ``key + index * golden``); uniforms
take the top bits; normals are Box–Muller over two independent words, with the logarithm and
the cosine computed as polynomials of correctly rounded ops only (``+ - * / sqrt``, ``frexp``),
so that a value is bit-identical whichever vector lane, kernel or device type computes it
(torch's ``log``/``cos`` are not: a CPU kernel's scalar tail and its vector body may differ in
the last bit).  See docs/randomness.md.

Speed: the hash is ~11 elementwise int64 ops.  ``draw`` runs them in place on pieces
small enough that a piece's two int64 buffers stay in a CPU core's L2 cache (``PIECE_CPU``; on an
accelerator one piece is large, ``CHUNK``, so kernel launches stay few), each piece's indices one
``arange`` where they are a run of the global index; values never depend on the piece size: each is a
function of its global index alone.
"""

from __future__ import annotations

__all__ = ["draw", "gaussian_like", "stream_key"]

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence

import torch
import xxhash
from torch import Tensor

from .errors import PlanError
from .placement import Box, ShardInfo, boxes

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_C1, _C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_SIGN = -(1 << 63)  # the int64 word whose only set bit is the sign bit
#: the most elements drawn at once on an accelerator (bounds the int64 temporaries)
CHUNK = 1 << 22
#: the elements drawn at once on a CPU: two int64 buffers of a piece (512 KiB) stay in L2
PIECE_CPU = 1 << 15


def _signed(z: int) -> int:
    """A 64-bit word as the int64 torch stores."""
    z &= _M64
    return z - (1 << 64) if z >> 63 else z


def _mix(z: int) -> int:
    """The SplitMix64 finalizer on a Python int (keys)."""
    z &= _M64
    z = ((z ^ (z >> 30)) * _C1) & _M64
    z = ((z ^ (z >> 27)) * _C2) & _M64
    return z ^ (z >> 31)


def stream_key(seed: int, *parts: int) -> int:
    """The 64-bit key of the stream ``parts`` (ints) under ``seed``: one mix per part, so
    ``(seed, 1, 2)`` and ``(seed, 2, 1)`` differ."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise PlanError(f"seed must be an int, got {type(seed).__name__}")
    key = _mix(seed ^ 0x6A09E667F3BCC908)
    for p in parts:
        key = _mix(key ^ _mix((p + _GOLDEN) & _M64))
    return key


def name_stream(name: str) -> int:
    """A stream id for ``name`` that every process computes alike (xxh64 of its UTF-8 bytes,
    not Python's salted ``hash``)."""
    return xxhash.xxh64_intdigest(name.encode())


def _lsr(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 words (torch's ``>>`` is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _lsr_into(x: Tensor, s: int, out: Tensor) -> Tensor:
    """``_lsr(x, s)`` written into ``out`` (no allocation)."""
    return torch.bitwise_right_shift(x, s, out=out).bitwise_and_((1 << (64 - s)) - 1)


def _fmix_(z: Tensor, tmp: Tensor) -> Tensor:
    """The SplitMix64 finalizer, in place on int64 words (multiplication wraps modulo 2**64);
    ``tmp``: a scratch buffer shaped like ``z``."""
    z.bitwise_xor_(_lsr_into(z, 30, tmp)).mul_(_signed(_C1))
    z.bitwise_xor_(_lsr_into(z, 27, tmp)).mul_(_signed(_C2))
    return z.bitwise_xor_(_lsr_into(z, 31, tmp))


def random_bits(key: int, index: Tensor) -> Tensor:
    """64 random bits (an int64 tensor shaped like ``index``) per element of ``index`` (int64
    global element indices) in stream ``key``: SplitMix64's output at position ``index`` of the
    sequence that starts at ``key`` (one finalizer round over ``key + index * golden``)."""
    z = index * _signed(_GOLDEN)
    return _fmix_(z.add_(_signed(key)), torch.empty_like(z))


_BITS = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}


def _float_bits(dtype: torch.dtype) -> int:
    if dtype not in _BITS:
        raise PlanError(f"counter-based random values are floating point (float64/32/16, bfloat16), not {dtype}")
    return _BITS[dtype]


def uniform(key: int, index: Tensor, dtype: torch.dtype) -> Tensor:
    """Uniform values in [0, 1) of ``dtype``, one per element of ``index``: the top k bits times
    2**-k, k the dtype's significand (exact: never rounds up to 1)."""
    k = _float_bits(dtype)
    return _lsr(random_bits(key, index), 64 - k).to(dtype).mul_(2.0 ** -k)


def keep_mask(key: int, index: Tensor, p: float) -> Tensor:
    """Dropout's keep mask: True with probability ``1 - p`` (to 2**-32), compared on integers: the
    top 32 bits read unsigned are at least ``floor(p * 2**32)`` (the sign bit flipped, so that a
    signed comparison orders the words as unsigned ones)."""
    return random_bits(key, index).bitwise_xor_(_SIGN) >= (int(p * 2.0 ** 32) << 32) + _SIGN


# Polynomial coefficients, highest power first (Horner): log(m) = 2 s (1 + s^2/3 + s^4/5 + ...)
# with s = (m - 1) / (m + 1), |s| <= 0.1716; cos and sin of psi in [0, pi/2) by their Taylor series;
# as many terms as the compute dtype resolves (the first left out below its rounding).
def _series(terms: int, coeff) -> tuple[float, ...]:
    return tuple(coeff(j) for j in range(terms - 1, -1, -1))


_POLY = {
    cd: (_series(n_log, lambda j: 1.0 / (2 * j + 1)),
         _series(n_trig, lambda j: (-1.0) ** j / math.factorial(2 * j)),
         _series(n_trig, lambda j: (-1.0) ** j / math.factorial(2 * j + 1)))
    for cd, n_log, n_trig in ((torch.float64, 13, 14), (torch.float32, 6, 8))
}


def _horner(x: Tensor, coeffs: Sequence[float]) -> Tensor:
    acc = torch.full_like(x, coeffs[0])
    for c in coeffs[1:]:
        acc = acc * x + c
    return acc


def normal(key: int, index: Tensor, dtype: torch.dtype) -> Tensor:
    """Standard normal values of ``dtype``, one per element of ``index`` (Box–Muller: the radius
    from one word, the angle from another; computed in float64 for float64, else float32, tails
    cut at 8.6 and 5.8 standard deviations by the uniforms' resolution)."""
    _float_bits(dtype)
    cd = torch.float64 if dtype == torch.float64 else torch.float32
    k = _BITS[cd]
    h1 = random_bits(key, index)
    h2 = random_bits(_mix(key ^ 0xB7E151628AED2A6B), index)
    u1 = (_lsr(h1, 64 - k) + 1).to(cd) * 2.0 ** -k  # (0, 1]
    del h1
    m, e = torch.frexp(u1)  # u1 = m * 2**e, m in [0.5, 1)
    small = m < math.sqrt(0.5)
    m = torch.where(small, m * 2.0, m)
    e = (e - small.to(e.dtype)).to(cd)
    s = (m - 1.0) / (m + 1.0)
    log_poly, cos_poly, sin_poly = _POLY[cd]
    log_u1 = e * math.log(2.0) + (s * 2.0) * _horner(s * s, log_poly)
    r = torch.sqrt(log_u1 * -2.0)
    quadrant = _lsr(h2, 62)
    frac = ((_lsr(h2, 64 - 2 - (k - 1)) & ((1 << (k - 1)) - 1)) * 2 + 1).to(cd) * 2.0 ** -k  # (0, 1)
    psi = frac * (math.pi / 2)
    x = psi * psi
    cos, sin = _horner(x, cos_poly), psi * _horner(x, sin_poly)
    # cos(quadrant * pi/2 + psi): cos, -sin, -cos, sin
    c = torch.where(quadrant == 0, cos, torch.where(quadrant == 1, -sin, torch.where(quadrant == 2, -cos, sin)))
    return (r * c).to(dtype)


def _contiguous(local_shape: Sequence[int], global_shape: Sequence[int], offset: Sequence[int | Tensor]) -> bool:
    """Whether a block at integer ``offset`` is one run of the global row-major index: one index in
    the leading dims, then one dim cut, then dims whole."""
    if any(isinstance(o, Tensor) for o in offset):
        return False
    cut = next((d for d, k in enumerate(local_shape) if k != 1), len(local_shape))
    return all(k == g for k, g in zip(local_shape[cut + 1:], global_shape[cut + 1:], strict=True))


def global_index(local_shape: Sequence[int], global_shape: Sequence[int], offset: Sequence[int | Tensor],
                 device: torch.device | str) -> Tensor:
    """The row-major flat index in ``global_shape`` of every element of a local block of
    ``local_shape`` (int64, shaped ``local_shape``).  Per dim, ``offset`` is either an int (the
    block holds global positions ``offset, offset + 1, ...`` of that dim) or a 1-D integer tensor
    of ``local_shape[d]`` global positions, in local order (a non-affine map: context
    parallelism's zigzag sequence chunks)."""
    n = len(local_shape)
    if _contiguous(local_shape, global_shape, offset):  # one run of the global flat index: one arange
        start = sum(o * math.prod(global_shape[d + 1:]) for d, o in enumerate(offset))
        return torch.arange(start, start + math.prod(local_shape), dtype=torch.int64, device=device).view(tuple(local_shape))
    index = torch.zeros((1,) * n, dtype=torch.int64, device=device)
    stride = 1
    for d in reversed(range(n)):
        if isinstance(offset[d], Tensor):
            r = offset[d].to(device=device, dtype=torch.int64)
            if r.shape != (local_shape[d],):
                raise PlanError(f"global_index: the positions of dim {d} have shape {tuple(r.shape)}, not "
                                f"({local_shape[d]},) (one global position per local element)")
        else:
            r = torch.arange(offset[d], offset[d] + local_shape[d], dtype=torch.int64, device=device)
        index = index + (r * stride).view(*(1,) * d, -1, *(1,) * (n - d - 1))
        stride *= global_shape[d]
    return index.expand(*local_shape) if n else index.reshape(())


def _piece_boxes(shape: Sequence[int], piece: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(start, size)`` boxes tiling a tensor of ``shape`` in row-major order, each of at most
    ``piece`` elements where the last dim allows (a box of one index in the leading dims and a run
    of rows of the first dim whose trailing block fits)."""
    n = len(shape)
    cut = next(d for d in range(n + 1) if math.prod(shape[d:]) <= piece)  # dims >= cut: whole in a box
    if cut == 0:
        yield (0,) * n, tuple(shape)
        return
    c = cut - 1  # the dim cut into runs of rows
    rows = max(1, piece // max(math.prod(shape[cut:]), 1))
    for lead in itertools.product(*(range(k) for k in shape[:c])):
        for r in range(0, shape[c], rows):
            yield (*lead, r, *(0,) * (n - cut)), (*(1,) * c, min(rows, shape[c] - r), *shape[cut:])


def _shifted(offset: Sequence[int | Tensor], start: Sequence[int], size: Sequence[int]) -> tuple[int | Tensor, ...]:
    """The per-dim global offsets (``global_index``'s) of the box ``start``/``size`` of a block at ``offset``."""
    return tuple(o[s:s + k] if isinstance(o, Tensor) else o + s for o, s, k in zip(offset, start, size, strict=True))


def draw(kind: str, key: int, local: Sequence[int], glob: Sequence[int], offset: Sequence[int | Tensor],
         device: torch.device | str, dtype: torch.dtype = torch.float32, p: float = 0.0) -> Tensor:
    """Stream ``key``'s values at the global index of every element of a local block (``global_index``'s
    arguments), shaped ``local``: ``"keep"`` (dropout's keep mask with drop probability ``p``, bool),
    ``"dropout"`` (that mask as ``dtype`` divided by ``1 - p``: dropout's multiplier), ``"uniform"`` or
    ``"normal"`` (of ``dtype``).  The same values as ``keep_mask``/``uniform``/``normal`` over
    ``global_index(local, glob, offset)``, drawn piece by piece (module docstring)."""
    fn = {"keep": lambda idx: keep_mask(key, idx, p),
          "dropout": lambda idx: keep_mask(key, idx, p).to(dtype).div_(1 - p),
          "uniform": lambda idx: uniform(key, idx, dtype), "normal": lambda idx: normal(key, idx, dtype)}[kind]
    out = torch.empty(tuple(local), dtype=torch.bool if kind == "keep" else dtype, device=device)
    piece = PIECE_CPU if torch.device(device).type == "cpu" else CHUNK
    for start, size in _piece_boxes(tuple(local), piece):
        if 0 in size:
            continue
        where = tuple(slice(s, s + k) for s, k in zip(start, size, strict=True))
        out[where] = fn(global_index(size, glob, _shifted(offset, start, size), device))
    return out


def gaussian_like(params: Mapping[str, Tensor], shard_info: Mapping[str, ShardInfo] | None = None,
                  std: float | Mapping[str, float] = 1.0, seed: int = 0) -> dict[str, Tensor]:
    """Gaussian noise shaped like ``params`` whose every element depends only on ``(seed,
    the leaf's name, the element's global index)``: ``hpf.unshard`` of the result is the same
    bits at any layout (TP, ``hpf.fsdp`` row splits, packed blocks, KV-head groups, expert
    stacks) and equals the result for the unsharded parameters.  Local: no communication.
    For DP-SGD noise and perturbations.

    Args:
        params: this rank's local shards by key (``shard()``'s or ``fsdp()``'s params), or the
            whole tensors (``dict(model.named_parameters())``) with ``shard_info=None``.
        shard_info: where each shard sits (``shard()``'s third value); None: every tensor is whole.
        std: the standard deviation, one for all leaves or one per key (every key present).
        seed: an int; the leaf key (the parameter's FQN) picks the stream within it.
    Returns:
        A dict with ``params``' keys of new tensors (each leaf's shape, dtype and device, no grad).
    """
    if shard_info is not None:
        missing = sorted(set(params) - set(shard_info))
        if missing:
            raise PlanError(f"gaussian_like: no ShardInfo for {missing[:3]}; pass the shard_info of the same "
                            "shard()/fsdp() call as params (or None for whole tensors)")
    if isinstance(std, Mapping):
        missing = sorted(set(params) - set(std))
        if missing:
            raise PlanError(f"gaussian_like: std has no entry for {missing[:3]}; give one per key or a single float")
    elif isinstance(std, bool) or not isinstance(std, (int, float)):
        raise PlanError(f"gaussian_like: std must be a float or a dict of floats by key, got {type(std).__name__}")
    out = {}
    for name, p in params.items():
        if not isinstance(p, Tensor) or not p.is_floating_point():
            raise PlanError(f"gaussian_like: params[{name!r}] is not a floating-point tensor")
        if shard_info is None:
            glob, parts = tuple(p.shape), [Box((0,) * p.dim(), (0,) * p.dim(), tuple(p.shape))]
        else:
            info = shard_info[name]
            if tuple(p.shape) != tuple(info.local_shape):
                raise PlanError(f"gaussian_like: params[{name!r}] has shape {tuple(p.shape)}, but its ShardInfo's "
                                f"local shape is {tuple(info.local_shape)}; pass the params and shard_info of one call")
            glob, parts = tuple(info.global_shape), boxes(info)
        scale = float(std[name] if isinstance(std, Mapping) else std)
        key = stream_key(seed, name_stream(name))
        noise = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
        compute = torch.float64 if p.dtype == torch.float64 else torch.float32
        for box in parts:
            if 0 not in box.size:
                box.of_local(noise).copy_(draw("normal", key, box.size, glob, box.start, p.device, compute).mul_(scale))
        out[name] = noise
    return out
