"""apply_fn called from several threads at once: exact (a skeleton per thread) on a one-rank mesh,
a ReentrancyError at once from any other thread on a multi-rank mesh — never a wrong value, never a hang."""

import functools
import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import hp_functional as hpf
from tests.conftest import get_pool
from tests.support.helpers import mesh
from tests.support.models import build_llama, make_llama_state

THREADS, CALLS = 4, 5


@functools.cache
def own_mesh() -> DeviceMesh:
    """A mesh of this rank alone (a group per rank: new_subgroups is a collective, made once per process)."""
    group, _ = dist.new_subgroups(group_size=1)
    return DeviceMesh.from_group(group, "cpu", mesh_dim_names=("tp",))


def case_threads(state, one_rank: bool):
    """Serial losses and gradients of THREADS * CALLS batches, then the same calls from THREADS
    threads at once (started together): which succeeded, which differ from the serial result,
    which raised what."""
    model = build_llama(state)
    apply_fn, params, _ = hpf.shard(model, hpf.ShardingPlan.from_hf(model), own_mesh() if one_rank else mesh())
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 128, (2, 8), generator=gen) for _ in range(THREADS * CALLS)]

    def step(ids):
        return torch.func.grad_and_value(lambda p: apply_fn(p, input_ids=ids, labels=ids).loss)(params)

    serial = [step(b) for b in batches]
    results, errors = {}, {}
    start = threading.Barrier(THREADS)

    def work(t: int):
        start.wait()
        for i in range(t * CALLS, (t + 1) * CALLS):
            try:
                results[i] = step(batches[i])
            except Exception as exc:  # noqa: BLE001 - reported to the test
                errors[i] = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=work, args=(t,), name=f"worker{t}") for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hangs"
    wrong = [i for i, (grads, loss) in results.items()
             if not torch.equal(loss, serial[i][1]) or any(not torch.equal(grads[k], serial[i][0][k]) for k in grads)]
    # the building thread may still call it afterwards, and gets the serial results
    again = step(batches[0])
    assert torch.equal(again[1], serial[0][1])
    return sorted(results), wrong, errors


@pytest.mark.slow
def test_one_rank_threads_are_exact():
    """A one-rank mesh (as at world size 1; here each rank of the pool has its own): every call
    from every thread equals the serial result."""
    for done, wrong, errors in get_pool(2).run(case_threads, make_llama_state(), True):
        assert not errors and not wrong, (errors, wrong)
        assert done == list(range(THREADS * CALLS))


@pytest.mark.slow
def test_multi_rank_other_threads_are_refused():
    """World size 2 (tp 2): no other thread may call (its collectives could pair with another
    thread's on the other rank), so every call raises ReentrancyError at once, on both ranks."""
    for done, wrong, errors in get_pool(2).run(case_threads, make_llama_state(), False):
        assert done == [] and wrong == []
        assert sorted(errors) == list(range(THREADS * CALLS))
        assert all(e.startswith("ReentrancyError") and "thread 'worker" in e for e in errors.values()), errors


def case_one_other_thread(state):
    """One call from one other thread per rank (they would pair up if allowed): refused at once."""
    model = build_llama(state)
    apply_fn, params, _ = hpf.shard(model, hpf.ShardingPlan.from_hf(model), mesh())
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    outcome = []

    def work():
        try:
            apply_fn(params, input_ids=ids, labels=ids)
            outcome.append("ran")
        except Exception as exc:  # noqa: BLE001 - reported to the test
            outcome.append(f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=work, name="worker-single")
    thread.start()
    thread.join(timeout=60)
    return outcome


def test_multi_rank_refuses_a_single_other_thread():
    """Even one other thread, on every rank alike, is refused: its calls would pair across ranks
    today, but nothing orders them against the building thread's."""
    for outcome in get_pool(2).run(case_one_other_thread, make_llama_state()):
        assert len(outcome) == 1 and outcome[0].startswith("ReentrancyError"), outcome
