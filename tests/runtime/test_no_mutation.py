"""shard() and any number of apply_fn calls leave the user's model exactly as it was."""

import pytest
import torch
from torch.func import grad

import hp_functional as hpf
from tests.support.helpers import mesh
from tests.support.models import build_llama, make_llama_state
from tests.support.snapshot import assert_unchanged, snapshot


def case_no_mutation(state):
    model = build_llama(state)
    seen = []
    model.model.layers[0].register_forward_hook(lambda mod, args, out: seen.append(1))
    plan = hpf.ShardingPlan.from_hf(model)
    plan_entries = dict(plan.entries)
    before = snapshot(model)
    apply_fn, params, _ = hpf.shard(model, plan, mesh())
    apply_fn2, params2, _ = hpf.shard(model, hpf.llama_sp_plan(), mesh())
    assert_unchanged(before, snapshot(model))
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        apply_fn(params, input_ids=ids, labels=ids).loss.backward()
        grad(lambda p: apply_fn2(p, input_ids=ids, labels=ids).loss)(params2)
    assert_unchanged(before, snapshot(model))
    assert plan.entries == plan_entries, "the plan object changed"
    # the local shards own their storage: nothing aliases the model's parameters
    model_ptrs = {p.data_ptr() for p in model.parameters()}
    assert not any(p.data_ptr() in model_ptrs for p in params.values())
    # the user's hook is part of the model's behaviour, so it runs inside apply_fn too (on the skeleton)
    assert len(seen) == 4  # 2 iterations x 2 apply_fns
    return True


@pytest.mark.slow
def test_shard_and_apply_mutate_nothing(pool):
    pool.run(case_no_mutation, make_llama_state())
