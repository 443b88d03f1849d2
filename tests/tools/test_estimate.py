"""explain's per-rank memory estimate (tools/estimate.py): parameters, gradients, optimizer state and
FSDP's rows against closed forms; activations and the peak against a real step's measurement."""

import math

import pytest
import torch

import hp_functional as hpf
from hp_functional.cli.main import main
from hp_functional.tools.estimate import LiveBytes
from hp_functional.tools.models import tiny_config

B, S = 2, 32


def meta_llama(**overrides):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config("llama", **overrides))


def local_rows(config, tp: int, dp: int, dp_index: int) -> int:
    """Elements one rank holds under HF's Llama plan at ``tp``, FSDP-chunked over ``dp`` (torch.chunk's
    sizes: ceil(rows / dp) rows, the last ranks fewer), at position ``dp_index``."""
    c = config
    h, V, ff, L = c.hidden_size, c.vocab_size, c.intermediate_size, c.num_hidden_layers
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    # (rows, columns) of every TP-local leaf: colwise split rows, rowwise columns, norms replicated
    leaves = [(V // tp, h), (V // tp, h), (h, 1)]  # embedding (vocab rows), lm_head (colwise), final norm
    leaves += L * [(q // tp, h), (kv // tp, h), (kv // tp, h), (h, q // tp), (ff // tp, h), (ff // tp, h),
                   (h, ff // tp), (h, 1), (h, 1)]

    def mine(rows: int) -> int:
        chunk = -(-rows // dp)
        return max(0, min(chunk, rows - dp_index * chunk))

    return sum(mine(r) * cols for r, cols in leaves)


@pytest.mark.parametrize("rank", [0, pytest.param(3, marks=pytest.mark.slow)])
def test_parameters_gradients_optimizer_and_fsdp_rows_match_closed_forms(rank):
    """An odd vocabulary (130: 65 rows per tp rank) makes FSDP's rows uneven: 33 on dp rank 0, 32 on dp rank 1."""
    config = tiny_config("llama", vocab_size=130)
    model = meta_llama(vocab_size=130)
    plan = hpf.ShardingPlan.from_hf(model)
    tp_only = hpf.simulate(lambda m: hpf.explain(model, plan, m, batch=B, seq=S).memory, world_size=2)
    p = local_rows(config, 2, 1, 0) * 4
    assert tp_only.per_rank == p
    step = tp_only.step
    assert (step.parameters, step.gradients, step.optimizer) == (p, p, 2 * p + 8)  # mu, nu; the int64 step
    assert step.peak >= p + p + 2 * p + step.activations and step.peak == max(step.peak_backward, step.peak_update)
    assert step.inputs == B * S * 8  # input_ids (labels are the same tensor)
    m = hpf.simulate(lambda mesh: hpf.explain(model, plan, mesh, batch=B, seq=S, fsdp=True, optimizer="sgd").memory,
                     world_size=4, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"), rank=rank)
    f, padded = local_rows(config, 2, 2, rank // 2) * 4, local_rows(config, 2, 2, 0) * 4
    # a rank with fewer rows gets its gradients as views of the padded reduce-scatter output, which they keep alive
    assert m.per_rank == f and (m.step.parameters, m.step.gradients, m.step.optimizer) == (f, padded, 8)
    assert m.optimizer == "sgd" and "optimizer state (sgd)" in str(m)
    assert (rank == 0) == (f > p / 2)  # dp rank 0 holds the larger chunk


@pytest.mark.slow
def test_remat_keeps_only_the_blocks_inputs():
    model = meta_llama()
    plan = hpf.ShardingPlan.from_hf(model)
    c = model.config

    def both(mesh):
        return [hpf.explain(model, plan, mesh, batch=B, seq=S, remat=r).memory.step for r in (None, True)]

    plain, remat = hpf.simulate(both, world_size=2)
    hidden = B * S * c.hidden_size * 4
    assert [n for _, n in remat.blocks] == [hidden] * c.num_hidden_layers  # each block's output: the next one's input
    assert [b for b, _ in plain.blocks] == [f"model.layers.{i}" for i in range(c.num_hidden_layers)]
    assert all(n > 10 * hidden for _, n in plain.blocks)
    assert remat.activations < plain.activations / 2


@pytest.mark.slow
def test_estimate_equals_a_real_step_on_every_rank():
    """The estimate (fake tensors) against one real step on each rank (``hpf.emulate``): the peak of
    live storages, and the activations against an independent count, the distinct non-parameter
    storages autograd saves (``saved_tensors_hooks``), within 15 %."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    meta = meta_llama()
    ids = torch.randint(0, 128, (B, S), generator=torch.Generator().manual_seed(1))
    results = {}
    for remat in (None, True):
        est = hpf.simulate(lambda m, r=remat: hpf.explain(meta, hpf.ShardingPlan.from_hf(meta), m, batch=B, seq=S,
                                                          remat=r).memory.step, world_size=2)

        def step(mesh, r=remat):
            apply_fn, params, _ = hpf.shard(model, hpf.ShardingPlan.from_hf(model), mesh, remat=r)
            params = {k: v.detach().requires_grad_() for k, v in params.items()}
            opt, live = hpf.optim.adamw(), LiveBytes()
            live.add((params, ids))
            with live, torch.no_grad():
                state = opt.init(params)
            keep = {v.untyped_storage()._cdata for v in params.values()}
            saved = {}

            def pack(t):
                if torch._C._current_graph_task_id() == -1 and t.untyped_storage()._cdata not in keep:
                    saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
                return t

            with live, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = apply_fn(params, input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                del loss
            with live, torch.no_grad():
                opt.update({k: v.grad for k, v in params.items()}, state, params)
            return live.peak, sum(saved.values())

        results[remat] = (est, hpf.emulate(step, (2,), ("tp",)))
    for est, ranks in results.values():
        for peak, saved in ranks:
            assert math.isclose(est.peak, peak, rel_tol=0.15), (est.peak, peak)
            assert math.isclose(est.activations, saved, rel_tol=0.15), (est.activations, saved)


@pytest.mark.slow
def test_cli_fit_exit_status(capsys):
    args = ["plan", "llama", "--tp", "2", "--dp", "2", "--fsdp", "--remat", "--seq", "16", "--brief"]
    assert main([*args, "--fit", "1"]) == 0
    out = capsys.readouterr().out
    assert "fits: peak" in out and "optimizer state (adamw)" in out and "activations at the end" in out
    assert main([*args, "--fit", "0.0001"]) == 1
    assert "does not fit: peak" in capsys.readouterr().out
    assert main(["plan", "llama", "--tp", "2", "--fsdp"]) == 2
    assert "--fsdp shards over the dp axis" in capsys.readouterr().err
