"""What both OpenAI endpoints of `parcompile serve` share (:class:`Serving`), laid out as
vLLM's OpenAI server splits its request handling: a base over the engine (request checks,
tokenization, sampling parameters; vllm-project/vllm
``vllm/entrypoints/openai/serving_engine.py`` ``OpenAIServing`` at 0030b9f) and one serving
class per endpoint over it (``serving_completion.py`` ``OpenAIServingCompletion`` at
00463e6, ``serving_chat.py``): here :class:`parcompile.server.serving_completion.ServingCompletion`
and :class:`parcompile.server.serving_chat.ServingChat`, which give the endpoint's request
model, prompts, logprobs and choice shapes. The engine side of one sequence is
:class:`parcompile.server.generation.Generation`, a streamed answer
:class:`parcompile.server.streaming.StreamedAnswer`. The API's rules are in
:mod:`parcompile.server.api`'s docstring."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from parcompile.runtime.serve.generate import ServeError
from parcompile.server.generation import Generation
from parcompile.server.protocol import (MAX_SEQUENCES, SAMPLING_EPS, THREAD_PARSE_BYTES, UNSUPPORTED, ApiError,
                                        ChatRequest, CompletionRequest, ModelInfo, load_json, usage,
                                        validation_message)
from parcompile.server.sse import dumps
from parcompile.server.streaming import StreamedAnswer


@dataclass
class Reply:
    """One request being answered (:meth:`Serving.respond`): the request, its prompts'
    token ids, samples per prompt (``best_of`` or ``n``), each prompt's sampling
    parameters, echo, logprobs asked (``k`` alternatives; ``want_lp``), the fields every
    answer object starts with (``base``), the engine jobs ``(prompt index, prompt ids,
    parameters)`` in choice order, and per job a streamed chunk's constant beginning
    (``heads``)."""

    req: Any
    prompts: list
    samples: int
    base_params: list
    echo: bool
    k: Any
    want_lp: bool
    base: dict
    jobs: list = field(default_factory=list)
    heads: list = field(default_factory=list)   # per job: a chunk's event up to its choice's index and a comma


class Serving:
    """One endpoint of the API for one model (``info``, :class:`ModelInfo`), its sequences
    run by ``generation`` (:class:`Generation`), bodies at most ``max_body`` bytes: reads
    and checks a request (:meth:`parse`), tokenizes its prompts (:meth:`encode`), sets each
    sequence's sampling parameters (:meth:`sampling`), and answers it whole
    (:meth:`respond_plain`) or streamed (:meth:`respond_stream`). A subclass is one
    endpoint: its request model and names, :meth:`prompts`, and the shapes of its choices
    (:meth:`choice`, :meth:`chunk_body`) and logprobs (:meth:`logprobs`)."""

    #: the endpoint's request model, the field its prompts come from, its answer ids' prefix,
    #: its answer's and its streamed chunks' ``object``
    request_model: Any = None
    param = obj = chunk_obj = id_prefix = ""
    #: whether a stream opens with a chunk per choice giving its ``role`` (chat)
    role_chunk = False

    def __init__(self, info: ModelInfo, generation: Generation, max_body: int):
        self.info, self.generation, self.max_body = info, generation, max_body

    async def create(self, request: Request):
        """Answer one HTTP request of this endpoint (the route's body)."""
        req = await self.parse(request)
        return await self.respond(request, req, await self.prompts(req))

    async def prompts(self, req) -> list[list[int]]:
        """The token ids of each prompt of ``req`` (checked: :meth:`encode_sync`)."""
        raise NotImplementedError

    def check(self, req) -> None:
        """The endpoint's own checks of a parsed request (400 :class:`ApiError`)."""

    def logprobs_asked(self, req) -> tuple:
        """(logprob alternatives per token or None for no logprobs, whether the prompt's too)."""
        raise NotImplementedError

    def wants_logprobs(self, req) -> bool:
        """Whether the choices carry ``logprobs``."""
        raise NotImplementedError

    async def read_body(self, request: Request) -> bytes:
        """The body, refused with 413 past ``max_body`` bytes (a Content-Length above it is
        refused by :class:`parcompile.server.protocol.Guard` before any byte is read; this
        counts a chunked one)."""
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

    async def parse(self, request: Request):
        """The request's body as :attr:`request_model`, checked: 400 for a field of the wrong
        type or value, an unsupported field set, inconsistent ``n`` / ``best_of`` / ``stream``
        / ``max_tokens`` / logprobs (and :meth:`check`); 404 for another model."""
        model_cls = self.request_model
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
        self.check_samples(req)
        if req.max_tokens == 0 and not getattr(req, "echo", False):
            scores = " or `\"echo\": true` (the prompt's logprobs)" if "echo" in model_cls.model_fields else ""
            raise ApiError(400, f"`max_tokens` 0 asks for no output: ask for at least 1 token{scores}",
                           param="max_tokens", code="invalid_value")
        if req.max_tokens == 0 and req.stream:
            raise ApiError(400, "`max_tokens` 0 (the prompt's logprobs only) is not streamed", param="max_tokens",
                           code="invalid_value")
        self.check(req)
        if req.model is not None and req.model != self.info.name:
            raise ApiError(404, f"the model `{req.model}` does not exist; this server serves `{self.info.name}`",
                           param="model", code="model_not_found")
        return req

    def check_samples(self, req) -> None:
        """400 unless ``best_of`` (or ``n``) is at least ``n``, at most the sequences a replica
        decodes at once, and equal to ``n`` when streamed."""
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
        token ids, or a list of either (OpenAI's batch); :meth:`encode_sync` off the event
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
        taken out by :meth:`Generation.generate` (the engine makes at least one).

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
        k, prompt_lp = self.logprobs_asked(req)     # k alternatives per token (None: none); echo: the prompt's too
        return {"max_tokens": max(int(max_tokens), 1), "temperature": float(temperature), "top_k": top_k,
                "top_p": top_p, "seed": secrets.randbits(62) if req.seed is None else req.seed % (1 << 63),
                "eos": self.info.eos, "stop": stop, "logprobs": k, "prompt_logprobs": prompt_lp,
                "want": int(max_tokens)}

    async def respond(self, request: Request, req, prompts: list[list[int]]):
        """Answer ``req`` over its ``prompts``: one choice per prompt and sample (``index``
        prompt-major), plain (:meth:`respond_plain`) or streamed (:meth:`respond_stream`)."""
        n = req.n
        samples = getattr(req, "best_of", None) or n
        if len(prompts) * samples > MAX_SEQUENCES:
            raise ApiError(400, f"{len(prompts)} prompt(s) x {samples} samples is {len(prompts) * samples} sequences; "
                                f"this server takes at most {MAX_SEQUENCES} in one request", param=self.param,
                           code="invalid_value")
        base_params = [self.sampling(req, len(p), self.param) for p in prompts]
        r = Reply(req=req, prompts=prompts, samples=samples, base_params=base_params,
                  echo=bool(getattr(req, "echo", False)), k=base_params[0]["logprobs"],
                  want_lp=self.wants_logprobs(req),
                  base={"id": self.id_prefix + secrets.token_hex(12), "created": int(time.time()),
                        "model": self.info.name})
        head = "data: " + dumps({**r.base, "object": self.chunk_obj})[:-1] + ',"choices":[{"index":'
        # one engine request per prompt and sample; a given seed gives sample j the seed + j
        for i, (p, params) in enumerate(zip(prompts, base_params)):
            for j in range(samples):
                r.jobs.append((i, p, dict(params, seed=(params["seed"] + j) % (1 << 63))))
        for idx, (i, _, _) in enumerate(r.jobs):
            r.heads.append(f"{head}{i * n + idx % samples},")
        generate = self.generation.generate
        streams = [generate(request, p, pj, watch="first" if req.stream else "all") for _, p, pj in r.jobs]
        if not req.stream:
            return await self.respond_plain(r, streams)
        return await self.respond_stream(r, streams)

    async def respond_plain(self, r: Reply, streams: list):
        """The whole answer as one JSON object once every sequence has ended (best_of keeps
        the ``n`` samples of the highest summed logprob); 499 when the client went away."""
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
        choices, n_out, samples, n = [], 0, r.samples, r.req.n
        for i, p in enumerate(r.prompts):
            mine = results[i * samples:(i + 1) * samples]
            if samples > n:       # best_of: the n samples of the highest summed logprob
                order = sorted(range(samples), key=lambda j: -sum(lp for lp, _ in mine[j][3]))
                mine = [mine[j] for j in sorted(order[:n])]
            for j, (text, ids, reason, lps, plps) in enumerate(mine):
                if r.base_params[i]["want"] == 0:       # echo with max_tokens 0: the prompt only
                    text, ids, lps, reason = "", [], [], "length"
                n_out += len(ids)
                c = self.choice(r, i * n + j, p, text, ids, reason,
                                self.logprobs(r, p, ids, lps, plps, r.echo) if r.want_lp else None)
                if r.req.return_token_ids:
                    c.update(prompt_token_ids=p, token_ids=list(ids))
                choices.append(c)
        return JSONResponse({**r.base, "object": self.obj, "choices": choices,
                             "usage": usage(sum(map(len, r.prompts)), n_out)})

    def choice(self, r: Reply, index: int, prompt: list[int], text: str, ids: list[int], reason: str,
               lp_obj) -> dict:
        """One choice of a plain answer: choice ``index``, its prompt's ids, its text, token
        ids, finish_reason and logprobs object (None when not asked)."""
        raise NotImplementedError

    def logprobs(self, r: Reply, p: list[int], ids: list[int], lps: list, plps, with_prompt: bool,
                 offset: int = 0) -> dict:
        """A choice's ``logprobs`` object for its tokens ``ids`` and their entries ``lps``
        (and its prompt ``p``'s ``plps`` first when ``with_prompt``; text offsets from ``offset``)."""
        raise NotImplementedError

    def logprobs_chars(self, lp_obj: dict) -> int:
        """The characters of text a streamed chunk's logprobs object covers (its next chunk's
        ``offset``); 0 where the object has no offsets."""
        return 0

    def token_text(self, tok: int) -> str:
        """One token's text in a logprobs object (a special token's too: the tokenizer's
        ``token_text``)."""
        return self.info.tokenizer.token_text(tok)

    async def respond_stream(self, r: Reply, streams: list):
        """Server-sent events (:meth:`StreamedAnswer.start`)."""
        return await StreamedAnswer.start(self, r, streams)

    def chunk_body(self, delta: str, role: bool = False) -> str:
        """A streamed chunk's choice fields carrying the text ``delta`` (chat's ``delta``, a
        completion's ``text``), as JSON text; ``role``: the opening chunk of a stream whose
        endpoint has :attr:`role_chunk`."""
        raise NotImplementedError
