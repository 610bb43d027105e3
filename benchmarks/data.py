"""Data pipeline speed (issue 15). Prints figures; not a timed test.

* Tokenization: tokens/s of ``dataset.prepare`` into a fresh cache (reading the jsonl,
  hashing the files, tokenizing, writing the memory-mapped cache) against the tokenizer's
  own ``encode_batch`` on the same documents already in memory (target: ratio >= 0.8).
  The corpus is tinyshakespeare (``../shared/data``; Python's ``pydoc_data`` text when it
  is absent) repeated to ``--mb`` MB, cut into documents of about 4 KB at blank lines,
  written as one ``.jsonl``. The tokenizer is a byte-level BPE trained here on the corpus
  (``--vocab``), or ``--tokenizer PATH`` (a tokenizer.json or a directory holding one).
* Data time per step: ``TrainBatches.batch`` for a global batch of ``--global-batch`` x
  (``--seq-len`` + 1) tokens, as a share of a step time ``--step-time`` (seconds,
  default 1; target < 2%). The cache is then opened afresh (as a training rank does)
  and read through its memory map.

Run: ``python benchmarks/data.py [--mb 10] [--vocab 8000] [--tokenizer PATH]
[--global-batch 64] [--seq-len 2048] [--step-time 1.0] [--steps 50]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from parcompile.runtime.data import dataset as ds

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


def corpus(mb: float) -> tuple[str, list[str]]:
    if SHAKESPEARE.is_file():
        name, text = "tinyshakespeare", SHAKESPEARE.read_text(encoding="utf-8")
    else:
        name = "pydoc_data (tinyshakespeare absent)"
        text = Path(importlib.util.find_spec("pydoc_data.topics").origin).read_text(encoding="utf-8")
    paras = text.split("\n\n")
    docs, cur, size, target = [], [], 0, int(mb * 1e6)
    total = 0
    while total < target:
        for p in paras:
            cur.append(p)
            size += len(p) + 2
            if size >= 4096:
                doc = "\n\n".join(cur)
                docs.append(doc)
                total += len(doc.encode())
                cur, size = [], 0
                if total >= target:
                    break
    return name, docs


def train_tokenizer(docs: list[str], vocab: int, out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    t.train_from_iterator(docs[:300], trainer)
    t.save(str(out / "tokenizer.json"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=10.0)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--step-time", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        name, docs = corpus(args.mb)
        src = tmp / "corpus.jsonl"
        src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        nbytes = src.stat().st_size
        tok_path = args.tokenizer or str(train_tokenizer(docs, args.vocab, tmp))
        tok = ds.load_tokenizer(tok_path)
        print(f"corpus: {name}, {len(docs)} documents, {nbytes / 1e6:.1f} MB jsonl; "
              f"tokenizer: {'trained BPE' if args.tokenizer is None else tok_path}, vocab {tok.vocab_size}; "
              f"{os.cpu_count()} CPUs")

        # each measurement gets a freshly loaded tokenizer (a cold BPE word cache), as prepare does
        wall = {"fast": [], "plain": [], "prepare": []}
        cpu = {"fast": [], "plain": [], "prepare": []}
        ntok = 0

        def timed(key, fn):
            w, c = time.perf_counter(), time.process_time()
            out = fn()
            wall[key].append(time.perf_counter() - w)
            cpu[key].append(time.process_time() - c)
            return out

        for r in range(args.repeats):
            fresh = ds.load_tokenizer(tok_path).backend
            ids = timed("fast", lambda: [e.ids for e in fresh.encode_batch_fast(docs, add_special_tokens=False)])
            ntok = sum(map(len, ids)) + (len(docs) if tok.eos_id is not None else 0)  # + eos, as prepare writes
            del ids
            fresh = ds.load_tokenizer(tok_path).backend
            timed("plain", lambda: [e.ids for e in fresh.encode_batch(docs, add_special_tokens=False)])
            cache = timed("prepare", lambda: ds.prepare(str(src), tokenizer=tok_path, cache_dir=tmp / f"cache{r}",
                                                         progress=False))
            assert not cache.reused and cache.num_tokens == ntok, (cache.num_tokens, ntok)
        print(f"tokens: {ntok:,} ({ntok / nbytes:.3f} per byte); best of {args.repeats}, wall (CPU seconds "
              "of all threads)")
        for key, label in (("fast", "encode_batch_fast + ids, in memory"), ("plain", "encode_batch + ids, in memory"),
                           ("prepare", "prepare, fresh cache, from jsonl")):
            w, c = min(wall[key]), min(cpu[key])
            print(f"  {label:36s} {ntok / w / 1e6:6.2f} M tokens/s  ({w:.2f} s wall, {c:.2f} s CPU)")
        for key in ("fast", "plain"):
            print(f"ratio prepare / encode_batch{'_fast' if key == 'fast' else ''}: "
                  f"{min(wall[key]) / min(wall['prepare']):.2f} by wall time, "
                  f"{min(cpu[key]) / min(cpu['prepare']):.2f} by CPU time (target >= 0.8)")
        t0 = time.perf_counter()
        again = ds.prepare(str(src), tokenizer=tok_path, cache_dir=tmp / "cache0", progress=False)
        print(f"prepare again (reused={again.reused}): {time.perf_counter() - t0:.3f} s (hashing the files)")

        # data time per step, read as a rank reads: a fresh read-only TokenCache
        cache = ds.TokenCache(again.path)
        seq = args.seq_len
        need = args.global_batch * (seq + 1)
        if cache.num_samples(seq) < args.global_batch:
            print(f"corpus too small for a global batch of {args.global_batch} x {seq + 1} "
                  f"({cache.num_samples(seq)} samples); use a larger --mb")
            return 1
        tb = ds.TrainBatches(cache, seq, args.global_batch, seed=0)
        times = []
        for k in range(args.steps):
            t0 = time.perf_counter()
            toks, tgts = tb.batch(k)
            times.append(time.perf_counter() - t0)
        assert toks.shape == (args.global_batch, seq + 1) and tgts.shape == (args.global_batch, seq)
        mean, worst = statistics.mean(times), max(times)
        epochs = args.steps * args.global_batch / tb.num_samples
        print(f"TrainBatches.batch ({args.global_batch} x {seq + 1} = {need:,} tokens, {args.steps} steps, "
              f"{epochs:.2f} epochs of {tb.num_samples} samples): mean {mean * 1e3:.2f} ms, max {worst * 1e3:.2f} ms"
              f" = {100 * mean / args.step_time:.2f}% of a {args.step_time:g} s step (target < 2%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
