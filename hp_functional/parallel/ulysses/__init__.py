"""Ulysses sequence parallelism (DeepSpeed-Ulysses): the sequence sharded over the ``cp`` axis,
turned into a head split by an all-to-all around attention (``attention``), on the modules a
``Ulysses`` entry plans (``styles``); ``plugin`` offers it to plan sources as
``cp_strategy="ulysses"``.  See docs/context-parallel.md#ulysses."""

__all__: list[str] = []
