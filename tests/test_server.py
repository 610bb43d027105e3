"""`parcompile serve` (SPEC 4): one server, tp 2 x pp 2 with the tiny model, launched once
for the module and talked to with the official `openai` client over loopback.

Truth: greedy tokens equal the single-process serve program's (tests/serve_utils.py:
run_in_process, a world of one), for completions and chat, plain and streamed, and for 32
concurrent streams of different lengths. The cache holds 16 blocks of 16 tokens and 8
sequences run at once, so the 32 streams queue (seen in /metrics) and all complete; every
block is free afterwards and after a client leaves mid-stream. Prefix caching is on (the
default) and prefill is chunked (12 prompt tokens per step), so these equalities hold with
both; 8 streams needing twice the cache are preempted and recomputed, and their tokens are
still the same. The last test kills a rank: 503, then a non-zero exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from parcompile.runtime.serve import generate as gen  # noqa: E402
from parcompile.runtime.serve import paged  # noqa: E402
from tests.serve_utils import build_serve, free_port, paged_generate, run_in_process, serving  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SPEC = """model tiny {
    layers = 4, hidden = 64, heads = 4, kv_heads = 2, ffn_hidden = 128
    vocab = 256, seq_len = 64, dtype = fp32, norm = rmsnorm, activation = swiglu, position = rope
}
cluster local from "cpu" { gpus_per_node = WORLD }
parallel { tp = TP, pp = PP }
serve {
    batch = 8
    prompt_len = 16
    max_new_tokens = 48
    seed = 1
    block_size = 16
    kv_cache_tokens = 256
    max_prefill_tokens = 12
}
"""
BLOCKS = 16


def _spec(tp: int, pp: int) -> str:
    return SPEC.replace("WORLD", str(tp * pp)).replace("TP", str(tp)).replace("PP", str(pp))


@contextlib.contextmanager
def _serving(tmp: Path, spec: str):
    """`parcompile serve` of ``spec`` (written into ``tmp``) on a free loopback port, until the
    block ends: ``proc``, ``base`` URL, an openai ``client`` and ``tmp``."""
    (tmp / "s.par").write_text(spec)
    env = dict(os.environ, OMP_NUM_THREADS="1", PARCOMPILE_DEVICE="cpu", PYTHONPATH=str(REPO))
    with serving(tmp / "s.par", tmp / "out", env) as (proc, base):
        yield {"proc": proc, "base": base,
               "client": openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0), "tmp": tmp}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with _serving(tmp_path_factory.mktemp("server"), _spec(2, 2)) as s:
        yield s


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Greedy tokens of the single-process serve program: prompt ids -> 48 new tokens."""
    from parcompile.frontend import load_spec

    tmp = tmp_path_factory.mktemp("ref")
    (tmp / "one.par").write_text(_spec(1, 1))
    cfg, _ = load_spec(tmp / "one.par")
    build_serve(cfg, tmp / "one")
    cache = {}

    def tokens(prompts: list[list[int]], n: int) -> list[list[int]]:
        todo = [p for p in prompts if tuple(p) not in cache]
        if todo:
            argv = ["--temperature", "0", "--max-new-tokens", str(64 - max(map(len, todo))), "--weights", "seed"]
            for p in todo:
                argv += ["--prompt-ids", ",".join(map(str, p))]
            threads = torch.get_num_threads()
            torch.set_num_threads(1)     # ten times faster beside the server's ranks on a few cores
            try:
                rec = run_in_process(tmp / "one", argv)
            finally:
                torch.set_num_threads(threads)
            cache.update({tuple(p): t for p, t in zip(todo, rec["tokens"])})
        return [cache[tuple(p)][:n] for p in prompts]

    return tokens


def _metrics(base: str) -> dict:
    out = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith("parcompile_") and "{" in line:
            name = line.split("{")[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _same_time_tokens(base: str) -> float:
    """Output tokens the front got together with the one before them (the TPOT histogram's
    first bucket, 1 ms: an engine step here takes longer; metrics.Metrics.tokens)."""
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith('parcompile_time_per_output_token_seconds_bucket{') and 'le="0.001"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no TPOT histogram in /metrics")


def _extra(obj, key):
    return (obj.model_extra or {}).get(key) if hasattr(obj, "model_extra") else getattr(obj, key)


def _chat_ids(text: str) -> list[int]:
    return list(f"user: {text}\nassistant:".encode())   # api.PLAIN_CHAT_TEMPLATE, bytes


@pytest.mark.torchrun
def test_completions_and_chat_equal_single_process(server, reference):
    c = server["client"]
    models = c.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    prompt = [84, 104, 101, 32, 7, 200]
    want = reference([prompt], 12)[0]
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                             extra_body={"return_token_ids": True})
    assert _extra(r.choices[0], "token_ids") == want and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == 6
    assert r.choices[0].text == gen.ByteTokenizer().decode(want)
    ids, text = [], ""
    for ch in c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                   extra_body={"return_token_ids": True}):
        ids += _extra(ch.choices[0], "token_ids")
        text += ch.choices[0].text
    assert ids == want and text == r.choices[0].text
    # chat: the plain template of a byte-level model
    msgs = [{"role": "user", "content": "hi"}]
    want = reference([_chat_ids("hi")], 10)[0]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert _extra(r.choices[0], "token_ids") == want
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == gen.ByteTokenizer().decode(want)
    ids, text, reasons = [], "", []
    for ch in c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0, stream=True,
                                        extra_body={"return_token_ids": True}):
        ids += _extra(ch.choices[0], "token_ids") or []
        text += ch.choices[0].delta.content or ""
        reasons.append(ch.choices[0].finish_reason)
    assert ids == want and text == r.choices[0].message.content and reasons[-1] == "length"


@pytest.mark.torchrun
def test_sampling_seed_stop_and_text_prompt(server):
    c = server["client"]
    a = c.completions.create(model="tiny", prompt="The ", max_tokens=16, temperature=0.9, top_p=0.9, seed=7,
                             extra_body={"top_k": 20, "return_token_ids": True})
    b = c.completions.create(model="tiny", prompt="The ", max_tokens=16, temperature=0.9, top_p=0.9, seed=7,
                             extra_body={"top_k": 20, "return_token_ids": True})
    assert _extra(a.choices[0], "token_ids") == _extra(b.choices[0], "token_ids")    # same seed, same draws
    g = c.completions.create(model="tiny", prompt="The ", max_tokens=16, temperature=0)
    text = g.choices[0].text
    cut = next(i for i in range(3, len(text)) if text[i] != "\ufffd")
    s = c.completions.create(model="tiny", prompt="The ", max_tokens=16, temperature=0, stop=[text[cut]])
    assert s.choices[0].finish_reason == "stop" and s.choices[0].text == text[:text.index(text[cut])]
    tiny_t = c.completions.create(model="tiny", prompt="The ", max_tokens=16, temperature=1e-300)   # greedy, no NaN
    assert tiny_t.choices[0].text == text


@pytest.mark.torchrun
def test_32_concurrent_streams_queue_complete_and_free_every_block(server, reference):
    c, base = server["client"], server["base"]
    g = torch.Generator().manual_seed(0)
    jobs = []
    for i in range(32):
        n_prompt = 1 + i % 16
        prompt = torch.randint(0, 256, (n_prompt,), generator=g).tolist()
        jobs.append((prompt, 4 + (7 * i) % 21))
    full = reference([p for p, _ in jobs], 48)      # one left-padded batch (as alone: tests/test_serve.py)
    want = [t[:n] for t, (_, n) in zip(full, jobs)]
    seen = {"waiting": 0.0, "free_min": BLOCKS}
    done = threading.Event()

    def poll():
        while not done.is_set():
            m = _metrics(base)
            seen["waiting"] = max(seen["waiting"], m.get("parcompile_requests_waiting", 0))
            seen["free_min"] = min(seen["free_min"], m.get("parcompile_kv_cache_blocks_free", BLOCKS))
            time.sleep(0.05)

    def run(job):
        prompt, n = job
        ids, reason = [], None
        for ch in c.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                       extra_body={"return_token_ids": True}):
            ids += _extra(ch.choices[0], "token_ids")
            reason = ch.choices[0].finish_reason or reason
        return ids, reason

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    with ThreadPoolExecutor(32) as ex:
        got = list(ex.map(run, jobs))
    done.set()
    poller.join()
    assert [r for _, r in got] == ["length"] * 32
    assert [ids for ids, _ in got] == want
    assert seen["waiting"] > 0                 # 8 run at once (batch): requests waited, then completed
    assert seen["free_min"] <= BLOCKS - 8      # 8 running sequences hold a block each at least
    m = _metrics(base)
    assert m["parcompile_kv_cache_blocks_used"] == 0 and m["parcompile_kv_cache_blocks_free"] == BLOCKS
    assert m["parcompile_requests_waiting"] == 0 and m["parcompile_requests_running"] == 0


@pytest.mark.torchrun
def test_stream_interval_sends_a_requests_tokens_in_groups_and_keeps_them(tmp_path, reference):
    """`serve { stream_interval = 3 }` (tp 1 x pp 1): a stream's tokens come in fewer events
    than tokens (its first alone, then groups of 3: scheduler.StreamBuffer), and the token
    ids, the text, a stop string's cut and the freed blocks are what they are with 1."""
    spec = _spec(1, 1).replace("    seed = 1\n", "    seed = 1\n    stream_interval = 3\n")
    with _serving(tmp_path, spec) as srv:
        c = srv["client"]
        prompt = [84, 104, 101, 32, 7, 200]
        want = reference([prompt], 11)[0]
        together = _same_time_tokens(srv["base"])
        ids, text = [], ""
        for ch in c.completions.create(model="tiny", prompt=prompt, max_tokens=11, temperature=0, stream=True,
                                       extra_body={"return_token_ids": True}):
            ids += _extra(ch.choices[0], "token_ids") or []
            text += ch.choices[0].text
        assert ids == want and text == gen.ByteTokenizer().decode(want)
        # sent as [1, 3, 3, 3, 1]: 6 tokens arrived with the one before them (the events may
        # merge further: a random byte model's text often ends in a partial character, held back)
        assert _same_time_tokens(srv["base"]) - together >= 6
        full = c.completions.create(model="tiny", prompt="The ", max_tokens=16, temperature=0).choices[0].text
        cut = next(i for i in range(3, len(full)) if full[i] != "\ufffd")
        streamed, reason = "", None
        for ch in c.completions.create(model="tiny", prompt="The ", max_tokens=16, temperature=0, stop=[full[cut]],
                                       stream=True):
            streamed += ch.choices[0].text
            reason = ch.choices[0].finish_reason or reason
        assert reason == "stop" and streamed == full[:full.index(full[cut])]
        deadline = time.monotonic() + 10
        while _metrics(srv["base"])["parcompile_kv_cache_blocks_free"] != BLOCKS:      # the abort reaches the leader
            assert time.monotonic() < deadline, _metrics(srv["base"])
            time.sleep(0.05)


