"""validate(): passes on correct plans, names the culprit on deliberately broken ones; the DTensor
mode names (module, expected, actual) where a declared placement disagrees with DTensor."""

import dataclasses

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import hp_functional as hpf
from hp_functional import PlacementMismatchError, ValidationError, validate, validate_placements
from tests.support.helpers import build_hf, make_hf_state, mesh, world
from tests.support.models import MLP, make_mlp_state
from tests.support.snapshot import assert_unchanged, snapshot


@dataclasses.dataclass(frozen=True)
class RowwiseNoReduce(hpf.Rowwise):
    """Broken on purpose: declares the output Replicate where it is Partial, so the reduction is skipped."""

    def spec(self, module, fqn, axis):
        return dataclasses.replace(super().spec(module, fqn, axis), out_src={"output": {axis: Replicate()}})


@dataclasses.dataclass(frozen=True)
class VocabEmbeddingWrongOffset(hpf.VocabEmbedding):
    """Broken on purpose: every rank looks its ids up at the next rank's vocabulary offset."""

    def local_forward(self, module, forward, *, fqn, axis, axes):
        g = axes[axis]
        wrong = {**axes, axis: dataclasses.replace(g, rank=(g.rank + 1) % g.size)}
        return super().local_forward(module, forward, fqn=fqn, axis=axis, axes=wrong)


def sp_norm_without_grad_reduce() -> hpf.ModuleSpec:
    """A SequenceParallel norm forced invariant (``varying=False``), so the module tree alone would
    never all-reduce its weight gradient (from this rank's tokens only); the dataflow pass sees the
    weight meet sequence-sharded data and reduces it anyway (exact: ``test_validate_passes_...``)."""
    seq = {"tp": Shard(1)}
    return hpf.ModuleSpec(in_src={0: seq}, in_dst={0: seq}, out_src={"output": seq}, out_dst={"output": seq}, varying=False)


MLP_SP = {  # Megatron-SP inside a root boundary: full input and output, sequence-sharded in between
    "": hpf.ModuleSpec(in_src={0: {"tp": Replicate()}}, in_dst={0: {"tp": Shard(1)}},
                       out_src={"output": {"tp": Shard(1)}}, out_dst={"output": {"tp": Replicate()}}),
    "norm": hpf.SequenceParallel(),
    "up": hpf.Colwise(input_layout=Shard(1)),
    "down": hpf.Rowwise(output_layout=Shard(1)),
}
L = "model.layers.*"
SETUPS = {  # name -> (model, plan entries on top of its base plan)
    "llama_hf": ("llama", {}),
    "llama_sp": ("llama_sp", {}),
    "llama_sp_2d": ("llama_sp", {}),  # on a (dp, tp) mesh, each dp group with its own batch
    "mlp_tp": ("mlp", {"up": hpf.Colwise(), "down": hpf.Rowwise()}),
    "mlp_sp": ("mlp", MLP_SP),
    "mlp_partial": ("mlp", {"up": hpf.Colwise(), "down": hpf.Rowwise(output_layout=Partial())}),  # output left unreduced
    "broken_rowwise": ("llama", {"model.layers.1.self_attn.o_proj": RowwiseNoReduce()}),
    "broken_mlp_rowwise": ("mlp", {"up": hpf.Colwise(), "down": RowwiseNoReduce()}),
    "sp_norm_forced_invariant": ("llama_sp", {f"{L}.input_layernorm": sp_norm_without_grad_reduce()}),
    "broken_vocab_offset": ("llama", {"model.embed_tokens": VocabEmbeddingWrongOffset()}),
    "broken_declared_input": ("llama_sp", {"model.layers.0": hpf.PrepareInput({"hidden_states": (Shard(1), Shard(1))})}),
}


