"""A per-head q/k norm left unplanned on a model whose batch cannot be synthesized: exact or
refused.

The model starts with a linear patch embedding and its forward takes a second argument (a scale),
so no batch can be synthesized for the dataflow pass or the shard-time probe.  Its attention
normalises q and k per head (``LayerNorm(head_dim)``, as Flux, SD3 and timm's ``qk_norm`` do)
between the colwise q/k projections and sdpa: on each rank
that norm sees the rank's share of the heads, so its gradient is a per-rank share unless something
reduces it.  ``shard()`` without ``example_inputs`` refuses such a plan by name; with them the
dataflow pass traces the batch and reduces the norm's gradient (loss and every gradient equal the
unsharded model's); a norm planned ``NoParallel(reduce_grads=True)``, an attention without the
norms and a pre-norm of the layer's replicated width beside a planned MLP are accepted as before.
The same model with a one-argument forward gets a synthesized batch (features at the patch
embedding's width): traced, exact, no ``example_inputs`` needed.  Every rank a thread
(``hpf.emulate``), tp 2.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hp_functional as hpf
from tests.support.helpers import assert_close


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, qk_norm: bool):
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(self.head_dim) if qk_norm else nn.Identity()

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q_norm(self.q(x).view(b, n, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k(x).view(b, n, -1, self.head_dim)).transpose(1, 2)
        v = self.v(x).view(b, n, -1, self.head_dim).transpose(1, 2)
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, -1))


class Block(nn.Module):
    """Whisper's layout: the layer norms and the MLP's projections are children of the layer."""

    def __init__(self, dim: int, heads: int, qk_norm: bool):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, qk_norm)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class PatchNet(nn.Module):
    """A linear patch embedding first (no ``nn.Embedding``), one block, a pooled head."""

    def __init__(self, qk_norm: bool = True, dim: int = 32, heads: int = 4):
        super().__init__()
        self.patch = nn.Linear(12, dim)
        self.block = Block(dim, heads, qk_norm)
        self.head = nn.Linear(dim, 3)

    def forward(self, x, scale):
        return self.head(self.block(self.patch(x))).mean(1) * scale


class OneArgument(PatchNet):
    """``PatchNet`` whose forward takes the features alone: a batch can be synthesized for it."""

    def forward(self, x):
        return super().forward(x, 1.0)


PLAN = {"block.attn.q": hpf.Colwise(), "block.attn.k": hpf.Colwise(), "block.attn.v": hpf.Colwise(),
        "block.attn.o": hpf.Rowwise(), "block.fc1": hpf.Colwise(), "block.fc2": hpf.Rowwise()}
NORMS = ("block.attn.q_norm", "block.attn.k_norm")


def _reference(model, *x):
    model.zero_grad()
    loss = model(*x).square().sum()
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def _sharded(model, plan, x: tuple, mesh, **kw):
    """(loss, full gradients, checks) of the sharded model, or the PlanError it raised (on every rank)."""
    try:
        apply_fn, params, info = hpf.shard(model, plan, mesh, probe_cache=None, **kw)
    except hpf.PlanError as exc:
        return exc
    grads, loss = torch.func.grad_and_value(lambda p: apply_fn(p, *x).square().sum())(params)
    return loss.detach(), hpf.unshard(grads, info), dict(apply_fn.runtime.checks)


def _exact(result, ref, what: str) -> dict:
    assert not isinstance(result, Exception), f"{what}: refused: {result}"
    loss, grads, checks = result
    assert_close(loss, ref[0], f"{what} loss")
    for k, g in ref[1].items():
        assert_close(grads[k], g, f"{what} grad {k}", atol=1e-6, rtol=1e-4)
    return checks


def test_unplanned_per_head_norm_is_refused_or_traced_with_example_inputs():
    torch.manual_seed(0)
    model, x = PatchNet(), torch.randn(2, 5, 12)
    one = OneArgument()
    one.load_state_dict(model.state_dict())
    ref = _reference(model, x, 1.0)

    def run(mesh):
        return (_sharded(model, PLAN, (x, 1.0), mesh),
                _sharded(model, PLAN, (x, 1.0), mesh, example_inputs={"x": x, "scale": 1.0}),
                _sharded(model, PLAN, (x, 1.0), mesh, example_inputs=(x, 1.0), verify=False),
                _sharded(one, PLAN, (x,), mesh))

    for refused, given, unverified, synthesized in hpf.emulate(run, (2,), ("tp",)):
        assert isinstance(refused, hpf.PlanError), refused
        message = str(refused)
        assert "block.attn.q_norm is not planned" in message and "'block.attn'" in message, message
        for fix in ("NoParallel(reduce_grads=True)", "NoParallel()", "shard(..., example_inputs=...)"):
            assert fix in message, message
        assert "block.ln1" not in message and "block.ln2" not in message, message  # the layer's replicated width
        checks = _exact(given, ref, "example_inputs")
        assert checks == {"dataflow": "traced on meta tensors (example_inputs)", "probe": "exact on the probe copy",
                          "proof": "the probe and the dataflow pass"}, checks
        assert _exact(unverified, ref, "example_inputs, verify=False")["dataflow"].startswith("traced on meta")
        checks = _exact(synthesized, ref, "a synthesized batch")
        assert checks["dataflow"] == "traced on meta tensors" and checks["proof"] == "the probe and the dataflow pass"


@pytest.mark.slow  # three more shard() calls and an emulation: about 1 s
def test_planned_norms_and_regions_without_them_are_accepted():
    torch.manual_seed(0)
    model, plain, x = PatchNet(), PatchNet(qk_norm=False), torch.randn(2, 5, 12)
    ref, plain_ref = _reference(model, x, 1.0), _reference(plain, x, 1.0)
    allowed = {"allow_unproved": True}  # nothing runs the forward: the plan as stated, knowingly

    def run(mesh):
        return (_sharded(model, {**PLAN, **dict.fromkeys(NORMS, hpf.NoParallel(reduce_grads=True))}, (x, 1.0), mesh,
                         **allowed),
                _sharded(model, {**PLAN, **dict.fromkeys(NORMS, hpf.NoParallel())}, (x, 1.0), mesh, **allowed),
                _sharded(plain, PLAN, (x, 1.0), mesh, **allowed))

    for reduced, claimed, without in hpf.emulate(run, (2,), ("tp",)):
        checks = _exact(reduced, ref, "norms NoParallel(reduce_grads=True)")
        assert "one forward on meta tensors failed" in checks["dataflow"], checks
        assert checks["proof"].startswith("unproved (allow_unproved=True)"), checks
        _exact(without, plain_ref, "no per-head norms")
        # NoParallel() states that the norm sees replicated data: accepted as stated, and then its
        # gradient is a per-rank share — what the refusal above prevents when nothing is stated
        assert not isinstance(claimed, Exception), claimed
        wrong = (claimed[1]["block.attn.q_norm.weight"] - ref[1]["block.attn.q_norm.weight"]).abs().max()
        assert wrong > 1e-3 * ref[1]["block.attn.q_norm.weight"].abs().max(), wrong


class RootScale(nn.Module):
    """A per-head-dim scale owned by the root and used on the attention's head-sharded queries (as
    MLCD's root-level ``class_pos_emb`` joins the rotary table its attention rotates them with)."""

    def __init__(self):
        super().__init__()
        self.patch, self.attn, self.head = nn.Linear(12, 32), Attention(32, 4, False), nn.Linear(32, 3)
        self.scale = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x, scale):
        h = self.patch(x) * scale
        b, n, _ = h.shape
        attn = self.attn
        q = (attn.q(h).view(b, n, -1, 8) * self.scale).transpose(1, 2)
        k, v = (m(h).view(b, n, -1, 8).transpose(1, 2) for m in (attn.k, attn.v))
        out = attn.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, -1))
        return self.head(h + out).mean(1)


