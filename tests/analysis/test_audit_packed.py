"""The shape audit on packed projections: a fused projection's sharded output is cut, viewed or
sliced in the forward, and the audit must accept exactly the plans whose pieces line up.

A ``Colwise(packed=P)`` rank holds its slice of every one of the P blocks; a plain ``Colwise``
rank a contiguous range of all the rows.  So timm's ``qkv(x).reshape(B, N, 3, H, D)`` is right
with ``packed=3`` and ``H`` divided, and wrong with a plain ``Colwise`` (the shapes are the same);
GPT-2's ``split(split_size)`` and a ``chunk(2)`` of a fused gate/up likewise; BLOOM's interleaved
``(B, N, H, 3, D)`` is the other way round.  Each case runs ``hpf.lint`` on a simulated mesh (one
process, no numbers: ``tests/models/test_handwritten.py`` runs the numbers)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hp_functional as hpf
from hp_functional.analysis.audit import compare, handoff, record
from hp_functional.analysis.packing import Packed

DIM, HEADS = 32, 4


class Fused(nn.Module):
    """Attention over a fused ``qkv`` Linear, cut into q, k, v the way ``layout`` says:
    ``timm`` (``reshape(B, N, 3, H, D)``, then ``attn_dim``), ``interleaved`` (BLOOM:
    ``(B, N, H, 3, D)``), ``split`` (GPT-2: ``split(split_size, -1)``), ``chunk`` (``chunk(3, -1)``)."""

    def __init__(self, layout: str):
        super().__init__()
        self.layout, self.num_heads, self.head_dim = layout, HEADS, DIM // HEADS
        self.attn_dim = self.split_size = DIM
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, x):
        B, N, _ = x.shape
        qkv = self.qkv(x)
        if self.layout == "timm":
            q, k, v = qkv.reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        elif self.layout == "interleaved":
            q, k, v = qkv.view(B, N, self.num_heads, 3, self.head_dim).transpose(1, 2).unbind(3)
        else:
            parts = qkv.split(self.split_size, -1) if self.layout == "split" else qkv.chunk(3, -1)
            q, k, v = (t.view(B, N, -1, self.head_dim).transpose(1, 2) for t in parts)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, self.attn_dim)
        return self.proj(out)


class GateUp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, -1)
        return self.down(F.silu(gate) * up)


class Net(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return x + self.block(x)


def _plan(qkv, heads=None) -> dict:
    return {"block.qkv": qkv, "block.proj": hpf.Rowwise(), **({"block": hpf.Heads(attrs=heads)} if heads else {})}


def _errors(model: nn.Module, plan: dict, n: int) -> list[str]:
    def run(mesh):
        return [str(f) for f in hpf.lint(model, plan, mesh) if f.level == "error"]
    return hpf.simulate(run, world_size=n)


def _input():
    return (torch.empty(1, 4, DIM, device="meta"),), {}


BOTH = ("num_heads", "attn_dim")

# (layout, qkv style, divided attributes, what an error must say; None: accepted)
CASES = [
    ("timm", hpf.Colwise(packed=3), BOTH, None),
    ("timm", hpf.Colwise(), BOTH, "plan it Colwise(packed=3)"),  # same local shapes, wrong rows
    ("timm", hpf.Colwise(packed=3), ("head_dim", "attn_dim"), "each head's 8 features would be cut to"),
    ("timm", hpf.Colwise(packed=3), ("num_heads",), "attn_dim"),  # its last reshape keeps attn_dim global
    ("interleaved", hpf.Colwise(), BOTH, None),  # each head's q, k, v side by side: contiguous rows are whole heads
    ("interleaved", hpf.Colwise(packed=3), BOTH, "packed blocks"),
    ("split", hpf.Colwise(packed=3), ("split_size", "attn_dim"), None),
    ("split", hpf.Colwise(), ("split_size", "attn_dim"), "plan 'qkv' as Colwise(packed=3)"),
    ("chunk", hpf.Colwise(packed=3), ("attn_dim",), None),
    ("chunk", hpf.Colwise(), ("attn_dim",), "plan 'qkv' as Colwise(packed=3)"),
]


@pytest.mark.parametrize("layout, style, heads, needle", CASES,
                         ids=[f"{c[0]}-{'packed' if c[1].packed else 'plain'}-{'+'.join(c[2])}" for c in CASES])
def test_packed_views_and_splits(layout, style, heads, needle):
    model = Net(Fused(layout))
    for n in (2, 4):
        errors = _errors(model, _plan(style, heads), n)
        assert all(e == errors[0] for e in errors) if errors else True
        if needle is None:
            assert errors == [], (n, errors)
        else:
            assert errors and needle in errors[0] and "block" in errors[0], (n, errors)


def test_fused_gate_up_chunk():
    model = Net(GateUp())
    ok = {"block.gate_up": hpf.Colwise(packed=2), "block.down": hpf.Rowwise()}
    assert _errors(model, ok, 2) == []
    wrong = _errors(model, {**ok, "block.gate_up": hpf.Colwise()}, 2)
    assert wrong and "plan 'gate_up' as Colwise(packed=2)" in wrong[0], wrong


def test_record_tags_the_packing_and_compare_judges_the_view():
    """``record`` tags a sharded projection's output with its blocks (``Packed``) and follows it to
    the view; ``compare`` accepts the timm view of ``Colwise(packed=3)`` and refuses the same
    local shapes from a plain ``Colwise``, naming the packing."""
    block, call, outputs = Fused("timm"), _input(), {}
    glob, ok = record(block, *call, opaque={"qkv": None, "proj": None}, outputs=outputs)
    assert ok
    shapes = {"qkv.weight": torch.Size([3 * DIM // 2, DIM]), "qkv.bias": torch.Size([3 * DIM // 2]),
              "proj.weight": torch.Size([DIM, DIM // 2])}
    proj = handoff(hpf.Rowwise().spec(block.proj, "proj", "tp"), "tp", 2)
    for blocks in (3, None):
        qkv = handoff(hpf.Colwise(packed=blocks).spec(block.qkv, "qkv", "tp"), "tp", 2)
        local, _ = record(block, *call, shapes=shapes, attrs={"num_heads": HEADS // 2, "attn_dim": DIM // 2},
                          opaque={"qkv": qkv, "proj": proj}, outputs={k: list(v) for k, v in outputs.items()})
        view = next(op for op in local if op.name == "reshape")
        assert view.packed == Packed("qkv", 2, (DIM // 2,) * 3 if blocks else (3 * DIM // 2,))
        found = compare(glob, local, 2)
        if blocks:
            assert found is None, found
        else:
            assert found is not None and found.glob.name == "reshape" and "Colwise(packed=3)" in found.why, found
