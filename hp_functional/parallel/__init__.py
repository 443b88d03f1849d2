"""Layer 3: the parallelisms, each a package of its own (``tensor``, ``context``, ``experts``) with
its styles, its shard-time checks, its root additions and its run-time pieces, handed to the plan
language through one contract (``core.parallelism``); plus ``Local`` (hand-written local compute)
that they build on.  Imports ``core`` and ``analysis``.

``PARALLELISMS`` is the one registration: a new parallelism adds its line here, in the order its
``resolve`` runs (a later one may take over an earlier one's root entry: context parallelism's root
also computes loss parallel's loss)."""

from __future__ import annotations

__all__ = ["PARALLELISMS"]

from .context import plugin as context
from .experts import plugin as experts
from .tensor import plugin as tensor
from .ulysses import plugin as ulysses

PARALLELISMS = (
    tensor.PARALLELISM,
    experts.PARALLELISM,
    context.PARALLELISM,
    ulysses.PARALLELISM,
)