def test_a_root_parameter_reaching_a_region_is_refused_or_traced():
    torch.manual_seed(0)
    model, x = RootScale(), torch.randn(2, 5, 12)
    ref = _reference(model, x, 1.0)
    plan = {k.removeprefix("block."): v for k, v in PLAN.items() if ".attn." in k}

    def run(mesh):
        return _sharded(model, plan, (x, 1.0), mesh), _sharded(model, plan, (x, 1.0), mesh, example_inputs=(x, 1.0))

    for refused, given in hpf.emulate(run, (2,), ("tp",)):
        assert isinstance(refused, hpf.PlanError) and "<root module> is not planned, is or encloses" in str(refused)
        assert "(scale)" in str(refused), refused
        _exact(given, ref, "example_inputs")


def test_the_probe_shrinks_the_token_table_the_model_names():
    """Qwen3-VL's first embedding is its vision tower's position table: the probe's copy shrinks
    the table ``get_input_embeddings()`` names, and the positions keep their rows."""
    from hp_functional.runtime.probe_copy import shrink_vocab

    class VL(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = nn.Embedding(300, 8)
            self.tokens, self.head = nn.Embedding(200, 8), nn.Linear(8, 200)

        def get_input_embeddings(self):
            return self.tokens

    twin = VL()
    shrink_vocab(twin, 128)
    assert (twin.pos.num_embeddings, twin.tokens.num_embeddings, twin.head.out_features) == (300, 128, 128)


class OffsetIds(nn.Module):
    """CPM-Ant's ids: offset by the vocabulary size the model was built with, so a copy whose table
    the probe shrinks to 128 rows cannot take a batch whose ids are all below 128."""

    def __init__(self, vocab: int = 300):
        super().__init__()
        self.offset = vocab - 64
        self.tokens, self.up, self.down = nn.Embedding(vocab, 16), nn.Linear(16, 32), nn.Linear(32, 16)

    def get_input_embeddings(self):
        return self.tokens

    def forward(self, ids):
        h = self.tokens(ids + self.offset)
        return h + self.down(F.gelu(self.up(h)))


def test_the_probe_keeps_the_vocabulary_where_the_shrunk_copy_does_not_take_the_batch():
    torch.manual_seed(0)
    model, ids = OffsetIds(), torch.randint(0, 64, (2, 5))
    ref = _reference(model, ids)
    plan = {"up": hpf.Colwise(), "down": hpf.Rowwise()}
    for result in hpf.emulate(lambda mesh: _sharded(model, plan, (ids,), mesh, example_inputs=(ids,)), (2,), ("tp",)):
        checks = _exact(result, ref, "offset ids")
        assert checks["probe"] == "exact on the probe copy", checks  # not skipped for an index out of range
