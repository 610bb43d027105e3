"""parcompile.runtime.data.dataset: tokenizers, corpora, the token cache, batch order, masks, errors.

A small byte-level BPE (vocab 400) is trained here on tinyshakespeare (../shared/data) when
it is there, else on Python's pydoc_data text, so nothing needs the network.
"""

from __future__ import annotations

import importlib.util
import json
import threading
from pathlib import Path

import pytest
import torch

from parcompile.runtime.data import dataset as ds
from parcompile.runtime.data.dataset import DataError

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
# ChatML, with transformers' {% generation %} tags around what we count as the assistant turn
CHATML = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def corpus_text() -> str:
    if SHAKESPEARE.is_file():
        return SHAKESPEARE.read_text(encoding="utf-8")
    return Path(importlib.util.find_spec("pydoc_data.topics").origin).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def text() -> str:
    return corpus_text()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, text) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    t.train_from_iterator([text[i:i + 10_000] for i in range(0, 200_000, 10_000)], trainer)
    d = tmp_path_factory.mktemp("tok")
    t.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|endoftext|>",
        "chat_template": CHATML}))
    return d


@pytest.fixture(autouse=True)
def cache_env(tmp_path, monkeypatch):
    monkeypatch.setenv("PARCOMPILE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def hf(tok_dir):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(tok_dir / "tokenizer.json"))


def enc(hf, s: str) -> list[int]:
    return hf.encode(s, add_special_tokens=False).ids


def docs(text: str, n: int, size: int = 700) -> list[str]:
    return [text[i * size:(i + 1) * size] for i in range(n)]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, table: dict) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table(table), path)
    return path


def raises(fn, *args, **kw) -> DataError:
    with pytest.raises(DataError) as info:
        fn(*args, **kw)
    return info.value


# ---------------------------------------------------------------------------- tokenizer

def test_tokenizer_fields(tok_dir, hf):
    tok = ds.load_tokenizer(str(tok_dir))
    assert tok.vocab_size == 400 == max(hf.get_vocab(with_added_tokens=True).values()) + 1
    assert tok.eos_id == hf.token_to_id("<|endoftext|>") and tok.bos_id == hf.token_to_id("<s>")
    assert tok.pad_id is None and tok.chat_template == CHATML
    assert [f.name for f in tok.files] == ["tokenizer.json", "tokenizer_config.json"]
    assert tok.encode_batch(["hello world", "<|im_end|>x"]) == [enc(hf, "hello world"), enc(hf, "<|im_end|>x")]
    same = ds.load_tokenizer(str(tok_dir / "tokenizer.json"))
    assert same.vocab_size == 400 and same.eos_id == tok.eos_id
    b = ds.load_tokenizer("bytes")
    assert (b.vocab_size, b.eos_id, b.pad_id, b.files) == (256, None, None, [])
    assert b.encode_batch(["hé"]) == [[104, 195, 169]]


def test_tokenizer_added_tokens_and_known_eos(tmp_path, tok_dir):
    from tokenizers import AddedToken, Tokenizer
    t = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    t.add_special_tokens([AddedToken("<pad>", special=True)])
    t.save(str(tmp_path / "tokenizer.json"))   # no tokenizer_config.json: eos found by name
    tok = ds.load_tokenizer(str(tmp_path))
    assert tok.vocab_size == 401 and tok.eos_id == t.token_to_id("<|endoftext|>") and tok.chat_template is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<|im_end|>"}, "chat_template": [{"name": "default", "template": "X"}]}))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<pad>"}))
    (tmp_path / "chat_template.jinja").write_text("J")
    tok = ds.load_tokenizer(str(tmp_path))
    assert tok.eos_id == t.token_to_id("<|im_end|>") and tok.pad_id == 400
    assert tok.chat_template == "J"
    assert [f.name for f in tok.files] == ["tokenizer.json", "tokenizer_config.json",
                                           "special_tokens_map.json", "chat_template.jinja"]
    (tmp_path / "chat_template.jinja").unlink()
    assert ds.load_tokenizer(str(tmp_path)).chat_template == "X"


