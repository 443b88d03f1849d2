"""emulate: every rank in this process on torch's threaded process group, with real numbers.

The same function run by ``hpf.emulate`` and by real gloo ranks gives the same per-rank results,
bit for bit: FSDP over a dp 2 × tp 2 ``shard()`` of a tiny HF Llama (loss and every local
gradient under ``torch.func.grad``), and dp 2 × cp 2 × tp 2 (``from_hf(cp_axis="cp")`` + FSDP over
dp, 8 ranks); both also equal the unsharded model in this process.  Then the other features
inside it, and what it refuses."""

import functools
import os

import pytest
import torch
from torch.func import grad_and_value

import hp_functional as hpf
from tests.conftest import get_pool
from tests.support.helpers import assert_close, build_hf, make_hf_state, mesh

SEQ = 8


def _ids(batch: int, seq: int = SEQ, seed: int = 3):
    return torch.randint(3, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _reference(state, ids):
    """Loss and every gradient of the unsharded model on the global batch."""
    model = build_hf("llama", state)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {k: p.grad for k, p in model.named_parameters()}


def case_fsdp(state, m, cp: bool):
    """FSDP over dp of a ``shard()`` (HF's TP plan on tp; with ``cp``, also context parallel on cp):
    each dp rank's loss on its rows, its local gradients (as ``torch.func.grad`` gives them) and
    the full gradients (``hpf.unshard``)."""
    model = build_hf("llama", state)
    plan = hpf.ShardingPlan.from_hf(model, cp_axis="cp") if cp else hpf.ShardingPlan.from_hf(model)
    apply_fn, params, info = hpf.fsdp(*hpf.shard(model, plan, m), m, "dp")
    rows = _ids(2 * m["dp"].size()).chunk(m["dp"].size())[m["dp"].get_local_rank()]
    grads, loss = grad_and_value(lambda p: apply_fn(p, input_ids=rows, labels=rows, use_cache=False).loss)(params)
    return loss.detach(), _detached(grads), _detached(hpf.unshard(grads, info))


def _detached(tensors: dict) -> dict:
    return {k: t.detach() for k, t in tensors.items()}


def on_gloo(case, state, shape, names, *args):
    """``case`` on a real gloo rank of the pool, on its mesh of ``shape``."""
    return case(state, mesh(shape, names), *args)


def _same_on_both(emulated, gloo) -> None:
    """Per rank: the loss and every local gradient bit for bit."""
    assert len(emulated) == len(gloo)
    for r, ((e_loss, e_grads, _), (g_loss, g_grads, _)) in enumerate(zip(emulated, gloo, strict=True)):
        assert torch.equal(e_loss, g_loss), (r, e_loss, g_loss)
        assert e_grads.keys() == g_grads.keys()
        differ = [k for k in e_grads if not torch.equal(e_grads[k], g_grads[k])]
        assert not differ, f"rank {r}: gradients differ from the gloo rank's: {differ}"


def _equals_reference(state, results, dp: int) -> None:
    """The dp ranks' mean loss and every full gradient equal the unsharded model's."""
    ref_loss, ref_grads = _reference(state, _ids(2 * dp))
    losses = torch.stack([loss for loss, _, _ in results])
    assert_close(losses.mean() if dp > 1 else losses[0], ref_loss, "loss")  # every rank of a dp group agrees
    for _, _, full in results:
        for k, g in ref_grads.items():
            assert_close(full[k], g, f"grad {k}")


def test_fsdp_over_dp_tp_equals_gloo_ranks_bit_for_bit():
    state = make_hf_state("llama")
    shape, names = (2, 2), ("dp", "tp")
    emulated = hpf.emulate(functools.partial(case_fsdp, state, cp=False), shape, names)
    _same_on_both(emulated, get_pool(4).run(on_gloo, case_fsdp, state, shape, names, False))
    _equals_reference(state, emulated, dp=2)


@pytest.mark.slow
def test_fsdp_over_dp_cp_tp_equals_the_unsharded_model():
    """8 ranks in one process: dp 2 × cp 2 × tp 2, context parallel (ring) on cp, HF's TP plan on
    tp, FSDP over dp, against the unsharded model (the gloo comparison is the next test)."""
    state = make_hf_state("llama")
    emulated = hpf.emulate(functools.partial(case_fsdp, state, cp=True), (2, 2, 2), ("dp", "cp", "tp"))
    _equals_reference(state, emulated, dp=2)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("HPF_SWEEP", "0") in ("", "0"),
                    reason="on demand (HPF_SWEEP=1): spawning 8 gloo ranks takes ~90 s on 2 cores")
