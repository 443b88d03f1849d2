"""The gradient of what ``apply_fn`` returns is its gradient, on the models where it
was silently wrong, and the shard-time proof (dataflow pass + numeric probe) refuses what it
cannot make exact.

* Apertus (xIELU's learnable scalars on colwise-sharded features), Param2MoE and Sarvam-MoE
  (``q_norm``/``k_norm`` on sharded heads; their MoE forward cannot run on meta tensors, so the
  dataflow runs on the probe's real copy) with HF's own plans at tp 2 and tp 4;
* GLM4 under context parallelism: ``torch.func.grad`` of the loss is the full gradient, with
  no ``reduce_gradients`` call, and the cp reduction is one bucketed all-reduce, not one per
  parameter; under ``hpf.fsdp`` over ``("dp", "cp")`` (dp 2 × cp 2) that sum is folded into
  FSDP's reduce-scatter (no cp all-reduce in the backward);
* the probe refuses a plan whose gradients are wrong (the dataflow pass switched off on purpose)
  on every rank, naming the parameter; ``verify=False`` then shows that those gradients really
  are wrong.
Each: loss and every gradient vs the unsharded model, ``.backward()`` and ``torch.func.grad``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard
from torch.func import grad_and_value

import hp_functional as hpf
from tests.conftest import get_pool
from tests.support.helpers import assert_close, mesh, raised, rank, world

TINY_MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)  # the defaults: 26M parameters
FAMILIES = {
    "apertus": {},
    "param2moe": TINY_MOE,
    "sarvam_moe": TINY_MOE,
}


def _config(family: str, **overrides):
    from transformers import AutoConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0)
    kw.update(overrides)
    config = AutoConfig.for_model(family, **kw)
    config._attn_implementation = "eager"
    return config


def _model(family: str, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family, **overrides))
    with torch.no_grad():  # non-trivial scalars and norm weights, so their gradients are really checked
        for p in model.parameters():
            if p.dim() < 2:
                p.uniform_(0.5, 1.5)
    return model


def _ids(seq: int = 16) -> torch.Tensor:
    return torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(1))


def _check(apply_fn, params, info, model, kwargs) -> dict[str, float]:
    """Loss and every gradient under .backward() and torch.func.grad vs the unsharded model."""
    ref = model(**kwargs)
    ref.loss.backward()
    ref_grads = {k: p.grad for k, p in model.named_parameters()}
    out = apply_fn(params, **kwargs)
    out.loss.backward()
    backward = {k: p.grad for k, p in params.items()}
    functional, loss = grad_and_value(lambda p: apply_fn(p, **kwargs).loss)(params)
    diffs = {"loss": assert_close(loss.detach(), ref.loss.detach(), "loss")}
    for label, grads in (("backward", backward), ("grad", functional)):
        full = hpf.unshard(grads, info)
        diffs[label] = max(assert_close(full[k], g, f"{label} grad {k}") for k, g in ref_grads.items())
    return diffs


def case_family_tp(family: str):
    model = _model(family, **FAMILIES[family])
    m = mesh((world(),), ("tp",))
    apply_fn, params, info = hpf.shard(model, hpf.ShardingPlan.from_hf(model), m)
    checks = apply_fn.runtime.checks
    assert checks["probe"] == "exact on the probe copy", checks
    ids = _ids()
    return {**_check(apply_fn, params, info, model, dict(input_ids=ids, labels=ids)), **checks}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.slow
def test_replicated_parameters_in_sharded_regions(pool, family):
    out = pool.run(case_family_tp, family)[0]
    print(family, pool.world, out)
    if family != "apertus":  # their MoE forward does not run on meta tensors: traced on the probe's real copy
        assert out["dataflow"] == "traced on the probe's real copy", out


def case_cp_gradient(family: str):
    model = _model(family)
    m = mesh((world(),), ("cp",))
    plan = hpf.ShardingPlan.from_hf(model, cp_axis="cp")
    apply_fn, params, info = hpf.shard(model, plan, m)
    ids = _ids(8 * world())
    diffs = _check(apply_fn, params, info, model, dict(input_ids=ids, labels=ids))
    # the cp reduction: one bucketed all-reduce in the backward, not one per parameter
    e = hpf.explain(model, plan, m, input_ids=ids, labels=ids)
    rows = [r for r in e.schedule.rows if r.axis == "cp" and r.op == "all_reduce" and r.direction == "bwd"]
    diffs["cp all_reduce bwd"] = len(rows)
    diffs["parameters"] = len(params)
    return diffs


@pytest.mark.slow
def test_context_parallel_gradient_is_the_gradient(pool):
    out = pool.run(case_cp_gradient, "glm4")[0]
    print(f"glm4 cp {pool.world}: {out}")
    assert out["cp all_reduce bwd"] == 1 < out["parameters"], out


def case_probe_refuses(family: str):
    """The dataflow pass switched off (as if it had missed the parameters): the probe refuses the
    plan on every rank, under ``torch.no_grad()`` too; with verify=False the gradients are indeed wrong."""
    from hp_functional.compile import build
    from hp_functional.compile.dataflow import Dataflow

    model = _model(family)
    m = mesh((world(),), ("tp",))
    plan = hpf.ShardingPlan.from_hf(model)
    original = build.trace_dataflow
    build.trace_dataflow = lambda *a, **k: Dataflow({})
    try:
        with pytest.raises(hpf.PlanError) as refused:
            hpf.shard(model, plan, m)
        with torch.no_grad(), pytest.raises(hpf.PlanError) as refused_no_grad:  # the probe takes gradients anyway
            hpf.shard(model, plan, m)
        assert str(refused_no_grad.value) == str(refused.value)
        apply_fn, params, info = hpf.shard(model, plan, m, verify=False)
    finally:
        build.trace_dataflow = original
    ids = _ids()
    try:
        _check(apply_fn, params, info, model, dict(input_ids=ids, labels=ids))
        wrong = ""
    except AssertionError as exc:
        wrong = str(exc).splitlines()[0]
    return str(refused.value), wrong, apply_fn.runtime.checks["probe"]


def test_probe_refuses_a_wrong_gradient():
    for message, wrong, probe in get_pool(2).run(case_probe_refuses, "apertus"):
        assert "shard-time probe" in message and "act_fn.alpha" in message, message
        assert "grad model.layers" in wrong and "act_fn.alpha" in wrong, wrong  # the gradient it refused is wrong
        assert probe == "skipped: verify=False"


class _Scaled(torch.nn.Module):
    """An MLP whose forward takes a second argument: no batch can be synthesized for it."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x, scale):
        return self.down(torch.relu(self.up(x))) * scale