@pytest.mark.torchrun
def test_a_full_cache_preempts_and_every_stream_continues_exactly(server, reference):
    """8 concurrent streams of 16-token prompts and 36 new tokens need 4 blocks each, 32 in
    all, of the 16: they run together and running ones are preempted (recomputed) when the
    cache is full (/metrics counts them). The greedy ones equal the single process; the
    seeded ones equal the same requests again, 4 at a time (16 blocks: none preempted)."""
    c, base = server["client"], server["base"]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (16,), generator=g).tolist() for _ in range(8)]

    def run(job):
        prompt, seed = job
        ids = []
        extra = {"return_token_ids": True}
        for ch in c.completions.create(model="tiny", prompt=prompt, max_tokens=36, stream=True, extra_body=extra,
                                       **({"temperature": 1.0, "seed": seed} if seed else {"temperature": 0})):
            ids += _extra(ch.choices[0], "token_ids")
        return ids

    jobs = [(p, 100 + i if i % 2 else None) for i, p in enumerate(prompts)]
    key = "parcompile_num_preemptions_total"
    m0 = _metrics(base)
    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(run, jobs))
    m1 = _metrics(base)
    seeded = [j for j in jobs if j[1]]
    with ThreadPoolExecutor(4) as ex:
        again = list(ex.map(run, seeded))
    m2 = _metrics(base)
    assert m1.get(key, 0) > m0.get(key, 0) and m2.get(key, 0) == m1.get(key, 0)
    greedy = [p for p, seed in jobs if not seed]
    assert [ids for ids, (_, seed) in zip(got, jobs) if not seed] == reference(greedy, 36)
    assert [ids for ids, (_, seed) in zip(got, jobs) if seed] == again
    assert all(len(ids) == 36 for ids in got)
    deadline = time.monotonic() + 10            # the last step's stats follow its tokens
    while _metrics(base)["parcompile_kv_cache_blocks_free"] != BLOCKS:
        assert time.monotonic() < deadline, "blocks were left held after the streams"
        time.sleep(0.1)


@pytest.mark.torchrun
def test_client_leaving_mid_stream_frees_its_blocks(server):
    base = server["base"]
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 60, "temperature": 0, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]
        assert got[0].startswith("data: ")
        assert 1 <= _metrics(base)["parcompile_kv_cache_blocks_used"] <= 4   # taken as tokens come, ceil((3 + 60) / 16)
    deadline = time.monotonic() + 10
    while _metrics(base)["parcompile_kv_cache_blocks_used"] != 0:
        assert time.monotonic() < deadline, "the blocks of a closed stream were not freed"
        time.sleep(0.1)
    assert _metrics(base)["parcompile_kv_cache_blocks_free"] == BLOCKS


@pytest.mark.torchrun
def test_bad_requests_get_openai_errors(server):
    c, base = server["client"], server["base"]

    def err(r, status):
        assert r.status_code == status, r.text
        e = r.json()["error"]
        assert set(e) == {"message", "type", "param", "code"}
        return e

    e = err(httpx.post(base + "/v1/completions", content=b"{not json", timeout=10), 400)
    assert "not valid JSON" in e["message"]
    e = err(httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": "ten"}, timeout=10), 400)
    assert e["param"] == "max_tokens" and "integer" in e["message"]
    e = err(httpx.post(base + "/v1/chat/completions", json={"messages": "hi"}, timeout=10), 400)
    assert e["param"] == "messages"
    e = err(httpx.post(base + "/v1/completions", json={"max_tokens": 3}, timeout=10), 400)
    assert "`prompt` is required" in e["message"]
    with pytest.raises(openai.BadRequestError) as x:
        c.completions.create(model="tiny", prompt=list(range(1, 70)), max_tokens=1)
    assert "context is 64 tokens" in x.value.message and "69 tokens" in x.value.message
    # a prompt of the whole context is scored with echo and max_tokens 0 (chunked over 6 steps of
    # max_prefill_tokens 12): its logprobs are those of its 40-token prefix, then more
    full = [(7 * i) % 256 for i in range(64)]
    lps = {}
    for n in (64, 40):
        r = httpx.post(base + "/v1/completions", json={"prompt": full[:n], "echo": True, "max_tokens": 0,
                                                       "logprobs": 1}, timeout=120)
        assert r.status_code == 200, r.text
        lps[n] = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert len(lps[64]) == 64 and lps[64][0] is None and all(x <= 0 for x in lps[64][1:])
    assert lps[64][:40] == pytest.approx(lps[40], abs=1e-4)
    with pytest.raises(openai.BadRequestError) as x:
        c.completions.create(model="tiny", prompt="hello", max_tokens=60)
    assert "at most 59 new tokens fit" in x.value.message and x.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as x:
        c.completions.create(model="tiny", prompt="", max_tokens=3)
    assert "empty" in x.value.message
    with pytest.raises(openai.NotFoundError) as x:
        c.completions.create(model="gpt-4", prompt="hi", max_tokens=3)
    assert "`gpt-4` does not exist" in x.value.message
    with pytest.raises(openai.BadRequestError) as x:
        c.completions.create(model="tiny", prompt="hi", max_tokens=2, logprobs=21)
    assert x.value.body["param"] == "logprobs" and "20" in x.value.message
    with pytest.raises(openai.BadRequestError) as x:           # the spec's batch is 8
        c.completions.create(model="tiny", prompt="hi", max_tokens=2, n=9)
    assert x.value.body["param"] == "n" and "at most 8 sequences" in x.value.message
    # and it keeps serving
    assert c.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0).usage.completion_tokens == 2


@pytest.mark.torchrun
def test_a_top_p_that_rounds_to_zero_is_answered_and_kills_no_rank(server):
    """Issue 30.1: top_p 1e-46 is 0 in float32: every token was masked, torch.multinomial
    raised and the rank died (503, exit). Now the likeliest token survives: the answer is the
    greedy one, and the server keeps serving."""
    base = server["base"]
    body = {"prompt": "Hi", "max_tokens": 2, "temperature": 1, "top_p": 1e-46, "return_token_ids": True}
    r = httpx.post(base + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    greedy = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0,
                                                        "return_token_ids": True}, timeout=60).json()
    assert r.json()["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"]
    r = httpx.post(base + "/v1/completions", json={**body, "top_p": 5e-324, "top_k": 10**30, "temperature": 1e-5},
                   timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"]
    assert httpx.get(base + "/health", timeout=10).text == "ok"


@pytest.mark.torchrun
def test_logprobs_under_tp_and_pp_equal_one_process_and_a_repeated_prefix_is_prefilled_once(server, tmp_path):
    """Issue 33 on the tp 2 x pp 2 server: echo + logprobs (the table broadcast over pp)
    equal the single-process engine's on the same weights; the same prompt again finds its
    full block (16 tokens) cached: 16 prefix-cache hits, 4 tokens prefilled, the same
    generated logprobs; a batch of prompts with n = 2 gives 4 choices, greedy alike."""
    from parcompile.frontend import load_spec
    from tests.test_serve_engine import Engine

    base = server["base"]
    prompt = list(range(40, 60))                      # 20 tokens: one full block of 16
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 2, "echo": True}
    m0 = _metrics(base)
    a = httpx.post(base + "/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
    m1 = _metrics(base)
    b = httpx.post(base + "/v1/completions", json={**body, "echo": False}, timeout=60).json()["choices"][0]["logprobs"]
    m2 = _metrics(base)
    hits, queries, prefill = ("parcompile_prefix_cache_hits_total", "parcompile_prefix_cache_queries_total",
                              "parcompile_prefill_tokens_total")
    assert m1[prefill] - m0.get(prefill, 0) == 20 and m1.get(hits, 0) == m0.get(hits, 0)   # echo: prefilled whole
    assert m2[hits] - m1.get(hits, 0) == 16 and m2[queries] - m1.get(queries, 0) == 20
    assert m2[prefill] - m1[prefill] == 4
    assert len(a["tokens"]) == 23 and a["token_logprobs"][0] is None and a["top_logprobs"][0] is None
    assert b["token_logprobs"] == pytest.approx(a["token_logprobs"][20:], abs=1e-4)
    assert b["tokens"] == a["tokens"][20:] and all(len(t) <= 3 for t in b["top_logprobs"])
    (tmp_path / "one.par").write_text(_spec(1, 1))
    cfg, _ = load_spec(tmp_path / "one.par")
    build_serve(cfg, tmp_path / "one")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = Engine(tmp_path / "one", None, blocks=8, block_size=16, max_seqs=2, caching=False).run(
            [(prompt, {"max_tokens": 3, "logprobs": 2, "prompt_logprobs": True})])[0]
    finally:
        torch.set_num_threads(threads)
    assert a["token_logprobs"][1:20] == pytest.approx([x for x, _ in ref["prompt"]], abs=1e-4)
    assert a["token_logprobs"][20:] == pytest.approx([x for x, _ in ref["lps"]], abs=1e-4)
    r = httpx.post(base + "/v1/completions", json={"prompt": [[1, 2, 3], [4, 5]], "n": 2, "max_tokens": 4,
                                                   "temperature": 0, "return_token_ids": True}, timeout=60).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    ids = [c["token_ids"] for c in r["choices"]]
    assert ids[0] == ids[1] and ids[2] == ids[3] and all(len(t) == 4 for t in ids)


@pytest.mark.torchrun
def test_the_end_token_and_its_logprob_are_returned_and_counted_as_vllm_does(tmp_path):
    """Issue 47: a sequence that ends on the model's end token lost that token: completions
    and chat, streamed or not, gave neither its id nor its logprob and did not count it in
    ``completion_tokens``, so lm-eval's loglikelihood request (``max_tokens`` 1, echo,
    ``logprobs`` 1, greedy; it reads ``token_logprobs[ctxlen:-1]``) got one entry fewer than
    the prompt and dropped the continuation's last token. vLLM keeps the end token's id and
    logprob (its token string "<|endoftext|>") and leaves it out of the text. On a tiny
    Llama trained here until its greedy continuations end with the end token, the served
    tokens, logprobs, texts and counts equal transformers' greedy decoding of the same
    checkpoint (the truth), over the official `openai` client."""
    transformers = pytest.importorskip("transformers")
    from tests.serve_utils import write_byte_llama

    chat_prompt = "user: Hello\nassistant:"           # the plain chat template's prompt (no template in the checkpoint)
    eot = write_byte_llama(tmp_path / "hf", ending=["The sky is blue", chat_prompt + " Hi"])
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()

    def greedy(text, n=12):
        """transformers' greedy tokens after ``text`` up to the end token, and their logprobs."""
        ids, out, lps = tok(text)["input_ids"], [], []
        with torch.no_grad():
            for _ in range(n):
                logp = torch.log_softmax(model(torch.tensor([ids + out])).logits[0, -1], -1)
                out.append(int(logp.argmax()))
                lps.append(float(logp[out[-1]]))
                if out[-1] == eot:
                    break
        return out, lps

    ids, lps = greedy("The sky is")
    chat_ids, chat_lps = greedy(chat_prompt)
    assert ids[-1] == eot and chat_ids[-1] == eot and len(chat_ids) > 1      # the premise: greedy ends on it
    text, chat_text = tok.decode(ids[:-1]), tok.decode(chat_ids[:-1])
    tokens = [tok.decode([i]) for i in ids]          # each token alone, special ones kept (vLLM's logprobs)
    assert tokens[-1] == "<|endoftext|>"
    spec = ('model m from "hf/config.json" { dtype = fp32 }\ncluster c from "cpu" { gpus_per_node = 1 }\n'
            'serve {\n    batch = 2\n    prompt_len = 32\n    max_new_tokens = 16\n    weights = "hf"\n'
            '    kv_cache_tokens = 256\n}\n')
    with _serving(tmp_path, spec) as s:
        c = s["client"]
        r = c.completions.create(model="m", prompt="The sky is", max_tokens=12, temperature=0, logprobs=1,
                                 extra_body={"return_token_ids": True})
        ch = r.choices[0]
        assert ch.finish_reason == "stop" and ch.text == text and _extra(ch, "token_ids") == ids
        assert ch.logprobs.tokens == tokens and ch.logprobs.token_logprobs == pytest.approx(lps, abs=1e-3)
        assert r.usage.completion_tokens == len(ids)
        parts = list(c.completions.create(model="m", prompt="The sky is", max_tokens=12, temperature=0, logprobs=1,
                                          stream=True, stream_options={"include_usage": True}))
        done = [p for p in parts if p.choices]
        assert "".join(p.choices[0].text for p in done) == text and done[-1].choices[0].finish_reason == "stop"
        assert sum((p.choices[0].logprobs.tokens for p in done), []) == tokens
        assert parts[-1].usage.completion_tokens == len(ids)
        # lm-eval's loglikelihood request: the prompt's logprobs, then the end token's
        prompt = tok("The sky is blue")["input_ids"]
        r = c.completions.create(model="m", prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True)
        ch = r.choices[0]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0], -1)
        want = [float(logp[i, t]) for i, t in enumerate(prompt[1:] + [eot])]
        assert len(ch.logprobs.token_logprobs) == len(prompt) + 1 and ch.logprobs.tokens[-1] == "<|endoftext|>"
        assert ch.logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-3)
        assert ch.text == "The sky is blue" and ch.finish_reason == "stop" and r.usage.completion_tokens == 1
        msgs = [{"role": "user", "content": "Hello"}]
        r = c.chat.completions.create(model="m", messages=msgs, max_tokens=12, temperature=0, logprobs=True)
        ch = r.choices[0]
        assert ch.message.content == chat_text and ch.finish_reason == "stop"
        assert [x.token for x in ch.logprobs.content] == [tok.decode([i]) for i in chat_ids]
        assert [x.logprob for x in ch.logprobs.content] == pytest.approx(chat_lps, abs=1e-3)
        assert r.usage.completion_tokens == len(chat_ids)
        parts = list(c.chat.completions.create(model="m", messages=msgs, max_tokens=12, temperature=0, logprobs=True,
                                               stream=True, stream_options={"include_usage": True}))
        done = [p for p in parts if p.choices]
        assert "".join(p.choices[0].delta.content or "" for p in done) == chat_text
        assert done[-1].choices[0].finish_reason == "stop"
        assert [x.token for p in done if p.choices[0].logprobs for x in p.choices[0].logprobs.content] == \
            [tok.decode([i]) for i in chat_ids]
        assert parts[-1].usage.completion_tokens == len(chat_ids)
        # a stop string keeps vLLM's default (include_stop_str_in_output false): the text ends before it
        r = c.chat.completions.create(model="m", messages=msgs, max_tokens=12, temperature=0, stop=[chat_text[-1]])
        assert r.choices[0].message.content == chat_text[:chat_text.index(chat_text[-1])]
        assert r.choices[0].finish_reason == "stop"


