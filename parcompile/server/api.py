"""The OpenAI-compatible HTTP API of `parcompile serve` (SPEC 4), on FastAPI, as vLLM's
``vllm.entrypoints.openai.api_server``: ``POST /v1/completions``, ``POST
/v1/chat/completions`` (``"stream": true``: server-sent events of OpenAI's chunk objects,
ended by ``data: [DONE]``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(Prometheus text).

Requests. ``prompt`` is a string, a list of token ids, or a list of either (a batch: one
choice per prompt, ``index`` in prompt order); ``messages`` go through the tokenizer's chat
template (``chat_template`` of the weights' ``tokenizer_config.json``, rendered with jinja2
as transformers does); a model without one (the byte-level models) uses
:data:`PLAIN_CHAT_TEMPLATE`: one ``role: content`` line per message, then ``assistant:``.
Omitted sampling fields take the spec's ``serve`` values (``temperature``, ``top_k``);
``top_p`` defaults to 1, ``max_tokens`` to the room left in the context (``prompt_len +
max_new_tokens`` of the spec, vLLM's default), ``seed`` to a random one (with ``n`` > 1,
sample j draws with ``seed + j``). ``stop`` (a string or up to 4) ends the text before the
first match (``finish_reason: "stop"``), as do the model's end tokens; ``max_tokens`` ends
it with ``"length"``. ``n`` samples per prompt (choice ``index`` = prompt * n + sample);
completions' ``best_of`` draws that many and returns the ``n`` of the highest summed
logprob (not streamed); ``n`` and ``best_of`` are at most the sequences a replica decodes at
once (:attr:`ModelInfo.max_seqs`), prompts x samples at most :data:`MAX_SEQUENCES`.

Logprobs (fp32 log-softmax of the model's full-vocabulary logits, before temperature and
top-k/top-p, as vLLM's ``raw_logprobs``; :mod:`parcompile.runtime.paged`): completions'
``logprobs: k`` (0 to :data:`MAX_LOGPROBS`) gives each choice OpenAI's legacy object as
vLLM returns it, ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` (a
top-logprobs dict holds the k likeliest tokens' texts and the chosen one's); with
``"echo": true`` the text and the logprobs begin with the prompt's (the first prompt token's
logprob and top are null), and ``max_tokens`` may be 0 (the prompt only, which may then fill
the whole context). Chat's ``"logprobs": true`` with ``top_logprobs`` (0 to :data:`MAX_LOGPROBS`) gives
``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``. Extension (vLLM's):
``"return_token_ids": true`` adds ``prompt_token_ids`` and ``token_ids`` to each choice.

Errors are OpenAI's object ``{"error": {"message", "type", "param", "code"}}``: 400 for
malformed JSON, a field of the wrong type or value, an empty prompt, a prompt or
``max_tokens`` beyond the context (the message gives the limits), a field this server does
not implement (:data:`UNSUPPORTED`: ``suffix``, penalties, ``tools``, chat's ``echo``...) set to
anything but its neutral value, a body that is not JSON text (NaN, nesting deeper than
:data:`MAX_JSON_DEPTH`, a lone surrogate); 401 without the ``--api-key`` (:class:`Guard`);
413 for a body past ``--max-body`` (:func:`default_max_body`); 404 for another model or
path; 500 (``non_finite_logits``) for a request whose logits came out NaN or infinite (the
server goes on); 503 once a rank has died (the server then exits non-zero). ``logprobs`` /
``top_logprobs`` above :data:`MAX_LOGPROBS`, ``n`` or ``best_of`` above the batch, ``best_of``
< ``n`` or streamed, ``max_tokens`` 0 without ``echo`` are 400. A client that goes away, while its plain request is
being generated or its stream waits for a first token, has its request aborted within
:data:`DISCONNECT_POLL_S` seconds (its KV blocks are freed).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from parcompile.runtime.generate import ServeError
from parcompile.server.engines import EngineFailed
from parcompile.server.sse import EventStream, OneStream, as_api_error, dumps, event_batches, json_str, sse
from parcompile.server.text import IncrementalText
# the request side (models, errors, limits, Guard) lives in protocol.py; its names stay importable from here
from parcompile.server.protocol import (BODY_BYTES_PER_TOKEN, DISCONNECT_POLL_S, MAX_JSON_DEPTH, MAX_LOGPROBS,
                                        MAX_SEQUENCES, MIN_BODY_BYTES, PLAIN_CHAT_TEMPLATE, SAMPLING_EPS,
                                        THREAD_PARSE_BYTES, UNSUPPORTED, ApiError, ChatRequest, CompletionRequest,
                                        Guard, Message, ModelInfo, StreamOptions, default_max_body, load_json,
                                        unavailable, validation_message)

__all__ = ["build_app", "Handlers", "ApiError", "ChatRequest", "CompletionRequest", "Guard", "Message", "ModelInfo",
           "StreamOptions", "default_max_body", "unavailable", "PLAIN_CHAT_TEMPLATE", "SAMPLING_EPS",
           "DISCONNECT_POLL_S", "BODY_BYTES_PER_TOKEN", "MIN_BODY_BYTES", "MAX_JSON_DEPTH", "THREAD_PARSE_BYTES",
           "UNSUPPORTED", "MAX_LOGPROBS", "MAX_SEQUENCES"]



def build_app(info: ModelInfo, engines, metrics, api_key: str | None = None, max_body: int | None = None) -> FastAPI:
    """The FastAPI application over ``engines`` (:class:`parcompile.server.engines.Engines`),
    recording into ``metrics`` (:class:`parcompile.server.metrics.Metrics`); ``api_key`` and
    ``max_body`` (bytes; default :func:`default_max_body` of the context) as :class:`Guard`.
    The requests are answered by :class:`Handlers`; errors in OpenAI's form
    (:func:`add_error_handlers`), the routes by :func:`add_routes`."""
    app = FastAPI(title=f"parcompile serve: {info.name}", docs_url=None, redoc_url=None)
    max_body = default_max_body(info.context) if max_body is None else max_body
    app.add_middleware(Guard, api_key=api_key, max_body=max_body)
    add_error_handlers(app)
    add_routes(app, Handlers(info, engines, metrics, max_body))
    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's object: an :class:`ApiError` as itself, an unknown path or
    method with its HTTP status, a bug as 500 ``internal_error`` (its traceback in the log)."""

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return e.response()

    @app.exception_handler(Exception)
    async def _bug(request, e: Exception):         # a bug: still OpenAI's form (and the traceback in the log)
        return ApiError(500, f"internal error: {type(e).__name__}: {e}"[:300], code="internal_error",
                        kind="server_error").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):   # an unknown path, a wrong method
        return ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                        code="not_found" if e.status_code == 404 else None).response()