def case_no_batch():
    """What the proof could not see is said, and a plan nothing proves is refused by name unless
    accepted knowingly (``allow_unproved``); a batch (``example_inputs``) lets both run; a model
    that starts with a linear layer gets a synthesized one."""
    torch.manual_seed(0)
    plan, m = {"up": hpf.Colwise(), "down": hpf.Rowwise()}, mesh((world(),), ("tp",))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    model = _Scaled()
    refused = raised(hpf.shard, model, plan, m)
    apply_fn, params, _ = hpf.shard(model, plan, m, allow_unproved=True)
    assert_close(apply_fn(params, x, 2.0), model(x, 2.0), "output")
    unproved = apply_fn.runtime.checks
    proved = hpf.shard(model, plan, m, example_inputs=(x, 2.0))[0].runtime.checks
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    synthesized = hpf.shard(mlp, {"0": hpf.Colwise(), "2": hpf.Rowwise()}, m)[0].runtime.checks
    # traced, but a style that runs a function of its own (a Local) where the probe has no values (meta inputs)
    local = hpf.Local(lambda module, axes, h: axes["tp"].all_reduce(torch.nn.functional.linear(h, module.weight)),
                      in_dst={0: Shard(-1)}, params={"weight": Shard(1)})
    opaque = raised(hpf.shard, mlp, {"0": hpf.Colwise(), "2": local}, m, example_inputs=(x.to("meta"),))
    return refused, unproved, proved, synthesized, opaque


