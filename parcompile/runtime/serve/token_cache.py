"""The token cache on disk and the batches read from it (:func:`parcompile.runtime.data.dataset.prepare`
writes it): :class:`TokenCache` (read-only, memory-mapped samples), :class:`CacheWriter` (what
``prepare`` streams into a temporary directory), :class:`TrainBatches` / :class:`EvalBatches`
(the global batch of a step) and :func:`local_rows` (this data-parallel rank's micro-batches).

Shapes and conventions as :mod:`parcompile.runtime.data.dataset`'s: a batch is ``tokens`` (n,
seq_len + 1) int64 and ``targets`` (n, seq_len) int64, ``-100`` (:data:`IGNORE`) where a
token is not a loss target."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from parcompile.runtime.data.files import DataError

#: the cache layout's version (meta.json ``format``; part of the cache key)
FORMAT_VERSION = "parcompile.tokens/1"
#: the target of a token that is not a loss target
IGNORE = -100


class TokenCache:
    """A tokenized corpus on disk, opened read-only and memory-mapped.

    Files in ``path``: ``tokens.bin`` (uint32, all tokens), for ``prompt_completion`` and
    ``chat`` also ``mask.bin`` (uint8, 1 where the token is a loss target) and
    ``offsets.bin`` (int64, num_examples + 1 example starts), and ``meta.json`` (format,
    data_format, files, tokenizer, counts, warnings).

    Attributes: ``path``, ``meta`` (dict), ``data_format``, ``num_tokens``,
    ``num_examples`` (documents for text, examples kept otherwise), ``max_token_id``,
    ``reused`` (True when ``prepare`` found the cache already built), ``warnings``
    (prepare-time warnings, e.g. chat examples skipped).

    Raises: DataError when ``path`` is not a complete cache of this format.
    """

    def __init__(self, path: str | os.PathLike, reused: bool = False):
        self.path = Path(path)
        meta_path = self.path / "meta.json"
        if not meta_path.is_file():
            raise DataError("not a token cache (no meta.json)", self.path)
        self.meta = json.loads(meta_path.read_text())
        if self.meta.get("format") != FORMAT_VERSION:
            raise DataError(f"token cache format {self.meta.get('format')!r}, expected {FORMAT_VERSION!r}", self.path)
        self.data_format = self.meta["data_format"]
        self.num_tokens = int(self.meta["num_tokens"])
        self.num_examples = int(self.meta["num_examples"])
        self.max_token_id = int(self.meta["max_token_id"])
        self.warnings = list(self.meta.get("warnings", []))
        self.reused = reused
        self.source = self.meta.get("source")   # the data key it was prepared from
        self._tokens = self._mask = self._offsets = None

    @property
    def masked(self) -> bool:
        """True for prompt_completion and chat (one example = one sample, loss masks)."""
        return self.data_format != "text"

    def _open(self):
        if self._tokens is None:
            self._tokens = np.memmap(self.path / "tokens.bin", dtype=np.uint32, mode="r")
            if self.masked:
                self._mask = np.memmap(self.path / "mask.bin", dtype=np.uint8, mode="r")
                self._offsets = np.memmap(self.path / "offsets.bin", dtype=np.int64, mode="r")

    @property
    def tokens(self) -> np.ndarray:
        """All tokens, (num_tokens,) uint32, memory-mapped read-only."""
        self._open()
        return self._tokens

    @property
    def mask(self) -> np.ndarray | None:
        """(num_tokens,) uint8 loss mask (masked formats), else None."""
        self._open()
        return self._mask

    @property
    def offsets(self) -> np.ndarray | None:
        """(num_examples + 1,) int64 example starts (masked formats), else None."""
        self._open()
        return self._offsets

    def num_samples(self, seq_len: int) -> int:
        """Samples of ``seq_len + 1`` tokens: ``num_tokens // (seq_len + 1)`` for text (the
        last partial one dropped), one per example otherwise."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        return self.num_examples if self.masked else self.num_tokens // (seq_len + 1)

    def truncated(self, seq_len: int) -> int:
        """How many examples are longer than ``seq_len + 1`` tokens (cut in ``sample``); 0 for text."""
        if not self.masked:
            return 0
        return int((np.diff(self.offsets) > seq_len + 1).sum())

    def without_loss(self, seq_len: int, chunk: int = 1 << 20) -> int:
        """How many examples have no loss token among the ``seq_len`` targets of their
        sample (:meth:`sample` cuts each to ``seq_len + 1`` tokens: a prompt of ``seq_len``
        tokens or more leaves nothing to learn); 0 for text. Reads the loss mask once, in
        chunks of ``chunk`` examples (no per-token index array)."""
        if not self.masked or self.num_examples == 0:
            return 0
        self._open()
        total = 0
        for lo in range(0, self.num_examples, chunk):
            starts = np.asarray(self._offsets[lo:min(lo + chunk, self.num_examples) + 1], dtype=np.int64)
            a, b = starts[:-1] + 1, np.minimum(starts[1:], starts[:-1] + seq_len + 1)   # target positions
            nonempty = b > a
            if not nonempty.any():
                total += int(a.size)
                continue
            first, last = int(a[nonempty][0]), int(b[nonempty].max())
            window = np.asarray(self._mask[first:last], dtype=np.int64)
            bounds = np.stack([a[nonempty] - first, b[nonempty] - first], axis=1).ravel()
            sums = np.add.reduceat(np.append(window, 0), bounds)[0::2]   # loss tokens in [a, b)
            total += int((~nonempty).sum()) + int((sums == 0).sum())
        return total

    def sample_warnings(self, seq_len: int) -> list[str]:
        """Prepare-time warnings plus the truncation count for this ``seq_len``."""
        out = list(self.warnings)
        n = self.truncated(seq_len)
        if n:
            out.append(f"{n} of {self.num_examples} examples are longer than seq_len + 1 = {seq_len + 1} "
                       "tokens and were truncated")
        return out

    @property
    def pad_id(self) -> int:
        """The padding token of masked samples: the tokenizer's pad, else eos, else 0."""
        p = self.meta.get("pad_id")
        if p is None:
            p = self.meta.get("eos_id")
        return 0 if p is None else int(p)

    def sample(self, i: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``i``: (tokens (seq_len + 1,) int64, targets (seq_len,) int64) with
        ``targets[j] = tokens[j + 1]``, or -100 where the token at ``j + 1`` is not a loss
        token (masked formats: prompt, non-assistant turns, padding). Reads only its slice.

        Raises: IndexError for ``i`` outside ``[0, num_samples(seq_len))``.
        """
        toks, tgts = self._sample_np(i, seq_len)
        return torch.from_numpy(toks), torch.from_numpy(tgts)

    def _sample_np(self, i: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        n = self.num_samples(seq_len)
        if not 0 <= i < n:
            raise IndexError(f"sample {i} out of range: there are {n} samples of seq_len + 1 = {seq_len + 1} tokens")
        t = seq_len + 1
        self._open()
        if not self.masked:
            toks = self._tokens[i * t:(i + 1) * t].astype(np.int64)
            return toks, toks[1:].copy()
        a, b = int(self._offsets[i]), int(self._offsets[i + 1])
        b = min(b, a + t)
        toks = np.full(t, self.pad_id, dtype=np.int64)
        mask = np.zeros(t, dtype=bool)
        toks[:b - a] = self._tokens[a:b]
        mask[:b - a] = self._mask[a:b] != 0
        tgts = np.where(mask[1:], toks[1:], IGNORE)
        return toks, tgts

    def batch(self, indices: list[int], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``indices`` stacked: (tokens (n, seq_len + 1), targets (n, seq_len)) int64.
        An index of -1 is a fully masked row (tokens 0, targets -100)."""
        t = seq_len + 1
        n = len(indices)
        idx = np.asarray(indices, dtype=np.int64)
        if not self.masked and n and (idx >= 0).all():
            limit = self.num_samples(seq_len)
            if (idx >= limit).any():
                raise IndexError(f"sample {int(idx.max())} out of range: there are {limit} samples")
            self._open()
            toks = self._tokens[(idx * t)[:, None] + np.arange(t)[None, :]].astype(np.int64)
            return torch.from_numpy(toks), torch.from_numpy(toks[:, 1:].copy())
        toks = np.zeros((n, t), dtype=np.int64)
        tgts = np.full((n, seq_len), IGNORE, dtype=np.int64)
        for r, i in enumerate(idx.tolist()):
            if i >= 0:
                toks[r], tgts[r] = self._sample_np(i, seq_len)
        return torch.from_numpy(toks), torch.from_numpy(tgts)

    def __repr__(self) -> str:
        return (f"TokenCache({str(self.path)!r}, {self.data_format}, tokens={self.num_tokens}, "
                f"examples={self.num_examples}, reused={self.reused})")


class CacheWriter:
    """Streams tokens (and masks, offsets) into a temporary cache directory."""

    def __init__(self, tmp: Path, masked: bool):
        self.tmp = tmp
        self.masked = masked
        self.tok = open(tmp / "tokens.bin", "wb")
        self.mask = open(tmp / "mask.bin", "wb") if masked else None
        self.offsets = [0] if masked else None
        self.n = 0
        self.max_id = -1
        self.examples = 0

    def add(self, arrays: list[np.ndarray], masks: list[np.ndarray] | None = None):
        if not arrays:
            return
        flat = np.concatenate(arrays).astype(np.uint32, copy=False)
        if flat.size:
            self.max_id = max(self.max_id, int(flat.max()))
        self.tok.write(flat.tobytes())
        self.n += flat.size
        self.examples += len(arrays)
        if self.masked:
            self.mask.write(np.concatenate(masks).astype(np.uint8, copy=False).tobytes())
            for a in arrays:
                self.offsets.append(self.offsets[-1] + a.size)

    def close(self):
        self.tok.close()
        if self.masked:
            self.mask.close()
            np.asarray(self.offsets, dtype=np.int64).tofile(self.tmp / "offsets.bin")



# ----------------------------------------------------------------------------------------
# Batches

def epoch_seed(seed: int, epoch: int) -> int:
    """The permutation seed of ``epoch``: the first 8 bytes (little-endian) of
    ``sha256(f"parcompile.data/1:{seed}:{epoch}")``, masked to 63 bits."""
    d = hashlib.sha256(f"parcompile.data/1:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(d[:8], "little") & ((1 << 63) - 1)


class TrainBatches:
    """Deterministic training batches over a token cache.

    Epoch e visits the ``num_samples(seq_len)`` samples in the order
    ``torch.randperm(n, generator=torch.Generator().manual_seed(epoch_seed(seed, e)))``;
    step k takes positions ``[k * global_batch, (k + 1) * global_batch)`` of the
    concatenation of epochs 0, 1, 2, ... (a batch may cross an epoch boundary). Step k's
    samples are a pure function of (cache, seq_len, global_batch, seed, k), so a resumed
    run sees exactly what an uninterrupted one would.

    Raises: DataError (in the constructor) when there are fewer samples than one global
        batch needs.
    """

    def __init__(self, cache: TokenCache, seq_len: int, global_batch: int, seed: int):
        self.cache = cache
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.num_samples = cache.num_samples(seq_len)
        if self.num_samples < global_batch:
            unit = (f"samples of seq_len + 1 = {seq_len + 1} tokens ({cache.num_tokens} tokens in all)"
                    if not cache.masked else "examples")
            raise DataError(f"the training data has {self.num_samples} {unit}; one global batch needs "
                            f"{global_batch}", cache.source,
                            help="add data, or lower global_batch or seq_len")
        self._perms: dict[int, torch.Tensor] = {}

    def permutation(self, epoch: int) -> torch.Tensor:
        """(num_samples,) int64: the order in which ``epoch`` visits the samples."""
        p = self._perms.get(epoch)
        if p is None:
            g = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
            p = torch.randperm(self.num_samples, generator=g)
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = p
        return p

    def epoch(self, step: int) -> float:
        """Epochs completed at the start of ``step`` (fractional)."""
        return step * self.global_batch / self.num_samples

    def indices(self, step: int) -> list[int]:
        """The sample indices of ``step`` (``global_batch`` of them)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        n = self.num_samples
        out = []
        pos = step * self.global_batch
        end = pos + self.global_batch
        while pos < end:
            e, off = divmod(pos, n)
            take = min(end - pos, n - off)
            out.extend(self.permutation(e)[off:off + take].tolist())
            pos += take
        return out

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens (global_batch, seq_len + 1), targets (global_batch, seq_len)) int64."""
        return self.cache.batch(self.indices(step), self.seq_len)


class EvalBatches:
    """Evaluation batches: the samples in order, never shuffled.

    ``len(self)`` global batches: ``ceil(num_samples / global_batch)`` when
    ``eval_batches`` is None (all), else ``min(eval_batches, that)`` (fewer than asked is
    noted in ``warnings``). The last batch is padded with fully masked rows (tokens 0,
    targets -100).

    Raises: DataError when the cache has no sample of ``seq_len + 1`` tokens.
    """

    def __init__(self, cache: TokenCache, seq_len: int, global_batch: int, eval_batches: int | None = None):
        self.cache = cache
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.num_samples = cache.num_samples(seq_len)
        self.warnings: list[str] = []
        if self.num_samples == 0:
            raise DataError(f"the eval data has no sample of seq_len + 1 = {seq_len + 1} tokens "
                            f"({cache.num_tokens} tokens in all)", cache.source)
        available = -(-self.num_samples // global_batch)
        if eval_batches is None:
            self.num_batches = available
        else:
            if eval_batches < 1:
                raise ValueError(f"eval_batches must be >= 1 or None, got {eval_batches}")
            self.num_batches = min(eval_batches, available)
            if eval_batches > available:
                self.warnings.append(f"eval_batches = {eval_batches} but the eval data has {self.num_samples} "
                                     f"samples, {available} global batches of {global_batch}; using {available}")

    def __len__(self) -> int:
        return self.num_batches

    def indices(self, b: int) -> list[int]:
        """Sample indices of eval batch ``b``; -1 marks a padding row."""
        if not 0 <= b < self.num_batches:
            raise IndexError(f"eval batch {b} out of range: there are {self.num_batches}")
        lo = b * self.global_batch
        return [i if i < self.num_samples else -1 for i in range(lo, lo + self.global_batch)]

    def batch(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens (global_batch, seq_len + 1), targets (global_batch, seq_len)) int64."""
        return self.cache.batch(self.indices(b), self.seq_len)

    def __iter__(self):
        return (self.batch(b) for b in range(self.num_batches))


def local_rows(tokens: torch.Tensor, targets: torch.Tensor, dp_index: int, dp_size: int,
               micro_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This data-parallel rank's contiguous rows of a global batch, split into
    micro-batches of ``micro_batch`` rows: a list of (tokens (micro_batch, seq_len + 1),
    targets (micro_batch, seq_len)); every program's data-parallel split."""
    rows = tokens.shape[0] // dp_size
    sl = slice(dp_index * rows, (dp_index + 1) * rows)
    return list(zip(tokens[sl].split(micro_batch), targets[sl].split(micro_batch)))
