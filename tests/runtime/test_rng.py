"""Layout-independent randomness: ``hpf.gaussian_like`` (noise by parameter name and global
index) and ``hpf.rng`` (dropout and friends by global index): the sharded results gathered are
the unsharded ones, bit for bit for the noise and to fp32 rounding for a train-mode step."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard
from torch.func import grad_and_value

import hp_functional as hpf
from hp_functional.core import counter_rng
from hp_functional.core.placement import GroupedShard, ShardInfo, StackedShard, local_layout, slice_local
from tests.support.helpers import assert_close, build_hf, make_hf_state, mesh, raised

LLAMA = {"attention_dropout": 0.3}
PHI3 = {"attention_dropout": 0.2, "resid_pdrop": 0.2}
PHI3_RESID = {"resid_pdrop": 0.2}  # dropout on the residual stream only (outside attention)
CP_SEQ = 16


# ---------------------------------------------------------------- the generator (one process)
def test_bits_match_the_reference_and_any_slice():
    """The int64 words wrap like 64-bit unsigned arithmetic (SplitMix64 written on Python ints), and a
    slice of indices draws the slice of the values, normals included (no vector-lane dependence)."""
    key = counter_rng.stream_key(5, 7)
    idx = torch.arange(20_000)
    bits = counter_rng.random_bits(key, idx)
    m = counter_rng._M64

    def ref(i: int) -> int:
        return counter_rng._signed(counter_rng._mix((i * counter_rng._GOLDEN + key) & m))  # SplitMix64's output
    assert [bits[i].item() for i in (0, 1, 2, 777, 19_999)] == [ref(i) for i in (0, 1, 2, 777, 19_999)]
    for p in (0.1, 0.5, 0.9):  # dropout keeps an element when its top 32 bits, unsigned, reach floor(p * 2**32)
        keep = counter_rng.keep_mask(key, idx, p)
        assert keep.tolist() == [((ref(i) & m) >> 32) >= int(p * 2 ** 32) for i in range(20_000)], p
    for dtype in (torch.float32, torch.float64):
        z = counter_rng.normal(key, idx, dtype)
        assert torch.equal(counter_rng.normal(key, idx[13:19_001:7].clone(), dtype), z[13:19_001:7])
        assert abs(z.double().mean().item()) < 0.02 and abs(z.double().std().item() - 1) < 0.02
    u = counter_rng.uniform(key, idx, torch.bfloat16)
    assert u.min() >= 0 and u.max() < 1
    assert counter_rng.stream_key(5, 1, 2) != counter_rng.stream_key(5, 2, 1)


@pytest.mark.slow
def test_draw_by_pieces_is_the_draw_of_the_whole_block():
    """``draw`` computes a block piece by piece (cache-sized on a CPU): the values are those of the
    whole block's global indices, whatever the cut (a run of rows, a cut inside the last dim, a dim
    given as positions, an empty block)."""
    key = counter_rng.stream_key(3, 4)
    piece = counter_rng.PIECE_CPU
    cases = [((2, 3, 96, 128), (2, 3, 96, 256), (0, 0, 0, 128)),  # runs of rows of a 4-d block
             ((2, piece + 77), (4, piece + 77), (2, 0)),  # a row longer than a piece: cut inside the last dim
             ((2, 5, 7), (2, 10, 7), (0, torch.tensor([9, 1, 3, 0, 5]), 0)), ((0, 4), (3, 4), (1, 0)), ((), (), ())]
    for local, glob, offset in cases:
        index = counter_rng.global_index(local, glob, offset, "cpu")
        assert torch.equal(counter_rng.draw("keep", key, local, glob, offset, "cpu", p=0.3),
                           counter_rng.keep_mask(key, index, 0.3)), local
        assert torch.equal(counter_rng.draw("dropout", key, local, glob, offset, "cpu", torch.float32, p=0.3),
                           counter_rng.keep_mask(key, index, 0.3).to(torch.float32).div_(0.7)), local
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(counter_rng.draw("uniform", key, local, glob, offset, "cpu", dtype),
                               counter_rng.uniform(key, index, dtype)), local
        assert torch.equal(counter_rng.draw("normal", key, local, glob, offset, "cpu", torch.float64),
                           counter_rng.normal(key, index, torch.float64)), local


def test_global_index_of_any_block_is_that_slice_of_the_row_major_index():
    """Every block at integer offsets (one run of the flat index, drawn with one arange, or not) indexes
    like the slice of ``arange(numel).view(global shape)``."""
    glob = (3, 4, 5)
    whole = torch.arange(60).view(glob)
    cases = [((1, 1, 5), (2, 3, 0)), ((1, 2, 5), (1, 1, 0)), ((2, 4, 5), (1, 0, 0)), ((1, 1, 3), (0, 2, 1)),
             ((1, 2, 3), (2, 2, 2)), ((2, 1, 5), (0, 3, 0)), ((3, 4, 2), (0, 0, 3)), ((1, 0, 5), (0, 4, 0))]
    for local, offset in cases:
        want = whole[tuple(slice(o, o + k) for o, k in zip(offset, local, strict=True))]
        assert torch.equal(counter_rng.global_index(local, glob, offset, "cpu"), want), (local, offset)
    assert counter_rng.global_index((), (), (), "cpu").tolist() == 0


def test_global_index_takes_a_vector_of_positions_per_dim():
    """A dim given as global positions (zigzag sequence chunks: not affine) indexes like a gather of the
    whole tensor's indices; a vector of another length is refused."""
    whole = counter_rng.global_index((2, 16, 3), (2, 16, 3), (0, 0, 0), "cpu")
    for rank in range(2):
        pos = hpf.cp_positions(rank, 16, 2, "zigzag")
        assert torch.equal(counter_rng.global_index((1, 8, 3), (2, 16, 3), (1, pos, 0), "cpu"), whole[1:2, pos])
    assert "one global position per local element" in raised(counter_rng.global_index, (1, 8, 3), (2, 16, 3),
                                                             (0, pos[:4], 0), "cpu")[1]


