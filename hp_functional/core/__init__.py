"""Layer 1: placements and ``ShardInfo`` with its facets, the differentiable collectives (one table),
the one src → dst lowering table, the style contract (``style``), the one module-path matcher
(``paths``), the ``Program`` data types, host communication and counter-based randomness.
Imports nothing else of the package."""

__all__: list[str] = []
