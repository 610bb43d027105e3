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
first match (``finish_reason: "stop"``), as do the model's end tokens (as vLLM: the end
token is left out of the text but counted in ``completion_tokens`` and returned in
``token_ids`` and the logprobs, its token string with special tokens kept, "<|endoftext|>");
``max_tokens`` ends it with ``"length"``. ``n`` samples per prompt (choice ``index`` = prompt * n + sample);
completions' ``best_of`` draws that many and returns the ``n`` of the highest summed
logprob (not streamed); ``n`` and ``best_of`` are at most the sequences a replica decodes at
once (:attr:`ModelInfo.max_seqs`), prompts x samples at most :data:`MAX_SEQUENCES`.

Logprobs (fp32 log-softmax of the model's full-vocabulary logits, before temperature and
top-k/top-p, as vLLM's ``raw_logprobs``; :mod:`parcompile.runtime.serve.paged`): completions'
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
not implement (:data:`UNSUPPORTED`: ``suffix``, penalties, ``tools`` and ``tool_choice``, ``ignore_eos``,
``stop_token_ids``, a request's chat template, chat's ``echo``...) set to
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

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from parcompile.server.generation import Generation
# the request side (models, errors, limits, Guard) lives in protocol.py; its names stay importable from here
from parcompile.server.protocol import (BODY_BYTES_PER_TOKEN, DISCONNECT_POLL_S, MAX_JSON_DEPTH, MAX_LOGPROBS,
                                        MAX_SEQUENCES, MIN_BODY_BYTES, PLAIN_CHAT_TEMPLATE, SAMPLING_EPS,
                                        THREAD_PARSE_BYTES, UNSUPPORTED, ApiError, ChatRequest, CompletionRequest,
                                        Guard, Message, ModelInfo, StreamOptions, default_max_body, unavailable)
from parcompile.server.serving_chat import ServingChat
from parcompile.server.serving_completion import ServingCompletion

__all__ = ["build_app", "ApiError", "ChatRequest", "CompletionRequest", "Guard", "Message", "ModelInfo",
           "StreamOptions", "default_max_body", "unavailable", "PLAIN_CHAT_TEMPLATE", "SAMPLING_EPS",
           "DISCONNECT_POLL_S", "BODY_BYTES_PER_TOKEN", "MIN_BODY_BYTES", "MAX_JSON_DEPTH", "THREAD_PARSE_BYTES",
           "UNSUPPORTED", "MAX_LOGPROBS", "MAX_SEQUENCES"]


def build_app(info: ModelInfo, engines, metrics, api_key: str | None = None, max_body: int | None = None) -> FastAPI:
    """The FastAPI application over ``engines`` (:class:`parcompile.server.engines.Engines`),
    recording into ``metrics`` (:class:`parcompile.server.metrics.Metrics`); ``api_key`` and
    ``max_body`` (bytes; default :func:`default_max_body` of the context) as :class:`Guard`.
    The requests are answered by one serving class per endpoint
    (:class:`parcompile.server.serving_completion.ServingCompletion`,
    :class:`parcompile.server.serving_chat.ServingChat`) over one
    :class:`parcompile.server.generation.Generation`; errors in OpenAI's form
    (:func:`add_error_handlers`), the routes by :func:`add_routes`."""
    app = FastAPI(title=f"parcompile serve: {info.name}", docs_url=None, redoc_url=None)
    max_body = default_max_body(info.context) if max_body is None else max_body
    app.add_middleware(Guard, api_key=api_key, max_body=max_body)
    add_error_handlers(app)
    generation = Generation(info, engines, metrics)
    add_routes(app, ServingCompletion(info, generation, max_body), ServingChat(info, generation, max_body))
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


def add_routes(app: FastAPI, completion: ServingCompletion, chat: ServingChat) -> None:
    """``POST /v1/completions`` (``completion``), ``POST /v1/chat/completions`` (``chat``),
    ``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (of their model, engines and
    metrics)."""
    info, engines, metrics = completion.info, completion.generation.engines, completion.generation.metrics

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await completion.create(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await chat.create(request)

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
