"""Which leaves an ``hpf.optim`` mask names: FQN patterns under the package's one rule
(``core.paths``, docs/plan-language.md#patterns), or a predicate (re-exported by ``hpf.optim``)."""

from __future__ import annotations

__all__ = ["Mask", "PatternMask", "decay_mask", "mask_fn"]

from collections.abc import Callable, Iterable, Sequence

from ..core.paths import path_matches

#: a weight-decay mask: None (every leaf), a predicate on the FQN, or patterns of the FQNs that decay
Mask = Callable[[str], bool] | str | Sequence[str] | None


class PatternMask:
    """A mask given as FQN patterns: a leaf is selected when one of ``patterns`` matches its FQN
    under the one rule (``negate``: when none does), memoised (the FQNs are the same every step).
    ``who`` names the mask's owner (``"adamw mask"``) where it is shown."""

    def __init__(self, patterns: Sequence[str], who: str, negate: bool = False):
        self.patterns, self.who, self.negate = tuple(patterns), who, negate
        self.memo: dict[str, bool] = {}

    def __call__(self, fqn: str) -> bool:
        if fqn not in self.memo:
            self.memo[fqn] = any(path_matches(p, fqn) for p in self.patterns) != self.negate
        return self.memo[fqn]

    def __repr__(self) -> str:
        return f"PatternMask({list(self.patterns)!r}, {self.who!r}{', negate=True' if self.negate else ''})"


def decay_mask(exclude: Iterable[str] = ("**.*bias", "**.*norm*.**")) -> Callable[[str], bool]:
    """A ``mask`` that decays every leaf except those whose FQN matches one of ``exclude``
    (patterns under the one rule, docs/plan-language.md#patterns): by default no decay on biases
    (an FQN ending in ``bias``) and norms (any segment containing ``norm``)."""
    return PatternMask((exclude,) if isinstance(exclude, str) else tuple(exclude), "decay_mask", negate=True)


def mask_fn(mask: Mask, who: str) -> Callable[[str], bool]:
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
