"""Layer 9: training over the params pytree — fsdp, data parallel, optimizers, clipping,
checkpoints (DCP), weights out, module interop and pipeline stages.  Imports the layers below."""

__all__: list[str] = []