def test_gaussian_like_whole_tensors_and_bad_input():
    params = {"a.weight": torch.zeros(4, 6), "b.bias": torch.zeros(5, dtype=torch.float64)}
    out = hpf.gaussian_like(params, None, std={"a.weight": 2.0, "b.bias": 0.5}, seed=1)
    again = hpf.gaussian_like(params, None, std={"a.weight": 2.0, "b.bias": 0.5}, seed=1)
    assert all(torch.equal(out[k], again[k]) for k in params)
    assert out["b.bias"].dtype == torch.float64
    other = hpf.gaussian_like(params, None, std=1.0, seed=2)
    assert not torch.equal(other["a.weight"] * 2, out["a.weight"])
    assert "std has no entry" in raised(hpf.gaussian_like, params, None, {"a.weight": 1.0}, 0)[1]
    assert "no ShardInfo" in raised(hpf.gaussian_like, params, {}, 1.0, 0)[1]


def _independent(a: torch.Tensor, b: torch.Tensor) -> float:
    """The correlation of two draws (about N(0, 1/n) for independent ones); asserts it is near 0."""
    a, b = a.double().flatten(), b.double().flatten()
    r = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
    assert abs(r) < 6 / a.numel() ** 0.5, r  # six standard errors
    return r


def test_gaussian_like_same_shaped_leaves_draw_their_own_noise():
    """Each leaf's noise is its own stream (DP-SGD's independence across parameters): leaves of one
    shape, dtype and std (a layer's q/k/v, two layers' norms) get uncorrelated noise, and a leaf's
    noise depends on its own name only (the same drawn alone or among others)."""
    shapes = {"q.weight": (64, 64), "k.weight": (64, 64), "v.weight": (64, 64), "a.norm": (4096,), "b.norm": (4096,)}
    out = hpf.gaussian_like({k: torch.zeros(s) for k, s in shapes.items()}, None, 1.0, seed=7)
    for x, y in (("q.weight", "k.weight"), ("q.weight", "v.weight"), ("k.weight", "v.weight"), ("a.norm", "b.norm"),
                 ("q.weight", "a.norm")):
        _independent(out[x], out[y])
    for k, s in shapes.items():
        assert torch.equal(hpf.gaussian_like({k: torch.zeros(s)}, None, 1.0, seed=7)[k], out[k]), k


