"""Run-time agreement across ranks: apply_fn's inputs on the axes that replicate them, the gradients'
structure in clip_grad_norm / reduce_gradients, and bounded waits (hpf.set_timeout).  Every
disagreement is a Python exception on every rank, within a bounded time — never a gloo abort,
a silently wrong loss or norm, or collectives paired across calls."""

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import hp_functional as hpf
from hp_functional.runtime import inputs
from tests.conftest import get_pool
from tests.support.helpers import assert_close, mesh, rank
from tests.support.models import build_llama, make_llama_state


def _error(fn, *args, **kwargs) -> str | None:
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"{type(exc).__name__}: {exc}"
    return None


def _exchanges() -> list[int]:
    """A counter of input-agreement exchanges (store round trips) made by this rank, from now on."""
    count = [0]
    original = inputs._exchange

    def counted(*args):
        count[0] += 1
        return original(*args)

    inputs._exchange = counted
    return count


# ------------------------------------------------------------------ apply_fn's inputs
def case_inputs(state):
    model = build_llama(state)
    apply_fn, params, _ = hpf.shard(model, hpf.ShardingPlan.from_hf(model), mesh())
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (2, 16), generator=gen)
    count, original = _exchanges(), inputs._exchange
    try:
        out = {}
        # 2 x 16 on rank 0, 4 x 8 on the others, on the first call (new on every rank: a shape agreed
        # before is trusted, see case_cached_versus_new)
        odd = ids if rank() == 0 else ids.reshape(4, 8)
        out["batch"] = _error(apply_fn, params, input_ids=odd, labels=odd)
        loss = apply_fn(params, input_ids=ids, labels=ids).loss
        for _ in range(3):  # steady state: no exchange, same loss
            assert torch.equal(apply_fn(params, input_ids=ids, labels=ids).loss, loss)
        out["steady"] = count[0] - 1
        # sequence length differing across tp ranks (both new): every rank raises before any collective
        seq = ids[:, : 8 + 4 * rank()]
        out["seq"] = _error(apply_fn, params, input_ids=seq, labels=seq)
        # the same under torch.func.grad
        out["grad"] = _error(torch.func.grad(lambda p: apply_fn(p, input_ids=seq, labels=seq).loss), params)
        # same shapes, different token ids: silent without the value check, an error with it
        other = (ids + rank()) % 128
        out["values_off"] = _error(apply_fn, params, input_ids=other, labels=other)
        apply_fn.input_check.values = True
        out["values_on"] = _error(apply_fn, params, input_ids=other, labels=other)
        out["values_same"] = _error(apply_fn, params, input_ids=ids, labels=ids)
        apply_fn.input_check.values = False
        # HPF_CHECK_INPUTS=1 switches the value check on for apply_fns built from then on
        os.environ["HPF_CHECK_INPUTS"] = "1"
        try:
            checked, params2, _ = hpf.shard(model, hpf.ShardingPlan.from_hf(model), mesh())
        finally:
            del os.environ["HPF_CHECK_INPUTS"]
        out["env"] = _error(checked, params2, input_ids=other, labels=other)
        before = count[0]
        assert torch.equal(apply_fn(params, input_ids=ids, labels=ids).loss, loss), "still agreed, still exact"
        out["after"] = count[0] - before
        return out
    finally:
        inputs._exchange = original


def test_inputs_that_differ_across_tp_ranks_raise_on_every_rank():
    for out in get_pool(2).run(case_inputs, make_llama_state()):
        assert out["steady"] == 1, "one exchange for the first signature, none after"
        for case in ("seq", "batch", "grad"):
            assert out[case].startswith("InputMismatchError") and "mesh axis 'tp'" in out[case], out[case]
            assert "argument 'input_ids'" in out[case] and "on ranks [0]" in out[case], out[case]
        assert "shape (2, 8)" in out["seq"] and "shape (2, 12)" in out["seq"]
        assert "shape (2, 16)" in out["batch"] and "shape (4, 8)" in out["batch"]
        assert out["values_off"] is None, "values are only compared behind the switch"
        assert out["values_on"].startswith("InputMismatchError") and "values crc" in out["values_on"], out["values_on"]
        assert out["values_same"] is None and out["env"].startswith("InputMismatchError"), out
        assert out["after"] == 0


