"""Every torch.func transform through every parallelism of the library: one test per cell of
docs/transforms.md's matrix.

Rows are the library's transforms (TP, SP, CP, EP, FSDP alone and over TP, ``hpf.gpipe``,
activation recompute, ``buffers=``), columns torch.func's (grad, vjp, jvp, vmap, per-example
``vmap(grad)``, the HVP ``jvp∘grad``, ``grad∘grad``, ``hessian``).  Each cell compares against the
unsharded model (the loss or its tangent, and every gradient gathered with ``hpf.unshard``) at
fp32, or asserts the hp_functional error that refuses it.  One pool run computes a row's cells
(the fast ones, or the slow ones) and the per-cell tests read the cached result.

Semantics the cells check (docs/transforms.md): a rank-varying loss (FSDP's: each dp rank's batch)
stands for the dp-mean, the global loss; ``grad∘grad`` differentiates ``Σ <G, v>`` over the
gradient's unique elements (a shard once, a replicated piece once), which is the HVP; ``hessian``
is taken of full (rank-invariant) parameters sliced inside with ``split_to``.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.func import functional_call, grad, grad_and_value, hessian, jvp, vjp, vmap

import hp_functional as hpf
from hp_functional import collectives as C
from hp_functional.core.host_comm import all_gather_objects
from hp_functional.core.placement import slice_local
from tests.conftest import get_pool
from tests.support.helpers import build_hf, make_hf_state, mesh
from tests.support.models import BufferNet

COLUMNS = ("grad", "vjp", "jvp", "vmap", "vmap_grad", "jvp_grad", "grad_grad", "hessian")
LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, vocab_size=64)
SEQ = 8


# ---------------------------------------------------------------- a row: what its cells need
@dataclass
class Row:
    """One library transform, set up on this rank: ``loss(params, batch)`` is this rank's loss of
    the global ``batch`` (the rank slices what it computes on), ``ref(full, batch)`` the unsharded
    model's; ``mean`` turns a per-rank loss (or its tangent, or a stack of them) into the global
    one; ``split(sub)`` makes local leaves of full ones, differentiably (hessian)."""

    loss: Callable[[dict, Tensor], Tensor]
    ref: Callable[[dict, Tensor], Tensor]
    params: dict[str, Tensor]
    full: dict[str, Tensor]
    unshard: Callable[[dict], dict]
    local: Callable[[dict], dict]
    batches: Tensor  # [K, ...]: K global batches (vmap); batches[0] is the one of the other cells
    examples: Tensor  # [K, ...]: K per-example batches (vmap(grad))
    hessian_of: dict[str, Tensor]  # the full (rank-invariant) values the hessian is taken of
    split: Callable[[dict], dict]  # those values -> this rank's leaves (differentiable)
    mean: Callable[[Tensor], Tensor] = lambda t: t
    ref_split: Callable[[dict], dict] = lambda s: s


def _close(got: Tensor, want: Tensor, what: str, scale: float | None = None) -> float:
    """The worst difference; fp32 tolerances relative to ``scale`` (default: ``want``'s largest entry)."""
    if scale is None:  # alone: a zero reference would make the check void
        assert want.abs().max() > 0, f"{what}: the reference is zero"
        scale = want.abs().max().item()
    scale = max(1.0, scale)
    torch.testing.assert_close(got, want, atol=1e-5 * scale, rtol=1e-4, msg=lambda m: f"{what}: {m}")
    return (got - want).abs().max().item() if want.numel() else 0.0


def _close_tree(got: dict, want: dict, what: str) -> float:
    """Every leaf (the same keys), tolerances relative to the largest entry of the whole tree."""
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want))[:4])
    scale = max(v.abs().max().item() for v in want.values())
    assert scale > 0, f"{what}: the reference is zero"
    return max(_close(got[k], want[k], f"{what} {k}", scale) for k in want)


def _tangent(full: dict[str, Tensor]) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(11)
    return {k: torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in full.items()}