def test_rng_unsharded_module_is_deterministic_and_seeded():
    state = make_hf_state("phi3", **PHI3)
    model = build_hf("phi3", state, **PHI3).train()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    with hpf.rng(3) as r:
        a = model(input_ids=ids, labels=ids).loss
    assert r.count == 6  # per layer: attention probabilities and two residual dropouts
    with hpf.rng(3):
        b = model(input_ids=ids, labels=ids).loss
    with hpf.rng(4):
        c = model(input_ids=ids, labels=ids).loss
    assert a.item() == b.item() and a.item() != c.item()
    with hpf.rng(3):
        y = torch.nn.functional.dropout(torch.ones(64), 0.5)
        assert "randperm is not covered" in raised(torch.randperm, 4)[1]
        assert "generator=" in raised(torch.rand, 3, generator=torch.Generator())[1]
    assert set(y.unique().tolist()) == {0.0, 2.0}


def test_rng_random_ops_of_one_forward_draw_apart():
    """The k-th random op of a block reads its own stream: two dropouts of one shape in one forward
    (two ``nn.Dropout`` of a block, attention and residual) draw independent masks, so do two
    ``randn`` of one shape; the block drawn again draws the same values."""
    x = torch.ones(64, 64)

    def draws():
        return (torch.nn.functional.dropout(x, 0.5), torch.nn.Dropout(0.5)(x), torch.randn(64, 64),
                torch.randn(64, 64))

    with hpf.rng(3):
        first, second, z1, z2 = draws()
    assert set(first.unique().tolist()) == set(second.unique().tolist()) == {0.0, 2.0}
    agree = (first == second).double().mean().item()  # 1/2 for independent masks of p = 1/2
    assert abs(agree - 0.5) < 6 * 0.5 / 64, agree
    _independent(first, second)
    _independent(z1, z2)
    with hpf.rng(3):
        again = draws()
    assert all(torch.equal(a, b) for a, b in zip(again, (first, second, z1, z2), strict=True))


def test_multinomial_draws_each_category_at_its_probability():
    """``multinomial`` under ``hpf.rng``: the frequencies follow the probabilities (inverse CDF, and
    the Gumbel top-k without replacement), a zero-probability category is never drawn, the draws
    are the seed's (the same again, others for another seed), and rows draw apart."""
    probs = torch.tensor([0.1, 0.0, 0.2, 0.0, 0.7], dtype=torch.float64)
    rows = probs.expand(40000, 5)
    with hpf.rng(1):
        once = torch.multinomial(rows, 1)[:, 0]
        pairs = rows[:4000].multinomial(2)
    with hpf.rng(1):
        again = torch.multinomial(rows.float(), 1)[:, 0]
    with hpf.rng(2):
        other = torch.multinomial(rows, 1)[:, 0]
    freq = torch.bincount(once, minlength=5).double() / len(once)
    assert (freq - probs).abs().max() < 0.01, freq
    assert torch.equal(once, again) and not torch.equal(once, other)
    assert (pairs[:, 0] != pairs[:, 1]).all() and not torch.isin(pairs, torch.tensor([1, 3])).any()
    first = torch.bincount(pairs[:, 0], minlength=5).double() / len(pairs)  # the first draw is a plain draw
    assert (first - probs).abs().max() < 0.03, first
    with hpf.rng(1):
        assert "generator=" in raised(torch.multinomial, probs, 1, generator=torch.Generator())[1]


