"""``hpf.auto_plan``: plans for models without a tp_plan, checked against the unsharded model.

A custom decoder written here (its own names, head counts as attributes fed to ``view``, a
per-head parameter, biases), HF GPT-2 (``Conv1D``, fused ``c_attn``) and HF Llama, with and
without sequence parallelism: loss and every gradient within 1e-5 of the single-process model at
world sizes 2 and 4.  On every HF family of the suite, ``auto_plan`` shards every parameter as
``ShardingPlan.from_hf`` does.  Overrides, the coverage report and the errors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import hp_functional as hpf
from hp_functional.tools.models import TINY
from tests.conftest import get_pool
from tests.support.helpers import assert_close, build_hf, mesh
from tests.support.models import MLP
from tests.support.titan_llama import RMSNorm


# ---------------------------------------------------------------- a decoder of our own
class Attention(nn.Module):
    """Grouped-query attention reshaping with ``self.n_heads``/``self.n_kv_heads``, with a
    learned per-head gain."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.n_rep = n_heads // n_kv_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.head_gain = nn.Parameter(torch.linspace(0.5, 1.5, n_heads))

    def forward(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = q * self.head_gain.view(1, -1, 1, 1)
        k, v = k.repeat_interleave(self.n_rep, dim=1), v.repeat_interleave(self.n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(dim, hidden), nn.Linear(hidden, dim), nn.Linear(dim, hidden)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, hidden):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(dim), Attention(dim, n_heads, n_kv_heads)
        self.ffn_norm, self.feed_forward = RMSNorm(dim), FeedForward(dim, hidden)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(nn.Module):
    def __init__(self, vocab=128, dim=32, n_layers=2, n_heads=8, n_kv_heads=4, hidden=64):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, n_kv_heads, hidden) for _ in range(n_layers))
        self.norm, self.output = RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def gpt2_config():
    from transformers import GPT2Config

    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "eager"
    return config


def build(kind: str, state=None, **cfg) -> nn.Module:
    torch.manual_seed(0)
    if kind == "custom":
        model = Decoder(**cfg)
    elif kind == "gpt2":
        from transformers import GPT2LMHeadModel

        model = GPT2LMHeadModel(gpt2_config())
    else:
        model = build_hf(kind, **cfg)
    if state is not None:
        model.load_state_dict(state)
    return model


def make_state(kind: str, **cfg):
    model = build(kind, **cfg)
    with torch.no_grad():  # non-trivial norm weights, so their gradients are checked for real
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name:
                p.uniform_(0.5, 1.5)
    return model.state_dict()


