"""``compile.regions``: on which axes each planned module's compute varies per rank, and which
modules are regions (rank-varying compute entered by replicated inputs, whose gradients are
reduced at the region's entry); the specs' ``varying``/``region`` overrides.  In one process."""

import dataclasses

from torch import nn

import hp_functional as hpf
from hp_functional.compile.build import resolve_specs
from hp_functional.compile.regions import analyse_regions, consumer_axes
from tests.support.models import MLP, PLANS


def _analyse(model, entries, override=None):
    plan = hpf.ShardingPlan(entries)

    def run(m):
        planned, specs = resolve_specs(model, plan, m)
        for fqn, changes in (override or {}).items():
            specs[fqn] = dataclasses.replace(specs[fqn], **changes)
        return analyse_regions(planned, specs, ["tp"])

    return hpf.simulate(run, world_size=2)


def test_colwise_is_a_region_rowwise_is_not():
    a = _analyse(MLP(), PLANS["tp"])
    assert list(a) == ["up", "down"]  # parents before children, named_modules order
    assert a["up"].varying == {"tp"} and a["up"].region == {"tp"}  # replicated input into sharded compute
    assert a["down"].varying == {"tp"} and a["down"].region == set()  # its input is already sharded
    assert a["up"].inside == a["down"].inside == set()
    assert consumer_axes("up", a) == {"tp"} and consumer_axes("norm", a) == set()


def test_sequence_parallel_norm_varies_without_sharded_params():
    a = _analyse(MLP(), PLANS["sp"])
    assert a["norm"].varying == {"tp"} and a["norm"].region == set()  # its input is Shard(1): data varies
    assert consumer_axes("norm", a) == {"tp"}


def test_overrides_force_varying_and_region():
    a = _analyse(MLP(), PLANS["tp"], {"up": {"region": False}})
    assert a["up"].varying == {"tp"} and a["up"].region == set()
    a = _analyse(MLP(), PLANS["tp"], {"up": {"varying": False}})
    assert a["up"].varying == set() and a["up"].region == set()
    a = _analyse(MLP(), PLANS["tp"], {"down": {"region": True}})
    assert a["down"].region == {"tp"}


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = MLP()

    def forward(self, x):
        return self.block(x)


def test_modules_inside_a_region_know_it():
    entries = {"block": hpf.NoParallel(), "block.up": hpf.Colwise(), "block.down": hpf.Rowwise()}
    a = _analyse(Outer(), entries, {"block": {"region": True}})
    assert a["block"].varying == {"tp"}, "sharded parameters below make the container vary"
    assert a["block"].region == {"tp"}
    assert a["block.up"].inside == a["block.down"].inside == {"tp"}
    assert consumer_axes("block.norm", a) == {"tp"}  # an unplanned module inside the region
    a = _analyse(Outer(), entries, {"block": {"region": False}})
    assert a["block.up"].inside == set() and consumer_axes("block.norm", a) == set()
