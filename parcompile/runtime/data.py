"""Training data for generated programs: synthetic tokens, or tokenized text through the
token cache of :mod:`parcompile.runtime.dataset` (:func:`training_data`).

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
    """A relative path (data, tokenizer, checkpoint) is taken relative to ``base`` (the
    program's directory); names (``synthetic``, ``bytes``, built-in texts) stay."""
    if source in ("synthetic", "bytes") or source in BUILTIN_SOURCES or Path(source).is_absolute():
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


class SyntheticBatches:
    """``data = "synthetic"`` in the interface of :class:`parcompile.runtime.dataset.TrainBatches`:
    ``batch(step)`` -> (tokens (global_batch, seq_len + 1), targets (global_batch, seq_len)),
    every target counted."""

    def __init__(self, vocab: int, seq_len: int, global_batch: int, seed: int):
        self.draw = GlobalBatches("synthetic", vocab, seq_len, global_batch, seed)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.draw.batch(step)
        return tokens, tokens[:, 1:]


def prepare_cache(source: str, data: dict, ctx=None):
    """The token cache of ``source`` (a data path, glob or built-in name) for the program's
    ``data`` settings (``tokenizer``, ``data_format``, ``text_field``). Every rank calls
    it: a file lock lets one process per cache directory tokenize (once; a cache that
    exists is reused) while the others wait and then open the same cache read-only, and a
    bad file raises the same error on every rank (no rank waits at a barrier for one
    that failed). ``ctx`` is unused (kept for the call sites).

    Raises:
        parcompile.runtime.dataset.DataError: unreadable data (path and line), an empty dataset,
            a missing tokenizer.
    """
    from parcompile.runtime import dataset

    return dataset.prepare(source, tokenizer=data["tokenizer"], data_format=data["data_format"],
                           text_field=data["text_field"])


def training_data(source: str, data: dict, vocab: int, seq_len: int, global_batch: int, seed: int, ctx=None):
    """Step-indexed global batches: ``batch(step)`` -> (tokens (global_batch, seq_len + 1),
    targets (global_batch, seq_len), -100 where a target is masked). Every rank draws the
    same global batch; step k's samples depend only on (seed, k), so a resumed run sees
    exactly the samples of the uninterrupted one (SPEC "Real training jobs")."""
    if source == "synthetic":
        return SyntheticBatches(vocab, seq_len, global_batch, seed)
    from parcompile.runtime import dataset

    return dataset.TrainBatches(prepare_cache(source, data, ctx), seq_len, global_batch, seed)


def eval_data(source: str | None, data: dict, vocab: int, seq_len: int, global_batch: int,
              eval_batches: int | None, ctx=None):
    """The eval set's global batches, in order (None without ``eval_data``); for
    ``"synthetic"``, ``eval_batches`` (default 1) batches drawn from a seed of their own."""
    if source is None:
        return None
    if source == "synthetic":
        draw = SyntheticBatches(vocab, seq_len, global_batch, seed=2**31 - 1)
        return [draw.batch(b) for b in range(eval_batches or 1)]
    from parcompile.runtime import dataset

    return dataset.EvalBatches(prepare_cache(source, data, ctx), seq_len, global_batch, eval_batches)


def local_rows(tokens: torch.Tensor, targets: torch.Tensor, dp_index: int, dp_size: int,
               micro_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This data-parallel rank's rows of a global batch, as m micro-batches of
    (tokens (micro_batch, seq_len + 1), targets (micro_batch, seq_len))."""
    return list(zip(local_microbatches(tokens, dp_index, dp_size, micro_batch),
                    local_microbatches(targets, dp_index, dp_size, micro_batch)))


def batch_digest(tokens: torch.Tensor, targets: torch.Tensor) -> int:
    """CRC-32 of a global batch's tokens and targets: equal digests, equal samples (resume tests)."""
    import zlib

    return zlib.crc32(targets.numpy().tobytes(), zlib.crc32(tokens.numpy().tobytes()))
