"""``python -m hp_functional.cli`` (what torchrun runs): the command line."""

__all__: list[str] = []

import sys

from .main import main

sys.exit(main())
