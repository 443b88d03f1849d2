"""Models, plan building blocks and the per-rank checks behind tests/plan/test_properties.py.

A case is plain data (``Case``): a model description (``NetSpec``), a mesh, the plan's entries
and the layouts the caller passes and receives.  Every rank rebuilds the same model from the
case's seed, so the reference (unsharded) forward and gradients are computed locally.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import hp_functional as hpf
from tests.support.helpers import mesh
from tests.support.snapshot import assert_unchanged, snapshot

ACTS = {"gelu": F.gelu, "silu": F.silu, "tanh": torch.tanh}


@dataclass(frozen=True)
class MixSpec:
    """An MLP (``mlp``: up/down, ``gated``: gate/up/down, ``packed``: gate_up/down) or ``attn``."""

    kind: str
    hidden: int = 0  # MLP intermediate size
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    bias: bool = True
    act: str = "gelu"
    causal: bool = True


@dataclass(frozen=True)
class BlockSpec:
    norm: str | None  # "layer", "layer_nobias", "rms" or None
    mix: MixSpec
    residual: bool = True


@dataclass(frozen=True)
class NetSpec:
    d: int
    blocks: tuple[BlockSpec, ...]
    vocab: int = 0  # 0: no embedding, the input is a float tensor
    padding_idx: int | None = None
    final_norm: str | None = None
    head: int = 0  # 0: no output head
    head_bias: bool = False


@dataclass
class Case:
    """One generated example: mesh, model, plan, and the caller's input/output layouts.

    Layouts: ``R`` replicated, ``S`` sequence-sharded (dim 1), ``V`` sharded on the last dim."""

    mesh_shape: tuple[int, ...]
    mesh_names: tuple[str, ...]
    axis: str
    net: NetSpec
    entries: dict = field(default_factory=dict)
    tp_axis: str = "tp"
    in_layout: str = "R"
    out_layout: str = "R"
    batch: int = 2
    seq: int = 4
    seed: int = 0
    use_grad: bool = False
    meta: dict = field(default_factory=dict)  # what the generator chose (kinds per block, emb, head)


def _norm(kind: str | None, d: int) -> nn.Module | None:
    if kind is None:
        return None
    if kind == "rms":
        return nn.RMSNorm(d)
    return nn.LayerNorm(d, bias=kind == "layer")


class Mlp(nn.Module):
    def __init__(self, d: int, s: MixSpec):
        super().__init__()
        self.kind, self.act = s.kind, ACTS[s.act]
        if s.kind == "packed":
            self.gate_up = nn.Linear(d, 2 * s.hidden, bias=s.bias)
        elif s.kind == "gated":
            self.gate = nn.Linear(d, s.hidden, bias=s.bias)
        if s.kind != "packed":
            self.up = nn.Linear(d, s.hidden, bias=s.bias)
        self.down = nn.Linear(s.hidden, d, bias=s.bias)

    def forward(self, x):
        if self.kind == "packed":
            g, u = self.gate_up(x).chunk(2, -1)
            return self.down(self.act(g) * u)
        if self.kind == "gated":
            return self.down(self.act(self.gate(x)) * self.up(x))
        return self.down(self.act(self.up(x)))


class Attn(nn.Module):
    """Self-attention that reshapes with its ``num_heads``/``num_key_value_heads`` attributes."""

    def __init__(self, d: int, s: MixSpec):
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim, self.causal = s.heads, s.kv_heads, s.head_dim, s.causal
        self.q = nn.Linear(d, s.heads * s.head_dim, bias=s.bias)
        self.k = nn.Linear(d, s.kv_heads * s.head_dim, bias=s.bias)
        self.v = nn.Linear(d, s.kv_heads * s.head_dim, bias=s.bias)
        self.o = nn.Linear(s.heads * s.head_dim, d, bias=s.bias)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        rep = self.num_heads // self.num_key_value_heads
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                             is_causal=self.causal)
        return self.o(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


class Block(nn.Module):
    def __init__(self, d: int, s: BlockSpec):
        super().__init__()
        self.residual = s.residual
        if s.norm:
            self.norm = _norm(s.norm, d)
        self.mix = Attn(d, s.mix) if s.mix.kind == "attn" else Mlp(d, s.mix)

    def forward(self, h):
        y = self.mix(self.norm(h) if hasattr(self, "norm") else h)
        return h + y if self.residual else y


class Net(nn.Module):
    def __init__(self, s: NetSpec):
        super().__init__()
        if s.vocab:
            self.emb = nn.Embedding(s.vocab, s.d, padding_idx=s.padding_idx)
        self.blocks = nn.ModuleList(Block(s.d, b) for b in s.blocks)
        if s.final_norm:
            self.norm_f = _norm(s.final_norm, s.d)
        if s.head:
            self.head = nn.Linear(s.d, s.head, bias=s.head_bias)

    def forward(self, inp):
        h = self.emb(inp) if hasattr(self, "emb") else inp
        for block in self.blocks:
            h = block(h)
        if hasattr(self, "norm_f"):
            h = self.norm_f(h)
        return self.head(h) if hasattr(self, "head") else h


def build(spec: NetSpec, seed: int) -> Net:
    """The model with seeded weights (identical on every rank); norms get non-trivial affine params."""
    torch.manual_seed(seed)
    model = Net(spec)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
                m.weight.uniform_(0.5, 1.5)
                if getattr(m, "bias", None) is not None:
                    m.bias.uniform_(-0.5, 0.5)
    return model


# ------------------------------------------------------------------------------- plan pieces
R_KINDS = ("tp", "gather", "split_input", "none")  # replicated in, replicated out
S_KINDS = ("sp", "sp_prepare", "spec_gather")  # sequence-sharded in and out ("sp": MLP only, attention reads s from x)
S_GATHERED_KINDS = ("rep_in", "spec_split")  # after SequenceParallel(output_layout=Replicate()): R in, S out
HEAD_DIV = ("tp", "sp", "sp_prepare", "rep_in")  # attention: head counts divided; MLP: Colwise(packed=2) if packed


def sharded_dims(kind: str, mix: MixSpec) -> str:
    """What must divide the axis size: ``hidden`` (MLP), ``heads`` (head counts), ``features``
    (q/k/v/o features without head division) or nothing."""
    if kind in ("none", "spec_gather", "spec_split"):
        return ""
    if mix.kind != "attn":
        return "hidden"
    return "heads" if kind in HEAD_DIV else "features"


def mix_styles(kind: str, mix: MixSpec, axis: str, key: int | str = 0, use_prepare: bool = False) -> dict:
    """Canonical styles (axis None) of a mixer's modules, keyed by path relative to the mixer."""
    attn = mix.kind == "attn"
    cols = ("q", "k", "v") if attn else {"packed": ("gate_up",), "gated": ("gate", "up")}.get(mix.kind, ("up",))
    row = "o" if attn else "down"
    packed = 2 if mix.kind == "packed" else None
    attrs = ("num_heads", "num_key_value_heads")
    heads = hpf.PrepareInput(divide_attrs=attrs) if use_prepare else hpf.Heads()
    root = {"": heads} if attn and kind in HEAD_DIV else {}
    seq, rep = Shard(1), Replicate()
    if kind == "tp":
        return {**root, **{c: hpf.Colwise(packed=packed) for c in cols}, row: hpf.Rowwise()}
    if kind == "gather":  # not packed: a packed Colwise cannot gather its output (rejected by the style)
        return {c: hpf.Colwise(gather_output=True) for c in cols}
    if kind == "split_input":
        return {row: hpf.Rowwise(input_layout=rep)}
    if kind == "sp":
        return {**root, **{c: hpf.Colwise(input_layout=seq, packed=packed) for c in cols}, row: hpf.Rowwise(output_layout=seq)}
    if kind == "sp_prepare":
        prep = hpf.PrepareInput({key: (seq, rep)}, divide_attrs=attrs if attn else ())
        return {"": prep, **{c: hpf.Colwise(packed=packed) for c in cols}, row: hpf.Rowwise(output_layout=seq)}
    if kind == "rep_in":
        return {**root, **{c: hpf.Colwise(packed=packed) for c in cols}, row: hpf.Rowwise(output_layout=seq)}
    if kind == "spec_gather":  # the whole mixer replicated: gather the sequence in, split it out
        return {"": hpf.ModuleSpec(in_src={key: {axis: seq}}, in_dst={key: {axis: rep}},
                                   out_src={"output": {axis: rep}}, out_dst={"output": {axis: seq}})}
    if kind == "spec_split":
        return {"": hpf.ModuleSpec(out_src={"output": {axis: rep}}, out_dst={"output": {axis: seq}})}
    return {}


