"""``hpf.auto_plan`` is exact or refuses, checked against the
unsharded model: loss and every gradient under ``.backward()`` and ``torch.func.grad``.

* OPT views its local q/k/v with ``self.num_heads`` and a ``-1`` that, with the head count left
  global, lands on the sequence dim (with SDPA's ``is_causal`` nothing else notices): auto_plan
  must divide ``num_heads``.
* BioGPT's mask asks a meta tensor for a value (``Tensor.item()``): the trace takes a one-element
  boolean as True and goes on (the trace used to stop there, in 17 families).
* GPT-BigCode is multi-query (one KV head) with a fused ``c_attn`` = q | k | v: splitting its
  single K/V head over the ranks is wrong; auto_plan gathers the block (exact) instead.
* MPNet's encoder computes one relative position bias (a table of one column per head) and hands
  it to every layer, whose attention adds it to its scores: with the heads split, the table is
  split by its columns too (it was left whole and the probe refused the plan by shape).
"""

from __future__ import annotations

import pytest
import torch

import hp_functional as hpf
from tests.support.helpers import assert_close, mesh


def build(kind: str, state=None):
    torch.manual_seed(0)
    if kind == "opt":
        from transformers import OPTConfig, OPTForCausalLM

        config = OPTConfig(vocab_size=128, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                           max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2)
        config._attn_implementation = "sdpa"
        model = OPTForCausalLM(config)
    elif kind == "biogpt":  # its sdpa mask asks bool(padding_mask.sum() == numel): the trace takes it as True
        from transformers import BioGptConfig, BioGptForCausalLM

        config = BioGptConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
                              attention_probs_dropout_prob=0.0, layerdrop=0.0, pad_token_id=0, bos_token_id=1,
                              eos_token_id=2)
        config._attn_implementation = "sdpa"
        model = BioGptForCausalLM(config)
    elif kind == "mpnet":
        from transformers import MPNetConfig, MPNetForMaskedLM

        config = MPNetConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=64, relative_attention_num_buckets=32,
                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)
        model = MPNetForMaskedLM(config)
    else:
        from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

        config = GPTBigCodeConfig(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64, multi_query=True,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
        config._attn_implementation = "sdpa"
        model = GPTBigCodeForCausalLM(config)
    if state is not None:
        model.load_state_dict(state)
    return model


def make_state(kind: str):
    model = build(kind)
    with torch.no_grad():  # non-trivial norm weights and biases, so their gradients are checked for real
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5) if "ln" in name or "norm" in name else p.normal_(0.0, 0.1)
    return model.state_dict()


def case_exact(kind: str, state):
    m = mesh()
    model = build(kind, state)
    plan = hpf.auto_plan(model, m)
    apply_fn, params, info = hpf.shard(model, plan, m)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(7))
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    out = apply_fn(params, input_ids=ids, labels=ids)
    diffs = {"loss": assert_close(out.loss, ref.loss.detach(), "loss"),
             "logits": assert_close(out.logits, ref.logits.detach(), "logits")}
    out.loss.backward()
    grads = dict(model.named_parameters())
    full = hpf.unshard({k: p.grad for k, p in params.items()}, info)
    assert set(full) == set(grads), "every parameter has a gradient"
    diffs["grads"] = max(assert_close(full[k], grads[k].grad, f"grad {k}") for k in grads)
    func = torch.func.grad(lambda p: apply_fn(p, input_ids=ids, labels=ids).loss)(
        {k: p.detach() for k, p in params.items()})
    full = hpf.unshard(func, info)
    diffs["func.grad"] = max(assert_close(full[k], grads[k].grad, f"torch.func.grad {k}") for k in grads)
    sharded = sum(i.local_shape.numel() for i in info.values()) / sum(i.global_shape.numel() for i in info.values())
    return diffs, plan.explain(), sharded


