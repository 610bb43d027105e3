"""The streamed answers of `parcompile serve`'s front (issue 33: its CPU per streamed token),
over fake engines, in-process: each server-sent event is OpenAI's chunk object written as
compact JSON (the chunk's text is formatted from a per-request head, so it is compared with
``json.dumps`` of the object built here), tokens that arrive together go out as one chunk
without changing the text, the token ids or the usage (a stop string still ends the ids
where it is completed), and a stream's end (last chunk, usage, ``[DONE]``) is one write."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")

from parcompile.server.engines import TokenQueue  # noqa: E402
from tests.test_server import _asgi, _front  # noqa: E402


class _Burst:
    """Engines' interface: each request gets ``groups`` of token ids, the tokens of a group
    put on its queue together (one engine step the reader fell behind on), the last one
    finishing with "length"."""

    def __init__(self, groups):
        self.groups, self.failed, self.aborted, self.tasks = groups, None, [], []

    def submit(self, rid, prompt, params):
        q = TokenQueue()
        flat = [t for g in self.groups for t in g]

        async def produce():
            i = 0
            for g in self.groups:
                for tok in g:
                    i += 1
                    q.put_nowait((tok, "length" if i == len(flat) else None, None))
                await asyncio.sleep(0.01)

        self.tasks.append(asyncio.get_running_loop().create_task(produce()))
        return q

    def abort(self, rid):
        self.aborted.append(rid)

    def totals(self):
        return {"blocks_used": 0, "blocks_free": 1, "waiting": 0, "running": 0}


def _stream(groups, body, path="/v1/completions"):
    """The events (text after ``data: ``) of one streamed request, and the HTTP body messages' texts."""
    async def main():
        status, raw = await _asgi(_front(_Burst(groups)), "POST", path, json.dumps(dict(body, stream=True)).encode())
        assert status == 200, raw
        return raw.decode()

    raw = asyncio.run(main())
    assert raw.endswith("\n\n")
    return [e[len("data: "):] for e in raw[:-2].split("\n\n")]