@pytest.mark.torchrun
def test_a_killed_rank_gives_503_and_a_nonzero_exit(server):
    """Last: it ends the module's server."""
    proc, base = server["proc"], server["base"]
    children = lambda pid: [int(x) for x in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                                                            text=True).stdout.split()]
    ranks = [p for t in children(proc.pid) for p in children(t)]
    assert len(ranks) == 4, ranks
    os.kill(ranks[-1], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, "no 503 after a rank died"
        try:
            r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=30)
        except httpx.HTTPError:
            pytest.fail("the server went away without answering 503")
        if r.status_code == 503:
            break
        time.sleep(0.1)
    assert r.json()["error"]["code"] == "service_unavailable"
    assert proc.wait(60) != 0


# ---- in-process ----------------------------------------------------------------------

def test_scheduler_admits_in_order_takes_blocks_as_tokens_need_them_and_frees():
    s = paged.Scheduler(blocks=4, block_size=16, max_seqs=2)
    s.add("a", [1] * 10, {"max_tokens": 30})          # a 40-token context: 1 block for its prompt now
    s.add("b", [1] * 5, {"max_tokens": 20})           # 1 block: admitted beside a (3 + 2 > 4 blocks of context)
    s.add("c", [1], {"max_tokens": 1})                # waits for a batch slot
    step = s.next_step()
    assert [r[0] for r in step["rows"]] == ["a", "b"] and list(step["new"]) == ["a", "b"]
    assert {k: s.stats()[k] for k in ("blocks_used", "blocks_free", "waiting", "running")} == {
        "blocks_used": 2, "blocks_free": 2, "waiting": 1, "running": 2}
    s.collect([paged.Row(*r) for r in step["rows"]], [7, 8])
    s.abort("a")
    step = s.next_step()
    assert step["free"] == ["a"] and [(r[0], r[1], r[2]) for r in step["rows"]] == [("b", [8], 5), ("c", [1], 0)]
    assert {k: s.stats()[k] for k in ("blocks_used", "blocks_free", "waiting", "running")} == {
        "blocks_used": 2, "blocks_free": 2, "waiting": 0, "running": 2}
    s.finish("b")
    assert s.stats()["blocks_free"] == 3 and s.freed == ["b"]


def test_an_end_token_drawn_as_the_last_allowed_token_finishes_with_stop():
    """vLLM's check_stop tests the end token before ``max_tokens`` (vllm-project/vllm
    vllm/v1/core/sched/utils.py at 018d5dc): a sequence whose ``max_tokens``-th token is an
    end token ends "stop" (that token kept, :class:`Generation` leaves it out of the text),
    another token there ends "length"."""
    s = paged.Scheduler(blocks=8, block_size=16, max_seqs=4)
    for rid, max_tokens in (("one", 1), ("two", 2), ("long", 2)):
        s.add(rid, [1] * 4, {"max_tokens": max_tokens, "eos": [9]})
    step = s.next_step()
    got = s.collect([paged.Row(*r) for r in step["rows"]], [9, 7, 7])
    assert [(rid, tok, reason) for rid, tok, reason, _ in got] == [("one", 9, "stop"), ("two", 7, None),
                                                                   ("long", 7, None)]
    step = s.next_step()
    got = s.collect([paged.Row(*r) for r in step["rows"]], [9, 8])
    assert [(rid, tok, reason) for rid, tok, reason, _ in got] == [("two", 9, "stop"), ("long", 8, "length")]


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    draws = {int(gen.pick_tokens(logits, 4, 1.0, 0, g, top_p=0.7)) for _ in range(200)}
    assert draws == {0, 1}
    assert {int(gen.pick_tokens(logits, 4, 1.0, 0, g, top_p=0.5)) for _ in range(50)} == {0}


def test_sampler_keeps_the_likeliest_token_and_fails_only_the_row_with_non_finite_logits():
    """Issue 30.1, defence in depth in the ranks: whatever sampling values arrive, one token
    survives top-p / top-k and no finite logits become NaN; NaN / inf logits fail their own
    request (ERROR_TOKEN, finish_reason "error", blocks freed), not the rank."""
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[0.1, 3.0, 0.2, -1.0]])
    for top_p in (1e-46, 0.0, 5e-324):           # all 0 in float32
        assert int(gen.pick_tokens(logits, 4, 1.0, 0, g, top_p=top_p)) == 1
    huge = torch.tensor([[3e38, -3e38, 1e38, 0.0]])    # / 1e-5 overflows unless the max is taken out first
    assert int(gen.pick_tokens(huge, 4, 1e-5, 2, g, top_p=1e-30)) == 0
    for t in (float("nan"), 1e-300, float("inf")):            # never NaN probabilities
        assert int(gen.pick_tokens(logits, 4, t, -3, g, top_p=float("nan"))) in range(4)
    assert int(gen.pick_tokens(logits, 4, float("nan"), 0, g)) == 1
    bad = torch.tensor([[0.0, float("nan"), 1.0, 0.0], [0.0, 5.0, 1.0, 0.0], [float("inf"), 0.0, 0.0, 0.0]])
    with pytest.raises(gen.NonFiniteLogits) as e:
        gen.pick_tokens(bad, 4, 0.0, 0, None)
    assert e.value.rows == [0, 2]
    p = {"temperature": 1.0, "top_k": 0, "top_p": 1e-46}
    assert paged.sample_rows(bad, 4, [p] * 3, [torch.Generator() for _ in range(3)]).tolist() == [
        paged.ERROR_TOKEN, 1, paged.ERROR_TOKEN]
    s = paged.Scheduler(blocks=4, block_size=16, max_seqs=2)
    s.add("nan", [1, 2], {"max_tokens": 5})
    s.add("ok", [1], {"max_tokens": 5})
    rows = [paged.Row(*r) for r in s.next_step()["rows"]]
    assert s.collect(rows, [paged.ERROR_TOKEN, 7]) == [("nan", paged.ERROR_TOKEN, "error", None),
                                                       ("ok", 7, None, None)]
    assert {k: s.stats()[k] for k in ("blocks_used", "blocks_free", "waiting", "running")} == {
        "blocks_used": 1, "blocks_free": 3, "waiting": 0, "running": 1}


def test_front_answers_non_finite_logits_to_that_request_and_sends_only_safe_sampling_values():
    """Issue 30.1 over loopback: the engine's "error" finish becomes a 500 in OpenAI's form
    for that request (an error event mid-stream); the next request is served; what reaches
    the engine has top_p >= SAMPLING_EPS and top_k within the vocabulary."""
    from parcompile.server.api import SAMPLING_EPS

    with _LiveFront(_FakeEngines(every_s=0.001, error_at=0)) as f:
        e = _openai_error(f.post("/v1/completions", {"prompt": "hi", "max_tokens": 3}), 500)
        assert e["code"] == "non_finite_logits" and "NaN or infinite logits" in e["message"]
        f.engines.error_at = 2
        with httpx.stream("POST", f.base + "/v1/completions", json={"prompt": "hi", "max_tokens": 5, "stream": True},
                          timeout=10) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert r.status_code == 200 and json.loads(events[-1][6:])["error"]["code"] == "non_finite_logits"
        f.engines.error_at = None
        r = f.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 1, "top_p": 1e-46,
                                        "top_k": 10**30})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "AA"
        assert f.engines.params[-1]["top_p"] == SAMPLING_EPS and f.engines.params[-1]["top_k"] == 0
        assert httpx.get(f.base + "/health", timeout=5).text == "ok"


