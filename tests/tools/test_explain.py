"""explain: the measured communication schedule and per-rank memory against closed-form counts."""

import pytest
import torch
from torch.distributed.tensor import Shard

import hp_functional as hpf
from hp_functional import explain, simulate
from hp_functional.tools.models import tiny_config
from tests.support.helpers import build_hf, mesh
from tests.support.models import MLP, PLANS

B, S = 2, 8  # batch and sequence of the example inputs


def case_explain(sp: bool, m=None):
    """Explain the HF (Megatron TP) or the SP plan of the tiny Llama on mesh ``m`` (default: all ranks)."""
    torch.manual_seed(0)  # the same weights on every rank (shard() checks under a real process group)
    model = build_hf("llama")
    plan = hpf.llama_sp_plan() if sp else hpf.ShardingPlan.from_hf(model)
    e = explain(model, plan, m or mesh(), batch=B, seq=S)
    return e.schedule.totals(), [(r.module, r.direction, r.op) for r in e.schedule.rows], e.memory, str(e)


def closed_form(n: int, sp: bool) -> dict:
    """Megatron TP/SP collectives of one step for a Llama block stack, from the config alone.

    Without SP: forward one all-reduce after attention and one after the MLP per block (plus the
    vocab-parallel embedding's, plus the all-gather of the logits); backward one all-reduce per
    block input (q, k and v share one, as do gate and up: the same input tensor entering
    rank-varying compute is converted once per call) and one for the head's input.  With SP: an
    all-gather entering and a reduce-scatter leaving attention and the MLP, their transposes in the
    backward, the split at layer 0 (all-gather in the backward) and the norm weights' gradients,
    summed by one bucketed all-reduce."""
    c = tiny_config("llama")
    L, h, V, f32 = c.num_hidden_layers, c.hidden_size, c.vocab_size, 4
    act, logits = B * S * h * f32, B * S * V * f32
    if not sp:
        return {("fwd", "all_reduce", "tp"): (2 * L + 1, (2 * L + 1) * act),
                ("fwd", "all_gather", "tp"): (1, logits),
                ("bwd", "all_reduce", "tp"): (2 * L + 1, (2 * L + 1) * act)}
    norms = 2 * L + 1
    return {("fwd", "all_reduce", "tp"): (1, act),  # the embedding's partial rows
            ("fwd", "all_gather", "tp"): (2 * L + 2, (2 * L + 1) * act + logits),  # attn, mlp, head input; logits
            ("fwd", "reduce_scatter", "tp"): (2 * L, 2 * L * act),
            ("bwd", "all_gather", "tp"): (2 * L + 1, (2 * L + 1) * act),  # o/down transposes + layer 0's split
            ("bwd", "reduce_scatter", "tp"): (2 * L + 1, (2 * L + 1) * act),
            ("bwd", "all_reduce", "tp"): (1, norms * h * f32)}  # one bucket: every norm weight


def param_bytes(n: int) -> tuple[int, int]:
    """(sharded bytes per rank, replicated bytes) of the tiny Llama, from the config."""
    c = tiny_config("llama")
    L, h, V, ff = c.num_hidden_layers, c.hidden_size, c.vocab_size, c.intermediate_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    sharded = 2 * V * h + L * (h * q + 2 * h * kv + q * h + 3 * h * ff)
    return sharded * 4 // n, (2 * L + 1) * h * 4


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.slow
def test_schedule_totals_match_closed_form(world, sp):
    """On the fake process group (one process): any world size, nothing allocated."""
    totals, rows, memory, text = simulate(lambda m: case_explain(sp, m), world_size=world)
    assert totals == closed_form(world, sp)
    assert memory.world == world and (memory.sharded, memory.replicated) == param_bytes(world)
    assert memory.unsharded == memory.sharded * world + memory.replicated
    fwd = [m for m, d, _ in rows if d == "fwd"]
    assert fwd[0] == "model.embed_tokens" and fwd[-1] == "lm_head"  # execution order
    assert fwd.index("model.layers.0.self_attn.o_proj" if not sp else "model.layers.0.self_attn") < fwd.index(
        "model.layers.1.mlp.down_proj")
    bwd = [m for m, d, _ in rows if d == "bwd"]
    if sp:  # the sequence-parallel norms' gradients: one bucketed all-reduce over the replicated parameters
        assert {m for m, d, op in rows if d == "bwd" and op == "all_reduce"} == {"(parameters)"}
        assert ("model.layers.0.self_attn", "bwd", "reduce_scatter") in rows
    else:
        assert bwd[0] == "lm_head" and bwd[-1] == "model.layers.0.self_attn.q_proj"
    assert "communication schedule" in text and "memory per rank" in text
    assert ("fwd all_gather(1)" if sp else "fwd all_gather(-1)") in text  # render()'s lowered steps


