"""Distributed checkpoints (``hp_functional.train.dcp``): a tiny Llama trained 2 AdamW steps at tp 2
and saved loads exactly (params and moments equal the saved global values' slices) at tp 4, tp 1,
dp 2 x tp 2 and FSDP x TP, and trains on from there as it would have without the save; a resume
with the RNG in ``extra`` is bit-identical to an uninterrupted run; async saves round-trip; a rank
killed mid-save leaves the previous checkpoint the latest; bad input raises on every rank."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import optree
import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

import hp_functional as hpf
from hp_functional.core.placement import slice_local
from hp_functional.train.dcp import MARKER, AsyncSaves, latest, load, save
from hp_functional.train.optim import state_info
from tests.conftest import get_pool
from tests.support.helpers import build_hf, make_hf_state, mesh, raised
from tests.support.models import MLP, PLANS, build_llama, make_llama_state, make_mlp_state

ROOT = Path(__file__).resolve().parents[2]
LR = 1e-3
LAYOUTS = ("tp", "tp1", "dp2xtp2", "fsdp")  # tp: over every rank (tp 2 at 2 ranks, tp 4 at 4)


def _shard(state, layout: str):
    model = build_llama(state)
    if layout == "tp":
        m = mesh()
    elif layout == "tp1":  # tp size 1: every parameter whole on every rank
        m = mesh((dist.get_world_size(), 1), ("dp", "tp"))
    else:
        m = mesh((2, 2), ("dp", "tp"))
    sharded = hpf.shard(model, hpf.ShardingPlan.from_hf(model), m)
    return hpf.fsdp(*sharded, m, "dp") if layout == "fsdp" else sharded


def _step(apply_fn, opt, params, opt_state):
    """One AdamW step on a batch drawn from the global RNG (the same on every rank, so dp ranks agree
    without a reduction), so that resuming must restore the RNG too."""
    ids = torch.randint(0, 128, (2, 8))
    grads = torch.func.grad(lambda p: apply_fn(p, input_ids=ids, labels=ids, use_cache=False).loss)(params)
    with torch.no_grad():
        return opt.update(grads, opt_state, params)


def _full(params, opt_state, info) -> dict:
    """Global params and moments (a collective), and the step."""
    return {"params": hpf.unshard(params, info), "mu": hpf.unshard(opt_state.mu, info),
            "nu": hpf.unshard(opt_state.nu, info), "step": int(opt_state.step)}


def _max_diff(a: dict, b: dict) -> float:
    return max((a[t][k] - b[t][k]).abs().max().item() for t in ("params", "mu", "nu") for k in a[t])


def _assert_equal(a: dict, b: dict, what: str) -> None:
    assert a["step"] == b["step"], what
    for t in ("params", "mu", "nu"):
        for k in b[t]:
            assert torch.equal(a[t][k], b[t][k]), f"{what}: {t}[{k}]"


# ---------------------------------------------------------------- one saved run, shared
def case_save(state, root: str):
    """2 steps, a sync save (with the RNG) and an async one, then 2 more steps: the reference."""
    torch.manual_seed(7)
    apply_fn, params, info = _shard(state, "tp")
    opt = hpf.optim.adamw(LR, weight_decay=0.01)
    opt_state = opt.init(params)
    for _ in range(2):
        params, opt_state = _step(apply_fn, opt, params, opt_state)
    extra = {"step": 2, "rng": torch.get_rng_state(), "rank": dist.get_rank()}
    handle = save(f"{root}/ckpt", params, info, opt_state=opt_state, extra=extra)
    assert handle.done() and os.path.isfile(f"{root}/ckpt/{MARKER}")
    copies = {k: p.clone() for k, p in params.items()}
    pending = save(f"{root}/async", copies, info, opt_state=opt_state, async_save=True)
    for p in copies.values():  # written to before wait(): the save wrote its own copy
        p.add_(1.0)
    assert not pending.done() and not os.path.exists(f"{root}/async")  # visible only once wait() finishes
    groups = len(dist.distributed_c10d._world.pg_map)
    assert pending.wait() == f"{root}/async" and os.path.isfile(f"{root}/async/{MARKER}")
    assert len(dist.distributed_c10d._world.pg_map) == groups - 1  # async_save=True: its own lane, closed by wait()
    saves = AsyncSaves()  # the caller's lanes: one gloo group reused, one pending save at a time
    first = save(f"{root}/owned/1", copies, info, async_save=saves)
    lane = saves.lane(tuple(range(dist.get_world_size())))
    second = save(f"{root}/owned/2", copies, info, async_save=saves)
    assert first.done() and not second.done() and saves.lane(tuple(range(dist.get_world_size()))) is lane
    assert second.wait() == f"{root}/owned/2" and os.path.isfile(f"{root}/owned/1/{MARKER}")
    assert len(dist.distributed_c10d._world.pg_map) == groups  # the caller's lane stays open for its next save
    refs = [_full(params, opt_state, info)]
    for _ in range(2):
        params, opt_state = _step(apply_fn, opt, params, opt_state)
        refs.append(_full(params, opt_state, info))
    return refs


@pytest.fixture(scope="module")
def crash_run(tmp_path_factory):
    """The kill-a-rank run (``tests/support/dcp_crash_script.py`` under torchrun), started before the pool
    cases so that its process starts overlap theirs; ``test_killed_rank...`` waits for it."""
    root, logs = tmp_path_factory.mktemp("crash"), tmp_path_factory.mktemp("crash_log")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "tests" / "support" / "dcp_crash_script.py"), str(root)]
    with open(logs / "torchrun.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    yield proc, root, logs / "torchrun.log"
    if proc.poll() is None:  # not waited for (deselected): torchrun stops its workers on SIGTERM
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, crash_run):  # crash_run: started first, to overlap
    root = tmp_path_factory.mktemp("dcp")
    return str(root), get_pool(2).run(case_save, make_llama_state(), str(root))[0]


def case_resume(state, root: str, refs):
    """A fresh load at the saving layout, the RNG restored, 2 steps: bit-identical to the 4-step run."""
    apply_fn, params, info = _shard(state, "tp")
    opt = hpf.optim.adamw(LR, weight_decay=0.01)
    out = load(f"{root}/ckpt", info, opt_state=opt.init(params))
    assert out.extra["step"] == 2 and out.extra["rank"] == dist.get_rank()  # its own (same world size)
    torch.set_rng_state(out.extra["rng"])
    p, s = out.params, out.opt_state
    _assert_equal(_full(p, s, info), refs[0], "loaded")
    for i in (1, 2):
        p, s = _step(apply_fn, opt, p, s)
        _assert_equal(_full(p, s, info), refs[i], f"step {i + 2} after resuming")


@pytest.mark.slow
def test_resume_is_bit_identical(saved):
    root, refs = saved
    get_pool(2).run(case_resume, make_llama_state(), root, refs)


def case_reshard(state, root: str, refs):
    """Load the tp-2 checkpoint at each layout: exact slices, then one step to 1e-6 of the reference."""
    worst = {}
    for layout in LAYOUTS:
        apply_fn, params, info = _shard(state, layout)
        opt = hpf.optim.adamw(LR, weight_decay=0.01)
        template = opt.init(params)
        before = {k: p.clone() for k, p in params.items()}
        out = load(f"{root}/ckpt", info, opt_state=template, params=params)
        for what, local in (("params", out.params), ("mu", out.opt_state.mu), ("nu", out.opt_state.nu)):
            for k, t in local.items():
                assert torch.equal(t, slice_local(refs[0][what][k], info[k])), f"{layout}: {what}[{k}]"
        assert int(out.opt_state.step) == 2 and out.extra["rank"] == 0, layout  # extra: rank 0's (another world size)
        assert all(torch.equal(params[k], before[k]) for k in params), f"{layout}: params template written to"
        assert all(not t.any() for t in [*template.mu.values(), *template.nu.values()]), f"{layout}: opt template written to"
        torch.set_rng_state(out.extra["rng"])
        p, s = _step(apply_fn, opt, out.params, out.opt_state)
        worst[layout] = _max_diff(_full(p, s, info), refs[1])
        assert worst[layout] < 1e-6, (layout, worst[layout])
    return worst


@pytest.mark.slow
def test_loads_at_other_layouts(saved):
    root, refs = saved
    worst = get_pool(4).run(case_reshard, make_llama_state(), root, refs[:2])[0]
    print("max |step 3 after loading - step 3 at tp 2|:", {k: f"{v:.1e}" for k, v in worst.items()})


def case_async(state, root: str, ref):
    _, params, info = _shard(state, "tp")
    out = load(f"{root}/async", info, opt_state=hpf.optim.adamw(LR).init(params))
    _assert_equal(_full(out.params, out.opt_state, info), ref, "async checkpoint")
    assert out.extra is None


def test_async_save_round_trips(saved):
    root, refs = saved
    get_pool(2).run(case_async, make_llama_state(), root, refs[0])


def test_a_failed_async_save_fails_on_every_wait():
    """A save that failed in its thread, or whose commit failed, raises on every ``wait()``: the
    handle never reports the path of a checkpoint that is not there."""
    from concurrent.futures import Future

    from hp_functional.train.dcp import SaveHandle

    failed = Future()
    failed.set_exception(OSError("No space left on device"))
    committed = []
    handle = SaveHandle("ck", failed, lambda: committed.append(True))
    for _ in range(2):
        with pytest.raises(OSError, match="No space left"):
            handle.wait()
    assert handle.done() and not committed

    def commit():
        raise OSError("rename failed")

    done = Future()
    done.set_result(None)
    handle = SaveHandle("ck", done, commit)
    for _ in range(2):
        with pytest.raises(OSError, match="rename failed"):
            handle.wait()


def test_global_tensors_without_duplicates(saved):
    """Every key's chunks tile its global tensor exactly once: the boxes two ranks hold (norms, the
    step) are written once (DCP's deduplication); ``latest`` is the newest completed save."""
    root, refs = saved
    md = FileSystemReader(f"{root}/ckpt").read_metadata().state_dict_metadata
    assert set(md) == {*refs[0]["params"], *(f"optim/{m}/{k}" for m in ("mu", "nu") for k in refs[0]["params"]),
                       "optim/step", "extra/0", "extra/1"}
    for key, v in md.items():
        if key.startswith("extra/"):  # each rank's extra, a byte item of its own
            continue
        assert sum(torch.Size(c.sizes).numel() for c in v.chunks) == v.size.numel(), key
    assert len(md["model.norm.weight"].chunks) == len(md["optim/step"].chunks) == 1
    assert len(md["lm_head.weight"].chunks) == 2 and md["lm_head.weight"].size == (128, 64)
    assert latest(root) == f"{root}/async" and latest(f"{root}/nothing") is None


# ---------------------------------------------------------------- packed and row-split layouts, any optimizer state
def _phi3(state, layout: str):
    model = build_hf("phi3", state)
    if layout == "packed":  # tp 2, gate_up_proj's gate and up blocks sliced separately
        plan = hpf.ShardingPlan({**hpf.ShardingPlan.from_hf(model).entries,
                                 "model.layers.*.mlp.gate_up_proj": "packed_colwise", "model.layers.*.mlp.down_proj": "rowwise"})
        return hpf.shard(model, plan, mesh())
    m = mesh((2, 1), ("dp", "tp"))
    return hpf.fsdp(*hpf.shard(model, hpf.ShardingPlan.from_hf(model), m), m, "dp")  # rows split over dp


def _partition():
    return hpf.optim.partition({"**.embed_tokens.**": hpf.optim.sgd(0.1, momentum=0.9), "**": hpf.optim.adamw(LR)})


def _global_tree(params, opt_state, info) -> tuple[dict, list]:
    """Global params and every optimizer-state leaf's global value (a collective)."""
    leaves, infos = optree.tree_leaves(opt_state), optree.tree_leaves(state_info(opt_state, info))
    flat = hpf.unshard({str(i): t for i, t in enumerate(leaves)}, {str(i): x for i, x in enumerate(infos)})
    return hpf.unshard(params, info), [flat[str(i)] for i in range(len(leaves))]


def case_packed(state, root: str):
    """A partition (SGD momentum + AdamW) state saved packed at tp 2 loads exactly row-split (FSDP),
    and what that saves loads exactly packed again."""
    _, params, info = _phi3(state, "packed")
    assert info["model.layers.0.mlp.gate_up_proj.weight"].blocks == (128, 128)
    opt = _partition()
    g = torch.Generator().manual_seed(3)
    grads = {k: slice_local(torch.randn(i.global_shape, generator=g), i) for k, i in info.items()}
    params, opt_state = opt.update(grads, opt.init(params), params)
    expected = _global_tree(params, opt_state, info)
    save(f"{root}/packed", params, info, opt_state=opt_state)
    for src, layout in (("packed", "fsdp"), ("fsdp", "packed")):
        _, like, info = _phi3(state, layout)
        out = load(f"{root}/{src}", info, opt_state=opt.init(like))
        for k, t in out.params.items():
            assert torch.equal(t, slice_local(expected[0][k], info[k])), f"{src} -> {layout}: {k}"
        leaves, infos = optree.tree_leaves(out.opt_state), optree.tree_leaves(state_info(out.opt_state, info))
        for i, (t, x) in enumerate(zip(leaves, infos, strict=True)):
            assert torch.equal(t, slice_local(expected[1][i], x)), f"{src} -> {layout}: state leaf {i}"
        if layout == "fsdp":
            save(f"{root}/fsdp", out.params, info, opt_state=out.opt_state)


@pytest.mark.slow
def test_packed_and_row_split_layouts(tmp_path):
    get_pool(2).run(case_packed, make_hf_state("phi3"), str(tmp_path))


# ---------------------------------------------------------------- a rank killed mid-save
def case_load_mlp(path: str, full):
    _, params, info = hpf.shard(_mlp(), PLANS["tp"], mesh())
    out = load(path, info)
    assert out.extra == {"step": 1}
    for k, t in out.params.items():
        assert torch.equal(t, slice_local(full[k], info[k])), k


def _mlp():
    model = MLP()
    model.load_state_dict(make_mlp_state())
    return model


@pytest.mark.slow
def test_killed_rank_leaves_the_previous_checkpoint(crash_run):
    proc, root, log = crash_run
    assert proc.wait(timeout=120) != 0, log.read_text()
    assert sorted(os.listdir(root)) == ["A", "B.hpf-partial"], os.listdir(root)
    assert not (root / "B.hpf-partial" / MARKER).exists()
    assert latest(root) == str(root / "A")
    get_pool(2).run(case_load_mlp, str(root / "A"), make_mlp_state())


# ---------------------------------------------------------------- bad input
def _failure(fn, *args, **kwargs) -> str | None:
    """``raised`` as one line, "Type: message" (the rows are compared as text)."""
    r = raised(fn, *args, **kwargs)
    return None if r is None else f"{r[0]}: {r[1]}"


def _bad_rows(params, info, root: str, bad: dict) -> dict:
    q = "model.layers.0.self_attn.q_proj.weight"
    rows = {kind: _failure(load, path, info) for kind, path in bad.items()}
    rows["missing"] = _failure(load, f"{root}/ckpt", {**info, "extra.weight": info[q]})
    rows["shape"] = _failure(load, f"{root}/ckpt", {**info, q: dataclasses.replace(info[q], global_shape=torch.Size([3, 64]))})
    rows["dtype"] = _failure(load, f"{root}/ckpt", info, params={**params, q: params[q].double()})
    rows["save_shape"] = _failure(save, f"{root}/bad_save", {**params, q: params[q][:1]}, info)
    rows["save_keys"] = _failure(save, f"{root}/bad_save", {k: v for k, v in params.items() if k != q}, info)
    rows["on_disk"] = [n for n in os.listdir(root) if n.startswith("bad_save")]
    return rows


def case_bad_input(state, root: str, bad: dict):
    """Each rank alone in turn (the others wait at a barrier): a check made after a collective would
    hang there instead of raising."""
    _, params, info = _shard(state, "tp")  # shard() itself agrees across ranks: done together first
    rows = None
    for r in range(dist.get_world_size()):
        if dist.get_rank() == r:
            rows = _bad_rows(params, info, root, bad)
        dist.barrier()
    return rows


def test_bad_input_raises_on_every_rank(saved, tmp_path):
    root, _ = saved
    q = "model.layers.0.self_attn.q_proj.weight"
    bad = {kind: str(tmp_path / kind) for kind in ("no_marker", "truncated", "truncated_recorded")}
    for path in bad.values():
        shutil.copytree(f"{root}/ckpt", path)
    os.remove(f"{bad['no_marker']}/{MARKER}")
    for kind in ("truncated", "truncated_recorded"):
        data = Path(bad[kind]) / "__1_0.distcp"
        data.write_bytes(data.read_bytes()[:1000])
    marker = json.loads((Path(bad["truncated_recorded"]) / MARKER).read_text())
    marker["files"]["__1_0.distcp"] = 1000  # the marker agrees: .metadata's offsets still catch it
    (Path(bad["truncated_recorded"]) / MARKER).write_text(json.dumps(marker))
    expect = {
        "no_marker": ["incomplete checkpoint (no marker", "hpf.latest", bad["no_marker"]],
        "truncated": ["__1_0.distcp", "1000 bytes", "recorded"],
        "truncated_recorded": ["__1_0.distcp", "1000 bytes", ".metadata references"],
        "missing": ["has no tensors ['extra.weight']"],
        "shape": [q, "(64, 64)", "(3, 64)"],
        "dtype": [q, "torch.float32", "torch.float64"],
        "save_shape": [f"parameter {q}", "(1, 64)", "(32, 64)"],
        "save_keys": [f"missing from params ['{q}']"],
    }
    for r, rows in enumerate(get_pool(2).run(case_bad_input, make_llama_state(), root, bad)):
        assert rows.pop("on_disk") == [], f"rank {r}: a failed save left files"
        for kind, parts in expect.items():
            assert rows[kind] is not None, f"rank {r}: {kind} did not raise"
            for part in parts:
                assert part in rows[kind], f"rank {r}: {kind}: {part!r} not in {rows[kind]!r}"
