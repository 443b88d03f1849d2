"""Pipeline stages of models whose root forward does more than embed -> layers -> norm -> head.

Cohere multiplies the logits by ``logit_scale``; Granite multiplies the embeddings by
``embedding_multiplier`` and divides the logits by ``logits_scaling``.  ``pipeline_split`` traces
the root forward on meta tensors: such operations run where they belong (a stage hands its last
layer's output on and the next stage's first layer takes it, so what the root computes before
the first layer runs on the first stage only, and what it computes after the last layer on the
last stage only).  Tiny Cohere (tied) and Granite (untied) at 2 stages, on (pp 2, tp 2) with the
HF TP plan, (pp 2, dp 2) with ``hpf.fsdp``, and (pp 2, dp 1), under torch's ``Schedule1F1B`` and
``hpf.gpipe`` with ``torch.func.grad``: the last stage's loss and every gradient within 1e-5 of
the unsharded model.  A root forward computing between two layers, feeding a layer anything
but the previous layer's output, or picking a layer's inputs by the loop's index where a stage
would start off the pattern, is refused naming the operation or argument, on every rank."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import hp_functional as hpf
from tests.conftest import get_pool
from tests.support.helpers import assert_close, assert_errors, mesh, plan_errors

LAYERS = 4
MICROBATCHES = 2
EXTRA = {"cohere": dict(logit_scale=0.25),  # tied embeddings by default
         "granite": dict(embedding_multiplier=3.0, logits_scaling=4.0, residual_multiplier=0.5,
                         attention_multiplier=0.2, tie_word_embeddings=False)}


def build(family: str, state=None):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        family, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, **EXTRA[family])
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if state is not None:
        model.load_state_dict(state)
    return model


def make_state(family: str):
    model = build(family)
    with torch.no_grad():  # non-trivial norm weights, so their gradients are checked for real
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.state_dict()


def causal_lm_loss(logits, target):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), target[:, 1:].reshape(-1))


def case_stages(family: str, other: str, state):
    """Both schedules on this rank's stage against the unsharded model; the worst differences."""
    model = build(family, state)
    m = mesh((2, dist_world() // 2), ("pp", other))
    stage = hpf.pipeline_split(model, 2, embedding_group=model.config.tie_word_embeddings)[m.get_local_rank("pp")]
    plan = hpf.ShardingPlan.from_hf(model) if other == "tp" else {}
    apply_fn, params, info = hpf.shard_stage(model, stage, plan, m)
    ids = torch.randint(0, 128, (8, 8), generator=torch.Generator().manual_seed(3))
    rows = ids
    if other == "dp":
        rows = ids.chunk(m["dp"].size())[m.get_local_rank("dp")]
        apply_fn, params, info = hpf.fsdp(apply_fn, params, info, m["dp"], dp_axis="dp")
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    local_ref = model(input_ids=rows, labels=rows).loss.detach()
    worst = {}
    mod = hpf.stage_module(apply_fn, params, stage)  # torch's 1F1B drives it
    pipe = PipelineStage(mod, stage.index, stage.num_stages, torch.device("cpu"), group=m.get_group("pp"))
    losses = []
    run = Schedule1F1B(pipe, n_microbatches=MICROBATCHES, loss_fn=causal_lm_loss)
    run.step(rows) if stage.is_first else run.step(target=rows, losses=losses)
    if losses:
        worst["1f1b loss"] = assert_close(torch.stack(losses).mean(), local_ref, "1f1b loss")
    full = hpf.unshard(hpf.sum_tied({k: p.grad for k, p in mod.named_parameters()}, stage, m), info)
    worst["1f1b grads"] = max(assert_close(g, model.get_parameter(k).grad, k) for k, g in full.items())
    step = hpf.gpipe(apply_fn, stage, m, causal_lm_loss, MICROBATCHES, hidden_size=model.config.hidden_size)
    grads, loss = torch.func.grad_and_value(step)(params, rows, rows)  # the functional GPipe
    if stage.is_last:
        worst["gpipe loss"] = assert_close(loss, local_ref, "gpipe loss")
    full = hpf.unshard(hpf.sum_tied(grads, stage, m), info)
    worst["gpipe grads"] = max(assert_close(g, model.get_parameter(k).grad, k) for k, g in full.items())
    return worst, sorted(full), (stage.index, stage.root_ops)


def dist_world() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


@pytest.mark.parametrize("family,other,world", [("cohere", "tp", 4), ("granite", "dp", 4),
                                                ("cohere", "dp", 2), ("granite", "dp", 2)],
                         ids=["cohere-pp2xtp2", "granite-pp2xdp2", "cohere-pp2", "granite-pp2"])
@pytest.mark.slow
def test_root_ops_run_where_they_belong(family, other, world):
    state = make_state(family)
    results = get_pool(world).run(case_stages, family, other, state)
    tied = build(family).config.tie_word_embeddings
    assert set().union(*(r[1] for r in results)) == {k for k in state if not (tied and k == "lm_head.weight")}
    ops = dict(r[2] for r in results)
    # the trace found the extra operations and placed them: the embeddings' on the first stage, the logits' on the last
    first, last = ops[0], ops[1]
    if family == "granite":
        assert any(o.startswith("mul ") for o in first) and any(o.startswith("div ") for o in last), ops
    else:
        assert not first and any(o.startswith("mul ") for o in last), ops
    print({k: max(r[0][k] for r in results if k in r[0]) for k in results[-1][0]})


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, hidden_states, extra=None):
        out = hidden_states + torch.tanh(self.proj(hidden_states))
        return out if extra is None else out + extra


class Toy(nn.Module):
    """embed -> layers -> norm -> head, with the root computing ``mode``'s extra operation."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(Block() for _ in range(4))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16)

    def forward(self, input_ids=None, inputs_embeds=None, use_cache=None):
        e = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        h = e * 2.0 if self.mode == "ends" else e
        biases = [torch.zeros(8), torch.ones(8)]  # "alternating": the loop's index picks a layer's input
        for i, layer in enumerate(self.layers):
            extra = {"embeddings to every layer": e, "alternating": biases[i % 2]}.get(self.mode)
            h = layer(h, extra=extra)
            if self.mode == "between layers":
                h = torch.sigmoid(h)
        out = self.head(self.norm(h))
        return out - 1.0 if self.mode == "ends" else out


PLAN = ["embed", "layers", "norm", "head"]


def case_toy():
    """A root forward computing between two layers, passing the embeddings to every layer, or
    alternating the layers' inputs by the loop's index (split off the pattern) is refused by
    name; one computing only before the first and after the last layer is exact."""
    errors = plan_errors({mode: lambda mode=mode: hpf.pipeline_split(Toy(mode), 2, plan=PLAN, layers=[1, 3])
                          for mode in ("between layers", "embeddings to every layer", "alternating")})
    assert [s.layers for s in hpf.pipeline_split(Toy("alternating"), 2, plan=PLAN)] == [(0, 1), (2, 3)]
    torch.manual_seed(0)
    model = Toy("ends")
    m = mesh((2, 1), ("pp", "dp"))
    stage = hpf.pipeline_split(model, 2, plan=PLAN)[m.get_local_rank("pp")]
    apply_fn, params, _ = hpf.shard_stage(model, stage, {}, m)
    ids = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(1))
    step = hpf.gpipe(apply_fn, stage, m, causal_lm_loss, 2, hidden_size=8)
    grads, loss = torch.func.grad_and_value(step)(params, ids, ids)
    ref = causal_lm_loss(model(input_ids=ids), ids)
    ref.backward()
    worst = assert_close(loss, ref.detach(), "loss") if stage.is_last else 0.0
    return errors, max(worst, *(assert_close(g, model.get_parameter(k).grad, k) for k, g in grads.items()))


def test_toy_root_ops_refused_or_exact():
    results = get_pool(2).run(case_toy)
    assert_errors([r[0] for r in results], {
        "between layers": "sigmoid", "embeddings to every layer": "'embed'",
        "alternating": "layer 1 gets other arguments (['extra']) than layer 0"})
    print([r[1] for r in results])
