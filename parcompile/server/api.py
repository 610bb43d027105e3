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
logprob and top are null), and ``max_tokens`` may be 0 (the prompt only). Chat's
``"logprobs": true`` with ``top_logprobs`` (0 to :data:`MAX_LOGPROBS`) gives
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
import hashlib
import hmac
import json
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from parcompile.runtime.generate import ServeError
from parcompile.server.engines import EngineFailed

#: the chat template of a tokenizer that has none (a byte-level model): one line per message
PLAIN_CHAT_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                       "{% if add_generation_prompt %}assistant:{% endif %}")


#: temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``, vllm/sampling_params.py)
SAMPLING_EPS = 1e-5

#: seconds between two checks that a waiting client is still connected
DISCONNECT_POLL_S = 0.25

#: the default request body limit: this many bytes per token of the context, and at least
#: :data:`MIN_BODY_BYTES` (a prompt of the whole context, JSON-escaped, fits with room)
BODY_BYTES_PER_TOKEN = 64
MIN_BODY_BYTES = 1 << 20

#: the deepest JSON nesting a request body may have (OpenAI's requests nest a few levels)
MAX_JSON_DEPTH = 64

#: bodies above this many bytes are parsed off the event loop
THREAD_PARSE_BYTES = 1 << 16


def default_max_body(context: int) -> int:
    """The request body limit in bytes for a model of ``context`` tokens
    (:data:`BODY_BYTES_PER_TOKEN` per token, at least :data:`MIN_BODY_BYTES`)."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * context)


class ApiError(Exception):
    """A request the server refuses: HTTP ``status`` and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


