"""Ulysses sequence parallelism as a plug-in (``core.parallelism``): the ``"ulysses"`` strategy on
the ``cp`` role.

``Ulysses`` is a context-parallel entry (a ``ContextParallel`` whose attention is two all-to-alls),
so the context plug-in's rules cover it: the plan's ``cp_layout`` and the root entry that cuts the
sequence and computes the loss, the shadowing check.  This plug-in only offers the strategy to plan
sources (``from_hf(cp_strategy="ulysses")``)."""

from __future__ import annotations

__all__ = ["PARALLELISM"]

from types import MappingProxyType

from ...core.parallelism import Parallelism
from .styles import Ulysses


class UlyssesParallelism(Parallelism):
    """The ``"ulysses"`` strategy of the ``cp`` role."""

    name = "ulysses"
    role = "cp"
    strategies = MappingProxyType({"ulysses": Ulysses})


PARALLELISM = UlyssesParallelism()