# ---------------------------------------------------------------- gaussian_like at every layout
def case_gaussian_layouts(state, world: int):
    """Noise drawn on the shards and gathered equals the noise of the whole tensors: TP (vocab-parallel
    embedding, colwise, rowwise), packed Colwise blocks, hpf.fsdp's row splits over dp × tp, KV-head
    groups and expert stacks (stored placements built by hand)."""
    diffs = {}
    model = build_hf("phi3", state, **PHI3)
    whole = dict(model.named_parameters())
    std = {k: 0.5 + i / 10 for i, k in enumerate(whole)}
    ref = hpf.gaussian_like(whole, None, std, seed=11)
    tp_mesh = mesh((world,), ("tp",))
    plan = hpf.ShardingPlan({**hpf.ShardingPlan.from_hf(model).entries,
                             "model.layers.*.mlp.gate_up_proj": "packed_colwise", "model.layers.*.mlp.down_proj": "rowwise"})
    layouts = {"tp": hpf.shard(model, plan, tp_mesh, verify=False)}
    dp_tp = mesh((2, world // 2), ("dp", "tp"))
    apply_fn, params, info = hpf.shard(model, plan, dp_tp, verify=False)
    layouts["fsdp dp x tp"] = hpf.fsdp(apply_fn, params, info, dp_tp, "dp")
    for name, (_, params, info) in layouts.items():
        full = hpf.unshard(hpf.gaussian_like(params, info, std, seed=11), info)
        for k in ref:
            assert torch.equal(full[k], ref[k]), f"{name}: {k}"
        diffs[name] = sorted({str(i.placements) for i in info.values()})
    # stored-only placements: KV heads held by groups of ranks, one expert of a stack
    g = torch.zeros(6, 8)
    for placement in (GroupedShard(0, 2), StackedShard(1, world), Shard(1), Replicate()):
        shape, offset = local_layout(g.shape, (placement,), tp_mesh, "w")
        info = {"w": ShardInfo((placement,), tp_mesh, g.shape, shape, offset)}
        local = {"w": slice_local(g, info["w"])}
        noise = hpf.gaussian_like(local, info, 1.0, seed=3)["w"]
        whole_noise = hpf.gaussian_like({"w": g}, None, 1.0, seed=3)["w"]
        assert torch.equal(noise, slice_local(whole_noise, info["w"])), str(placement)
    return diffs


@pytest.mark.slow
def test_gaussian_like_is_the_same_at_every_layout(pool):
    layouts = pool.run(case_gaussian_layouts, make_hf_state("phi3", **PHI3), pool.world)[0]
    assert any("RowSplit" in k or "Shard" in s for k, v in layouts.items() for s in v)


# ---------------------------------------------------------------- hpf.rng through apply_fn
def case_rng_step(state, family: str, cfg: dict, mesh_shape: tuple, fsdp: bool, seed: int = 5):
    """Loss and every gradient of a train-mode step under hpf.rng(seed): sharded (tp, or fsdp dp × tp)
    against the unsharded model on the global batch under the same generator."""
    names = ("tp",) if len(mesh_shape) == 1 else ("dp", "tp")
    m = mesh(tuple(mesh_shape), names)
    model = build_hf(family, state, **cfg).train()
    apply_fn, params, info = hpf.shard(model, hpf.ShardingPlan.from_hf(model), m, verify=False)
    dp = m["dp"] if "dp" in names else None
    if fsdp:
        apply_fn, params, info = hpf.fsdp(apply_fn, params, info, m, "dp")
    ids = torch.randint(0, model.config.vocab_size, (2 * (dp.size() if dp else 1), 8),
                        generator=torch.Generator().manual_seed(7))
    with hpf.rng(seed):
        ref = model(input_ids=ids, labels=ids).loss
    ref.backward()
    mine = ids.chunk(dp.size())[dp.get_local_rank()] if dp else ids
    with hpf.rng(seed) as r:
        loss = apply_fn(params, input_ids=mine, labels=mine).loss
    loss.backward()  # outside the block: the backward draws nothing
    draws = r.count
    tables = dict(apply_fn.runtime.rng_tables)  # the layout table, kept on the runtime for every later generator
    if dp:
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=dp.get_group())
        loss = loss / dp.size()
    assert_close(loss, ref.detach(), "loss", atol=1e-6, rtol=1e-6)
    full = hpf.unshard({k: p.grad for k, p in params.items()}, info)
    worst = max(assert_close(full[k], p.grad, f"grad {k}", atol=1e-6, rtol=1e-5) for k, p in model.named_parameters())
    if not fsdp:  # under torch.func.grad too (the layout table is computed outside the transform)
        with hpf.rng(seed):
            grads, _ = grad_and_value(lambda p: apply_fn(p, input_ids=mine, labels=mine).loss)(params)
        for k, p in params.items():
            assert_close(grads[k], p.grad, f"torch.func grad {k}", atol=1e-6, rtol=1e-5)
    with hpf.rng(seed + 1):  # another seed: other masks
        other = apply_fn(params, input_ids=mine, labels=mine).loss
    kept = len(tables) == 1 and apply_fn.runtime.rng_tables == tables and all(
        apply_fn.runtime.rng_tables[k] is t for k, t in tables.items())
    return draws, worst, abs(other.item() - loss.item()) > 1e-4 and kept


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_rng_tp2_attention_dropout_matches_unsharded(pool):
    for draws, worst, differs in pool.run(case_rng_step, make_hf_state("llama", **LLAMA), "llama", LLAMA, (2,), False):
        assert draws == 2 and worst < 1e-5 and differs


@pytest.mark.slow
@pytest.mark.parametrize("family,cfg", [("llama", {**LLAMA, "attn_implementation": "sdpa"}), ("phi3", PHI3)],
                         ids=["llama-sdpa", "phi3-resid"])
def test_rng_tp_matches_unsharded(pool, family, cfg):
    for draws, worst, differs in pool.run(case_rng_step, make_hf_state(family, **cfg), family, cfg, (pool.world,), False):
        assert draws == (6 if family == "phi3" else 2) and worst < 1e-5 and differs


@pytest.mark.slow
@pytest.mark.parametrize("pool", [4], indirect=True)
def test_rng_fsdp_dp_tp_matches_unsharded(pool):
    """dp 2 × tp 2, fsdp over dp: each dp rank's examples are global rows [i*b, (i+1)*b)."""
    for draws, worst, differs in pool.run(case_rng_step, make_hf_state("phi3", **PHI3), "phi3", PHI3, (2, 2), True):
        assert draws == 6 and worst < 1e-5 and differs


# ---------------------------------------------------------------- context parallelism
def _compare_cp(model, info, ref, loss, runs: dict, dp=None) -> float:
    """The worst difference of the loss and of every gathered gradient of ``runs`` (label → gradients) from the
    unsharded ``model``'s (``ref`` its loss); with ``dp``, the loss is the mean of the dp ranks'."""
    if dp is not None:
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=dp.get_group())
        loss = loss / dp.size()
    worst = assert_close(loss, ref.detach(), "loss", atol=1e-6, rtol=1e-6)
    for how, grads in runs.items():
        full = hpf.unshard(grads, info)
        worst = max(worst, *(assert_close(full[k], p.grad, f"{how} grad {k}", atol=1e-6, rtol=1e-5)
                             for k, p in model.named_parameters()))
    return worst