def test_missing_tokenizer(tmp_path):
    e = raises(ds.load_tokenizer, str(tmp_path / "nope.json"))
    assert e.path == str(tmp_path / "nope.json") and "not found" in e.message and e.help
    e = raises(ds.load_tokenizer, str(tmp_path))
    assert "no tokenizer.json" in str(e) and e.help
    (tmp_path / "tokenizer.json").write_text("{bad")
    assert raises(ds.load_tokenizer, str(tmp_path)).path == str(tmp_path / "tokenizer.json")
    assert raises(ds.prepare, "builtin:pydoc", tokenizer=str(tmp_path / "x")).help


# ---------------------------------------------------------------------------- sources

def test_text_formats_same_stream(tmp_path, tok_dir, hf, text):
    ds_docs = docs(text, 5)
    want = [t for d in ds_docs for t in enc(hf, d) + [hf.token_to_id("<|endoftext|>")]]
    d = tmp_path / "txt"
    (d / "sub").mkdir(parents=True)
    for i, doc in enumerate(ds_docs):   # sorted by path: a0 a1 sub/a2 ...
        (d / ("sub" if i >= 2 else "") / f"a{i}.txt").write_text(doc)
    (d / ".hidden.txt").write_text("skipped")
    (d / "notes.md").write_text("skipped")
    assert [p.name for p in ds.resolve_files(str(d))] == [f"a{i}.txt" for i in range(5)]
    j = write_jsonl(tmp_path / "c.jsonl", [{"text": x, "id": i} for i, x in enumerate(ds_docs)])
    with open(j, "a") as f:
        f.write("\n")  # blank lines are skipped
    pq = write_parquet(tmp_path / "c.parquet", {"text": ds_docs})
    for src in (str(d), str(j), str(pq), str(d / "**" / "a*.txt")):
        cache = ds.prepare(src, tokenizer=str(tok_dir))
        assert cache.tokens.tolist() == want, src
        assert cache.num_examples == 5 and cache.max_token_id == max(want)
    # a single .txt is one document
    c = ds.prepare(str(d / "a0.txt"), tokenizer=str(tok_dir))
    assert c.tokens.tolist() == enc(hf, ds_docs[0]) + [hf.token_to_id("<|endoftext|>")]
    # a custom text field
    j2 = write_jsonl(tmp_path / "f.jsonl", [{"body": x} for x in ds_docs])
    assert ds.prepare(str(j2), tokenizer=str(tok_dir), text_field="body").tokens.tolist() == want


def test_bytes_tokenizer_and_pydoc(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes("héllo\n".encode() + b"\xff")  # raw bytes pass through for the byte tokenizer
    c = ds.prepare(str(f), tokenizer="bytes")
    assert c.tokens.tolist() == list(f.read_bytes()) and c.meta["eos_id"] is None
    j = write_jsonl(tmp_path / "a.jsonl", [{"text": "ab"}, {"text": "cd"}])
    assert ds.prepare(str(j), tokenizer="bytes").tokens.tolist() == list(b"abcd")
    c = ds.prepare("builtin:pydoc", tokenizer="bytes")
    raw = Path(importlib.util.find_spec("pydoc_data.topics").origin).read_bytes()
    assert c.num_tokens == len(raw) and c.sample(0, 15)[0].tolist() == list(raw[:16])


def test_samples_text(tmp_path, tok_dir):
    j = write_jsonl(tmp_path / "a.jsonl", [{"text": "x" * 3}])
    c = ds.prepare(str(j), tokenizer="bytes")
    f = tmp_path / "b.txt"
    f.write_bytes(bytes(range(100)))
    c = ds.prepare(str(f), tokenizer="bytes")
    assert c.num_samples(9) == 10 and c.num_samples(10) == 9  # last partial dropped
    toks, tgts = c.sample(3, 9)
    assert toks.dtype == tgts.dtype == torch.int64
    assert toks.tolist() == list(range(30, 40)) and tgts.tolist() == list(range(31, 40))
    with pytest.raises(IndexError):
        c.sample(10, 9)
    t, g = c.batch([3, 0], 9)
    assert t.shape == (2, 10) and g.shape == (2, 9) and t[0].tolist() == toks.tolist()


# ---------------------------------------------------------------------------- cache

def test_cache_reuse_and_invalidation(tmp_path, tok_dir, text, monkeypatch):
    f = tmp_path / "a.txt"
    f.write_text(text[:3000])
    c1 = ds.prepare(str(f), tokenizer=str(tok_dir))
    assert not c1.reused and c1.path.parent == tmp_path / "cache"
    calls = []
    monkeypatch.setattr(ds, "_tokenize", lambda *a, **k: calls.append(1))
    c2 = ds.prepare(str(f), tokenizer=str(tok_dir))
    assert c2.reused and c2.path == c1.path and not calls
    monkeypatch.undo()
    monkeypatch.setenv("PARCOMPILE_CACHE", str(tmp_path / "cache"))
    f.write_text(text[:2999] + "!")
    c3 = ds.prepare(str(f), tokenizer=str(tok_dir))
    assert not c3.reused and c3.path != c1.path and c3.num_tokens > 0
    # other keys of the hash
    assert ds.prepare(str(f), tokenizer="bytes").path != c3.path
    assert ds.prepare(str(f), tokenizer=str(tok_dir), text_field="x").path != c3.path
    other = tmp_path / "elsewhere"
    c4 = ds.prepare(str(f), tokenizer=str(tok_dir), cache_dir=other)
    assert c4.path.parent == other and not c4.reused
    # readers open an existing cache directly, read-only
    c5 = ds.TokenCache(c3.path)
    assert c5.tokens.tolist() == c3.tokens.tolist() and not c5.tokens.flags.writeable
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".tmp-")]