def test_proof_reports_what_it_cannot_see():
    refused, unproved, proved, synthesized, opaque = get_pool(2).run(case_no_batch)[0]
    assert opaque[0] == "PlanError" and "cannot see inside 2 (a style that runs a function of its own)" in opaque[1], opaque
    assert "example_inputs are meta tensors" in opaque[1], opaque
    assert refused[0] == "PlanError" and "nothing proves" in refused[1] and "allow_unproved=True" in refused[1], refused
    assert "missing 1 required positional argument" in refused[1] and "example_inputs" in refused[1], refused
    assert unproved["proof"].startswith("unproved (allow_unproved=True)"), unproved
    assert "does not take the synthesized batch" in unproved["probe"], unproved
    assert proved["proof"] == "the probe and the dataflow pass", proved
    assert synthesized["proof"] == "the probe and the dataflow pass", synthesized


def case_probe_memo():
    from hp_functional.runtime.probe import ProbeCache

    model = _model("apertus")
    plan = hpf.ShardingPlan.from_hf(model)
    cache = ProbeCache()  # the caller's own: the process's default is not touched
    first = hpf.shard(model, plan, mesh(), probe_cache=cache)[0].runtime.checks["probe"]
    again = hpf.shard(model, plan, mesh(), probe_cache=cache)[0].runtime.checks["probe"]
    remembered = len(cache)
    if rank() == 0:  # one rank forgets: every rank must probe again (the decision is agreed, or ranks would hang)
        cache = ProbeCache()
    third = hpf.shard(model, plan, mesh(), probe_cache=cache)[0].runtime.checks["probe"]
    unremembered = hpf.shard(model, plan, mesh(), probe_cache=None)[0].runtime.checks["probe"]
    return first, again, third, unremembered, remembered


def test_probe_verdicts_are_remembered_and_the_decision_agreed():
    """The same structure, plan and mesh is probed once per cache (``shard(probe_cache=)``); whether
    to skip is decided in ``shard()``'s one agreement all-gather, so one rank's cache never leaves
    the others waiting; ``probe_cache=None`` always probes."""
    for first, again, third, unremembered, remembered in get_pool(2).run(case_probe_memo):
        assert first == "exact on the probe copy", first
        assert again == "exact on the probe copy (probed before in this process: same structure, plan and mesh)", again
        assert third == unremembered == "exact on the probe copy", (third, unremembered)
        assert remembered == 1


def case_fsdp_folds_cp(family: str, axis):
    """dp 2 × cp 2, FSDP over ``axis``: each dp rank its own rows, the full sequence on every cp
    rank.  Over ("dp", "cp") the cp sum is folded into the reduce-scatter (torchtitan's
    ``dp_shard_cp``): no all-reduce on cp in the backward; over "dp" alone one per bucket.  Either
    way the gradient (mean over dp) is the unsharded model's on the global batch."""
    from tests.train.test_fsdp import Collectives

    model = _model(family)
    m = mesh((2, 2), ("dp", "cp"))
    apply_fn, params, info = hpf.fsdp(*hpf.shard(model, hpf.ShardingPlan.from_hf(model, cp_axis="cp"), m), m, axis)
    owed = {a for i in info.values() for a in i.axes_of(hpf.ReducedOver)}
    assert owed == (set() if axis == ("dp", "cp") else {"cp"}), owed  # ReducedOver: the sums apply_fn does
    ids = _ids(16)
    ref = model(input_ids=torch.cat([ids, ids.flip(0)]), labels=torch.cat([ids, ids.flip(0)]))
    ref.loss.backward()
    rows = (ids, ids.flip(0))[m["dp"].get_local_rank()]
    kwargs = dict(input_ids=rows, labels=rows)
    out = apply_fn(params, **kwargs)
    with Collectives() as counted:  # the backward's
        out.loss.backward()
    functional, loss = grad_and_value(lambda p: apply_fn(p, **kwargs).loss)(params)
    cp_group, dp_group = m["cp"].get_group().group_name, m["dp"].get_group().group_name
    diffs = {"loss": assert_close(hpf.reduce_gradients({"l": loss.detach()}, {"l": hpf.ShardInfo(
        (torch.distributed.tensor.Replicate(),) * 2, m, loss.shape, loss.shape, ())}, m, dp_axis="dp")["l"],
        ref.loss.detach(), "loss"),
        "cp all_reduce": counted.counts.get(("all_reduce", cp_group), 0),
        "dp reduce_scatter": counted.counts.get(("reduce_scatter_tensor", dp_group), 0),
        "reduce_scatter": sum(n for (op, _), n in counted.counts.items() if op == "reduce_scatter_tensor"),
        "groups": len(apply_fn.fsdp.groups)}
    for label, grads in (("backward", {k: p.grad for k, p in params.items()}), ("grad", functional)):
        full = hpf.unshard(grads, info)
        diffs[label] = max(assert_close(full[k], p.grad, f"{label} grad {k}") for k, p in model.named_parameters())
    _, norm = hpf.clip_grad_norm(functional, info, 1.0)  # the flattened layout counts every row once
    diffs["norm"] = assert_close(norm, torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]), "norm")
    return diffs


