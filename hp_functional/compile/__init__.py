"""Layer 6: ``build_program`` — named passes from a resolved plan to a ``Program`` — plan lint
over the specs the passes built, and the cross-rank agreement.  Imports ``core`` up to ``plan``."""

__all__: list[str] = []