class ScaledMLP(torch.nn.Module):
    """A colwise/rowwise pair whose forward takes a plain float."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x, scale: float = 1.0):
        return self.down(torch.relu(self.up(x)) * scale)


def test_scalar_arguments_that_differ_across_tp_ranks_raise_on_every_rank():
    """A plain float is compared by value, not by type: after a call with the same ``scale`` everywhere
    (its signature agreed and remembered), ranks passing different floats, each new to its rank
    (positionally, by keyword, an int against a float), raise ``InputMismatchError`` on every rank
    naming the argument and each rank's value; equal scalars still give the unsharded output.
    (A rank repeating an agreed signature while another's is new: ``case_cached_versus_new``.)"""
    torch.manual_seed(0)
    model, x = ScaledMLP(), torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    ref = model(x, 0.5)

    def rank(m):
        apply_fn, params, _ = hpf.shard(model, {"up": hpf.Colwise(), "down": hpf.Rowwise()}, m, verify=False)
        r = m.get_local_rank("tp")
        out = {"agreed": apply_fn(params, x, 0.5)}
        out["positional"] = _error(apply_fn, params, x, [0.25, 0.75][r])
        out["keyword"] = _error(apply_fn, params, x, scale=[0.25, 0.75][r])
        out["int"] = _error(apply_fn, params, x, scale=[1, 2.0][r])
        out["after"] = apply_fn(params, x, scale=0.5)
        return out

    for out in hpf.emulate(rank, (2,), ("tp",), timeout=120):
        for case in ("positional", "keyword", "int"):
            error = out[case]
            assert error is not None and error.startswith("InputMismatchError"), (case, error)
            assert "argument 'scale'" in error and "mesh axis 'tp'" in error, (case, error)
        for case in ("positional", "keyword"):
            assert "value 0.25 on ranks [0]" in out[case] and "value 0.75 on ranks [1]" in out[case], out[case]
        assert "value 1 on ranks [0]" in out["int"] and "value 2.0 on ranks [1]" in out["int"], out["int"]
        assert_close(out["agreed"], ref, "output")
        assert_close(out["after"], ref, "output after the refusals")


# ------------------------------------------------------------------ gradients' structure
def case_grad_structure(state):
    model = build_llama(state)
    m = mesh((dist.get_world_size(),), ("dp",))
    apply_fn, params, info = hpf.shard(model, {}, m)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(rank()))
    grads = torch.func.grad(lambda p: apply_fn(p, input_ids=ids, labels=ids).loss)(params)
    key = "model.norm.weight"
    out = {}
    one_none = {k: (None if k == key and rank() == 1 else g) for k, g in grads.items()}
    out["clip_none"] = _error(hpf.clip_grad_norm, one_none, info, 1.0)
    out["reduce_none"] = _error(hpf.reduce_gradients, one_none, info, m)
    missing = {k: g for k, g in grads.items() if not (k == key and rank() == 1)}
    out["clip_missing"] = _error(hpf.clip_grad_norm, missing, info, 1.0)  # rank 1 catches its error and goes on
    out["reduce_missing"] = _error(hpf.reduce_gradients, missing, info, m)
    # the collectives stay aligned: the next calls are exact (None on every rank alike is fine)
    alike = {k: (None if k == key else g) for k, g in grads.items()}
    _, norm = hpf.clip_grad_norm(alike, info, 1.0)
    hpf.reduce_gradients(alike, info, m)
    local = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in alike.values() if g is not None]))
    out["norm"] = (float(norm), float(local))  # replicated on dp: rank 0's gradients count (owner masking)
    return out


