"""Small helpers that word diagnostics: lists, suggestions, divisors."""

from __future__ import annotations

import difflib
from typing import Iterable

#: Divisors are listed in help lines only for numbers up to this (keeps help instant).
MAX_DIVISIBLE = 10**12


def or_list(items: Iterable[object], quote: bool = False, conjunction: str = "or") -> str:
    """``[1, 2, 4]`` -> ``"1, 2 or 4"``; with ``quote`` each item is in backticks."""
    words = [f"`{i}`" if quote else str(i) for i in items]
    if len(words) <= 1:
        return "".join(words)
    return ", ".join(words[:-1]) + f" {conjunction} " + words[-1]


def and_list(items: Iterable[object], quote: bool = False) -> str:
    """``["a", "b"]`` -> ``"a and b"`` (see :func:`or_list`)."""
    return or_list(items, quote, conjunction="and")


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``"did you mean `rmsnorm`? "`` when a choice is close to ``word``, else ``""``."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"did you mean `{close[0]}`? " if close else ""


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n`` in increasing order ([] for n < 1 or n too large)."""
    if n < 1 or n > MAX_DIVISIBLE:
        return []
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i * i != n:
                large.append(n // i)
        i += 1
    return small + large[::-1]


def choices_words(values: list[int], limit: int = 12) -> str:
    """``[1, 2, 4]`` -> ``"1, 2 or 4"``; a long list keeps its first ``limit - 1`` and its last."""
    if len(values) > limit:
        return ", ".join(map(str, values[:limit - 1])) + ", ... or " + str(values[-1])
    return or_list(values)


def even_split(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` whole numbers differing by at most one, larger first.

    ``even_split(30, 4) == [8, 8, 7, 7]``.
    """
    base, extra = divmod(total, parts)
    return [base + 1] * extra + [base] * (parts - extra)
