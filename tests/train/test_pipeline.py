"""Pipeline stages against the unsharded model (fp32, gloo, 4 ranks).

A 4-layer HF ``LlamaForCausalLM`` (tied and untied embeddings) split into 2 stages and driven by
torch's own ``ScheduleGPipe`` and ``Schedule1F1B`` with 4 micro-batches, and by ``hpf.gpipe``
under ``torch.func.grad`` and ``.backward()``: on (pp 2, tp 2) with the
model's TP plan, and on (pp 2, dp 2) with ``hpf.fsdp`` over dp.  The last stage's loss and every
stage's gradients (all stages together: every parameter) within 1e-5 of the unsharded model,
then 10 AdamW steps matching; tied embeddings get their two stages' gradients summed.  A stage
holds only its own blocks, reads only its own weights from a file, and leaves the model as it
was; the stages' checkpoints together load as the whole model; bad input raises on every rank before any collective."""

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import hp_functional as hpf
from hp_functional.core.placement import slice_local
from tests.conftest import get_pool
from tests.support.helpers import assert_close, assert_errors, build_hf, make_hf_state, mesh, plan_errors
from tests.support.snapshot import assert_unchanged, snapshot

LAYERS = 4
MICROBATCHES = 4
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def causal_lm_loss(logits, target):
    """HF's causal-LM loss (labels shifted by one, mean over the tokens) on a micro-batch."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), target[:, 1:].reshape(-1))


def _step(mod, stage, m, schedule, rows):
    """One pipelined step; the mean micro-batch loss on the last stage (None elsewhere)."""
    pipe = PipelineStage(mod, stage.index, stage.num_stages, torch.device("cpu"), group=m.get_group("pp"))
    run = SCHEDULES[schedule](pipe, n_microbatches=MICROBATCHES, loss_fn=causal_lm_loss)
    losses = []
    run.step(rows) if stage.is_first else run.step(target=rows, losses=losses)
    grads = hpf.sum_tied({k: p.grad for k, p in mod.named_parameters()}, stage, m)
    return (torch.stack(losses).mean() if losses else None), grads


def _stages_form_the_model(model, params, info, root: str) -> None:
    """Every stage saves its shards into one checkpoint; loaded at tp 4 it is the whole model."""
    hpf.save(f"{root}/stages", params, info).wait()
    plan = hpf.ShardingPlan.from_hf(model)
    _, _, whole = hpf.shard(model, plan, mesh((4,), ("tp",)))
    loaded = hpf.load(f"{root}/stages", whole)
    for k, p in loaded.params.items():
        assert torch.equal(p, slice_local(model.get_parameter(k).detach(), whole[k])), k


def case_pipeline(state, tied: bool, other: str, weights: str | None, train: bool, root: str):
    model = build_hf("llama", state, tie_word_embeddings=tied, num_hidden_layers=LAYERS)
    before = snapshot(model)
    m = mesh((2, 2), ("pp", other))
    stages = hpf.pipeline_split(model, 2, embedding_group=tied)
    stage = stages[m.get_local_rank("pp")]
    plan = hpf.ShardingPlan.from_hf(model) if other == "tp" else {}
    apply_fn, params, info = hpf.shard_stage(model, stage, plan, m)
    others = {f"model.layers.{i}." for i in range(LAYERS) if i not in stage.layers}
    assert not any(k.startswith(tuple(others)) for k in params)  # only the stage's own blocks
    assert not any(n.startswith(tuple(others)) for n, _ in apply_fn.runtime.template.named_parameters())
    assert ("model.embed_tokens.weight" in params) == (stage.is_first or tied)
    if weights is not None:  # a meta model: the stage reads only its own tensors from the file
        with torch.device("meta"):
            empty = build_hf("llama", tie_word_embeddings=tied, num_hidden_layers=LAYERS)
        _, loaded, _ = hpf.shard_stage(empty, stage, plan, m, weights=weights)
        assert loaded.keys() == params.keys() and all(torch.equal(loaded[k], params[k]) for k in params)
    if other == "tp":
        _stages_form_the_model(model, params, info, root)
    ids = torch.randint(0, 128, (8, 8), generator=torch.Generator().manual_seed(3))
    rows = ids.chunk(2)[m.get_local_rank("dp")] if other == "dp" else ids
    if other == "dp":
        apply_fn, params, info = hpf.fsdp(apply_fn, params, info, m["dp"], dp_axis="dp")
    assert_unchanged(before, snapshot(model))
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    local_ref = model(input_ids=rows, labels=rows).loss.detach()
    worst = {}
    mod = hpf.stage_module(apply_fn, params, stage)
    for schedule in SCHEDULES:
        loss, grads = _step(mod, stage, m, schedule, rows)
        if loss is not None:
            worst[f"{schedule} loss"] = assert_close(loss, local_ref, "loss")
        full = hpf.unshard(grads, info)
        worst[f"{schedule} grads"] = max(assert_close(full[k], model.get_parameter(k).grad, k) for k in full)
        mod.zero_grad(set_to_none=True)
    # the functional GPipe: the pipeline under torch.func.grad
    step = hpf.gpipe(apply_fn, stage, m, causal_lm_loss, MICROBATCHES, hidden_size=model.config.hidden_size)
    grads, loss = torch.func.grad_and_value(step)(params, rows, rows)
    if stage.is_last:
        worst["func loss"] = assert_close(loss, local_ref, "loss")
    full = hpf.unshard(hpf.sum_tied(grads, stage, m), info)
    worst["func grads"] = max(assert_close(full[k], model.get_parameter(k).grad, k) for k in full)
    if not train:
        return worst, sorted(full)
    # eps 1e-6: Adam's first steps turn a 1e-9 rounding difference in a ~1e-8 gradient into a
    # difference of order lr; a larger eps keeps the comparison about the gradients
    opt, ref_opt = (torch.optim.AdamW(x.parameters(), lr=1e-3, eps=1e-6) for x in (mod, model))
    for step in range(10):
        loss, grads = _step(mod, stage, m, "1f1b", rows)
        if loss is not None:
            worst[f"adamw loss {step}"] = assert_close(loss, model(input_ids=rows, labels=rows).loss, "loss")
        for k, p in mod.named_parameters():
            p.grad = grads[k]
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        ref_opt.step()
    full = hpf.unshard(mod.params(), info)
    worst["adamw params"] = max(assert_close(full[k], model.get_parameter(k).detach(), k) for k in full)
    return worst, sorted(full)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("other", ["tp", "dp"])
@pytest.mark.slow
def test_two_stages(other, tied, tmp_path):
    """2 stages × tp 2 (TP plan) and 2 stages × dp 2 (FSDP), GPipe and 1F1B; then 10 AdamW steps
    (tied on tp, untied on dp: both tie options and both compositions train)."""
    state = make_hf_state("llama", tie_word_embeddings=tied, num_hidden_layers=LAYERS)
    weights = None
    if not tied and other == "tp":
        weights = str(tmp_path / "model.safetensors")
        save_file({k: v.contiguous() for k, v in state.items()}, weights)
    results = get_pool(4).run(case_pipeline, state, tied, other, weights, (other == "tp") == tied, str(tmp_path))
    keys = set().union(*(r[1] for r in results))
    expected = {k for k in state if not (tied and k == "lm_head.weight")}
    assert keys == expected  # every parameter, on some stage
    print({k: max(r[0][k] for r in results if k in r[0]) for k in results[-1][0]})


def case_bad_input(state):
    tied = build_hf("llama", state, tie_word_embeddings=True, num_hidden_layers=LAYERS)
    m = mesh((2, 2), ("pp", "tp"))
    stages = hpf.pipeline_split(tied, 2, embedding_group=True)
    wrong = stages[1 - m.get_local_rank("pp")]
    stage = stages[m.get_local_rank("pp")]
    apply_fn, params, _ = hpf.shard_stage(tied, stage, {}, m)
    step = hpf.gpipe(apply_fn, stage, m, causal_lm_loss, MICROBATCHES, hidden_size=64)
    ids = torch.zeros(6, 8, dtype=torch.long)
    return plan_errors({
        "micro-batches": lambda: step(params, ids, ids),
        "target": lambda: step(params, ids[:4], ids[:2]),
        "too many stages": lambda: hpf.pipeline_split(tied, LAYERS + 1),
        "layers": lambda: hpf.pipeline_split(tied, 2, layers=[4, 0], embedding_group=True),
        "tied": lambda: hpf.pipeline_split(tied, 2),
        "no pp axis": lambda: hpf.shard_stage(tied, stages[0], {}, mesh((4,), ("tp",))),
        "wrong stage": lambda: hpf.shard_stage(tied, wrong, {}, m),
        "gpipe stage": lambda: hpf.gpipe(apply_fn, wrong, m, causal_lm_loss, MICROBATCHES, hidden_size=64),
        "tied None": lambda: hpf.sum_tied({k: None if stage.is_first else torch.ones(3) for k in stage.tied}, stage, m),
    })


def test_bad_input():
    errors = get_pool(4).run(case_bad_input, make_hf_state("llama", tie_word_embeddings=True, num_hidden_layers=LAYERS))
    assert_errors(errors, {"too many stages": "num_stages=5 must be between 1 and the 4 layers",
                           "layers": "layers=[4, 0]", "tied": "'model.embed_tokens.weight' is tied across stages",
                           "no pp axis": "pp_axis 'pp' is not in the mesh", "wrong stage": "this rank is stage",
                           "gpipe stage": "gpipe: this rank is stage",
                           "tied None": "are None on some of the 2 stages holding them",
                           "micro-batches": "divisible into 4 micro-batches", "target": "with the batch of inputs (4)"})


def case_explain(state):
    model = build_hf("llama", state, num_hidden_layers=LAYERS)
    m = mesh((2, 2), ("pp", "tp"))
    stage = hpf.pipeline_split(model, 2)[m.get_local_rank("pp")]
    ex = hpf.explain_stage(model, stage, hpf.ShardingPlan.from_hf(model), m, batch=8, seq=8, microbatches=MICROBATCHES)
    text = str(ex)
    assert "4 micro-batches per step" in text and ("send" in text) and ("recv" in text)
    one = ex.per_microbatch.schedule.totals()
    return ex.step, one, stage.index


@pytest.mark.slow
def test_explain_stage_counts_p2p_and_collectives():
    """Per step: every micro-batch's activation sent forward and its gradient back (2 × 8 × 64
    fp32 = 4 KiB each), and the stage's TP collectives once per micro-batch."""
    for step, one, index in get_pool(4).run(case_explain, make_hf_state("llama", num_hidden_layers=LAYERS)):
        sent, got = ("fwd", "bwd") if index == 0 else ("bwd", "fwd")
        assert step[(sent, "send", "pp")] == (MICROBATCHES, MICROBATCHES * 2 * 8 * 64 * 4)
        assert step[(got, "recv", "pp")] == (MICROBATCHES, MICROBATCHES * 2 * 8 * 64 * 4)
        assert ("fwd", "recv", "pp") not in step if index == 0 else ("fwd", "send", "pp") not in step
        # two layers per stage, attention and MLP each; the first stage's vocab-parallel embedding
        assert one[("fwd", "all_reduce", "tp")][0] == 2 * 2 + (index == 0)
        assert step[("fwd", "all_reduce", "tp")][0] == MICROBATCHES * one[("fwd", "all_reduce", "tp")][0]


