"""Training data for generated programs: byte-level text or synthetic tokens.

Every rank draws the *same* global batch of a step (so the batch does not depend on the
plan), then takes its data-parallel rows and splits them into micro-batches. Sequences
are ``seq_len + 1`` tokens long: inputs are ``[:-1]``, targets ``[1:]``.

Sources (the `train.data` key):
- ``"synthetic"``: learnable token streams (each sequence an arithmetic progression mod
  the vocabulary with a random start and a stride from a small set), so loss can fall;
- ``"builtin:pydoc"``: the English text of Python's own ``pydoc_data`` topics, read as
  bytes (every CPython carries it), for a real-text run on a fresh machine;
- any other string: a path to a text file, read as bytes (token = byte value).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from parcompile.config.schema import BUILTIN_SOURCES


def load_corpus(source: str) -> torch.Tensor | None:
    """The token stream of a text source as a 1-D uint8 tensor (None for ``synthetic``).

    Raises:
        FileNotFoundError: a path that does not exist.
        ValueError: a text shorter than 2 bytes.
    """
    if source == "synthetic":
        return None
    if source == "builtin:pydoc":
        spec = importlib.util.find_spec("pydoc_data.topics")
        raw = Path(spec.origin).read_bytes()
    else:
        raw = Path(source).read_bytes()
    if len(raw) < 2:
        raise ValueError(f"text data {source!r} has {len(raw)} bytes; need at least 2")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def resolve_source(source: str, base: Path) -> str:
    """A relative file path is taken relative to ``base`` (the program's directory)."""
    if source == "synthetic" or source in BUILTIN_SOURCES or Path(source).is_absolute():
        return source
    return str(base / source)


class GlobalBatches:
    """Deterministic global batches: ``batch(step)`` -> (global_batch, seq_len + 1) int64.

    The draw depends only on ``seed`` and ``step``; for text, positions are uniform over the
    corpus (wrapping when the corpus is shorter than a sequence).
    """

    def __init__(self, source: str, vocab: int, seq_len: int, global_batch: int, seed: int):
        self.corpus = load_corpus(source)
        self.vocab = vocab
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        if self.corpus is not None and vocab < 256:
            raise ValueError(f"byte-level text needs vocab >= 256, the model has vocab = {vocab}")

    def batch(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 7919 + step)
        n, t = self.global_batch, self.seq_len + 1
        if self.corpus is None:
            start = torch.randint(0, self.vocab, (n, 1), generator=g)
            stride = torch.randint(1, 4, (n, 1), generator=g)
            return (start + stride * torch.arange(t)[None, :]) % self.vocab
        total = self.corpus.numel()
        offs = torch.randint(0, max(total - t, 1), (n, 1), generator=g)
        idx = (offs + torch.arange(t)[None, :]) % total
        return self.corpus[idx].long()


def local_microbatches(global_batch: torch.Tensor, dp_index: int, dp_size: int, micro_batch: int) -> list[torch.Tensor]:
    """This data-parallel rank's rows of the global batch, split into micro-batches of
    ``micro_batch`` sequences: a list of m tensors (micro_batch, seq_len + 1)."""
    rows = global_batch.shape[0] // dp_size
    mine = global_batch[dp_index * rows:(dp_index + 1) * rows]
    return list(mine.split(micro_batch))