def _cells(row: Row, columns) -> dict[str, tuple]:
    """Each column's outcome on this rank: ("exact", worst difference), ("refused", error type,
    message) for an hp_functional error, ("wrong"/"error", text) otherwise."""
    b = row.batches[0]
    tangent = _tangent(row.full)
    t = row.local(tangent)
    ref_grad, ref_loss = grad_and_value(row.ref)(row.full, b)
    ref_hvp = None

    def hvp_ref():
        nonlocal ref_hvp
        if ref_hvp is None:
            ref_hvp = jvp(lambda p: grad(row.ref)(p, b), (row.full,), (tangent,))[1]
        return ref_hvp

    def c_grad():
        g, loss = grad_and_value(row.loss)(row.params, b)
        return max(_close(row.mean(loss), ref_loss, "loss"), _close_tree(row.unshard(g), ref_grad, "grad"))

    def c_vjp():
        loss, fn = vjp(lambda p: row.loss(p, b), row.params)
        (g,) = fn(torch.tensor(1.7, dtype=loss.dtype))
        return max(_close(row.mean(loss), ref_loss, "loss"),
                   _close_tree(row.unshard(g), {k: 1.7 * v for k, v in ref_grad.items()}, "vjp"))

    def c_jvp():
        loss, tl = jvp(lambda p: row.loss(p, b), (row.params,), (t,))
        _, want = jvp(lambda p: row.ref(p, b), (row.full,), (tangent,))
        return max(_close(row.mean(loss), ref_loss, "loss"), _close(row.mean(tl), want, "tangent"))

    def c_vmap():
        got = vmap(lambda x: row.loss(row.params, x))(row.batches)
        want = torch.stack([row.ref(row.full, x) for x in row.batches])
        return _close(row.mean(got), want, "vmap losses")

    def c_vmap_grad():
        got = vmap(grad(row.loss), in_dims=(None, 0))(row.params, row.examples)
        return max(_close_tree(row.unshard({k: v[i] for k, v in got.items()}), grad(row.ref)(row.full, x),
                               f"example {i}") for i, x in enumerate(row.examples))

    def c_jvp_grad():
        _, h = jvp(lambda p: grad(row.loss)(p, b), (row.params,), (t,))
        return _close_tree(row.unshard(h), hvp_ref(), "hvp")

    def c_grad_grad():
        def inner(p):
            g = grad(row.loss)(p, b)
            return sum((g[k] * t[k]).sum() for k in g)

        return _close_tree(row.unshard(grad(inner)(row.params)), hvp_ref(), "grad of <grad, v>")

    def c_hessian():
        sub = row.hessian_of
        got = hessian(lambda s: row.loss(row.params | row.split(s), b))(sub)
        want = hessian(lambda s: row.ref(row.full | row.ref_split(s), b))(sub)
        return _close_tree({f"{a} x {c}": got[a][c] for a in sub for c in sub},
                           {f"{a} x {c}": want[a][c] for a in sub for c in sub}, "hessian")

    fns = {"grad": c_grad, "vjp": c_vjp, "jvp": c_jvp, "vmap": c_vmap, "vmap_grad": c_vmap_grad,
           "jvp_grad": c_jvp_grad, "grad_grad": c_grad_grad, "hessian": c_hessian}
    out = {}
    for col in columns:
        try:
            out[col] = ("exact", fns[col]())
        except AssertionError as exc:
            out[col] = ("wrong", str(exc)[:2000])
        except hpf.PlanError as exc:
            out[col] = ("refused", type(exc).__name__, str(exc))
        except Exception as exc:  # noqa: BLE001 - reported per cell: torch's raw errors are a failure
            out[col] = ("error", f"{type(exc).__name__}: {exc}"[:1500] + "\n" + traceback.format_exc()[-3000:])
    return out