def test_kv_cache_tokens_caps_the_paged_cache_and_must_hold_one_request():
    import parcompile
    from parcompile.diagnostics import SpecError

    d = parcompile.compile(_spec(2, 2), filename="s.par").data["serve"]
    assert (d["block_size"], d["kv_cache_tokens"], d["kv_blocks"]) == (16, 256, BLOCKS)
    free = parcompile.compile(_spec(2, 2).replace("    kv_cache_tokens = 256\n", ""), filename="s.par").data["serve"]
    # no kv_cache_tokens: the running batch at its longest, batch 8 x (16 + 48) tokens in blocks of 16 (issue 47)
    assert free["kv_cache_tokens"] == 8 * -(-(16 + 48) // 16) * 16 < free["max_concurrent_tokens"]
    with pytest.raises(SpecError) as e:
        parcompile.compile(_spec(2, 2).replace("kv_cache_tokens = 256", "kv_cache_tokens = 48"), filename="s.par")
    d = e.value.diagnostics[0]
    assert "holds no request" in d.message and d.help == "set kv_cache_tokens >= 64" and d.span.line == 13


@pytest.mark.parametrize("kind,model", [
    ("gqa", {}),
    ("sliding_window", {"sliding_window": 5}),
    ("mla", {"heads": 4, "kv_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_nope_head_dim": 8,
             "qk_rope_head_dim": 4, "v_head_dim": 8}),
])
def test_paged_continuous_batching_equals_one_shot_generation(kind, model, tmp_path):
    """Prompts of different lengths join a running batch of 3 one step apart, over a cache
    of blocks of 4 tokens: each one's greedy tokens equal the one-shot program's."""
    from tests.serve_utils import serve_config

    cfg = serve_config(model=model, serve=dict(batch=3, prompt_len=6, max_new_tokens=10, seed=3))
    build_serve(cfg, tmp_path / "p")
    prompts = [[5, 17, 99, 3, 250, 42], [7, 7, 120], [9], [31, 200, 4, 4, 8]]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        got, peak, _ = paged_generate(tmp_path / "p", prompts, 10, max_seqs=3, blocks=12, block_size=4)
        for p, toks in zip(prompts, got):
            rec = run_in_process(tmp_path / "p", ["--prompt-ids", ",".join(map(str, p)), "--max-new-tokens", "10",
                                                  "--temperature", "0"])
            assert toks == rec["tokens"][0], kind
    finally:
        torch.set_num_threads(threads)
    assert peak == 3


def test_cli_serve_refuses_a_training_spec_and_missing_weights(tmp_path, monkeypatch, capsys):
    from parcompile.cli import main

    monkeypatch.chdir(REPO)
    assert main(["serve", "examples/tiny.par", "-o", str(tmp_path / "a")]) == 2
    assert "this spec trains" in capsys.readouterr().err
    (tmp_path / "w.par").write_text(_spec(1, 1).replace("seed = 1", 'seed = 1\n    weights = "nowhere"'))
    assert main(["serve", str(tmp_path / "w.par"), "-o", str(tmp_path / "b")]) == 1
    err = capsys.readouterr().err
    assert "weights directory" in err and "nowhere` does not exist" in err and "Traceback" not in err


def test_replica_ranks_are_the_tp_x_pp_ranks_of_each_dp_index():
    from tests.serve_utils import serve_config

    from parcompile.driver import compile_config

    plan = compile_config(serve_config(dp=2, tp=2, pp=2)).data
    reps = paged.replica_ranks(plan)
    assert len(reps) == 2 and sorted(r for g in reps for r in g) == list(range(8))
    for rep in reps:   # a replica holds every (tp, pp) coordinate once, and no two ranks of one dp group
        assert {tuple(g) for g in plan["groups"]["dp"] if set(g) & set(rep)} == {tuple(g) for g in plan["groups"]["dp"]}
        assert all(len(set(g) & set(rep)) == 1 for g in plan["groups"]["dp"])
    assert paged.replica_ranks(compile_config(serve_config(tp=2, pp=2)).data) == [[0, 1, 2, 3]]


def test_cli_serve_compiles_writes_and_hands_the_program_to_the_server(tmp_path, monkeypatch):
    """`parcompile serve` in-process up to the launch: the plan and serve.py are written
    and run_server gets them (the launch itself is the module's server fixture)."""
    import parcompile.server as server_mod
    from parcompile.cli import main

    seen = {}
    monkeypatch.setattr(server_mod, "run_server", lambda plan, program, host, port, api_key, max_body: seen.update(
        program=program, host=host, port=port, api_key=api_key, max_body=max_body) or 0)
    monkeypatch.delenv("PARCOMPILE_API_KEY", raising=False)
    (tmp_path / "s.par").write_text(_spec(2, 2))
    assert main(["serve", str(tmp_path / "s.par"), "-o", str(tmp_path / "out"), "--port", "9"]) == 0
    assert seen == {"program": tmp_path / "out" / "serve.py", "host": "127.0.0.1", "port": 9, "api_key": None,
                    "max_body": None}
    assert (tmp_path / "out" / "serve.py").is_file() and (tmp_path / "out" / "plan.json").is_file()
    monkeypatch.setenv("PARCOMPILE_API_KEY", "from-env")
    assert main(["serve", str(tmp_path / "s.par"), "-o", str(tmp_path / "out"), "--max-body", "5000"]) == 0
    assert seen["api_key"] == "from-env" and seen["max_body"] == 5000
    assert main(["serve", str(tmp_path / "s.par"), "-o", str(tmp_path / "out"), "--api-key", "flag"]) == 0
    assert seen["api_key"] == "flag"          # the flag wins over the environment


def test_cli_serve_refuses_an_empty_api_key(tmp_path, monkeypatch, capsys):
    """`--api-key ""` (say `--api-key "$KEY"` with KEY unset) is a usage error, not an open
    server: a key that was asked for and came out empty must not serve without one."""
    import parcompile.server as server_mod
    from parcompile.cli import main

    seen = {}
    monkeypatch.setattr(server_mod, "run_server", lambda *a, **k: seen.update(ran=True) or 0)
    (tmp_path / "s.par").write_text(_spec(2, 2))
    assert main(["serve", str(tmp_path / "s.par"), "-o", str(tmp_path / "out"), "--api-key", ""]) == 2
    assert not seen
    assert "--api-key" in capsys.readouterr().err


def test_cli_serve_refuses_a_port_or_host_it_cannot_listen_on(tmp_path, capsys):
    """An empty --host (`--host "$HOST"` unset) bound every interface, the address said
    `http://:8000/v1`: now refused with the two usual addresses (checked first on port_free,
    so that the test cannot start a server where that fails)."""
    from parcompile.cli import main
    from parcompile.server import port_free

    assert "0.0.0.0" in (port_free("", 8000) or "") and "0.0.0.0" in (port_free(" ", 8000) or "")
    (tmp_path / "s.par").write_text(_spec(1, 1))
    for flags, why in ((["--port", "99999"], "the port must be 1-65535, got 99999"), (["--port", "0"], "got 0"),
                       (["--host", "192.0.2.1"], "cannot listen on 192.0.2.1:8000"),
                       (["--host", ""], "the host is empty: give an address")):
        assert main(["serve", str(tmp_path / "s.par"), "-o", str(tmp_path / "out")] + flags) == 1
        err = capsys.readouterr().err
        assert why in err and "Traceback" not in err


# ---- the HTTP front in-process, over a fake engine (no ranks) ---------------------------

class _FakeEngines:
    """Engines' interface: one token every ``every_s`` seconds after ``first_s``, up to
    max_tokens (the ``stop_at``-th: the request's first end token, finish_reason "stop",
    logprob -0.25, as the scheduler ends a sequence on one); records aborts and how many
    tokens each request was sent."""

    def __init__(self, first_s=0.0, every_s=0.02, error_at=None, stop_at=None):
        self.first_s, self.every_s, self.failed, self.error_at = first_s, every_s, None, error_at
        self.stop_at = stop_at
        self.aborted, self.sent, self.tasks, self.params = [], {}, [], []

    def submit(self, rid, prompt, params):
        self.params.append(params)
        q = asyncio.Queue()

        async def produce():
            await asyncio.sleep(self.first_s)
            for i in range(params["max_tokens"]):
                if rid in self.aborted:
                    return
                self.sent[rid] = i + 1
                if i == self.error_at:      # the engine's answer to NaN / inf logits (paged.ERROR_TOKEN)
                    q.put_nowait((paged.ERROR_TOKEN, "error"))
                    return
                lp = None
                if params.get("logprobs") is not None:     # the engine's entry (paged.unpack_logprobs)
                    lp = {"lp": -0.5, "top": [(65, -0.5), (66, -1.5)][:params["logprobs"]]}
                    if i == 0 and params.get("prompt_logprobs"):
                        lp["prompt"] = [(-1.0 - j, [(66, -0.25)][:params["logprobs"]]) for j in range(len(prompt) - 1)]
                if i == self.stop_at:
                    eos = params["eos"][0]
                    q.put_nowait((eos, "stop", None if lp is None else {**lp, "lp": -0.25, "top": [(eos, -0.25)]}))
                    return
                q.put_nowait((65, "length" if i + 1 == params["max_tokens"] else None, lp))
                await asyncio.sleep(self.every_s)

        self.tasks.append(asyncio.get_running_loop().create_task(produce()))
        return q

    def abort(self, rid):
        self.aborted.append(rid)

    def totals(self):
        return {"blocks_used": 0, "blocks_free": 1, "waiting": 0, "running": 0}


def _front(engines, chat_template=None, tokenizer=None, context=512, eos=(), **kw):
    from parcompile.server.api import PLAIN_CHAT_TEMPLATE, ModelInfo, build_app
    from parcompile.server.metrics import Metrics

    info = ModelInfo(name="tiny", vocab=256, context=context, temperature=0.0, top_k=0, eos=list(eos),
                     tokenizer=tokenizer or gen.load_tokenizer(None, None, 256),
                     chat_template=chat_template or PLAIN_CHAT_TEMPLATE, special={})
    return build_app(info, engines, Metrics("tiny"), **kw)


class _LiveFront:
    """The HTTP front over fake engines, served by `serve`'s own uvicorn configuration
    (server/http.py) in a thread on 127.0.0.1: real HTTP over loopback, no ranks."""

    def __init__(self, engines=None, headers_timeout_s=10.0, http="auto", loop="auto", limits=None, **kw):
        import uvicorn

        from parcompile.server.http import uvicorn_config

        self.engines = engines or _FakeEngines(every_s=0.001)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.config = uvicorn_config(_front(self.engines, **kw), "127.0.0.1", self.port,
                                     headers_timeout_s=headers_timeout_s, http=http, loop=loop, **(limits or {}))
        self.server = uvicorn.Server(self.config)
        self.server.install_signal_handlers = lambda: None      # uvicorn < 0.29
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the front did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)

    def post(self, path, body=None, content=None, headers=None, timeout=10):
        return httpx.post(self.base + path, json=body, content=content, headers=headers, timeout=timeout)


def _openai_error(r, status):
    assert r.status_code == status, (r.status_code, r.text[:300])
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"}, e
    return e


async def _asgi(app, method, path, body: bytes = b"", disconnect_after_s=None, timeout_s=10.0):
    """One request through the ASGI app; the client goes away ``disconnect_after_s`` seconds
    in (uvicorn then answers every receive() with http.disconnect). Returns (status, body)."""
    loop = asyncio.get_running_loop()
    t0, pending, sent = loop.time(), [{"type": "http.request", "body": body, "more_body": False}], []

    async def receive():
        if pending:
            return pending.pop(0)
        while disconnect_after_s is None or loop.time() < t0 + disconnect_after_s:
            await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 8000)}
    await asyncio.wait_for(app(scope, receive, send), timeout_s)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_front_aborts_a_plain_request_and_a_queued_stream_whose_client_left():
    """A plain (non-streamed) request's client that times out while tokens keep coming, and
    a stream's client that leaves while its request waits for a first token, are aborted
    at once (their KV blocks freed), not generated to max_tokens."""
    async def main():
        engines = _FakeEngines(every_s=0.02)
        app = _front(engines)
        t0 = time.monotonic()
        status, _ = await _asgi(app, "POST", "/v1/completions", json.dumps(
            {"prompt": "hi", "max_tokens": 400}).encode(), disconnect_after_s=0.3)
        assert len(engines.aborted) == 1 and engines.sent[engines.aborted[0]] < 100, engines.sent
        assert time.monotonic() - t0 < 4
        queued = _FakeEngines(first_s=3.0)
        status, _ = await _asgi(_front(queued), "POST", "/v1/completions", json.dumps(
            {"prompt": "hi", "max_tokens": 5, "stream": True}).encode(), disconnect_after_s=0.3)
        assert len(queued.aborted) == 1 and not queued.sent     # aborted before its first token
        for t in engines.tasks + queued.tasks:
            t.cancel()

    asyncio.run(main())


