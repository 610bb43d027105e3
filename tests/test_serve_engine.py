"""The serve engine (runtime/serve/paged.py) in one process (a world of one), on the generated
program's own Stage: logprobs against transformers' on the same weights, and prefix
caching (issue 33).

Truth: transformers' LlamaForCausalLM on the checkpoint the program loads (log_softmax of
its fp32 logits); for prefix caching, the same engine with caching off (greedy tokens and
logprobs equal), and the scheduler's own counters (a repeated prefix is not prefilled).
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from parcompile.runtime.serve import generate as gen
from parcompile.runtime.serve import paged
from tests.serve_utils import build_serve, serve_config

_ids = itertools.count()


class Engine:
    """The program in ``out`` (serve.py, plan.json) with its scheduler and paged cache;
    :meth:`run` serves requests, ``arrive`` of them joining per step."""

    def __init__(self, out: Path, weights: str | None, blocks: int, block_size: int, max_seqs: int, caching: bool,
                 max_prefill_tokens: int | None = None, **admission):
        from parcompile import runtime as rt
        from parcompile.runtime.state.weights import load_weights

        spec = importlib.util.spec_from_file_location(f"engine_prog_{next(_ids)}", out / "serve.py")
        self.mod = mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod      # importable, as the serve program (__main__) is: compile_engine's fused graph
        spec.loader.exec_module(mod)
        plan = json.loads((out / "plan.json").read_text())
        saved = {k: os.environ.pop(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK") if k in os.environ}
        try:
            self.ctx = rt.init_parallel(plan, force_cpu=True)
        finally:
            os.environ.update(saved)
        with rt.no_init() if weights else contextlib.nullcontext():
            self.model = mod.Stage(plan, self.ctx)
        load_weights(self.model, weights, self.ctx)
        for p in self.model.parameters():
            p.data = p.data.to(self.ctx.device, mod.DTYPE)
        self.model.eval()
        self.cache = self.model.new_paged_cache(blocks, block_size, self.ctx.device)
        self.windows = getattr(mod, "ATTN_CORE_WINDOW", None) or mod.WINDOW
        self.sched = paged.Scheduler(blocks, block_size, max_seqs, prefix_caching=caching,
                                     max_prefill_tokens=max_prefill_tokens, **admission)
        self.blocks = blocks
        self.steps: list[list[tuple[str, int, bool]]] = []      # each step's rows: (rid, new tokens, prefill)
        self.preempted: list[tuple[str, int]] = []               # (rid, its tokens generated) per preemption

    def run(self, requests: list[tuple[list[int], dict]], arrive: int = 1) -> dict:
        """Greedy (unless the params say otherwise) tokens and logprobs per request index."""
        base = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0, "eos": [], "logprobs": None}
        pending = [(str(i), p, {**base, **params}) for i, (p, params) in enumerate(requests)]
        got = {rid: {"tokens": [], "lps": [], "prompt": None} for rid, _, _ in pending}
        params, gens = {}, {}
        while True:
            for _ in range(arrive):
                if pending:
                    rid, p, pr = pending.pop(0)
                    params[rid] = pr
                    self.sched.add(rid, p, pr)
            before = self.sched.preemptions
            step = self.sched.next_step()
            self.preempted += [(q.rid, len(q.out)) for q in list(self.sched.waiting)[:self.sched.preemptions - before]]
            rows = [paged.Row(*r) for r in step["rows"]]
            if not rows and not pending and not self.sched.waiting:
                break
            if not rows:
                continue
            for rid, pr in step["new"].items():       # as serve_requests: one generator per request
                gens[rid] = torch.Generator().manual_seed(pr["seed"])
            self.steps.append([(r.rid, len(r.tokens), r.context < len(self.sched.running[r.rid].prompt))
                               for r in rows])
            want = set(step["prompt_logprobs"])
            tokens, lps = paged.run_step(self.model, self.ctx, self.cache, rows, [params[r.rid] for r in rows],
                                         [gens[r.rid] for r in rows], self.mod.VOCAB,
                                         self.mod.HIDDEN, self.mod.DTYPE, self.windows,
                                         prompt_rows=[r.rid in want for r in rows],
                                         partial_next=[step["partial"].get(r.rid) for r in rows])
            for rid, tok, _, lp in self.sched.collect(rows, tokens, lps):
                got[rid]["tokens"].append(tok)
                if lp is not None:
                    got[rid]["lps"].append((lp["lp"], lp["top"]))
                    if "prompt" in lp:
                        got[rid]["prompt"] = lp["prompt"]
        assert self.sched.stats()["blocks_free"] == self.blocks     # every block freed (cached ones count free)
        return [got[str(i)] for i in range(len(requests))]


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_logprobs_equal_transformers_on_the_same_weights(tmp_path, one_thread):
    """Prompt logprobs (echo), the generated tokens' logprobs and their top-k alternatives
    equal transformers' log_softmax of its logits on the checkpoint the program loads."""
    from tests.test_serve import _hf_llama, _hf_spec

    hf = _hf_llama(tmp_path)
    build_serve(_hf_spec(tmp_path, 1, 1), tmp_path / "p")
    eng = Engine(tmp_path / "p", str(tmp_path / "hf"), blocks=16, block_size=4, max_seqs=4, caching=True)
    prompts = [[5, 17, 99, 3, 250, 42], [7, 7, 120]]
    k = 3
    out = eng.run([(p, {"max_tokens": 4, "logprobs": k, "prompt_logprobs": True}) for p in prompts], arrive=2)
    for p, got in zip(prompts, out):
        seq = p + got["tokens"]
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), -1)      # (L, vocab)
        want_prompt = [lp[j, p[j + 1]].item() for j in range(len(p) - 1)]
        assert [x for x, _ in got["prompt"]] == pytest.approx(want_prompt, abs=1e-4)
        for j, (x, top) in enumerate(got["prompt"]):
            assert [i for i, _ in top] == lp[j].topk(k).indices.tolist()
        n = len(p)
        assert got["tokens"] == [int(lp[n - 1 + j].argmax()) for j in range(4)]          # greedy
        assert [x for x, _ in got["lps"]] == pytest.approx([lp[n - 1 + j].max().item() for j in range(4)], abs=1e-4)
        assert [v for _, v in got["lps"][0][1]] == pytest.approx(lp[n - 1].topk(k).values.tolist(), abs=1e-4)