def case_rng_cp(state, layouts: tuple, shape: tuple, names: tuple, sharded: bool = False, seed: int = 5):
    """Context parallelism (the sequence in each layout's chunks, dp or tp beside it): a train-mode step of
    Phi-3 with residual dropout on the sequence-sharded activations under hpf.rng(seed) gives the unsharded
    model's loss and every gradient (``.backward()`` and torch.func.grad).  dp ranks pass their own examples
    (data_axes; then hpf.fsdp over dp × cp too, whose cp ranks share theirs); ``sharded``: each rank passes
    its chunk of them (``cp_sharded=True``, shifted labels)."""
    out = []
    m = mesh(tuple(shape), tuple(names))
    dp = m["dp"] if "dp" in names else None
    for layout in layouts:
        model = build_hf("phi3", state, **PHI3_RESID).train()
        plan = hpf.ShardingPlan.from_hf(model, cp_axis="cp", cp_layout=layout)
        apply_fn, params, info = hpf.shard(model, plan, m, verify=False)
        ids = torch.randint(0, model.config.vocab_size, (2 * (dp.size() if dp else 1), CP_SEQ),
                            generator=torch.Generator().manual_seed(7))
        with hpf.rng(seed):
            ref = model(input_ids=ids, labels=ids).loss
        ref.backward()
        mine = ids.chunk(dp.size())[dp.get_local_rank()] if dp else ids
        call = dict(input_ids=mine, labels=mine)
        if sharded:
            shifted = torch.nn.functional.pad(mine, (0, 1), value=-100)[:, 1:]
            call = dict(input_ids=hpf.cp_shard(mine, m, 1, layout=layout),
                        shift_labels=hpf.cp_shard(shifted, m, 1, layout=layout), cp_sharded=True)
        gen = hpf.rng(seed, data_axes="dp" if dp else None)  # entered again below: its layout table is reused
        with gen:
            loss = apply_fn(params, **call).loss
        loss.backward()
        draws = gen.count
        with gen:
            fgrads, _ = grad_and_value(lambda p, call=call, fn=apply_fn: fn(p, **call).loss)(params)
        grads = {k: p.grad for k, p in params.items()}
        if dp:
            grads, fgrads = (hpf.reduce_gradients(g, info, m, dp_axis="dp") for g in (grads, fgrads))
        worst = _compare_cp(model, info, ref, loss, {"backward": grads, "torch.func": fgrads}, dp)
        with gen.fold_in(1):  # another stream: other masks
            other = apply_fn(params, **call).loss
        out.append((draws, worst, abs(other.item() - loss.item()) > 1e-6))  # the same masks give the same bits
        if dp:  # torchtitan's dp_shard_cp: fsdp over dp × cp, whose cp ranks share their examples
            f_apply, f_params, f_info = hpf.fsdp(apply_fn, params, info, m, ("dp", "cp"))
            with hpf.rng(seed) as r:
                loss = f_apply(f_params, **call).loss
            loss.backward()
            grads = {k: p.grad for k, p in f_params.items()}
            out.append((r.count, _compare_cp(model, f_info, ref, loss, {"fsdp dp x cp": grads}, dp), True))
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_rng_cp2_zigzag_residual_dropout_matches_unsharded(pool):
    for rank in pool.run(case_rng_cp, make_hf_state("phi3", **PHI3_RESID), ("zigzag",), (2,), ("cp",)):
        for draws, worst, differs in rank:
            assert draws == 4 and worst < 1e-5 and differs