# ---------------------------------------------------------------- the rows
def _ids(batch: int, seed: int) -> Tensor:
    return torch.randint(3, LLAMA["vocab_size"], (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def _stacked(k: int, batch: int, seed: int) -> Tensor:
    return torch.stack([_ids(batch, seed + i) for i in range(k)])


def _hf_loss(fn, p, x, **kw):
    return fn(p, input_ids=x, labels=x, use_cache=False, **kw).loss


def _model_row(model, apply_fn, params, info, batch: int = 2, split=None,
               keys=("model.layers.0.input_layernorm.weight",), **kw) -> Row:
    full = {k: v.detach() for k, v in model.named_parameters()}
    return Row(loss=lambda p, x: _hf_loss(apply_fn, p, x, **kw),
               ref=lambda p, x: _hf_loss(lambda q, **a: functional_call(model, q, (), a), p, x),
               params={k: v.detach() for k, v in params.items()}, full=full,
               unshard=lambda g: hpf.unshard(g, info), local=lambda d: {k: slice_local(d[k], info[k]) for k in info},
               batches=_stacked(2, batch, 20), examples=_stacked(2, 1, 40), hessian_of={k: full[k] for k in keys},
               split=split or (lambda s: s))


def row_tp(state):
    model = build_hf("llama", state, **LLAMA)
    return _model_row(model, *hpf.shard(model, hpf.ShardingPlan.from_hf(model), mesh()))


def row_sp(state):
    model = build_hf("llama", state, **LLAMA)
    return _model_row(model, *hpf.shard(model, hpf.llama_sp_plan(), mesh()))


def row_recompute(state):
    model = build_hf("llama", state, **LLAMA)
    return _model_row(model, *hpf.shard(model, hpf.ShardingPlan.from_hf(model), mesh(), remat=True))


def row_cp(state):
    model = build_hf("llama", state, **LLAMA)
    m = mesh((dist.get_world_size(),), ("cp",))
    return _model_row(model, *hpf.shard(model, hpf.ShardingPlan.from_hf(model, cp_axis="cp"), m))


def _moe_config(**overrides):
    from transformers import AutoConfig

    kw = dict(vocab_size=LLAMA["vocab_size"], hidden_size=32, intermediate_size=32, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
              tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2, output_router_logits=False)
    kw.update(overrides)
    config = AutoConfig.for_model("mixtral", **kw)
    config._attn_implementation = "eager"
    # HF's default experts kernel (torch._grouped_mm) has no forward-mode AD in torch 2.13: the
    # unsharded model's jvp raises as well; the loop over experts has every derivative
    config._experts_implementation = "eager"
    return config


def make_moe_state():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_moe_config())
    with torch.no_grad():  # experts at HF's init are ~0: make their contribution visible
        for name, p in model.named_parameters():
            if "experts" in name:
                p.normal_(0, 0.1)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.state_dict()


def row_ep(state):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_moe_config())
    model.load_state_dict(state)
    m = mesh((dist.get_world_size(),), ("ep",))  # the hessian's norm feeds the router: its tangents cross the experts
    return _model_row(model, *hpf.shard(model, hpf.ShardingPlan.from_hf(model, ep_axis="ep"), m),
                      keys=("model.layers.0.post_attention_layernorm.weight",))


def _fsdp_row(state, shape, names) -> Row:
    """FSDP over dp (each dp rank computes on its rows of the global batch; the dp-mean of its loss
    is the global loss), alone or over TP; blocks reshard after their forward (recomputed under
    torch.func)."""
    model = build_hf("llama", state, **LLAMA)
    m = mesh(shape, names)
    plan = hpf.ShardingPlan.from_hf(model) if "tp" in names else {}
    apply_fn, params, info = hpf.fsdp(*hpf.shard(model, plan, m), m, "dp")
    dp = C.AxisGroup.from_mesh(m, "dp")
    n, r = dp.size, dp.rank
    row = _model_row(model, apply_fn, params, info, batch=n,
                     split=lambda s: {k: C.split_to(v, 0, dp) for k, v in s.items()})
    local_loss = row.loss
    row.loss = lambda p, x: local_loss(p, x.chunk(n)[r])
    row.mean = lambda t: C.raw_all_reduce(t.detach(), dp) / n
    row.examples = _stacked(2, n, 40)  # example i: one row per dp rank (its gradient: the dp-mean of theirs)
    return row


def row_fsdp(state):
    return _fsdp_row(state, (dist.get_world_size(),), ("dp",))


def row_fsdp_tp(state):
    return _fsdp_row(state, (2, 2), ("dp", "tp"))


def _causal_lm_loss(logits, target):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), target[:, 1:].reshape(-1))


