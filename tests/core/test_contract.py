"""The plug-in contract as its readers use it: what the compiler, the runtime and their analyses need
of a parallelism they ask its styles (``core.style``: ``splits_sequence``, ``sequence_split``,
``local_buffer_shapes``, ``own_forward``) or its plug-in (``core.parallelism``: ``sharded_outputs``,
``lint``, ``loss_labels``), never its type.  So a parallelism written outside the package, whose
styles subclass none of the built-in ones, is read like the built-in ones; and lint's result type
(``core.findings``) is an enum that reads as text; the module kinds (``core.module_kinds``)."""

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import hp_functional as hpf
from hp_functional.core.findings import Finding, Level
from hp_functional.core.module_kinds import CONVS, is_conv1d
from hp_functional.core.parallelism import Parallelism
from hp_functional.core.style import ModuleSpec, Style
from hp_functional.parallel import PARALLELISMS
from hp_functional.parallel.context.styles import context_parallel_root
from hp_functional.runtime.rng_layout import _sequence_root


def test_lint_levels_are_an_enum_that_reads_as_text():
    found = Finding("error", "a.b", "a.b: broken", "code")  # the level's name is taken too
    assert found.level is Level.ERROR and found.level == "error" and str(found) == "error: a.b: broken"
    assert str(Finding(Level.WARNING, "x", "y")) == "warning: x: y" and f"{Level.NOTE}" == "note"
    with pytest.raises(ValueError, match="fatal"):
        Finding("fatal", "x", "y")


class Conv1D(nn.Module):
    """HF's ``Conv1D`` as ``is_conv1d`` recognises it, by name and shape (weight ``[nx, nf]``)."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf, self.nx, self.weight = nf, nx, nn.Parameter(torch.zeros(nx, nf))


def test_module_kinds():
    assert is_conv1d(Conv1D(8, 4)) and not is_conv1d(nn.Linear(4, 8))
    odd = Conv1D(8, 4)
    odd.nx = 5  # a Conv1D-named module whose weight is not [nx, nf] is no Conv1D
    assert not is_conv1d(odd)
    assert nn.Conv2d in CONVS and nn.ConvTranspose2d not in CONVS and not isinstance(nn.Linear(2, 2), CONVS)


def test_a_style_and_a_parallelism_add_nothing_by_default():
    style, plugin, plan = Style(), Parallelism(), hpf.ShardingPlan({})
    assert style.own_forward and not style.splits_sequence and style.sequence_split is None
    assert style.local_buffer_shapes(nn.BatchNorm1d(4), 2) == {}
    assert plugin.sharded_outputs(plan, nn.Linear(2, 2)) == () and plugin.lint(plan, {}, {}) == []
    assert plugin.loss_labels(plan) is None


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 16)

    def get_output_embeddings(self):
        return self.head

    def forward(self, x):
        return self.head(self.body(x))


def test_the_built_in_parallelisms_state_their_facts():
    assert hpf.ContextParallel().splits_sequence and hpf.Ulysses().splits_sequence
    assert not hpf.Colwise().splits_sequence and not hpf.SequenceParallel().splits_sequence  # SP: no data axis
    root = context_parallel_root("cp", "zigzag")
    assert root.sequence_split is root.fn and root.sequence_split.axis == "cp" and not root.own_forward
    assert root.sequence_split.positions(0, 8, 2).tolist() == [0, 1, 6, 7]  # zigzag: chunks 0 and 3 of 4
    labels, sequence = root.sequence_split.sequence_keys()
    assert labels == ("labels", "shift_labels") and sequence["input_ids"] == 1
    inputs = hpf.ContextInputs(sequence={"tokens": 1}, positions="pos", labels="targets")
    declared = inputs.root("cp", "contiguous", None).sequence_split
    assert declared.positions(1, 8, 2).tolist() == [4, 5, 6, 7]
    assert declared.sequence_keys() == (("targets",), {"tokens": 1, "pos": -1})
    plan = hpf.ShardingPlan({"attn": hpf.ContextParallel()}, axes={"cp": "cp"}, settings={"cp_inputs": inputs})
    assert [p.loss_labels(plan) for p in plan.parallelisms] == [None, None, inputs, None]
    assert all(p.loss_labels(hpf.ShardingPlan({})) is None for p in PARALLELISMS)
    stats = hpf.Channels().local_buffer_shapes(nn.BatchNorm2d(8), 2)  # its channels' slice of the statistics
    assert stats == {"running_mean": torch.Size([4]), "running_var": torch.Size([4])}
    assert hpf.Channels().local_buffer_shapes(nn.GroupNorm(2, 8), 2) == {}
    model = Head()
    heads = {p.name: p.sharded_outputs(hpf.ShardingPlan({"head": hpf.Colwise()}, settings={"loss_parallel": True}), model)
             for p in PARALLELISMS}
    assert heads == {"tensor": ("head",), "experts": (), "context": (), "ulysses": ()}


@dataclass(frozen=True)
class Shuffled(Style):
    """An outside parallelism's style that splits the sequence and subclasses no built-in style."""

    axis_role = "sq"
    splits_sequence = True

    def spec(self, module, fqn, axis):
        return ModuleSpec(varying=False, region=False)


