"""Unit tests of parcompile.runtime that need no process group."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from parcompile.runtime.distributed.context import Axis
from parcompile.runtime.data.loader import SyntheticBatches
from parcompile.runtime.data.dataset import TrainBatches, local_rows, prepare
from parcompile.runtime.model.layers import apply_rope, global_init, shard, vocab_parallel_cross_entropy
from parcompile.runtime.train.step import lr_at

ONE = Axis("tp", [0], 0)


def test_initialisation_is_independent_of_the_layout():
    full = global_init("layers.3.attn.wq.weight", (8, 6), seed=7, std=0.02)
    again = global_init("layers.3.attn.wq.weight", (8, 6), seed=7, std=0.02)
    other = global_init("layers.3.attn.wk.weight", (8, 6), seed=7, std=0.02)
    assert torch.equal(full, again) and not torch.equal(full, other)
    for size in (2, 4):
        for dim in (0, 1) if 6 % size == 0 else (0,):
            parts = [shard(full, dim, Axis("tp", list(range(size)), i)) for i in range(size)]
            assert torch.equal(torch.cat(parts, dim), full)
    assert abs(full.std().item() - 0.02) < 0.01


def test_padded_rows_start_at_zero():
    w = global_init("embedding.weight", (16, 4), seed=1, std=0.02, valid_rows=13)
    assert w[13:].abs().sum() == 0 and w[:13].abs().sum() > 0


def test_shard_refuses_a_size_that_does_not_divide():
    with pytest.raises(ValueError, match="does not divide"):
        shard(torch.zeros(6, 3), 0, Axis("tp", [0, 1, 2, 3], 1))


def test_vocab_parallel_cross_entropy_equals_torch_on_one_rank():
    torch.manual_seed(0)
    logits = torch.randn(10, 16, requires_grad=True)
    target = torch.randint(0, 13, (10,))
    ours = vocab_parallel_cross_entropy(logits, target, ONE, vocab=13)
    ref = F.cross_entropy(logits[:, :13], target, reduction="none")
    torch.testing.assert_close(ours, ref)
    ours.sum().backward()
    g = logits.grad.clone()
    logits.grad = None
    ref.sum().backward()
    torch.testing.assert_close(g[:, :13], logits.grad[:, :13])
    assert g[:, 13:].abs().sum() == 0  # padded columns get no gradient


def test_rope_rotates_pairs_and_keeps_norms():
    from parcompile.runtime.model.layers import rope_tables

    cos, sin = rope_tables(5, 4, 10000.0)
    x = torch.randn(1, 5, 2, 6)
    y = apply_rope(x, cos, sin)
    assert torch.equal(y[0, 0], x[0, 0])                      # position 0 is not rotated
    assert torch.equal(y[..., 4:], x[..., 4:])                # dims past rot_dim pass through
    torch.testing.assert_close(y[..., :4].norm(dim=-1), x[..., :4].norm(dim=-1))


def test_synthetic_batches_are_deterministic_and_split_by_rank():
    b = SyntheticBatches(vocab=50, seq_len=8, global_batch=8, seed=3)
    (x2, y2), (x3, _) = b.batch(2), b.batch(3)
    assert torch.equal(x2, b.batch(2)[0]) and not torch.equal(x2, x3)
    assert x2.shape == (8, 9) and int(x2.max()) < 50 and torch.equal(y2, x2[:, 1:])
    parts = local_rows(x2, y2, 0, 2, 2) + local_rows(x2, y2, 1, 2, 2)
    assert torch.equal(torch.cat([t for t, _ in parts]), x2) and torch.equal(torch.cat([t for _, t in parts]), y2)


def test_builtin_text_is_real_english_bytes(tmp_path):
    cache = prepare("builtin:pydoc", tokenizer="bytes", cache_dir=tmp_path)
    x, y = TrainBatches(cache, 32, 4, 1).batch(0)
    text = bytes(cache.tokens[:20000].tolist()).decode("utf-8", errors="replace")
    assert cache.num_tokens > 100_000 and " the " in text
    assert x.dtype == torch.int64 and int(x.max()) < 256 and torch.equal(y, x[:, 1:])


def test_learning_rate_schedules():
    base = dict(lr=1.0, warmup_steps=4, steps=14, min_lr=0.1)
    assert [lr_at(s, dict(base, lr_schedule="constant")) for s in (0, 3, 4, 13)] == [0.25, 1.0, 1.0, 1.0]
    cos = dict(base, lr_schedule="cosine")
    assert math.isclose(lr_at(4, cos), 1.0) and math.isclose(lr_at(13, cos), 0.1)
    lin = dict(base, lr_schedule="linear")
    assert math.isclose(lr_at(13, lin), 0.1) and math.isclose(lr_at(8, lin), 1.0 - 0.9 * 4 / 9)


SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


@pytest.mark.skipif(not SHAKESPEARE.exists(), reason="../shared/data/tinyshakespeare.txt is not beside this clone")
def test_shared_corpus_loads_as_bytes(tmp_path):
    cache = prepare(str(SHAKESPEARE), tokenizer="bytes", cache_dir=tmp_path)
    assert cache.num_tokens == SHAKESPEARE.stat().st_size      # one document, no end-of-text token for bytes
    x, _ = TrainBatches(cache, 64, 4, 2).batch(0)
    text = bytes(x[0].tolist()).decode("utf-8", errors="replace")
    assert x.shape == (4, 65) and any(w in text.lower() for w in (" the ", " and ", " to ", " of ", "\n"))
