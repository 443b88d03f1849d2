"""The per-call path: no plan or placement work per call, the params check, and the overhead budget."""

import gc
import sys
import time
import weakref

import pytest
import torch
from torch.func import grad_and_value
from torch.utils._python_dispatch import TorchDispatchMode

import hp_functional as hpf
from hp_functional.compile import build, lint
from hp_functional.core import lowering, placement
from hp_functional.parallel.tensor import styles
from hp_functional.plan import plan
from hp_functional.runtime import boundary, skeleton
from tests.support.helpers import assert_close, mesh
from tests.support.models import build_llama, make_llama_state


def _subclasses(cls: type) -> list[type]:
    return [cls] + [c for sub in cls.__subclasses__() for c in _subclasses(sub)]


# shard()'s phases: none of these may run inside apply_fn, its backward or a torch.func transform
PLAN_WORK = {
    "ShardingPlan.resolve": plan.ShardingPlan.resolve,
    "ShardingPlan.param_rules": plan.ShardingPlan.param_rules,
    "build_program": build.build_program,
    "lint": lint.lint_specs,
    "lower": lowering.lower,
    "local_layout": placement.local_layout,
    "mesh_placements": placement.mesh_placements,
    "slice_local": placement.slice_local,
    "build_skeleton": skeleton.build_skeleton,
    "install_boundary": boundary.install_boundary,
    **{f"{cls.__name__}.spec": cls.spec for cls in _subclasses(styles.Style) if "spec" in vars(cls)},
}


class CallCounter:
    """Counts Python calls into the functions of ``PLAN_WORK`` (by code object, so every alias
    and import of a function is caught) while active on this thread."""

    def __init__(self):
        self.names = {f.__code__: name for name, f in PLAN_WORK.items()}
        self.counts = dict.fromkeys(PLAN_WORK, 0)

    def _profile(self, frame, event, arg):
        if event == "call" and frame.f_code in self.names:
            self.counts[self.names[frame.f_code]] += 1

    def __enter__(self):
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)


def case_no_plan_work_per_call(state, plan_kind: str):
    model = build_llama(state)
    loss_parallel = plan_kind == "loss_parallel"
    the_plan = hpf.llama_sp_plan() if plan_kind == "sp" else hpf.ShardingPlan.from_hf(model, loss_parallel=loss_parallel)
    with CallCounter() as during_shard:
        apply_fn, params, info = hpf.shard(model, the_plan, mesh())
    # the counter sees shard()'s work, so a zero below is not a blind spot
    for name in ("ShardingPlan.resolve", "build_program", "lint", "lower", "local_layout", "mesh_placements", "Colwise.spec"):
        assert during_shard.counts[name] > 0, (name, during_shard.counts)

    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(3))
    loss_fn = lambda p: apply_fn(p, input_ids=ids, labels=ids).loss  # noqa: E731
    with CallCounter() as per_call:
        for _ in range(5):
            out = apply_fn(params, input_ids=ids, labels=ids)
            out.loss.backward()
            grads, loss = grad_and_value(loss_fn)(params)
    assert not any(per_call.counts.values()), {k: n for k, n in per_call.counts.items() if n}

    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    assert_close(loss, ref.loss.detach(), "loss")
    full = hpf.unshard(grads, info)
    for k, p in model.named_parameters():
        assert_close(full[k], p.grad, f"grad {k}")
    return sum(during_shard.counts.values())


@pytest.mark.parametrize("plan_kind", ["hf", "sp", "loss_parallel"])
@pytest.mark.parametrize("pool", [2], indirect=True, ids=["ws2"])  # Python work per call: the same at any world size
@pytest.mark.slow
def test_apply_fn_does_no_plan_work_per_call(pool, plan_kind):
    assert all(n > 0 for n in pool.run(case_no_plan_work_per_call, make_llama_state(), plan_kind))


