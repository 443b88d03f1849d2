"""Functional FSDP (``hpf.fsdp``) over ``shard()``: 20 AdamW steps of FSDP × TP (dp 2 × tp 2), of
FSDP alone (dp 2) and of DP × TP (``hpf.reduce_gradients``) equal the unsharded model
trained on the global batch, under ``.backward()`` with gradient accumulation and under
``torch.func.grad`` with the functional AdamW; collectives per step equal the closed form; peak
parameter memory is bounded; mixed precision; activation checkpointing; torch.compile; bad input."""

import contextlib
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.func import grad_and_value
from torch.utils._python_dispatch import TorchDispatchMode

import hp_functional as hpf
from hp_functional.train import fsdp as fsdp_module
from tests.support.helpers import assert_close, mesh
from tests.support.models import build_llama, make_llama_state

STEPS = 20
LR = 1e-3


def _setup(state, world: int, cfg: dict | None = None, **fsdp_kw):
    """(model, (apply_fn, params, shard_info), mesh, dp mesh): FSDP × TP at 4 ranks, FSDP alone at 2."""
    model = build_llama(state, **(cfg or {}))
    if world == 4:
        m = mesh((2, 2), ("dp", "tp"))
        sharded = hpf.shard(model, hpf.ShardingPlan.from_hf(model), m)
    else:
        m = mesh((world,), ("dp",))
        sharded = hpf.shard(model, {}, m)
    return model, hpf.fsdp(*sharded, m, "dp", **fsdp_kw), m, m["dp"]


def _batch(dp, seed: int = 0):
    ids = torch.randint(0, 128, (2 * dp.size(), 8), generator=torch.Generator().manual_seed(seed))
    return ids, ids.chunk(dp.size())[dp.get_local_rank()]


def _dp_mean(x, dp):
    x = x.detach().clone()
    dist.all_reduce(x, group=dp.get_group())
    return x / dp.size()


def _reduced(counted, dp) -> dict[str, int]:
    group = dp.get_group().group_name
    return {op: n for (op, g), n in counted.counts.items() if g == group}