def test_prefix_caching_shares_a_repeated_prefix_and_keeps_greedy_tokens(tmp_path, one_thread):
    """Requests sharing a 10-token prefix over blocks of 4 tokens: with prefix caching the
    later ones find its 2 full blocks cached (8 tokens each not prefilled) and their greedy
    tokens and logprobs equal those without caching; every block is free afterwards."""
    cfg = serve_config(serve=dict(batch=3, prompt_len=14, max_new_tokens=6, seed=3))
    build_serve(cfg, tmp_path / "p")
    prefix = [5, 17, 99, 3, 250, 42, 7, 7, 120, 9]
    reqs = [(prefix + [31, 200], {"max_tokens": 6, "logprobs": 2}), (prefix + [4], {"max_tokens": 5, "logprobs": 2}),
            (prefix + [4], {"max_tokens": 5, "logprobs": 2}), ([1, 2, 3], {"max_tokens": 6, "logprobs": 2})]
    results = {}
    for caching in (False, True):
        eng = Engine(tmp_path / "p", None, blocks=12, block_size=4, max_seqs=3, caching=caching)
        results[caching] = (eng.run(reqs, arrive=1), eng.sched.stats())
    (off, s_off), (on, s_on) = results[False], results[True]
    assert [r["tokens"] for r in on] == [r["tokens"] for r in off]
    for a, b in zip(on, off):
        assert [x for x, _ in a["lps"]] == pytest.approx([x for x, _ in b["lps"]], abs=1e-5)
    total = sum(len(p) for p, _ in reqs)
    assert s_off["prefix_cache_hits"] == 0 and s_off["prefill_tokens"] == total
    # request 1 and 2 each find the prefix's 2 full blocks (8 tokens); request 3 (its own
    # prompt) and request 0 (first) find none
    assert s_on["prefix_cache_queries"] == total and s_on["prefix_cache_hits"] == 16
    assert s_on["prefill_tokens"] == total - 16


def test_held_requests_get_the_tokens_and_logprobs_of_requests_admitted_at_once(tmp_path, one_thread):
    """serve.max_waiting_steps: requests held a few steps and then prefilled together beside
    the decoding ones (other step compositions) get the greedy tokens and logprobs (1e-5)
    they get when each is admitted the step it arrives, seeded sampling included."""
    build_serve(serve_config(serve=dict(batch=4, prompt_len=10, max_new_tokens=6, seed=3)), tmp_path / "p")
    reqs = [([5, 17, 99, 3], {"max_tokens": 6, "logprobs": 2}), ([7, 7, 120], {"max_tokens": 5, "logprobs": 1}),
            ([9, 8, 7, 6, 5], {"max_tokens": 6, "logprobs": 2, "temperature": 1.0, "seed": 11}),
            ([200, 1], {"max_tokens": 4, "logprobs": 3})]
    now = Engine(tmp_path / "p", None, blocks=16, block_size=4, max_seqs=4, caching=False)
    held = Engine(tmp_path / "p", None, blocks=16, block_size=4, max_seqs=4, caching=False,
                  waiting_served_ratio=10.0, max_waiting_steps=2)
    want, got = now.run(reqs, arrive=1), held.run(reqs, arrive=1)
    assert held.steps != now.steps and any(len(s) > 2 and sum(pre for *_, pre in s) >= 2 for s in held.steps)
    assert not any(sum(pre for *_, pre in s) >= 2 for s in now.steps)           # one prompt a step there
    for g, w in zip(got, want):
        assert g["tokens"] == w["tokens"]
        assert [x for x, _ in g["lps"]] == pytest.approx([x for x, _ in w["lps"]], abs=1e-5)


def test_prompt_logprobs_requests_are_prefilled_whole():
    """A request wanting its prompt's logprobs does not read the cache (the cached prefix
    holds no logits), as vLLM; it is not counted as a query."""
    s = paged.Scheduler(blocks=8, block_size=2, max_seqs=4)
    s.add("a", [1, 2, 3, 4, 5], {"max_tokens": 1})
    step = s.next_step()
    rows = [paged.Row(*r) for r in step["rows"]]
    s.collect(rows, [9])
    s.add("b", [1, 2, 3, 4, 6], {"max_tokens": 1, "prompt_logprobs": True})
    s.add("c", [1, 2, 3, 4, 7], {"max_tokens": 1})
    step = s.next_step()
    assert [(r[0], r[2]) for r in step["rows"]] == [("b", 0), ("c", 4)] and step["prompt_logprobs"] == ["b"]
    assert s.stats()["prefix_cache_queries"] == 10 and s.stats()["prefix_cache_hits"] == 4


def test_block_pool_counts_references_and_evicts_least_recently_freed():
    pool = paged.BlockPool(4)
    keys = paged.block_hashes(list(range(8)), 4, 2)
    assert keys == paged.block_hashes(list(range(8)), 4, 2) and keys[1] != paged.block_hashes([9, 1, 2, 3, 4, 5, 6, 7],
                                                                                               4, 2)[1]
    a = pool.take([], 2)
    pool.register(a[0], keys[0])
    pool.register(a[1], keys[1])
    b = pool.take(pool.lookup(keys), 1)                 # shares both blocks: 3 used, 1 free
    assert b[:2] == a and pool.ref[a[0]] == 2 and len(pool.free) == 1
    pool.release(a)
    assert pool.ref[a[0]] == 1 and len(pool.free) == 1
    pool.release(b)                                     # all free; the cached ones stay findable
    assert len(pool.free) == 4 and pool.lookup(keys) == a
    assert pool.available(a) == 2
    c = pool.take([], 2)             # the uncached blocks go first, then the prefix's tail before its head
    assert set(c) == set(range(4)) - set(a) and pool.lookup(keys) == a
    d = pool.take([], 1)
    assert d == [a[1]] and pool.lookup(keys) == [a[0]]