def test_front_refuses_unsupported_fields_lax_numbers_and_answers_unknown_paths_in_openai_form():
    async def main():
        engines = _FakeEngines(every_s=0)
        app = _front(engines)

        async def post(body, path="/v1/completions"):
            status, raw = await _asgi(app, "POST", path, json.dumps(body).encode())
            return status, json.loads(raw)

        for key, value in (("suffix", "x"), ("presence_penalty", 0.5), ("logit_bias", {"65": 100})):
            status, body = await post({"prompt": "hi", "max_tokens": 2, key: value})
            assert status == 400 and body["error"]["param"] == key and "not supported" in body["error"]["message"]
        status, body = await post({"messages": [{"role": "user", "content": "hi"}], "echo": True,
                                   "max_tokens": 2}, "/v1/chat/completions")
        assert status == 400 and body["error"]["param"] == "echo"
        # what would change where a sequence ends or what its text holds, or ask for a tool call
        # (vLLM: 400 for a tool_choice but "none" without tools): refused, not ignored
        for key, value in (("ignore_eos", True), ("stop_token_ids", [65]), ("include_stop_str_in_output", True),
                           ("skip_special_tokens", False), ("tool_choice", "required"), ("tool_choice", "auto"),
                           ("tool_choice", {"type": "function", "function": {"name": "f"}}), ("tool_choice", 5),
                           ("chat_template", "{{ messages }}"), ("add_generation_prompt", False),
                           ("continue_final_message", True)):
            status, body = await post({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, key: value},
                                      "/v1/chat/completions")
            assert status == 400 and body["error"]["param"] == key and "not supported" in body["error"]["message"]
        status, body = await post({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": [],
                                   "tool_choice": "none", "ignore_eos": False, "add_generation_prompt": True},
                                  "/v1/chat/completions")
        assert status == 200, body
        # what is implemented refuses values beyond its limits (and the server goes on)
        for extra, param, words in (({"logprobs": 21}, "logprobs", "less than or equal to 20"),
                                    ({"n": 3, "best_of": 2}, "best_of", "at least `n`"),
                                    ({"best_of": 3, "stream": True}, "best_of", "cannot be streamed"),
                                    ({"max_tokens": 0}, "max_tokens", "echo"),
                                    ({"prompt": []}, "prompt", "empty")):
            status, body = await post({"prompt": "hi", "max_tokens": 2, **extra})
            assert status == 400 and body["error"]["param"] == param and words in body["error"]["message"], body
        status, body = await post({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2,
                                   "max_tokens": 2}, "/v1/chat/completions")
        assert status == 400 and body["error"]["param"] == "top_logprobs"
        for key, value in (("temperature", "0.5"), ("temperature", True), ("top_p", "1")):
            status, body = await post({"prompt": "hi", "max_tokens": 2, key: value})
            assert status == 400 and body["error"]["param"] == key, body
        # neutral values (what clients send by default) and integer numbers are accepted
        status, body = await post({"prompt": "hi", "max_tokens": 2, "temperature": 0, "top_p": 1, "logprobs": None,
                                   "echo": False, "presence_penalty": 0.0, "frequency_penalty": 0, "best_of": 1})
        assert status == 200 and body["choices"][0]["text"] == "AA"
        status, body = await post({"prompt": "hi", "max_tokens": 1, "temperature": 1e-300})
        assert status == 200 and engines.params[-1]["temperature"] == 0.0     # greedy: logits / 1e-300 is inf
        for method, path, code in (("POST", "/v1/embeddings", 404), ("GET", "/v1/completions", 405)):
            status, raw = await _asgi(app, method, path)
            err = json.loads(raw)["error"]
            assert status == code and set(err) == {"message", "type", "param", "code"} and path in err["message"]
        for t in engines.tasks:
            t.cancel()

    asyncio.run(main())


def test_null_fields_take_openais_defaults():
    """OpenAI's API reference types ``n`` ("integer or null"), ``stream`` and ``echo``
    ("boolean or null") as nullable with defaults 1 and false: null is the default, as
    ``temperature: null`` already was (was: 400 "Input should be a valid integer (got null)")."""
    async def main():
        engines = _FakeEngines(every_s=0)
        app = _front(engines)

        async def post(body, path="/v1/completions"):
            status, raw = await _asgi(app, "POST", path, json.dumps(body).encode())
            return status, json.loads(raw)

        status, body = await post({"prompt": "hi", "max_tokens": 2, "n": None, "stream": None, "echo": None})
        assert status == 200 and [c["text"] for c in body["choices"]] == ["AA"], body
        status, body = await post({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": None,
                                   "stream": None}, "/v1/chat/completions")
        assert status == 200 and len(body["choices"]) == 1, body
        status, body = await post({"prompt": "hi", "max_tokens": 2, "n": "2"})     # a wrong type is still one
        assert status == 400 and body["error"]["param"] == "n", body
        for t in engines.tasks:
            t.cancel()

    asyncio.run(main())


def test_chat_max_tokens_0_is_refused_without_naming_echo():
    """Chat has no ``echo``: its ``max_tokens`` 0 is refused with a fix that it can take (was:
    "it is only taken with `"echo": true`", a field chat refuses)."""
    async def main():
        engines = _FakeEngines(every_s=0)
        status, raw = await _asgi(_front(engines), "POST", "/v1/chat/completions", json.dumps(
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}).encode())
        err = json.loads(raw)["error"]
        assert status == 400 and err["param"] == "max_tokens" and "echo" not in err["message"], err
        assert "at least 1" in err["message"], err

    asyncio.run(main())


def test_ctrl_c_while_the_ranks_start_ends_them(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM, which `serve` turns into one) before every replica connected:
    torchrun's process group is ended (torchrun ends its ranks on SIGTERM), no orphans."""
    from parcompile import jobs
    from parcompile.server import engines as engines_mod

    launched = []
    popen = subprocess.Popen
    monkeypatch.setattr(jobs.subprocess, "Popen", lambda *a, **k: launched.append(popen(*a, **k)) or launched[-1])

    def interrupted(self, timeout_s):
        raise KeyboardInterrupt

    monkeypatch.setattr(engines_mod.Engines, "_accept", interrupted)
    (tmp_path / "slow.py").write_text("import time\ntime.sleep(120)\n")
    with pytest.raises(KeyboardInterrupt):
        engines_mod.Engines(tmp_path / "slow.py", 1, 1)
    try:
        assert launched[0].poll() is not None          # torchrun ended, not left running
    finally:
        if launched[0].poll() is None:
            os.killpg(launched[0].pid, signal.SIGKILL)
            launched[0].wait()


def test_sigterm_after_uvicorn_shuts_down_still_stops_the_ranks(tmp_path, monkeypatch):
    """uvicorn re-raises the SIGTERM it shut down on; `serve` must then tell the ranks to
    stop (Engines.stop) rather than die by the signal's default action and leave them."""
    import uvicorn

    import parcompile.server as server_mod
    from parcompile.server import engines as engines_mod
    from tests.serve_utils import serve_config

    from parcompile.driver import compile_config

    guard = lambda signum, frame: None      # noqa: E731 - this test's own: never the default (death)
    previous = signal.signal(signal.SIGTERM, guard)
    stopped, logged = [], []

    class Fake(_FakeEngines):
        def __init__(self, *a, **k):
            super().__init__()

        def stop(self):
            stopped.append(True)
            return 0

    def run(self):
        assert signal.getsignal(signal.SIGTERM) is not guard   # serve's handler is in force
        signal.raise_signal(signal.SIGTERM)                    # as uvicorn does after its graceful shutdown

    monkeypatch.setattr(engines_mod, "Engines", Fake)
    monkeypatch.setattr(uvicorn.Server, "run", run)
    try:
        status = server_mod.run_server(compile_config(serve_config()), tmp_path / "serve.py", port=free_port(),
                                       log=lambda *a, **k: logged.append(a[0]))
        assert stopped == [True] and status == 0
        assert any("no `weights`: the model answers with random weights" in line for line in logged)
        assert signal.getsignal(signal.SIGTERM) is guard                # restored
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_second_ctrl_c_while_stopping_still_ends_the_job(tmp_path, monkeypatch):
    from parcompile.server import engines as engines_mod

    monkeypatch.setattr(engines_mod.Engines, "_accept", lambda self, timeout_s: None)
    (tmp_path / "slow.py").write_text("import time\ntime.sleep(120)\n")
    e = engines_mod.Engines(tmp_path / "slow.py", 1, 1)
    wait, calls = e.proc.wait, []

    def impatient(timeout=None):
        calls.append(timeout)
        if len(calls) == 1:
            raise KeyboardInterrupt        # Ctrl-C again during the graceful wait
        return wait(timeout)

    monkeypatch.setattr(e.proc, "wait", impatient)
    try:
        try:
            e.stop()
        except KeyboardInterrupt:
            pytest.fail("the second Ctrl-C escaped Engines.stop and left torchrun running")
        assert wait(0) is not None and len(calls) == 2      # SIGTERMed at once, not left running
    finally:
        if e.proc.poll() is None:
            os.killpg(e.proc.pid, signal.SIGKILL)
            wait()


def test_the_engine_connection_sends_each_step_at_once(tmp_path):
    """The front and the leader exchange one small message per step each way over TCP:
    both ends turn Nagle's algorithm off (paged.tcp_nodelay), else a step's tokens wait in
    the kernel for the previous message's delayed acknowledgement (up to 40 ms on Linux;
    strace showed a sequential request's tokens arriving in one burst at its end). A
    program of the test's own, started by Engines under torchrun as `serve` starts the real
    one, connects as the leader does (paged._connect) and reports its socket's option. The
    rank also gets its share of the cores less the front's (host.engine_threads: 1 of 2;
    torch's default, all the cores, stalled an engine step at every parallel region's
    barrier while the front was busy)."""
    import socket as socket_

    from parcompile.runtime.machine import host
    from parcompile.server import engines as engines_mod

    (tmp_path / "leader.py").write_text(
        "import socket, sys, torch\n"
        "from parcompile.runtime.serve.paged import _connect\n"
        "conn = _connect(sys.argv[sys.argv.index('--engine') + 1])\n"
        "s = socket.socket(fileno=conn.fileno())\n"
        "nodelay = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)\n"
        "s.detach()\n"
        "conn.send(('ready', {'replica': 0, 'kv_blocks': 4, 'block_size': 16, 'max_seqs': 1, 'cache_bytes': 0,\n"
        "                     'nodelay': nodelay, 'threads': torch.get_num_threads()}))\n"
        "while conn.recv()[0] != 'stop':\n"
        "    pass\n")
    e = engines_mod.Engines(tmp_path / "leader.py", 1, 1, extra_env={"PYTHONPATH": str(REPO)})
    try:
        (r,) = e.replicas
        front = socket_.socket(fileno=r.conn.fileno())
        try:
            assert front.getsockopt(socket_.IPPROTO_TCP, socket_.TCP_NODELAY) != 0       # the front's end
        finally:
            front.detach()
        assert r.info["nodelay"] != 0                                                   # the leader's end
        assert r.info["threads"] == host.engine_threads(1)          # (torch's default here: all the cores)
    finally:
        assert e.stop() == 0


