"""Layer 8: the private skeleton, boundary installation, ``apply_fn``, ``shard()``, the shard-time
proof, activation recompute, weights in and the losses.  Imports the layers below."""

__all__: list[str] = []