def case_train(state, world: int, kind: str, func: bool):
    """20 AdamW steps on the global batch's dp slices.  ``torch.func.grad`` steps the functional
    AdamW on a single batch; ``.backward()`` steps ``torch.optim.AdamW`` on two micro-batches
    accumulated with one reduction per step (FSDP: ``no_sync``; DP: reduce the summed grads once)."""
    model = build_llama(state)
    m = mesh((2, 2), ("dp", "tp")) if world == 4 else mesh((world,), ("dp",))
    apply_fn, params, info = hpf.shard(model, hpf.ShardingPlan.from_hf(model) if world == 4 else {}, m)
    if kind == "fsdp":
        apply_fn, params, info = hpf.fsdp(apply_fn, params, info, m, "dp")  # resharding after forward
    dp = m["dp"]
    params = {k: p.detach().requires_grad_(not func) for k, p in params.items()}  # the update records no history
    # lr 1e-3, a usual one: Adam's normalised steps turn a 1e-7 gradient difference on a near-zero
    # entry into a step-sized one, so the parameter tolerance (1e-4) scales with lr
    opt = hpf.optim.adamw(LR, weight_decay=0.01)
    opt_state = opt.init(params)
    torch_opt = torch.optim.AdamW(params.values(), lr=LR, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    worst = 0.0
    for step in range(STEPS):
        ids, local = _batch(dp, step)

        def loss_of(p, x):
            return apply_fn(p, input_ids=x, labels=x, use_cache=False).loss

        if func:
            grads, loss = grad_and_value(loss_of)(params, local)
            if kind == "dp":
                grads = hpf.reduce_gradients(grads, info, m)
            with torch.no_grad():
                params, opt_state = opt.update(grads, opt_state, params)
        else:
            torch_opt.zero_grad()
            first, second = local.chunk(2)
            with Collectives(enabled=step == 0) as counted:  # counted once: a Python mode slows every op
                with apply_fn.fsdp.no_sync() if kind == "fsdp" else contextlib.nullcontext():
                    loss = loss_of(params, first) / 2
                    loss.backward()
                assert "reduce_scatter_tensor" not in _reduced(counted, dp), "no_sync reduce-scattered"
                last = loss_of(params, second) / 2
                last.backward()
                loss = loss.detach() + last.detach()
                if kind == "dp":
                    reduced = hpf.reduce_gradients({k: p.grad for k, p in params.items()}, info, m)
                    for k, p in params.items():
                        p.grad = reduced[k]
            reductions = _reduced(counted, dp)
            if step > 0:
                pass
            elif kind == "fsdp":
                assert reductions["reduce_scatter_tensor"] == len(apply_fn.fsdp.groups), reductions
            else:
                # one bucket, once per step, after the small all-gather agreeing on the gradients' structure
                assert reductions == {"all_gather_into_tensor": 1, "all_reduce": 1}, reductions
            torch_opt.step()
        ref_opt.zero_grad()
        if func:
            ref = model(input_ids=ids, labels=ids, use_cache=False).loss
            ref.backward()
        else:  # the same two micro-batches (every dp rank's first rows, then its second), accumulated
            ref = 0.0
            for x in (ids[0::2], ids[1::2]):
                half = model(input_ids=x, labels=x, use_cache=False).loss / 2
                half.backward()
                ref = ref + half
        ref_opt.step()
        worst = max(worst, assert_close(_dp_mean(loss, dp), ref.detach(), f"loss at step {step}"))
    full = hpf.unshard({k: p.detach() for k, p in params.items()}, info)
    for k, p in model.named_parameters():
        assert_close(full[k], p.detach(), f"{k} after {STEPS} AdamW steps", atol=1e-4, rtol=1e-4)
    return worst


@pytest.mark.parametrize("func", [False, True], ids=["backward+accumulation", "torch.func.grad+hpf.optim"])
@pytest.mark.parametrize("pool,kind", [(4, "fsdp"), (4, "dp"), (2, "fsdp")], indirect=["pool"],
                         ids=["ws4-fsdp", "ws4-dp", "ws2-fsdp"])
@pytest.mark.slow
def test_trains_like_the_unsharded_model(pool, kind, func):
    """FSDP x TP and DP x TP at 4 ranks (dp 2 x tp 2), FSDP alone at 2 ranks (DP alone is
    ``tests/train/test_clip_dp.py``'s one-step case)."""
    worst = pool.run(case_train, make_llama_state(), pool.world, kind, func)
    print(f"{kind} world {pool.world}: max |loss - unsharded| over {STEPS} steps {max(worst):.2e}")


def test_shard_info_facets():
    """What a parallelism records of a leaf is one field of facets, one per type, in a fixed
    order."""
    base = hpf.ShardInfo((), None, torch.Size((4,)), torch.Size((2,)), (0,))
    one = base.with_facet(hpf.ReducedOver, hpf.ReducedOver(("cp",))).with_facet(hpf.SummedOver, hpf.SummedOver(("ep",)))
    other = base.with_facet(hpf.SummedOver, hpf.SummedOver(("ep",))).with_facet(hpf.ReducedOver, hpf.ReducedOver(("cp",)))
    assert one == other and one.axes_of(hpf.SummedOver) == ("ep",) and one.facet(hpf.RowSplit) is None
    assert one.with_facet(hpf.SummedOver, None).facets == (hpf.ReducedOver(("cp",)),)
    with pytest.raises(TypeError, match="is not a SummedOver"):
        base.with_facet(hpf.SummedOver, hpf.ReducedOver(("cp",)))


class Collectives(TorchDispatchMode):
    """Counts the functional collectives by op and process group (a count, not a timing)."""

    def __init__(self, enabled: bool = True):
        super().__init__()
        self.counts: dict[tuple[str, str], int] = {}
        self.dtypes: set[torch.dtype] = set()
        self.enabled = enabled

    def __enter__(self):
        return super().__enter__() if self.enabled else self

    def __exit__(self, *exc):
        return super().__exit__(*exc) if self.enabled else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"):
            key = (name, args[-1])
            self.counts[key] = self.counts.get(key, 0) + 1
            self.dtypes.add(args[0].dtype)
        return func(*args, **(kwargs or {}))


class GatheredBytes:
    """The bytes of gathered parameters alive at once (weak references to every tensor a bucket's
    gather returns; measured at each gather, where the peak is)."""

    def __init__(self):
        self.live: dict[int, int] = {}
        self.peak = 0

    def __enter__(self):
        original = self.original = fsdp_module.Bucket.gather

        def gather(bucket, values):
            out = original(bucket, values)
            for t in out:
                ident = id(t)
                self.live[ident] = t.numel() * t.element_size()
                weakref.finalize(t, self.live.pop, ident, None)
            self.peak = max(self.peak, sum(self.live.values()))
            return out

        fsdp_module.Bucket.gather = gather
        return self

    def __exit__(self, *exc):
        fsdp_module.Bucket.gather = self.original


def case_schedule(state, world: int, reshard: bool, checkpoint: bool):
    model = build_llama(state)
    m = mesh((2, 2), ("dp", "tp")) if world == 4 else mesh((world,), ("dp",))
    plan = hpf.ShardingPlan.from_hf(model) if world == 4 else {}
    apply_fn, params, info = hpf.shard(model, plan, m, remat=checkpoint)
    before = {k: p.detach().clone() for k, p in params.items()}
    f_apply, f_params, f_info = hpf.fsdp(apply_fn, params, info, m, "dp", reshard_after_forward=reshard)
    dp = m["dp"]
    ids, local = _batch(dp)
    with Collectives() as counted, GatheredBytes() as gathered:
        loss = f_apply(f_params, input_ids=local, labels=local, use_cache=False).loss
        loss.backward()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    full = hpf.unshard({k: p.grad for k, p in f_params.items()}, f_info)
    for k, p in model.named_parameters():
        assert_close(full[k], p.grad, f"grad {k}")
    assert all(f_info[k].facet(hpf.RowSplit).inner == info[k] for k in info)  # the layout fsdp split further
    # the closed form: a block resharded after its forward is gathered twice, every group reduced once
    group = dp.get_group().group_name
    got = {op: counted.counts.get((op, group), 0) for op in ("all_gather_into_tensor", "reduce_scatter_tensor")}
    layout = f_apply.fsdp
    blocks = [g for g in layout.groups if g.block]
    assert [g.block for g in blocks] == ["model.layers.0", "model.layers.1"]
    others = len(layout.groups) - len(blocks)
    expect = {"all_gather_into_tensor": len(blocks) * (2 if reshard else 1) + others,
              "reduce_scatter_tensor": len(blocks) + others}
    assert got == expect, (got, expect, [g.name for g in layout.groups])
    assert layout.collectives_per_step() == {"all_gather": expect["all_gather_into_tensor"],
                                             "reduce_scatter": expect["reduce_scatter_tensor"]}
    # peak parameter memory: the local shards plus what is gathered at once
    shards = sum(p.numel() * p.element_size() for p in f_params.values())
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(b.unsharded_bytes(torch.float32) for b in layout.buckets)
    peak = shards + gathered.peak
    if reshard:  # one group gathered at a time (the local shards exceed full/ranks only by TP-replicated norms)
        assert gathered.peak <= largest, (gathered.peak, largest)
        replicated = sum(p.numel() * p.element_size() for k, p in f_params.items() if not info[k].is_sharded)
        assert peak <= full_bytes / m.size() + replicated + largest, (peak, full_bytes, largest)
    # nothing given to fsdp changed; shard()'s apply_fn still runs on its own params
    for k, p in params.items():
        assert torch.equal(p.detach(), before[k]) and p.grad is None, k
    assert info == hpf.shard(build_llama(state), plan, m)[2]
    apply_fn(params, input_ids=local)
    return {"peak": peak, "local": shards, "full": full_bytes, "largest": largest, "collectives": got}


@pytest.mark.parametrize("reshard,checkpoint", [(True, False), (False, False), (True, True), (False, True)],
                         ids=["reshard", "keep", "reshard+checkpoint", "keep+checkpoint"])
@pytest.mark.slow
def test_fsdp_collectives_closed_form_and_peak_memory(pool, reshard, checkpoint):
    r = pool.run(case_schedule, make_llama_state(), pool.world, reshard, checkpoint)[0]
    print(f"world {pool.world} reshard={reshard} checkpoint={checkpoint}: peak parameter bytes {r['peak']} "
          f"(local {r['local']}, full/ranks {r['full'] // pool.world}, largest group {r['largest']}), {r['collectives']}")


def case_double_backward(state, world: int):
    """A gradient penalty through ``.backward(create_graph=True)``: the regathered parameters of
    resharded blocks keep their place in the graph, so the second derivative is the unsharded one."""
    model, (apply_fn, params, info), _, dp = _setup(state, world)
    ids, local = _batch(dp)
    loss = apply_fn(params, input_ids=local, labels=local, use_cache=False).loss
    grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
    sum((g**2).sum() for g in grads).backward()
    ref = model(input_ids=ids, labels=ids, use_cache=False).loss
    ref_grads = torch.autograd.grad(ref, list(model.parameters()), create_graph=True)
    sum((g**2).sum() for g in ref_grads).backward()
    # rank r's penalty is the sum over its rows of the global gradient squared, so the penalties sum
    # to the global one, and a function of the gradient's shards is differentiated as that sum
    # (FSDP's pair transposes for the pairing of the dp-mean: core/collectives.py)
    full = hpf.unshard({k: p.grad for k, p in params.items()}, info)
    for k, p in model.named_parameters():
        assert_close(full[k], p.grad, f"penalty grad {k}", atol=1e-5, rtol=1e-4)


def test_fsdp_double_backward_through_resharded_blocks(pool):
    pool.run(case_double_backward, make_llama_state(), pool.world)


def case_mixed_precision(state, world: int):
    model, (apply_fn, params, info), _, dp = _setup(state, world, param_dtype=torch.bfloat16,
                                                    reduce_dtype=torch.float32)
    ids, local = _batch(dp)
    with Collectives() as counted:
        loss = apply_fn(params, input_ids=local, labels=local, use_cache=False).loss
        loss.backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in params.values())
    assert counted.dtypes == {torch.bfloat16, torch.float32}, counted.dtypes  # gathered in bf16, reduced in fp32
    ref_model = build_llama(state).to(torch.bfloat16)
    ref = ref_model(input_ids=ids, labels=ids, use_cache=False).loss
    ref.backward()
    assert_close(_dp_mean(loss, dp).float(), ref.detach().float(), "bf16 loss", atol=2e-2, rtol=2e-2)
    full = hpf.unshard({k: p.grad for k, p in params.items()}, info)
    for k, p in ref_model.named_parameters():
        scale = p.grad.float().abs().max().item() + 1e-6
        assert (full[k] - p.grad.float()).abs().max().item() <= 0.1 * scale, k


