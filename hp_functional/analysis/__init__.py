"""Layer 2: what a model does, found without running it for real — the meta/fake-tensor trace of
its forward (``trace``) and the shape audit over it (``audit``).  The compiler's dataflow and lint
and the planner share them.  Imports only ``core``."""

__all__: list[str] = []