@pytest.mark.parametrize("axis", [("dp", "cp"), "dp"], ids=["dp_shard_cp", "dp"])
@pytest.mark.slow
def test_fsdp_folds_the_context_parallel_sum(axis):
    out = get_pool(4).run(case_fsdp_folds_cp, "glm4", axis)[0]
    print(f"glm4 dp 2 x cp 2, fsdp over {axis}: {out}")
    assert out["reduce_scatter"] == out["groups"], out
    if axis == "dp":
        assert out["cp all_reduce"] > 0 and out["dp reduce_scatter"] == out["groups"], out
    else:
        assert out["cp all_reduce"] == 0 and out["dp reduce_scatter"] == 0, out


def _forgetful_mlp(module, axes, x):
    """A hand-written TP MLP that forgets its all-reduce: each rank returns its partial sum as if
    it were the whole output (the classic bug of a hand-written row-parallel layer)."""
    return module.down_proj(module.act_fn(module.gate_proj(x)) * module.up_proj(x))


def case_probe_refuses_a_wrong_loss():
    """A plan whose forward is not the model's: the probe refuses it by its loss, on every rank."""
    from torch.distributed.tensor import Shard
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=4, attn_implementation="eager"))
    mlp = hpf.Local(_forgetful_mlp, params={"gate_proj.weight": Shard(0), "up_proj.weight": Shard(0),
                                            "down_proj.weight": Shard(1)})
    with pytest.raises(hpf.PlanError) as refused:
        hpf.shard(model, {"model.layers.*.mlp": mlp}, mesh((world(),), ("tp",)))
    return str(refused.value)


def test_probe_refuses_a_wrong_loss():
    for message in get_pool(2).run(case_probe_refuses_a_wrong_loss):
        assert "shard-time probe" in message and "the sharded loss" in message, message


class ConstantBranch(nn.Module):
    """A colwise/rowwise pair on data computed from parameters and constants alone (MarkupLM's
    xpath embeddings of padding ids when no xpath is given), added to the residual stream."""

    def __init__(self, vocab=32, d=16):
        super().__init__()
        self.embed, self.table = nn.Embedding(vocab, d), nn.Embedding(4, d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, input_ids):
        pad = torch.ones(input_ids.shape, dtype=torch.long)  # constant ids: no data flows from the input
        x = self.embed(input_ids) + self.down(torch.relu(self.up(self.table(pad))))
        return self.head(self.norm(x)).square().mean()


def test_a_pair_on_parameter_derived_data_leaves_the_stream_replicated():
    """The rowwise all-reduce makes the pair's output replicated even when no input data reaches
    it; the dataflow pass treated it as still split, and the norm after it got its gradient
    all-reduced (twice the true one: silently wrong with verify=False, refused by the probe)."""
    torch.manual_seed(0)
    model = ConstantBranch()
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    model(ids).backward()
    ref = {k: p.grad.clone() for k, p in model.named_parameters()}

    def rank(mesh):
        apply_fn, params, info = hpf.shard(model, {"up": hpf.Colwise(), "down": hpf.Rowwise()}, mesh, verify=False)
        grads = torch.func.grad(lambda p: apply_fn(p, ids))(params)
        full = hpf.unshard(grads, info)
        return [k for k, g in ref.items() if not torch.allclose(full[k], g, atol=1e-6)]

    assert hpf.emulate(rank, (2,), ("tp",)) == [[], []]