def unavailable(reason: str) -> ApiError:
    return ApiError(503, f"the server is unavailable: {reason}", code="service_unavailable", kind="server_error")


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Optional[StrictStr] = None
    max_tokens: Optional[StrictInt] = Field(None, ge=0)      # 0: only with echo (the prompt's logprobs)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1)
    temperature: Optional[StrictFloat] = Field(None, ge=0, le=2)     # OpenAI's "number": "0.5" is refused
    top_p: Optional[StrictFloat] = Field(None, gt=0, le=1)
    top_k: Optional[StrictInt] = Field(None, ge=-1)
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    seed: Optional[StrictInt] = None
    stream: StrictBool = False
    stream_options: Optional["StreamOptions"] = None
    n: StrictInt = Field(1, ge=1)
    return_token_ids: StrictBool = False


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options``: ``include_usage`` adds a last chunk with the usage."""

    model_config = ConfigDict(extra="allow")

    include_usage: Optional[StrictBool] = None


_Sampling.model_rebuild()


#: OpenAI (and vLLM) request fields this server does not implement, with the values that
#: ask for nothing (the client libraries' defaults): any other value is refused with 400
#: rather than silently ignored (a user asking for logprobs must not get ``null`` back)
#: (a field a request model declares, e.g. completions' ``echo``, is checked there instead)
UNSUPPORTED = {"echo": (None, False), "logprobs": (None, False), "top_logprobs": (None, 0), "best_of": (None, 1),
               "suffix": (None, ""), "logit_bias": (None, {}), "presence_penalty": (None, 0), "frequency_penalty":
               (None, 0), "repetition_penalty": (None, 1), "min_tokens": (None, 0), "tools": (None, []),
               "functions": (None, []), "response_format": (None, {"type": "text"}), "guided_json": (None,),
               "guided_regex": (None,), "guided_choice": (None,), "prompt_logprobs": (None,)}


#: the most logprob alternatives a request may ask for (vLLM's default ``max_logprobs``;
#: OpenAI's legacy completions allow 5)
MAX_LOGPROBS = 20

#: the most sequences one request may ask for: prompts x ``best_of`` (or ``n``)
MAX_SEQUENCES = 256


class CompletionRequest(_Sampling):
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]
    echo: StrictBool = False
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: Optional[StrictInt] = Field(None, ge=1)


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: StrictStr
    content: Union[StrictStr, list[dict[str, Any]], None] = None


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    logprobs: Optional[StrictBool] = None
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_LOGPROBS)


@dataclass
class ModelInfo:
    """What the API needs of the compiled serve program."""

    name: str
    vocab: int
    context: int                    # prompt_len + max_new_tokens: the longest request
    temperature: float              # the spec's defaults
    top_k: int
    eos: list[int]
    tokenizer: Any                  # runtime.generate's ByteTokenizer / HFTokenizer / IdTokenizer
    chat_template: str
    special: dict                   # bos_token, eos_token for the chat template
    max_seqs: int = 0               # sequences one replica decodes at once: the most `n` / `best_of` (0: no limit)


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"])
    param = str(err["loc"][0]) if err["loc"] else None
    if err["type"] == "missing":
        return f"`{loc}` is required", param
    return f"`{loc}`: {err['msg']} (got {json.dumps(err.get('input'), default=str)[:80]})", param


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _load_json(raw: bytes) -> dict:
    """The request body as a JSON object, nested at most :data:`MAX_JSON_DEPTH` deep.

    Raises:
        ApiError: 400 for anything else (invalid UTF-8 or JSON, NaN / Infinity, a body that is
            not an object, nesting too deep for the parser or past the limit, a string holding
            a lone UTF-16 surrogate).
    """
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    level, depth = [body], 1
    while level:            # breadth first, without recursion
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
        for x in level:     # JSON's \u escapes allow a lone surrogate (\ud800): no text encodes it
            for v in (list(x) + list(x.values()) if isinstance(x, dict) else x):
                if isinstance(v, str) and not _is_text(v):
                    raise ApiError(400, f"the request body holds a lone UTF-16 surrogate (in "
                                        f"{json.dumps(v)[:40]}): not text", code="invalid_json")
        level = [c for x in level for c in (x.values() if isinstance(x, dict) else x) if isinstance(c, (dict, list))]
        depth += 1
    return body


def _is_text(s: str) -> bool:
    """Whether ``s`` encodes as UTF-8 (no lone surrogate, which JSON's \\u escapes allow)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _error_body(status: int, message: str, code: str | None, kind: str = "invalid_request_error") -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


class Guard:
    """ASGI middleware in front of the API: the API key and the body limit, checked on the
    headers before any body byte is read or any handler runs.

    ``api_key`` (None: open): requests to ``/v1/...`` without ``Authorization: Bearer KEY``
    are answered 401 in OpenAI's error form (code ``invalid_api_key``); ``/health`` and
    ``/metrics`` stay open, as in vLLM (``vllm/entrypoints/openai/api_server.py``,
    AuthenticationMiddleware). The comparison is constant-time (``hmac.compare_digest`` of
    SHA-256 digests, so neither content nor length leaks). ``max_body`` (bytes): a
    ``Content-Length`` above it is answered 413 and the connection closed (a chunked body is
    counted as it is read, :func:`build_app`).
    """

    def __init__(self, app, api_key: str | None, max_body: int):
        self.app, self.max_body = app, max_body
        self.digest = hashlib.sha256(api_key.encode()).digest() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.digest is not None and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            given = headers.get(b"authorization", b"")
            token = given[7:] if given[:7].lower() == b"bearer " else b""
            if not (given and hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self.digest)):
                return await self._reply(send, 401, "Incorrect or missing API key: send the header `Authorization: "
                                         "Bearer KEY` with the key the server was started with (--api-key)",
                                         "invalid_api_key", extra=[(b"www-authenticate", b"Bearer")])
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                n = -1
            if n < 0:
                return await self._reply(send, 400, "the Content-Length header is not a byte count", "invalid_request")
            if n > self.max_body:
                return await self._reply(send, 413, f"the request body is {n:,} bytes; this server takes at most "
                                         f"{self.max_body:,} (`parcompile serve --max-body`)", "request_too_large")
        return await self.app(scope, receive, send)

    @staticmethod
    async def _reply(send, status: int, message: str, code: str, extra=()):
        body = _error_body(status, message, code)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close"), *extra]})
        await send({"type": "http.response.body", "body": body})


