"""The server's default KV cache is what the running batch can use (issue 47): a `serve`
spec without ``kv_cache_tokens`` on the `cpu` preset had sized the cache to all the free
memory (38,690,561 tokens for a 107k-parameter model; a 19 GB rank). The expected numbers
are computed here from the spec's keys, not read from the plan."""

from __future__ import annotations

import math

import parcompile
from tests.serve_utils import serve_config, tiny_serve_spec

from parcompile.driver import compile_config

SPEC = tiny_serve_spec(batch=4, prompt_len=16, max_new_tokens=40)


def _expected(batch_per_replica: int, prompt_len: int, max_new_tokens: int, block_size: int) -> int:
    return batch_per_replica * math.ceil((prompt_len + max_new_tokens) / block_size) * block_size


def test_the_default_cache_holds_the_running_batch_at_its_longest_in_whole_blocks():
    for dp, serve in ((1, dict(batch=2, prompt_len=6, max_new_tokens=6)),
                      (2, dict(batch=5, prompt_len=9, max_new_tokens=20, block_size=4)),
                      (1, dict(batch=3, prompt_len=16, max_new_tokens=16, block_size=16))):
        sv = compile_config(serve_config(dp=dp, serve=serve)).data["serve"]
        want = _expected(math.ceil(serve["batch"] / dp), serve["prompt_len"], serve["max_new_tokens"],
                         serve.get("block_size", 16))
        assert sv["kv_cache_tokens"] == want and sv["kv_blocks"] * sv["block_size"] == want, (serve, sv)
        assert sv["max_concurrent_tokens"] > 100 * want        # memory was not the bound
    # a spec's own kv_cache_tokens stays as given (whole blocks)
    sv = compile_config(serve_config(serve=dict(kv_cache_tokens=1000))).data["serve"]
    assert sv["kv_cache_tokens"] == 1000 // 16 * 16


def test_memory_still_bounds_the_default():
    src = tiny_serve_spec(batch=64, prompt_len=16, max_new_tokens=40)
    sv = parcompile.compile(src.replace("gpus_per_node = 1", "gpus_per_node = 1, memory = 4 MiB"),
                            filename="s.par").data["serve"]
    assert sv["kv_cache_tokens"] == sv["max_concurrent_tokens"] // 16 * 16 < _expected(64, 16, 40, 16)


def test_a_cache_over_half_the_hosts_memory_warns_at_the_key():
    plan = parcompile.compile(SPEC, filename="s.par")
    assert not [w for w in plan.warnings if w.code == "host-memory"]
    plan = parcompile.compile(tiny_serve_spec(batch=4, prompt_len=16, max_new_tokens=40, kv_cache_tokens=20000000),
                              filename="s.par")
    sv = plan.data["serve"]
    memory = plan.config.cluster.memory          # the fixed figures: 16 GiB a rank
    assert sv["kv_cache_tokens"] * sv["kv_bytes_per_token"] > memory / 2
    (w,) = [w for w in plan.warnings if w.code == "host-memory"]
    assert w.severity == "warning" and (w.span.line, w.span.column) == (10, 23)   # the value and w.span.file == "s.par"
    assert f"set kv_cache_tokens = {_expected(4, 16, 40, 16):,}" in w.help and "20,000,000 tokens" in w.message


def test_the_warnings_fix_is_the_default_rule_under_open_loop_arrivals():
    """With ``request_rate`` and no ``batch`` a step holds the engine's default number of
    sequences (vLLM's ``max_num_seqs``, analysis/serve.py OPEN_LOOP_SEQS), not the default
    batch of 1: the warning's suggested kv_cache_tokens is that default's cache, the value the
    plan takes without the key (was: batch_per_replica's, 64 tokens)."""
    from parcompile.analysis.serve import OPEN_LOOP_SEQS

    serve = dict(prompt_len=16, max_new_tokens=40, request_rate=5)
    default = parcompile.compile(tiny_serve_spec(**serve), filename="s.par").data["serve"]["kv_cache_tokens"]
    assert default == OPEN_LOOP_SEQS * _expected(1, 16, 40, 16)
    plan = parcompile.compile(tiny_serve_spec(**serve, kv_cache_tokens=20000000), filename="s.par")
    (w,) = [w for w in plan.warnings if w.code == "host-memory"]
    assert f"set kv_cache_tokens = {default:,} (what {OPEN_LOOP_SEQS} running sequences" in w.help, w.help


def test_an_open_loop_spec_decodes_the_running_limit_it_is_planned_for():
    """With ``request_rate`` and no ``batch`` the plan estimates (and sizes the default cache
    for) the engine's default running sequences, vLLM's ``max_num_seqs`` (OPEN_LOOP_SEQS on the
    `cpu` preset); the program's engine and the front decode ``serve.batch_per_replica`` at
    once, which was ``ceil(batch / dp)`` of the default batch, 1: a 256-sequence cache
    decoded one sequence at a time. Now it is the same limit, and the plan's KV memory row is
    that many sequences' cache."""
    from parcompile.analysis.serve import OPEN_LOOP_SEQS
    from parcompile.server import model_info

    serve = dict(prompt_len=16, max_new_tokens=40, request_rate=5)
    plan = parcompile.compile(tiny_serve_spec(**serve), filename="s.par")
    sv = plan.data["serve"]
    assert sv["batch_per_replica"] == OPEN_LOOP_SEQS == sv["running_limit"]    # decoded as estimated
    assert model_info(plan).max_seqs == OPEN_LOOP_SEQS                        # the front's limit (n, best_of)
    assert sv["kv_cache_bytes_per_rank"] == OPEN_LOOP_SEQS * (16 + 40) * sv["kv_bytes_per_token"]
    # a given batch stays the limit, open loop or not
    sv = parcompile.compile(tiny_serve_spec(batch=3, **serve), filename="s.par").data["serve"]
    assert sv["batch_per_replica"] == 3 and sv["kv_cache_tokens"] == _expected(3, 16, 40, 16)