def module_types(spec: NetSpec) -> dict[str, str]:
    """``named_modules()`` path -> class name of ``Net(spec)``, in order (built on the meta device)."""
    with torch.device("meta"):
        return {p: type(m).__name__ for p, m in Net(spec).named_modules()}


# ------------------------------------------------------------------------------- rank checks
def _plan(case: Case) -> hpf.ShardingPlan:
    return hpf.ShardingPlan(case.entries, axes={"tp": case.tp_axis})


def _axis(case: Case, m):
    dim = case.mesh_names.index(case.axis)
    return m.size(dim), m.get_local_rank(dim)


def _local(t: torch.Tensor, layout: str, n: int, r: int) -> torch.Tensor:
    return t if layout == "R" else t.chunk(n, 1 if layout == "S" else -1)[r]


def _inputs(case: Case):
    g = torch.Generator().manual_seed(case.seed + 1)
    net, shape = case.net, (case.batch, case.seq)
    inp = torch.randint(0, net.vocab, shape, generator=g) if net.vocab else torch.randn(*shape, net.d, generator=g)
    w = torch.randn(*shape, net.head or net.d, generator=g)
    return inp, w


def _reference(model: nn.Module, inp, w, dtype) -> dict[str, torch.Tensor]:
    """The unsharded output and gradients, computed in ``dtype`` on a copy of ``model``."""
    ref = copy.deepcopy(model).to(dtype)
    inp = inp.to(dtype) if inp.is_floating_point() else inp
    out = ref(inp)
    (out * w.to(dtype)).sum().backward()
    return {"output": out.detach(), **{f"grad {k}": p.grad for k, p in ref.named_parameters()}}


