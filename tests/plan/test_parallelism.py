"""The plan language knows no parallelism by name: ``ShardingPlan`` holds entries, axes by role and
settings, and each parallelism plugs in through ``core.parallelism`` (one line in
``parallel.PARALLELISMS``, or ``ShardingPlan(..., parallelisms=)``).  One spelling: the keywords
of the plan's fields only."""

import ast
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import hp_functional as hpf
from hp_functional.core.parallelism import Parallelism, Resolution
from hp_functional.core.program import Planned
from hp_functional.parallel import PARALLELISMS

PLAN_PY = Path(hpf.__file__).parent / "plan" / "plan.py"


def test_the_plan_has_no_field_for_any_parallelism():
    names = [f.name for f in dataclasses.fields(hpf.ShardingPlan)]
    assert names == ["entries", "axes", "settings", "optional_roles", "special_handlers", "handlers", "unplanned",
                     "parallelisms"]
    imported = {a.name for node in ast.walk(ast.parse(PLAN_PY.read_text())) if isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("parallel") for a in node.names}
    assert imported == {"PARALLELISMS"}, imported  # the registration tuple, nothing of any one parallelism
    assert [p.name for p in PARALLELISMS][:3] == ["tensor", "experts", "context"]
    owners = [name for p in PARALLELISMS for name in p.settings]
    assert len(owners) == len(set(owners)), "a setting has one owner"


@pytest.mark.parametrize("keyword", ["tp_axis", "cp_axis", "ep_axis", "loss_parallel", "cp_layout", "cp_inputs",
                                     "tp_optional", "cp_axes"])
def test_only_the_fields_are_keywords(keyword):
    """The earlier per-parallelism keywords and attributes are gone (docs/changelog.md): a
    TypeError and an AttributeError, as for any unknown name."""
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{keyword}'"):
        hpf.ShardingPlan({}, **{keyword: "x"})
    with pytest.raises(AttributeError, match=f"no attribute '{keyword}'"):
        getattr(hpf.ShardingPlan({}), keyword)


def test_bad_axes_and_settings():
    """A bare axis name is not a role map (the error says how to write it); a setting needs an owner."""
    with pytest.raises(hpf.PlanError, match=r"axes=\{'tp': 'model'\}"):
        hpf.ShardingPlan({"a": hpf.Colwise()}, "model")
    with pytest.raises(hpf.PlanError, match=r"plan settings \['zigzag'\] belong to no parallelism"):
        hpf.ShardingPlan({}, settings={"zigzag": True})
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        hpf.ShardingPlan({}).nope  # noqa: B018


class Watermark(Parallelism):
    """A plug-in written outside the package: its own setting, an entry rule and a root entry."""

    name = "watermark"
    role = "wm"
    settings = {"watermark": None}

    def check_entries(self, entries, plan):
        if plan.settings["watermark"] is not None and "" in entries:
            raise hpf.PlanError("watermark: the root module is the watermark's; drop the root entry")
        return entries

    def resolve(self, plan, resolution: Resolution) -> Resolution:
        if plan.settings["watermark"] is None:
            return resolution
        style = hpf.NoParallel()
        return dataclasses.replace(resolution, root=Planned("", None, style, "tp", "(watermark)"))


def test_a_parallelism_plugs_in_without_touching_the_package():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    mesh = SimpleNamespace(mesh_dim_names=("tp",))  # resolve reads only the axis names
    with pytest.raises(hpf.PlanError, match="belong to no parallelism"):
        hpf.ShardingPlan({"0": hpf.Colwise()}, settings={"watermark": 1})
    plugins = (*PARALLELISMS, Watermark())
    plan = hpf.ShardingPlan({"0": hpf.Colwise(), "1": hpf.Rowwise()}, settings={"watermark": 1}, parallelisms=plugins)
    resolved = plan.resolve(model, mesh)
    assert [(p.fqn, p.pattern) for p in resolved] == [("", "(watermark)"), ("0", "0"), ("1", "1")]
    assert resolved[0].module is model
    with pytest.raises(hpf.PlanError, match="the root module is the watermark's"):
        hpf.ShardingPlan({"": hpf.NoParallel()}, settings={"watermark": 1}, parallelisms=plugins)
    plain = plan.with_entries({"0": hpf.Colwise()}, settings={})  # with_entries keeps the plug-ins
    assert plain.parallelisms == plugins and [p.fqn for p in plain.resolve(model, mesh)] == ["0"]


def test_from_hf_finds_strategies_through_the_plugins():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    plan = hpf.ShardingPlan.from_hf(model, cp_axis="cp", cp_strategy="allgather")
    assert plan.axes == {"tp": "tp", "cp": "cp"} and plan.optional_roles == {"tp"}
    assert plan.entries["model.layers.*.self_attn"] == hpf.ContextParallel("allgather", layout="zigzag")
    with pytest.raises(hpf.PlanError, match="cp_strategy='spiral'.*must be one of"):
        hpf.ShardingPlan.from_hf(model, cp_axis="cp", cp_strategy="spiral")
