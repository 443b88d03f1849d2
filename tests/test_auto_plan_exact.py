"""``hpf.auto_plan`` is exact or refuses (issue 30, findings 1 and 2), checked against the
unsharded model: loss and every gradient under ``.backward()`` and ``torch.func.grad``.

* OPT views its local q/k/v with ``self.num_heads`` and a ``-1`` that, with the head count left
  global, lands on the sequence dim (with SDPA's ``is_causal`` nothing else notices): auto_plan
  must divide ``num_heads``.
* GPT-BigCode is multi-query (one KV head) with a fused ``c_attn`` = q | k | v: splitting its
  single K/V head over the ranks is wrong; auto_plan gathers the block (exact) instead.
"""

from __future__ import annotations

import pytest
import torch

import hp_functional as hpf
from tests.helpers import assert_close, mesh


def build(kind: str, state=None):
    torch.manual_seed(0)
    if kind == "opt":
        from transformers import OPTConfig, OPTForCausalLM

        config = OPTConfig(vocab_size=128, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                           max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2)
        config._attn_implementation = "sdpa"
        model = OPTForCausalLM(config)
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


@pytest.mark.parametrize("kind", ["opt", "gpt_bigcode"])
def test_auto_plan_is_exact(pool, kind):
    diffs, text, share = pool.run(case_exact, kind, make_state(kind))[0]
    print(f"{kind} world {pool.world}: max |diff| {diffs}, a rank holds {share:.0%} of the parameters")
    if kind == "opt":
        assert "Heads(attrs=('num_heads',)" in text, text
    else:  # the attention block gathered, the MLP sharded
        assert "gathered" in text and "mlp.c_fc" in text, text
    assert share < 0.8
