"""``POST /v1/completions`` (:class:`ServingCompletion`), as vLLM's
``OpenAIServingCompletion`` (vllm-project/vllm
``vllm/entrypoints/openai/serving_completion.py`` at 00463e6) over the shared
:class:`parcompile.server.serving.Serving`."""

from __future__ import annotations

from parcompile.server.protocol import CompletionRequest
from parcompile.server.serving import Reply, Serving
from parcompile.server.sse import json_str


def prompt_entries(p: list[int], plps) -> list:
    """The prompt's logprob entries: its first token without one, then ``plps`` per token."""
    out = [(p[0], None, None)]
    if plps is not None:
        out += [(tok, lp, top) for tok, (lp, top) in zip(p[1:], plps)]
    return out


class ServingCompletion(Serving):
    """The completions endpoint: prompts are a string, token ids, or a list of either (one
    choice per prompt and sample, ``index`` = prompt * n + sample); ``echo`` puts the
    prompt (and its logprobs) before the text; ``best_of``; OpenAI's legacy logprobs
    object (:meth:`completion_logprobs`)."""

    request_model = CompletionRequest
    param, obj, chunk_obj, id_prefix = "prompt", "text_completion", "text_completion", "cmpl-"

    async def prompts(self, req: CompletionRequest) -> list[list[int]]:
        return await self.encode(req.prompt)

    def logprobs_asked(self, req: CompletionRequest) -> tuple:
        k = req.logprobs
        if (req.best_of or 1) > req.n and k is None:
            k = 0                     # best_of ranks the samples by their summed logprobs
        return k, bool(req.echo) and req.logprobs is not None

    def wants_logprobs(self, req: CompletionRequest) -> bool:
        return req.logprobs is not None

    def choice(self, r: Reply, index, prompt, text, ids, reason, lp_obj) -> dict:
        return {"index": index, "text": (self.info.tokenizer.decode(prompt) + text) if r.echo else text,
                "logprobs": lp_obj, "finish_reason": reason}

    def logprobs(self, r: Reply, p, ids, lps, plps, with_prompt, offset=0) -> dict:
        entries = (prompt_entries(p, plps) if with_prompt else []) + [
            (tok, lp, top) for tok, (lp, top) in zip(ids, lps)]
        return self.completion_logprobs(entries, r.k or 0, offset)

    def logprobs_chars(self, lp_obj: dict) -> int:
        return sum(len(t) for t in lp_obj["tokens"])

    def chunk_body(self, delta, role=False) -> str:
        return '"text":' + json_str(delta)

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