def loss_of(kind, out, ids):
    if kind == "custom":
        return F.cross_entropy(out[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    return out.loss


def call(kind, fn, ids):
    return fn(ids) if kind == "custom" else fn(input_ids=ids, labels=ids)


# ---------------------------------------------------------------- numerics
def case_matches_unsharded(kind: str, state, sequence_parallel: bool, loss_parallel: bool = False):
    m = mesh()
    model = build(kind, state)
    plan = hpf.auto_plan(model, m, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    apply_fn, params, info = hpf.shard(model, plan, m)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(7))

    ref = call(kind, model, ids)
    ref_loss = loss_of(kind, ref, ids)
    ref_loss.backward()
    out = call(kind, lambda *a, **k: apply_fn(params, *a, **k), ids)
    loss = loss_of(kind, out, ids)
    diffs = {"loss": assert_close(loss, ref_loss.detach(), "loss")}
    logits, ref_logits = (out, ref) if kind == "custom" else (out.logits, ref.logits.detach())
    if loss_parallel:  # the logits stay vocab-sharded: this rank's slice
        ref_logits = ref_logits.chunk(m.size(), -1)[m.get_local_rank()]
    diffs["logits"] = assert_close(logits, ref_logits.detach(), "logits")
    loss.backward()
    full = hpf.unshard({k: p.grad for k, p in params.items()}, info)
    grads = dict(model.named_parameters())
    assert set(full) == set(grads), "every parameter has a gradient"
    diffs["grads"] = max(assert_close(full[k], grads[k].grad, f"grad {k}") for k in grads)
    return diffs, {k: str(i.placements) for k, i in info.items()}, plan.explain()


@pytest.mark.parametrize("kind,sequence_parallel,loss_parallel", [
    ("custom", False, False), ("custom", True, False), ("gpt2", False, False), ("gpt2", True, False), ("gpt2", False, True),
    ("llama", False, False), ("llama", True, False), ("llama", True, True)])
@pytest.mark.slow
def test_auto_plan_matches_unsharded(pool, kind, sequence_parallel, loss_parallel):
    diffs, placements, text = pool.run(case_matches_unsharded, kind, make_state(kind), sequence_parallel,
                                       loss_parallel)[0]
    print(f"{kind} sp={sequence_parallel} lp={loss_parallel} world {pool.world}: max |diff| {diffs}")
    if kind == "custom":
        assert placements["layers.0.attention.wq.weight"] == "(Shard(dim=0),)"
        assert placements["layers.0.attention.head_gain"] == "(Shard(dim=0),)"  # per-head
        assert placements["layers.0.feed_forward.w2.bias"] == "(Replicate(),)"  # added once
        assert "Heads(attrs=('n_heads', 'n_kv_heads')" in text or "divide_attrs=('n_heads', 'n_kv_heads')" in text
    if kind == "gpt2":
        assert placements["transformer.h.0.attn.c_attn.weight"] == "(Shard(dim=1),)"  # Conv1D: [in, out]
        assert placements["transformer.h.0.attn.c_proj.weight"] == "(Shard(dim=0),)"
        assert "packed 3" in text and "split_size" in text


def case_flex_attention(state):
    """Flex attention refuses meta tensors; auto_plan traces it on fake CPU tensors instead and
    plans it as the same model on SDPA.  Forward only: flex attention has no backward on the CPU
    (the plan's gradients are the SDPA model's, checked above).  Run eagerly (HF compiles flex
    attention; the C++ build would dominate the suite)."""
    m = mesh()
    with torch.compiler.set_stance("force_eager"), torch.no_grad():
        sdpa, model = build("llama", state), build("llama", state)
        model.config._attn_implementation = "flex_attention"  # every attention module reads it per call
        plan = hpf.auto_plan(model, m)
        assert plan.entries == hpf.auto_plan(sdpa, m).entries
        assert plan.entries["model.layers.*.mlp.down_proj"].input_layout == Shard(-1)  # heads localised, not gathered
        apply_fn, params, _ = hpf.shard(model, plan, m)  # under no_grad: the probe takes its gradients anyway
        checks = apply_fn.runtime.checks
        assert checks["probe"].startswith("the loss agrees; gradients not compared"), checks
        ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(7))
        ref, out = model(input_ids=ids, labels=ids), apply_fn(params, input_ids=ids, labels=ids)
    return {"loss": assert_close(out.loss, ref.loss, "loss"), "logits": assert_close(out.logits, ref.logits, "logits")}


@pytest.mark.slow
def test_auto_plan_traces_flex_attention_on_fake_tensors():
    """At world size 2 (the trace on fake tensors does not depend on it; the SDPA model's plans are
    checked at 2 and 4 above)."""
    from tests.conftest import get_pool

    print(f"flex attention: max |diff| {get_pool(2).run(case_flex_attention, make_state('llama'))[0]}")


# ---------------------------------------------------------------- agreement with from_hf
def agrees_with_from_hf(family: str, cfg, world: int) -> list[str]:
    """The parameters whose packed blocks or offsets differ, after asserting equal placements,
    global and local shapes (``shard`` on a simulated mesh: placements need no numbers)."""
    model = build_hf(family, **cfg)

    def infos(m):
        return (hpf.shard(model, hpf.auto_plan(model, m), m)[2], hpf.shard(model, hpf.ShardingPlan.from_hf(model), m)[2])

    ours, theirs = hpf.simulate(infos, world_size=world)
    assert set(ours) == set(theirs)
    packed_only_here = []
    for k, a in ours.items():
        b = theirs[k]
        assert (a.placements, a.global_shape, a.local_shape) == (b.placements, b.global_shape, b.local_shape), \
            f"{family} {k}: auto {a.placements} {a.local_shape} vs from_hf {b.placements} {b.local_shape}"
        if a.blocks != b.blocks or a.offset != b.offset:
            packed_only_here.append(k)
    return packed_only_here


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("family,cfg", [(f, {}) for f in TINY] + [("gemma", {"tie_word_embeddings": True})])
def test_auto_plan_agrees_with_from_hf(world, family, cfg):
    """Same placements, global and local shapes for every parameter.  The one difference:
    Phi-3's fused ``gate_up_proj``, which HF gathers (``colwise_gather_output``) and auto_plan
    packs (each rank holds matching gate and up slices, no gather), so its blocks differ."""
    expected = [f"model.layers.{i}.mlp.gate_up_proj.weight" for i in range(2)] if family == "phi3" else []
    assert agrees_with_from_hf(family, cfg, world) == expected


# ---------------------------------------------------------------- plans without numbers (one process)
def look(model, **kw):
    return lambda m: hpf.auto_plan(model, m, **kw)


def test_overrides_set_clear_and_unmatched():
    model = build("custom")
    plan = hpf.simulate(look(model, overrides={
        "layers.*.feed_forward.w2": hpf.Rowwise(output_layout=Replicate()),  # set: wins (here: as generated)
        "layers.1.feed_forward.w1": None, "layers.1.feed_forward.w3": None, "layers.1.feed_forward.w2": None,  # cleared
        "output": "colwise_rep",  # an HF string
    }), world_size=2)
    assert plan.entries["layers.0.feed_forward.w1"] == hpf.Colwise()  # unset: inherits
    assert "layers.1.feed_forward.w1" not in plan.entries and "layers.*.feed_forward.w1" not in plan.entries
    assert plan.coverage.replicated["layers.1.feed_forward.w1.weight"] == "cleared by override"
    assert plan.entries["output"] == hpf.Colwise(gather_output=True)
    with pytest.raises(hpf.PlanError, match=r"override 'layers\.\*\.feed_fwd\.w2' matches no module.*feed_forward"):
        hpf.simulate(look(model, overrides={"layers.*.feed_fwd.w2": None}), world_size=2)


def test_coverage_lists_every_parameter():
    model = build("gpt2")
    plan = hpf.simulate(look(model), world_size=4)
    cov = plan.coverage
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert sorted([*cov.planned, *cov.replicated]) == sorted(names)
    assert not set(cov.planned) & set(cov.replicated)
    assert plan.entries["transformer.wpe"] == hpf.VocabEmbedding() and "transformer.wpe.weight" in cov.planned
    assert cov.replicated["transformer.h.0.attn.c_proj.bias"].startswith("rowwise bias")
    assert cov.replicated["transformer.ln_f.weight"].startswith("norm")
    assert cov.planned["transformer.h.0.attn.c_attn.weight"].endswith("packed 3")
    text = plan.explain()
    assert "transformer.h.*.attn: Heads(attrs=('split_size',)" in text and "replicated" in text


def test_structure_decides_unknown_names():
    """A toy MLP (no embedding: example inputs given) with names auto_plan does not know."""
    model = MLP()  # norm, up, down: "up"/"down" are not in the name table
    plan = hpf.simulate(look(model, example_inputs=torch.randn(2, 4, 16)), world_size=2)
    assert plan.entries == {"up": hpf.Colwise(), "down": hpf.Rowwise()}
    with pytest.raises(hpf.PlanError, match="does not start with an nn.Embedding; pass example_inputs"):
        hpf.simulate(look(model), world_size=2)


def case_bad_heads(kind: str, cfg):
    try:
        plan = hpf.auto_plan(build(kind, **cfg), mesh())
    except hpf.PlanError as exc:
        return "PlanError: " + str(exc)
    return " | ".join(plan.notes) + f" | up: {type(plan.entries.get('layers.*.feed_forward.w1')).__name__}" \
        f" {type(plan.entries.get('model.layers.*.mlp.up_proj')).__name__}"


@pytest.mark.parametrize("pool", [4], indirect=True)
def test_heads_that_do_not_divide_leave_attention_whole_on_every_rank(pool):
    """6 query heads over 4 ranks: the attention is computed whole (its weights stored split, rule 8)
    and noted, alike on every rank, while the MLP shards (auto_plan communicates nothing)."""
    custom = pool.run(case_bad_heads, "custom", {"dim": 48, "n_heads": 6, "n_kv_heads": 2})
    assert all("layers.0.attention.wq: 6 heads do not split over 4 ranks" in m and "computed whole" in m
               and "up: Colwise" in m for m in custom), custom
    llama = pool.run(case_bad_heads, "llama", {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 2})
    assert all("model.layers.0.self_attn.q_proj: 6 heads do not split over 4 ranks" in m and "computed whole" in m
               and m.endswith("Colwise") for m in llama), llama


class Experts(nn.Module):
    """Top-1 routing: each token goes to the expert its router scores highest."""

    def __init__(self, d=16, n=4):
        super().__init__()
        self.router = nn.Linear(d, n)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        choice = self.router(flat).argmax(-1)
        out = torch.zeros_like(flat)
        for i, expert in enumerate(self.experts):
            rows = (choice == i).nonzero().squeeze(-1)
            out = out.index_add(0, rows, expert(flat[rows]))
        return out.reshape(x.shape)


class SoftMixture(Experts):
    """Every expert sees every token, weighted: a dense model, whatever its module names say."""

    def forward(self, x):
        w = self.router(x).softmax(-1)
        return sum(w[..., i:i + 1] * e(x) for i, e in enumerate(self.experts))


class WithMoE(nn.Module):
    def __init__(self, moe=Experts):
        super().__init__()
        self.embed, self.moe, self.head = nn.Embedding(32, 16), moe(), nn.Linear(16, 32)

    def forward(self, ids):
        return self.head(self.moe(self.embed(ids)))


class WithUnknown(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.mix, self.head = nn.Embedding(32, 16), nn.Conv1d(16, 16, 1), nn.Linear(16, 32)
        self.gain = nn.Parameter(torch.ones(16, 16))

    def forward(self, ids):
        return self.head(self.mix(self.embed(ids).transpose(1, 2)).transpose(1, 2) @ self.gain)


def test_moe_is_found_by_routing_not_by_name():
    """A top-1 router dispatching tokens to a ModuleList of experts is a mixture of experts (refused:
    the block loops over the list itself, so there is no experts call to dispatch); the
    same modules mixed softly (every expert on every token) are a dense model: lone projections."""
    with pytest.raises(hpf.PlanError, match="moe .*mixture of experts.*top-k.*cannot shard.*neither stacked.*hpf.Experts"):
        hpf.simulate(look(WithMoE()), world_size=2)
    plan = hpf.simulate(look(WithMoE(), allow_uncovered=True), world_size=2)
    assert plan.coverage.replicated["moe.router.weight"].startswith("MoE")
    assert plan.entries["head"] == hpf.Colwise(gather_output=True) and plan.entries["embed"] == hpf.VocabEmbedding()
    soft = hpf.simulate(look(WithMoE(SoftMixture)), world_size=2)
    roles = {r.param: r.role for r in soft.coverage.rows}
    assert roles["moe.router.weight"].startswith("lone projection (colwise, output gathered")
    assert roles["moe.experts.0.weight"].startswith("lone projection (colwise, output gathered")


def test_lone_convolutions_split_and_other_parameters_are_replicated_and_reported():
    plan = hpf.simulate(look(WithUnknown(), example_inputs=torch.zeros(1, 8, dtype=torch.long)), world_size=2)
    assert plan.entries["mix"] == hpf.Colwise(gather_output=True)  # 17 % of the parameters, pairs with nothing
    assert plan.coverage.replicated["gain"].startswith("other parameter (replicated")


def test_sequence_parallel_plan_is_llama_sp_plan():
    """On HF Llama, auto_plan(sequence_parallel=True) is hpf.llama_sp_plan() entry for entry."""
    model = build_hf("llama")
    plan = hpf.simulate(look(model, sequence_parallel=True), world_size=2)
    assert plan.entries == hpf.llama_sp_plan().entries
    assert plan.entries["model.layers.*.self_attn.o_proj"] == hpf.Rowwise(output_layout=Shard(1))


def test_tracing_reads_and_never_mutates():
    model = build("custom")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    attrs = {n: dict(vars(m)) for n, m in model.named_modules()}
    hpf.simulate(look(model, sequence_parallel=True), world_size=2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(type(v) is int for m in model.modules() for v in vars(m).values() if isinstance(v, int)
               and not isinstance(v, bool))
    assert {n: dict(vars(m)) for n, m in model.named_modules()}.keys() == attrs.keys()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


# ---------------------------------------------------------------- forwards that read values
class RaggedLayer(nn.Module):
    def __init__(self, dim: int, hidden: int, act: nn.Module):
        super().__init__()
        self.fc_in, self.act, self.fc_out = nn.Linear(dim, hidden), act, nn.Linear(hidden, dim)

    def forward(self, h):
        return h + self.fc_out(self.act(self.fc_in(h)))


class Ragged(nn.Module):
    """Control flow on token values (``.item()``: XLM's ``lengths.max().item()``), and one
    activation instance registered in every layer (XLM's shared ``act``)."""

    def __init__(self, vocab=64, dim=16, hidden=32):
        super().__init__()
        act = nn.GELU()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(RaggedLayer(dim, hidden, act) for _ in range(2))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        n = int((ids != 0).sum(-1).max().item())  # the longest row, read from the values
        h = self.embed(ids[:, :n])
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def case_value_reading_forward():
    torch.manual_seed(0)
    model, m = Ragged(), mesh()
    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    ids[:, 6:] = 0
    plan = hpf.auto_plan(model, m, example_inputs=ids)
    apply_fn, params, info = hpf.shard(model, plan, m, example_inputs=ids)
    ref = F.cross_entropy(model(ids).flatten(0, 1), ids[:, :6].flatten())
    ref.backward()
    loss = F.cross_entropy(apply_fn(params, ids).flatten(0, 1), ids[:, :6].flatten())
    loss.backward()
    full = hpf.unshard({k: p.grad for k, p in params.items()}, info)
    diffs = {"loss": assert_close(loss, ref.detach(), "loss")}
    diffs["grads"] = max(assert_close(full[k], p.grad, f"grad {k}") for k, p in model.named_parameters())
    return diffs, {k: v for k, v in plan.entries.items()}


def test_a_forward_that_reads_values_is_traced_with_values(pool):
    """Meta and fake tensors have no values to read: auto_plan traces a CPU copy with them, and
    the shared activation does not join the layers' flows (each layer pairs its own fc_in/fc_out)."""
    diffs, entries = pool.run(case_value_reading_forward)[0]
    assert entries["layers.*.fc_in"] == hpf.Colwise() and entries["layers.*.fc_out"] == hpf.Rowwise(), entries


def test_a_value_reading_forward_over_the_copy_budget_is_refused(monkeypatch):
    from hp_functional.analysis import trace

    monkeypatch.setattr(trace, "REAL_TRACE_BYTES", 1024)
    with pytest.raises(hpf.PlanError, match=r"Ragged on meta tensors failed .*pass example_inputs"):
        hpf.simulate(look(Ragged(), example_inputs=torch.ones(1, 8, dtype=torch.long)), world_size=2)


def test_a_vocabulary_that_does_not_split_is_replicated_with_a_note():
    hf = hpf.simulate(look(build_hf("llama", vocab_size=129)), world_size=2)
    assert "model.embed_tokens" not in hf.entries and hf.entries["lm_head"] == hpf.NoParallel()
    assert any("model.embed_tokens: a vocabulary of 129 does not split" in n and "pad" in n for n in hf.notes)
    plan = hpf.simulate(look(build("custom", vocab=129)), world_size=2)
    assert "tok_embeddings" not in plan.entries and plan.entries["output"] == hpf.NoParallel()
    assert plan.entries["layers.*.feed_forward.w1"] == hpf.Colwise()  # the blocks are sharded as ever
    assert "embedding (replicated: 129 rows do not split over 2 ranks" in plan.coverage.replicated["tok_embeddings.weight"]
    assert any("lm_head: 129 output features do not split over 2 ranks" in n for n in hf.notes)


# ---------------------------------------------------------------- modules run more than once
class ScaledGELU(nn.Module):
    """An activation with a buffer: a node of its own in the trace (not a transparent leaf)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.tensor(1.0))

    def forward(self, x):
        return F.gelu(x) * self.scale


class TwiceBlock(nn.Module):
    """A pre-norm block whose ``mix`` (a DropPath) runs after both branches."""

    def __init__(self, dim=16, hidden=32):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.o = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.up, self.act, self.down = nn.Linear(dim, hidden), ScaledGELU(), nn.Linear(hidden, dim)
        self.mix = nn.Identity()

    def forward(self, h):
        h = h + self.mix(self.o(self.q(self.norm1(h))))
        return h + self.mix(self.down(self.act(self.up(self.norm2(h)))))


class SharedDepth(nn.Module):
    """ALBERT: one block run at every depth, its activation as often as the block."""

    def __init__(self, vocab=64, dim=16, depth=3):
        super().__init__()
        self.embed, self.block, self.depth = nn.Embedding(vocab, dim), TwiceBlock(dim), depth
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        h = self.embed(ids)
        for _ in range(self.depth):
            h = self.block(h)
        return self.head(h)


def test_a_module_run_at_every_depth_pairs():
    plan = hpf.simulate(look(SharedDepth()), world_size=2)
    assert plan.entries["block.up"] == hpf.Colwise() and plan.entries["block.down"] == hpf.Rowwise()  # through act
    assert plan.entries["block.q"] == hpf.Colwise() and plan.entries["block.o"] == hpf.Rowwise()


# ---------------------------------------------------------------- ViTDet/SAM-style blocks
class RowsAttention(nn.Module):
    """ViTDet's and SAM's attention: one packed qkv, batch and heads merged into one row dim for
    the products, then split back."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.num_heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, _ = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.reshape(3, b * self.num_heads, n, -1).unbind(0)
        out = (q @ k.transpose(-2, -1) / 8).softmax(-1) @ v
        return self.proj(out.view(b, self.num_heads, n, -1).permute(0, 2, 1, 3).reshape(b, n, -1))


class DropTwiceMLP(nn.Module):
    """One dropout module after the activation and again after the output (ViTDet's MLP)."""

    def __init__(self, dim=32, hidden=64):
        super().__init__()
        self.fc1, self.act, self.fc2, self.drop = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim), nn.Dropout(0.0)

    def forward(self, x):
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class RowsViT(nn.Module):
    def __init__(self, dim=32, depth=2, classes=5):
        super().__init__()
        self.patch = nn.Linear(12, dim)
        self.blocks = nn.ModuleList(nn.ModuleDict({"norm1": nn.LayerNorm(dim), "attn": RowsAttention(dim),
                                                   "norm2": nn.LayerNorm(dim), "mlp": DropTwiceMLP(dim)})
                                    for _ in range(depth))
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        h = self.patch(x)
        for blk in self.blocks:
            h = h + blk["attn"](blk["norm1"](h))
            h = h + blk["mlp"](blk["norm2"](h))
        return self.head(h.mean(1))


def case_rows_vit():
    torch.manual_seed(0)
    model, m = RowsViT().eval(), mesh()
    x = torch.randn(2, 6, 12, generator=torch.Generator().manual_seed(5))
    plan = hpf.auto_plan(model, m, example_inputs=x)
    apply_fn, params, info = hpf.shard(model, plan, m, example_inputs=x)
    ref = model(x).square().mean()
    ref.backward()
    loss = apply_fn(params, x).square().mean()
    loss.backward()
    full = hpf.unshard({k: p.grad for k, p in params.items()}, info)
    diffs = {"loss": assert_close(loss, ref.detach(), "loss")}
    diffs["grads"] = max(assert_close(full[k], p.grad, f"grad {k}") for k, p in model.named_parameters())
    return diffs, dict(plan.entries)


def test_merged_batch_and_heads_and_a_dropout_run_twice_are_planned_and_exact(pool):
    diffs, entries = pool.run(case_rows_vit)[0]
    assert entries["blocks.*.attn.qkv"] == hpf.Colwise(packed=3) and entries["blocks.*.attn.proj"] == hpf.Rowwise()
    assert entries["blocks.*.attn"] == hpf.Heads(attrs=("num_heads",))
    assert entries["blocks.*.mlp.fc1"] == hpf.Colwise() and entries["blocks.*.mlp.fc2"] == hpf.Rowwise()


class ConvBetween(nn.Module):
    """SegFormer's MLP: a depthwise convolution between the two projections."""

    def __init__(self, dim=16, hidden=32):
        super().__init__()
        self.fc1, self.dw, self.fc2 = nn.Linear(dim, hidden), nn.Conv1d(hidden, hidden, 3, padding=1, groups=hidden), \
            nn.Linear(hidden, dim)

    def forward(self, x):
        h = self.dw(self.fc1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.fc2(F.gelu(h))


def test_a_module_between_the_pair_that_no_rule_splits_leaves_the_pair_replicated():
    plan = hpf.simulate(look(ConvBetween(), example_inputs=torch.randn(2, 5, 16)), world_size=2)
    # the pair and the convolution compute whole (replicated); each stores its rows split (rule 8: ShardedParams)
    assert plan.entries == {"fc1": hpf.ShardedParams(), "fc2": hpf.ShardedParams(), "dw": hpf.ShardedParams()}
    assert any(n.startswith(": dw (Conv1d: between colwise and rowwise projections): no rule splits it") or
               "dw (Conv1d: between colwise and rowwise projections): no rule splits it" in n for n in plan.notes)


class ChainOfThree(nn.Module):
    """VideoMT's mask head: fc1 → act → fc2 → act → fc3, one activation module run twice."""

    def __init__(self, dim=16):
        super().__init__()
        self.fc1, self.fc2, self.fc3, self.act = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim), nn.GELU()

    def forward(self, x):
        return self.fc3(self.act(self.fc2(self.act(self.fc1(x)))))


def test_the_last_of_a_chain_of_three_is_fed_by_no_colwise_and_stays_lone():
    plan = hpf.simulate(look(ChainOfThree(), example_inputs=torch.randn(2, 5, 16)), world_size=2)
    assert plan.entries == {"fc1": hpf.Colwise(), "fc2": hpf.Rowwise(), "fc3": hpf.Colwise(gather_output=True)}, \
        plan.entries


# ---------------------------------------------------------------- convolutions, on request
class InvertedResidual(nn.Module):
    """MobileNetV2's block: a 1×1 expansion, BatchNorm, a depthwise 3×3 and its BatchNorm, a 1×1
    projection back onto the residual stream."""

    def __init__(self, c=8, hidden=16):
        super().__init__()
        self.expand, self.bn1 = nn.Conv2d(c, hidden, 1), nn.BatchNorm2d(hidden)
        self.dw, self.bn2 = nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden), nn.BatchNorm2d(hidden)
        self.project = nn.Conv2d(hidden, c, 1)

    def forward(self, h):
        return h + self.project(F.relu6(self.bn2(self.dw(F.relu6(self.bn1(self.expand(h)))))))


class ConvNet(nn.Module):
    def __init__(self, c=8, classes=3):
        super().__init__()
        self.stem, self.block, self.head = nn.Conv2d(3, c, 3, padding=1), InvertedResidual(c), nn.Linear(c, classes)

    def forward(self, x):
        return self.head(self.block(self.stem(x)).mean((2, 3)))


def test_convolutions_pair_only_on_request():
    """By default each ungrouped convolution worth it is split on its own, its output gathered, and
    none pairs; ``split_convolutions=True`` pairs them as projections."""
    x = torch.randn(2, 3, 8, 8)
    default = hpf.simulate(look(ConvNet(), example_inputs=x), world_size=2)
    assert not any(isinstance(s, (hpf.Rowwise, hpf.Channels)) for s in default.entries.values())
    assert default.entries["block.expand"] == default.entries["block.project"] == hpf.Colwise(gather_output=True)
    assert default.entries["block.dw"] == hpf.ShardedParams()  # grouped: its compute never split on its own, its storage
    plan = hpf.simulate(look(ConvNet(), example_inputs=x, split_convolutions=True), world_size=2)
    assert {k: v for k, v in plan.entries.items() if not isinstance(v, (hpf.NoParallel, hpf.ShardedParams))} == {
        "block.expand": hpf.Colwise(), "block.bn1": hpf.Channels(), "block.dw": hpf.Channels(),
        "block.bn2": hpf.Channels(), "block.project": hpf.Rowwise(),
        "stem": hpf.Colwise(gather_output=True)}, plan.entries  # the stem pairs with none: lone


def case_resnet_split_convolutions():
    from tests.parallel.test_conv_channels import _resnet

    model, m = _resnet("bottleneck").eval(), mesh()
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    plan = hpf.auto_plan(model, m, example_inputs=x, split_convolutions=True)
    apply_fn, params, info = hpf.shard(model, plan, m, example_inputs=x)
    labels = torch.tensor([0, 2])
    ref = model(pixel_values=x, labels=labels).loss
    ref.backward()
    loss, grads = torch.func.grad_and_value(lambda p: apply_fn(p, pixel_values=x, labels=labels).loss, has_aux=False)(
        params)[::-1]
    full = hpf.unshard(grads, info)
    diffs = {"loss": assert_close(loss, ref.detach(), "loss"),
             "grads": max(assert_close(full[k], p.grad, f"grad {k}") for k, p in model.named_parameters())}
    return diffs, {k: str(v) for k, v in plan.entries.items()}


@pytest.mark.slow
def test_auto_plan_splits_a_resnets_channels_exactly(pool):
    diffs, entries = pool.run(case_resnet_split_convolutions)[0]
    for stage in (0, 1):  # each bottleneck: the 1×1 reduction and its BatchNorm split, the 3×3 reduces them
        layer = f"resnet.encoder.stages.{stage}.layers.0.layer"
        assert entries[f"{layer}.0.convolution"].startswith("Colwise(")
        assert entries[f"{layer}.0.normalization"].startswith("Channels(")
        assert entries[f"{layer}.1.convolution"].startswith("Rowwise(")


class VisualTable(nn.Linear):
    """Ovis2.5's visual embedding table: a Linear that also looks rows up by id through its weight."""

    def forward(self, x, lookup: bool = False):
        return F.embedding(x, self.weight.T) if lookup else super().forward(x)


class WithVisualTable(nn.Module):
    def __init__(self, dim=16, vocab=32):
        super().__init__()
        self.up, self.table, self.out = nn.Linear(dim, vocab), VisualTable(vocab, dim), nn.Linear(dim, dim)

    def forward(self, x, ids):
        return self.out(self.table(self.up(x).softmax(-1)) + self.table(ids, lookup=True))


class PlainLinear(nn.Linear):
    """Falcon's ``FalconLinear``: its own forward, of its input alone, computing the same map."""

    def forward(self, input):
        return input @ self.weight.T + self.bias


class WithPlainLinears(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.embed, self.up, self.down = nn.Embedding(32, dim), PlainLinear(dim, 4 * dim), PlainLinear(4 * dim, dim)

    def forward(self, ids):
        h = self.embed(ids)
        return h + self.down(F.gelu(self.up(h)))


def test_a_linear_subclass_with_its_own_forward_is_not_split():
    """Unless that forward takes its input alone (Falcon's linears pair as any MLP's do)."""
    plan = hpf.simulate(look(WithVisualTable(), example_inputs=(torch.randn(2, 5, 16), torch.randint(0, 32, (2, 5)))),
                        world_size=2)
    assert plan.entries.get("table", hpf.ShardedParams()) in (hpf.NoParallel(), hpf.ShardedParams()), plan.entries
    roles = {r.param: r.role for r in plan.coverage.rows}
    assert "table" not in plan.entries or "ShardedParams" in roles["table.weight"], roles  # computed whole
    plain = hpf.simulate(look(WithPlainLinears()), world_size=2)
    assert plain.entries["up"] == hpf.Colwise() and plain.entries["down"] == hpf.Rowwise(), plain.entries


def test_a_base_plans_parameters_are_listed_as_the_bases():
    """``auto_plan(base=from_hf(model))`` keeps HF's entries and says so for each of their
    parameters in the coverage table (it called q_proj's sharded weight "replicated" before)."""
    model = build_hf("llama")
    plan = hpf.simulate(look(model, base=hpf.ShardingPlan.from_hf(model)), world_size=2)
    rows = {r.param: r for r in plan.coverage.rows}
    for fqn in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        assert rows[fqn].role == "planned by the base plan" and rows[fqn].sharded, rows[fqn]
    assert rows["model.norm.weight"].role == "norm (replicated)"


def case_musicgen():
    from hp_functional.tools.sweep import check_family

    return check_family("musicgen", mesh())


@pytest.mark.slow
def test_an_output_embedding_that_is_no_projection_is_not_taken_for_the_head():
    """MusicGen's ``get_output_embeddings()`` is a ModuleList of per-codebook heads: auto_plan plans its parts
    as it finds them instead of failing on the list, and the model is exact at tp 2 (loss, every gradient)."""
    from hp_functional.tools.sweep import EXACT, combine
    from tests.conftest import get_pool

    row = combine(get_pool(2).run(case_musicgen))
    assert row["outcome"] == EXACT, row


class Lone(nn.Module):
    """Projections, tables and a convolution that pair with nothing: a classifier and a convolution
    worth splitting, a gate under 1 % of the parameters, a position table looked up by its own
    forward only, a type table its parent also reads by weight."""

    def __init__(self):
        super().__init__()
        self.embed, self.pos, self.types = nn.Embedding(32, 16), nn.Embedding(8, 16), nn.Embedding(4, 16)
        self.conv = nn.Conv1d(16, 16, 3, padding=1)
        self.gate, self.cls, self.head = nn.Linear(16, 1), nn.Linear(16, 16), nn.Linear(16, 32)

    def forward(self, ids):
        h = self.embed(ids) + self.pos(torch.arange(ids.shape[1])) + self.types(torch.zeros_like(ids))
        h = h + self.types.weight.mean(0) + self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.head(torch.sigmoid(self.gate(h)) * self.cls(h))


def test_lone_projections_tables_and_convolutions_worth_it_are_split():
    """What pairs with nothing is split where it holds 1 % of the parameters or more and only its
    own forward reads its weight (``ModelTrace.param_users``): a lone projection or convolution
    colwise with its output gathered, a table by rows (``VocabEmbedding``); else replicated."""
    plan = hpf.simulate(look(Lone(), example_inputs=torch.zeros(2, 8, dtype=torch.long)), world_size=2)
    assert plan.entries["cls"] == hpf.Colwise(gather_output=True) == plan.entries["conv"]
    assert plan.entries["pos"] == hpf.VocabEmbedding()
    assert plan.coverage.replicated["gate.weight"].startswith("lone projection (replicated")  # 17 of 2321
    assert plan.entries["types"] == hpf.ShardedParams()  # read whole by its parent: stored split, gathered (rule 8)


def case_lone():
    torch.manual_seed(0)
    model, m = Lone(), mesh()
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(3))
    apply_fn, params, info = hpf.shard(model, hpf.auto_plan(model, m, example_inputs=ids), m)
    model(ids).square().mean().backward()
    out = apply_fn(params, ids)
    out.square().mean().backward()
    assert_close(out, model(ids).detach(), "output")
    full = hpf.unshard({k: p.grad for k, p in params.items()}, info)
    return {k: assert_close(full[k], p.grad, f"grad {k}") for k, p in model.named_parameters()}, \
        {k: str(i.placements) for k, i in info.items()}


def test_lone_modules_split_are_exact():
    for diffs, placements in get_pool(2).run(case_lone):
        assert max(diffs.values()) < 1e-5, diffs
        assert placements["cls.weight"] == placements["conv.weight"] == placements["pos.weight"] == "(Shard(dim=0),)"


class TransposingHead(nn.Conv1d):
    """Parakeet's CTC head: a convolution subclass that takes (N, T, C) and transposes it itself."""

    def forward(self, x):
        return super().forward(x.transpose(1, 2)).transpose(1, 2)


class Narrow(nn.Module):
    """A pair of 3 features between its ends: they do not divide the axis."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 3), nn.Linear(3, 16)

    def forward(self, h):
        return self.fc2(torch.relu(self.fc1(h)))


class KeysAsWide(nn.Module):
    """An attention whose scores are normalised over as many keys as its width (GroupViT's
    ``attn / attn.sum(-1)``), with an additive bias on its keys from outside."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))

    def forward(self, h, bias):
        scores = (self.q(h) @ (self.k(h) + bias).transpose(1, 2)).exp()
        return self.o((scores / scores.sum(-1, keepdim=True)) @ self.v(h))


class WhatStaysWhole(nn.Module):
    """Modules worth splitting by size that auto_plan must leave whole: a convolution whose class lays
    out its input otherwise (Parakeet), a position table looked up over ``arange(num_embeddings)``
    (Whisper's encoder: a split divides that count on the skeleton), a relative-position table whose
    lookup goes straight into an attention block (SpeechT5), and a pair whose features (3) do not
    divide the axis (LightGlue's matchability); the attention's projections still pair though a sum
    over its keys is as wide as they are (the scores are contracted, not their features)."""

    def __init__(self):
        super().__init__()
        self.embed, self.pos, self.rel = nn.Embedding(32, 16), nn.Embedding(16, 16), nn.Embedding(16, 16)
        self.norm, self.attn, self.narrow, self.head = nn.LayerNorm(16), KeysAsWide(), Narrow(), TransposingHead(16, 32, 1)

    def forward(self, ids):  # ids [N, 16]: 16 keys, as many as the width
        h = self.norm(self.embed(ids) + self.pos(torch.arange(self.pos.num_embeddings)))
        h = h + self.attn(h, self.rel(torch.arange(16)))
        return self.head(h + self.narrow(h))


def test_what_a_split_would_break_stays_whole():
    plan = hpf.simulate(look(WhatStaysWhole(), example_inputs=torch.zeros(2, 16, dtype=torch.long)), world_size=2)
    roles = {r.param: r.role for r in plan.coverage.rows}
    for p in ("head", "pos", "rel", "narrow.fc2"):  # computed whole, stored split on dim 0 (rule 8)
        assert plan.entries[p] == hpf.ShardedParams() and "ShardedParams" in roles[f"{p}.weight"], (p, roles)
    assert plan.entries["narrow.fc1"] == hpf.NoParallel(), plan.entries  # 3 rows do not split over 2
    assert all(roles[f"attn.{p}.weight"].startswith("colwise") for p in "qkv"), roles  # paired, not lone
    assert roles["attn.o.weight"].startswith("rowwise"), roles