@pytest.mark.parametrize("kind,model", [
    ("gqa", {}),
    ("sliding_window", {"sliding_window": 5}),
    ("mla", {"heads": 4, "kv_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_nope_head_dim": 8,
             "qk_rope_head_dim": 4, "v_head_dim": 8}),
])
def test_chunked_prefill_splits_a_long_prompt_beside_decoding_and_keeps_tokens_and_logprobs(kind, model, tmp_path,
                                                                                            one_thread):
    """A budget of 4 prompt tokens per step: a 19-token prompt arriving while another
    sequence decodes is prefilled in chunks of at most 4, the other sequence getting a token
    at every one of those steps; greedy and seeded tokens, logprobs and the prompt's
    logprobs (echo) equal the whole-prompt engine's (no caching)."""
    cfg = serve_config(model=model, serve=dict(batch=3, prompt_len=20, max_new_tokens=8, seed=3))
    build_serve(cfg, tmp_path / "p")
    long = [(7 * i + 3) % 250 for i in range(19)]
    reqs = [([5, 17, 99], {"max_tokens": 8, "logprobs": 1}),
            (long, {"max_tokens": 4, "logprobs": 2, "prompt_logprobs": True}),
            (long[:9], {"max_tokens": 5, "logprobs": 1, "temperature": 1.0, "seed": 11})]
    whole_eng = Engine(tmp_path / "p", None, blocks=24, block_size=4, max_seqs=3, caching=False)
    whole = whole_eng.run(reqs, arrive=1)
    eng = Engine(tmp_path / "p", None, blocks=24, block_size=4, max_seqs=3, caching=True, max_prefill_tokens=4)
    chunked = eng.run(reqs, arrive=1)
    assert [r["tokens"] for r in chunked] == [r["tokens"] for r in whole], kind
    for a, b in zip(chunked, whole):
        assert [x for x, _ in a["lps"]] == pytest.approx([x for x, _ in b["lps"]], abs=1e-5)
    assert len(chunked[1]["prompt"]) == 18
    assert [x for x, _ in chunked[1]["prompt"]] == pytest.approx([x for x, _ in whole[1]["prompt"]], abs=1e-5)
    assert [[i for i, _ in t] for _, t in chunked[1]["prompt"]] == [[i for i, _ in t] for _, t in whole[1]["prompt"]]
    assert [n for rows in whole_eng.steps for rid, n, pre in rows if rid == "1" and pre] == [19]   # one step
    chunks = [n for rows in eng.steps for rid, n, pre in rows if rid == "1" and pre]
    assert sum(chunks) == 19 and max(chunks) <= 4 and len(chunks) == 5      # echo: no cached prefix
    assert all(sum(n for _, n, pre in rows if pre) <= 4 for rows in eng.steps)
    for rows in eng.steps:                      # request 0 decodes beside every chunk of request 1
        if any(rid == "1" and pre for rid, _, pre in rows):
            assert ("0", 1, False) in rows
    assert eng.sched.stats()["prefix_cache_hits"] == 8       # request 2 shares request 1's first 2 blocks


def test_serve_keys_reach_the_plan_and_bad_values_point_at_the_spec():
    import parcompile
    from parcompile.diagnostics import SpecError

    src = ('model m { layers = 2, hidden = 32, heads = 2, ffn_hidden = 64, vocab = 256, seq_len = 32 }\n'
           'cluster c from "cpu" { gpus_per_node = 1 }\n'
           'serve {\n    prompt_len = 8\n    max_new_tokens = 8\n    kv_cache_tokens = 64\nEXTRA}\n')
    d = parcompile.compile(src.replace("EXTRA", ""), filename="s.par").data["serve"]
    assert d["prefix_caching"] is True and "max_prefill_tokens" not in d        # vLLM v1's defaults
    d = parcompile.compile(src.replace("EXTRA", "    prefix_caching = false\n    max_prefill_tokens = 8\n"),
                           filename="s.par").data["serve"]
    assert d["prefix_caching"] is False and d["max_prefill_tokens"] == 8
    assert "compile" not in d                                                   # off by default
    d = parcompile.compile(src.replace("EXTRA", "    compile = true\n"), filename="s.par").data["serve"]
    assert d["compile"] is True
    assert (d["waiting_served_ratio"], d["max_waiting_steps"]) == (0.3, 20)      # text-generation-inference's
    d = parcompile.compile(src.replace("EXTRA", "    max_waiting_steps = 0\n"), filename="s.par").data["serve"]
    assert "waiting_served_ratio" not in d and "max_waiting_steps" not in d         # at once: vLLM's
    for bad in ("    prefix_caching = 3\n", "    max_prefill_tokens = 0\n", "    compile = 1\n",
                "    waiting_served_ratio = -1\n", "    max_waiting_steps = 1.5\n"):
        with pytest.raises(SpecError) as e:
            parcompile.compile(src.replace("EXTRA", bad), filename="s.par")
        assert e.value.diagnostics[0].span.line == 7, bad


def test_a_sequences_token_slices_equal_slices_of_prompt_and_out():
    """Sequence.tokens(a, b) (what the scheduler lays out each step, without building
    prompt + out) is (prompt + out)[a:b] for every a <= b, across the prompt/out border."""
    seq = paged.Sequence("r", [1, 2, 3, 4], {"max_tokens": 9}, out=[5, 6, 7])
    whole = seq.prompt + seq.out
    for a in range(len(whole) + 1):
        for b in range(a, len(whole) + 1):
            assert seq.tokens(a, b) == whole[a:b], (a, b)
    assert paged.Sequence("e", [1, 2], {"max_tokens": 1}).tokens(1, 2) == [2]