@pytest.mark.parametrize("kind", ["opt", "gpt_bigcode", "biogpt", "mpnet"])
@pytest.mark.slow
def test_auto_plan_is_exact(pool, kind):
    diffs, text, share = pool.run(case_exact, kind, make_state(kind))[0]
    print(f"{kind} world {pool.world}: max |diff| {diffs}, a rank holds {share:.0%} of the parameters")
    if kind == "opt":
        assert "Heads(attrs=('num_heads',)" in text, text
    elif kind == "gpt_bigcode":  # the attention block gathered, the MLP sharded
        assert "gathered" in text and "mlp.c_fc" in text, text
    elif kind == "mpnet":
        assert "mpnet.encoder.relative_attention_bias" in text and "per-head table handed to the blocks" in text, text
    assert share < 0.8


# ---------------------------------------------------------------- the shape audit (build_program's lint)
OPT_ATTN = "model.decoder.layers.*.self_attn"
OPT_PLAN = {f"{OPT_ATTN}.{n}_proj": hpf.Colwise() for n in "qkv"} | {f"{OPT_ATTN}.out_proj": hpf.Rowwise()}


class TwoTensorAttention(torch.nn.Module):
    """A region whose forward takes two tensors, in a model that does not start with an
    embedding: its arguments cannot be synthesized."""

    def __init__(self):
        super().__init__()
        self.n_heads = 4
        self.q, self.o = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x, scale):
        b, s, _ = x.shape
        return self.o((self.q(x).view(b, s, self.n_heads, -1) * scale).reshape(b, s, -1))


class Wrapper(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = TwoTensorAttention()

    def forward(self, x):
        return self.attn(x, x.new_ones(()))


@pytest.mark.parametrize("world", [2, 4])
def test_shape_audit_refuses_a_head_count_kept_global(world):
    """OPT's attention planned by hand without ``Heads``: ``view(bsz, -1, num_heads, head_dim)``
    runs at local shapes with its ``-1`` on the sequence.  build_program refuses it (before any
    collective), naming the region, the op and the attribute; with ``Heads(attrs=('num_heads',))``
    nothing is found.  GPT-BigCode's single K/V head split by a packed Colwise is refused too."""
    model = build("opt")
    with pytest.raises(hpf.PlanError) as exc:
        hpf.simulate(lambda m: hpf.build_program(model, OPT_PLAN, m), world_size=world)
    text = str(exc.value)
    for part in ("model.decoder.layers.*.self_attn: op view", "(2 modules)", "attribute num_heads=4",
                 "plan 'model.decoder.layers.*.self_attn' as Heads(attrs=('num_heads',))"):
        assert part in text, text
    good = {OPT_ATTN: hpf.Heads(attrs=("num_heads",)), **OPT_PLAN}
    assert hpf.simulate(lambda m: hpf.lint(model, good, m), world_size=world) == []
    hpf.simulate(lambda m: hpf.build_program(model, good, m), world_size=world)

    code = build("gpt_bigcode")
    A = "transformer.h.*.attn"
    split_kv = {f"{A}.c_attn": hpf.Colwise(packed=(32, 8, 8)), f"{A}.c_proj": hpf.Rowwise(),
                A: hpf.Heads(attrs=("embed_dim", "kv_dim"))}
    found = hpf.simulate(lambda m: hpf.lint(code, split_kv, m), world_size=world)
    assert [(f.level, f.where) for f in found] == [("error", f"transformer.h.{i}.attn") for i in range(2)], found
    assert "op scaled_dot_product_attention" in str(found[0]) and "torch would raise" in str(found[0])


def test_regions_the_audit_cannot_run_are_noted():
    """A region whose arguments cannot be synthesized is a ``not-audited`` note of ``hpf.lint``
    (build_program neither raises nor warns for it)."""
    plan = {"attn.q": hpf.Colwise(), "attn.o": hpf.Rowwise(), "attn": hpf.Heads(attrs=("n_heads",))}
    found = hpf.simulate(lambda m: hpf.lint(Wrapper(), plan, m), world_size=2)
    assert [(f.level, f.code, f.where) for f in found] == [("note", "not-audited", "attn")], found
    assert "its arguments cannot be synthesized" in str(found[0])
    hpf.simulate(lambda m: hpf.build_program(Wrapper(), plan, m), world_size=2)