def test_front_gives_chat_templates_transformers_globals():
    """HF templates call raise_exception (Mistral's, on roles out of order) and strftime_now
    (Llama 3.1's date): the refusal is the template's own message, a 400."""
    template = ("{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with a user "
                "message') }}{% endif %}{{ strftime_now('%Y') }}{% for m in messages %}{{ m.content }}{% endfor %}")

    async def main():
        engines = _FakeEngines(every_s=0)
        app = _front(engines, template)
        async def chat(first):
            return await _asgi(app, "POST", "/v1/chat/completions", json.dumps(
                {"messages": [{"role": first, "content": "hi"}], "max_tokens": 1}).encode())

        code, raw = await chat("assistant")
        assert code == 400 and json.loads(raw)["error"]["message"].endswith(
            "Conversations must start with a user message"), raw
        code, raw = await chat("user")
        assert code == 200 and engines.params, raw
        for t in engines.tasks:
            t.cancel()

    asyncio.run(main())


# ---- issue 30: hostile requests over loopback ---------------------------------------------

def test_malformed_fields_and_deep_json_are_400_not_500():
    """Issue 30.2: stream_options "x" (after a token was generated), a content part whose
    text is a number and a body nested 100,000 deep were 500s; each is a 400 in OpenAI's
    form before anything is generated, and the server keeps serving."""
    with _LiveFront() as f:
        e = _openai_error(f.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stream": True,
                                                     "stream_options": "x"}), 400)
        assert e["param"] == "stream_options"
        e = _openai_error(f.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2,
                                                     "stream_options": {"include_usage": True}}), 400)
        assert "only be given with" in e["message"]
        chat = lambda content: f.post("/v1/chat/completions", {"messages": [{"role": "user", "content": content}],
                                                               "max_tokens": 2})
        e = _openai_error(chat([{"type": "text", "text": 5}]), 400)
        assert "messages.0.content.0.text" in e["message"] and e["param"] == "messages"
        e = _openai_error(chat([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]), 400)
        assert "only text content parts" in e["message"]
        assert chat([{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]).status_code == 200
        e = _openai_error(f.post("/v1/completions", content=b"[" * 100_000 + b"]" * 100_000), 400)
        assert "nests deeper than 64" in e["message"]
        deep = b'{"prompt": "x", "max_tokens": 1, "logit_bias": ' + b"[" * 500 + b"]" * 500 + b"}"
        assert "nests deeper" in _openai_error(f.post("/v1/completions", content=deep), 400)["message"]
        e = _openai_error(f.post("/v1/completions", content=b'{"prompt": "x", "temperature": NaN}'), 400)
        assert "NaN is not JSON" in e["message"]
        # found by the fuzz: a lone surrogate (a valid JSON escape, not text) made the tokenizer raise (500)
        for raw in (b'{"prompt": "\\ud800x", "max_tokens": 1}', b'{"messages": [{"role": "user", "content": '
                    b'"\\udc00"}], "max_tokens": 1}', '{"prompt": "\\ud800"}'.encode("utf-16")):
            path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
            e = _openai_error(f.post(path, content=raw), 400)
            assert "lone UTF-16 surrogate" in e["message"], raw
        assert f.post("/v1/completions", content=b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}').status_code == 200
        r = f.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stream": True,
                                       "stream_options": {"include_usage": True}})
        assert r.status_code == 200 and '"usage"' in r.text


class _SlowTokenizer:
    """Bytes, one second per encode (a long prompt's tokenization); counts its calls."""

    kind, max_token_bytes = "bytes", 1

    def __init__(self):
        self.calls = 0

    def encode(self, text):
        self.calls += 1
        time.sleep(1.0)
        return list(text.encode())

    def decode(self, ids):
        return bytes(ids).decode(errors="replace")


def test_large_bodies_are_413_long_prompts_400_untokenized_and_tokenizing_blocks_no_one():
    """Issue 30.3: no body limit, and the tokenizer ran in the event loop before the context
    check (a 50 MB prompt: 25 s to its 400 while /health stalled). Now a Content-Length past
    the limit is 413 at once (nothing read), a chunked body is cut at the limit, a text that
    cannot fit by its bytes is refused without tokenizing, and /health answers while a
    prompt is tokenized."""
    import socket as socket_

    tok = _SlowTokenizer()
    with _LiveFront(tokenizer=tok, max_body=100_000) as f:
        t0 = time.monotonic()
        with socket_.create_connection(("127.0.0.1", f.port), timeout=10) as c:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 50000000\r\n\r\n" + b'{"prompt": "' + b"a" * 1000)
            head = b""
            while chunk := c.recv(65536):     # the answer, then the server closes
                head += chunk
            head = head.decode()
        assert head.startswith("HTTP/1.1 413") and "request_too_large" in head and time.monotonic() - t0 < 5
        assert "100,000" in head and "--max-body" in head

        def chunks():
            yield b'{"prompt": "'
            for _ in range(30):
                yield b"a" * 10_000
            yield b'"}'
        e = _openai_error(httpx.post(f.base + "/v1/completions", content=chunks(), timeout=10), 413)
        assert e["code"] == "request_too_large"
        # found by the fuzz: a client that leaves mid-body was a traceback in the log (and a 500 to nobody)
        import logging

        errors = []
        handler = logging.Handler(logging.ERROR)
        handler.emit = errors.append
        logging.getLogger("uvicorn.error").addHandler(handler)
        try:
            with socket_.create_connection(("127.0.0.1", f.port), timeout=10) as c:
                c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
                time.sleep(0.2)
            time.sleep(0.3)
            assert httpx.get(f.base + "/health", timeout=5).text == "ok"
        finally:
            logging.getLogger("uvicorn.error").removeHandler(handler)
        assert not errors, [r.getMessage() for r in errors]
        e = _openai_error(f.post("/v1/completions", {"prompt": "a" * 90_000, "max_tokens": 1}), 400)
        assert e["code"] == "context_length_exceeded" and "at least 90000 tokens" in e["message"] and tok.calls == 0
        e = _openai_error(f.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 600}]}), 400)
        assert e["code"] == "context_length_exceeded" and tok.calls == 0
        with ThreadPoolExecutor(1) as ex:      # a prompt being tokenized (1 s) does not stall /health
            slow = ex.submit(f.post, "/v1/completions", {"prompt": "hello", "max_tokens": 1})
            while tok.calls == 0:
                time.sleep(0.01)
            t0 = time.monotonic()
            assert httpx.get(f.base + "/health", timeout=5).text == "ok"
            assert time.monotonic() - t0 < 0.5
            assert slow.result().status_code == 200


def test_api_key_gives_401_in_openai_form_and_health_stays_open():
    """Issue 30.4: --api-key (PARCOMPILE_API_KEY) as vLLM's: /v1 needs `Authorization:
    Bearer KEY`; /health and /metrics stay open."""
    with _LiveFront(api_key="s3cret") as f:
        for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Bearer s3cret2"}):
            e = _openai_error(f.post("/v1/completions", {"prompt": "hi", "max_tokens": 1}, headers=headers), 401)
            assert e["code"] == "invalid_api_key" and "s3cret" not in e["message"]
        assert httpx.get(f.base + "/v1/models", timeout=5).status_code == 401
        e = _openai_error(f.post("/v1/completions", content=b"x" * 2_000_000), 401)   # before any body check
        assert httpx.get(f.base + "/health", timeout=5).text == "ok"
        assert httpx.get(f.base + "/metrics", timeout=5).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f.base + "/v1", api_key="wrong", max_retries=0).completions.create(
                model="tiny", prompt="hi", max_tokens=1)
        good = openai.OpenAI(base_url=f.base + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].text == "AA"


def _fast_http() -> bool:
    from parcompile.server.http import fast_http_available

    return all(fast_http_available())


#: serve's two HTTP stacks: uvloop + httptools (uvicorn[standard], the default when installed)
#: and the asyncio + h11 fallback
STACKS = [pytest.param(("httptools", "uvloop"), marks=pytest.mark.skipif(
              not _fast_http(), reason="uvloop / httptools not installed (pip install 'uvicorn[standard]')"),
              id="httptools"),
          pytest.param(("h11", "asyncio"), id="h11")]


@pytest.mark.parametrize("stack", STACKS)
def test_a_connection_that_never_finishes_its_headers_is_dropped(stack):
    """Issue 30.4 (slowloris): uvicorn alone keeps a connection that sends a header byte now
    and then open forever; serve's protocol closes it at the headers deadline, and /health
    answers meanwhile; on both HTTP stacks."""
    import socket as socket_

    with _LiveFront(headers_timeout_s=1.0, http=stack[0], loop=stack[1]) as f:
        c = socket_.create_connection(("127.0.0.1", f.port), timeout=10)
        t0 = time.monotonic()
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        closed_after = None
        try:
            for i in range(40):             # 8 s of one header byte every 0.2 s
                assert httpx.get(f.base + "/health", timeout=2).text == "ok" if i % 10 == 0 else True
                c.sendall(b"X")
                time.sleep(0.2)
        except (BrokenPipeError, ConnectionResetError):
            closed_after = time.monotonic() - t0
        finally:
            c.close()
        assert closed_after is not None and closed_after < 4, closed_after
        # a kept-alive connection's next request gets the same deadline; a complete request is served
        with socket_.create_connection(("127.0.0.1", f.port), timeout=10) as c:
            c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            got = c.recv(4096)
            while not got.endswith(b"\r\n\r\nok"):
                got += c.recv(4096)
            assert got.startswith(b"HTTP/1.1 200")
            c.sendall(b"GET /health HTTP/1.1\r\n")
            t0 = time.monotonic()
            assert c.recv(4096) == b"" and time.monotonic() - t0 < 3     # closed, no second answer