def run_threads(n, fn):
    out = []
    threads = [threading.Thread(target=lambda: out.append(fn())) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_concurrent_preparers(tmp_path, tok_dir, text, monkeypatch):
    f = tmp_path / "a.txt"
    f.write_text(text[:3000])
    # with the lock: one tokenizes, the others wait and reuse its cache
    out = run_threads(3, lambda: ds.prepare(str(f), tokenizer=str(tok_dir), cache_dir=tmp_path / "locked"))
    assert sorted(c.reused for c in out) == [False, True, True] and len({c.path for c in out}) == 1
    # without it (say, a file system without flock): all tokenize, one rename wins
    monkeypatch.setattr(ds, "_lock", lambda path: __import__("contextlib").nullcontext())
    real = ds._tokenize
    barrier = threading.Barrier(3)

    def slow(*a, **k):
        meta = real(*a, **k)
        barrier.wait(timeout=10)   # all three finish tokenizing before any renames
        return meta

    monkeypatch.setattr(ds, "_tokenize", slow)
    out = run_threads(3, lambda: ds.prepare(str(f), tokenizer=str(tok_dir)))
    assert len(out) == 3 and len({c.path for c in out}) == 1
    assert sorted(c.reused for c in out) == [False, True, True]
    assert all(c.tokens.tolist() == out[0].tokens.tolist() for c in out)
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == [out[0].path.name]


def test_progress_bar(tmp_path, capsys):
    f = tmp_path / "a.txt"
    f.write_text("abc" * 100)
    ds.prepare(str(f), tokenizer="bytes", progress=True)
    assert "tokenizing" in capsys.readouterr().err


# ---------------------------------------------------------------------------- order

@pytest.fixture()
def small_cache(tmp_path):
    f = tmp_path / "s.txt"
    f.write_bytes(bytes(range(100)))   # 10 samples of seq_len 9
    return ds.prepare(str(f), tokenizer="bytes")


def test_permutation_epochs_and_resume(small_cache):
    tb = ds.TrainBatches(small_cache, seq_len=9, global_batch=4, seed=3)
    assert tb.num_samples == 10
    seen = [i for k in range(5) for i in tb.indices(k)]   # 20 = two epochs exactly
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    assert seen[:10] != seen[10:]
    p0, p1 = tb.permutation(0).tolist(), tb.permutation(1).tolist()
    assert tb.indices(2) == p0[8:10] + p1[0:2]   # crosses the epoch boundary
    g = torch.Generator().manual_seed(ds.epoch_seed(3, 1))
    assert p1 == torch.randperm(10, generator=g).tolist()
    fresh = ds.TrainBatches(small_cache, 9, 4, 3)
    for k in (7, 2, 0, 1000, 2):   # a pure function of k, in any order
        assert fresh.indices(k) == tb.indices(k)
    assert ds.TrainBatches(small_cache, 9, 4, 4).indices(0) != tb.indices(0)
    toks, tgts = tb.batch(2)
    assert toks.shape == (4, 10) and tgts.shape == (4, 9)
    for r, i in enumerate(tb.indices(2)):
        assert toks[r].tolist() == small_cache.sample(i, 9)[0].tolist()
        assert toks[r].tolist() == list(range(10 * i, 10 * i + 10))
    assert torch.equal(tgts, toks[:, 1:])


def test_too_few_samples(small_cache):
    e = raises(ds.TrainBatches, small_cache, 9, 11, 0)
    assert "has 10 samples" in e.message and "needs 11" in e.message and e.help
    ds.TrainBatches(small_cache, 9, 10, 0)


def test_eval_batches(small_cache):
    ev = ds.EvalBatches(small_cache, 9, 4, None)
    assert len(ev) == 3 and ev.indices(0) == [0, 1, 2, 3] and ev.indices(2) == [8, 9, -1, -1]
    toks, tgts = ev.batch(2)
    assert toks[0].tolist() == list(range(80, 90)) and (toks[2:] == 0).all() and (tgts[2:] == -100).all()
    assert len(list(ev)) == 3
    two = ds.EvalBatches(small_cache, 9, 4, 2)
    assert len(two) == 2 and not two.warnings
    many = ds.EvalBatches(small_cache, 9, 4, 9)
    assert len(many) == 3 and many.warnings
    assert raises(ds.EvalBatches, small_cache, 200, 4, None).message.startswith("the eval data has no sample")


def test_local_rows():
    toks = torch.arange(8 * 5).reshape(8, 5)
    tgts = toks[:, 1:]
    mbs = ds.local_rows(toks, tgts, dp_index=1, dp_size=2, micro_batch=2)
    assert len(mbs) == 2
    assert mbs[0][0].tolist() == toks[4:6].tolist() and mbs[1][1].tolist() == tgts[6:8].tolist()


# ---------------------------------------------------------------------------- masked formats

def test_prompt_completion(tmp_path, tok_dir, hf):
    eos = hf.token_to_id("<|endoftext|>")
    rows = [{"prompt": "Question: who?", "completion": " Romeo."}, {"prompt": "A" * 40, "completion": "B" * 40}]
    j = write_jsonl(tmp_path / "pc.jsonl", rows)
    c = ds.prepare(str(j), tokenizer=str(tok_dir), data_format="prompt_completion")
    assert c.num_examples == c.num_samples(16) == 2
    p, q = enc(hf, rows[0]["prompt"]), enc(hf, rows[0]["completion"])
    want = p + q + [eos]
    seq = len(want) + 3
    toks, tgts = c.sample(0, seq)
    assert toks.tolist() == want + [eos] * 4   # padded with eos (no pad token)
    exp = [-100] * (len(p) - 1) + q + [eos] + [-100] * 4
    assert tgts.tolist() == exp
    # truncated and counted
    n1 = len(enc(hf, "A" * 40) + enc(hf, "B" * 40)) + 1
    assert c.truncated(n1 - 1) == 0 and c.truncated(n1 - 2) == 1
    assert c.sample_warnings(n1 - 2) and "truncated" in c.sample_warnings(n1 - 2)[0]
    t2, g2 = c.sample(1, 4)
    assert t2.shape == (5,) and g2.shape == (4,)
    # parquet gives the same
    pq = write_parquet(tmp_path / "pc.parquet", {"prompt": [r["prompt"] for r in rows],
                                                   "completion": [r["completion"] for r in rows]})
    c2 = ds.prepare(str(pq), tokenizer=str(tok_dir), data_format="prompt_completion")
    assert c2.tokens.tolist() == c.tokens.tolist() and c2.mask.tolist() == c.mask.tolist()
    # bytes: no eos; an empty completion has no loss token and is skipped
    jb = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "ab", "completion": "cd"}, {"prompt": "x", "completion": ""}])
    cb = ds.prepare(str(jb), tokenizer="bytes", data_format="prompt_completion")
    assert cb.num_examples == 1 and cb.warnings
    toks, tgts = cb.sample(0, 4)
    assert toks.tolist() == list(b"abcd") + [0] and tgts.tolist() == [-100, ord("c"), ord("d"), -100]