def test_scheduler_takes_blocks_as_tokens_need_them_and_preempts_the_latest_admitted():
    """Three requests whose contexts (8, 7 and 6 tokens: 4 + 4 + 3 blocks of 2) exceed a
    4-block cache are admitted at once (their prompts' 2 + 1 + 1 blocks); when b's next
    token crosses a block boundary with no block free, c (admitted last) is preempted and
    queued first; later a preempts b, and b c again. A resumed request's row is its prompt and the tokens
    it generated, from position 0; it is never announced as new again (the ranks keep its
    generator) and is freed once, when it finishes."""
    s = paged.Scheduler(blocks=4, block_size=2, max_seqs=3, prefix_caching=False)
    prompts = {"a": [1, 2, 3], "b": [4, 5], "c": [6]}
    for rid, p in prompts.items():
        s.add(rid, p, {"max_tokens": 5})
    step = s.next_step()
    assert [(r[0], r[2], len(r[3])) for r in step["rows"]] == [("a", 0, 2), ("b", 0, 1), ("c", 0, 1)]
    assert list(step["new"]) == ["a", "b", "c"] and s.stats()["blocks_free"] == 0
    made = {rid: [] for rid in prompts}
    news, freed, resumed = list(step["new"]), [], []
    tok = iter(range(100, 200))
    while step["rows"]:
        rows = [paged.Row(*r) for r in step["rows"]]
        for rid, t, reason, _ in s.collect(rows, [next(tok) for _ in rows]):
            made[rid].append(t)
        before = s.preemptions
        running = list(s.running)
        step = s.next_step()
        if s.preemptions > before:        # the victims are the latest admitted, queued first in order
            victims = running[len(running) - (s.preemptions - before):]
            assert [q.rid for q in list(s.waiting)[:len(victims)]] == victims
            assert step["new"] == {}      # no admission in a step that preempted
        for rid, toks, context, table in step["rows"]:
            if context == 0 and made[rid]:
                assert toks == prompts[rid] + made[rid]          # recomputes what it had
                resumed.append(rid)
        news += step["new"]
        freed += step["free"]
    # step 1: b's 3rd token crosses into a 2nd block: c preempted (1 token made); step 2: a's
    # 5th position needs a 3rd block: b preempted (2 made); a finishes alone; b (2 blocks) and
    # c (1) resume together; b's 5th position needs a 3rd block: c preempted again (2 made)
    assert s.stats()["preemptions"] == 3 and resumed == ["b", "c", "c"]
    assert s.stats()["recomputed_tokens"] == (2 + 2) + (1 + 1) + (1 + 2)
    assert [len(m) for m in made.values()] == [5, 5, 5] and sorted(news) == sorted(freed) == ["a", "b", "c"]
    assert s.stats()["blocks_free"] == 4 and not any(s.pool.ref)


def test_abort_of_a_preempted_request_frees_its_generator_and_the_watermark_holds_back_admission():
    s = paged.Scheduler(blocks=10, block_size=1, max_seqs=4, prefix_caching=False, watermark=0.2)
    s.add("a", [1] * 6, {"max_tokens": 4})            # alone: admitted without the watermark's 2 blocks
    s.add("b", [2] * 3, {"max_tokens": 1})            # 3 blocks of the 4 free, leaving 1 < 2: waits
    step = s.next_step()
    assert [r[0] for r in step["rows"]] == ["a"] and s.stats()["waiting"] == 1
    s.abort("b")
    assert s.stats()["waiting"] == 0 and s.next_step()["free"] == []      # never admitted: nothing to free
    s.add("c", [3], {"max_tokens": 3})
    s.running["a"].out = [9]                                              # as if a decoded
    s._preempt(s.running["a"])
    s.abort("a")
    assert s.next_step()["free"] == ["a"] and s.stats()["blocks_free"] == 9     # c holds one


def test_waiting_requests_are_held_until_enough_wait_or_the_steps_pass():
    """serve.waiting_served_ratio / max_waiting_steps (text-generation-inference's router):
    with nothing running a request is admitted at once; beside running sequences a new one
    waits until ratio x running wait (then all join one step) or it was held the steps; a
    step computing a prompt chunk anyway takes it at once; 0 steps admits every step."""
    def step(sched):             # one engine step: its rows' rids (each row's token: 5)
        plan = sched.next_step()
        rows = [paged.Row(*r) for r in plan["rows"]]
        sched.collect(rows, [5] * len(rows))
        return [r.rid for r in rows], set(plan["new"])

    s = paged.Scheduler(blocks=64, block_size=4, max_seqs=8, prefix_caching=False, waiting_served_ratio=0.5,
                        max_waiting_steps=3)
    for rid in "abcd":
        s.add(rid, [1, 2, 3], {"max_tokens": 20})
    assert step(s)[0] == list("abcd")                           # nothing ran: at once
    s.add("e", [4, 5], {"max_tokens": 20})
    assert step(s)[0] == list("abcd") and s.held_steps == 1     # 1 waits < 0.5 x 4 running
    s.add("f", [6, 7], {"max_tokens": 20})
    assert step(s) == (list("abcdef"), {"e", "f"}) and s.held_steps == 0   # 2 wait >= 0.5 x 4: one step
    s.add("g", [8], {"max_tokens": 20})
    for held in (1, 2, 3):
        assert "g" not in step(s)[0] and s.held_steps == held
    assert step(s)[0][-1] == "g"                                # held max_waiting_steps: admitted

    full = paged.Scheduler(blocks=64, block_size=4, max_seqs=2, prefix_caching=False, waiting_served_ratio=10.0,
                           max_waiting_steps=2)
    full.add("a", [1], {"max_tokens": 20})
    full.add("b", [2], {"max_tokens": 5})
    step(full)
    full.add("c", [3], {"max_tokens": 20})
    for _ in range(4):                                          # b's tokens 2 to 5: no seat for c
        assert step(full)[0] == ["a", "b"]
    assert step(full)[0] == ["a", "c"] and full.held_steps == 0  # waited out the full batch: joins at once

    chunked = paged.Scheduler(blocks=64, block_size=4, max_seqs=8, prefix_caching=False, max_prefill_tokens=8,
                              waiting_served_ratio=10.0, max_waiting_steps=50)
    chunked.add("a", [1] * 3, {"max_tokens": 20})
    chunked.add("long", list(range(12)), {"max_tokens": 20})
    assert step(chunked)[0] == ["a", "long"]                    # a whole, 5 of long's 12 (the budget: 8)
    chunked.add("b", [2, 2], {"max_tokens": 20})
    assert step(chunked)[0] == ["a", "long", "b"]               # long's last 7: b's prompt joins at once
    chunked.add("c", [3], {"max_tokens": 20})
    assert step(chunked)[0] == ["a", "long", "b", "c"]          # b's last token (its chunk of 1 was the budget's)
    chunked.add("d", [4], {"max_tokens": 20})
    assert step(chunked)[0] == ["a", "long", "b", "c"]          # decode rows only: d is held

    now = paged.Scheduler(blocks=64, block_size=4, max_seqs=8, prefix_caching=False)      # 0 steps: every step
    now.add("a", [1], {"max_tokens": 20})
    step(now)
    now.add("b", [2], {"max_tokens": 20})
    assert step(now)[0] == ["a", "b"]