@pytest.mark.parametrize("stack", STACKS)
def test_stalled_bodies_are_dropped_and_health_answers_under_200_of_them(stack):
    """Issue 51: requests that send headers and `{` and then nothing were held forever (40
    clients x 500 filled the front's file descriptors and /health stopped). 200 such
    connections: /health answers while they stall; each is closed at the body deadline; a
    body that arrives in time is served; on both HTTP stacks."""
    import socket as socket_

    with _LiveFront(http=stack[0], loop=stack[1], limits={"body_timeout_s": 1.5}) as f:
        stalled = []
        for _ in range(200):
            c = socket_.create_connection(("127.0.0.1", f.port), timeout=10)
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{")
            stalled.append(c)
        t0 = time.monotonic()
        assert httpx.get(f.base + "/health", timeout=5).text == "ok"
        assert time.monotonic() - t0 < 1.0
        ok = f.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        time.sleep(2.0)
        closed = 0
        for c in stalled:
            c.settimeout(5)
            try:
                closed += c.recv(4096) == b""
            except ConnectionResetError:
                closed += 1
            c.close()
        assert closed == 200, closed


@pytest.mark.parametrize("stack", STACKS)
def test_a_slow_but_steady_body_outlives_the_body_deadline(stack):
    """The body deadline grows a second per BODY_MIN_RATE bytes received (Apache's
    ``MinRate``): a body at the server's size limit on a slow link is served (was: closed at
    30 s whatever arrived, so 64 MB needed 2.2 MB/s), one that stops is still closed.
    Scaled down: a 1 s deadline, 1,000 bytes/s; 6 kB sent at 2,000 bytes/s over 3 s."""
    import socket as socket_

    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode().ljust(6000)
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    with _LiveFront(http=stack[0], loop=stack[1], limits={"body_timeout_s": 1.0, "body_min_rate": 1000}) as f:
        with socket_.create_connection(("127.0.0.1", f.port), timeout=10) as c:
            c.sendall(head)
            t0 = time.monotonic()
            for i in range(0, len(body), 500):
                c.sendall(body[i:i + 500])
                time.sleep(0.25)
            assert time.monotonic() - t0 > 2.5
            assert c.recv(4096).startswith(b"HTTP/1.1 200")
        with socket_.create_connection(("127.0.0.1", f.port), timeout=10) as c:
            c.sendall(head)
            time.sleep(0.1)
            t0 = time.monotonic()
            c.sendall(body[:2000])               # 2 s earned, then nothing: closed at about 1 + 2 s
            try:
                assert c.recv(4096) == b""
            except ConnectionResetError:
                pass
            assert 2.0 < time.monotonic() - t0 < 5.0


@pytest.mark.parametrize("stack", STACKS)
def test_one_client_holds_at_most_its_share_of_connections(stack):
    """Connections past MAX_CONNECTIONS_PER_CLIENT from one address are closed as they arrive
    (nginx's limit_conn); closing some admits the client again."""
    import socket as socket_

    with _LiveFront(http=stack[0], loop=stack[1], limits={"max_connections_per_client": 20}) as f:
        held = [socket_.create_connection(("127.0.0.1", f.port), timeout=10) for _ in range(20)]
        time.sleep(0.3)
        extra = socket_.create_connection(("127.0.0.1", f.port), timeout=5)
        try:
            assert extra.recv(4096) == b""
        except ConnectionResetError:
            pass
        extra.close()
        for c in held[:5]:
            c.close()
        time.sleep(0.3)
        assert httpx.get(f.base + "/health", timeout=5).text == "ok"
        for c in held[5:]:
            c.close()


@pytest.mark.parametrize("stack", STACKS)
def test_request_headers_past_the_bound_get_400_and_smaller_ones_are_served(stack):
    """Incomplete request headers past MAX_HEADER_BYTES are answered 400 and the connection
    closed (h11 bounds them itself; llhttp buffers any size, serve's protocol counts), on
    both stacks; a request with headers of half the bound is served, and a kept-alive
    connection's second request gets the bound afresh."""
    import select
    import socket as socket_

    from parcompile.server.http import MAX_HEADER_BYTES

    def read_all(c):
        got = b""
        while True:
            part = c.recv(65536)
            if not part:
                return got
            got += part

    with _LiveFront(http=stack[0], loop=stack[1]) as f:
        with socket_.create_connection(("127.0.0.1", f.port), timeout=10) as c:
            c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
            for i in range(MAX_HEADER_BYTES // 1024 + 2):          # in pieces, never finished
                if select.select([c], [], [], 0.02)[0]:             # answered: send no more
                    break
                c.sendall(b"a" * 1024)
            assert i > MAX_HEADER_BYTES // 1024 - 2                 # not answered before the bound
            got = read_all(c)
            assert got.startswith(b"HTTP/1.1 400"), got[:200]
        half = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES // 2) + b"\r\n\r\n"
        with socket_.create_connection(("127.0.0.1", f.port), timeout=10) as c:
            for _ in range(3):        # kept alive: the count starts again with each request
                c.sendall(half)
                got = c.recv(4096)
                while not got.endswith(b"\r\n\r\nok"):
                    got += c.recv(4096)
                assert got.startswith(b"HTTP/1.1 200"), got[:200]


def test_serve_falls_back_to_asyncio_and_h11_without_uvloop_and_httptools(monkeypatch):
    """With uvloop and httptools installed serve runs on them; without them (imports that
    fail) on asyncio and h11, and a streamed completion is answered there; asking for one
    that is missing is a ValueError naming the extra."""
    import uvicorn  # noqa: F401  (imported before the modules go missing)

    from parcompile.server import http

    if _fast_http():
        cfg = http.uvicorn_config(None, "127.0.0.1", 1)
        assert cfg.loop == "uvloop" and issubclass(cfg.http, http.HttpToolsHeaderTimeoutProtocol)
    monkeypatch.setitem(sys.modules, "uvloop", None)
    monkeypatch.setitem(sys.modules, "httptools", None)
    assert http.fast_http_available() == (False, False)
    cfg = http.uvicorn_config(None, "127.0.0.1", 1, headers_timeout_s=3.0)
    assert cfg.loop == "asyncio" and issubclass(cfg.http, http.HeaderTimeoutProtocol)
    assert cfg.http.headers_timeout_s == 3.0
    for kw in ({"http": "httptools"}, {"loop": "uvloop"}):
        with pytest.raises(ValueError, match=r"uvicorn\[standard\]"):
            http.uvicorn_config(None, "127.0.0.1", 1, **kw)
    with _LiveFront() as f:
        assert f.config.loop == "asyncio"
        r = httpx.post(f.base + "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True}, timeout=10)
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        assert "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.text.split("\n\n")
                       if line.startswith("data: {")) == "AAA"


def test_serving_beyond_loopback_without_a_key_warns(tmp_path, monkeypatch, capsys):
    import uvicorn

    import parcompile.server as server_mod
    from parcompile.driver import compile_config
    from parcompile.server import engines as engines_mod
    from tests.serve_utils import serve_config

    class Fake(_FakeEngines):
        def __init__(self, *a, **k):
            super().__init__()

        def stop(self):
            return 0

    monkeypatch.setattr(engines_mod, "Engines", Fake)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: None)
    plan = compile_config(serve_config())
    for host, key, warned in (("0.0.0.0", None, True), ("0.0.0.0", "k", False), ("127.0.0.1", None, False),
                              ("localhost", None, False)):
        assert server_mod.run_server(plan, tmp_path / "serve.py", host=host, port=free_port(), api_key=key,
                                     log=lambda *a, **k: None) == 0
        err = capsys.readouterr().err
        assert ("not a loopback address, without an API key" in err) == warned, (host, key, err)
    assert server_mod.is_loopback("::1") and server_mod.is_loopback("127.0.0.2") and not server_mod.is_loopback("10.0.0.1")


def test_front_batches_prompts_samples_n_and_returns_openai_logprobs():
    """Issue 33 over a fake engine (each token 'A' = 65 with logprob -0.5, the prompt's
    tokens -1, -2, ...): a list of prompts and n give prompt-major choices; echo with
    logprobs gives the prompt's tokens first (the first one null), max_tokens 0 the prompt
    alone; chat's logprobs give OpenAI's content list; a stream of n choices carries both
    indices; best_of returns n; the engine is asked for the logprobs it must compute."""
    async def main():
        engines = _FakeEngines(every_s=0)
        app = _front(engines)

        async def post(body, path="/v1/completions"):
            status, raw = await _asgi(app, "POST", path, json.dumps(body).encode())
            assert status == 200, raw
            return json.loads(raw) if not body.get("stream") else raw.decode()

        r = await post({"prompt": ["hi", "hi!"], "n": 2, "max_tokens": 2, "temperature": 1, "seed": 5})
        assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3] and [c["text"] for c in r["choices"]] == ["AA"] * 4
        assert r["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}
        assert sorted(p["seed"] for p in engines.params[-4:]) == [5, 5, 6, 6]
        r = await post({"prompt": [[104, 105]], "max_tokens": 1, "echo": True, "logprobs": 1})
        lp = r["choices"][0]["logprobs"]
        assert r["choices"][0]["text"] == "hiA"
        assert lp["tokens"] == ["h", "i", "A"] and lp["token_logprobs"] == [None, -1.0, -0.5]
        assert lp["top_logprobs"] == [None, {"B": -0.25, "i": -1.0}, {"A": -0.5}] and lp["text_offset"] == [0, 1, 2]
        assert engines.params[-1]["prompt_logprobs"] and engines.params[-1]["logprobs"] == 1
        r = await post({"prompt": "hi", "max_tokens": 0, "echo": True, "logprobs": 0})
        assert r["choices"][0]["text"] == "hi" and r["choices"][0]["logprobs"]["token_logprobs"] == [None, -1.0]
        assert r["usage"]["completion_tokens"] == 0 and engines.params[-1]["max_tokens"] == 1
        r = await post({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
                        "top_logprobs": 2}, "/v1/chat/completions")
        content = r["choices"][0]["logprobs"]["content"]
        assert [c["token"] for c in content] == ["A", "A"] and content[0]["bytes"] == [65]
        assert [t["token"] for t in content[0]["top_logprobs"]] == ["A", "B"] and content[1]["logprob"] == -0.5
        raw = await post({"prompt": "hi", "n": 2, "max_tokens": 3, "stream": True, "logprobs": 0})
        events = [json.loads(x[6:]) for x in raw.split("\n\n") if x.startswith("data: {")]
        by = {}
        for e in events:
            c = e["choices"][0]
            by.setdefault(c["index"], []).append(c)
        assert sorted(by) == [0, 1] and all("".join(c["text"] for c in cs) == "AAA" for cs in by.values())
        assert all(sum(len(c["logprobs"]["tokens"]) for c in cs) == 3 for cs in by.values())
        assert raw.rstrip().endswith("data: [DONE]")
        r = await post({"prompt": "hi", "n": 1, "best_of": 3, "max_tokens": 2})
        assert len(r["choices"]) == 1 and r["choices"][0]["logprobs"] is None
        assert [p["logprobs"] for p in engines.params[-3:]] == [0, 0, 0]      # ranked by their logprobs
        for t in engines.tasks:
            t.cancel()

    asyncio.run(main())


def test_front_returns_the_end_token_and_its_logprob_and_counts_it_as_vllm_does(tmp_path):
    """Issue 47 over a fake engine that ends each sequence on its third token, the end token
    (logprob -0.25; the two before: token 65, logprob -0.5), behind real HTTP and the official `openai` client: completions and
    chat, streamed or not, return its id and logprob with its token string (the tokenizer's
    text of it alone, specials kept: "<|endoftext|>", as vLLM's logprobs) and count it in
    ``completion_tokens``; the text leaves it out (vLLM's detokenizer skips a stop-terminated
    sequence's last token). It was dropped from all of these."""
    transformers = pytest.importorskip("transformers")
    from tests.serve_utils import write_byte_tokenizer

    eot = write_byte_tokenizer(tmp_path / "tok")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    a, end = hf.decode([65]), hf.decode([eot])        # the fake's token 65, and the end token alone
    assert end == "<|endoftext|>"
    with _LiveFront(_FakeEngines(every_s=0.001, stop_at=2), eos=[eot],
                    tokenizer=gen.load_tokenizer(str(tmp_path / "tok"), None, 256)) as front:
        c = openai.OpenAI(base_url=front.base + "/v1", api_key="none", max_retries=0)
        r = c.completions.create(model="tiny", prompt="hi", max_tokens=5, logprobs=1,
                                 extra_body={"return_token_ids": True})
        ch = r.choices[0]
        assert ch.text == a * 2 and ch.finish_reason == "stop" and _extra(ch, "token_ids") == [65, 65, eot]
        assert ch.logprobs.tokens == [a, a, end] and ch.logprobs.token_logprobs == [-0.5, -0.5, -0.25]
        assert ch.logprobs.text_offset == [0, 1, 2] and ch.logprobs.top_logprobs[-1] == {end: -0.25}
        assert r.usage.completion_tokens == 3
        parts = list(c.completions.create(model="tiny", prompt="hi", max_tokens=5, logprobs=1, stream=True,
                                          stream_options={"include_usage": True}))
        done = [p for p in parts if p.choices]
        assert "".join(p.choices[0].text for p in done) == a * 2 and done[-1].choices[0].finish_reason == "stop"
        assert sum((p.choices[0].logprobs.tokens for p in done), []) == [a, a, end]
        assert sum((p.choices[0].logprobs.token_logprobs for p in done), []) == [-0.5, -0.5, -0.25]
        assert parts[-1].usage.completion_tokens == 3
        msgs = [{"role": "user", "content": "hi"}]
        r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, logprobs=True)
        ch = r.choices[0]
        assert ch.message.content == a * 2 and ch.finish_reason == "stop" and r.usage.completion_tokens == 3
        assert [(x.token, x.logprob) for x in ch.logprobs.content] == [(a, -0.5), (a, -0.5), (end, -0.25)]
        assert ch.logprobs.content[-1].bytes == list(end.encode())
        parts = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, logprobs=True, stream=True,
                                               stream_options={"include_usage": True}))
        done = [p for p in parts if p.choices]
        assert "".join(p.choices[0].delta.content or "" for p in done) == a * 2
        assert done[-1].choices[0].finish_reason == "stop" and parts[-1].usage.completion_tokens == 3
        assert [x.token for p in done if p.choices[0].logprobs for x in p.choices[0].logprobs.content] == \
            [a, a, end]
        # n > 1: each sample keeps its own end token, streamed chunks interleaved by index
        r = c.completions.create(model="tiny", prompt="hi", max_tokens=5, logprobs=1, n=2,
                                 extra_body={"return_token_ids": True})
        assert [(ch.index, ch.text, _extra(ch, "token_ids"), ch.logprobs.tokens, ch.finish_reason)
                for ch in r.choices] == [(i, a * 2, [65, 65, eot], [a, a, end], "stop") for i in range(2)]
        assert r.usage.completion_tokens == 6
        parts = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, logprobs=True, n=2,
                                               stream=True, stream_options={"include_usage": True}))
        for i in range(2):
            mine = [p.choices[0] for p in parts if p.choices and p.choices[0].index == i]
            assert "".join(x.delta.content or "" for x in mine) == a * 2 and mine[-1].finish_reason == "stop"
            assert [x.token for m in mine if m.logprobs for x in m.logprobs.content] == [a, a, end]
        assert parts[-1].usage.completion_tokens == 6


