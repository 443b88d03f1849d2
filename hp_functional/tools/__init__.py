"""Layer 6 (``train`` will sit between runtime and tools): explain, validate, simulate and
the built-in tiny model configs.  Imports the layers below."""

__all__: list[str] = []
