"""Layer 2: ``ShardingPlan`` and pattern resolution, the styles (each compiles to a
``ModuleSpec``), the HF plan source and ready recipes.  Imports only ``core``."""

__all__: list[str] = []