@pytest.mark.slow
@pytest.mark.parametrize("pool", [4], indirect=True)
@pytest.mark.parametrize("names,sharded", [(("dp", "cp"), True), (("cp", "tp"), False)], ids=["dp-cp", "cp-tp"])
def test_rng_cp_with_dp_or_tp_matches_unsharded(pool, names, sharded):
    """dp 2 × cp 2 (data_axes, cp_sharded chunks; hpf.fsdp over dp × cp) and cp 2 × tp 2, both layouts each."""
    state = make_hf_state("phi3", **PHI3_RESID)
    for rank in pool.run(case_rng_cp, state, ("zigzag", "contiguous"), (2, 2), names, sharded):
        for draws, worst, differs in rank:
            assert draws == 4 and worst < 1e-5 and differs


def case_rng_cp_declared_inputs(state, seed: int = 3):
    """A model without HF's arguments (the torchtitan-style Llama, ``hpf.ContextInputs``) at cp 2, contiguous:
    a dropout after each block's feed-forward, with the whole batch (positional tokens) and with cp_sharded
    chunks, against the unsharded model under the same generator."""
    from tests.support.titan_llama import VOCAB, Transformer

    model = Transformer()
    model.load_state_dict(state)
    for block in model.layers:
        block.feed_forward = torch.nn.Sequential(block.feed_forward, torch.nn.Dropout(0.2))
    model.train()
    m = mesh((2,), ("cp",))
    inputs = hpf.ContextInputs(sequence={"tokens": 1}, positions="positions")
    plan = hpf.ShardingPlan({"layers.*.attention.inner_attention": hpf.ContextParallel("ring")}, axes={"cp": "cp"},
                            settings={"cp_layout": "contiguous", "cp_inputs": inputs})
    apply_fn, params, info = hpf.shard(model, plan, m, verify=False)
    gen = torch.Generator().manual_seed(7)
    ids, labels = torch.randint(0, VOCAB, (2, CP_SEQ), generator=gen), torch.randint(0, VOCAB, (2, CP_SEQ), generator=gen)
    with hpf.rng(seed):
        ref = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), labels.flatten())
    ref.backward()
    rng = hpf.rng(seed)
    with rng:
        _, loss = apply_fn(params, ids, labels=labels)
    loss.backward()
    chunk = dict(tokens=hpf.cp_shard(ids, m, 1, layout="contiguous"),
                 labels=hpf.cp_shard(labels, m, 1, layout="contiguous"), cp_sharded=True)
    with rng:
        grads, value = grad_and_value(lambda p: apply_fn(p, **chunk)[1])(params)
    worst = _compare_cp(model, info, ref, loss, {"backward": {k: p.grad for k, p in params.items()}})
    return rng.count, max(worst, _compare_cp(model, info, ref, value, {"cp_sharded": grads}))