def test_a_none_or_missing_gradient_on_one_rank_raises_on_every_rank():
    outs = get_pool(2).run(case_grad_structure, make_llama_state())
    for out in outs:
        for case in ("clip_none", "reduce_none"):
            assert out[case].startswith("PlanError") and "grads['model.norm.weight']" in out[case], out[case]
            assert "None on ranks [1]" in out[case] and "grad on ranks [0]" in out[case], out[case]
        for case in ("clip_missing", "reduce_missing"):
            assert out[case].startswith("PlanError"), out[case]
            assert "failed the local checks on ranks [1]" in out[case] or "missing from grads" in out[case], out[case]
    norms = [out["norm"] for out in outs]
    assert norms[0][0] == norms[1][0] and abs(norms[0][0] - norms[0][1]) < 1e-5 * norms[0][1], norms


# ------------------------------------------------------------------ bounded waits
def _fresh_tp_mesh() -> DeviceMesh:
    """A 1-D mesh over a process group of its own, so that a timed-out collective leaves the pool's
    default group usable."""
    group = dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=120))
    return DeviceMesh.from_group(group, "cpu", mesh_dim_names=("tp",))


def case_stuck_rank(state, seconds: float):
    """Rank 1 alive but stuck (sleeping) while rank 0 calls apply_fn: rank 0 raises within the timeout."""
    model = build_llama(state)
    m = _fresh_tp_mesh()
    apply_fn, params, _ = hpf.shard(model, hpf.ShardingPlan.from_hf(model), m)
    hpf.set_timeout(seconds, m)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    apply_fn(params, input_ids=ids, labels=ids)  # agreed and exact while both take part
    start = time.monotonic()
    if rank() == 1:
        time.sleep(3 * seconds)
        return None, time.monotonic() - start
    return _error(apply_fn, params, input_ids=ids, labels=ids), time.monotonic() - start


def case_cached_versus_new(state, seconds: float):
    """Rank 0 repeats an agreed batch shape, rank 1 brings a new one: rank 1 waits for an input
    agreement rank 0 skips, rank 0 for a collective rank 1 never issues: both raise in bounded time."""
    model = build_llama(state)
    m = _fresh_tp_mesh()
    apply_fn, params, _ = hpf.shard(model, hpf.ShardingPlan.from_hf(model), m)
    hpf.set_timeout(seconds, m)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    apply_fn(params, input_ids=ids, labels=ids)
    start = time.monotonic()
    odd = ids if rank() == 0 else ids.reshape(4, 4)
    return _error(apply_fn, params, input_ids=odd, labels=odd), time.monotonic() - start


@pytest.mark.slow
def test_a_stuck_or_out_of_step_rank_makes_the_others_raise_within_the_timeout():
    pool = get_pool(2)
    (error, elapsed), (_, slept) = pool.run(case_stuck_rank, make_llama_state(), 2.0, timeout=60)
    assert error is not None and error.startswith("CollectiveError"), error
    assert "over mesh axis 'tp' (2 ranks)" in error and "[module 'model." in error and "2s" in error, error
    assert 1.5 < elapsed < 2.0 + 4.0, elapsed
    results = pool.run(case_cached_versus_new, make_llama_state(), 2.0, timeout=60)
    (error0, elapsed0), (error1, elapsed1) = results
    assert error0.startswith("CollectiveError"), error0
    assert error1.startswith("InputMismatchError") and "did not all check their inputs" in error1, error1
    assert max(elapsed0, elapsed1) < 2.0 + 4.0, (elapsed0, elapsed1)


def test_set_timeout_refuses_what_is_not_a_positive_number():
    """``True`` is an int to Python, not a timeout of one second."""
    for bad in (True, 0, -1.0, "5"):
        with pytest.raises(ValueError, match="seconds must be a positive number"):
            hpf.set_timeout(bad)
