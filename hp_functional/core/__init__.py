"""Layer 1: placements and ``ShardInfo``, the differentiable collectives, the one src → dst
lowering table and the ``Program`` data types.  Imports nothing else of the package."""

__all__: list[str] = []