def _preempting_requests():
    """Four requests (two sharing a prefix of a block), greedy and seeded, with logprobs and
    one with its prompt's (echo): their contexts need 19 blocks of 4 tokens, their prompts 9."""
    shared = [5, 17, 99, 3]
    return [(shared + [250, 42, 7], {"max_tokens": 10, "logprobs": 2}),
            ([11, 12, 13, 14, 15, 16, 17, 18, 19], {"max_tokens": 10, "logprobs": 1, "prompt_logprobs": True}),
            (shared + [8, 1], {"max_tokens": 10, "logprobs": 1}),
            ([60, 61, 62, 63, 64, 65, 66, 67], {"max_tokens": 10, "logprobs": 3, "temperature": 1.0, "seed": 5})]


@pytest.mark.parametrize("chunk", [None, 4])
def test_a_cache_too_small_preempts_and_every_request_continues_exactly(chunk, tmp_path, one_thread):
    """A cache of 10 blocks (4 tokens each) for four requests whose contexts need 19: all
    four are admitted at once (their prompts need 9), preemption (recompute) happens when
    decoding runs out of blocks, and every request's greedy tokens, seeded samples, logprobs
    and prompt logprobs equal those of a cache holding them all (40 blocks); the seeded
    request, admitted last, is preempted after it sampled and continues its draws. Prefix
    caching is on; afterwards no block is referenced and every cached key names its block."""
    cfg = serve_config(serve=dict(batch=4, prompt_len=10, max_new_tokens=10, seed=3))
    build_serve(cfg, tmp_path / "p")
    reqs = _preempting_requests()
    big = Engine(tmp_path / "p", None, blocks=40, block_size=4, max_seqs=4, caching=True, max_prefill_tokens=chunk)
    want = big.run(reqs, arrive=4)
    assert big.sched.stats()["preemptions"] == 0
    eng = Engine(tmp_path / "p", None, blocks=10, block_size=4, max_seqs=4, caching=True, max_prefill_tokens=chunk)
    got = eng.run(reqs, arrive=4)
    assert [r["tokens"] for r in got] == [r["tokens"] for r in want]
    for a, b in zip(got, want):
        assert [x for x, _ in a["lps"]] == pytest.approx([x for x, _ in b["lps"]], abs=1e-5)
        assert [[i for i, _ in t] for _, t in a["lps"]] == [[i for i, _ in t] for _, t in b["lps"]]
    assert [x for x, _ in got[1]["prompt"]] == pytest.approx([x for x, _ in want[1]["prompt"]], abs=1e-5)
    assert len(got[1]["prompt"]) == 8 and len(set(got[3]["tokens"])) > 1
    st = eng.sched.stats()
    assert st["preemptions"] > 0 and st["recomputed_tokens"] > 0
    assert max(len(rows) for rows in eng.steps) == 4              # all four ran at once
    assert len(eng.preempted) == st["preemptions"]
    assert any(rid == "3" and made > 0 for rid, made in eng.preempted), eng.preempted    # mid-decode
    pool = eng.sched.pool
    assert not any(pool.ref) and len(pool.free) == 10
    assert all(pool.key_of[b] == k for k, b in pool.cached.items()) and len(pool.key_of) == len(pool.cached)