def setup(name: str, states: dict, labels: bool = True):
    """(model, plan, mesh, args, kwargs) of a named setup, built inside a rank."""
    kind, extra = SETUPS[name]
    m = mesh((world() // 2, 2), ("dp", "tp")) if name.endswith("_2d") else mesh()
    if kind == "mlp":
        model = MLP()
        model.load_state_dict(states["mlp"])
        x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
        return model, hpf.ShardingPlan(extra), m, (x,), {}
    model = build_hf("llama", states["llama"])
    base = hpf.llama_sp_plan().entries if kind == "llama_sp" else hpf.ShardingPlan.from_hf(model).entries
    dp = m.size(0) if m.ndim == 2 else 1
    ids = torch.randint(0, 128, (2 * dp, 8), generator=torch.Generator().manual_seed(7))
    ids = ids.chunk(dp)[m["dp"].get_local_rank()] if dp > 1 else ids
    return model, hpf.ShardingPlan({**base, **extra}), m, (), {"input_ids": ids, **({"labels": ids} if labels else {})}


@pytest.fixture(scope="module")
def states():
    return {"llama": make_hf_state("llama"), "mlp": make_mlp_state()}


def case_validate(name: str, states: dict):
    model, plan, m, args, kwargs = setup(name, states)
    before = snapshot(model)
    report = validate(model, plan, m, *args, raise_on_failure=False, **kwargs)
    assert_unchanged(before, snapshot(model))  # hooks and gradients landed on private copies only
    error = None
    try:
        report.raise_if_failed()
    except ValidationError as exc:
        error = str(exc)
    return {
        "ok": report.ok, "text": str(report), "error": error,
        "modules": [(d.name, d.what, d.ok) for d in report.modules],
        "params": [(d.name, d.ok) for d in report.params],
        "replicas": [(r.param, r.axis) for r in report.mismatched_replicas],
        "n_params": len(dict(model.named_parameters())),
    }


@pytest.mark.parametrize("name", ["llama_hf", "llama_sp", "llama_sp_2d", "mlp_tp", "mlp_sp", "mlp_partial",
                                  "sp_norm_forced_invariant"])
def test_validate_passes_on_correct_plans(pool, states, name):
    results = pool.run(case_validate, name, states)
    r = results[0]
    assert r["ok"], r["text"]
    assert all(x == r for x in results), "every rank gets the same report"
    assert len(r["params"]) == r["n_params"] and r["modules"], r["text"]
    assert not r["replicas"] and r["error"] is None


BROKEN = {  # name -> the module the report must name first (a gradient-only divergence, an unreduced
    # norm weight, is no longer possible: the dataflow pass reduces it, see "sp_norm_forced_invariant" above)
    "broken_rowwise": "model.layers.1.self_attn.o_proj",
    "broken_mlp_rowwise": "down",
    "broken_vocab_offset": "model.embed_tokens",
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_validate_names_the_broken_module(pool, states, name):
    module = BROKEN[name]
    r = pool.run(case_validate, name, states)[0]
    assert not r["ok"], r["text"]
    first_line = r["error"].splitlines()[0]
    failing_modules = [m for m, _, ok in r["modules"] if not ok]
    assert failing_modules[0] == module, r["text"]  # the first divergence, ahead of what inherits it
    assert f"first diverging module {module} " in first_line, first_line
    assert not any(ok for _, _, ok in r["modules"][: len(failing_modules)]), "failing rows come first"


def case_dtensor(name: str, states: dict):
    model, plan, m, args, kwargs = setup(name, states, labels=False)
    before = snapshot(model)
    report = validate(model, plan, m, *args, mode="dtensor", raise_on_failure=False, **kwargs)
    found = [(e.module, e.expected, e.actual, e.stage, e.key) for e in report.placement_mismatches]
    raised = None
    try:
        validate_placements(model, plan, m, *args, **kwargs)
    except PlacementMismatchError as exc:
        raised = (exc.module, exc.expected, exc.actual, exc.stage, str(exc))
    quiet = validate_placements(model, plan, m, *args, raise_on_failure=False, **kwargs)
    assert [(e.module, e.stage) for e in quiet] == [f[0:1] + f[3:4] for f in found]  # validate's keyword
    assert_unchanged(before, snapshot(model))
    return report.ok, report.placements_checked, found, raised, str(report)


@pytest.mark.parametrize("name", ["llama_hf", "llama_sp", "mlp_tp", "mlp_sp"])
def test_dtensor_mode_agrees_with_correct_plans(pool, states, name):
    ok, checked, found, raised, text = pool.run(case_dtensor, name, states)[0]
    assert ok and not found and raised is None, text
    assert checked >= 4, text


@pytest.mark.parametrize("name,module,expected,actual,stage", [
    ("broken_rowwise", "model.layers.1.self_attn.o_proj", (Replicate(),), (Partial(),), "out_src"),
    ("broken_declared_input", "model.layers.0", (Shard(1),), (Replicate(),), "in_src"),
])
def test_dtensor_mode_raises_placement_mismatch(pool, states, name, module, expected, actual, stage):
    ok, _, found, raised, text = pool.run(case_dtensor, name, states)[0]
    assert not ok and len(found) == 1, text
    assert found[0][:4] == (module, expected, actual, stage), found
    assert raised[:4] == (module, expected, actual, stage), raised
    assert raised[4].startswith(f"[{module}] {stage} placement mismatch"), raised[4]


def case_bad_input(states: dict):
    model, plan, _, args, _ = setup("mlp_tp", states)
    before = snapshot(model)
    errors = []
    for kwargs, kind in [({"mode": "jax"}, ValueError), ({"tolerance": -1.0}, ValueError), ({"loss_fn": 3}, TypeError),
                         ({"check_axes": ["dp"]}, ValueError), ({"mode": "dtensor", "loss_fn": sum}, ValueError)]:
        with pytest.raises(kind) as exc:
            validate(model, plan, mesh(), *args, **kwargs)
        errors.append(str(exc.value))
    with pytest.raises(hpf.PlanError, match="matches no module"):
        validate(model, {"upp": hpf.Colwise()}, mesh(), *args)
    with pytest.raises(RuntimeError):  # wrong input width: the (local) reference run raises first
        validate(model, plan, mesh(), torch.randn(2, 8, 5))
    assert_unchanged(before, snapshot(model))
    # nothing above reached a collective, or this one would hang or mix up messages
    assert validate(model, plan, mesh(), *args, loss_fn=lambda out: (out**2).mean()).ok
    return errors


def test_bad_input_raises_before_any_collective(pool, states):
    errors = pool.run(case_bad_input, states)[0]
    assert "mode 'jax'" in errors[0] and "tolerance" in errors[1] and "loss_fn" in errors[2], errors
    assert "check_axes" in errors[3] and "mode='numeric'" in errors[4], errors


def _local_attention():
    """examples/local_attention.py as a module (hand-written TP attention with ``hpf.Local``)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "local_attention.py"
    spec = importlib.util.spec_from_file_location("local_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def case_local_attention(states: dict, broken: bool):
    """The example's plan on an eager Llama, whose attention returns its weights where the
    ``Local`` returns None; ``broken``: the heads' partial sums declared Replicate, never reduced."""
    example = _local_attention()
    model = build_hf("llama", states["llama"])  # eager attention: output[1] is the attention weights
    plan = example.attention_plan()
    if broken:
        attention = plan["model.layers.*.self_attn"]
        plan["model.layers.*.self_attn"] = dataclasses.replace(attention, out_src={"output": Replicate()})
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(7))
    report = validate(model, plan, mesh(), input_ids=ids, labels=ids, raise_on_failure=False)
    return report.ok, str(report), [(d.name, d.what, d.ok, d.compared, d.note) for d in report.modules]


def test_local_attention_without_weights_is_not_a_divergence(pool, states):
    """The attention weights only the reference returns are "not compared",
    not a divergence of max|Δ| inf; everything both sides return is compared, and a real
    divergence of the same module is still reported."""
    ok, text, rows = pool.run(case_local_attention, states, False)[0]
    assert ok, text
    skipped = [r for r in rows if not r[3]]
    assert {(r[0], r[1]) for r in skipped} == {(f"model.layers.{i}.self_attn", "output[1]") for i in range(2)}, text
    assert all(r[2] and "not compared: the sharded run returns no tensor" in r[4] for r in skipped), text
    assert {(r[0], r[1]) for r in rows if r[3]} >= {(f"model.layers.{i}.self_attn", "output") for i in range(2)}, text
    assert "2 outputs not compared" in text.splitlines()[0], text
    ok, text, rows = pool.run(case_local_attention, states, True)[0]
    failing = [(r[0], r[1]) for r in rows if not r[2]]
    assert not ok and failing[0] == ("model.layers.0.self_attn", "output"), text


def test_to_full_refuses_a_placement_it_cannot_gather():
    """A stacked expert (or any placement to_full has no gather for) is refused before any
    collective, not returned as if the local shard were the full value."""
    import torch

    from hp_functional.core.collectives import AxisGroup
    from hp_functional.core.placement import StackedShard, to_full

    with pytest.raises(hpf.PlanError, match=r"to_full: no full value for placements \[StackedShard"):
        to_full(torch.ones(2), [StackedShard(0, 2)], [AxisGroup("ep", "unused", 2, 0)])
