"""Module- and parameter-path patterns: the one rule every pattern of the package follows —
plan entries and special handlers, recompute (remat) blocks, FSDP blocks, optimizer masks and
groups.  See docs/plan-language.md#patterns.

- A pattern is a dot path matched segment by segment: a segment without wildcards is a name,
  ``*`` is exactly one segment, a segment such as ``*norm*`` or ``q_*`` is one segment matched as
  ``fnmatch`` does (``*``, ``?``, ``[...]``, case-sensitive, never across a dot), and ``**`` is any
  number of segments, none included (``**.bias``: every ``bias``, the root's too).
- The root module is the empty path, matched by the empty pattern only.
- A path matched by several patterns takes the most specific one, whatever their order: the one
  with the most name segments, then the most partial segments (``*norm*``), then the fewest
  ``**`` (for patterns of names and ``*``: the fewest ``*``).
"""

from __future__ import annotations

__all__ = ["Candidate", "layer_patterns", "most_specific", "most_specific_patterns", "path_matches", "specificity"]

from collections.abc import Iterable
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, NamedTuple

from .errors import PlanError

if TYPE_CHECKING:
    from .style import Style

_GLOB = frozenset("*?[")


def _segment_matches(pattern: str, segment: str) -> bool:
    if pattern == "*":
        return True
    if _GLOB.isdisjoint(pattern):
        return pattern == segment
    return fnmatchcase(segment, pattern)


def _matches(p: list[str], q: list[str]) -> bool:
    """Whether pattern segments ``p`` match path segments ``q`` (``**``: any number of them)."""
    i = 0
    while i < len(p) and p[i] != "**":
        if i >= len(q) or not _segment_matches(p[i], q[i]):
            return False
        i += 1
    if i == len(p):
        return len(q) == len(p)
    rest = p[i + 1:]
    while rest and rest[0] == "**":  # consecutive ** are one
        rest = rest[1:]
    return any(_matches(rest, q[k:]) for k in range(i, len(q) + 1))


def path_matches(pattern: str, path: str) -> bool:
    """Whether ``pattern`` matches the module or parameter ``path`` under the one rule (see the
    module docstring): ``*`` one segment, ``*norm*`` one segment by ``fnmatch``, ``**`` any number."""
    if not path or not pattern:  # the root module is addressed by the empty path only
        return pattern == path
    return _matches(pattern.split("."), path.split("."))


def specificity(pattern: str) -> tuple[int, int, int]:
    """How specific ``pattern`` is, larger first: (name segments, partial segments such as
    ``*norm*``, minus the ``**`` segments).  Of two patterns matching one path, the larger wins; for
    patterns of names and ``*`` this is the fewest ``*``."""
    names = partial = double = 0
    for s in pattern.split(".") if pattern else ():
        if s == "**":
            double += 1
        elif _GLOB.isdisjoint(s):
            names += 1
        elif s != "*":
            partial += 1
    return names, partial, -double


def most_specific_patterns(path: str, patterns: Iterable[str]) -> list[str]:
    """The patterns of ``patterns`` that match ``path`` and are the most specific of those that do
    (several when equally specific; empty when none matches), in their given order."""
    hits = [p for p in patterns if path_matches(p, path)]
    if not hits:
        return []
    best = max(map(specificity, hits))
    return [p for p in hits if specificity(p) == best]


def layer_patterns(paths) -> list[str]:
    """Module paths as plan patterns, layer indices as ``*`` (``model.layers.3.mlp`` →
    ``model.layers.*.mlp``), each pattern once, in first-seen order."""
    return list(dict.fromkeys(".".join("*" if part.isdigit() else part for part in p.split(".")) for p in paths))


class Candidate(NamedTuple):
    """A plan entry whose pattern matches a module path (the winner is decided by ``specificity``)."""

    pattern: str
    style: Style


def most_specific(path: str, cands: list[Candidate]) -> tuple[str, Style]:
    """The (pattern, style) that plans ``path``: the most specific pattern wins (``specificity``),
    whatever the entry order; equally specific patterns with different styles are a PlanError
    naming both."""
    top = max(specificity(c.pattern) for c in cands)
    best = [(c.pattern, c.style) for c in cands if specificity(c.pattern) == top]
    for pattern, style in best[1:]:
        if style != best[0][1]:
            raise PlanError(f"{path}: conflicting plan entries {best[0][0]!r} ({best[0][1]}) and {pattern!r} ({style})")
    return best[0]