def test_paged_step_packs_the_tokens_and_lays_out_each_group_by_the_block_tables():
    """The step's layout, held against the rule written per position (module docstring of
    runtime/serve/paged.py): the tokens packed (1, N), the one-token rows first, then the longer
    ones, each in row order; token p of a row sits in slot ``table[p // bs] * bs + p % bs``;
    within a group rows are left-padded to the group's longest (the decode rows: not at
    all); a real query sees its context and the new keys up to itself (within a window), a
    padding query itself only; ``last`` and ``padded`` give the rows back in row order."""
    bs = 4
    rows = [paged.Row("a", [5], 9, [7, 2, 11]), paged.Row("b", [1, 2, 3, 4, 5, 6], 0, [3, 0]),
            paged.Row("c", [8, 9], 3, [6, 9]), paged.Row("d", [4], 0, [1])]
    ids, step = paged.paged_step(rows, bs, (0, 3), "cpu")
    order = [0, 3, 1, 2]                                            # decode rows, then the longer ones
    assert ids.tolist() == [sum((rows[b].tokens for b in order), [])]
    assert step.positions.tolist() == [sum((list(range(rows[b].context, rows[b].context + len(rows[b].tokens)))
                                            for b in order), [])]
    pk = step.packing
    assert pk.last.tolist() == [0, 7, 9, 1] and pk.lengths == [1, 6, 2, 1] and pk.offsets == [0, 2, 8, 1]
    slot = lambda r, p: r.table[p // bs] * bs + p % bs        # noqa: E731
    dec, pre = pk.groups
    assert (dec.start, dec.count, dec.shape, dec.to_padded, dec.to_packed) == (0, 2, (2, 1), None, None)
    assert (pre.start, pre.count, pre.shape) == (2, 8, (2, 6))
    x = torch.arange(10)[None]
    assert pre.unpack(x).tolist() == [[2, 3, 4, 5, 6, 7], [8, 8, 8, 8, 8, 9]]     # c left-padded by its first token
    assert pre.pack(pre.unpack(x)).tolist() == list(range(2, 10)) and dec.unpack(x).tolist() == [[0], [1]]
    assert step.padded(x).tolist() == [[0] * 6, [2, 3, 4, 5, 6, 7], [8] * 5 + [9], [1] * 6]
    assert step.last(x[..., None])[:, 0, 0].tolist() == [0, 7, 9, 1]

    def check(g, grows):
        (G, T), C = g.shape, max(r.context for r in grows)
        # int64 and contiguous, as the compiled step's guards were traced with (a strided
        # index would be another graph: a recompile)
        assert {g.write.dtype, g.read.dtype} == {torch.int64} and g.read.is_contiguous() and g.write.is_contiguous()
        assert g.write.tolist() == [slot(r, r.context + i) for r in grows for i in range(len(r.tokens))]
        read = g.read.view(G, C)
        for b, r in enumerate(grows):
            assert read[b, :r.context].tolist() == [slot(r, p) for p in range(r.context)]
            pad = T - len(r.tokens)
            for w in (0, 3):
                m = g.masks[w][b, 0]
                assert m.shape == (T, C + T)
                for q in range(T):
                    qp = r.context + q - pad
                    for k in range(C + T):
                        if q < pad:
                            want = k == C + q
                        elif k < C:
                            want = k < r.context and (not w or qp - k < w)
                        else:
                            kp = r.context + k - C - pad
                            want = k - C >= pad and k - C <= q and (not w or qp - kp < w)
                        assert bool(m[q, k]) == want, (g.start, b, w, q, k)

    check(dec, [rows[0], rows[3]])
    check(pre, [rows[1], rows[2]])
    # a step of decode rows only (most steps under load) is laid out by its own shorter path:
    # the same rule, rows in their own order (a context of 0, a table shorter than the longest)
    drows = [rows[0], paged.Row("e", [3], 6, [4, 8]), rows[3]]
    ids, step = paged.paged_step(drows, bs, (0, 3), "cpu")
    assert ids.tolist() == [[5, 3, 4]] and step.positions.tolist() == [[9, 6, 0]]
    pk = step.packing
    assert pk.last.tolist() == [0, 1, 2] and pk.lengths == [1, 1, 1] and pk.offsets == [0, 1, 2]
    (g,) = pk.groups
    assert (g.start, g.count, g.shape, g.to_padded, g.to_packed) == (0, 3, (3, 1), None, None)
    assert {ids.dtype, step.positions.dtype, pk.last.dtype} == {torch.int64}
    check(g, drows)
    # a context of one token in every row (two one-token prompts' second step): C = 1
    drows = [paged.Row("f", [2], 1, [5]), paged.Row("g", [6], 1, [9])]
    ids, step = paged.paged_step(drows, bs, (0, 3), "cpu")
    check(step.packing.groups[0], drows)


@pytest.mark.parametrize("kind,model", [
    ("gqa", {}),
    ("mla", {"heads": 4, "kv_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_nope_head_dim": 8,
             "qk_rope_head_dim": 4, "v_head_dim": 8}),
])
def test_a_mixed_step_runs_its_real_tokens_only_and_equals_each_row_alone(kind, model, tmp_path, one_thread):
    """Three decode rows beside a 9-token chunk of a prompt (with a cached context): every
    linear layer sees the step's 12 real tokens (not 4 rows padded to 9: 36), and the
    step's last-token logits, and every position's (prompt logprobs), equal each row run
    alone (one row per step, nothing to pad) on the same cache contents."""
    cfg = serve_config(model=model, serve=dict(batch=4, prompt_len=20, max_new_tokens=4, seed=3))
    build_serve(cfg, tmp_path / "p")
    eng = Engine(tmp_path / "p", None, blocks=24, block_size=4, max_seqs=4, caching=False)
    prompts = [[5, 17, 99], [7, 7, 120, 3, 9, 11], [9, 30], [(7 * i + 3) % 250 for i in range(14)]]
    tables = [[0, 1], [2, 3], [4], [5, 6, 7, 8]]

    def forward(rows, all_positions=False):
        ids, step = paged.paged_step(rows, 4, eng.windows, "cpu")
        step.all_positions = all_positions
        eng.cache.bind(step.packing.groups)
        with torch.no_grad():
            return eng.model.forward(ids, step)

    # the prompts' first tokens into the cache, one row per step (the last prompt: its first 5)
    for p, t in zip(prompts[:3], tables[:3]):
        forward([paged.Row("x", p, 0, t)])
    forward([paged.Row("x", prompts[3][:5], 0, tables[3])])
    mixed = [paged.Row(str(i), [40 + i], len(p), t) for i, (p, t) in enumerate(zip(prompts[:3], tables[:3]))]
    mixed.append(paged.Row("3", prompts[3][5:], 5, tables[3]))
    seen = []
    linears = [m for m in eng.model.modules() if hasattr(m, "weight") and getattr(m.weight, "dim", lambda: 0)() == 2
               and m is not getattr(eng.model, "embedding", None)]
    hooks = [m.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[:-1].numel())) for m in linears]
    try:
        got = forward(mixed)
        got_all = forward(mixed, all_positions=True)
    finally:
        for h in hooks:
            h.remove()
    assert seen and set(seen) <= {12, 4}, set(seen)        # 12 tokens through the layers, 4 through the head
    assert got.shape[0] == 4 and got_all.shape[:2] == (4, 9)
    for b, r in enumerate(mixed):                           # the same writes again, alone: the same cache
        alone = forward([r])
        alone_all = forward([r], all_positions=True) if len(r.tokens) > 1 else alone[:, None]
        torch.testing.assert_close(got[b], alone[0], atol=1e-5, rtol=1e-5)
        n = len(r.tokens)
        torch.testing.assert_close(got_all[b, 9 - n:], alone_all[0], atol=1e-5, rtol=1e-5)
    assert got.argmax(-1).tolist() == [forward([r]).argmax(-1).item() for r in mixed]