class Split:
    """An outside root's ``SequenceSplit``: every other position."""

    axis = "sq"

    def positions(self, rank, seq_len, size):
        return torch.arange(rank, seq_len, size)

    def sequence_keys(self):
        return ("labels",), {"x": 1}

    def __call__(self, module, axes, *args, cp_sharded=False, **kwargs):
        return module(*args, **kwargs)


def test_a_sequence_split_of_any_parallelism_lays_out_the_randomness():
    """``hpf.rng`` finds the root that cuts the sequence through the styles' facts: an outside
    parallelism gets the layout by position without subclassing ``ContextParallel``."""
    split = Split()
    root = hpf.Local(split, axis="sq", sequence_split=split)
    mesh = SimpleNamespace(get_local_rank=lambda axis: 1)

    def program(*styles):
        return SimpleNamespace(mesh=mesh, boundaries=[SimpleNamespace(planned=SimpleNamespace(fqn=f, axis="sq", style=s))
                                                      for f, s in styles])

    found = _sequence_root(program(("", root), ("attn", Shuffled())), {"sq": 2})
    assert found is not None and found.split is split and (found.size, found.rank, found.axis) == (2, 1, "sq")
    assert _sequence_root(program(("", root), ("attn", hpf.NoParallel())), {"sq": 2}) is None  # no entry splits
    assert _sequence_root(program(("x", root), ("attn", Shuffled())), {"sq": 2}) is None  # not on the root


def test_a_sequence_splitting_axis_is_no_data_axis_of_the_randomness():
    """``hpf.rng``'s data axes leave out an axis on which any style splits the sequence (its ranks
    share their examples), whatever parallelism the style belongs to."""
    def run(mesh):
        def data(style):
            boundary = SimpleNamespace(planned=SimpleNamespace(fqn="attn", axis="cp", style=style))
            return hpf.rng(0, data_axes=("dp", "cp"))._data(SimpleNamespace(program=SimpleNamespace(
                mesh=mesh, boundaries=[boundary])))
        return data(Shuffled()), data(hpf.ContextParallel()), data(hpf.NoParallel())

    split, context, plain = hpf.simulate(run, world_size=4, mesh_shape=(2, 2), mesh_dim_names=("dp", "cp"), rank=3)
    assert split == context == (2, 1) and plain == (4, 3)


class Marked(Parallelism):
    """An outside plug-in with its own lint check and a module whose sharded output it means."""

    name = "marked"

    def sharded_outputs(self, plan, model):
        return ("up",)

    def lint(self, plan, planned, specs):
        return [Finding(Level.WARNING, fqn, f"{fqn}: marked", "marked") for fqn in planned if fqn]


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.out = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.out(torch.relu(self.up(x)))


def test_an_outside_plugin_lints_through_its_hooks():
    """``hpf.lint`` reports an outside plug-in's findings and leaves alone the output it keeps sharded."""
    def run(mesh):
        plans = {name: hpf.ShardingPlan({"up": hpf.Colwise()}, parallelisms=plugins)
                 for name, plugins in (("built-in", PARALLELISMS), ("marked", (*PARALLELISMS, Marked())))}
        return {name: sorted((f.level, f.code, f.where) for f in hpf.lint(Pair(), plan, mesh))
                for name, plan in plans.items()}

    found = hpf.simulate(run, world_size=2)
    assert found == {"built-in": [("error", "unreduced", "out")],  # Colwise up's Shard(-1) output, nothing reduces it
                     "marked": [("warning", "marked", "up")]}, found