CHATS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who loves Juliet?"},
                  {"role": "assistant", "content": "Romeo, of course."}, {"role": "user", "content": "Why?"},
                  {"role": "assistant", "content": "Love at first sight."}]},
    {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}]},
    {"messages": [{"role": "user", "content": "no answer here"}]},
]


def test_chat_masks_match_transformers(tmp_path, tok_dir, hf):
    from transformers import PreTrainedTokenizerFast
    ref = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    j = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    c = ds.prepare(str(j), tokenizer=str(tok_dir), data_format="chat")
    assert c.num_examples == 2 and any("no assistant turn" in w for w in c.warnings)
    assert c.meta["skipped_no_assistant"] == 1
    tok = ds.load_tokenizer(str(tok_dir))
    for k, chat in enumerate(CHATS[:2]):
        msgs = chat["messages"]
        text = ref.apply_chat_template(msgs, tokenize=False)
        assert ds.render_chat(tok, msgs) == text
        assert ds.render_chat(tok, msgs[:1], add_generation_prompt=True) == \
            ref.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
        out = ref.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        a, b = int(c.offsets[k]), int(c.offsets[k + 1])
        assert c.tokens[a:b].tolist() == list(out["input_ids"]) == enc(hf, text)
        assert c.mask[a:b].tolist() == list(out["assistant_masks"])
        # assistant content unmasked, the user's masked
        toks, tgts = c.sample(k, b - a + 2)
        kept = [t for t in tgts.tolist() if t != -100]
        want = [t for m in msgs if m["role"] == "assistant" for t in enc(hf, m["content"]) +
                enc(hf, "<|im_end|>\n")]
        assert kept == want
        assert hf.decode(kept, skip_special_tokens=False).count("<|im_end|>") == \
            sum(m["role"] == "assistant" for m in msgs)
        for m in msgs:
            if m["role"] != "assistant":
                assert m["content"] not in hf.decode(kept)
    # the same through parquet (a list<struct> column)
    pq = write_parquet(tmp_path / "chat.parquet", {"messages": [x["messages"] for x in CHATS]})
    c2 = ds.prepare(str(pq), tokenizer=str(tok_dir), data_format="chat")
    assert c2.tokens.tolist() == c.tokens.tolist() and c2.mask.tolist() == c.mask.tolist()