def test_echo_scores_a_full_context_prompt_with_max_tokens_0_and_refuses_one_longer():
    """Tester: a prompt of the whole context (64 tokens) with echo, max_tokens 0 and logprobs
    was 400 "leaving no room for output" though no output is asked for. It is scored (every
    position is inside the context; the token the engine draws is dropped, never cached);
    asking for output, or a prompt past the context, is still refused."""
    async def main():
        engines = _FakeEngines(every_s=0)
        app = _front(engines, context=64)

        async def post(body):
            status, raw = await _asgi(app, "POST", "/v1/completions", json.dumps(body).encode())
            return status, json.loads(raw)

        for prompt in ([104] * 64, "h" * 64):           # ids, and a text of 64 byte tokens
            status, r = await post({"prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 1})
            assert status == 200, r
            lp = r["choices"][0]["logprobs"]
            assert len(lp["tokens"]) == 64 and lp["token_logprobs"][0] is None and lp["token_logprobs"][1] == -1.0
            assert r["usage"] == {"prompt_tokens": 64, "completion_tokens": 0, "total_tokens": 64}
            assert r["choices"][0]["text"] == "h" * 64
        for body in ({"prompt": [104] * 64, "max_tokens": 1}, {"prompt": [104] * 64},
                     {"prompt": [104] * 64, "echo": True, "logprobs": 1},
                     {"prompt": [104] * 65, "echo": True, "max_tokens": 0, "logprobs": 1},
                     {"prompt": "h" * 65, "echo": True, "max_tokens": 0, "logprobs": 1}):
            status, r = await post(body)
            assert status == 400 and r["error"]["code"] == "context_length_exceeded", (body, r)
            assert "context is 64 tokens" in r["error"]["message"]
        status, r = await post({"prompt": [104] * 65, "echo": True, "max_tokens": 0, "logprobs": 1})
        assert "no room for output" not in r["error"]["message"] and "65 tokens" in r["error"]["message"], r
        for t in engines.tasks:
            t.cancel()

    asyncio.run(main())


def test_union_fields_say_what_they_take_and_chat_roles_are_openais():
    """Tester: `prompt: [1.5]` said "`prompt.str`: Input should be a valid string" (pydantic's
    first union branch); the message names what is wrong with the value. Chat roles are
    OpenAI's (openai.types.chat.ChatCompletionMessageParam): "wizard" is 400, not 200."""
    async def main():
        engines = _FakeEngines(every_s=0)
        app = _front(engines)

        async def post(body, path="/v1/completions"):
            status, raw = await _asgi(app, "POST", path, json.dumps(body).encode())
            return status, json.loads(raw)

        for prompt in ([1.5], [True, False], [[104, 2.0]], [104, True]):
            status, r = await post({"prompt": prompt, "max_tokens": 1})
            assert status == 400 and r["error"]["param"] == "prompt", r
            assert r["error"]["message"].startswith("`prompt`: token ids must be integers"), r
            assert ".str" not in r["error"]["message"]
        status, r = await post({"prompt": ["a", 104], "max_tokens": 1})
        assert status == 400 and r["error"]["message"].startswith("`prompt`: must be a string, a list of token ids"), r
        status, r = await post({"prompt": "hi", "max_tokens": 1, "stop": [1]})
        assert status == 400 and r["error"]["param"] == "stop", r
        assert r["error"]["message"].startswith("`stop`: must be a string or a list of strings"), r
        chat = lambda messages: post({"messages": messages, "max_tokens": 1}, "/v1/chat/completions")
        status, r = await chat([{"role": "user", "content": 5}])
        assert status == 400 and r["error"]["param"] == "messages", r
        assert r["error"]["message"].startswith("`messages.0.content`: must be a string, a list of content parts"), r
        status, r = await chat([{"role": "wizard", "content": "hi"}])
        assert status == 400 and r["error"]["param"] == "messages" and "messages.0.role" in r["error"]["message"], r
        assert "'user'" in r["error"]["message"] and "wizard" in r["error"]["message"]
        for role in ("system", "developer", "user"):
            status, r = await chat([{"role": role, "content": "hi"}])
            assert status == 200, (role, r)
        for t in engines.tasks:
            t.cancel()

    asyncio.run(main())


def test_a_chat_template_that_never_ends_is_a_500_and_the_server_keeps_serving(monkeypatch):
    """Issue 51: a tokenizer_config.json template that loops for hours pinned every worker
    thread; every request hung and the server ignored SIGINT and SIGTERM. It renders in a
    child process now, killed at the time limit: a 500 naming the template, and completions
    answered while chats time out."""
    import parcompile.server.chat_template as ct

    monkeypatch.setattr(ct, "TEMPLATE_TIMEOUT_S", 1.0)
    slow = "{% for a in messages[0].content %}{% for b in messages[0].content %}{% endfor %}{% endfor %}x"

    async def main():
        engines = _FakeEngines(every_s=0)
        app = _front(engines, slow)
        chat = json.dumps({"messages": [{"role": "user", "content": "y" * 100_000}], "max_tokens": 1}).encode()
        chats = [asyncio.ensure_future(_asgi(app, "POST", "/v1/chat/completions", chat, timeout_s=30))
                 for _ in range(3)]
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        code, raw = await _asgi(app, "POST", "/v1/completions",
                                json.dumps({"prompt": "hi", "max_tokens": 1}).encode())
        assert code == 200 and time.monotonic() - t0 < 5, raw
        for code, raw in await asyncio.gather(*chats):
            err = json.loads(raw)["error"]
            assert code == 500 and "did not finish rendering in 1 s" in err["message"], raw
            assert err["code"] == "chat_template_timeout"
        fast = json.dumps({"messages": [{"role": "user", "content": "y"}], "max_tokens": 1}).encode()
        code, raw = await _asgi(app, "POST", "/v1/chat/completions", fast, timeout_s=30)
        assert code == 200, raw             # a short content renders: a new child, the same template
        for t in engines.tasks:
            t.cancel()

    asyncio.run(main())


def test_a_chat_template_that_renders_a_huge_prompt_is_refused_in_its_child():
    """A template can render hundreds of megabytes within its time (``{{ "x" * 3 * 10**8 }}``:
    300 MB sent to the server, 900 MB at its peak, then tokenized); a rendered prompt over the
    body limit (max_body, a whole context with room) is a 400 from the child, and the next
    request is served."""
    big = '{% if messages[0].content == "big" %}{{ "x" * 5000000 }}{% else %}{{ messages[0].content }}{% endif %}'

    async def main():
        engines = _FakeEngines(every_s=0)
        app = _front(engines, big, max_body=1 << 20)
        answers = {}
        for content in ("big", "y"):
            body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 1}).encode()
            answers[content] = await _asgi(app, "POST", "/v1/chat/completions", body, timeout_s=30)
        code, raw = answers["big"]
        assert code == 400 and "the rendered prompt has 5,000,000 characters, over the 1,048,576" in \
            json.loads(raw)["error"]["message"], raw
        assert answers["y"][0] == 200, answers["y"]
        for t in engines.tasks:
            t.cancel()

    asyncio.run(main())


def test_the_chat_template_child_runs_no_unguarded_script_again_and_outlives_a_kill(tmp_path):
    """The renderer's child loads chat_template.py alone: multiprocessing's ``spawn`` re-ran
    the parent's ``__main__``, so a script that builds the server without an ``if __name__``
    guard ran again in the child (a second server) and every chat answered 500. A child
    killed from outside mid-render is a TemplateTimeout and the next render starts a new one."""
    script = tmp_path / "unguarded.py"
    script.write_text("from parcompile.server.chat_template import TemplateRenderer\n"
                      "print('top level ran')\n"
                      "r = TemplateRenderer('{{ messages[0].content }}!')\n"
                      "print(r.render([{'role': 'user', 'content': 'hi'}]))\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert (run.returncode, run.stdout) == (0, "top level ran\nhi!\n"), run.stderr

    from parcompile.server.chat_template import TemplateRenderer, TemplateTimeout

    slow = "{% for a in messages[0].content %}{% for b in messages[0].content %}{% endfor %}{% endfor %}x"
    r = TemplateRenderer("{% if messages[0].role == 'slow' %}" + slow + "{% else %}ok{% endif %}", timeout_s=30)
    try:
        assert r.render([{"role": "user", "content": ""}]) == "ok"
        first = r._proc.pid
        threading.Timer(0.5, os.kill, (first, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(TemplateTimeout, match="renderer stopped"):
            r.render([{"role": "slow", "content": "y" * 100_000}])
        assert time.monotonic() - t0 < 10
        assert r.render([{"role": "user", "content": ""}]) == "ok" and r._proc.pid != first
    finally:
        r.close()
