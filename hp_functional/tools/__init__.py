"""Layer 10: explain, validate, simulate, the sweep and the built-in tiny model configs.  Imports
the layers below."""

__all__: list[str] = []
