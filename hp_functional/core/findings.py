"""Lint's result type: a ``Finding`` (its ``Level``, where, why, a short code).  Here, under the
compiler and the parallelisms, so that a parallelism's own checks (``Parallelism.lint``) report
through the same type as the compiler's lint (``compile.lint``; the codes: docs/tools.md#lint)."""

from __future__ import annotations

__all__ = ["Finding", "Level"]

from dataclasses import dataclass
from enum import StrEnum


class Level(StrEnum):
    """How bad a finding is.  A ``str``: ``Level.ERROR == "error"`` and ``str(Level.ERROR) == "error"``."""

    #: the plan cannot be applied or would certainly compute something else than the model
    ERROR = "error"
    #: it runs but is probably not what was meant
    WARNING = "warning"
    #: what a check could not see (``hpf.lint`` only)
    NOTE = "note"


@dataclass(frozen=True)
class Finding:
    """One lint result: its ``level`` (a ``Level``; its name as a string is taken too), the
    module/pattern it names, why, and a short ``code`` (docs/tools.md#lint)."""

    level: Level
    where: str
    message: str
    code: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "level", Level(self.level))  # "error" -> Level.ERROR; a ValueError for no level

    def __str__(self) -> str:
        named = not self.where or self.where in self.message
        return f"{self.level}: {self.message}" if named else f"{self.level}: {self.where}: {self.message}"
