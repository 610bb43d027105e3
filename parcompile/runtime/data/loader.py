"""Training data for generated programs: synthetic tokens, or tokenized text through the
token cache of :mod:`parcompile.runtime.data.dataset` (one rule for every text source, the
``"bytes"`` tokenizer included).

Every rank draws the *same* global batch of a step (so the batch does not depend on the
plan), then takes its data-parallel rows and splits them into micro-batches
(:func:`parcompile.runtime.data.dataset.local_rows`). A batch is ``tokens`` (n, seq_len + 1)
and ``targets`` (n, seq_len), -100 where the loss is masked.

Sources (the `train.data` key):
- ``"synthetic"``: learnable token streams (each sequence an arithmetic progression mod
  the vocabulary with a random start and a stride from a small set), so loss can fall;
- ``"builtin:pydoc"``: the English text of Python's own ``pydoc_data`` topics, and any
  file, directory or glob: tokenized by :func:`parcompile.runtime.data.dataset.prepare`.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import torch

from parcompile.core.sources import BUILTIN_SOURCES
from parcompile.runtime.data.dataset import EvalBatches, TrainBatches, local_rows, prepare


def resolve_source(source: str, base: Path) -> str:
    """A relative path (data, tokenizer, checkpoint, weights) is taken relative to ``base``
    (the program's directory, absolute: ``Path(__file__).resolve().parent``) and normalised,
    so that what the program prints names the file as the user finds it (``/abs/tiny_hf``,
    not ``/abs/build/../tiny_hf``); names (``synthetic``, ``bytes``, built-in texts) stay.

    The normalisation is lexical (``os.path.normpath``), the inverse of how
    :func:`parcompile.codegen.emit._data_path` wrote the relative path (``os.path.relpath``
    of two ``abspath``), and ``base`` holds no symbolic links: the path names the same file."""
    if source in ("synthetic", "bytes") or source in BUILTIN_SOURCES or Path(source).is_absolute():
        return source
    return os.path.normpath(base / source)


class SyntheticBatches:
    """``data = "synthetic"`` in the interface of :class:`parcompile.runtime.data.dataset.TrainBatches`:
    ``batch(step)`` -> (tokens (global_batch, seq_len + 1) int64, targets (global_batch,
    seq_len), every target counted). The draw depends only on ``seed`` and ``step``."""

    def __init__(self, vocab: int, seq_len: int, global_batch: int, seed: int):
        self.vocab, self.seq_len, self.global_batch, self.seed = vocab, seq_len, global_batch, seed

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed((self.seed * 7919 + step) % (2**63 - 1))   # any seed of the spec
        n, t = self.global_batch, self.seq_len + 1
        start = torch.randint(0, self.vocab, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        tokens = (start + stride * torch.arange(t)[None, :]) % self.vocab
        return tokens, tokens[:, 1:]


def prepare_cache(source: str, data: dict):
    """The token cache of ``source`` (a data path, glob or built-in name) for the program's
    ``data`` settings (``tokenizer``, ``data_format``, ``text_field``). Every rank calls
    it: a file lock lets one process per cache directory tokenize (once; a cache that
    exists is reused) while the others wait and then open the same cache read-only, and a
    bad file raises the same error on every rank (no rank waits at a barrier for one
    that failed).

    Raises:
        parcompile.runtime.data.dataset.DataError: unreadable data (path and line), an empty dataset,
            a missing tokenizer.
    """
    return prepare(source, tokenizer=data["tokenizer"], data_format=data["data_format"],
                   text_field=data["text_field"])


def training_data(source: str, data: dict, vocab: int, seq_len: int, global_batch: int, seed: int):
    """Step-indexed global batches: ``batch(step)`` -> (tokens (global_batch, seq_len + 1),
    targets (global_batch, seq_len), -100 where a target is masked). Every rank draws the
    same global batch; step k's samples depend only on (seed, k), so a resumed run sees
    exactly the samples of the uninterrupted one (SPEC "Real training jobs")."""
    if source == "synthetic":
        return SyntheticBatches(vocab, seq_len, global_batch, seed)
    return TrainBatches(prepare_cache(source, data), seq_len, global_batch, seed)


def eval_data(source: str | None, data: dict, vocab: int, seq_len: int, global_batch: int,
              eval_batches: int | None):
    """The eval set's global batches, in order (None without ``eval_data``); for
    ``"synthetic"``, ``eval_batches`` (default 1) batches drawn from a seed of their own."""
    if source is None:
        return None
    if source == "synthetic":
        draw = SyntheticBatches(vocab, seq_len, global_batch, seed=2**31 - 1)
        return [draw.batch(b) for b in range(eval_batches or 1)]
    return EvalBatches(prepare_cache(source, data), seq_len, global_batch, eval_batches)


def batch_digest(tokens: torch.Tensor, targets: torch.Tensor) -> int:
    """CRC-32 of a global batch's tokens and targets: equal digests, equal samples (resume tests)."""
    return zlib.crc32(targets.numpy().tobytes(), zlib.crc32(tokens.numpy().tobytes()))


__all__ = ["resolve_source", "SyntheticBatches", "prepare_cache", "training_data", "eval_data", "local_rows",
           "batch_digest"]
