"""Pass: analyse rank-varying compute — on which axes each planned module's compute differs
per rank, and which modules are *regions* that own the gradient reduction of what enters them.

A module is rank-varying on an axis when it (or a planned module below it) holds parameters
sharded on that axis, or takes an input that is sharded or partial there (``ModuleSpec.varying``
forces it either way).  A rank-varying module whose inputs are made Replicate is a region: its
replicated inputs' gradients are per-rank partial sums inside it, reduced once at its entry
(JAX's varying/invariant values); ``ModuleSpec.region`` forces it (``Local`` entries are regions).
Reads the specs only.
"""

from __future__ import annotations

__all__ = ["Varying", "analyse_regions", "consumer_axes", "is_below"]

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Partial, Replicate, Shard

from ..core.placement import splits
from ..core.program import Planned
from ..core.style import ModuleSpec


@dataclass(frozen=True)
class Varying:
    """One planned module's analysis: ``varying`` axes of its compute; ``region`` the varying
    axes on which it is a region; ``inside`` the region axes of the regions enclosing it;
    ``data`` the axes over which it splits the data its subtree computes on."""

    varying: frozenset[str]
    region: frozenset[str]
    inside: frozenset[str]
    data: frozenset[str] = frozenset()  # ModuleSpec.data_axes: the data below is split over these


def is_below(fqn: str, ancestor: str) -> bool:
    """Whether module ``fqn`` is a proper descendant of ``ancestor`` ("" is the root)."""
    return fqn != ancestor and (not ancestor or fqn.startswith(ancestor + "."))


def analyse_regions(planned: Sequence[Planned], specs: Mapping[str, ModuleSpec], axes: Sequence[str]) -> dict[str, Varying]:
    """Planned module FQN → its ``Varying`` (see the module docstring), parents before children."""
    sharded = {
        fqn: {a for pls in spec.params.values() for a, pl in pls.items() if splits(pl)}
        for fqn, spec in specs.items()
    }
    out: dict[str, Varying] = {}
    for p in planned:
        spec = specs[p.fqn]
        below = set().union(*(s for m, s in sharded.items() if m == p.fqn or is_below(m, p.fqn)))
        inside = frozenset().union(*(v.region for m, v in out.items() if is_below(p.fqn, m)))
        varying = set(inside)
        for axis in axes:
            if spec.varying is not None and axis == p.axis:  # forced on the style's own axis
                if spec.varying:
                    varying.add(axis)
            elif axis in below or any(isinstance(d.get(axis), (Shard, Partial)) for d in spec.in_dst.values()):
                varying.add(axis)
        if spec.region is None:
            region = frozenset(a for a in varying if any(isinstance(d.get(a), Replicate) for d in spec.in_dst.values()))
        else:
            region = frozenset(varying) if spec.region else frozenset()
        out[p.fqn] = Varying(frozenset(varying), region, inside, frozenset(a for a in spec.data_axes if a in axes))
    return out


def consumer_axes(module: str, analysis: Mapping[str, Varying], unvarying: frozenset[str] = frozenset()) -> set[str]:
    """The axes on which the compute that uses ``module``'s parameters differs per rank: the
    module's own varying axes (less ``unvarying``: those on which a trace saw the parameter used
    only with data that does not vary) and those of every region, or data-splitting module
    (context parallelism's root: ``ModuleSpec.data_axes``), enclosing (or being) it — inside a
    region every value's gradient is a per-rank share, whatever data it meets."""
    own = set(analysis[module].varying) - unvarying if module in analysis else set()
    return own.union(*(v.region | v.data for m, v in analysis.items() if module == m or is_below(module, m)))