def add_routes(app: FastAPI, h: "Handlers") -> None:
    """``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET
    /health`` and ``GET /metrics`` over the handlers ``h``."""

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await h.parse(request, CompletionRequest)
        return await h.respond(request, req, await h.encode(req.prompt), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await h.parse(request, ChatRequest)
        # the template and the tokenizer run off the event loop
        return await h.respond(request, req, [await asyncio.to_thread(h.chat_ids, req)], chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": h.info.name, "object": "model", "created": 0,
                                            "owned_by": "parcompile", "max_model_len": h.info.context}]}

    @app.get("/health")
    async def health():
        if h.engines.failed:
            return unavailable(h.engines.failed).response()
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def prometheus():
        body, content_type = h.metrics.render(h.engines.totals())
        return PlainTextResponse(body, media_type=content_type)


def chat_environment():
    """The jinja2 sandbox chat templates render in, with the globals transformers'
    ``apply_chat_template`` gives them (chat_template_utils.py): ``raise_exception`` (what a
    template calls on messages it refuses) and ``strftime_now``."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: time.strftime(fmt, time.localtime()))
    return env


def _non_finite_logits() -> ApiError:
    """500 for a request whose logits came out NaN or infinite (the server goes on)."""
    return ApiError(500, "the model produced NaN or infinite logits for this request (its weights "
                         "or activations overflow in the serve dtype); no token could be drawn",
                    code="non_finite_logits", kind="server_error")


#: what :meth:`Handlers.watch_client` puts on a request's token queue when its client went away
_CLIENT_GONE = object()


def _usage(n_prompt: int, n_out: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def _prompt_entries(p: list[int], plps) -> list:
    """The prompt's logprob entries: its first token without one, then ``plps`` per token."""
    out = [(p[0], None, None)]
    if plps is not None:
        out += [(tok, lp, top) for tok, (lp, top) in zip(p[1:], plps)]
    return out


@dataclass
class _Reply:
    """One request being answered (:meth:`Handlers.respond`): the request, its prompts'
    token ids, chat or completion, samples per prompt (``best_of`` or ``n``), each prompt's
    sampling parameters, echo, logprobs asked (``k`` alternatives; ``want_lp``), the object
    name and the fields every answer object starts with (``base``), the engine jobs
    ``(prompt index, prompt ids, parameters)`` in choice order, and a streamed chunk's
    constant beginning (``head``)."""

    req: Any
    prompts: list
    chat: bool
    samples: int
    base_params: list
    echo: bool
    k: Any
    want_lp: bool
    obj: str
    base: dict
    jobs: list = field(default_factory=list)
    head: str = ""          # a streamed chunk's event up to its choice's index (:meth:`Handlers.chunk`)
    heads: list = field(default_factory=list)   # per job: ``head``, its choice's index and a comma