def run_valid(case: Case) -> float:
    """Sharded forward and every gradient equal the unsharded model's; nothing is mutated.

    All collectives run before any comparison, so a mismatch on one rank cannot hang the others."""
    m = mesh(case.mesh_shape, case.mesh_names)
    n, r = _axis(case, m)
    model = build(case.net, case.seed)
    inp, w = _inputs(case)
    x_in, w_in = _local(inp, case.in_layout, n, r), _local(w, case.out_layout, n, r)
    before = snapshot(model)
    # the shard-time probe (verify) on every third case: it must accept every valid plan, which a
    # third of the cases shows; the comparison below is the property itself (the probe doubled its cost)
    apply_fn, params, info = hpf.shard(model, _plan(case), m, verify=case.seed % 3 == 0)
    out = apply_fn(params, x_in)
    if case.use_grad:
        grads = torch.func.grad(lambda p: (apply_fn(p, x_in) * w_in).sum())(params)
    else:
        (out * w_in).sum().backward()
        grads = {k: torch.zeros_like(p) if p.grad is None else p.grad for k, p in params.items()}
    full = hpf.unshard(grads, info)
    after = snapshot(model)

    refs = [_reference(model, inp, w, dtype) for dtype in (torch.float32, torch.float64)]
    problems, worst = [], 0.0
    for what, expected in refs[0].items():
        actual = out.detach() if what == "output" else full.get(what[5:])
        expected, exact = (_local(t, case.out_layout, n, r) if what == "output" else t for t in (expected, refs[1][what]))
        if actual is None or actual.shape != expected.shape:
            problems.append(f"{what}: got {None if actual is None else tuple(actual.shape)}, want {tuple(expected.shape)}")
            continue
        diff = (actual - expected).abs().max().item() if actual.numel() else 0.0
        worst = max(worst, diff)
        # 1e-5, widened by the reference's own fp32 rounding error where the model is ill-conditioned
        slack = 8 * (expected.double() - exact).abs().max().item() if expected.numel() else 0.0
        if not torch.allclose(actual, expected, atol=1e-5 + slack, rtol=1e-5):
            problems.append(f"{what}: max abs diff {diff:.3g} (max abs expected {expected.abs().max().item():.3g}, "
                            f"fp32 reference error {slack / 8:.3g})")
    if set(full) != {k for k, _ in model.named_parameters()}:
        problems.append(f"params keys {sorted(full)}")
    assert_unchanged(before, after)
    assert not problems, "\n".join(problems)
    return worst


def run_invalid(case: Case, exc_type: str, needles: tuple[str, ...]) -> str:
    """shard() raises ``exc_type`` naming every needle, before any collective; the model is untouched."""
    m = mesh(case.mesh_shape, case.mesh_names)
    model = build(case.net, case.seed)
    before = snapshot(model)
    try:
        hpf.shard(model, _plan(case), m)
    except Exception as exc:  # noqa: BLE001 - the type is checked below
        raised, message = exc, str(exc)
    else:
        raised, message = None, "<nothing raised>"
    assert_unchanged(before, snapshot(model))
    assert isinstance(raised, getattr(hpf, exc_type)), f"expected {exc_type}, got {type(raised).__name__}: {message}"
    missing = [s for s in needles if s not in message]
    assert not missing, f"message does not name {missing}: {message}"
    return message
