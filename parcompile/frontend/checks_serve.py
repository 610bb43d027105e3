"""The serve checks of a spec (SPEC 1 `serve`): what the serve program and the serving
estimate take (:func:`check_serve`) and the workload's keys (:func:`check_workload`). Run by
:func:`parcompile.frontend.checks.check_config` (its :data:`~parcompile.frontend.checks.CHECKS`).
"""

from __future__ import annotations

from parcompile.config.presets import fp8_storage, fp8_storage_presets
from parcompile.config.schema import SpecConfig
from parcompile.config.text import or_list
from parcompile.frontend.check_context import CheckContext


def check_serve(cfg: SpecConfig, ctx: CheckContext) -> None:
    """A serve spec's keys: an FP8 cache on a part that holds FP8, what the serve program does
    not split (cp, virtual stages, compile with tp or pp, experts over ep beside tp), the
    workload (:func:`check_workload`), a request within the context and the cache."""
    s, m, p = cfg.serve, cfg.model, cfg.parallel
    if s is None:
        return
    check_weight_dtype(cfg, ctx)
    if s.kv_dtype == "fp8" and ctx.ok("serve.kv_dtype") and not fp8_storage(cfg.cluster.preset):
        ctx.bag.error(f"kv_dtype = fp8 needs FP8 tensors: cluster preset `{cfg.cluster.preset}` has no FP8 type",
                      ctx.span("serve.kv_dtype"),
                      help=f"use a cluster `from` {or_list(fp8_storage_presets(), quote=True)}, or set kv_dtype = "
                           f"bf16 or fp16 (or remove it: the model's dtype)",
                      note="an FP8 KV cache is storage, cast to 16 bits for attention: it needs no FP8 GEMM "
                           "(vLLM keeps one on Ampere), only a device with an FP8 type (config/presets.py)")
    if cfg.workload == "serve":
        # what the serve program (prefill + token-by-token decode) does not split
        if ctx.ok("parallel.cp") and p.cp > 1:
            ctx.bag.error(f"serving with cp = {p.cp} is not supported", ctx.span("parallel.cp"),
                          help="split long prompts' KV cache with tp (by kv head) or pp (by layer); set cp = 1")
        if ctx.ok("parallel.virtual_stages") and p.virtual_stages > 1:
            ctx.bag.error(f"serving with virtual_stages = {p.virtual_stages} is not supported",
                          ctx.span("parallel.virtual_stages"),
                          help="a token passes each pipeline stage once; set virtual_stages = 1")
        if s.compile and ctx.ok("serve.compile", "parallel.tp", "parallel.pp") and p.tp * p.pp > 1:
            ctx.bag.error(f"serve compile = true with tp = {p.tp}, pp = {p.pp} is not supported",
                          ctx.span("serve.compile"),
                          help="compile a replica of one rank (tp = 1, pp = 1; dp may be larger), "
                               "or set compile = false",
                          note="the engine's torch.compile warm-up is not yet checked to trace the tp/pp "
                               "collectives alike on every rank of a replica")
        # the serve program's experts: tensor parallel (vLLM's default: every expert on every
        # rank, split over tp; passes/shard_experts.py: _tensor_parallel), or split over ep inside the tp
        # group (training's dispatch at decode size: ep x expert_tp = tp; the dp replicas
        # serve independent requests, so no expert group crosses them)
        if m.experts > 0 and ctx.ok("parallel.ep", "parallel.tp", "parallel.expert_tp") and p.ep > 1:
            if p.ep * p.expert_tp != p.tp:
                ctx.bag.error(f"serving with ep = {p.ep} x expert_tp = {p.expert_tp} != tp = {p.tp}",
                              ctx.span("parallel.ep"),
                              help=f"serving splits the experts inside the tp group: set ep x expert_tp = tp "
                                   f"(ep = {p.tp} and expert_tp = 1, or ep = 1)")
        elif m.experts > 0 and ctx.ok("parallel.expert_tp", "parallel.tp") and p.expert_tp != p.tp:
            ctx.bag.error(f"serving with expert_tp = {p.expert_tp} is not supported: the experts split over "
                          f"tp = {p.tp}", ctx.span("parallel.expert_tp"),
                          help="remove `expert_tp` (serving splits each expert's inner width over tp)")
    check_workload(cfg, ctx)
    if not ctx.ok("serve.prompt_len", "serve.max_new_tokens", "model.seq_len"):
        return
    total = s.prompt_len + s.max_new_tokens
    if total > m.seq_len:
        nearest = (f"max_new_tokens = {m.seq_len - s.prompt_len} for this prompt" if s.prompt_len < m.seq_len
                   else f"prompt_len = {m.seq_len - s.max_new_tokens}" if s.max_new_tokens < m.seq_len
                   else f"prompt_len + max_new_tokens <= {m.seq_len}")
        ctx.bag.error(f"prompt_len({s.prompt_len}) + max_new_tokens({s.max_new_tokens}) = {total} "
                      f"exceeds seq_len = {m.seq_len}", ctx.span("serve.max_new_tokens", "serve.prompt_len"),
                      help=f"nearest feasible: {nearest}; or raise the model's `seq_len` (at most its "
                           f"max_positions)")
    if s.kv_cache_tokens is not None and ctx.ok("serve.kv_cache_tokens", "serve.block_size"):
        need = -(-total // s.block_size) * s.block_size   # one longest request, in whole blocks
        if s.kv_cache_tokens < need:
            ctx.bag.error(f"kv_cache_tokens = {s.kv_cache_tokens} holds no request of prompt_len({s.prompt_len}) + "
                          f"max_new_tokens({s.max_new_tokens}) = {total} tokens in blocks of {s.block_size}",
                          ctx.span("serve.kv_cache_tokens"), help=f"set kv_cache_tokens >= {need}")


def check_weight_dtype(cfg: SpecConfig, ctx: CheckContext) -> None:
    """``weight_dtype``: FP8 weights on a part that holds FP8 (as an FP8 cache); MXFP4 for a
    mixture of experts only (the format quantizes the experts, gpt-oss's as published); a
    4-bit format without ``weights``, a warning (code ``no-weights``: `run` and `serve` refuse
    it, cli.STARTS_ONLY_WITHOUT), since only fp8 is made on load."""
    s, m = cfg.serve, cfg.model
    if not ctx.ok("serve.weight_dtype"):
        return
    if s.weight_dtype == "fp8" and not fp8_storage(cfg.cluster.preset):
        ctx.bag.error(f"weight_dtype = fp8 needs FP8 tensors: cluster preset `{cfg.cluster.preset}` has no FP8 type",
                      ctx.span("serve.weight_dtype", "serve.weights"),
                      help=f"use a cluster `from` {or_list(fp8_storage_presets(), quote=True)}, or weight_dtype = "
                           "int4 (weight-only, dequantized to 16 bits) or model")
    if s.weight_dtype in ("mxfp4", "int4") and s.weights is None and cfg.workload == "serve":
        ctx.bag.warning(f"weight_dtype = {s.weight_dtype} needs a checkpoint quantized so, and the spec names no "
                        "`weights`: the serve program would draw random weights, and it makes only fp8 on load",
                        ctx.span("serve.weight_dtype"), code="no-weights",   # `run` and `serve`: an error
                        help="set `weights` to the published " + ("MXFP4 (gpt-oss)" if s.weight_dtype == "mxfp4" else
                                                                  "AWQ or GPTQ (4-bit, group 128)")
                             + " checkpoint; `serve` and `run` need it (a plan may be sized before the download)")
    if s.weight_dtype == "mxfp4" and ctx.ok("model.experts") and not m.experts:
        ctx.bag.error("weight_dtype = mxfp4 quantizes a mixture of experts' experts (gpt-oss's format); this model "
                      "has none (experts = 0)", ctx.span("serve.weight_dtype", "serve.weights"),
                      help="use weight_dtype = fp8 or int4 for a dense model")


def check_workload(cfg: SpecConfig, ctx: CheckContext) -> None:
    """The serve workload's keys: closed loop or open loop, not both; the prefill pool's
    keys only with ``disaggregated = true``; a disaggregated prefill instance's tp splits
    the heads."""
    s, m = cfg.serve, cfg.model
    if s.burst and "batch" in s.auto:
        ctx.bag.error("request_rate = inf sends `batch` requests at once: batch = auto leaves the workload open",
                      ctx.span("serve.batch"), help="give batch = N, the requests of the burst")
    if ctx.given("serve.concurrency") and ctx.given("serve.request_rate"):
        ctx.bag.error("give `concurrency` (closed-loop clients) or `request_rate` (open-loop arrivals), not both",
                      ctx.span("serve.request_rate"),
                      help="remove one: `concurrency = N` keeps N requests in flight, each client sending its next "
                           "when its last ends; `request_rate = R` sends R requests per second whatever is in "
                           "flight (`inf`: all at once)")
    if not s.disaggregated and "disaggregated" not in s.auto:
        for key in ("prefill_replicas", "prefill_tp"):
            if ctx.given(f"serve.{key}"):
                ctx.bag.warning(f"{key} has no effect without `disaggregated = true`", ctx.span(f"serve.{key}"),
                                help="set `disaggregated = true` (prefill on its own GPU pool) or remove it")
    elif s.prefill_tp is not None and ctx.ok("serve.prefill_tp") and m.heads % s.prefill_tp:
        ctx.bag.error(f"prefill_tp = {s.prefill_tp} does not divide heads = {m.heads}", ctx.span("serve.prefill_tp"),
                      help="prefill_tp may be " + or_list([str(t) for t in range(1, m.heads + 1)
                                                             if m.heads % t == 0 and t <= 64]))
