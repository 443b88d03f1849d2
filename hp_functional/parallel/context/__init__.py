"""Context parallelism: attention over a sequence sharded on the ``cp`` axis (ring, all-gather),
the root entry that shards the batch, and ``ContextInputs`` for models that are not Hugging Face's."""

__all__: list[str] = []
