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


def plural(n: int, word: str, many: str | None = None) -> str:
    """``plural(1, "rank") == "1 rank"``, ``plural(2, "rank") == "2 ranks"``;
    ``many`` spells an irregular plural (``plural(3, "micro-batch", "micro-batches")``)."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


def and_list(items: Iterable[object], quote: bool = False) -> str:
    """``["a", "b"]`` -> ``"a and b"`` (see :func:`or_list`)."""
    return or_list(items, quote, conjunction="and")


def close_matches(word: str, choices: Iterable[str]) -> list[str]:
    """The choices ``word`` was most likely meant as, best first ([] when none is close).

    A choice equal to ``word`` but for case wins outright (``adamW`` -> ``adamw``,
    ``tb/s`` -> ``TB/s``; ``gb/s`` -> both ``GB/s`` and ``Gb/s``); otherwise the closest
    spelling, compared case-insensitively, so ``Gib`` finds ``GiB`` rather than ``Gb/s``; but
    first the choices ``word`` is a ``-``-separated prefix of, or that are one of ``word``
    (``gb200`` -> ``gb200-nvl72``, ``b200-sxm`` -> ``b200``).
    """
    choices = list(dict.fromkeys(choices))
    folded = word.casefold()
    same = [c for c in choices if c.casefold() == folded and c != word]
    if same:
        return same
    # a name cut or extended at a `-` (`gb200` for `gb200-nvl72`, `b200-sxm` for `b200`, `a100`
    # for both `a100-*`): closer in meaning than the nearest spelling (`b200`, `h100-sxm`)
    family = [c for c in choices if c.casefold().startswith(folded + "-") or folded.startswith(c.casefold() + "-")]
    if family:
        return family
    by_folded: dict[str, str] = {}
    for c in choices:
        by_folded.setdefault(c.casefold(), c)
    close = difflib.get_close_matches(folded, list(by_folded), n=1, cutoff=0.6)
    return [by_folded[c] for c in close]


#: names users bring from transformers' config.json, Megatron-LM flags and torch dtypes ->
#: the spec's own key or value (suggested only where that name is one of the choices)
ALIASES = {
    "learning_rate": "lr", "num_layers": "layers", "num_hidden_layers": "layers", "n_layer": "layers",
    "hidden_size": "hidden", "n_embd": "hidden", "num_attention_heads": "heads", "n_head": "heads",
    "num_key_value_heads": "kv_heads", "num_query_groups": "kv_heads", "intermediate_size": "ffn_hidden",
    "ffn_hidden_size": "ffn_hidden", "vocab_size": "vocab", "seq_length": "seq_len", "max_seq_len": "seq_len",
    "micro_batch_size": "micro_batch", "global_batch_size": "global_batch", "tensor_parallel": "tp",
    "tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp", "context_parallel_size": "cp",
    "expert_model_parallel_size": "ep", "train_iters": "steps",
    "float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "half": "fp16", "float": "fp32",
}


def did_you_mean(word: str, choices: Iterable[str], case_note: str | None = None) -> str:
    """``"did you mean `rmsnorm`? "`` when a choice is close to ``word`` (or ``word`` is
    another tool's name for a choice, :data:`ALIASES`: ``float32`` -> ``fp32``,
    ``learning_rate`` -> ``lr``), else ``""``.

    Case-aware (see :func:`close_matches`). When the suggestion differs from ``word`` only
    in case, ``case_note`` (e.g. ``"units are case-sensitive"``) follows it in brackets.
    """
    choices = list(choices)
    alias = ALIASES.get(word)
    if alias is not None and alias != word and alias in choices:
        return f"did you mean `{alias}`? "
    close = close_matches(word, choices)
    if not close:
        return ""
    suggestion = or_list(close, quote=True)
    if case_note and all(c.casefold() == word.casefold() for c in close):
        return f"did you mean {suggestion} ({case_note})? "
    return f"did you mean {suggestion}? "


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
