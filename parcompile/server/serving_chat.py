"""``POST /v1/chat/completions`` (:class:`ServingChat`), as vLLM's ``OpenAIServingChat``
(vllm-project/vllm ``vllm/entrypoints/openai/serving_chat.py``; its base
``serving_engine.py`` at 0030b9f) over the shared :class:`parcompile.server.serving.Serving`."""

from __future__ import annotations

import asyncio
import json

from parcompile.server.chat_template import TemplateRenderer, TemplateTimeout
from parcompile.server.generation import Generation
from parcompile.server.protocol import ApiError, ChatRequest, ModelInfo
from parcompile.server.serving import Reply, Serving
from parcompile.server.sse import json_str


class ServingChat(Serving):
    """The chat completions endpoint: the prompt is the ``messages`` through the model's
    chat template (:meth:`chat_ids`); ``n`` choices; a stream opens with each choice's
    ``role`` chunk; chat's logprobs object (:meth:`chat_logprobs`)."""

    request_model = ChatRequest
    param, obj, chunk_obj, id_prefix = "messages", "chat.completion", "chat.completion.chunk", "chatcmpl-"
    role_chunk = True

    def __init__(self, info: ModelInfo, generation: Generation, max_body: int):
        super().__init__(info, generation, max_body)
        # in a child process, time-limited; a rendered prompt is at most what a body may send
        # (max_body: protocol.BODY_BYTES_PER_TOKEN per context token, a whole context with room)
        self.chat_template = TemplateRenderer(info.chat_template, max_chars=max_body)

    async def prompts(self, req: ChatRequest) -> list[list[int]]:
        # the template and the tokenizer run off the event loop
        return [await asyncio.to_thread(self.chat_ids, req)]

    def check(self, req: ChatRequest) -> None:
        if req.top_logprobs and not req.logprobs:
            raise ApiError(400, "`top_logprobs` needs `\"logprobs\": true`", param="top_logprobs",
                           code="invalid_value")

    def logprobs_asked(self, req: ChatRequest) -> tuple:
        return (req.top_logprobs or 0) if req.logprobs else None, False

    def wants_logprobs(self, req: ChatRequest) -> bool:
        return bool(req.logprobs)

    def choice(self, r: Reply, index, prompt, text, ids, reason, lp_obj) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": lp_obj,
                "finish_reason": reason}

    def logprobs(self, r: Reply, p, ids, lps, plps, with_prompt, offset=0) -> dict:
        return self.chat_logprobs(ids, lps, r.k or 0)

    def chunk_body(self, delta, role=False) -> str:
        if role:
            return '"delta":{"role":"assistant","content":' + json_str(delta) + "}"
        return '"delta":{"content":' + json_str(delta) + "}" if delta else '"delta":{}'

    def chat_logprobs(self, ids: list[int], lps: list, k: int) -> dict:
        """OpenAI's chat ``logprobs``: per token its text, logprob, UTF-8 bytes and its ``k``
        likeliest alternatives (``top_logprobs``)."""
        def one(tok, lp):
            t = self.token_text(tok)
            return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8", "surrogatepass"))}
        return {"content": [{**one(tok, lp), "top_logprobs": [one(i, v) for i, v in top[:k]]}
                            for tok, (lp, top) in zip(ids, lps)]}

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
            text = self.chat_template.render(messages, add_generation_prompt=True, **self.info.special)
        except TemplateTimeout as e:   # the weights' template loops too long: the server's fault, not the request's
            raise ApiError(500, f"{e}; the model's tokenizer_config.json `chat_template` is at fault",
                           code="chat_template_timeout", kind="server_error") from None
        except ValueError as e:   # a template that rejects these messages (roles out of order)
            raise ApiError(400, f"the chat template rejects these messages: {e}", param="messages") from None
        return self.encode_sync(text, "messages")
