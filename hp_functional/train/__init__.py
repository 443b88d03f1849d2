"""Training over the params pytree: fsdp, data parallel, optimizers, clipping, module interop."""

__all__: list[str] = []