@pytest.mark.parametrize("partial_exit", [False, True], ids=["regions", "partial_exit"])
@pytest.mark.parametrize("world", [2, 4])
def test_megatron_regions(world, partial_exit):
    """Attention and the MLP as regions: the backward all-reduces each block's input once (plus,
    when the block leaves replicated, once at o_proj/down_proj, whose gradient arrives kept on
    rank 0); with Megatron's g (partial exit) exactly one per block — 2L+1 with the head's input."""

    def run(m):
        model = build_hf("llama")
        return explain(model, hpf.megatron_plan(model, partial_exit), m, batch=B, seq=S).schedule.totals()

    c = tiny_config("llama")
    L, act = c.num_hidden_layers, B * S * c.hidden_size * 4
    n = 2 * L + 1 if partial_exit else 4 * L + 1
    expected = closed_form(world, sp=False)
    expected[("bwd", "all_reduce", "tp")] = (n, n * act)
    assert simulate(run, world_size=world) == expected


@pytest.mark.slow
def test_dtype_loss_parallel_and_plain_modules():
    """In one process (fake process group): bf16 halves every byte count; loss-parallel
    collectives are listed under the root module (their Local entry); a non-HF module with positional inputs."""

    def run(m):
        model = build_hf("llama")
        f32 = explain(model, hpf.ShardingPlan.from_hf(model), m, batch=B, seq=S)
        bf16 = explain(model, hpf.ShardingPlan.from_hf(model), m, batch=B, seq=S, dtype=torch.bfloat16)
        lp = explain(model, hpf.ShardingPlan.from_hf(model, loss_parallel=True), m, batch=B, seq=S)
        mlp = explain(MLP(), PLANS["sp"], m, torch.randn(B, S // 2, 16))
        static = explain(MLP(), PLANS["tp"], m)
        return f32, bf16, lp, mlp, static

    f32, bf16, lp, mlp, static = simulate(run, world_size=2)
    assert bf16.schedule.total_bytes() * 2 == f32.schedule.total_bytes() > 0
    assert bf16.memory.per_rank * 2 == f32.memory.per_rank
    loss = lp.schedule.select(direction="fwd")
    assert [r.op for r in loss if r.module == ""] == ["all_gather", "all_reduce", "all_reduce"]
    assert lp.schedule.count("all_gather", "fwd") == 1  # the logits are never gathered
    # SP MLP on (2, 4, 16) local rows: all-gather in (2*8*16*4 bytes), reduce-scatter out, transposes back
    full = B * S * 16 * 4
    assert mlp.schedule.totals() == {("fwd", "all_gather", "tp"): (1, full), ("fwd", "reduce_scatter", "tp"): (1, full),
                                     ("bwd", "all_gather", "tp"): (1, full), ("bwd", "reduce_scatter", "tp"): (1, full),
                                     ("bwd", "all_reduce", "tp"): (1, 2 * 16 * 4)}  # norm weight and bias: one bucket
    assert [r.module for r in mlp.schedule.rows[:2]] == ["up", "down"]
    assert static.schedule is None and "no schedule" in str(static) and static.memory.replicated == 16 * 4 * 3


def test_schedule_error_is_reported_not_raised():
    """A forward that cannot run on the given shapes leaves the static parts (memory) intact."""

    def run(m):
        plan = {"up": hpf.Colwise(), "down": hpf.Rowwise(output_layout=Shard(1))}
        return explain(MLP(), plan, m, torch.randn(2, 3, 16))  # 3 rows do not reduce-scatter over 2 ranks

    e = simulate(run, world_size=2)
    assert e.schedule is None and "could not run" in e.schedule_error and e.memory.sharded > 0


@pytest.mark.slow
def test_real_gloo_ranks_measure_the_same_schedule():
    """On 2 gloo ranks (the rank pool's; shard() agrees across them for real): the same totals."""
    from tests.conftest import get_pool

    results = get_pool(2).run(case_explain, True)
    assert [r[0] for r in results] == [closed_form(2, True)] * 2
