"""Layer 3: the parallelisms, each a package of its own (``tensor``, ``context``, ``experts``) with
its styles, its root additions, its shard-time checks and its run-time pieces, plus ``Local``
(hand-written local compute) that they build on.  Imports ``core`` and ``analysis``."""

__all__: list[str] = []
