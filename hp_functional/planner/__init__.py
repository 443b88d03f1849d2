"""Layer 7: the planner — ``auto_plan`` chooses a tensor-parallel plan from a model's traced
dataflow (``auto``, with its blocks, heads, sequence-parallel and report modules).  Imports every
layer up to ``compile``."""

__all__: list[str] = []