def test_fsdp_mixed_precision_bf16_compute_fp32_master_and_reduction(pool):
    pool.run(case_mixed_precision, make_llama_state(), pool.world)


def case_compile(state, world: int, cfg: dict):
    """``fullgraph=True``: one graph, no graph break (Dynamo raises on a break), kept and resharded."""
    _, (apply_fn, params, _), _, dp = _setup(state, world, cfg, reshard_after_forward=False)
    _, local = _batch(dp)

    def kept(p):
        return apply_fn(p, input_ids=local, labels=local, use_cache=False).loss

    assert_close(torch.compile(kept, backend="eager", fullgraph=True)(params).detach(), kept(params).detach(),
                 "compiled loss, kept")
    _, (r_apply, r_params, _), _, _ = _setup(state, world, cfg)

    def resharded(p):
        return r_apply(p, input_ids=local, labels=local, use_cache=False).loss

    # the blocks are traced as torch's checkpoint; Dynamo refuses the parameter bindings inside it
    # (side effects the block undoes) unless told they need no replay
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        loss = torch.compile(resharded, backend="aot_eager", fullgraph=True)(r_params)
        loss.backward()
    eager, eager_loss = grad_and_value(resharded)(r_params)
    assert_close(loss.detach(), eager_loss, "compiled loss")
    for k, p in r_params.items():
        assert_close(p.grad, eager[k], f"compiled grad {k}")


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.slow
def test_fsdp_compiles_to_one_graph(pool):
    cfg = {"num_hidden_layers": 1}  # one block traces what two do, in half the time
    pool.run(case_compile, make_llama_state(**cfg), pool.world, cfg)


