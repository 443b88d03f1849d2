"""``python -m hp_functional.cli`` (what torchrun runs): the command line."""

import sys

from .main import main

sys.exit(main())
