"""Which leaves an ``hpf.optim`` mask or group names: patterns by the package's one rule
(``core.paths``, docs/plan-language.md#patterns), and the earlier fnmatch spelling kept for now with
a ``FutureWarning`` where the two differ (re-exported by ``hpf.optim``)."""

from __future__ import annotations

__all__ = ["Mask", "PatternMask", "_RULE", "_mask_fn", "_old_matches", "_resolve_mask", "_spelling_hint",
           "decay_mask"]

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from fnmatch import fnmatchcase

from torch import Tensor

from ..core.paths import path_matches

Params = Mapping[str, Tensor]
#: a weight-decay mask: None (every leaf), a predicate on the FQN, or patterns of the FQNs that decay
Mask = Callable[[str], bool] | str | Sequence[str] | None


# ---------------------------------------------------------------- patterns (the one rule, and the old one for now)
_RULE = "docs/plan-language.md#patterns"


def _old_matches(pattern: str, fqn: str) -> bool:
    """The optimizer's earlier rule: ``fnmatch`` on the whole FQN (``*`` crossing dots).  A pattern
    with ``**`` was never meant for it and is read by the one rule alone."""
    return path_matches(pattern, fqn) if "**" in pattern else fnmatchcase(fqn, pattern)


def _new_spelling(pattern: str) -> str:
    """An ``fnmatch`` FQN pattern written under the one rule, where it can be: a ``*`` that may cross
    dots becomes ``**`` (``*`` → ``**``, ``*.bias`` → ``**.bias``, ``*bias`` → ``**.*bias``,
    ``*norm*`` → ``**.*norm*.**``, ``layers.*.weight`` → ``layers.**.weight``)."""
    out = []
    for seg in pattern.split("."):
        if seg in ("*", "**"):
            out.append("**")
            continue
        if seg.startswith("*"):
            out.append("**")
        out.append(seg)
        if seg.endswith("*") and len(seg) > 1:
            out.append("**")
    merged = [s for i, s in enumerate(out) if not (s == "**" and i and out[i - 1] == "**")]
    return ".".join(merged)


def _spelling_hint(pattern: str, fqns: Iterable[str]) -> str:
    """How to write ``pattern`` under the one rule, checked on ``fqns``."""
    new = _new_spelling(pattern)
    same = all(path_matches(new, f) == fnmatchcase(f, pattern) for f in fqns)
    return f"write {new!r}" + ("" if same else " (it does not match the same parameters here: check it)")


class PatternMask:
    """A mask given as FQN patterns: a leaf is selected when one of ``patterns`` matches its FQN
    (``negate``: when none does), memoised (the FQNs are the same every step).

    Patterns follow the one rule (``core.paths``).  For now a pattern without ``**`` whose
    ``fnmatch`` match (the earlier rule: ``*`` crossing dots) differs on some FQN keeps its
    ``fnmatch`` match, with one ``FutureWarning`` per pattern naming the FQN and the spelling under
    the one rule."""

    def __init__(self, patterns: Sequence[str], who: str, negate: bool = False):
        self.patterns, self.who, self.negate = tuple(patterns), who, negate
        self.memo: dict[str, bool] = {}
        self.warned: set[str] = set()

    def __call__(self, fqn: str) -> bool:
        if fqn not in self.memo:
            self.resolve((fqn,), stacklevel=2)
        return self.memo[fqn]

    def resolve(self, fqns: Iterable[str], stacklevel: int = 1) -> None:
        """Decide every FQN of ``fqns`` not decided yet; warn (at ``stacklevel`` above the caller)
        for each pattern whose two rules disagree on them."""
        fqns = list(fqns)
        differ: dict[str, list[str]] = {}
        for fqn in fqns:
            if fqn in self.memo:
                continue
            hit = False
            for p in self.patterns:
                old = _old_matches(p, fqn)
                if old != path_matches(p, fqn):
                    differ.setdefault(p, []).append(fqn)
                hit = hit or old
            self.memo[fqn] = hit != self.negate
        for p, names in differ.items():
            if p in self.warned:
                continue
            self.warned.add(p)
            first, second = ("earlier rule (fnmatch)", "one pattern rule") if fnmatchcase(
                names[0], p) else ("one pattern rule", "earlier rule (fnmatch)")
            more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
            warnings.warn(
                f"{self.who}: pattern {p!r} matches {names[0]!r}{more} by the {first} but not by the {second} "
                f"({_RULE}: `*` one segment, `**` any number); the earlier rule decides for now: "
                f"{_spelling_hint(p, fqns)}", FutureWarning, stacklevel=stacklevel + 1)


def decay_mask(exclude: Iterable[str] = ("**.*bias", "**.*norm*.**")) -> Callable[[str], bool]:
    """A ``mask`` that decays every leaf except those whose FQN matches one of ``exclude``
    (patterns under the one rule, docs/plan-language.md#patterns): by default no decay on biases
    (an FQN ending in ``bias``) and norms (any segment containing ``norm``)."""
    return PatternMask((exclude,) if isinstance(exclude, str) else tuple(exclude), "decay_mask", negate=True)


def _mask_fn(mask: Mask, who: str) -> Callable[[str], bool]:
    """``mask`` as a predicate on the FQN; memoised (the FQNs are the same every step)."""
    if mask is None:
        return lambda fqn: True
    if isinstance(mask, PatternMask):
        return mask
    if not callable(mask):
        patterns = (mask,) if isinstance(mask, str) else tuple(mask)
        if not all(isinstance(p, str) for p in patterns):
            raise TypeError(f"mask must be None, a callable fqn -> bool or FQN patterns, got {mask!r}")
        return PatternMask(patterns, f"{who} mask")
    pred = mask
    memo: dict[str, bool] = {}

    def decays(fqn: str) -> bool:
        if fqn not in memo:
            memo[fqn] = bool(pred(fqn))
        return memo[fqn]

    return decays


def _resolve_mask(decays: Callable[[str], bool], params: Params) -> None:
    """Decide a pattern mask on every FQN at once (its warnings point at the caller's caller)."""
    if isinstance(decays, PatternMask):
        decays.resolve(params, stacklevel=3)