def test_sample_rows_draws_greedy_rows_together_as_each_row_alone():
    """Greedy rows (temperature 0, NaN, below float32's tiny) take one batched argmax: each
    equals pick_tokens on its row alone (first on ties, padded columns never win), a row
    with non-finite logits gets ERROR_TOKEN, and sampled rows between them draw from their
    own generators as before."""
    torch.manual_seed(0)
    logits = torch.randn(6, 10)
    logits[1, 3] = logits[1, 5] = logits[1].max() + 1            # a tie: the first wins
    logits[2, 9] = 1e9                                          # a padded column (vocab 8)
    logits[4, 0] = float("nan")
    temps = [0.0, 0.0, float("nan"), 0.8, 0.0, 1e-300]
    params = [{"temperature": t, "top_k": 0, "top_p": 1.0} for t in temps]
    got = paged.sample_rows(logits, 8, params, [torch.Generator().manual_seed(b) for b in range(6)]).tolist()
    want = []
    for b, p in enumerate(params):
        try:
            want.append(int(gen.pick_tokens(logits[b:b + 1], 8, p["temperature"], 0, torch.Generator().manual_seed(b))))
        except gen.NonFiniteLogits:
            want.append(paged.ERROR_TOKEN)
    assert got == want and got[1] == 3 and got[4] == paged.ERROR_TOKEN and got[2] != 9
    every = [{"temperature": 0.0, "top_k": 0, "top_p": 1.0}] * 5        # all greedy: the batched path alone
    bad = torch.randn(5, 8)
    bad[1, 2], bad[2, 7], bad[3, 0] = float("inf"), float("-inf"), float("nan")
    bad[4] = 3e38                                                   # huge but finite: no overflow to an error
    got = paged.sample_rows(bad, 8, every, [None] * 5).tolist()
    assert got[1:4] == [paged.ERROR_TOKEN] * 3 and got[0] == int(bad[0].argmax()) and got[4] == 0
    # serve.compile's copy (compile_engine gives it to the model): the same tokens, the tie
    # and the padded column included
    compiled = torch.compile(paged.greedy_tokens, dynamic=True)
    assert paged.sample_rows(bad, 8, every, [None] * 5, compiled).tolist() == got
    assert compiled(logits[[0, 1, 2]], 8).tolist() == want[:2] + [paged.greedy_tokens(logits[2:3], 8).item()]
    assert paged.sample_rows(logits, 8, params, [torch.Generator().manual_seed(b) for b in range(6)],
                             compiled).tolist() == want
    # every row's greedy token computed with the logits (compile_engine's forward_and_greedy,
    # a tp-1 last stage): the greedy rows take theirs from it, the others are drawn as before
    def unused(*_):
        raise AssertionError("greedy_fn called although greedy_all was given")

    every_row = paged.greedy_tokens(logits, 8)
    assert paged.sample_rows(logits, 8, params, [torch.Generator().manual_seed(b) for b in range(6)], unused,
                             greedy_all=every_row).tolist() == want
    assert paged.sample_rows(bad, 8, every, [None] * 5, unused, greedy_all=paged.greedy_tokens(bad, 8)).tolist() == got


