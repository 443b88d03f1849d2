"""Earlier spellings of public keywords, kept working with a ``FutureWarning`` where a rename
would break a documented call (docs/plan-language.md#names-and-keywords)."""

from __future__ import annotations

__all__ = ["renamed_keywords"]

import functools
import warnings
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def renamed_keywords(**renames: str) -> Callable[[F], F]:
    """A decorator: each ``old=`` keyword of ``renames`` (``old="new"``) is passed on as ``new=``
    with a ``FutureWarning``; both at once is a ``TypeError``.  The signature shown
    (``inspect.signature``) is the new one."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            for old, new in renames.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{fn.__name__}() got both {old}= and {new}=; {old}= is the earlier name of {new}=")
                    warnings.warn(f"{fn.__name__}({old}=...) is now {fn.__name__}({new}=...)", FutureWarning, stacklevel=2)
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return call  # type: ignore[return-value]

    return wrap