def _as_written(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


def test_stream_chunks_are_openais_chunk_objects_as_compact_json():
    # "é" is two bytes (held back until whole), a quote and a backslash need escapes
    text = 'é"\\x'
    groups = [[b] for b in text.encode()]
    events = _stream(groups, {"prompt": "hi", "max_tokens": len(groups), "return_token_ids": True,
                              "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    first = json.loads(events[0])
    head = {"id": first["id"], "created": first["created"], "model": "tiny", "object": "text_completion"}
    assert first["id"].startswith("cmpl-")
    want = [(text[0], [0xC3, 0xA9], None)] + [(c, [ord(c)], None) for c in text[1:]]
    want[-1] = (want[-1][0], want[-1][1], "length")
    for ev, (delta, ids, reason) in zip(events, want):
        assert ev == _as_written({**head, "choices": [{"index": 0, "text": delta, "logprobs": None,
                                                       "finish_reason": reason, "token_ids": ids}]})
    assert events[len(want)] == _as_written({**head, "choices": [], "usage": {
        "prompt_tokens": 2, "completion_tokens": len(groups), "total_tokens": 2 + len(groups)}})
    assert len(events) == len(want) + 2

    events = _stream([[104], [105]], {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
                     "/v1/chat/completions")
    first = json.loads(events[0])
    head = {"id": first["id"], "created": first["created"], "model": "tiny", "object": "chat.completion.chunk"}
    assert first["id"].startswith("chatcmpl-")
    deltas = [{"role": "assistant", "content": ""}, {"content": "h"}, {"content": "i"}]
    assert events[:-1] == [_as_written({**head, "choices": [{"index": 0, "delta": d, "logprobs": None,
                                                             "finish_reason": r}]})
                           for d, r in zip(deltas, [None, None, "length"])]


def test_tokens_that_arrive_together_are_one_chunk_and_a_stop_string_still_ends_the_ids():
    events = _stream([[97], [98, 99, 100], [101]], {"prompt": "hi", "max_tokens": 5, "return_token_ids": True,
                                                    "stream_options": {"include_usage": True}})
    chunks = [json.loads(e)["choices"] for e in events[:-1]]
    assert [(c[0]["text"], c[0]["token_ids"]) for c in chunks[:-1]] == [("a", [97]), ("bcd", [98, 99, 100]),
                                                                        ("e", [101])]
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 5
    # "c" completes the stop string "bc": the text ends before it, the ids and usage at it
    events = _stream([[97], [98, 99, 100], [101]], {"prompt": "hi", "max_tokens": 5, "stop": "bc",
                                                    "return_token_ids": True,
                                                    "stream_options": {"include_usage": True}})
    choices = [c for e in events[:-2] for c in json.loads(e)["choices"]]
    assert "".join(c["text"] for c in choices) == "a" and choices[-1]["finish_reason"] == "stop"
    assert [t for c in choices for t in c["token_ids"]] == [97, 98, 99]
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 3


def test_a_streams_end_is_one_write():
    """The last token's chunk, the usage and ``[DONE]`` go out in one body message (one socket
    write), after one message per earlier chunk."""
    async def bodies():
        app = _front(_Burst([[97], [98]]))
        body = json.dumps({"prompt": "hi", "max_tokens": 2, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        messages, pending = [], [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if pending:
                return pending.pop(0)
            await asyncio.sleep(3600)

        async def send(m):
            messages.append(m)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
                 "scheme": "http", "headers": [(b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
        await asyncio.wait_for(app(scope, receive, send), 10)
        return [m["body"].decode() for m in messages if m["type"] == "http.response.body" and m["body"]]

    writes = asyncio.run(bodies())
    assert len(writes) == 2
    last = writes[-1].split("\n\n")
    assert '"finish_reason":"length"' in last[0] and '"usage"' in last[1] and last[2] == "data: [DONE]"


def test_latency_histograms_count_as_prometheus_clients_histogram():
    """The front's TTFT / TPOT histograms (plain counts, :class:`Latency`) expose the buckets,
    count and sum prometheus_client's ``Histogram`` gives for the same observations (values
    on a bound, between bounds, above all)."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from parcompile.server.metrics import _TPOT_BUCKETS, _TTFT_BUCKETS, Metrics

    values = [0.005, 0.0051, 0.3, 0.0001, 100.0, 1.0, 0.02]

    def samples(text: str, name: str) -> dict:
        out = {}
        for line in text.splitlines():
            if line.startswith(name + "_") and not line.startswith(name + "_created"):
                key, value = line.rsplit(" ", 1)
                labels = dict(kv.split("=") for kv in key[key.index("{") + 1:-1].split(","))
                out[(key[:key.index("{")], labels.get("le"))] = float(value)
        return out

    m = Metrics("tiny")
    for v in values:
        m.token(v, first=True)
        m.token(v, first=False)
    ours = generate_latest(m.registry).decode()
    for name, buckets in (("parcompile_time_to_first_token_seconds", _TTFT_BUCKETS),
                          ("parcompile_time_per_output_token_seconds", _TPOT_BUCKETS)):
        r = CollectorRegistry()
        h = Histogram(name, "x", ["model"], buckets=buckets, registry=r)
        for v in values:
            h.labels("tiny").observe(v)
        want = samples(generate_latest(r).decode(), name)
        assert len(want) == len(buckets) + 3 and samples(ours, name) == want


def test_a_client_leaving_mid_stream_has_its_request_aborted_at_once():
    """A stream's client that goes away after some tokens (``http.disconnect``) ends the
    response and aborts its engine request before the response returns."""
    from tests.test_server import _FakeEngines

    async def main():
        engines = _FakeEngines(every_s=0.02)
        status, raw = await _asgi(_front(engines), "POST", "/v1/completions", json.dumps(
            {"prompt": "hi", "max_tokens": 200, "stream": True}).encode(), disconnect_after_s=0.3)
        aborted, sent = list(engines.aborted), dict(engines.sent)
        for t in engines.tasks:
            t.cancel()
        return status, raw.decode(), aborted, sent

    status, raw, aborted, sent = asyncio.run(main())
    assert status == 200 and "data: [DONE]" not in raw and '"text":"A"' in raw
    assert len(aborted) == 1 and 0 < sent[aborted[0]] < 200


class _RewritingTokenizer:
    """A tokenizer whose decode of more tokens rewrites text of earlier ones, as Hugging
    Face's ``clean_up_tokenization_spaces`` does: "do" " n" "'t" " go" decodes to "don't go",
    while "do" " n" alone decode to "do n" (which a stream has sent by then)."""

    pieces = {100: "do", 101: " n", 102: "'t", 103: " go", 104: "!"}

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids).replace(" n't", "n't")

    def encode(self, text):
        raise AssertionError("the prompts are ids")


def test_a_tokenizer_that_rewrites_sent_text_drops_no_later_text():
    """The rest of a stream whose tokenizer rewrites characters already sent is not dropped
    (it was: every later chunk was empty): what went out stays, each new token adds its own
    text, and the plain answer is the same text."""
    from parcompile.server.api import PLAIN_CHAT_TEMPLATE, ModelInfo, build_app
    from parcompile.server.metrics import Metrics

    groups = [[100], [101], [102], [103], [104]]
    info = ModelInfo(name="tiny", vocab=256, context=512, temperature=0.0, top_k=0, eos=[],
                     tokenizer=_RewritingTokenizer(), chat_template=PLAIN_CHAT_TEMPLATE, special={})

    async def main(stream):
        app = build_app(info, _Burst(groups), Metrics("tiny"))
        return await _asgi(app, "POST", "/v1/completions", json.dumps(
            {"prompt": [1, 2], "max_tokens": len(groups), "stream": stream}).encode())

    status, raw = asyncio.run(main(True))
    assert status == 200
    events = [json.loads(e[len("data: "):]) for e in raw.decode()[:-2].split("\n\n") if e != "data: [DONE]"]
    texts = [e["choices"][0]["text"] for e in events]
    assert texts == ["do", " n", "'t", " go", "!"] and events[-1]["choices"][0]["finish_reason"] == "length"
    status, raw = asyncio.run(main(False))
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == "do n't go!"
