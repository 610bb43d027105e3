"""Unit tests of parcompile.runtime that need no process group."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from parcompile.runtime.context import Axis
from parcompile.runtime.data import GlobalBatches, load_corpus, local_microbatches
from parcompile.runtime.layers import apply_rope, global_init, shard, vocab_parallel_cross_entropy
from parcompile.runtime.train import lr_at

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
    from parcompile.runtime.layers import rope_tables

    cos, sin = rope_tables(5, 4, 10000.0)
    x = torch.randn(1, 5, 2, 6)
    y = apply_rope(x, cos, sin)
    assert torch.equal(y[0, 0], x[0, 0])                      # position 0 is not rotated
    assert torch.equal(y[..., 4:], x[..., 4:])                # dims past rot_dim pass through
    torch.testing.assert_close(y[..., :4].norm(dim=-1), x[..., :4].norm(dim=-1))


def test_global_batches_are_deterministic_and_split_by_rank():
    b = GlobalBatches("synthetic", vocab=50, seq_len=8, global_batch=8, seed=3)
    assert torch.equal(b.batch(2), b.batch(2)) and not torch.equal(b.batch(2), b.batch(3))
    assert b.batch(0).shape == (8, 9) and int(b.batch(0).max()) < 50
    parts = [mb for d in range(2) for mb in local_microbatches(b.batch(0), d, 2, 2)]
    assert torch.equal(torch.cat(parts), b.batch(0))


def test_builtin_text_is_real_english_bytes():
    corpus = load_corpus("builtin:pydoc")
    text = bytes(corpus[:20000].tolist()).decode("utf-8", errors="replace")
    assert corpus.numel() > 100_000 and " the " in text
    b = GlobalBatches("builtin:pydoc", vocab=256, seq_len=32, global_batch=4, seed=1).batch(0)
    assert b.dtype == torch.int64 and int(b.max()) < 256


def test_text_needs_a_byte_vocabulary():
    with pytest.raises(ValueError, match="vocab >= 256"):
        GlobalBatches("builtin:pydoc", vocab=100, seq_len=8, global_batch=2, seed=1)


def test_learning_rate_schedules():
    base = dict(lr=1.0, warmup_steps=4, steps=14, min_lr=0.1)
    assert [lr_at(s, dict(base, lr_schedule="constant")) for s in (0, 3, 4, 13)] == [0.25, 1.0, 1.0, 1.0]
    cos = dict(base, lr_schedule="cosine")
    assert math.isclose(lr_at(4, cos), 1.0) and math.isclose(lr_at(13, cos), 0.1)
    lin = dict(base, lr_schedule="linear")
    assert math.isclose(lr_at(13, lin), 0.1) and math.isclose(lr_at(8, lin), 1.0 - 0.9 * 4 / 9)


SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


@pytest.mark.skipif(not SHAKESPEARE.exists(), reason="../shared/data/tinyshakespeare.txt is not beside this clone")
def test_shared_corpus_loads_as_bytes():
    corpus = load_corpus(str(SHAKESPEARE))
    assert corpus.numel() == SHAKESPEARE.stat().st_size
    b = GlobalBatches(str(SHAKESPEARE), vocab=256, seq_len=64, global_batch=4, seed=2).batch(0)
    text = bytes(b[0].tolist()).decode("utf-8", errors="replace")
    assert b.shape == (4, 65) and any(w in text.lower() for w in (" the ", " and ", " to ", " of ", "\n"))