# ---------------------------------------------------------------------------- errors

def test_record_errors(tmp_path, tok_dir):
    T = str(tok_dir)

    def err(name: str, body: str, fmt: str = "text", **kw) -> DataError:
        p = tmp_path / name
        p.write_text(body)
        e = raises(ds.prepare, str(p), tokenizer=T, data_format=fmt, **kw)
        assert e.path == str(p)
        return e

    ok = json.dumps({"text": "fine"})
    e = err("bad.jsonl", ok + "\n" + ok + "\n{not json\n")
    assert e.line == 3 and "not valid JSON" in e.message and "Expecting property name" in e.message
    assert str(e) == f"{tmp_path / 'bad.jsonl'}:3: {e.message}"
    e = err("field.jsonl", ok + "\n" + json.dumps({"content": "x", "id": 2}) + "\n")
    assert e.line == 2 and "`text`" in e.message and "`content`, `id`" in e.message and e.help
    e = err("type.jsonl", json.dumps({"text": 5}) + "\n")
    assert e.line == 1 and "a number, not a string" in e.message
    e = err("list.jsonl", ok + "\n[1, 2]\n")
    assert e.line == 2 and "a list" in e.message
    e = err("pc.jsonl", json.dumps({"prompt": "x"}) + "\n", "prompt_completion")
    assert e.line == 1 and "`completion`" in e.message and "`prompt`" in e.message
    e = err("pc2.jsonl", json.dumps({"prompt": "x", "completion": None}) + "\n", "prompt_completion")
    assert "null, not a string" in e.message
    for body, words in ((json.dumps({"messages": "hi"}), "not a list"),
                        (json.dumps({"messages": []}), "empty list"),
                        (json.dumps({"messages": [{"role": "user"}]}), "message 1 has no `content`"),
                        (json.dumps({"messages": [{"role": "user", "content": "a"}, 3]}), "message 2 is a number"),
                        (json.dumps({"messages": [{"role": 1, "content": "a"}]}), "`role` is a number")):
        e = err("chat.jsonl", ok + "\n" + body + "\n", "chat")
        assert e.line == 1 and "`messages`" in e.message   # line 1 has no messages field
        e = err("chat.jsonl", json.dumps({"messages": [{"role": "user", "content": "a"}]}) + "\n" + body + "\n",
                "chat")
        assert e.line == 2 and words in e.message, (body, e.message)
    e = err("empty.txt", "")
    assert e.line is None and "no tokens" in e.message
    (tmp_path / "bin.txt").write_bytes(b"ok\nok\n\xff\n")
    e = raises(ds.prepare, str(tmp_path / "bin.txt"), tokenizer=T)
    assert e.line == 3 and "UTF-8" in e.message
    e = err("chat.txt", "text", "chat")
    assert "needs .jsonl or .parquet" in e.message
    e = raises(ds.prepare, "x", tokenizer=T, data_format="dialog")
    assert "data_format" in e.message


