"""Layer 4: the private skeleton, boundary installation, ``apply_fn``, ``shard()`` and the
losses.  Imports the layers below."""

__all__: list[str] = []
