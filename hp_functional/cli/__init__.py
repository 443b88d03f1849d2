"""Layer 11: the ``hp-functional`` command line, the demo and the local launcher."""

__all__: list[str] = []