def case_four_stages(state):
    """4 stages (one layer each) on (pp 4, dp 1): middle stages run layers only, and the tied
    embedding's gradients are summed over the first and last stage's ranks alone."""
    model = build_hf("llama", state, tie_word_embeddings=True, num_hidden_layers=LAYERS)
    m = mesh((4, 1), ("pp", "dp"))
    stage = hpf.pipeline_split(model, 4, embedding_group=True)[m.get_local_rank("pp")]
    assert stage.layers == (stage.index,) and bool(stage.tied) == (stage.index in (0, 3))
    apply_fn, params, info = hpf.shard_stage(model, stage, {}, m)
    ids = torch.randint(0, 128, (8, 8), generator=torch.Generator().manual_seed(3))
    model(input_ids=ids, labels=ids).loss.backward()
    loss, grads = _step(hpf.stage_module(apply_fn, params, stage), stage, m, "1f1b", ids)
    worst = max(assert_close(g, model.get_parameter(k).grad, k) for k, g in grads.items())
    step = hpf.gpipe(apply_fn, stage, m, causal_lm_loss, MICROBATCHES, hidden_size=model.config.hidden_size)
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    step(leaves, ids, ids).backward()  # the functional GPipe under .backward(), middle stages too
    grads = hpf.sum_tied({k: v.grad for k, v in leaves.items()}, stage, m)
    worst = max(worst, *(assert_close(g, model.get_parameter(k).grad, k) for k, g in grads.items()))
    return worst, sorted(grads)