def row_gpipe(state):
    """2 stages of one layer each (pp 2), 2 micro-batches; the loss on the last stage.  The hessian
    is taken w.r.t. one norm weight per stage, concatenated (rank-invariant) and split over pp."""
    model = build_hf("llama", state, **{**LLAMA, "num_hidden_layers": 2})
    m = mesh((2, 1), ("pp", "tp"))
    stage = hpf.pipeline_split(model, 2)[m.get_local_rank("pp")]
    apply_fn, params, info = hpf.shard_stage(model, stage, {}, m)
    step = hpf.gpipe(apply_fn, stage, m, _causal_lm_loss, 2, hidden_size=LLAMA["hidden_size"])
    pp, pp_group = C.AxisGroup.from_mesh(m, "pp"), m.get_group("pp")
    full = {k: v.detach() for k, v in model.named_parameters()}
    norms = ("model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight")

    def unshard(g):  # every stage's gradients: each stage's own keys
        return {k: v for part in all_gather_objects({k: v.detach() for k, v in g.items()}, pp_group)
                for k, v in part.items()}

    def last(t):  # the last stage's value, on every stage
        return C.raw_all_reduce(t.detach() if stage.is_last else torch.zeros_like(t), pp)

    return Row(loss=lambda p, x: step(p, x, x), ref=lambda p, x: _hf_loss(lambda q, **a: functional_call(model, q, (), a), p, x),
               params={k: v.detach() for k, v in params.items()}, full=full, unshard=unshard,
               local=lambda d: {k: d[k] for k in params}, batches=_stacked(2, 2, 20), examples=_stacked(2, 2, 40),
               hessian_of={"norms": torch.cat([full[k] for k in norms])}, mean=last,
               split=lambda s: {norms[stage.index]: C.split_to(s["norms"], 0, pp)},
               ref_split=lambda s: dict(zip(norms, s["norms"].chunk(2), strict=True)))


def Net() -> BufferNet:  # the model of this row, with tanh: its second derivatives do not vanish
    return BufferNet(torch.tanh)


def make_net_state():
    torch.manual_seed(0)
    net = Net().double()  # fp64: BatchNorm's division amplifies fp32 rounding in the second derivatives
    with torch.no_grad():
        net.norm.weight.uniform_(0.5, 1.5)
        net.norm.bias.uniform_(-0.5, 0.5)
        net.norm.running_mean.uniform_(-1, 1)
    return net.state_dict()


def _with(buffers: dict[str, Tensor], x: Tensor) -> dict[str, Tensor]:
    """Fresh buffers carrying ``x``'s transforms (batched under vmap, as torch.func requires of a
    buffer updated from batched values; docs/training.md#buffers-model-state)."""
    zero = x.reshape(-1)[0] * 0
    return {k: b.clone() + zero.to(b.dtype) for k, b in buffers.items()}


def row_buffers(state):
    """The model's state through ``buffers=``: a fresh copy per call, updated by the forward (BatchNorm
    in training mode, an in-place counter); the loss of the output, against ``functional_call``."""
    model = Net().double()
    model.load_state_dict(state)
    m = mesh()
    batch = (torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0)),)  # [batch, features]
    apply_fn, params, info = hpf.shard(model, {"up": hpf.Colwise(), "down": hpf.Rowwise()}, m, example_inputs=batch)
    buffers, _ = hpf.buffers(apply_fn)
    tp = C.AxisGroup.from_mesh(m, "tp")
    full = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, x):
        out, _ = apply_fn(p, x, buffers=_with(buffers, x))
        return out.pow(2).mean()

    def ref(p, x):
        return functional_call(model, (p, _with(buffers, x)), (x,)).pow(2).mean()

    def xs(k, seed):
        return torch.randn(k, 6, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)

    return Row(loss=loss, ref=ref, params={k: v.detach() for k, v in params.items()}, full=full,
               unshard=lambda g: hpf.unshard(g, info), local=lambda d: {k: slice_local(d[k], info[k]) for k in info},
               batches=xs(2, 1), examples=xs(2, 2)[:, :3],
               hessian_of={"up.bias": full["up.bias"], "norm.weight": full["norm.weight"]},
               split=lambda s: {"up.bias": C.split_to(s["up.bias"], 0, tp), "norm.weight": s["norm.weight"]})


ROWS: dict[str, tuple[Callable, int, Callable]] = {  # row -> (state maker, world size, row builder)
    "tp": (lambda: make_hf_state("llama", **LLAMA), 2, row_tp),
    "sp": (lambda: make_hf_state("llama", **LLAMA), 2, row_sp),
    "cp": (lambda: make_hf_state("llama", **LLAMA), 2, row_cp),
    "ep": (make_moe_state, 2, row_ep),
    "fsdp": (lambda: make_hf_state("llama", **LLAMA), 2, row_fsdp),
    "fsdp_tp": (lambda: make_hf_state("llama", **LLAMA), 4, row_fsdp_tp),
    "gpipe": (lambda: make_hf_state("llama", **{**LLAMA, "num_hidden_layers": 2}), 2, row_gpipe),
    "recompute": (lambda: make_hf_state("llama", **LLAMA), 2, row_recompute),
    "buffers": (make_net_state, 2, row_buffers),
}


