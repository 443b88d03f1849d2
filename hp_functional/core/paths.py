"""Module-path patterns, the one rule: dot paths where ``*`` matches exactly one segment
(``model.layers.*.mlp``), and a path matched by several patterns takes the most specific one
(fewest ``*``).  Plans, recompute blocks and FSDP blocks use it."""

from __future__ import annotations

__all__ = ["Candidate", "layer_patterns", "most_specific", "path_matches"]

from typing import TYPE_CHECKING, NamedTuple

from .errors import PlanError

if TYPE_CHECKING:
    from .style import Style


def path_matches(pattern: str, path: str) -> bool:
    """Whether a dot-path ``pattern`` (``*``: exactly one segment) matches module/parameter ``path``."""
    if not path or not pattern:  # the root module is addressed by the empty path only
        return pattern == path
    p, q = pattern.split("."), path.split(".")
    return len(p) == len(q) and all(a == "*" or a == b for a, b in zip(p, q, strict=True))


def layer_patterns(paths) -> list[str]:
    """Module paths as plan patterns, layer indices as ``*`` (``model.layers.3.mlp`` →
    ``model.layers.*.mlp``), each pattern once, in first-seen order."""
    return list(dict.fromkeys(".".join("*" if part.isdigit() else part for part in p.split(".")) for p in paths))


class Candidate(NamedTuple):
    """A plan entry whose pattern matches a module path; fewer ``stars`` is more specific."""

    stars: int
    pattern: str
    style: Style


def most_specific(path: str, cands: list[Candidate]) -> tuple[str, Style]:
    """The (pattern, style) that plans ``path``: the fewest ``*`` win, whatever the entry order;
    equally specific patterns with different styles are a PlanError naming both."""
    fewest = min(c.stars for c in cands)
    best = [(c.pattern, c.style) for c in cands if c.stars == fewest]
    for pattern, style in best[1:]:
        if style != best[0][1]:
            raise PlanError(f"{path}: conflicting plan entries {best[0][0]!r} ({best[0][1]}) and {pattern!r} ({style})")
    return best[0]