def case_bad_input(state):
    model = build_llama(state)
    m = mesh((dist.get_world_size(),), ("dp",))
    apply_fn, params, info = hpf.shard(model, {}, m)
    tp_sharded = hpf.shard(model, hpf.ShardingPlan.from_hf(model), mesh((dist.get_world_size(),), ("tp",)))
    f_apply, f_params, f_info = hpf.fsdp(apply_fn, params, info, m, "dp")
    # one typed apply_fn recording what made it, in order; fsdp's is a new one, shard()'s unchanged
    assert isinstance(f_apply, hpf.ApplyFn) and (apply_fn.transforms, f_apply.transforms) == (("shard",), ("shard", "fsdp"))
    assert apply_fn.fsdp is None and f_apply.fsdp.axis == "dp" and f_apply.runtime is apply_fn.runtime
    small = build_llama(None, num_hidden_layers=1)
    other = hpf.shard(small, {}, m, verify_values=False)
    calls = []
    original = fsdp_module.agree
    fsdp_module.agree = lambda *a, **k: calls.append(a)  # the first collective fsdp() issues
    bad = {
        "axis": lambda: hpf.fsdp(apply_fn, params, info, m, "data"),
        "axes": lambda: hpf.fsdp(apply_fn, params, info, m, ("dp", "dp")),
        "axes missing": lambda: hpf.fsdp(apply_fn, params, info, m, ("dp", "cp")),
        "already sharded": lambda: hpf.fsdp(*tp_sharded, tp_sharded[2]["lm_head.weight"].mesh, "tp"),
        "twice": lambda: hpf.fsdp(f_apply, f_params, f_info, m, "dp"),
        "other shard": lambda: hpf.fsdp(apply_fn, other[1], other[2], m, "dp"),
        "dtype": lambda: hpf.fsdp(apply_fn, params, info, m, "dp", param_dtype=torch.int8),
        "blocks": lambda: hpf.fsdp(apply_fn, params, info, m, "dp", blocks=["model.layer.*"]),
        "mesh": lambda: hpf.fsdp(*tp_sharded, m, "dp"),
    }
    messages = {}
    try:
        for what, call in bad.items():
            with pytest.raises(hpf.PlanError) as err:
                call()
            messages[what] = str(err.value)
    finally:
        fsdp_module.agree = original
    assert not calls, "a bad input reached the cross-rank agreement"
    return messages


@pytest.mark.slow
def test_fsdp_bad_input_raises_before_any_collective(pool):
    messages = pool.run(case_bad_input, make_llama_state())[0]
    assert "'data' is not in the mesh" in messages["axis"]
    assert "tuple of distinct ones, got ('dp', 'dp')" in messages["axes"]
    assert "'cp' is not in the mesh" in messages["axes missing"]
    assert "already sharded on mesh axis 'tp'" in messages["already sharded"]
    assert "already sharded by hpf.fsdp on axis 'dp'" in messages["twice"]
    assert "not this apply_fn's" in messages["other shard"]
    assert "param_dtype" in messages["dtype"]
    assert "model.layer.*" in messages["blocks"]
    assert "does not contain shard()'s mesh" in messages["mesh"]