def case_returned_parameter() -> dict[str, float]:
    from hp_functional.tools.sweep import build

    m = mesh()
    model, inputs, _, _ = build("gpt_neox_japanese", world())
    plan = hpf.auto_plan(model, m, example_inputs=inputs)
    assert isinstance(plan.entries["gpt_neox_japanese.layers.*.attention"], hpf.Heads)
    apply_fn, params, info = hpf.shard(model, plan, m, verify=False, example_inputs=inputs)
    assert apply_fn.runtime.checks["dataflow"].startswith("traced"), apply_fn.runtime.checks
    steps = apply_fn.runtime.program.param_steps
    assert not any("dense_bias" in k for k in steps), [k for k in steps if "dense_bias" in k]
    return _check(apply_fn, params, info, model, inputs)


@pytest.mark.slow
def test_a_parameter_the_attention_only_returns_takes_no_reduction():
    """GPT-NeoX-Japanese's attention (rank-varying: its heads split) returns its
    ``dense_bias`` beside its output, and the layer adds it to the residual stream after the
    rowwise reduce: every rank already has its whole gradient.  The module tree alone reduced it
    (twice the gradient, refused only by the probe); the dataflow pass sees it used with
    replicated data only, and the plan is exact with the probe off."""
    print(get_pool(2).run(case_returned_parameter)[0])


class GainAttention(nn.Module):
    """Attention whose heads are split (``Heads`` over colwise q/k/v and a rowwise o) holding a
    replicated ``gain``, used per ``use``: on the head-split values before ``o`` (rank-varying:
    each rank has a share of its gradient), on ``o``'s reduced output (replicated: each rank has
    the whole gradient), or both."""

    def __init__(self, use: str, d: int = 16, heads: int = 4):
        super().__init__()
        self.use, self.num_heads = use, heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.gain = nn.Parameter(torch.tensor(1.3))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (m(x).view(b, s, self.num_heads, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, -1)
        varying = a * self.gain if self.use in ("varying", "both") else a
        out = self.o(varying)
        return out * self.gain if self.use in ("replicated", "both") else out


class GainNet(nn.Module):
    def __init__(self, use: str):
        super().__init__()
        self.embed, self.attn = nn.Embedding(32, 16), GainAttention(use)
        self.norm, self.head = nn.LayerNorm(16), nn.Linear(16, 32)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        return self.head(self.norm(x + self.attn(x))).square().mean()


def test_a_head_split_modules_parameter_is_reduced_by_its_uses():
    """The trace decides the reduction of a replicated parameter of a head-split module (not a
    region) from its uses, exact with the probe off: used with rank-varying data only it keeps its
    all-reduce; with replicated data only it takes none (the rule of GPT-NeoX-Japanese's
    ``dense_bias``); with both, one conversion cannot give both uses their gradient (kept, the
    replicated use's gradient is counted once per rank; taken away, the varying use's is a share):
    refused by name on every rank."""
    plan = {"attn": hpf.Heads(), **{f"attn.{n}": hpf.Colwise() for n in "qkv"}, "attn.o": hpf.Rowwise()}
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    models, refs = {}, {}
    for use in ("varying", "replicated", "both"):
        torch.manual_seed(0)
        models[use] = GainNet(use)
        models[use](ids).backward()
        refs[use] = {k: p.grad.clone() for k, p in models[use].named_parameters()}

    def rank(m):
        out = {}
        for use in ("varying", "replicated"):
            apply_fn, params, info = hpf.shard(models[use], plan, m, verify=False)
            steps = [(s.axis, s.collective.name) for s in apply_fn.runtime.program.param_steps.get("attn.gain", ())]
            full = hpf.unshard(torch.func.grad(lambda p, f=apply_fn: f(p, ids))(params), info)
            out[use] = steps, max(assert_close(full[k], g, f"{use}: grad {k}") for k, g in refs[use].items())
        with pytest.raises(hpf.PlanError) as refused:  # before any collective: the trace is local
            hpf.shard(models["both"], plan, m, verify=False)
        out["both"] = str(refused.value)
        return out

    for out in hpf.emulate(rank, (2,), ("tp",)):
        assert out["varying"][0] == [("tp", "copy_to")] and out["replicated"][0] == [], out
        assert "parameter attn.gain is used both" in out["both"] and "'tp'" in out["both"], out["both"]