def case_row(name: str, state, columns: tuple[str, ...]):
    torch.manual_seed(0)
    return _cells(ROWS[name][2](state), columns)


# ---------------------------------------------------------------- the matrix
REFUSED_EP_VMAP = "expert parallelism under torch.func.vmap of the routed tokens"
#: What each cell must give: "exact", or the text of the hp_functional error that refuses it.
EXPECTED: dict[str, dict[str, str]] = {row: dict.fromkeys(COLUMNS, "exact") for row in ROWS}
EXPECTED["ep"].update(vmap=REFUSED_EP_VMAP, vmap_grad=REFUSED_EP_VMAP)
#: The cells of the fast subset (the rest are marked slow): the TP row, and FSDP × TP's HVP and per-example grads.
FAST = {("tp", c) for c in COLUMNS} | {("fsdp_tp", "jvp_grad"), ("fsdp_tp", "vmap_grad")}

_results: dict[tuple[str, bool], list[dict]] = {}  # (row, fast) -> every rank's cells, computed once


def _row(name: str, fast: bool) -> list[dict]:
    """The row's cells of one subset (fast or slow), from one pool run."""
    key = (name, fast)
    if key not in _results:
        make_state, world, _ = ROWS[name]
        columns = tuple(c for c in COLUMNS if ((name, c) in FAST) == fast)
        _results[key] = get_pool(world).run(case_row, name, make_state(), columns)
    return _results[key]


def _cell_params():
    for name in ROWS:
        for col in COLUMNS:
            marks = () if (name, col) in FAST else (pytest.mark.slow,)
            yield pytest.param(name, col, marks=marks, id=f"{name}-{col}")


@pytest.mark.parametrize("row,column", list(_cell_params()))
def test_cell(row, column):
    """One cell: exact against the unsharded model on every rank, or refused by name on every rank."""
    outcomes = [cells[column] for cells in _row(row, (row, column) in FAST)]
    expected = EXPECTED[row][column]
    for rank, outcome in enumerate(outcomes):
        if expected == "exact":
            assert outcome[0] == "exact", f"rank {rank}: {outcome}"
        else:
            assert outcome[0] == "refused" and expected in outcome[2], f"rank {rank}: {outcome}"
    if expected == "exact":
        print(f"{row} x {column}: worst difference {max(o[1] for o in outcomes):.1e}")


def case_refusals(llama_state, pipe_state):
    """What cannot be exact is refused by name on every rank: FSDP's ``no_sync`` (gradients kept
    across calls) under ``vmap(grad)``, and a pipeline whose stages are transformed differently
    (another vmap batch size per stage), which would otherwise hang in a transfer."""
    errors = {}
    model = build_hf("llama", llama_state, **LLAMA)
    m = mesh((dist.get_world_size(),), ("dp",))
    f_apply, f_params, _ = hpf.fsdp(*hpf.shard(model, {}, m), m, "dp")
    with f_apply.fsdp.no_sync():
        try:
            vmap(grad(lambda p, x: _hf_loss(f_apply, p, x)), in_dims=(None, 0))(
                {k: v.detach() for k, v in f_params.items()}, _stacked(2, 1, 3))
        except hpf.PlanError as exc:
            errors["no_sync"] = str(exc)
    pipe = row_gpipe(pipe_state)
    batch = 2 + dist.get_rank()  # stage 0 vmaps 2 batches, stage 1 three
    try:
        vmap(lambda x: pipe.loss(pipe.params, x))(_stacked(batch, 2, 5))
    except hpf.PlanError as exc:
        errors["gpipe"] = str(exc)
    return errors


def test_refused_by_name():
    per_rank = get_pool(2).run(case_refusals, make_hf_state("llama", **LLAMA),
                               make_hf_state("llama", **{**LLAMA, "num_hidden_layers": 2}))
    for errors in per_rank:
        assert "no_sync() keeps gradients across backward passes" in errors.get("no_sync", ""), errors
        assert "gpipe under torch.func: the stages' params/inputs/target carry different transforms" in errors.get(
            "gpipe", ""), errors
