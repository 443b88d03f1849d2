"""Tensor parallelism: column/row splits, sequence parallel, head counts, the vocab-parallel
embedding and the vocab-parallel loss."""

__all__: list[str] = []