def test_fsdp_over_dp_cp_tp_equals_gloo_ranks():
    """8 ranks: the same function on 8 real gloo ranks gives every rank's loss and local gradients
    bit for bit (dp 2 × tp 2 is compared in the suite; this is the on-demand sweep's 8-rank case)."""
    state = make_hf_state("llama")
    shape, names = (2, 2, 2), ("dp", "cp", "tp")
    emulated = hpf.emulate(functools.partial(case_fsdp, state, cp=True), shape, names)
    _same_on_both(emulated, get_pool(8).run(on_gloo, case_fsdp, state, shape, names, True))


def make_moe_state():
    """A tiny Mixtral (4 experts, top 2) with experts large enough to matter."""
    torch.manual_seed(0)
    model = build_moe()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name:
                p.normal_(0, 0.1)
    return model.state_dict()


def build_moe(state=None):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("mixtral", vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=8, num_key_value_heads=4, head_dim=8, num_local_experts=4,
                                  num_experts_per_tok=2, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config)
    if state is not None:
        model.load_state_dict(state)
    return model


def case_ep(state, m):
    """Mixtral's experts over ep (``from_hf(ep_axis="ep")``): loss and full gradients."""
    model = build_moe(state)
    apply_fn, params, info = hpf.shard(model, hpf.ShardingPlan.from_hf(model, ep_axis="ep"), m)
    ids = _ids(2)
    grads, loss = grad_and_value(lambda p: apply_fn(p, input_ids=ids, labels=ids).loss)(params)
    return loss.detach(), _detached(hpf.unshard(grads, info))


@pytest.mark.slow
def test_experts_inside_emulate_equal_the_unsharded_model():
    state = make_moe_state()
    model = build_moe(state)
    ids = _ids(2)
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    for loss, full in hpf.emulate(functools.partial(case_ep, state), (2,), ("ep",)):
        assert_close(loss, ref.loss.detach(), "loss")
        for k, p in model.named_parameters():
            assert_close(full[k], p.grad, f"grad {k}")


def case_tools(state, root: str, m):
    """save then load (a folder), explain's schedule and validate's report, on one rank."""
    model = build_hf("llama", state)
    plan = hpf.ShardingPlan.from_hf(model)
    _, params, info = hpf.shard(model, plan, m)
    hpf.save(f"{root}/ckpt", params, info).wait()
    loaded = hpf.load(f"{root}/ckpt", info).params
    same = sorted(k for k in params if torch.equal(loaded[k], params[k]))
    totals = hpf.explain(model, plan, m, batch=2, seq=SEQ).schedule.totals()
    ids = _ids(2)
    report = hpf.validate(model, plan, m, input_ids=ids, labels=ids)
    return same, sorted(params), totals, report.ok


@pytest.mark.slow
def test_save_load_explain_validate_inside_emulate(tmp_path):
    """tp 2: the checkpoint loads back bit for bit; explain counts the closed form of a 2-layer
    Llama (2L+1 all-reduces each way, the logits' all-gather); validate passes."""
    state = make_hf_state("llama")
    for same, keys, totals, ok in hpf.emulate(functools.partial(case_tools, state, str(tmp_path)), (2,), ("tp",)):
        assert same == keys
        act = 2 * SEQ * 64 * 4
        assert totals == {("fwd", "all_reduce", "tp"): (5, 5 * act), ("bwd", "all_reduce", "tp"): (5, 5 * act),
                          ("fwd", "all_gather", "tp"): (1, 2 * SEQ * 128 * 4)}
        assert ok


