"""Context parallelism on HF ``LlamaForCausalLM`` against the unsharded model (fp32, gloo).

cp 2 and cp 4 (both strategies, zigzag; contiguous too), cp 2 × tp 2 (loss parallel too),
dp 2 × cp 2 with batches sharded by the caller, a bidirectional variant: logits, loss and every
gradient (summed over ``cp``) within 1e-5, with ``.backward()`` and ``torch.func.grad``; the
user's model and config untouched; ``explain`` counts the ring's steps; bad input raises on
every rank before any collective."""

import pytest
import torch
from torch.func import grad_and_value

import hp_functional as hpf
from tests.conftest import get_pool
from tests.support.helpers import assert_close, assert_errors, build_hf, make_hf_state, mesh, plan_errors, rank, world
from tests.support.snapshot import assert_unchanged, snapshot

SEQ = 16


def _ids(batch: int = 2, seq: int = SEQ, seed: int = 7):
    return torch.randint(3, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _reference(model, ids, labels):
    model.zero_grad(set_to_none=True)
    ref = model(input_ids=ids, labels=labels)
    ref.loss.backward()
    return ref, {k: p.grad.clone() for k, p in model.named_parameters()}


def _compare(apply_fn, params, info, m, ref, ref_grads, kwargs, cp_axis="cp", extra=None, dp=None):
    """Loss, logits and every gradient (as apply_fn returns them: summed over ``cp`` inside its
    backward; then ``extra`` reductions) vs the reference; with ``dp``, the loss is the mean of the
    dp ranks' losses.  Reducing again over ``cp`` is refused (its ``ReducedOver`` facet)."""
    diffs = {}
    for functional in (False, True):
        if functional:
            grads, loss = grad_and_value(lambda p: apply_fn(p, **kwargs).loss)(params)
        else:
            for p in params.values():
                p.grad = None
            loss = apply_fn(params, **kwargs).loss
            loss.backward()
            grads = {k: p.grad for k, p in params.items()}
        assert all(cp_axis in info[k].axes_of(hpf.ReducedOver) for k in grads), "replicated gradients owed a cp reduction"
        with pytest.raises(hpf.PlanError, match="already summed over mesh axis"):
            hpf.reduce_gradients(grads, info, m, dp_axis=cp_axis, op="sum")
        if extra is not None:
            grads = extra(grads)
        full = hpf.unshard(grads, info)
        loss = loss.detach()
        if dp is not None:
            loss = hpf.collectives.raw_all_reduce(loss, dp) / dp.size
        diffs[f"loss {functional}"] = assert_close(loss, ref.loss.detach(), "loss")
        diffs[f"grads {functional}"] = max(assert_close(full[k], g, f"grad {k}") for k, g in ref_grads.items())
    return diffs


def case_cp(state, strategy: str, layout: str, shape: tuple, names: tuple, loss_parallel: bool = False):
    model = build_hf("llama", state)
    before = snapshot(model)
    m = mesh(shape, names)
    plan = hpf.ShardingPlan.from_hf(model, cp_axis="cp", cp_strategy=strategy, cp_layout=layout,
                                    loss_parallel=loss_parallel)
    apply_fn, params, info = hpf.shard(model, plan, m)
    ids = _ids()
    ref, ref_grads = _reference(model, ids, ids)
    diffs = _compare(apply_fn, params, info, m, ref, ref_grads, dict(input_ids=ids, labels=ids))
    if not loss_parallel:
        logits = apply_fn(params, input_ids=ids).logits
        assert logits.shape[1] == SEQ // m["cp"].size()  # this rank's positions
        diffs["logits"] = assert_close(hpf.cp_unshard(logits.detach(), m, 1, layout=layout), ref.logits.detach(),
                                       "logits")
    model.zero_grad(set_to_none=True)
    assert_unchanged(before, snapshot(model))
    assert model.config._attn_implementation == "eager"  # the user's config keeps its attention
    return diffs


@pytest.mark.parametrize("strategy", ["ring", "allgather"])
def test_llama_cp(pool, strategy):
    diffs = pool.run(case_cp, make_hf_state("llama"), strategy, "zigzag", (pool.world,), ("cp",))
    print(f"cp {pool.world} {strategy}: {diffs[0]}")


def test_llama_cp_contiguous_layout():
    print(get_pool(2).run(case_cp, make_hf_state("llama"), "ring", "contiguous", (2,), ("cp",))[0])


@pytest.mark.parametrize("strategy", ["ring", "allgather"])
def test_llama_cp_times_tp(strategy):
    diffs = get_pool(4).run(case_cp, make_hf_state("llama"), strategy, "zigzag", (2, 2), ("cp", "tp"))
    print(f"cp 2 x tp 2 {strategy}: {diffs[0]}")


def test_llama_cp_times_tp_loss_parallel():
    diffs = get_pool(4).run(case_cp, make_hf_state("llama"), "ring", "zigzag", (2, 2), ("cp", "tp"), True)
    print(f"cp 2 x tp 2, loss parallel: {diffs[0]}")


def case_dp_cp(state):
    """dp 2 × cp 2: each dp rank passes its batch rows already cut for its cp rank (``cp_sharded``)."""
    model = build_hf("llama", state)
    m = mesh((2, 2), ("dp", "cp"))
    apply_fn, params, info = hpf.shard(model, hpf.ShardingPlan.from_hf(model, cp_axis="cp"), m)
    ids = _ids(batch=4)
    ref, ref_grads = _reference(model, ids, ids)
    rows = ids.chunk(2)[m["dp"].get_local_rank()]
    shift = torch.nn.functional.pad(rows, (0, 1), value=-100)[:, 1:]  # shifted over the whole sequence
    kwargs = dict(input_ids=hpf.cp_shard(rows, m, 1), shift_labels=hpf.cp_shard(shift, m, 1), cp_sharded=True)

    def over_dp(grads):
        return hpf.reduce_gradients(grads, info, m, dp_axis="dp", op="mean")

    dp = hpf.collectives.AxisGroup.from_mesh(m, "dp")
    diffs = _compare(apply_fn, params, info, m, ref, ref_grads, kwargs, extra=over_dp, dp=dp)
    with pytest.raises(hpf.PlanError, match="shift_labels"):
        apply_fn(params, input_ids=kwargs["input_ids"], labels=kwargs["input_ids"], cp_sharded=True)
    return diffs


def test_llama_dp_times_cp_presharded():
    """The mean loss of each dp rank's rows is the full-batch mean (equal token counts)."""
    print(get_pool(4).run(case_dp_cp, make_hf_state("llama"))[0])


def case_bidirectional(state, strategy: str):
    """Attention that is not causal (``is_causal=False`` on every attention module): the module's
    own mask is not used, the mask follows the module."""
    model = build_hf("llama", state, attn_implementation="sdpa")
    for layer in model.model.layers:
        layer.self_attn.is_causal = False
    apply_fn, params, info = hpf.shard(model, hpf.ShardingPlan.from_hf(model, cp_axis="cp", cp_strategy=strategy),
                                       mesh((world(),), ("cp",)))
    ids = _ids()
    ref, ref_grads = _reference(model, ids, ids)
    diffs = _compare(apply_fn, params, info, mesh((world(),), ("cp",)), ref, ref_grads, dict(input_ids=ids, labels=ids))
    causal = build_hf("llama", state, attn_implementation="sdpa")(input_ids=ids, labels=ids).loss
    assert (causal - ref.loss).abs() > 1e-3  # the reference really is bidirectional
    return diffs


@pytest.mark.parametrize("strategy", ["ring", "allgather"])
def test_llama_bidirectional(strategy):
    print(get_pool(2).run(case_bidirectional, make_hf_state("llama"), strategy)[0])


def case_explain(strategy: str, m):
    with torch.device("meta"):
        model = build_hf("llama", None)
    e = hpf.explain(model, hpf.ShardingPlan.from_hf(model, cp_axis="cp", cp_strategy=strategy), m, batch=2, seq=SEQ)
    s = e.schedule
    counts = {(op, d): s.count(op=op, direction=d) for op in ("ppermute", "all_gather", "reduce_scatter")
              for d in ("fwd", "bwd")}
    rows = [r for r in s.rows if r.op == "ppermute"]
    return str(e), counts, sorted({r.bytes for r in rows if r.direction == "fwd"}), {r.axis for r in rows}


@pytest.mark.parametrize("strategy", ["ring", "allgather"])
@pytest.mark.slow
def test_explain_shows_ring_steps(strategy):
    """On the fake process group: a meta model, no numbers (the schedule is recorded by the same
    code on real ranks; tests/tools/test_explain.py compares the two)."""
    layers = 2
    for shape, names in (((2,), ("cp",)), ((4,), ("cp",)), ((2, 2), ("cp", "tp"))):
        cp = shape[0]
        text, counts, fwd_bytes, axes = hpf.simulate(lambda m: case_explain(strategy, m), world_size=world_of(shape),
                                                     mesh_shape=shape, mesh_dim_names=names)
        if strategy == "ring":
            assert counts[("ppermute", "fwd")] == layers * (cp - 1), counts
            assert counts[("ppermute", "bwd")] == layers * cp, counts
            kv_heads = 4 // (shape[1] if len(shape) > 1 else 1)
            assert fwd_bytes == [2 * 2 * kv_heads * (SEQ // cp) * 8 * 4], fwd_bytes  # K and V of one chunk
            assert axes == {"cp"} and "ppermute" in text, text
        else:
            assert counts[("ppermute", "fwd")] == counts[("ppermute", "bwd")] == 0, counts
            assert counts[("all_gather", "fwd")] >= layers and counts[("reduce_scatter", "bwd")] >= layers, counts
        print(shape, strategy, counts)


def world_of(shape: tuple) -> int:
    return int(torch.tensor(shape).prod())


def case_bad_input(state):
    model = build_hf("llama", state)
    m = mesh((world(),), ("cp",))
    apply_fn, params, _ = hpf.shard(model, hpf.ShardingPlan.from_hf(model, cp_axis="cp"), m)
    errors = {}
    if rank() == 0:  # one rank alone: a check placed after a collective would hang here
        errors.update(plan_errors({
            "seq": lambda: apply_fn(params, input_ids=_ids(seq=2 * world() + 2)),
            "padding": lambda: apply_fn(params, input_ids=_ids(), attention_mask=torch.ones(2, SEQ).tril()[:2])}))
    errors.update(plan_errors({
        "no attention": lambda: hpf.ShardingPlan.from_hf(torch.nn.Sequential(torch.nn.Linear(2, 2)), cp_axis="cp"),
        "no entry": lambda: hpf.ShardingPlan({"model.norm": hpf.NoParallel()}, axes={"cp": "cp"}),
        "no cp_axis": lambda: hpf.ShardingPlan({"model.layers.*.self_attn": hpf.ContextParallel()}),
        "axis": lambda: hpf.shard(model, hpf.ShardingPlan.from_hf(model, cp_axis="seq"), m),
        "strategy": lambda: hpf.shard(model, hpf.ShardingPlan.from_hf(model, cp_axis="cp", cp_strategy="x"), m),
        "no sdpa": lambda: hpf.shard(model, hpf.ShardingPlan({"model.layers.*.mlp": hpf.ContextParallel()},
                                                            axes={"cp": "cp"}), m)[0](params, input_ids=_ids()),
    }))
    return errors


def test_bad_input_raises_before_any_collective():
    errors = get_pool(2).run(case_bad_input, make_hf_state("llama"))
    assert errors[0]["seq"][0] == "ShapeError" and "not divisible by 4" in errors[0]["seq"][1], errors[0]
    assert "padding" in errors[0]["padding"][1]
    expect = {"no attention": "no attention module", "no entry": "no ContextParallel entry",
              "no cp_axis": "needs the plan's cp_axis", "axis": "'seq' is not in the mesh",
              "strategy": "strategy must be one of", "no sdpa": "no scaled_dot_product_attention"}
    assert_errors(errors, expect)


def case_sliding_window(state):
    """Mistral: a window at least the sequence is causal (matches); a shorter one raises."""
    out = {}
    for window in (SEQ, SEQ // 2):
        model = build_hf("mistral", state, sliding_window=window)
        m = mesh((world(),), ("cp",))
        ids = _ids()
        try:  # a window shorter than the batch's sequence: its probe refused, so nothing proves the plan
            apply_fn, params, info = hpf.shard(model, hpf.ShardingPlan.from_hf(model, cp_axis="cp"), m,
                                               example_inputs=dict(input_ids=ids, labels=ids))
            ref, ref_grads = _reference(model, ids, ids)
            out[window] = _compare(apply_fn, params, info, m, ref, ref_grads, dict(input_ids=ids, labels=ids))
        except hpf.PlanError as e:
            out[window] = str(e)
    return out


def test_mistral_sliding_window():
    out = get_pool(2).run(case_sliding_window, make_hf_state("mistral"))[0]
    assert isinstance(out[SEQ], dict), out
    assert "sliding-window attention (window 8)" in out[SEQ // 2], out