@pytest.mark.slow
@pytest.mark.parametrize("pool", [2], indirect=True)
def test_rng_cp_declared_inputs_matches_unsharded(pool):
    from tests.support.titan_llama import make_titan_state

    for draws, worst in pool.run(case_rng_cp_declared_inputs, make_titan_state()):
        assert draws == 2 and worst < 1e-5


# ---------------------------------------------------------------- sequence parallelism; what is refused
def case_ws2_layouts(llama):
    """Sequence parallelism (the residual stream seq-sharded between the norms) matches the unsharded
    model; a random op that hpf.rng cannot place raises PlanError naming the module: inside a block
    recomputed in the backward, attention-probability dropout under context parallelism (inside ring
    attention)."""
    out = {}
    m = mesh((2,), ("tp",))
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    model = build_hf("llama", llama, **LLAMA).train()
    apply_fn, params, info = hpf.shard(model, hpf.llama_sp_plan(), m, verify=False)
    with hpf.rng(0):
        ref = model(input_ids=ids, labels=ids).loss
    ref.backward()
    with hpf.rng(0):
        loss = apply_fn(params, input_ids=ids, labels=ids).loss
    loss.backward()
    full = hpf.unshard({k: p.grad for k, p in params.items()}, info)
    out["sp"] = max(assert_close(loss, ref.detach(), "loss", atol=1e-6, rtol=1e-6),
                    *(assert_close(full[k], p.grad, k, atol=1e-6) for k, p in model.named_parameters()))
    apply_fn, params, _ = hpf.shard(model, hpf.ShardingPlan.from_hf(model), m, verify=False, remat=True)
    with hpf.rng(0):
        out["checkpoint"] = raised(apply_fn, params, input_ids=ids, labels=ids)
    model = build_hf("llama", llama, **LLAMA).train()
    apply_fn, params, _ = hpf.shard(model, hpf.ShardingPlan.from_hf(model, cp_axis="cp"), mesh((2,), ("cp",)),
                                    verify=False)
    with hpf.rng(0):
        out["cp"] = raised(apply_fn, params, input_ids=ids, labels=ids)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("pool", [2], indirect=True)
def test_rng_sequence_parallel_and_refusals(pool):
    out = pool.run(case_ws2_layouts, make_hf_state("llama", **LLAMA))[0]
    assert out["sp"] < 1e-5
    kind, msg = out["checkpoint"]
    assert kind == "PlanError" and "model.layers.0.self_attn" in msg and "recomputed in the backward" in msg
    kind, msg = out["cp"]
    assert kind == "PlanError" and "model.layers.0.self_attn" in msg and "attention dropout" in msg, msg