PP_CFG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, vocab_size=64)


def case_gpipe(state, m):
    model = build_hf("llama", state, **PP_CFG)
    stage = hpf.pipeline_split(model, 2)[m.get_local_rank("pp")]
    apply_fn, params, _ = hpf.shard_stage(model, stage, {}, m)

    def loss_fn(logits, target):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    step = hpf.gpipe(apply_fn, stage, m, loss_fn, 2, hidden_size=PP_CFG["hidden_size"])
    ids = _ids(4) % PP_CFG["vocab_size"]
    return step(params, ids, ids)


def test_pipeline_is_refused_by_name():
    """gpipe sends activations point to point, which the threaded group lacks: a PlanError, at once."""
    with pytest.raises(hpf.PlanError, match="the pipeline .*gpipe.*send/recv"):
        hpf.emulate(functools.partial(case_gpipe, make_hf_state("llama", **PP_CFG)), (2, 1), ("pp", "tp"), timeout=60)


def case_async_save(model, root: str, m):
    _, params, info = hpf.shard(model, {}, m)
    return hpf.save(f"{root}/ckpt", params, info, async_save=True)


def test_async_save_is_refused_by_name(tmp_path):
    model = torch.nn.Linear(2, 2)  # built once, outside: the ranks share it (shard() reads, never writes it)
    with pytest.raises(hpf.PlanError, match="async_save=True cannot run under hpf.emulate"):
        hpf.emulate(functools.partial(case_async_save, model, str(tmp_path)), (2,), ("tp",), timeout=60)


def case_fail_on_rank_1(m):
    if m.get_rank() == 1:
        raise ValueError("rank 1 gives up")
    x = torch.ones(1)
    torch.distributed.all_reduce(x)  # rank 1 never joins: stopped, not hung
    return x


def case_skip_a_collective(m):
    if m.get_rank() == 0:
        torch.distributed.all_reduce(torch.ones(1))
    return m.get_rank()


def test_a_failing_rank_stops_the_others_and_is_raised():
    with pytest.raises(ValueError, match="rank 1 gives up"):
        hpf.emulate(case_fail_on_rank_1, (2,), timeout=60)
    assert not torch.distributed.is_initialized()
    assert hpf.emulate(lambda m: (m.get_rank(), m.mesh_dim_names, torch.distributed.get_world_size()), (2, 2)) == [
        (r, ("dp", "tp"), 4) for r in range(4)]  # and it runs again afterwards


@pytest.mark.slow
def test_a_missing_collective_times_out():
    with pytest.raises(TimeoutError, match=r"ranks \[0\] did not finish in 1s"):
        hpf.emulate(case_skip_a_collective, (2,), timeout=1)
    assert not torch.distributed.is_initialized()


def test_bad_arguments_are_refused():
    with pytest.raises(hpf.PlanError, match="must name every dim"):
        hpf.emulate(lambda m: None, (2, 2), ("tp",))
    with pytest.raises(hpf.PlanError, match="positive sizes"):
        hpf.emulate(lambda m: None, (0,))
    with pytest.raises(hpf.PlanError, match="mesh_dim_names is required"):
        hpf.emulate(lambda m: None, (1, 1, 1, 1))


def test_forward_mode_differentiation_is_refused_by_name():
    """torch keeps forward-AD state per process: ranks running jvp on threads at once corrupt each
    other's (a jacfwd∘jacrev comparison came out wrong with no error), so emulate refuses it."""

    def rank(mesh):
        x = torch.ones(3)
        return torch.func.jvp(torch.sin, (x,), (x,))

    with pytest.raises(hpf.PlanError, match="forward-mode differentiation .* cannot run on emulate's threads"):
        hpf.emulate(rank, (2,), ("tp",))
    grads = hpf.emulate(lambda mesh: torch.func.grad(lambda x: x.sin().sum())(torch.ones(3)), (2,), ("tp",))
    assert all(torch.allclose(g, torch.ones(3).cos()) for g in grads)  # reverse mode runs as before
