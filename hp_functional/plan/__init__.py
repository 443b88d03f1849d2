"""Layer 5: the plan language — ``ShardingPlan`` (entries, axes by role, handlers) and its
resolution against a model, and ready recipes.  Imports ``core`` up to ``sources``."""

__all__: list[str] = []