def test_parquet_errors(tmp_path, tok_dir):
    p = write_parquet(tmp_path / "a.parquet", {"body": ["x", "y"]})
    e = raises(ds.prepare, str(p), tokenizer=str(tok_dir))
    assert e.path == str(p) and e.line is None and "no column `text`" in e.message and "`body`" in e.message
    p = write_parquet(tmp_path / "b.parquet", {"text": ["x", None, "z"]})
    e = raises(ds.prepare, str(p), tokenizer=str(tok_dir))
    assert e.line == 2 and "null" in e.message
    p = write_parquet(tmp_path / "c.parquet", {"text": [1, 2]})
    assert raises(ds.prepare, str(p), tokenizer=str(tok_dir)).line == 1
    (tmp_path / "d.parquet").write_text("not parquet")
    assert raises(ds.prepare, str(tmp_path / "d.parquet"), tokenizer=str(tok_dir)).path == str(tmp_path / "d.parquet")


def test_empty_and_missing(tmp_path, tok_dir):
    (tmp_path / "e.jsonl").write_text("\n\n")
    e = raises(ds.prepare, str(tmp_path / "e.jsonl"), tokenizer="bytes")
    assert e.path == str(tmp_path / "e.jsonl") and "no tokens" in e.message
    j = write_jsonl(tmp_path / "c.jsonl", [CHATS[2]])
    e = raises(ds.prepare, str(j), tokenizer=str(tok_dir), data_format="chat")
    assert "no examples with a loss token" in e.message and e.path == str(j)
    e = raises(ds.resolve_files, str(tmp_path / "nothing*.jsonl"))
    assert "no file matches" in e.message
    e = raises(ds.resolve_files, str(tmp_path / "gone.txt"))
    assert e.path == str(tmp_path / "gone.txt") and e.help
    (tmp_path / "d").mkdir()
    assert "holds no" in raises(ds.resolve_files, str(tmp_path / "d")).message
    e = raises(ds.prepare, str(j), tokenizer="bytes", data_format="chat")
    assert "chat template" in e.message and e.help
    from tokenizers import Tokenizer
    Tokenizer.from_file(str(tok_dir / "tokenizer.json")).save(str(tmp_path / "tokenizer.json"))
    e = raises(ds.prepare, str(j), tokenizer=str(tmp_path), data_format="chat")
    assert e.path == str(tmp_path / "tokenizer.json") and "chat template" in e.message


def test_chat_template_errors(tmp_path, tok_dir):
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template":
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"}))
    j = write_jsonl(tmp_path / "c.jsonl", [CHATS[1], {"messages": [{"role": "tool", "content": "x"},
                                                                  {"role": "assistant", "content": "y"}]}])
    e = raises(ds.prepare, str(j), tokenizer=str(d), data_format="chat")
    assert e.line == 2 and "no tools" in e.message
    # a template that renders a prefix differently from the whole conversation
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template":
        "{% for m in messages %}{{ m['content'] }}{% if loop.last %}!{% endif %}{% endfor %}"}))
    j = write_jsonl(tmp_path / "c2.jsonl", [CHATS[0]])
    e = raises(ds.prepare, str(j), tokenizer=str(d), data_format="chat")
    assert e.line == 1 and "differently" in e.message and e.help