def case_params_check(state):
    model = build_llama(state)
    apply_fn, params, info = hpf.shard(model, hpf.ShardingPlan.from_hf(model), mesh())
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(4))
    ref = model(input_ids=ids, labels=ids).loss.detach()
    # another key order (e.g. a pytree rebuilt sorted) takes the slow path and gives the same loss
    reordered = dict(sorted(params.items(), reverse=True))
    assert list(reordered) != list(params)
    assert_close(apply_fn(reordered, input_ids=ids).logits, apply_fn(params, input_ids=ids).logits, "reordered logits")
    assert_close(apply_fn(reordered, input_ids=ids, labels=ids).loss, ref, "reordered loss")

    key = "model.layers.1.mlp.up_proj.weight"
    bad = {
        "missing": ({k: v for k, v in params.items() if k != key}, f"missing ['{key}']"),
        "extra": ({**params, "model.extra.weight": params[key]}, "extra ['model.extra.weight']"),
        "shape": ({**params, key: torch.zeros(info[key].global_shape)},
                  f"params['{key}'] has shape {tuple(info[key].global_shape)}, expected local {tuple(info[key].local_shape)}"),
    }
    messages = {}
    for kind, (p, needle) in bad.items():
        with pytest.raises(hpf.PlanError) as err:
            apply_fn(p, input_ids=ids)
        assert needle in str(err.value), str(err.value)
        messages[kind] = str(err.value)
    return messages


def test_params_keys_and_shapes_are_checked(pool):
    """A params pytree with missing or extra keys or a wrong local shape is a PlanError naming
    the key; another key order is accepted and computes the same."""
    assert all(set(m) == {"missing", "extra", "shape"} for m in pool.run(case_params_check, make_llama_state()))


def case_skeleton_keeps_no_caller_tensors(state):
    """Bound parameters are put back to the meta placeholders after every call, even one that
    raises inside the forward, so the skeleton never keeps the caller's tensors alive."""
    model = build_llama(state)
    apply_fn, params, _ = hpf.shard(model, hpf.ShardingPlan.from_hf(model), mesh())
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(6))
    alive = {}
    for label, inputs in (("ok", ids), ("raises", ids.float())):  # float ids: the embedding raises
        fresh = {k: v.detach().clone() for k, v in params.items()}
        refs = [weakref.ref(t) for t in fresh.values()]
        try:
            apply_fn(fresh, input_ids=inputs)
            raised = False
        except RuntimeError:
            raised = True
        del fresh
        gc.collect()
        alive[label] = (raised, sum(r() is not None for r in refs))
    return alive


@pytest.mark.parametrize("pool", [2], indirect=True, ids=["ws2"])  # what the skeleton keeps: the same at any world size
@pytest.mark.slow
def test_skeleton_keeps_no_caller_tensors(pool):
    for alive in pool.run(case_skeleton_keeps_no_caller_tensors, make_llama_state()):
        assert alive == {"ok": (False, 0), "raises": (True, 0)}, alive


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def case_overhead_at_tp1(state, rounds: int):
    """apply_fn on a 1-sized tp axis against the plain model: the aten ops dispatched, and the
    fastest of ``rounds`` interleaved forward+backward calls of each."""
    model = build_llama(state)
    m = mesh((torch.distributed.get_world_size(), 1), ("dp", "tp"))
    apply_fn, params, _ = hpf.shard(model, hpf.ShardingPlan.from_hf(model), m)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(5))

    def plain():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    def functional():
        for p in params.values():
            p.grad = None
        apply_fn(params, input_ids=ids, labels=ids).loss.backward()

    ops = {}
    for name, fn in (("plain", plain), ("functional", functional)):
        with OpCounter() as counter:
            fn()
        ops[name] = counter.ops
    if torch.distributed.get_rank() != 0:  # the other ranks return and sleep on their inbox (a gloo
        return ops, None                      # barrier would spin), so they take no CPU from rank 0
    best = {"plain": float("inf"), "functional": float("inf")}
    for _ in range(rounds):
        for name, fn in (("plain", plain), ("functional", functional)):
            start = time.thread_time()  # CPU time of this thread: preemption by other processes does not count
            fn()
            best[name] = min(best[name], time.thread_time() - start)
    return ops, best["functional"] / best["plain"]


def test_overhead_budget_at_tp1(pool):
    """At a 1-sized tp axis apply_fn adds no per-parameter work: only the vocab-parallel
    embedding's id masking (a fixed handful of ops) beyond the model's own ops, and it costs
    <= 1.15x the plain call (the least CPU time of many interleaved calls, on one rank while
    the others wait: robust to machine load)."""
    (ops, ratio), *others = pool.run(case_overhead_at_tp1, make_llama_state(), 40)
    assert all(o == ops for o, _ in others)
    assert ops["functional"] - ops["plain"] <= 12, ops
    assert ratio <= 1.15, f"apply_fn / model(...) = {ratio:.3f}"