class Handlers:
    """What the routes of :func:`build_app` do for one model (``info``, :class:`ModelInfo`)
    over its ``engines``, recording into ``metrics``: read and check a request
    (:meth:`parse`, :meth:`encode`, :meth:`sampling`), run it (:meth:`generate`) and answer
    it, plain or streamed (:meth:`respond`)."""

    def __init__(self, info: ModelInfo, engines, metrics, max_body: int):
        self.info, self.engines, self.metrics, self.max_body = info, engines, metrics, max_body
        self.chat_template = chat_environment().from_string(info.chat_template)
        # engine request ids: a random prefix per front and a count (issue 33: no uuid4 per request)
        self.rid_prefix, self.rids = secrets.token_hex(6) + "-", itertools.count()

    async def read_body(self, request: Request) -> bytes:
        """The body, refused with 413 past ``max_body`` bytes (a Content-Length above it is
        refused by :class:`Guard` before any byte is read; this counts a chunked one)."""
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body:
                    raise ApiError(413, f"the request body exceeds {self.max_body:,} bytes (`parcompile serve --max-body`)",
                                   code="request_too_large")
                chunks.append(chunk)
        except ClientDisconnect:     # gone before its body ended: nobody reads the answer (no traceback)
            raise ApiError(400, "the client disconnected before the end of its body", code="client_disconnected") \
                from None
        return b"".join(chunks)

    async def parse(self, request: Request, model_cls):
        """The request's body as ``model_cls``, checked: 400 for a field of the wrong type or
        value, an unsupported field set, inconsistent ``n`` / ``best_of`` / ``stream`` /
        ``max_tokens`` / logprobs; 404 for another model."""
        raw = await self.read_body(request)
        if len(raw) > THREAD_PARSE_BYTES:
            body = await asyncio.to_thread(load_json, raw)
        else:
            body = load_json(raw)
        try:
            req = model_cls.model_validate(body)
        except ValidationError as e:
            message, param = validation_message(e)
            raise ApiError(400, message, param=param, code="invalid_value") from None
        for key, neutral in UNSUPPORTED.items():
            if key in model_cls.model_fields:
                continue
            value = body.get(key)
            if not any(value is v if isinstance(value, bool) or isinstance(v, bool) or v is None else value == v
                       for v in neutral):
                raise ApiError(400, f"`{key}` is not supported by this server (got {json.dumps(value)[:80]}); "
                                    f"omit it", param=key, code="unsupported_parameter")
        if req.stream_options is not None and not req.stream:
            raise ApiError(400, "`stream_options` can only be given with `\"stream\": true`", param="stream_options",
                           code="invalid_value")
        samples = getattr(req, "best_of", None) or req.n
        if samples < req.n:
            raise ApiError(400, f"`best_of` ({samples}) must be at least `n` ({req.n})", param="best_of",
                           code="invalid_value")
        if req.stream and samples > req.n:
            raise ApiError(400, "`best_of` > `n` cannot be streamed (the best are known at the end)", param="best_of",
                           code="invalid_value")
        if self.info.max_seqs and samples > self.info.max_seqs:
            name = "best_of" if samples > req.n else "n"
            raise ApiError(400, f"`{name}` is {samples}; this server decodes at most {self.info.max_seqs} sequences at once "
                                f"per replica (the spec's serve `batch` over its dp replicas), so a prompt's samples "
                                f"are at most that", param=name, code="invalid_value")
        if req.max_tokens == 0 and not getattr(req, "echo", False):
            scores = " or `\"echo\": true` (the prompt's logprobs)" if "echo" in model_cls.model_fields else ""
            raise ApiError(400, f"`max_tokens` 0 asks for no output: ask for at least 1 token{scores}",
                           param="max_tokens", code="invalid_value")
        if req.max_tokens == 0 and req.stream:
            raise ApiError(400, "`max_tokens` 0 (the prompt's logprobs only) is not streamed", param="max_tokens",
                           code="invalid_value")
        if isinstance(req, ChatRequest) and req.top_logprobs and not req.logprobs:
            raise ApiError(400, "`top_logprobs` needs `\"logprobs\": true`", param="top_logprobs",
                           code="invalid_value")
        if req.model is not None and req.model != self.info.name:
            raise ApiError(404, f"the model `{req.model}` does not exist; this server serves `{self.info.name}`",
                           param="model", code="model_not_found")
        return req

    def too_long(self, n_tokens: int, param: str, at_least: bool = False) -> ApiError:
        """400 ``context_length_exceeded``: a prompt of ``n_tokens`` is longer than the context,
        or fills it while output is asked for."""
        what = "more than the context holds" if n_tokens > self.info.context else "leaving no room for output"
        return ApiError(400, f"this model's context is {self.info.context} tokens (prompt_len + max_new_tokens); the prompt "
                             f"has {'at least ' if at_least else ''}{n_tokens} tokens, {what}",
                        param=param, code="context_length_exceeded")

    def encode_sync(self, prompt, param: str) -> list[int]:
        """Token ids of one ``prompt`` (a string, or ids), checked against the vocabulary and
        the context (at most ``context`` tokens: a prompt that fills it is only scored, echo
        with ``max_tokens`` 0, :meth:`sampling` decides); a text that cannot fit by its bytes
        alone is refused untokenized."""
        if isinstance(prompt, str):
            per_token = getattr(self.info.tokenizer, "max_token_bytes", None)
            if per_token:
                least = -(-len(prompt.encode("utf-8", "surrogatepass")) // per_token)
                if least > self.info.context:
                    raise self.too_long(least, param, at_least=True)
            try:
                ids = self.info.tokenizer.encode(prompt)
            except ServeError as e:      # a model without a tokenizer: ids only
                raise ApiError(400, str(e), param=param) from None
        else:
            ids = list(prompt)
        if not ids:
            raise ApiError(400, "the prompt is empty", param=param, code="empty_prompt")
        if len(ids) > self.info.context:
            raise self.too_long(len(ids), param)
        bad = [i for i in ids if not 0 <= i < self.info.vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, {self.info.vocab})", param=param)
        return ids

    async def encode(self, prompt, param: str = "prompt") -> list[list[int]]:
        """The token ids of each prompt of a completion request's ``prompt``: a string,
        token ids, or a list of either (OpenAI's batch); :func:`encode_sync` off the event
        loop for texts (tokenizing a long one takes time that /health and the streams must
        not wait for)."""
        many = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
        prompts = prompt if many else [prompt]
        if len(prompts) > MAX_SEQUENCES:
            raise ApiError(400, f"{len(prompts)} prompts in one request; this server takes at most {MAX_SEQUENCES}",
                           param=param, code="invalid_value")
        if any(isinstance(p, str) for p in prompts):
            return await asyncio.to_thread(lambda: [self.encode_sync(p, param) for p in prompts])
        return [self.encode_sync(p, param) for p in prompts]

    def sampling(self, req: CompletionRequest | ChatRequest, n_prompt: int, param: str) -> dict:
        """What reaches the ranks for one sequence of ``req`` whose prompt has ``n_prompt``
        tokens (values made safe here); ``want`` (the tokens asked for: 0 with echo) is
        taken out by :func:`respond` (the engine makes at least one).

        A prompt may fill the context only when no output is asked for (``max_tokens`` 0,
        echo): its positions are all inside the context, and the one token the engine draws
        after it is dropped, never cached (vLLM v1 refuses such a prompt for every generate
        request, ``_validate_prompt_len``, since its engine reserves that token's slot)."""
        room = self.info.context - n_prompt
        if room < 1 and req.max_tokens != 0:
            raise self.too_long(n_prompt, param)
        max_tokens = req.max_tokens if req.max_tokens is not None else (req.max_completion_tokens or room)
        if max_tokens > room:
            raise ApiError(400, f"this model's context is {self.info.context} tokens (prompt_len + max_new_tokens); "
                                f"the prompt has {n_prompt} tokens and max_tokens is {max_tokens}: at most "
                                f"{room} new tokens fit", param="max_tokens", code="context_length_exceeded")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > 4 or any(not s for s in stop):
            raise ApiError(400, "`stop` takes up to 4 non-empty strings", param="stop")
        # what reaches the ranks is made safe here (the sampler keeps the likeliest token too):
        # top_k in [0, vocab] (0: all), temperature 0 (greedy) or >= SAMPLING_EPS, top_p in
        # [SAMPLING_EPS, 1] (1e-46 is 0 in float32: every token would be masked), seed in [0, 2**63)
        top_k = self.info.top_k if req.top_k is None else req.top_k
        top_k = 0 if top_k < 0 or top_k >= self.info.vocab else int(top_k)
        temperature = self.info.temperature if req.temperature is None else req.temperature
        if temperature < SAMPLING_EPS:    # logits / 1e-300 overflow to inf: NaN probabilities kill the rank
            temperature = 0.0
        top_p = 1.0 if req.top_p is None else min(max(float(req.top_p), SAMPLING_EPS), 1.0)
        # logprobs: k alternatives per token (None: none); echo: the prompt's too
        if isinstance(req, ChatRequest):
            k, prompt_lp = (req.top_logprobs or 0) if req.logprobs else None, False
        else:
            k = req.logprobs
            prompt_lp = bool(req.echo) and k is not None
            if (req.best_of or 1) > req.n and k is None:
                k = 0                     # best_of ranks the samples by their summed logprobs
        return {"max_tokens": max(int(max_tokens), 1), "temperature": float(temperature), "top_k": top_k,
                "top_p": top_p, "seed": secrets.randbits(62) if req.seed is None else req.seed % (1 << 63),
                "eos": self.info.eos, "stop": stop, "logprobs": k, "prompt_logprobs": prompt_lp,
                "want": int(max_tokens)}

    async def generate(self, request: Request, prompt: list[int], params: dict, watch: str):
        """Yield (text delta, token ids so far, finish_reason, their logprobs so far, the
        prompt's logprobs) as tokens arrive; the request is cancelled in the engine when the
        client goes away or a stop string matches. The text is
        :class:`parcompile.server.text.IncrementalText`'s: final text only (an unfinished
        character, and the last characters that may begin a stop string, wait), stop strings
        searched in the new text. Logprobs are the engine's entries
        (:func:`parcompile.runtime.paged.unpack_logprobs`), one per token id (an empty list
        when the request asked for none). Tokens that arrived together (the reader fell
        behind the engine's steps) are taken together: one yield for all of them, as
        vLLM's output collector merges a lagging request's outputs.

        ``watch``: "all" polls the connection every :data:`DISCONNECT_POLL_S` seconds while
        tokens arrive (a plain response: nothing is written until the end); "first" until
        the first token only (a stream: once it is writing, Starlette cancels it when the
        client goes away). The polling is a task beside the request's (:meth:`watch_client`),
        so that a token costs one queue wake-up, not a timer and a task."""
        rid = f"{self.rid_prefix}{next(self.rids)}"      # unique in this front (no uuid4 per request)
        params = dict(params)
        text = IncrementalText(self.info.tokenizer.decode, params.pop("stop"))
        stop = text.stop
        params.pop("want", None)
        t0 = time.perf_counter()
        try:
            q = self.engines.submit(rid, prompt, params)
        except EngineFailed as e:
            raise unavailable(str(e)) from None
        self.metrics.request_started(len(prompt))
        watcher = asyncio.ensure_future(self.watch_client(request, q))
        eos = self.info.eos
        ids: list[int] = []
        lps: list = []
        prompt_lps = None
        last = None
        finished = False
        try:
            while True:
                items = [await q.get()]
                while not stop and not q.empty():   # with stop strings, token by token (where one ends)
                    items.append(q.get_nowait())
                reason = None
                n_tokens = 0
                for item in items:
                    if type(item) is not tuple:
                        if item is _CLIENT_GONE:
                            return           # the finally aborts it: its blocks are freed
                        if isinstance(item, EngineFailed):
                            raise unavailable(str(item))
                    tok, reason = item[0], item[1]
                    lp = item[2] if len(item) > 2 else None
                    if reason == "error":    # its logits were NaN or inf: this request fails, the server lives
                        finished = True
                        self.metrics.request_finished("abort", len(ids))
                        raise _non_finite_logits()
                    n_tokens += 1
                    if lp is not None and "prompt" in lp:
                        prompt_lps = lp["prompt"]
                    if not (reason == "stop" and tok in eos):      # the end token is not text
                        ids.append(tok)
                        if lp is not None:
                            lps.append((lp["lp"], lp["top"]))
                    if reason is not None:
                        break            # nothing comes after a finish
                now = time.perf_counter()     # the batch's tokens arrived together: one clock read
                self.metrics.tokens(n_tokens, now - (t0 if last is None else last), first=last is None)
                last = now
                if watch == "first" and watcher is not None:
                    watcher.cancel()     # a stream is writing: Starlette watches the client from now on
                    watcher = None
                new = text.step(ids, final=reason is not None)
                if stop and new:        # only the new text can complete a stop string (also on the last token)
                    hit = text.find_stop(len(new))
                    if hit >= 0:
                        text.cut(hit)
                        if reason is None:
                            self.engines.abort(rid)
                        reason = "stop"
                delta = text.release(reason is not None)
                if reason is None:
                    if delta:
                        yield delta, ids, None, lps, prompt_lps
                    continue
                finished = True
                self.metrics.request_finished(reason, len(ids))
                yield delta, ids, reason, lps, prompt_lps
                return
        finally:
            if watcher is not None:
                watcher.cancel()
            if not finished:
                self.engines.abort(rid)
                self.metrics.request_finished("abort", len(ids))

    @staticmethod
    async def watch_client(request: Request, q) -> None:
        """Every :data:`DISCONNECT_POLL_S` seconds, whether the client of ``request`` went
        away; then :data:`_CLIENT_GONE` on its token queue ``q`` (:meth:`generate` aborts it).
        Cancelled when the request ends (or a stream starts writing)."""
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await request.is_disconnected():
                q.put_nowait(_CLIENT_GONE)
                return

    def token_text(self, tok: int) -> str:
        """One token's text."""
        return self.info.tokenizer.decode([tok])

    def completion_logprobs(self, entries: list[tuple[int, float | None, list | None]], k: int, offset: int = 0) -> dict:
        """OpenAI's legacy completion logprobs as vLLM returns them: ``tokens`` (each
        token's text), ``token_logprobs``, ``top_logprobs`` (per token a dict of its ``k``
        likeliest tokens' texts and the chosen one's to their logprobs; None where the
        token has no logprob: the first prompt token) and ``text_offset`` (each token's
        character offset, counted from ``offset``). ``entries``: (token id, logprob, top
        (id, logprob) pairs)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tok, lp, top in entries:
            t = self.token_text(tok)
            out["tokens"].append(t)
            out["token_logprobs"].append(lp)
            if lp is None:
                out["top_logprobs"].append(None)
            else:
                d = {self.token_text(i): v for i, v in top[:k]}
                d.setdefault(t, lp)
                out["top_logprobs"].append(d)
            out["text_offset"].append(offset)
            offset += len(t)
        return out

    def chat_logprobs(self, ids: list[int], lps: list, k: int) -> dict:
        """OpenAI's chat ``logprobs``: per token its text, logprob, UTF-8 bytes and its ``k``
        likeliest alternatives (``top_logprobs``)."""
        def one(tok, lp):
            t = self.token_text(tok)
            return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8", "surrogatepass"))}
        return {"content": [{**one(tok, lp), "top_logprobs": [one(i, v) for i, v in top[:k]]}
                            for tok, (lp, top) in zip(ids, lps)]}

    async def respond(self, request: Request, req: CompletionRequest | ChatRequest, prompts: list[list[int]],
                      chat: bool):
        """Answer a completion (one choice per prompt and sample, ``index`` prompt-major)
        or a chat completion (``n`` choices), plain (:meth:`respond_plain`) or streamed
        (:meth:`respond_stream`)."""
        param = "messages" if chat else "prompt"
        n = req.n
        samples = (getattr(req, "best_of", None) or n) if not chat else n
        if len(prompts) * samples > MAX_SEQUENCES:
            raise ApiError(400, f"{len(prompts)} prompt(s) x {samples} samples is {len(prompts) * samples} sequences; "
                                f"this server takes at most {MAX_SEQUENCES} in one request", param=param,
                           code="invalid_value")
        base_params = [self.sampling(req, len(p), param) for p in prompts]
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        r = _Reply(req=req, prompts=prompts, chat=chat, samples=samples, base_params=base_params,
                   echo=bool(getattr(req, "echo", False)), k=base_params[0]["logprobs"],
                   want_lp=(req.logprobs is not None) if not chat else bool(req.logprobs),
                   obj="chat.completion" if chat else "text_completion",
                   base={"id": rid, "created": int(time.time()), "model": self.info.name})
        r.head = "data: " + dumps({**r.base, "object": r.obj + ".chunk" if chat else r.obj})[:-1] + \
            ',"choices":[{"index":'
        # one engine request per prompt and sample; a given seed gives sample j the seed + j
        for i, (p, params) in enumerate(zip(prompts, base_params)):
            for j in range(samples):
                r.jobs.append((i, p, dict(params, seed=(params["seed"] + j) % (1 << 63))))
        for idx, (i, _, _) in enumerate(r.jobs):
            r.heads.append(f"{r.head}{idx % samples if chat else i * n + idx % samples},")
        streams = [self.generate(request, p, pj, watch="first" if req.stream else "all") for _, p, pj in r.jobs]
        if not req.stream:
            return await self.respond_plain(r, streams)
        return await self.respond_stream(r, streams)

    def choice_logprobs(self, r: "_Reply", p, ids, lps, plps, with_prompt: bool, offset: int = 0):
        """A choice's ``logprobs`` (None when not asked): chat's, or the completion's (with the
        prompt's first when ``with_prompt``, offsets from ``offset``)."""
        if not r.want_lp:
            return None
        if r.chat:
            return self.chat_logprobs(ids, lps, r.k or 0)
        entries = (_prompt_entries(p, plps) if with_prompt else []) + [
            (tok, lp, top) for tok, (lp, top) in zip(ids, lps)]
        return self.completion_logprobs(entries, r.k or 0, offset)

    async def respond_plain(self, r: "_Reply", streams: list):
        """The whole answer as one JSON object once every sequence has ended (best_of keeps
        the ``n`` samples of the highest summed logprob); 499 when the client went away."""
        req, prompts, chat, samples, n, echo, base_params = (r.req, r.prompts, r.chat, r.samples, r.req.n, r.echo,
                                                              r.base_params)

        async def run(g):
            text, ids, reason, lps, plps = "", [], None, [], None
            async for delta, ids, reason, lps, plps in g:
                text += delta
            return text, list(ids), reason, list(lps), plps

        if len(streams) == 1:          # one choice: read in this task (no task, no gather)
            results = [await run(streams[0])]
        else:
            tasks = [asyncio.ensure_future(run(g)) for g in streams]
            try:
                results = await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
        if any(res[2] is None for res in results):        # the client went away: nobody reads this
            return JSONResponse({}, status_code=499)
        choices, n_out = [], 0
        for i, p in enumerate(prompts):
            mine = results[i * samples:(i + 1) * samples]
            if samples > n:       # best_of: the n samples of the highest summed logprob
                order = sorted(range(samples), key=lambda j: -sum(lp for lp, _ in mine[j][3]))
                mine = [mine[j] for j in sorted(order[:n])]
            for j, (text, ids, reason, lps, plps) in enumerate(mine):
                if base_params[i]["want"] == 0:       # echo with max_tokens 0: the prompt only
                    text, ids, lps, reason = "", [], [], "length"
                n_out += len(ids)
                if chat:
                    c = {"index": j, "message": {"role": "assistant", "content": text},
                         "logprobs": self.choice_logprobs(r, p, ids, lps, plps, False), "finish_reason": reason}
                else:
                    c = {"index": i * n + j, "text": (self.info.tokenizer.decode(p) + text) if echo else text,
                         "logprobs": self.choice_logprobs(r, p, ids, lps, plps, echo), "finish_reason": reason}
                if req.return_token_ids:
                    c.update(prompt_token_ids=p, token_ids=list(ids))
                choices.append(c)
        return JSONResponse({**r.base, "object": r.obj, "choices": choices,
                             "usage": _usage(sum(map(len, prompts)), n_out)})

    async def respond_stream(self, r: "_Reply", streams: list):
        """Server-sent events: the choices' events (:func:`parcompile.server.sse.event_batches`); the first must
        arrive (or fail) before the 200 status goes out."""
        batches, close = event_batches(streams)
        try:
            first = await batches.__anext__()
        except BaseException:
            await close()
            raise
        if isinstance(first[0][1], ApiError):
            await close()
            raise first[0][1]
        include_usage = bool(r.req.stream_options and r.req.stream_options.include_usage)
        return EventStream(self.events(r, first, batches, close, include_usage))

    def chunk(self, r: "_Reply", idx: int, delta: str, new_ids: list[int], reason, lp_obj, role: bool = False) -> str:
        """One streamed chunk of sequence ``idx`` (chat's ``delta``, or a completion's
        ``text``) as its server-sent event: OpenAI's chunk object, the request's constant
        head (:attr:`_Reply.head`) and this choice's fields, in the order of the object
        ``{**base, "object", "choices": [{"index", "delta" | "text", "logprobs",
        "finish_reason"[, "token_ids"]}]}`` written by :data:`parcompile.server.sse.dumps`."""
        if r.chat:
            body = ('"delta":{"role":"assistant","content":' + json_str(delta) + "}" if role else
                    '"delta":{"content":' + json_str(delta) + "}" if delta else '"delta":{}')
        else:
            body = '"text":' + json_str(delta)
        return (r.heads[idx] + body + (',"logprobs":null' if lp_obj is None else ',"logprobs":' + dumps(lp_obj))
                + (',"finish_reason":null' if reason is None else ',"finish_reason":' + json_str(reason))
                + (',"token_ids":[' + ",".join(map(str, new_ids)) + "]}]}\n\n" if r.req.return_token_ids else
                   "}]}\n\n"))

    async def events(self, r: "_Reply", first, batches, close, include_usage: bool):
        """The event stream from the ``first`` batch of events on (:func:`parcompile.server.sse.event_batches`),
        then the usage (when asked) and ``data: [DONE]``: one write per batch (the end's
        chunks, usage and ``[DONE]`` together); a rank's error ends it as the last event.
        Closes the choices' generators at the end (``close``). One choice
        (:class:`parcompile.server.sse.OneStream`) is read here directly: no generator between
        its tokens and the response."""
        jobs, chat, want_lp, echo, k, prompts, base, obj = (r.jobs, r.chat, r.want_lp, r.echo, r.k, r.prompts, r.base,
                                                            r.obj)
        one = batches.next if isinstance(batches, OneStream) else None
        n_ids = [0] * len(jobs)
        offsets = [0] * len(jobs)
        started = [False] * len(jobs)
        done = [False] * len(jobs)   # finished or ended
        open_ = len(jobs)
        if first[0][1] is None and open_ == 1:
            await close()
            return
        out = [self.chunk(r, idx, "", [], None, None, role=True) for idx in range(len(jobs))] if chat else []
        batch = first
        try:
            while True:
                for idx, ev in batch:
                    if isinstance(ev, ApiError):      # a rank died mid-stream: the error as the last event
                        out.append(sse({"error": {"message": ev.message, "type": ev.kind, "param": None,
                                                   "code": ev.code}}))
                        yield "".join(out)
                        return
                    if ev is None:
                        if not done[idx]:             # ended without a finish (its client went away)
                            done[idx] = True
                            open_ -= 1
                        continue
                    delta, ids, reason, lps, plps = ev
                    new_ids = ids[n_ids[idx]:]
                    lp_obj = None
                    if want_lp:
                        p, new_lps = jobs[idx][1], lps[n_ids[idx]:]
                        if chat:
                            lp_obj = self.chat_logprobs(new_ids, new_lps, k or 0)
                        else:
                            entries = (_prompt_entries(p, plps) if echo and not started[idx] else []) + [
                                (tok, lp, top) for tok, (lp, top) in zip(new_ids, new_lps)]
                            lp_obj = self.completion_logprobs(entries, k or 0, offsets[idx])
                            offsets[idx] += sum(len(t) for t in lp_obj["tokens"])
                    if echo and not started[idx]:
                        delta = self.info.tokenizer.decode(jobs[idx][1]) + delta
                    out.append(self.chunk(r, idx, delta, new_ids, reason, lp_obj))
                    n_ids[idx] = len(ids)
                    started[idx] = True
                    if reason is not None:            # its last event: nothing comes after a finish
                        done[idx] = True
                        open_ -= 1
                if open_ == 0:
                    break
                if out:
                    yield out[0] if len(out) == 1 else "".join(out)
                    out = []
                if one is None:
                    batch = await batches.__anext__()
                    continue
                try:                                  # OneStream.__anext__, inline
                    batch = ((0, await one()),)
                except StopAsyncIteration:
                    batch = ((0, None),)
                except Exception as e:
                    batch = ((0, as_api_error(e)),)
        finally:
            await close()
        if include_usage:
            out.append(sse({**base, "object": obj + ".chunk" if chat else obj, "choices": [],
                             "usage": _usage(sum(map(len, prompts)), sum(n_ids))}))
        out.append("data: [DONE]\n\n")
        yield "".join(out)

    def chat_ids(self, req: ChatRequest) -> list[int]:
        """A chat request's prompt token ids: its messages (text content parts joined) through the
        chat template, then :meth:`encode_sync`."""
        messages = []
        for i, m in enumerate(req.messages):
            content = m.content
            if isinstance(content, list):    # content parts: text ones only (a text-only model)
                texts = []
                for j, part in enumerate(content):
                    where = f"messages.{i}.content.{j}"
                    if part.get("type") != "text":
                        raise ApiError(400, f"`{where}`: only text content parts are supported by this model (got "
                                            f"type {json.dumps(part.get('type'))[:40]})", param="messages",
                                       code="invalid_value")
                    if not isinstance(part.get("text"), str):
                        raise ApiError(400, f"`{where}.text`: a text part's `text` must be a string (got "
                                            f"{json.dumps(part.get('text'), default=str)[:80]})", param="messages",
                                       code="invalid_value")
                    texts.append(part["text"])
                content = "".join(texts)
            messages.append({"role": m.role, "content": content or ""})
        try:
            text = self.chat_template.render(messages=messages, add_generation_prompt=True, **self.info.special)
        except Exception as e:   # a template that rejects these messages (roles out of order)
            raise ApiError(400, f"the chat template rejects these messages: {e}", param="messages") from None
        return self.encode_sync(text, "messages")