def _plan_rank(rank: int, port: int, msgs: list, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        got = [paged.broadcast_plan(m if rank == 0 else None, 0, dist.group.WORLD, rank == 0) for m in msgs]
        Path(f"{out}.{rank}").write_text(json.dumps([got, repr(got)]))
    finally:
        dist.destroy_process_group()


def test_broadcast_plan_carries_a_small_and_a_large_step_plan(tmp_path):
    """The leader's step plan reaches the other ranks equal, in one buffer of STEP_PLAN_BYTES
    and, for a plan beyond it (a long prompt's chunk), in a second broadcast for the rest; a
    plan with a tuple or an int key reaches every rank, the leader too, as its JSON decodes."""
    import socket

    import torch.multiprocessing as mp

    from parcompile.core.model import STEP_PLAN_BYTES

    small = {"stop": False, "free": ["a"], "new": {}, "rows": [["b", [7], 12, [3, 4]]], "prompt_logprobs": [],
             "partial": {}}
    large = {**small, "rows": [["c", list(range(STEP_PLAN_BYTES)), 0, list(range(300))]]}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # not JSON's own types: a tuple and an int key, which JSON turns into a list and a string
    odd = {**small, "rows": [("d", (5, 6), 2, (9,))], "partial": {7: 1}}
    odd_sent = {**small, "rows": [["d", [5, 6], 2, [9]]], "partial": {"7": 1}}
    mp.start_processes(_plan_rank, args=(port, [small, large, odd, small], str(tmp_path / "got")), nprocs=2,
                       start_method="spawn")
    got = [json.loads((tmp_path / f"got.{rank}").read_text()) for rank in (0, 1)]
    for plans, _ in got:
        assert plans == [small, large, odd_sent, small]
    assert got[0][1] == got[1][1]        # the leader runs the very plan the others decode (types too)


def test_compile_with_tp_or_pp_is_refused_at_the_spec():
    import parcompile
    from parcompile.diagnostics import SpecError

    src = ('model m { layers = 2, hidden = 32, heads = 2, ffn_hidden = 64, vocab = 256, seq_len = 32 }\n'
           'cluster c from "cpu" { gpus_per_node = 2 }\nparallel { tp = 2 }\n'
           'serve {\n    prompt_len = 8\n    max_new_tokens = 8\n    compile = true\n}\n')
    with pytest.raises(SpecError) as e:
        parcompile.compile(src, filename="s.par")
    d = e.value.diagnostics[0]
    assert "compile" in d.message and d.span.line == 7


def test_the_fused_greedy_graph_needs_the_program_module_importable(tmp_path):
    """compile_engine compiles the forward with the greedy tokens as one graph only when the
    forward's module is the one ``sys.modules`` holds under its name (dynamo imports it to
    inline the forward): a module loaded from a file and not registered keeps the two calls."""
    assert paged._importable(paged.greedy_tokens) and paged._importable(paged.PagedKVCache.bind)
    (tmp_path / "prog_x.py").write_text("class M:\n    def forward(self, x):\n        return x\n")
    spec = importlib.util.spec_from_file_location("prog_x_unregistered", tmp_path / "prog_x.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert not paged._importable(mod.M().forward)
    sys.modules[spec.name] = mod
    try:
        assert paged._importable(mod.M().forward)
        sys.modules[spec.name] = importlib.util.module_from_spec(spec)     # another module of that name
        assert not paged._importable(mod.M().forward)
    finally:
        del sys.modules[spec.name]


@pytest.mark.slow   # torch.compile of the engine: tens of seconds
def test_compiled_engine_equals_the_eager_engine(tmp_path, one_thread):
    """serve.compile: the engine after :func:`paged.compile_engine` (torch.compile, warmed up
    on a few layouts) gives the eager engine's greedy tokens and logprobs (1e-4) for the same
    requests, steps mixing decode rows with new prompts and a chunked prompt (blocks of 4,
    at most 5 prompt tokens a step) included; the warm-up's scratch writes leave every block
    free and the prefix cache empty; the generated code writes the cache in place, a mixed
    step's too (no whole-cache copy: :meth:`paged.PagedKVCache.write_step`)."""
    build_serve(serve_config(model=dict(layers=2), serve=dict(batch=4, prompt_len=12, max_new_tokens=6)), tmp_path / "p")
    prompts = [[5, 17, 99, 3, 250, 42], [7, 7, 120], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12], [200, 1]]
    reqs = [(p, {"max_tokens": 5, "logprobs": 2}) for p in prompts]
    eager = Engine(tmp_path / "p", None, blocks=24, block_size=4, max_seqs=4, caching=True, max_prefill_tokens=5)
    want = eager.run(reqs, arrive=2)
    eng = Engine(tmp_path / "p", None, blocks=24, block_size=4, max_seqs=4, caching=True, max_prefill_tokens=5)
    layouts = ((((1, 5), (1, 9), (1, 3)), False), (((1, 5), (1, 9), (1, 3), (6, 0), (3, 0)), False),
               (((6, 0), (3, 0)), False))
    from torch._inductor.utils import run_and_get_code

    _, code = run_and_get_code(paged.compile_engine, eng.model, eng.ctx, eng.cache, eng.mod.VOCAB, eng.mod.HIDDEN,
                               eng.mod.DTYPE, eng.windows, layouts=layouts)
    assert eng.sched.stats()["blocks_free"] == 24 and not eng.sched.pool.cached       # warm-up: no state
    # the step's cache writes stay in place: no kernel copies a cache back (aten.copy_ in a
    # fused kernel's name, as inductor wrote when each group of a mixed step wrote its own)
    assert code and not [line for c in code for line in c.splitlines() if re.search(r"(?<!index)_copy__", line)]
    # tp 1: the greedy tokens come from the forward's graph, and no second greedy graph is made
    assert hasattr(eng.model, "forward_and_greedy") and not hasattr(eng.model, "greedy_tokens")
    got = eng.run(reqs, arrive=2)
    assert any(sum(pre for _, _, pre in rows) and sum(not pre for _, _, pre in rows) for rows in eng.steps)   # mixed
    assert eng.steps == eager.steps
    for g, w in zip(got, want):
        assert g["tokens"] == w["tokens"]
        assert [x for x, _ in g["lps"]] == pytest.approx([x for x, _ in w["lps"]], abs=1e-4)
        assert [[i for i, _ in t] for _, t in g["lps"]] == [[i for i, _ in t] for _, t in w["lps"]]


def test_stream_buffer_sends_the_first_and_last_token_at_once_and_the_others_in_groups():
    """serve.stream_interval (SGLang's, vLLM's --stream-interval): the leader sends a request's
    first token at once, then groups of ``interval`` tokens, and its last token (finished,
    stopped or failed) at once with the held ones; every token once, in order; a cancelled
    request's held tokens are dropped; 1 passes every step's outputs through."""
    buf = paged.StreamBuffer(3)
    steps = [[("a", 1, None, None)],
             [("a", 2, None, None), ("b", 10, None, None)],
             [("a", 3, None, None), ("b", 11, None, None)],
             [("a", 4, None, None), ("b", 12, None, None), ("c", 20, "length", None)],
             [("a", 5, None, None), ("b", 13, None, None)],
             [("a", 6, "stop", {"lp": -1.0}), ("b", 14, None, None)]]
    sent = [buf.push(s) for s in steps]
    assert [[(r, t) for r, t, _, _ in out] for out in sent] == [
        [("a", 1)], [("b", 10)], [], [("a", 2), ("a", 3), ("a", 4), ("c", 20)], [("b", 11), ("b", 12), ("b", 13)],
        [("a", 5), ("a", 6)]]
    assert sent[-1][-1] == ("a", 6, "stop", {"lp": -1.0})
    assert buf.held == {"b": [("b", 14, None, None)]}
    buf.drop("b")
    assert buf.held == {}
    one = paged.StreamBuffer(1)
    assert all(one.push(s) is s for s in steps) and one.held == {}
    with pytest.raises(ValueError, match="at least 1"):
        paged.StreamBuffer(0)


def test_the_leader_sends_due_tokens_only_and_an_abort_forgets_held_ones():
    """_leader_collect with a Scheduler of stream_interval 4: a step whose tokens are all held
    sends no message; the sent tokens are each request's, in order, first and last at once;
    aborting a request (the front's "abort") drops its held tokens."""
    class Conn:
        def __init__(self):
            self.sent = []

        def send(self, msg):
            self.sent.append(msg)

    sched = paged.Scheduler(16, 4, 2, stream_interval=4)
    params = {"max_tokens": 6, "eos": []}
    sched.add("x", [1, 2, 3], params)
    sched.add("y", [4, 5], dict(params, max_tokens=50))
    conn, got = Conn(), {"x": [], "y": []}
    for step in range(7):
        rows = [paged.Row(*r) for r in sched.next_step()["rows"]]
        paged._leader_collect(conn, sched, rows, [100 + step] * len(rows))
    for msg in conn.sent:
        assert msg[0] == "out" and msg[1]
        for rid, tok, reason, _ in msg[1]:
            got[rid].append((tok, reason))
    assert [len(m[1]) for m in conn.sent] == [2, 8, 1]        # the firsts; x 2-5 and y 2-5; x's last
    assert got["x"] == [(100 + i, "length" if i == 5 else None) for i in range(6)]
    assert got["y"] == [(100 + i, None) for i in range(5)] and sched.stream.held["y"] == [("y", 105, None, None), ("y", 106, None, None)]
    sched.abort("y")
    assert "y" not in sched.stream.held and not sched.running