def build_app(info: ModelInfo, engines, metrics, api_key: str | None = None, max_body: int | None = None) -> FastAPI:
    """The FastAPI application over ``engines`` (:class:`parcompile.server.engines.Engines`),
    recording into ``metrics`` (:class:`parcompile.server.metrics.Metrics`); ``api_key`` and
    ``max_body`` (bytes; default :func:`default_max_body` of the context) as :class:`Guard`."""
    app = FastAPI(title=f"parcompile serve: {info.name}", docs_url=None, redoc_url=None)
    max_body = default_max_body(info.context) if max_body is None else max_body
    app.add_middleware(Guard, api_key=api_key, max_body=max_body)
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from jinja2.exceptions import TemplateError

    def raise_exception(message):      # what a template calls on messages it refuses
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    # the globals transformers' apply_chat_template gives templates (chat_template_utils.py)
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: time.strftime(fmt, time.localtime()))
    chat_template = env.from_string(info.chat_template)

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

    async def read_body(request: Request) -> bytes:
        """The body, refused with 413 past ``max_body`` bytes (a Content-Length above it is
        refused by :class:`Guard` before any byte is read; this counts a chunked one)."""
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_body:
                    raise ApiError(413, f"the request body exceeds {max_body:,} bytes (`parcompile serve --max-body`)",
                                   code="request_too_large")
                chunks.append(chunk)
        except ClientDisconnect:     # gone before its body ended: nobody reads the answer (no traceback)
            raise ApiError(400, "the client disconnected before the end of its body", code="client_disconnected") \
                from None
        return b"".join(chunks)

    async def parse(request: Request, model_cls):
        raw = await read_body(request)
        if len(raw) > THREAD_PARSE_BYTES:
            body = await asyncio.to_thread(_load_json, raw)
        else:
            body = _load_json(raw)
        try:
            req = model_cls.model_validate(body)
        except ValidationError as e:
            message, param = _validation_message(e)
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
        if info.max_seqs and samples > info.max_seqs:
            name = "best_of" if samples > req.n else "n"
            raise ApiError(400, f"`{name}` is {samples}; this server decodes at most {info.max_seqs} sequences at once "
                                f"per replica (the spec's serve `batch`), so a prompt's samples are at most that",
                           param=name, code="invalid_value")
        if req.max_tokens == 0 and not getattr(req, "echo", False):
            raise ApiError(400, "`max_tokens` 0 asks for no output: it is only taken with `\"echo\": true` (the "
                                "prompt's logprobs)", param="max_tokens", code="invalid_value")
        if req.max_tokens == 0 and req.stream:
            raise ApiError(400, "`max_tokens` 0 (the prompt's logprobs only) is not streamed", param="max_tokens",
                           code="invalid_value")
        if isinstance(req, ChatRequest) and req.top_logprobs and not req.logprobs:
            raise ApiError(400, "`top_logprobs` needs `\"logprobs\": true`", param="top_logprobs",
                           code="invalid_value")
        if req.model is not None and req.model != info.name:
            raise ApiError(404, f"the model `{req.model}` does not exist; this server serves `{info.name}`",
                           param="model", code="model_not_found")
        return req

    def too_long(n_tokens: int, param: str, at_least: bool = False) -> ApiError:
        return ApiError(400, f"this model's context is {info.context} tokens (prompt_len + max_new_tokens); the prompt "
                             f"has {'at least ' if at_least else ''}{n_tokens} tokens, leaving no room for output",
                        param=param, code="context_length_exceeded")

    def encode_sync(prompt, param: str) -> list[int]:
        """Token ids of one ``prompt`` (a string, or ids), checked against the vocabulary and
        the context; a text that cannot fit by its bytes alone is refused untokenized."""
        if isinstance(prompt, str):
            per_token = getattr(info.tokenizer, "max_token_bytes", None)
            if per_token:
                least = -(-len(prompt.encode("utf-8", "surrogatepass")) // per_token)
                if least >= info.context:
                    raise too_long(least, param, at_least=True)
            try:
                ids = info.tokenizer.encode(prompt)
            except ServeError as e:      # a model without a tokenizer: ids only
                raise ApiError(400, str(e), param=param) from None
        else:
            ids = list(prompt)
        if not ids:
            raise ApiError(400, "the prompt is empty", param=param, code="empty_prompt")
        if len(ids) >= info.context:
            raise too_long(len(ids), param)
        bad = [i for i in ids if not 0 <= i < info.vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, {info.vocab})", param=param)
        return ids

    async def encode(prompt, param: str = "prompt") -> list[list[int]]:
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
            return await asyncio.to_thread(lambda: [encode_sync(p, param) for p in prompts])
        return [encode_sync(p, param) for p in prompts]

    def sampling(req: _Sampling, n_prompt: int, param: str) -> dict:
        """What reaches the ranks for one sequence of ``req`` whose prompt has ``n_prompt``
        tokens (values made safe here); ``want`` (the tokens asked for: 0 with echo) is
        taken out by :func:`respond` (the engine makes at least one)."""
        room = info.context - n_prompt
        if room < 1:
            raise too_long(n_prompt, param)
        max_tokens = req.max_tokens if req.max_tokens is not None else (req.max_completion_tokens or room)
        if max_tokens > room:
            raise ApiError(400, f"this model's context is {info.context} tokens (prompt_len + max_new_tokens); "
                                f"the prompt has {n_prompt} tokens and max_tokens is {max_tokens}: at most "
                                f"{room} new tokens fit", param="max_tokens", code="context_length_exceeded")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > 4 or any(not s for s in stop):
            raise ApiError(400, "`stop` takes up to 4 non-empty strings", param="stop")
        # what reaches the ranks is made safe here (the sampler keeps the likeliest token too):
        # top_k in [0, vocab] (0: all), temperature 0 (greedy) or >= SAMPLING_EPS, top_p in
        # [SAMPLING_EPS, 1] (1e-46 is 0 in float32: every token would be masked), seed in [0, 2**63)
        top_k = info.top_k if req.top_k is None else req.top_k
        top_k = 0 if top_k < 0 or top_k >= info.vocab else int(top_k)
        temperature = info.temperature if req.temperature is None else req.temperature
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
                "eos": info.eos, "stop": stop, "logprobs": k, "prompt_logprobs": prompt_lp,
                "want": int(max_tokens)}

    async def generate(request: Request, prompt: list[int], params: dict, watch: str):
        """Yield (text delta, token ids so far, finish_reason, their logprobs so far, the
        prompt's logprobs) as tokens arrive; the request is cancelled in the engine when the
        client goes away or a stop string matches. Logprobs are the engine's entries
        (:func:`parcompile.runtime.paged.unpack_logprobs`), one per token id (an empty list
        when the request asked for none).

        ``watch``: "all" polls the connection every :data:`DISCONNECT_POLL_S` seconds while
        tokens arrive (a plain response: nothing is written until the end); "first" until
        the first token only (a stream: once it is writing, Starlette cancels it when the
        client goes away)."""
        rid = uuid.uuid4().hex
        params = dict(params)
        stop = params.pop("stop")
        params.pop("want", None)
        hold = max((len(s) for s in stop), default=1) - 1   # text that may begin a stop string
        t0 = time.perf_counter()
        try:
            q = engines.submit(rid, prompt, params)
        except EngineFailed as e:
            raise unavailable(str(e)) from None
        metrics.request_started(len(prompt))
        ids: list[int] = []
        lps: list = []
        prompt_lps = None
        sent = ""
        last = None
        finished = False
        next_poll = time.monotonic() + DISCONNECT_POLL_S
        try:
            while True:
                try:
                    item = await asyncio.wait_for(q.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    item = None
                if (watch == "all" or (watch == "first" and last is None)) and time.monotonic() >= next_poll:
                    next_poll = time.monotonic() + DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        return           # the finally aborts it: its blocks are freed
                if item is None:
                    continue
                if isinstance(item, EngineFailed):
                    raise unavailable(str(item))
                tok, reason, *rest = item
                lp = rest[0] if rest else None
                if reason == "error":        # its logits were NaN or inf: this request fails, the server lives
                    finished = True
                    metrics.request_finished("abort", len(ids))
                    raise ApiError(500, "the model produced NaN or infinite logits for this request (its weights "
                                        "or activations overflow in the serve dtype); no token could be drawn",
                                   code="non_finite_logits", kind="server_error")
                if lp is not None and "prompt" in lp:
                    prompt_lps = lp["prompt"]
                now = time.perf_counter()
                metrics.token(now - (last if last is not None else t0), first=last is None)
                last = now
                if reason == "stop" and tok in info.eos:
                    text = info.tokenizer.decode(ids)      # the end token is not text
                else:
                    ids.append(tok)
                    if lp is not None:
                        lps.append((lp["lp"], lp["top"]))
                    text = info.tokenizer.decode(ids)
                if reason is None:
                    hit = min((i for i in (text.find(s, max(len(sent) - hold, 0)) for s in stop) if i >= 0),
                              default=-1)
                    if hit >= 0:
                        text, reason = text[:hit], "stop"
                        engines.abort(rid)
                if reason is None:
                    keep = len(text) - hold if stop else len(text)
                    while keep > len(sent) and text[keep - 1] == "\ufffd":   # an unfinished UTF-8 character
                        keep -= 1
                    if keep > len(sent) and text.startswith(sent):
                        delta, sent = text[len(sent):keep], text[:keep]
                        yield delta, ids, None, lps, prompt_lps
                    continue
                finished = True
                metrics.request_finished(reason, len(ids))
                yield (text[len(sent):] if text.startswith(sent) else ""), ids, reason, lps, prompt_lps
                return
        finally:
            if not finished:
                engines.abort(rid)
                metrics.request_finished("abort", len(ids))

    def usage(n_prompt: int, n_out: int) -> dict:
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

    def token_text(tok: int) -> str:
        return info.tokenizer.decode([tok])

    def completion_logprobs(entries: list[tuple[int, float | None, list | None]], k: int, offset: int = 0) -> dict:
        """OpenAI's legacy completion logprobs as vLLM returns them: ``tokens`` (each
        token's text), ``token_logprobs``, ``top_logprobs`` (per token a dict of its ``k``
        likeliest tokens' texts and the chosen one's to their logprobs; None where the
        token has no logprob: the first prompt token) and ``text_offset`` (each token's
        character offset, counted from ``offset``). ``entries``: (token id, logprob, top
        (id, logprob) pairs)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tok, lp, top in entries:
            t = token_text(tok)
            out["tokens"].append(t)
            out["token_logprobs"].append(lp)
            if lp is None:
                out["top_logprobs"].append(None)
            else:
                d = {token_text(i): v for i, v in top[:k]}
                d.setdefault(t, lp)
                out["top_logprobs"].append(d)
            out["text_offset"].append(offset)
            offset += len(t)
        return out

    def chat_logprobs(ids: list[int], lps: list, k: int) -> dict:
        """OpenAI's chat ``logprobs``: per token its text, logprob, UTF-8 bytes and its ``k``
        likeliest alternatives (``top_logprobs``)."""
        def one(tok, lp):
            t = token_text(tok)
            return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8", "surrogatepass"))}
        return {"content": [{**one(tok, lp), "top_logprobs": [one(i, v) for i, v in top[:k]]}
                            for tok, (lp, top) in zip(ids, lps)]}

    async def respond(request: Request, req: _Sampling, prompts: list[list[int]], chat: bool):
        """Answer a completion (one choice per prompt and sample, ``index`` prompt-major)
        or a chat completion (``n`` choices), plain or streamed."""
        param = "messages" if chat else "prompt"
        n = req.n
        samples = (getattr(req, "best_of", None) or n) if not chat else n
        if len(prompts) * samples > MAX_SEQUENCES:
            raise ApiError(400, f"{len(prompts)} prompt(s) x {samples} samples is {len(prompts) * samples} sequences; "
                                f"this server takes at most {MAX_SEQUENCES} in one request", param=param,
                           code="invalid_value")
        base_params = [sampling(req, len(p), param) for p in prompts]
        echo = bool(getattr(req, "echo", False))
        k = base_params[0]["logprobs"]
        want_lp = (req.logprobs is not None) if not chat else bool(req.logprobs)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        base = {"id": rid, "created": created, "model": info.name}
        # one engine request per prompt and sample; a given seed gives sample j the seed + j
        jobs = []
        for i, (p, params) in enumerate(zip(prompts, base_params)):
            for j in range(samples):
                pj = dict(params, seed=(params["seed"] + j) % (1 << 63))
                jobs.append((i, p, pj))
        streams = [generate(request, p, pj, watch="first" if req.stream else "all") for _, p, pj in jobs]

        def prompt_entries(p: list[int], plps) -> list:
            out = [(p[0], None, None)]
            if plps is not None:
                out += [(tok, lp, top) for tok, (lp, top) in zip(p[1:], plps)]
            return out

        def choice_logprobs(p, ids, lps, plps, with_prompt: bool, offset: int = 0):
            if not want_lp:
                return None
            if chat:
                return chat_logprobs(ids, lps, k or 0)
            entries = (prompt_entries(p, plps) if with_prompt else []) + [
                (tok, lp, top) for tok, (lp, top) in zip(ids, lps)]
            return completion_logprobs(entries, k or 0, offset)

        if not req.stream:
            async def run(g):
                text, ids, reason, lps, plps = "", [], None, [], None
                async for delta, ids, reason, lps, plps in g:
                    text += delta
                return text, list(ids), reason, list(lps), plps

            tasks = [asyncio.ensure_future(run(g)) for g in streams]
            try:
                results = await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            if any(r[2] is None for r in results):        # the client went away: nobody reads this
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
                             "logprobs": choice_logprobs(p, ids, lps, plps, False), "finish_reason": reason}
                    else:
                        c = {"index": i * n + j, "text": (info.tokenizer.decode(p) + text) if echo else text,
                             "logprobs": choice_logprobs(p, ids, lps, plps, echo), "finish_reason": reason}
                    if req.return_token_ids:
                        c.update(prompt_token_ids=p, token_ids=list(ids))
                    choices.append(c)
            return JSONResponse({**base, "object": obj, "choices": choices,
                                 "usage": usage(sum(map(len, prompts)), n_out)})

        # streamed: every choice's events through one queue; the first event must arrive (or
        # fail) before the 200 status goes out
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(idx: int, g):
            """Forward one choice's events to ``merged``, then None (its end) or its error."""
            try:
                async for item in g:
                    await merged.put((idx, item))
            except ApiError as e:                  # a rank died, or its logits were not finite
                await merged.put((idx, e))
                return
            except Exception as e:                 # a bug: OpenAI's form to the client, the traceback to the log
                await merged.put((idx, ApiError(500, f"internal error: {type(e).__name__}: {e}"[:300],
                                                code="internal_error", kind="server_error")))
                raise
            await merged.put((idx, None))

        pumps = [asyncio.ensure_future(pump(idx, g)) for idx, g in enumerate(streams)]

        async def cancel_all():
            for t in pumps:
                t.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

        try:
            first = await merged.get()
        except BaseException:
            await cancel_all()
            raise
        if isinstance(first[1], ApiError):
            await cancel_all()
            raise first[1]
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(idx: int, delta: str, new_ids: list[int], reason, lp_obj, role: bool = False) -> dict:
            index = jobs[idx][0] * n + idx % samples if not chat else idx % samples
            if chat:
                d = {"role": "assistant", "content": delta} if role else ({"content": delta} if delta else {})
                c = {"index": index, "delta": d, "logprobs": lp_obj, "finish_reason": reason}
            else:
                c = {"index": index, "text": delta, "logprobs": lp_obj, "finish_reason": reason}
            if req.return_token_ids:
                c["token_ids"] = new_ids
            return {**base, "object": obj + ".chunk" if chat else obj, "choices": [c]}

        async def events():
            n_ids = [0] * len(jobs)
            totals = [0] * len(jobs)
            offsets = [0] * len(jobs)
            started = [False] * len(jobs)
            open_ = len(jobs)
            if first[1] is None and open_ == 1:
                await cancel_all()
                return
            if chat:
                for idx in range(len(jobs)):
                    yield sse(chunk(idx, "", [], None, None, role=True))
            item = first
            try:
                while True:
                    idx, ev = item
                    if isinstance(ev, ApiError):      # a rank died mid-stream: the error as the last event
                        yield sse({"error": {"message": ev.message, "type": ev.kind, "param": None, "code": ev.code}})
                        return
                    if ev is None:
                        open_ -= 1
                        if open_ == 0:
                            break
                    else:
                        delta, ids, reason, lps, plps = ev
                        p = jobs[idx][1]
                        new_ids, new_lps = ids[n_ids[idx]:], lps[n_ids[idx]:]
                        lp_obj = None
                        if want_lp:
                            if chat:
                                lp_obj = chat_logprobs(new_ids, new_lps, k or 0)
                            else:
                                entries = (prompt_entries(p, plps) if echo and not started[idx] else []) + [
                                    (tok, lp, top) for tok, (lp, top) in zip(new_ids, new_lps)]
                                lp_obj = completion_logprobs(entries, k or 0, offsets[idx])
                                offsets[idx] += sum(len(t) for t in lp_obj["tokens"])
                        if echo and not started[idx]:
                            delta = info.tokenizer.decode(p) + delta
                        started[idx] = True
                        yield sse(chunk(idx, delta, new_ids, reason, lp_obj))
                        n_ids[idx] = len(ids)
                        totals[idx] = len(ids)
                    item = await merged.get()
            finally:
                await cancel_all()
            if include_usage:
                yield sse({**base, "object": obj + ".chunk" if chat else obj, "choices": [],
                           "usage": usage(sum(map(len, prompts)), sum(totals))})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse(request, CompletionRequest)
        return await respond(request, req, await encode(req.prompt), chat=False)

    def chat_ids(req: ChatRequest) -> list[int]:
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
            text = chat_template.render(messages=messages, add_generation_prompt=True, **info.special)
        except Exception as e:   # a template that rejects these messages (roles out of order)
            raise ApiError(400, f"the chat template rejects these messages: {e}", param="messages") from None
        return encode_sync(text, "messages")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await parse(request, ChatRequest)
        # the template and the tokenizer run off the event loop
        return await respond(request, req, [await asyncio.to_thread(chat_ids, req)], chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": info.name, "object": "model", "created": 0,
                                            "owned_by": "parcompile", "max_model_len": info.context}]}

    @app.get("/health")
    async def health():
        if engines.failed:
            return unavailable(engines.failed).response()
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.render(engines.totals())
        return PlainTextResponse(body, media_type=content_type)

    return app
