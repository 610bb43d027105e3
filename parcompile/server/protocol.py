"""What a request to `parcompile serve`'s API may be and how it is refused (module
:mod:`parcompile.server.api` serves it): the request models (pydantic), OpenAI's error object
(:class:`ApiError`), the JSON body reader (:func:`load_json`), the limits, :class:`Guard`
(the API key and body-size middleware) and an answer's :func:`usage`."""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Literal, Optional, Union

from fastapi.responses import JSONResponse
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr,
                      ValidationError, WrapValidator)
from pydantic_core import PydanticCustomError

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
    """503: the server cannot answer (a rank died); ``reason`` says why."""
    return ApiError(503, f"the server is unavailable: {reason}", code="service_unavailable", kind="server_error")


def _one_of(describe: Callable[[Any], str]) -> WrapValidator:
    """A union field's validator whose error is ONE message, ``describe(value)`` (what the
    field takes, or what is wrong with the value), instead of pydantic's error of the
    union's first member (``prompt.str``: "Input should be a valid string" for ``[1.5]``)."""
    def wrap(value, handler):
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("union_type", describe(value)) from None
    return WrapValidator(wrap)


def _null_is(default) -> BeforeValidator:
    """A field OpenAI's API reference types "X or null" with a default: null is that default
    (``n``: "integer or null", defaults to 1; ``stream``, ``echo``: "boolean or null",
    defaults to false); another value is validated as the field's type."""
    return BeforeValidator(lambda v: default if v is None else v)


def _is_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _prompt_problem(value) -> str:
    """What is wrong with a completion ``prompt`` that is none of its forms: a number that is
    not an integer (``1.5``, ``true``) where token ids are, or another shape."""
    items = value if isinstance(value, list) else []
    flat = [y for x in items for y in (x if isinstance(x, list) else [x])]
    if flat and all(isinstance(y, (int, float)) for y in flat) and not all(_is_id(y) for y in flat):
        return "token ids must be integers"
    return "must be a string, a list of token ids (integers), a list of strings or a list of token id lists"


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Optional[StrictStr] = None
    max_tokens: Optional[StrictInt] = Field(None, ge=0)      # 0: only with echo (the prompt's logprobs)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1)
    temperature: Optional[StrictFloat] = Field(None, ge=0, le=2)     # OpenAI's "number": "0.5" is refused
    top_p: Optional[StrictFloat] = Field(None, gt=0, le=1)
    top_k: Optional[StrictInt] = Field(None, ge=-1)
    stop: Annotated[Optional[Union[StrictStr, list[StrictStr]]],
                    _one_of(lambda v: "must be a string or a list of strings")] = None
    seed: Optional[StrictInt] = None
    stream: Annotated[StrictBool, _null_is(False)] = False
    stream_options: Optional["StreamOptions"] = None
    n: Annotated[StrictInt, _null_is(1)] = Field(1, ge=1)
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
               "guided_regex": (None,), "guided_choice": (None,), "prompt_logprobs": (None,),
               # vLLM's extra sampling fields about the end (vllm/entrypoints/openai/protocol.py at ec3b890):
               # generating past the end token, other end tokens, the stop string or special tokens in the text
               "ignore_eos": (None, False), "stop_token_ids": (None, []), "include_stop_str_in_output": (None, False),
               "skip_special_tokens": (None, True),
               # chat: a tool call asked for (vLLM: "When using `tool_choice`, `tools` must be set", unless
               # "none"; tests/tool_use/test_chat_completion_request_validations.py at c10dff9), another
               # template or rendering of it than the model's with the generation prompt
               "tool_choice": (None, "none"), "chat_template": (None,), "chat_template_kwargs": (None, {}),
               "add_generation_prompt": (None, True), "continue_final_message": (None, False)}


#: the most logprob alternatives a request may ask for (vLLM's default ``max_logprobs``;
#: OpenAI's legacy completions allow 5)
MAX_LOGPROBS = 20

#: the most sequences one request may ask for: prompts x ``best_of`` (or ``n``)
MAX_SEQUENCES = 256


class CompletionRequest(_Sampling):
    prompt: Annotated[Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]],
                      _one_of(_prompt_problem)]
    echo: Annotated[StrictBool, _null_is(False)] = False
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: Optional[StrictInt] = Field(None, ge=1)


#: the chat roles OpenAI takes (openai-python's ``ChatCompletionMessageParam`` members; vLLM
#: also takes any other string, OpenAI answers 400)
ROLES = ("developer", "system", "user", "assistant", "tool", "function")


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal[ROLES]  # type: ignore[valid-type]
    content: Annotated[Union[StrictStr, list[dict[str, Any]], None],
                       _one_of(lambda v: "must be a string, a list of content parts (objects) or null")] = None


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


def usage(n_prompt: int, n_out: int) -> dict:
    """OpenAI's ``usage`` object of an answer with ``n_prompt`` prompt and ``n_out`` output tokens."""
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def validation_message(e: ValidationError) -> tuple[str, str | None]:
    """A request model's first validation error as OpenAI's message and ``param`` (the top field)."""
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"])
    param = str(err["loc"][0]) if err["loc"] else None
    if err["type"] == "missing":
        return f"`{loc}` is required", param
    return f"`{loc}`: {err['msg']} (got {json.dumps(err.get('input'), default=str)[:80]})", param


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def load_json(raw: bytes) -> dict:
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
    counted as it is read, :func:`parcompile.server.api.build_app`).
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