def test_four_stages_tied_embedding_group():
    results = get_pool(4).run(case_four_stages, make_hf_state("llama", tie_word_embeddings=True,
                                                              num_hidden_layers=LAYERS))
    assert set().union(*(r[1] for r in results)) == set(make_hf_state("llama", tie_word_embeddings=True,
                                                                      num_hidden_layers=LAYERS)) - {"lm_head.weight"}
    print([r[0] for r in results])


def case_family(family: str, state):
    """Another family's stages under hpf.gpipe and torch.func.grad against its unsharded model."""
    model = build_hf(family, state, num_hidden_layers=LAYERS)
    m = mesh((2, 1), ("pp", "dp"))
    stage = hpf.pipeline_split(model, 2, embedding_group=True)[m.get_local_rank("pp")]
    apply_fn, params, _ = hpf.shard_stage(model, stage, {}, m)
    ids = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(3))
    step = hpf.gpipe(apply_fn, stage, m, causal_lm_loss, 2, hidden_size=model.config.hidden_size)
    grads, loss = torch.func.grad_and_value(step)(params, ids, ids)
    grads = hpf.sum_tied(grads, stage, m)
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    worst = assert_close(loss, ref.loss.detach(), "loss") if stage.is_last else 0.0
    return max(worst, *(assert_close(g, model.get_parameter(k).grad, k) for k, g in grads.items()))


@pytest.mark.parametrize("family", ["qwen2", "gemma"])
@pytest.mark.slow
def test_other_families(family):
    """Qwen2 and Gemma (embedding scale in its embedding module, as HF's pp_plan contract has it)."""
    print(get_pool(2).run(case_family, family, make_hf_state(family, num_hidden_layers=LAYERS)))
